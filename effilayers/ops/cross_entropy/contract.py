"""What :func:`cross_entropy` accepts, checked once per call (and the
options :class:`effilayers.nn.CrossEntropyLoss` checks at construction)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

REDUCTIONS = ("mean", "sum", "none")
LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TARGET_DTYPES = (torch.int64, torch.int32, torch.uint8)


def check_options(op: str, reduction, label_smoothing, inplace_backward) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"{op}: inplace_backward must be a bool, got {inplace_backward!r}")


def check_arguments(logits, target, weight, ignore_index, label_smoothing, reduction, inplace_backward) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"cross_entropy: logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"cross_entropy: target must be a torch.Tensor, got {type(target).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"cross_entropy: logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    check_options("cross_entropy", reduction, label_smoothing, inplace_backward)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    if target.is_floating_point():
        check_probability_target(logits, target, weight, ignore_index, inplace_backward)
        return
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"cross_entropy: target must be int64 (or int32/uint8) class indices, got {target.dtype}")
    if logits.dim() == 0:
        raise ValueError("cross_entropy: logits must have at least 1 dimension (C,) or (N, C, ...)")
    expected = () if logits.dim() == 1 else tuple(logits.shape[:1]) + tuple(logits.shape[2:])
    if tuple(target.shape) != expected:
        raise ValueError(
            f"cross_entropy: target must have shape {expected} for logits of shape {tuple(logits.shape)} "
            f"(the logits without the class dimension 1), got {tuple(target.shape)}"
        )
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {target.device} but logits are on {logits.device}")
    classes = logits.shape[0] if logits.dim() == 1 else logits.shape[1]
    if weight is not None:
        _check_class_weight(weight, classes, logits.device)
        if weight.requires_grad and torch.is_grad_enabled():
            # torch's nll_loss refuses it too (not differentiable w.r.t. weight):
            # no gradient would reach it, and a silently missing weight.grad is worse.
            raise ValueError(
                "cross_entropy: weight requires grad, but the loss is not differentiable with respect to the class "
                "weights (torch.nn.functional.cross_entropy refuses it too); pass weight.detach()"
            )
    # Under no_grad / inference_mode nothing is written (no gradient is
    # computed), and torch allows in-place ops there too: no refusal.
    writes = inplace_backward and logits.requires_grad and torch.is_grad_enabled()
    if writes and logits.is_leaf:
        raise ValueError(
            "cross_entropy: inplace_backward=True overwrites the logits, but they are a leaf tensor that requires "
            "grad; pass logits computed by the model (e.g. lm_head(h)) or use inplace_backward=False"
        )
    # A view's _base is the tensor that owns the storage (never itself a view):
    # writing through w[:] or w.view(...) would overwrite the leaf w, which
    # torch refuses for its own in-place ops.
    base = logits._base
    if writes and base is not None and base.is_leaf and base.requires_grad:
        raise ValueError(
            "cross_entropy: inplace_backward=True overwrites the logits, but they are a view of a leaf tensor that "
            "requires grad (a parameter, say) and would overwrite it; pass logits computed by the model (e.g. "
            "lm_head(h)) or use inplace_backward=False"
        )
    if inplace_backward and any(size > 1 and stride == 0 for size, stride in zip(logits.shape, logits.stride())):
        raise ValueError(
            "cross_entropy: inplace_backward=True writes the gradient over the logits, but several of their "
            "elements share memory (an expanded tensor); pass logits.contiguous() or use inplace_backward=False"
        )


def check_probability_target(logits, target, weight, ignore_index, inplace_backward) -> None:
    """A floating target holds class probabilities (soft labels, mixup):
    the logits' shape, as torch requires."""
    if logits.dim() == 0:
        raise ValueError("cross_entropy: logits must have at least 1 dimension (C,) or (N, C, ...)")
    if target.dtype not in LOGIT_DTYPES:
        raise TypeError(f"cross_entropy: a probability target must be float16, bfloat16, float32 or float64, "
                        f"got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape):
        raise ValueError(
            f"cross_entropy: a floating target holds class probabilities and must have the logits' shape "
            f"{tuple(logits.shape)}, got {tuple(target.shape)} (class indices must be int64)"
        )
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {target.device} but logits are on {logits.device}")
    if ignore_index != -100:
        raise ValueError(f"cross_entropy: ignore_index is not supported for probability (floating) targets, "
                         f"got ignore_index={ignore_index} (torch refuses it too)")
    if inplace_backward:
        raise ValueError("cross_entropy: inplace_backward=True needs class-index targets; probability targets run "
                         "torch's formula, which keeps its log-softmax")
    classes = logits.shape[0] if logits.dim() == 1 else logits.shape[1]
    if weight is not None:
        _check_class_weight(weight, classes, logits.device)


def _check_class_weight(weight, classes: int, device: torch.device) -> None:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError("cross_entropy: weight must be a floating-point tensor of shape (C,) or None")
    if tuple(weight.shape) != (classes,):
        raise ValueError(f"cross_entropy: weight must have shape ({classes},) (one per class), "
                         f"got {tuple(weight.shape)}")
    if weight.device != device:
        raise ValueError(f"cross_entropy: weight is on {weight.device} but logits are on {device}")


def check_target_range(target: torch.Tensor, ignore_index: int, classes: int, where: str = "cross_entropy",
                       classes_are: str = "") -> None:
    """Class indices in [0, classes) or ignore_index; on CPU only (no device
    synchronisation there) and not while compiling. ``classes_are`` says,
    in the error, where the classes come from."""
    if (target.is_floating_point() or target.device.type != "cpu" or torch.compiler.is_compiling()
            or target.numel() == 0 or is_fake(target)):
        return
    t = target.to(torch.int64)
    bad = (t != ignore_index) & ((t < 0) | (t >= classes))
    if bool(bad.any()):
        value = int(t[bad][0])
        raise IndexError(f"{where}: target {value} is out of bounds for {classes} classes{classes_are}, "
                         f"and is not ignore_index={ignore_index}")
