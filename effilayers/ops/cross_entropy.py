"""Cross-entropy over class indices without an fp32 copy of the logits.

``cross_entropy(logits, target, weight=None, ignore_index=-100,
label_smoothing=0.0, reduction="mean", inplace_backward=False)`` computes
what ``torch.nn.functional.cross_entropy`` computes for class-index targets:
logits ``(N, C)`` with target ``(N,)``, or ``(N, C, d1, ...)`` with target
``(N, d1, ...)`` (the class dimension is 1), or unbatched ``(C,)`` with a
0-dim target. Probability ("soft") targets are not supported. The loss is
differentiable with respect to the logits only: a ``weight`` that requires
grad is refused (``ValueError``) while grad mode is on, as torch refuses it.

Numerics
    Each row's log-sum-exp is accumulated in float32 (float64 for float64
    logits) with an online maximum and rescaled sum, so one read of the row
    gives it and a row of ``-inf`` values with one finite value is exact. The
    per-row loss and the reduction are float32; the returned loss has the
    logits' dtype, as torch returns it (float16 logits -> float16 loss), or
    float32 under ``torch.autocast`` (see Autocast below). Per
    row, with ``w`` the class weights (1 without ``weight``), ``W = sum(w)``,
    ``eps = label_smoothing``, ``t`` the target and ``lse`` the log-sum-exp::

        loss = (1 - eps) * w[t] * (lse - x[t]) + eps / C * sum_c w[c] * (lse - x[c])
        grad = ((1 - eps) * w[t] + eps / C * W) * softmax(x) - eps / C * w - (1 - eps) * w[t] * onehot(t)

    ``reduction="mean"`` divides by the sum of ``w[t]`` over the rows that
    are not ``ignore_index`` (torch's convention). When that sum is 0 the
    mean is NaN, with or without label smoothing, as torch's is: every row
    ignored gives a zero gradient, counted rows whose targets all have
    weight 0 a NaN gradient on those rows (0 on ignored ones). Ignored rows have loss 0
    and gradient 0. A ``-inf`` logit on the target gives an infinite loss and
    a finite gradient, like torch; ``+inf`` logits give NaN. Logits with 0
    classes (every target ignored) give torch's values without running a
    kernel: rows 0 (NaN with label smoothing, torch's ``eps / 0`` times 0).
    So do inputs without rows, ``(0, C)`` or ``(N, C, 0)``: a sum of 0, a
    mean of NaN (0 / 0) and an empty ``"none"`` loss, as torch gives.
    Logits near the top of bf16's range behave as torch's do: the loss
    ``lse - x[t]`` is formed in float32, so with values of about +-3e38 in one
    row (``lse`` ~3e38, ``x[t]`` ~-3e38) it overflows to ``inf``, exactly as
    torch's float32 log-softmax does; the gradient stays finite.

What is saved for backward
    The gradient is computed during the forward pass, already scaled for the
    reduction (``1 / sum(w[t])`` for the mean), and saved in the logits'
    dtype and layout: one logits-sized buffer and nothing else (torch saves
    its log-softmax output, in float32 under CUDA autocast). So the default
    mode's peak is about one logits size above the logits, a third of
    ``F.cross_entropy``'s (~3x: its log-softmax and two logits-sized
    gradients in backward): the issue's memory target (peak <= 0.3x torch's at
    16384x131072 bf16) needs ``inplace_backward=True``, below. Backward
    multiplies that buffer by ``grad_output`` in place (a scalar for
    ``"mean"``/``"sum"``, one value per row for ``"none"``) and returns it,
    so backward allocates nothing logits-sized. Under ``retain_graph=True``
    (the graph may be walked again) and under ``torch.compile`` (which plans
    the backward's buffers itself) it multiplies out of place instead: one
    logits-sized output. Double backward is not supported (a clear error
    when attempted). When the
    logits do not require grad no gradient is computed or saved.

``inplace_backward=True``
    The gradient is written over the logits themselves: no logits-sized
    buffer is allocated at all, the logits' storage becomes the saved
    gradient. The contract: **the logits' values are destroyed** by the call;
    use it when nothing else needs them (the usual ``loss =
    cross_entropy(lm_head(h), target)``). The logits' version counter is
    bumped (by the dispatcher, because ``effilayers::cross_entropy_forward_``
    declares ``logits`` mutated: the effect of
    ``torch.autograd.graph.increment_version``, and it also holds under
    ``torch.compile``), so any other autograd node that saved the logits
    (``logits.sin()`` used elsewhere, say) raises at backward instead of
    silently using gradient values. A leaf tensor that requires grad, or a view of one
    (``w[:]``, ``w.view(...)`` of a parameter ``w``), is refused with a
    ``ValueError``, as torch refuses in-place ops on them (under ``no_grad``
    nothing is written and nothing is refused). When the class dimension cannot be walked in
    place (strides that do not merge into (N, C, rest), see ``ops/_layout``),
    the kernel reads a contiguous copy and writes the gradient to a
    contiguous temporary that is then copied over the logits: the one case
    that costs logits-sized temporaries during the forward. Logits whose
    elements overlap in memory (``expand``) are refused.

Targets out of range (neither in ``[0, C)`` nor ``ignore_index``)
    On CPU tensors an ``IndexError`` is raised before any kernel runs (the
    check costs no device synchronisation there; the C++ kernel checks too).
    On GPU no check is made on the host (it would synchronise every step)
    and no device assert is used: the kernel writes NaN into that row's loss
    and gradient, so the reduced loss becomes NaN and the error is visible
    at the next loss read. Under ``torch.compile`` the host check is skipped
    (it is data-dependent); on CPU the C++ kernel still raises the
    ``IndexError`` (it checks each row as it reads it), while the kernels
    that do not check (Triton, and the PyTorch reference, the fallback)
    give NaN as above.

Autocast
    Under ``torch.autocast`` (CPU or CUDA) ``torch.nn.functional.cross_entropy``
    runs in float32 and returns a float32 loss; so does this op, with the
    autocast of the logits' device enabled and float16/bfloat16/float32
    logits: the loss (a scalar, or ``(N, ...)`` for ``reduction="none"``) is
    returned in float32 before any rounding to the logits' dtype, so a sum
    over many rows does not overflow float16 (8000x1000 fp16 logits with
    ``reduction="sum"``: about 9e4 like torch, where rounding to fp16 gave
    ``inf``; ``tests/test_cross_entropy.py::test_autocast_loss_dtype_follows_torch``).
    Unlike torch, no float32 copy of the
    logits is made: the kernels accumulate in float32 anyway, and the saved
    gradient (and ``inplace_backward``'s) stays in the logits' dtype, which is
    also the dtype of the gradient autograd hands back, as with torch.

Backends: a C++ CPU kernel (``csrc/cpu/cross_entropy.cpp``), a Triton GPU
kernel (``effilayers/kernels/cross_entropy.py``) and the chunked PyTorch
reference below; all implement one row-wise kernel,
``cross_entropy_rows(logits3, target, weight, grad3, grad_scale,
ignore_index, label_smoothing) -> loss_rows``, on an ``(N, C, I)`` strided
view of the logits.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.nn import _reduction as _Reduction
from torch._subclasses.fake_tensor import is_fake

from .._core import registry
from .._core.layout import autocast_to_float32, refuse_forward_ad, three_groups

__all__ = [
    "cross_entropy",
    "cross_entropy_rows_reference",
    "REDUCTIONS",
    "REFERENCE_CHUNK_ELEMENTS",
]

REDUCTIONS = ("mean", "sum", "none")
LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TARGET_DTYPES = (torch.int64, torch.int32, torch.uint8)

# The reference converts at most this many logits to float32 at a time
# (2**16 values = 256 KiB per temporary; a handful of temporaries of that size
# live at once), so its float32 working set is bounded whatever the
# vocabulary size, as the kernels' is.
REFERENCE_CHUNK_ELEMENTS = 1 << 16


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------
# The row-wise kernel, pure PyTorch
# ---------------------------------------------------------------------------


def cross_entropy_rows_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],
    grad: Optional[torch.Tensor],
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Per-row losses of an ``(N, C, I)`` logits view; writes the scaled
    gradient into ``grad`` (an ``(N, C, I)`` view, possibly the logits
    themselves) when it is given.

    ``target``: ``(N * I,)`` int64, row ``n * I + i``. ``grad_scale``: a
    1-element tensor multiplying the gradient (``1 / sum(w[t])`` for a mean).
    Returns ``(N * I,)`` losses in the accumulation dtype: 0 for ignored rows,
    NaN for rows whose target is out of range. Works on chunks of at most
    ``REFERENCE_CHUNK_ELEMENTS`` logits (never fewer than one row), so the
    float32 temporaries stay small.
    """
    n_outer, classes, n_inner = logits.shape
    acc = acc_dtype(logits.dtype)
    loss_rows = torch.empty(n_outer * n_inner, dtype=acc, device=logits.device)
    losses = loss_rows.view(n_outer, n_inner)
    targets = target.view(n_outer, n_inner)
    eps = float(label_smoothing)
    w_all = None if weight is None else weight.to(acc).view(1, classes, 1)
    scale = grad_scale.reshape(()).to(acc)
    if classes == 0:  # nothing to read or write: ignored rows 0, the rest have no valid target
        loss_rows.copy_(torch.where(target == ignore_index, 0.0, math.nan))
        return loss_rows
    if loss_rows.numel() == 0:  # no rows ((0, C, I) or (N, C, 0)): no chunk to size
        return loss_rows
    inner_block = n_inner if classes * n_inner <= REFERENCE_CHUNK_ELEMENTS else max(1, REFERENCE_CHUNK_ELEMENTS // classes)
    outer_block = max(1, REFERENCE_CHUNK_ELEMENTS // (classes * inner_block))
    for n0 in range(0, n_outer, outer_block):
        n1 = min(n0 + outer_block, n_outer)
        for i0 in range(0, n_inner, inner_block):
            i1 = min(i0 + inner_block, n_inner)
            x = logits[n0:n1, :, i0:i1].to(acc)  # (nb, C, ib): the bounded fp32 temporary
            t = targets[n0:n1, i0:i1]
            valid = t != ignore_index
            in_range = (t >= 0) & (t < classes)
            bad = valid & ~in_range
            t_safe = torch.where(valid & in_range, t, torch.zeros_like(t)).unsqueeze(1)
            row_max = x.amax(dim=1, keepdim=True)
            # A row of -inf has no finite maximum; shifting by 0 keeps exp() at 0.
            shift = torch.where(row_max == -math.inf, torch.zeros_like(row_max), row_max)
            exp = torch.exp(x - shift)
            lse = shift + torch.log(exp.sum(dim=1, keepdim=True))
            x_t = x.gather(1, t_safe)
            w_t = torch.ones_like(x_t) if w_all is None else w_all.view(-1)[t_safe]
            loss = (1.0 - eps) * w_t * (lse - x_t)
            if eps > 0.0:
                if w_all is None:
                    smooth = classes * lse - x.sum(dim=1, keepdim=True)
                    coef = torch.ones_like(w_t)
                else:
                    total_w = w_all.sum()
                    smooth = total_w * lse - (x * w_all).sum(dim=1, keepdim=True)
                    coef = (1.0 - eps) * w_t + eps / classes * total_w
                loss = loss + eps / classes * smooth
            else:
                coef = w_t
            loss = loss.squeeze(1)
            loss = torch.where(valid, loss, torch.zeros_like(loss))
            losses[n0:n1, i0:i1] = torch.where(bad, torch.full_like(loss, math.nan), loss)
            if grad is None:
                continue
            softmax = torch.exp(x - lse)
            g = coef * softmax
            if eps > 0.0:
                g = g - eps / classes * (1.0 if w_all is None else w_all)
            g.scatter_add_(1, t_safe, -(1.0 - eps) * w_t)
            g = g * scale
            g = torch.where(valid.unsqueeze(1), g, torch.zeros_like(g))
            g = torch.where(bad.unsqueeze(1), torch.full_like(g, math.nan), g)
            grad[n0:n1, :, i0:i1] = g.to(grad.dtype)
    return loss_rows


def _triton_rows(*args):
    from ..kernels.cross_entropy import cross_entropy_rows_triton

    return cross_entropy_rows_triton(*args)


registry.register(
    registry.OpKernels(
        name="cross_entropy", reference=cross_entropy_rows_reference, cpp="cross_entropy_rows", triton=_triton_rows
    )
)


# ---------------------------------------------------------------------------
# Shapes, buffers, reductions (shared by both custom ops)
# ---------------------------------------------------------------------------


def _as_rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``(N, C, d...)`` as an ``(N, C, I)`` view without a copy, or None."""
    groups = three_groups(t, (1,))
    if groups is None:
        return None
    return t.as_strided(
        (groups.outer, groups.reduced, groups.inner),
        (groups.outer_stride, groups.reduced_stride, groups.inner_stride),
        t.storage_offset(),
    )


def _is_dense(t: torch.Tensor) -> bool:
    """Fills one block of memory without gaps or overlaps (a permutation of
    contiguous): then ``empty_like`` keeps its strides."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _grad_buffer(logits: torch.Tensor) -> torch.Tensor:
    """An uninitialised logits-sized gradient, laid out like the logits
    where the kernels can walk that layout, else contiguous."""
    if _is_dense(logits) and three_groups(logits, (1,)) is not None:
        return torch.empty_like(logits)
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _loss_shape(logits: torch.Tensor, reduction: str) -> tuple[int, ...]:
    return tuple(logits.shape[:1]) + tuple(logits.shape[2:]) if reduction == "none" else ()


def _row_weights(target_rows, weight, ignore_index, classes, acc):
    """sum over non-ignored rows of w[t] (as a 1-element tensor; no sync)."""
    valid = target_rows != ignore_index
    if weight is None or classes == 0:  # 0 classes: no weight to index (every row is ignored or NaN)
        return valid.sum().to(acc).reshape(1)
    safe = torch.where(valid, target_rows, torch.zeros_like(target_rows)).clamp(0, classes - 1)
    return (weight.to(acc)[safe] * valid).sum().reshape(1)


def _run(logits, target, weight, ignore_index, label_smoothing, reduction, grad, loss_dtype):
    """Run the row kernel; returns the loss in ``loss_dtype``. ``grad``:
    None, or a logits-shaped buffer (possibly the logits) to fill."""
    acc = acc_dtype(logits.dtype)
    classes = logits.shape[1]
    # The kernels read target row r at offset r: a target with gaps (a column
    # of a label table, a shifted or permuted view) is copied, which
    # reshape(-1) alone does not do where a single stride fits.
    target_rows = target.reshape(-1).to(torch.int64).contiguous()
    if reduction == "mean":
        total = _row_weights(target_rows, weight, ignore_index, classes, acc)
        # A total weight of 0 (every row ignored, or every target of a class
        # of weight 0): torch's mean is 0 / 0 = NaN, with label smoothing too
        # (its smoothing term is added to that NaN), and its gradient NaN on
        # the counted rows; 1 / 0 = inf would give inf there. A NaN scale does
        # it; the kernels still write 0 on ignored rows (a select, as torch's).
        grad_scale = torch.where(total == 0, math.nan, 1.0 / total)
    else:
        total = None
        grad_scale = torch.ones(1, dtype=acc, device=logits.device)
    if weight is not None:
        # (C,) values: the kernels take them contiguous in the accumulation dtype.
        weight = weight.to(device=logits.device, dtype=acc).contiguous()
    if classes == 0 or target_rows.numel() == 0:
        # No logit to read and no gradient element to write: torch's values
        # directly. With 0 classes, ignored rows give 0, or NaN with label
        # smoothing (torch's eps / C is inf, times a zero sum); any other
        # target is out of range (NaN, as the kernels flag it; CPU raised
        # before). With no rows ((0, C), (N, C, 0)), no loss at all: the sum
        # is 0 and the mean 0 / 0 = NaN, as torch gives.
        ignored = 0.0 if label_smoothing == 0 else math.nan
        loss_rows = torch.where(target_rows == ignore_index, ignored, math.nan).to(acc)
    else:
        rows3 = _as_rows(logits)
        if rows3 is None:
            # Strides that do not merge into (N, C, rest): the one case that costs a copy.
            rows3 = _as_rows(logits.contiguous())
        grad3 = None if grad is None else _as_rows(grad)
        copied_grad = None
        if grad is not None and grad3 is None:
            copied_grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
            grad3 = _as_rows(copied_grad)
        loss_rows = registry.kernel("cross_entropy", logits.device)(
            rows3, target_rows, weight, grad3, grad_scale, ignore_index, float(label_smoothing)
        )
        if copied_grad is not None:
            grad.copy_(copied_grad)
    if reduction == "none":
        return loss_rows.view(_loss_shape(logits, "none")).to(loss_dtype)
    loss = loss_rows.sum()
    if reduction == "mean":
        loss = torch.where(total == 0, math.nan, loss / total).reshape(())
    return loss.to(loss_dtype)


# ---------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------


@torch.library.custom_op("effilayers::cross_entropy_forward", mutates_args=())
def _cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    compute_grad: bool,
    loss_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, grad): the loss in ``loss_dtype``; grad is the reduction-scaled
    d loss / d logits in the logits' dtype, or an empty tensor when
    ``compute_grad`` is False."""
    grad = _grad_buffer(logits) if compute_grad else logits.new_empty((0,))
    loss = _run(logits, target, weight, ignore_index, label_smoothing, reduction, grad if compute_grad else None,
                loss_dtype)
    return loss, grad


@_cross_entropy_forward.register_fake
def _(logits, target, weight, ignore_index, label_smoothing, reduction, compute_grad, loss_dtype):
    loss = logits.new_empty(_loss_shape(logits, reduction), dtype=loss_dtype)
    grad = _grad_buffer(logits) if compute_grad else logits.new_empty((0,))
    return loss, grad


@torch.library.custom_op("effilayers::cross_entropy_forward_", mutates_args=("logits",))
def _cross_entropy_forward_(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    loss_dtype: torch.dtype,
) -> torch.Tensor:
    """The loss in ``loss_dtype``; the reduction-scaled gradient is written over ``logits``."""
    return _run(logits, target, weight, ignore_index, label_smoothing, reduction, logits, loss_dtype)


@_cross_entropy_forward_.register_fake
def _(logits, target, weight, ignore_index, label_smoothing, reduction, loss_dtype):
    return logits.new_empty(_loss_shape(logits, reduction), dtype=loss_dtype)


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, label_smoothing, reduction, inplace_backward, grad_mode,
                loss_dtype):
        # needs_input_grad says True under no_grad too: `grad_mode` (read
        # before apply) keeps no_grad / inference_mode calls from computing
        # and writing a gradient nobody will use.
        compute_grad = ctx.needs_input_grad[0] and grad_mode
        ctx.reduction = reduction
        if compute_grad and inplace_backward:
            loss = _cross_entropy_forward_(logits, target, weight, ignore_index, label_smoothing, reduction, loss_dtype)
            grad = logits
        else:
            loss, grad = _cross_entropy_forward(
                logits, target, weight, ignore_index, label_smoothing, reduction, compute_grad, loss_dtype
            )
        if compute_grad:
            ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
            raise RuntimeError(
                "effilayers cross_entropy: double backward is not supported (the gradient is computed in the "
                "forward pass and saved without a graph), so backward(create_graph=True) through it is refused; "
                "use torch.nn.functional.cross_entropy for higher-order gradients"
            )
        (grad,) = ctx.saved_tensors
        scale = grad_output.unsqueeze(1) if ctx.reduction == "none" else grad_output
        # grad_output may be float32 (autocast's loss) while the gradient has
        # the logits' dtype: multiplying in place (into the gradient's dtype,
        # computed in the wider one) keeps it so without a float32 temporary.
        if torch.compiler.is_compiling() or torch._C._autograd._get_current_graph_task_keep_graph():
            # retain_graph=True (gradcheck, a second backward): keep the saved
            # gradient intact at the cost of one logits-sized output.
            return grad.clone().mul_(scale), None, None, None, None, None, None, None, None
        # The usual single backward: scale the saved buffer in place, so
        # backward allocates nothing logits-sized.
        return grad.mul_(scale), None, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------
# The functional op
# ---------------------------------------------------------------------------


def _check_arguments(logits, target, weight, ignore_index, label_smoothing, reduction, inplace_backward):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"cross_entropy: logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"cross_entropy: target must be a torch.Tensor, got {type(target).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"cross_entropy: logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"cross_entropy: inplace_backward must be a bool, got {inplace_backward!r}")
    if target.is_floating_point():
        raise TypeError(
            "cross_entropy: target must hold class indices (int64); probability (soft) targets "
            f"are not supported, got a {target.dtype} target of shape {tuple(target.shape)}"
        )
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
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError("cross_entropy: weight must be a floating-point tensor of shape (C,) or None")
        if tuple(weight.shape) != (classes,):
            raise ValueError(f"cross_entropy: weight must have shape ({classes},) (one per class), "
                             f"got {tuple(weight.shape)}")
        if weight.device != logits.device:
            raise ValueError(f"cross_entropy: weight is on {weight.device} but logits are on {logits.device}")
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


def _check_target_range(logits, target, ignore_index, classes):
    """On CPU only (no device sync there) and not while compiling."""
    if target.device.type != "cpu" or torch.compiler.is_compiling() or target.numel() == 0 or is_fake(target):
        return
    t = target.to(torch.int64)
    bad = (t != ignore_index) & ((t < 0) | (t >= classes))
    if bool(bad.any()):
        value = int(t[bad][0])
        raise IndexError(f"cross_entropy: target {value} is out of bounds for {classes} classes "
                         f"(and is not ignore_index={ignore_index})")


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    inplace_backward: bool = False,
    *,
    size_average: Optional[bool] = None,
    reduce: Optional[bool] = None,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` against class indices ``target``, like
    ``torch.nn.functional.cross_entropy`` but saving one logits-sized
    gradient (none with ``inplace_backward=True``, which destroys the logits'
    values) instead of a log-softmax, and never making a float32 copy of the
    logits. See the module docstring for numerics and contracts.

    ``size_average`` / ``reduce`` (keyword only) are torch's deprecated pair:
    when either is given it overrides ``reduction`` the way torch maps it,
    with torch's warning.
    """
    if size_average is not None or reduce is not None:
        reduction = _Reduction.legacy_get_string(size_average, reduce)
    _check_arguments(logits, target, weight, ignore_index, label_smoothing, reduction, inplace_backward)
    refuse_forward_ad("cross_entropy", logits, weight)
    unbatched = logits.dim() == 1
    if unbatched:
        logits = logits.unsqueeze(0)
        target = target.unsqueeze(0)
    _check_target_range(logits, target, ignore_index, logits.shape[1])
    # torch.autocast runs F.cross_entropy in float32 on CPU and CUDA: the loss follows.
    loss_dtype = torch.float32 if autocast_to_float32(logits, ("cpu", "cuda")) else logits.dtype
    loss = _CrossEntropyFunction.apply(
        logits, target, weight, int(ignore_index), float(label_smoothing), reduction, inplace_backward,
        torch.is_grad_enabled(), loss_dtype,
    )
    if unbatched and reduction == "none":
        loss = loss.squeeze(0)
    return loss
