"""What activated BatchNorm accepts: the one place its inputs are checked.

The functional forms check everything here once per call; the modules check
their configuration when built and only the input on each call.
"""

from __future__ import annotations

import math

import torch

from .._activation import ACTIVATIONS, INVERTIBLE_ACTIVATIONS

__all__ = ["DEFAULT_WEIGHT_EPS", "SUPPORTED_DTYPES", "check_activation", "check_input", "check_arguments",
           "check_in_place", "check_eps", "check_momentum", "check_weight_eps", "check_flag"]

DEFAULT_WEIGHT_EPS = 1e-3
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_activation(activation: str, activation_param: float, inplace: bool, where: str) -> None:
    """Raise a clear ValueError/TypeError for an unusable activation."""
    # In place, only the invertible ones are allowed: the list names exactly
    # those, and what ABN takes besides is said apart from it.
    allowed = INVERTIBLE_ACTIVATIONS if inplace else ACTIVATIONS
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        others = [name for name in ACTIVATIONS if name not in allowed]
        elsewhere = (f" (effilayers.nn.ABN, which keeps its input instead, also takes {', '.join(others)})"
                     if others else "")
        raise ValueError(f"{where}: activation must be one of {', '.join(allowed)}, got {activation!r}{elsewhere}")
    if inplace and activation not in INVERTIBLE_ACTIVATIONS:
        raise ValueError(
            f"{where}: activation={activation!r} is not invertible, so it cannot run in place (backward rebuilds "
            f"the input from the output); {where} takes one of {', '.join(allowed)}. Use effilayers.nn.ABN, "
            f"which keeps its input and takes {activation!r}, or activation='leaky_relu' (e.g. "
            "activation_param=0.01)."
        )
    if isinstance(activation_param, bool) or not isinstance(activation_param, (int, float)):
        raise TypeError(f"{where}: activation_param must be a float, got {type(activation_param).__name__}")
    if not math.isfinite(activation_param):
        raise ValueError(f"{where}: activation_param must be finite, got {activation_param}")
    if activation == "leaky_relu" and inplace and activation_param <= 0:
        raise ValueError(
            f"{where}: leaky_relu in place needs a negative slope > 0 to be invertible, got {activation_param}"
        )
    if activation == "leaky_relu" and activation_param < 0:
        raise ValueError(f"{where}: leaky_relu negative slope must be >= 0, got {activation_param}")
    if activation == "elu" and activation_param <= 0:
        raise ValueError(f"{where}: elu alpha must be > 0, got {activation_param}")


def check_eps(eps, where: str) -> None:
    # "eps must be positive" is the phrase torch's BatchNorm raises.
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{where}: eps must be positive (a float > 0), got {eps!r}")


def check_flag(value, name: str, where: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__}")


def check_momentum(momentum, where: str) -> None:
    if momentum is not None and not (isinstance(momentum, (int, float)) and 0 <= momentum <= 1):
        raise ValueError(f"{where}: momentum must be None or a float in [0, 1], got {momentum!r}")


def check_weight_eps(weight_eps, where: str) -> None:
    if not (isinstance(weight_eps, (int, float)) and weight_eps > 0):
        raise ValueError(f"{where}: weight_eps must be a positive float, got {weight_eps!r}")


def check_input(x, residual, where: str, channels=None) -> None:
    """The per-call checks: ``x`` (and ``residual``) as the kernels take them;
    ``channels``, when given, is what the module was built for."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: input must be a torch.Tensor, got {type(x).__name__}")
    if not 2 <= x.dim() <= 5:
        raise ValueError(f"{where}: expected 2D to 5D input (N, C, ...), got {x.dim()}D input of shape "
                         f"{tuple(x.shape)}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(f"{where}: expected {channels} channels (dim 1), got input of shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{where}: input dtype must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"{where}: residual must match input in shape and dtype, got {tuple(residual.shape)} "
                         f"{residual.dtype} for input {tuple(x.shape)} {x.dtype}")


def check_arguments(x, weight, bias, running_mean, running_var, num_batches_tracked, training, eps, momentum,
                    where: str) -> None:
    """The functional forms' checks of everything but the input itself."""
    channels = x.shape[1]
    for name, tensor in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                         ("running_var", running_var)):
        if tensor is not None and tuple(tensor.shape) != (channels,):
            raise ValueError(f"{where}: {name} must have shape ({channels},) for input with {channels} channels, "
                             f"got {tuple(tensor.shape)}")
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{where}: {name} is on {tensor.device} but input is on {x.device}")
    if not training and (running_mean is None or running_var is None):
        raise ValueError(f"{where}: training=False needs running_mean and running_var")
    check_eps(eps, where)
    check_momentum(momentum, where)
    if momentum is None and training and (running_mean is not None or running_var is not None) \
            and num_batches_tracked is None:
        raise ValueError(f"{where}: momentum=None (cumulative average) needs num_batches_tracked")


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        # Dynamo cannot read storage addresses: it breaks the graph there and
        # guards the resumed frame on the address, which recompiles whenever
        # the allocator moves the tensor. Views made by view ops carry their
        # base, which it can trace (sharing by other means goes unseen here).
        return (a if a._base is None else a._base) is (b if b._base is None else b._base)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def check_in_place(x: torch.Tensor, residual, where: str) -> None:
    """What overwriting ``x`` needs: not a leaf that requires grad, and no
    residual that shares its memory."""
    if x.is_leaf and x.requires_grad:
        raise ValueError(
            f"{where}: input is a leaf tensor that requires grad (for example the model's input); "
            "it cannot be overwritten. Pass x.clone() or use effilayers.nn.ABN."
        )
    if residual is not None and _share_memory(residual, x):
        raise ValueError(
            f"{where}: residual shares memory with the input, which is overwritten; backward needs the "
            "residual as it was. Pass a residual that is not a view of the input (or use abn)."
        )
