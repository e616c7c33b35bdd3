"""The chunked pass, its two custom ops, the autograd Function over them and
the public function (see the package docstring for numerics and contracts)."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ..._core import registry
from ..._core.dtypes import accumulation_dtype
from ..._core.layout import refuse_forward_ad

# Importing the family registers the "cross_entropy" row kernels this op runs on each chunk.
from ..cross_entropy import op as _cross_entropy_op  # noqa: F401
from .contract import INPUT_DTYPES, OP, check_arguments, check_target_range
from .reference import class_index_grads_reference, class_index_stats_reference
from .vocab_chunks import (
    accumulate_product,
    probability_terms,
    vocab_chunk_bytes,
    vocab_chunked_rows,
    whole_probability_rows,
)
from .vocab_parallel import is_sharded, runs_vocab_parallel, vocab_parallel_linear_cross_entropy

# A chunk of logits takes at most this many bytes, or the input's own size
# when that is larger: a large input (many tokens, a wide hidden size) gets
# taller chunks and fewer trips through the loop, while a chunk stays no
# larger than a tensor the caller already holds. 8 MiB, not 16: at issue
# 32's CPU shape (4096 tokens x hidden 256 x 32768 classes, float32) the
# gradients alone are 0.07x the logits, and a 16 MiB chunk left the peak
# above the 0.1x target (benchmarks/results/linear_cross_entropy-cpu-table-*).
CHUNK_LOGITS_BYTES = 8 << 20


def chunk_tokens(tokens: int, classes: int, itemsize: int, input_bytes: int, chunk_size: Optional[int]) -> int:
    """Tokens per chunk: ``chunk_size`` when given, else the most whose
    logits fit in ``max(CHUNK_LOGITS_BYTES, input_bytes)`` (at least one).
    ``itemsize``: bytes per logit (6 for fp16/bf16 on CPU when the weight
    gradient is wanted: the logits and their float32 copy)."""
    if chunk_size is not None:
        return max(1, min(chunk_size, tokens))
    budget = max(CHUNK_LOGITS_BYTES, input_bytes)
    return max(1, min(tokens, budget // (classes * itemsize)))


# Fewer tokens than this per chunk make thin, slow matmuls: a vocabulary so
# wide that this many tokens' logits overflow the budget is split instead.
MIN_CHUNK_TOKENS = 32


def chunk_shape(tokens: int, classes: int, itemsize: int, vocab_itemsize: int, input_bytes: int,
                chunk_size: Optional[int]) -> tuple[int, int]:
    """(tokens, classes) per chunk. Whole vocabulary rows while the token
    chunk (``chunk_size``, else :func:`chunk_tokens`'s) is at least
    ``min(tokens, MIN_CHUNK_TOKENS)`` tokens and fits the budget
    ``max(CHUNK_LOGITS_BYTES, input_bytes)``; otherwise the token chunk is
    ``chunk_size`` or ``min(tokens, MIN_CHUNK_TOKENS)``, and the vocabulary is
    split into the most classes whose logits fit the budget at
    ``vocab_itemsize`` bytes each (the compute dtype, plus the float32 copy
    that CPU matmuls read for fp16/bf16 gradients), at least one."""
    budget = max(CHUNK_LOGITS_BYTES, input_bytes)
    step = chunk_tokens(tokens, classes, itemsize, input_bytes, chunk_size)
    fits = step * classes * itemsize <= budget
    if fits and (chunk_size is not None or step >= min(tokens, MIN_CHUNK_TOKENS)):
        return step, classes
    if chunk_size is None:
        step = max(1, min(tokens, MIN_CHUNK_TOKENS))
    return step, max(1, min(classes, budget // (step * vocab_itemsize)))


# ---------------------------------------------------------------------------
# One pass over the tokens, chunk by chunk
# ---------------------------------------------------------------------------


# The fused path's two passes (triton.py). Their references exist for the
# self-test; the op runs them only where Triton does, and the chunked path
# elsewhere.
for _name, _reference in (("linear_cross_entropy_stats", class_index_stats_reference),
                          ("linear_cross_entropy_grads", class_index_grads_reference)):
    registry.register(registry.OpKernels(
        name=_name, reference=_reference,
        triton=f"effilayers.ops.linear_cross_entropy.triton:class_index_{_name.rsplit('_', 1)[1]}"))


def _fused_kernels(device: torch.device):
    """(statistics pass, gradient pass) of the fused path where its Triton
    kernels run (CUDA, or CPU tensors under TRITON_INTERPRET=1 when forced),
    unless torch is asked for deterministic algorithms (their atomic float
    adds sum in a varying order); else None, and the chunked path runs."""
    if torch.are_deterministic_algorithms_enabled():
        return None
    stats, grads = (registry.choice(name, device.type) for name in
                    ("linear_cross_entropy_stats", "linear_cross_entropy_grads"))
    if stats.backend != "triton" or grads.backend != "triton":
        return None
    return stats.kernel, grads.kernel


def _chunks(input, weight, target, bias, class_weight, ignore_index, label_smoothing, chunk_size, compute_dtype,
            grad_scale, row_scale, needs, keep_rows, filter_eps=0.0):
    """Walk the tokens in chunks: logits = x W^T + b, one row-kernel call
    (loss and, when a gradient is wanted, d loss / d logits written over the
    logits), then the chunk's share of each gradient. ``row_scale``: None or
    a per-token multiplier of the logits' gradient. Returns (loss rows or
    None, grad_input or None, grad_weight and grad_bias in the accumulation
    dtype or None)."""
    tokens, hidden = input.shape
    classes = weight.shape[0]
    device = input.device
    acc = accumulation_dtype(compute_dtype)
    soft = target.is_floating_point()
    if not soft:  # the row kernels read int64 class indices, row r at offset r
        target = target.to(torch.int64).contiguous()
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    kernel_weight = None if class_weight is None else class_weight.to(acc).contiguous()
    # CPU has no fp16/bf16 GEMM with a float32 output: the weight gradient
    # reads a float32 copy of each chunk's logits gradient, which counts
    # against the chunk's bytes too.
    needs_scratch = (needs[1] or needs[2]) and compute_dtype != acc and device.type != "cuda"
    bytes_per_logit = compute_dtype.itemsize + (acc.itemsize if needs_scratch else 0)
    # A vocabulary chunk's gradient feeds grad_input's float32 sum as well: any gradient reads the copy.
    wide_copy = any(needs) and compute_dtype != acc and device.type != "cuda"
    vocab_bytes = vocab_chunk_bytes(compute_dtype, acc, wide_copy)
    step, vocab_step = chunk_shape(tokens, classes, bytes_per_logit, vocab_bytes,
                                   input.numel() * input.element_size(), chunk_size)
    loss_rows = torch.empty(tokens, dtype=acc, device=device) if keep_rows else None
    grad_input = torch.empty((tokens, hidden), dtype=input.dtype, device=device) if needs[0] else None
    grad_weight = torch.zeros((classes, hidden), dtype=acc, device=device) if needs[1] else None
    grad_bias = torch.zeros((classes,), dtype=acc, device=device) if needs[2] else None
    write_grad = any(needs)
    fused = None if soft or chunk_size is not None else _fused_kernels(device)
    if filter_eps and fused is None:
        raise ValueError(
            f"effilayers {OP}: filter_eps={filter_eps} applies to the fused Triton path (CUDA, class-index targets, "
            "no chunk_size, deterministic algorithms off); this call runs the chunked path, whose gradients are "
            "exact: pass filter_eps=0")
    if fused is not None:
        fused = (fused[0], functools.partial(fused[1], filter_eps=filter_eps))
        # No logits in memory at all: every token and class at once.
        # The kernels read rows of x and W, and b, with unit stride.
        rows = vocab_chunked_rows(
            input.to(compute_dtype).contiguous(), w.contiguous(), None if b is None else b.contiguous(), target,
            kernel_weight, ignore_index,
            label_smoothing, grad_scale, row_scale, needs, classes, acc, grad_input, grad_weight, grad_bias, fused)
        return (rows if keep_rows else None), grad_input, grad_weight, grad_bias
    if vocab_step < classes:
        for start in range(0, tokens, step):
            stop = min(start + step, tokens)
            rows = vocab_chunked_rows(
                input[start:stop].to(compute_dtype), w, b, target[start:stop], kernel_weight, ignore_index,
                label_smoothing, grad_scale, None if row_scale is None else row_scale[start:stop], needs,
                vocab_step, acc, None if grad_input is None else grad_input[start:stop], grad_weight, grad_bias)
            if keep_rows:
                loss_rows[start:stop] = rows
        return loss_rows, grad_input, grad_weight, grad_bias
    if soft:
        terms = probability_terms(kernel_weight, label_smoothing, classes, acc, device)
    else:
        rows_kernel = registry.kernel("cross_entropy", device)
    # One logits buffer for every chunk: a fresh chunk-sized allocation per
    # chunk costs page faults each time on CPU, and glibc keeps some of the
    # freed chunks (its mmap threshold rises to their size), which grew the
    # resident set to several chunks.
    buffer = torch.empty((min(step, tokens), classes), dtype=compute_dtype, device=device)
    scratch = torch.empty(buffer.shape, dtype=acc, device=device) if needs_scratch else None
    for start in range(0, tokens, step):
        stop = min(start + step, tokens)
        x = input[start:stop].to(compute_dtype)
        logits = buffer[:stop - start]
        if b is None:
            torch.mm(x, w.t(), out=logits)
        else:
            torch.addmm(b, x, w.t(), out=logits)
        if soft:
            rows = whole_probability_rows(logits, target[start:stop], terms, grad_scale, write_grad)
        else:
            view = logits.view(stop - start, classes, 1)
            rows = rows_kernel(view, target[start:stop], kernel_weight, view if write_grad else None, grad_scale,
                               ignore_index, label_smoothing)
        if keep_rows:
            loss_rows[start:stop] = rows
        if not write_grad:
            continue
        # From here `logits` holds d loss / d logits for this chunk.
        if row_scale is not None:
            logits.mul_(row_scale[start:stop, None])
        if needs[0]:
            if grad_input.dtype == compute_dtype:
                torch.mm(logits, w, out=grad_input[start:stop])
            else:  # autocast: the input's own dtype differs from the matmuls'
                grad_input[start:stop] = torch.mm(logits, w)
        if needs[1] or needs[2]:
            wide = logits
            if scratch is not None:  # one float32 copy serves both sums
                wide = scratch[:stop - start]
                wide.copy_(logits)
            if needs[1]:
                accumulate_product(grad_weight, wide.t(), x)
            if needs[2]:
                grad_bias += wide.sum(0, dtype=acc)
    return loss_rows, grad_input, grad_weight, grad_bias


def _mean_divisor(target, class_weight, token_weight, ignore_index, acc):
    """sum_i s_i * d_i (see the package docstring) as a 1-element tensor, no sync."""
    if target.is_floating_point():
        per_token = torch.ones(target.shape[0], dtype=acc, device=target.device)
    else:
        valid = target != ignore_index
        if class_weight is None:
            per_token = valid.to(acc)
        else:
            safe = torch.where(valid, target, 0).clamp(0, class_weight.shape[0] - 1)
            per_token = class_weight.to(acc)[safe] * valid
    if token_weight is not None:
        per_token = per_token * token_weight.to(acc)
    return per_token.sum().reshape(1)


def _nothing(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype)


# ---------------------------------------------------------------------------
# Custom ops: the forward pass (with the gradients, for mean and sum) and the
# backward pass of reduction="none" (recomputing the chunks)
# ---------------------------------------------------------------------------

_ARGUMENTS = ("Tensor input, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, Tensor? token_weight, "
              "SymInt ignore_index, float label_smoothing")
_WANTS = ("int? chunk_size, bool grad_input, bool grad_weight, bool grad_bias, ScalarType compute_dtype, "
          "float filter_eps")


def _forward(input, weight, target, bias, class_weight, token_weight, ignore_index, label_smoothing, reduction,
             chunk_size, grad_input, grad_weight, grad_bias, compute_dtype, filter_eps, loss_dtype):
    """(loss, grad_input, grad_weight, grad_bias): the loss in ``loss_dtype``;
    the gradients of the reduced loss, grad_input in the input's dtype,
    grad_weight / grad_bias in the accumulation dtype (cast once, in
    backward, after scaling by grad_output); empty where not wanted."""
    acc = accumulation_dtype(compute_dtype)
    needs = (grad_input, grad_weight, grad_bias and bias is not None)
    # The body casts explicitly; autocast must not re-cast the float32 sums.
    with torch.autocast(input.device.type, enabled=False):
        total = None
        if reduction == "mean":
            total = _mean_divisor(target, class_weight, token_weight, ignore_index, acc)
            # sum of weights 0: torch's mean is 0 / 0 = NaN, and so is its gradient on counted rows.
            grad_scale = torch.where(total == 0, math.nan, 1.0 / total)
        else:
            grad_scale = torch.ones(1, dtype=acc, device=input.device)
        row_scale = None if token_weight is None else token_weight.to(acc)
        rows, gi, gw, gb = _chunks(input, weight, target, bias, class_weight, ignore_index, label_smoothing,
                                   chunk_size, compute_dtype, grad_scale, row_scale, needs, keep_rows=True,
                                   filter_eps=filter_eps)
        if row_scale is not None:
            rows = rows * row_scale
        if reduction == "none":
            loss = rows
        else:
            loss = rows.sum()
            if reduction == "mean":
                loss = torch.where(total == 0, math.nan, loss / total).reshape(())
    return (loss.to(loss_dtype),
            gi if gi is not None else _nothing(input, input.dtype),
            gw if gw is not None else _nothing(input, acc),
            gb if gb is not None else _nothing(input, acc))


def _backward_unreduced(grad_output, input, weight, target, bias, class_weight, token_weight, ignore_index,
                        label_smoothing, chunk_size, grad_input, grad_weight, grad_bias, compute_dtype, filter_eps):
    """Gradients of sum_i grad_output_i * loss_i, recomputing each chunk's
    logits; grad_weight / grad_bias cast to the parameters' dtypes."""
    acc = accumulation_dtype(compute_dtype)
    needs = (grad_input, grad_weight, grad_bias and bias is not None)
    with torch.autocast(input.device.type, enabled=False):
        row_scale = grad_output.reshape(-1).to(acc)
        if token_weight is not None:
            row_scale = row_scale * token_weight.to(acc)
        grad_scale = torch.ones(1, dtype=acc, device=input.device)
        _, gi, gw, gb = _chunks(input, weight, target, bias, class_weight, ignore_index, label_smoothing,
                                chunk_size, compute_dtype, grad_scale, row_scale, needs, keep_rows=False,
                                filter_eps=filter_eps)
    return (gi if gi is not None else _nothing(input, input.dtype),
            gw.to(weight.dtype) if gw is not None else _nothing(input, weight.dtype),
            gb.to(bias.dtype) if gb is not None else _nothing(input, input.dtype))


_linear_cross_entropy_forward = torch.library.custom_op(
    "effilayers::linear_cross_entropy_forward", _forward, mutates_args=(),
    schema=f"({_ARGUMENTS}, str reduction, {_WANTS}, ScalarType loss_dtype) -> (Tensor, Tensor, Tensor, Tensor)",
)
_linear_cross_entropy_backward = torch.library.custom_op(
    "effilayers::linear_cross_entropy_backward", _backward_unreduced, mutates_args=(),
    schema=f"(Tensor grad_output, {_ARGUMENTS}, {_WANTS}) -> (Tensor, Tensor, Tensor)",
)


@_linear_cross_entropy_forward.register_fake
def _(input, weight, target, bias, class_weight, token_weight, ignore_index, label_smoothing, reduction, chunk_size,
      grad_input, grad_weight, grad_bias, compute_dtype, filter_eps, loss_dtype):
    acc = accumulation_dtype(compute_dtype)
    loss = input.new_empty((input.shape[0],) if reduction == "none" else (), dtype=loss_dtype)
    gi = input.new_empty(input.shape) if grad_input else _nothing(input, input.dtype)
    gw = input.new_empty(weight.shape, dtype=acc) if grad_weight else _nothing(input, acc)
    gb = input.new_empty((weight.shape[0],), dtype=acc) if grad_bias and bias is not None else _nothing(input, acc)
    return loss, gi, gw, gb


@_linear_cross_entropy_backward.register_fake
def _(grad_output, input, weight, target, bias, class_weight, token_weight, ignore_index, label_smoothing,
      chunk_size, grad_input, grad_weight, grad_bias, compute_dtype, filter_eps):
    gi = input.new_empty(input.shape) if grad_input else _nothing(input, input.dtype)
    gw = weight.new_empty(weight.shape) if grad_weight else _nothing(input, weight.dtype)
    gb = bias.new_empty(bias.shape) if grad_bias and bias is not None else _nothing(input, input.dtype)
    return gi, gw, gb


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, target, class_weight, token_weight, settings):
        ignore_index, label_smoothing, reduction, chunk_size, grad_mode, compute_dtype, loss_dtype, filter_eps = \
            settings
        # needs_input_grad says True under no_grad too: grad_mode (read before apply) keeps
        # no_grad / inference_mode calls from computing gradients nobody will use.
        needs = tuple(bool(ctx.needs_input_grad[i] and grad_mode) for i in range(3))
        ctx.settings, ctx.needs = settings, needs
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        fused = reduction != "none" and any(needs)
        forward = _forward if registry.runs_eagerly(input) else _linear_cross_entropy_forward
        loss, gi, gw, gb = forward(input, weight, target, bias, class_weight, token_weight, ignore_index,
                                   label_smoothing, reduction, chunk_size, fused and needs[0], fused and needs[1],
                                   fused and needs[2], compute_dtype, filter_eps, loss_dtype)
        if fused:
            ctx.save_for_backward(gi, gw, gb)
        elif any(needs):
            # reduction="none": the per-token grad_output is known only in
            # backward, and grad_weight = sum_i g_i * dl_i^T x_i cannot be
            # rebuilt from an unscaled sum, so backward recomputes the chunks.
            ctx.save_for_backward(input, weight, target, bias, class_weight, token_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
            raise RuntimeError(
                f"effilayers {OP}: double backward is not supported (the gradients are computed by chunks without "
                "a graph), so backward(create_graph=True) through it is refused; use torch.nn.functional.linear + "
                "cross_entropy for higher-order gradients"
            )
        ignore_index, label_smoothing, reduction, chunk_size, _, compute_dtype, _, filter_eps = ctx.settings
        needs = ctx.needs
        if reduction == "none":
            input, weight, target, bias, class_weight, token_weight = ctx.saved_tensors
            backward = _backward_unreduced if registry.runs_eagerly(grad_output) else _linear_cross_entropy_backward
            gi, gw, gb = backward(grad_output, input, weight, target, bias, class_weight, token_weight, ignore_index,
                                  label_smoothing, chunk_size, *needs, compute_dtype, filter_eps)
        else:
            gi, gw, gb = ctx.saved_tensors
            # retain_graph=True (gradcheck, a second backward) and torch.compile
            # (which plans its own buffers) scale copies; the usual single
            # backward scales the saved buffers in place.
            keep = torch.compiler.is_compiling() or torch._C._autograd._get_current_graph_task_keep_graph()
            if keep:
                gi, gw, gb = gi.clone(), gw.clone(), gb.clone()
            gi = gi.mul_(grad_output)
            # The one cast of the float32 sums to the parameters' dtypes.
            gw = gw.mul_(grad_output).to(ctx.weight_dtype)
            gb = gb.mul_(grad_output).to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return (gi if needs[0] else None, gw if needs[1] else None, gb if needs[2] else None,
                None, None, None, None)


# ---------------------------------------------------------------------------
# The functional op
# ---------------------------------------------------------------------------


def _autocasting(input) -> bool:
    return (isinstance(input, torch.Tensor) and input.dtype in INPUT_DTYPES and input.dtype != torch.float64
            and torch.is_autocast_enabled(input.device.type))


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    class_weight: Optional[torch.Tensor] = None,
    token_weight: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    filter_eps: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, weight, bias), target, ...)`` without
    ever holding the whole logits: the tokens (and, for wide vocabularies,
    the classes) are processed in chunks, and each chunk's logits are the
    only logits-shaped memory alive at a time.

    ``input``: ``(..., hidden)``; ``weight``: ``(classes, hidden)``;
    ``bias``: ``(classes,)`` or None; ``target``: class indices of shape
    ``input.shape[:-1]``, or class probabilities of shape
    ``input.shape[:-1] + (classes,)``; ``class_weight``: ``(classes,)`` (torch's
    ``weight``); ``token_weight``: ``input.shape[:-1]``, one weight per token.

    ``chunk_size`` (tokens per chunk): by default the most tokens whose logits
    take at most ``max(8 MiB, the input's bytes)`` in the compute dtype
    (counting, for fp16/bf16 on CPU, the float32 copy the weight gradient's
    GEMM reads). Where that is fewer than 32 tokens (and fewer than all), or
    a given ``chunk_size``'s rows overflow that budget, the vocabulary is
    chunked too: 32 tokens (or ``chunk_size``) by the most classes that fit,
    with an online float32 log-sum-exp across the vocabulary chunks. See the
    package docstring for how chunk sizes are chosen, the mean's definition
    with token weights, numerics, autocast and memory.

    ``filter_eps`` (default 0: exact gradients): on the fused path only, the
    gradient pass skips a tile of tokens x classes whose every
    ``|d loss / d logit|`` (before the reduction's scale) is below it, as Cut
    Cross-Entropy's filtering does: cheaper, and inexact by up to that much
    per skipped logit. A call that runs the chunked path refuses it.
    """
    autocasting = _autocasting(input)
    check_arguments(input, weight, target, bias, ignore_index, label_smoothing, reduction, class_weight,
                    token_weight, chunk_size, autocasting, filter_eps)
    refuse_forward_ad(OP, input, weight, bias)
    classes, hidden = weight.shape
    check_target_range(target, ignore_index, classes)
    batch_shape = input.shape[:-1]
    if autocasting:
        # As torch.autocast runs F.linear (in the autocast dtype) and then
        # F.cross_entropy (in float32): the matmuls take the autocast dtype,
        # the loss is float32.
        compute_dtype = torch.get_autocast_dtype(input.device.type)
        loss_dtype = torch.float32
    else:
        compute_dtype = loss_dtype = input.dtype
    rows_target = target.reshape(-1, classes) if target.is_floating_point() else target.reshape(-1)
    if is_sharded(weight) or is_sharded(bias):
        if runs_vocab_parallel(weight, bias, target, reduction, autocasting):
            if filter_eps:
                raise ValueError(f"effilayers {OP}: filter_eps applies to the fused Triton path, not to the "
                                 "vocabulary-parallel one (a sharded weight): pass filter_eps=0")
            return vocab_parallel_linear_cross_entropy(
                input.reshape(-1, hidden), weight, rows_target, bias, ignore_index, label_smoothing, reduction,
                class_weight, None if token_weight is None else token_weight.reshape(-1), chunk_size, chunk_tokens)
        # Any other placement or option: whole parameters, as F.linear would
        # need them; DTensor's autograd shards their gradients back.
        weight = weight.full_tensor() if is_sharded(weight) else weight
        bias = bias.full_tensor() if is_sharded(bias) else bias
    settings = (int(ignore_index), float(label_smoothing), reduction, chunk_size, torch.is_grad_enabled(),
                compute_dtype, loss_dtype, float(filter_eps))
    loss = _LinearCrossEntropyFunction.apply(
        input.reshape(-1, hidden), weight, bias, rows_target, class_weight,
        None if token_weight is None else token_weight.reshape(-1), settings,
    )
    return loss.reshape(batch_shape) if reduction == "none" else loss
