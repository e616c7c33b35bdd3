"""What :func:`linear_cross_entropy` accepts, checked once per call (and the
options :class:`effilayers.nn.LinearCrossEntropyLoss` checks at construction).

Every error names the argument it is about."""

from __future__ import annotations

import torch

from ..cross_entropy.contract import REDUCTIONS, TARGET_DTYPES, check_target_range as _check_range

OP = "linear_cross_entropy"
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_options(op: str, reduction, label_smoothing, ignore_index, chunk_size, filter_eps=0.0) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{op}: chunk_size must be a positive int (tokens per chunk) or None, got {chunk_size!r}")
    if isinstance(filter_eps, bool) or not isinstance(filter_eps, (int, float)) or not 0.0 <= filter_eps < 1.0:
        raise ValueError(f"{op}: filter_eps must be a float in [0, 1) (0: exact gradients), got {filter_eps!r}")


def _tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{OP}: {name} must be a torch.Tensor, got {type(value).__name__}")


def _like_input(name: str, value: torch.Tensor, input: torch.Tensor, autocasting: bool) -> None:
    # The operands of the linear: on input's device, and of its dtype as for
    # torch.nn.functional.linear, except under autocast, which casts them.
    if value.device != input.device:
        raise ValueError(f"{OP}: {name} is on {value.device} but input is on {input.device}")
    if value.dtype != input.dtype and not (autocasting and value.dtype in INPUT_DTYPES):
        raise TypeError(f"{OP}: {name} has dtype {value.dtype} but input has {input.dtype}; they must match "
                        "(as for torch.nn.functional.linear) outside torch.autocast")


def _constant_weights(name: str, value: torch.Tensor, shape: tuple, device: torch.device, what: str) -> None:
    _tensor(name, value)
    if not value.is_floating_point():
        raise TypeError(f"{OP}: {name} must be a floating-point tensor, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{OP}: {name} must have shape {shape} ({what}), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{OP}: {name} is on {value.device} but input is on {device}")
    if value.requires_grad and torch.is_grad_enabled():
        # A silently missing .grad is worse than a refusal (torch refuses a
        # class weight that requires grad too).
        raise ValueError(f"{OP}: {name} requires grad, but the loss is not differentiated with respect to it; "
                         f"pass {name}.detach()")


def check_arguments(input, weight, target, bias, ignore_index, label_smoothing, reduction, class_weight,
                    token_weight, chunk_size, autocasting: bool, filter_eps=0.0) -> None:
    """``autocasting``: torch.autocast is on for the input's device, so input,
    weight and bias may differ in dtype (they are cast as ``F.linear`` casts
    them)."""
    _tensor("input", input)
    _tensor("weight", weight)
    _tensor("target", target)
    check_options(OP, reduction, label_smoothing, ignore_index, chunk_size, filter_eps)
    if input.dtype not in INPUT_DTYPES:
        raise TypeError(f"{OP}: input must be float16, bfloat16, float32 or float64, got {input.dtype}")
    if input.dim() == 0:
        raise ValueError(f"{OP}: input must have shape (..., hidden), got a 0-dim tensor")
    if weight.dim() != 2:
        raise ValueError(f"{OP}: weight must have shape (classes, hidden), got {tuple(weight.shape)}")
    classes, hidden = weight.shape
    if hidden != input.shape[-1]:
        raise ValueError(f"{OP}: weight has {hidden} input features (shape {tuple(weight.shape)}) but input has "
                         f"{input.shape[-1]} in its last dimension (shape {tuple(input.shape)})")
    if classes == 0:
        raise ValueError(f"{OP}: weight must have at least one class (row), got shape {tuple(weight.shape)}")
    _like_input("weight", weight, input, autocasting)
    if bias is not None:
        _tensor("bias", bias)
        if tuple(bias.shape) != (classes,):
            raise ValueError(f"{OP}: bias must have shape ({classes},) (one per class), got {tuple(bias.shape)}")
        _like_input("bias", bias, input, autocasting)
    tokens = tuple(input.shape[:-1])
    if target.device != input.device:
        raise ValueError(f"{OP}: target is on {target.device} but input is on {input.device}")
    if target.is_floating_point():
        if tuple(target.shape) != tokens + (classes,):
            raise ValueError(f"{OP}: target (class probabilities) must have shape {tokens + (classes,)} (input's "
                             f"leading dimensions, then the classes), got {tuple(target.shape)}")
        if target.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{OP}: target requires grad, but the loss is not differentiated with respect to "
                             "it; pass target.detach()")
    else:
        if target.dtype not in TARGET_DTYPES:
            raise TypeError(f"{OP}: target must hold class indices (int64, int32 or uint8) or class "
                            f"probabilities (floating point), got {target.dtype}")
        if tuple(target.shape) != tokens:
            raise ValueError(f"{OP}: target must have shape {tokens} (input's shape {tuple(input.shape)} without "
                             f"the hidden dimension), got {tuple(target.shape)}")
    if class_weight is not None:
        _constant_weights("class_weight", class_weight, (classes,), input.device, "one per class")
    if token_weight is not None:
        _constant_weights("token_weight", token_weight, tokens, input.device, "one per token: input's shape "
                          "without the hidden dimension")


def check_target_range(target: torch.Tensor, ignore_index: int, classes: int) -> None:
    """The cross_entropy family's range check, in this op's words."""
    _check_range(target, ignore_index, classes, OP, " (the rows of weight)")
