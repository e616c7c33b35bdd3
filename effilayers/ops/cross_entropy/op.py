"""The cross-entropy ops, the autograd Function over them and the public
function (see the package docstring for numerics and contracts)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.nn import _reduction as _Reduction

from ..._core import registry
from ..._core.dtypes import accumulation_dtype
from ..._core.layout import autocast_to_float32, is_dense, refuse_forward_ad, three_groups, three_view
from .contract import check_arguments, check_target_range
from .reference import (
    cross_entropy_chunk_grad_reference,
    cross_entropy_chunk_stats_reference,
    cross_entropy_rows_reference,
    cross_entropy_soft_chunk_grad_reference,
    cross_entropy_soft_chunk_stats_reference,
)

# The functions effilayers.functional exports from this family (effilayers/functional.py finds them here).
FUNCTIONAL = ("cross_entropy",)

registry.register(registry.OpKernels(name="cross_entropy", reference=cross_entropy_rows_reference,
                                     cpp="cross_entropy",
                                     triton="effilayers.ops.cross_entropy.triton:cross_entropy_rows_triton"))
for _name, _reference in (("cross_entropy_chunk_stats_", cross_entropy_chunk_stats_reference),
                          ("cross_entropy_chunk_grad_", cross_entropy_chunk_grad_reference),
                          ("cross_entropy_soft_chunk_stats_", cross_entropy_soft_chunk_stats_reference),
                          ("cross_entropy_soft_chunk_grad_", cross_entropy_soft_chunk_grad_reference)):
    registry.register(registry.OpKernels(name=_name, reference=_reference, cpp=_name,
                                         triton=f"effilayers.ops.cross_entropy.triton:{_name[:-1]}_triton"))


# --------------------------------------------------------------------------- kernel ops
# Declared once here; csrc/cpu/cross_entropy.cpp adds the CPU kernels, the
# registry the Triton and reference ones where those are the choice.

# The row kernel over an (N, C, I) view of the logits: per-row losses in the
# accumulation dtype, and the reduction-scaled gradient written into `grad`
# (which may be the logits themselves) when given.
rows_op = registry.declare(
    "cross_entropy",
    "(Tensor logits, Tensor target, Tensor? weight, Tensor(a!)? grad, Tensor grad_scale, int ignore_index, "
    "float label_smoothing) -> Tensor",
    lambda logits, *args: logits.new_empty((logits.shape[0] * logits.shape[2],),
                                           dtype=accumulation_dtype(logits.dtype)))

# The two passes over one vocabulary chunk of rows too wide to walk whole
# (linear_cross_entropy's vocabulary chunks): (rows, classes) logits, classes
# contiguous, starting at class `class_offset`; the online statistics updated
# in place in `stats` (4, rows), then, from the final log-sum-exp and scales
# in `row_terms` (4, rows), the gradient written over the logits. In place,
# so a traced graph holds them with fake kernels that compute nothing.
chunk_stats_op = registry.declare(
    "cross_entropy_chunk_stats_",
    "(Tensor logits, Tensor target, Tensor? weight, Tensor(a!) stats, int class_offset, int ignore_index, "
    "bool smoothing) -> ()", lambda *args: None)
chunk_grad_op = registry.declare(
    "cross_entropy_chunk_grad_",
    "(Tensor(a!) logits, Tensor target, Tensor? class_term, Tensor row_terms, int class_offset, int ignore_index) "
    "-> ()", lambda *args: None)
# The same two passes for rows with class-probability targets `probs` (any
# floating dtype and strides), each probability weighted as q_c = p_c *
# prob_weight_c + class_term_c: `stats` (4, rows) gains sum_c q_c z_c and
# sum_c q_c; `row_terms` (3, rows) is the final log-sum-exp, sum_c q_c over
# the whole row, and the gradient's scale.
soft_chunk_stats_op = registry.declare(
    "cross_entropy_soft_chunk_stats_",
    "(Tensor logits, Tensor probs, Tensor? prob_weight, Tensor? class_term, Tensor(a!) stats) -> ()",
    lambda *args: None)
soft_chunk_grad_op = registry.declare(
    "cross_entropy_soft_chunk_grad_",
    "(Tensor(a!) logits, Tensor probs, Tensor? prob_weight, Tensor? class_term, Tensor row_terms) -> ()",
    lambda *args: None)


# ---------------------------------------------------------------------------
# Shapes, buffers, reductions: the forward both composition ops run
# ---------------------------------------------------------------------------


def _grad_buffer(logits: torch.Tensor) -> torch.Tensor:
    """An uninitialised logits-sized gradient, laid out like the logits
    where the kernels can walk that layout, else contiguous."""
    if is_dense(logits) and three_groups(logits, (1,)) is not None:
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
    acc = accumulation_dtype(logits.dtype)
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
        rows3 = three_view(logits, (1,))
        if rows3 is None:
            # Strides that do not merge into (N, C, rest): the one case that costs a copy.
            rows3 = three_view(logits.contiguous(), (1,))
        grad3 = None if grad is None else three_view(grad, (1,))
        copied_grad = None
        if grad is not None and grad3 is None:
            copied_grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
            grad3 = three_view(copied_grad, (1,))
        loss_rows = rows_op(
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
# Composition ops
# ---------------------------------------------------------------------------

# What both forward ops take after the logits (one schema, written once).
_ARGUMENTS = "Tensor target, Tensor? weight, SymInt ignore_index, float label_smoothing, str reduction"


def _forward(logits, target, weight, ignore_index, label_smoothing, reduction, compute_grad, loss_dtype):
    """(loss, grad): the loss in ``loss_dtype``; grad is the reduction-scaled
    d loss / d logits in the logits' dtype, or an empty tensor when
    ``compute_grad`` is False."""
    grad = _grad_buffer(logits) if compute_grad else logits.new_empty((0,))
    loss = _run(logits, target, weight, ignore_index, label_smoothing, reduction, grad if compute_grad else None,
                loss_dtype)
    return loss, grad


def _forward_(logits, target, weight, ignore_index, label_smoothing, reduction, loss_dtype):
    """The loss in ``loss_dtype``; the reduction-scaled gradient is written over ``logits``."""
    return _run(logits, target, weight, ignore_index, label_smoothing, reduction, logits, loss_dtype)


def _forward_fake(logits, target, weight, ignore_index, label_smoothing, reduction, compute_grad, loss_dtype):
    loss = logits.new_empty(_loss_shape(logits, reduction), dtype=loss_dtype)
    grad = _grad_buffer(logits) if compute_grad else logits.new_empty((0,))
    return loss, grad


def _forward_fake_(logits, target, weight, ignore_index, label_smoothing, reduction, loss_dtype):
    return logits.new_empty(_loss_shape(logits, reduction), dtype=loss_dtype)


# Compositions over the row op: a traced graph holds one of these, not the
# reshapes, weights and reductions around the kernel.
_cross_entropy_forward = registry.declare(
    "cross_entropy_forward",
    f"(Tensor logits, {_ARGUMENTS}, bool compute_grad, ScalarType loss_dtype) -> (Tensor, Tensor)",
    _forward_fake, composition=_forward)
_cross_entropy_forward_ = registry.declare(
    "cross_entropy_forward_", f"(Tensor(a0!) logits, {_ARGUMENTS}, ScalarType loss_dtype) -> Tensor",
    _forward_fake_, composition=_forward_)


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, label_smoothing, reduction, inplace_backward, grad_mode,
                loss_dtype):
        # needs_input_grad says True under no_grad too: `grad_mode` (read
        # before apply) keeps no_grad / inference_mode calls from computing
        # and writing a gradient nobody will use.
        compute_grad = ctx.needs_input_grad[0] and grad_mode
        ctx.reduction = reduction
        arguments = (target, weight, ignore_index, label_smoothing, reduction)
        if compute_grad and inplace_backward:
            if registry.runs_eagerly(logits):
                loss = _forward_(logits, *arguments, loss_dtype)
                # What the op's mutation of logits does through the
                # dispatcher: other nodes that saved the logits now raise.
                torch.autograd.graph.increment_version(logits)
            else:
                loss = _cross_entropy_forward_(logits, *arguments, loss_dtype)
            grad = logits
        else:
            forward = _forward if registry.runs_eagerly(logits) else _cross_entropy_forward
            loss, grad = forward(logits, *arguments, compute_grad, loss_dtype)
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
# Probability targets: torch's formula
# ---------------------------------------------------------------------------


def _probability_cross_entropy(logits, target, weight, label_smoothing, reduction):
    """torch's cross-entropy against class probabilities, in torch's order of
    operations (so float64 results are torch's to the bit): smoothed target
    ``target * (1 - eps) + eps / C``, row loss ``-sum_c w[c] * target[c] *
    log_softmax(x)[c]``, a mean over rows (not over weights). Plain torch
    ops: autograd reaches the logits, the target and the weight, and the
    memory is torch's (the log-softmax is kept)."""
    class_dim = 0 if logits.dim() == 1 else 1
    classes = logits.shape[class_dim]
    if autocast_to_float32(logits, ("cpu", "cuda")):
        # torch.autocast runs cross_entropy in float32, target included.
        logits, target = logits.float(), target.float()
        weight = None if weight is None else weight.float()
    log_probabilities = torch.log_softmax(logits, class_dim)
    if label_smoothing > 0:
        target = target * (1 - label_smoothing) + label_smoothing / classes
    terms = log_probabilities * target
    if weight is not None:
        shape = [1] * logits.dim()
        shape[class_dim] = classes
        terms = terms * weight.view(shape)
    if reduction == "none":
        return -terms.sum(class_dim)
    total = -terms.sum()
    if reduction == "sum":
        return total
    if logits.numel() == 0:
        return total.fill_(math.nan)
    return total / (logits.numel() // classes)


# ---------------------------------------------------------------------------
# The functional op
# ---------------------------------------------------------------------------


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
    logits. See the package docstring for numerics and contracts.

    A floating ``target`` of the logits' shape holds class probabilities
    (soft labels, mixup, distillation): computed with torch's formula and
    torch's ops, ``label_smoothing`` and ``weight`` included (no kernel of
    ours, torch's memory; ``ignore_index`` and ``inplace_backward`` refused).

    ``size_average`` / ``reduce`` (keyword only) are torch's deprecated pair:
    when either is given it overrides ``reduction`` the way torch maps it,
    with torch's warning.
    """
    if size_average is not None or reduce is not None:
        reduction = _Reduction.legacy_get_string(size_average, reduce)
    check_arguments(logits, target, weight, ignore_index, label_smoothing, reduction, inplace_backward)
    if target.is_floating_point():
        return _probability_cross_entropy(logits, target, weight, float(label_smoothing), reduction)
    refuse_forward_ad("cross_entropy", logits, weight)
    unbatched = logits.dim() == 1
    if unbatched:
        logits = logits.unsqueeze(0)
        target = target.unsqueeze(0)
    check_target_range(target, ignore_index, logits.shape[1])
    # torch.autocast runs F.cross_entropy in float32 on CPU and CUDA: the loss follows.
    loss_dtype = torch.float32 if autocast_to_float32(logits, ("cpu", "cuda")) else logits.dtype
    loss = _CrossEntropyFunction.apply(
        logits, target, weight, int(ignore_index), float(label_smoothing), reduction, inplace_backward,
        torch.is_grad_enabled(), loss_dtype,
    )
    if unbatched and reduction == "none":
        loss = loss.squeeze(0)
    return loss
