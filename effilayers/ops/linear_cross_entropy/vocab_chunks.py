"""One chunk of tokens against a vocabulary too wide to hold whole: the
classes are walked in chunks twice, each vocabulary chunk's logits
``x W_v^T + b_v`` computed by torch's matmul into one reused buffer (in the
compute dtype, as ``F.linear`` rounds them).

Class-index targets (the common case) run the cross_entropy family's two
chunk ops (``effilayers::``, their kernels C++ on CPU, Triton on GPU):

* ``cross_entropy_chunk_stats_`` folds each chunk into per-row running
  statistics in the accumulation dtype (float32, float64 for float64): an
  online log-sum-exp (a running maximum ``m`` and ``s = sum exp(z - m)``,
  rescaled when the maximum grows), the target's logit and, with label
  smoothing, ``sum_c w_c z_c``. The loss rows follow from them in a few
  per-row torch ops.
* when a gradient is wanted, each chunk's logits are recomputed and
  ``cross_entropy_chunk_grad_`` writes its slice of d loss / d logits
  (``coef * softmax - (the target's and the smoothing's share)``, scaled per
  row) over them in place; torch's matmuls then add it into grad_input (a
  float32 sum over the vocabulary chunks, cast once per token chunk),
  grad_weight and grad_bias (the caller's float32 accumulators). On CPU with
  fp16/bf16, which has no mixed-dtype GEMM, the matmuls read one float32 copy
  of the chunk's gradient.

Probability targets run the same two walks with the family's
``cross_entropy_soft_chunk_stats_`` / ``cross_entropy_soft_chunk_grad_``,
which read the chunk's slice of the caller's probabilities (any floating
dtype) beside its logits: the statistics gain ``sum_c q_c z_c`` and ``sum_c
q_c``, ``q`` being torch's smoothed, class-weighted probabilities (label
smoothing and class weights folded into two per-class vectors,
:func:`probability_terms`). Whole rows (the token chunks) take them too,
as one chunk of every class.

So a vocabulary chunk costs its logits (plus that float32 copy) and nothing
else chunk-sized, and the gradient never exists beyond one chunk.
"""

from __future__ import annotations

import math

import torch

from ..cross_entropy.op import chunk_grad_op, chunk_stats_op, soft_chunk_grad_op, soft_chunk_stats_op


def vocab_chunk_bytes(compute_dtype: torch.dtype, acc: torch.dtype, wide_copy: bool) -> int:
    """Bytes per logit of a vocabulary chunk: the compute-dtype logits, plus
    the float32 copy (``wide_copy``) that CPU matmuls read for fp16/bf16
    gradients."""
    return compute_dtype.itemsize + (acc.itemsize if wide_copy else 0)


# The fused path's gradient pass writes d loss / d logits for every token
# and a chunk of classes into one reused buffer G (tokens x chunk, compute
# dtype), which two GEMMs turn into the chunk's grad_weight rows and a share
# of grad_input. G takes at most max(GRADIENT_CHUNK_BYTES, a quarter of the
# input's bytes): memory bounded by the input, never by the vocabulary, and
# (at Gemma-2's and Llama-3's heads, 8192 tokens in bf16) 512 to 1024
# classes, wide enough for the GEMMs to fill the chip. Chunks are whole
# multiples of GRADIENT_CHUNK_ALIGN classes (every tile width divides it).
# Not tuned on a GPU yet.
GRADIENT_CHUNK_BYTES = 8 << 20
GRADIENT_CHUNK_ALIGN = 256


def gradient_chunk(tokens: int, classes: int, itemsize: int, input_bytes: int) -> int:
    """Classes per chunk of the fused gradient pass (see GRADIENT_CHUNK_BYTES)."""
    budget = max(GRADIENT_CHUNK_BYTES, input_bytes // 4)
    width = budget // (max(tokens, 1) * itemsize) // GRADIENT_CHUNK_ALIGN * GRADIENT_CHUNK_ALIGN
    return max(1, min(classes, max(width, GRADIENT_CHUNK_ALIGN)))


def accumulate_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b with the product kept in ``out``'s dtype (never rounded to
    fp16/bf16), in place: no product-sized temporary. On CPU, which has no
    mixed-dtype GEMM, ``a`` arrives already in ``out``'s dtype and ``b`` is
    widened (the callers pass it widened where it is reused)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b.to(out.dtype))
    else:
        # cuBLAS's fp16/bf16 GEMM accumulating into a float32 C (torch >= 2.11).
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)


def _chunk_logits(x, w, b, step, buffer):
    """(start, logits) of each vocabulary chunk, written into ``buffer`` as a
    contiguous (rows, width) view (overwritten by the next chunk)."""
    rows_n, classes = x.shape[0], w.shape[0]
    for start in range(0, classes, step):
        stop = min(start + step, classes)
        z = buffer[:rows_n * (stop - start)].view(rows_n, stop - start)
        if b is None:
            torch.mm(x, w[start:stop].t(), out=z)
        else:
            torch.addmm(b[start:stop], x, w[start:stop].t(), out=z)
        yield start, z


def new_stats(rows: int, acc: torch.dtype, device) -> torch.Tensor:
    """The (4, rows) statistics before the first chunk: a maximum of -inf, zero sums."""
    stats = torch.zeros((4, rows), dtype=acc, device=device)
    stats[0] = -math.inf
    return stats


class _Gradients:
    """Adds each vocabulary chunk's d loss / d logits into grad_input's
    float32 sum, grad_weight and grad_bias."""

    def __init__(self, x, w, needs, acc, grad_input, grad_weight, grad_bias):
        self.x, self.w, self.needs, self.acc = x, w, needs, acc
        self.grad_weight, self.grad_bias, self.grad_input = grad_weight, grad_bias, grad_input
        self.gi = torch.zeros((x.shape[0], x.shape[1]), dtype=acc, device=x.device) if needs[0] else None
        self.wide_x = x.to(acc) if needs[1] and x.device.type != "cuda" else x

    def add(self, g, start):
        stop = start + g.shape[1]
        if self.needs[0]:
            accumulate_product(self.gi, g, self.w[start:stop])
        if self.needs[1]:
            accumulate_product(self.grad_weight[start:stop], g.t(), self.wide_x)
        if self.needs[2]:
            self.grad_bias[start:stop] += g.sum(0, dtype=self.acc)

    def finish(self):
        if self.needs[0]:
            self.grad_input.copy_(self.gi)

    def walk(self, b, step, buffer, write_chunk_gradient):
        """The second walk: each chunk's logits recomputed,
        ``write_chunk_gradient(z, start, stop)`` writes d loss / d logits
        over them, and the chunk's share of each gradient is added."""
        # CPU matmuls take no fp16/bf16 operands with a float32 output: one float32 copy of each chunk's gradient.
        x, acc = self.x, self.acc
        wide = None if x.device.type == "cuda" or x.dtype == acc else torch.empty(buffer.shape, dtype=acc,
                                                                                 device=x.device)
        for start, z in _chunk_logits(x, self.w, b, step, buffer):
            write_chunk_gradient(z, start, start + z.shape[1])
            if wide is not None:
                z = wide[:z.numel()].view(z.shape).copy_(z)
            self.add(z, start)


def class_index_loss(lse, target_logit, smooth, w_t, class_weight, eps: float, classes: int):
    """``(loss rows, softmax coefficient of the gradient)`` of class-index
    rows from their log-sum-exp, target logit and (with label smoothing)
    ``sum_c w_c z_c``; ``w_t``: the targets' class weights (ones without)."""
    rows = (1.0 - eps) * w_t * (lse - target_logit)
    if eps <= 0:
        return rows, w_t
    sum_w = float(classes) if class_weight is None else class_weight.sum()
    return rows + eps / classes * (sum_w * lse - smooth), (1.0 - eps) * w_t + eps / classes * sum_w


def vocab_chunked_rows(x, w, b, target, class_weight, ignore_index, eps, grad_scale, row_scale, needs, step, acc,
                       grad_input, grad_weight, grad_bias):
    """Loss rows (accumulation dtype) of one token chunk ``x`` (compute
    dtype), walking the classes ``step`` at a time. When a gradient is wanted,
    writes ``grad_input`` (this chunk's rows, any dtype) and adds into
    ``grad_weight`` / ``grad_bias`` (accumulation dtype), the logits'
    gradient scaled by ``grad_scale`` (1 element) and ``row_scale`` (per row or
    None). ``acc``: the accumulation dtype (``accumulation_dtype`` of the
    compute dtype); ``class_weight``: None or in it; ``target``: int64 class
    indices, contiguous, or probabilities."""
    scale = grad_scale if row_scale is None else grad_scale * row_scale
    scale = scale.expand(x.shape[0])
    grads = _Gradients(x, w, needs, acc, grad_input, grad_weight, grad_bias) if any(needs) else None
    if target.is_floating_point():
        rows = _probability_rows(x, w, b, target, class_weight, eps, scale, step, acc, grads)
    else:
        rows = _class_index_rows(x, w, b, target, class_weight, ignore_index, eps, scale, step, acc, grads)
    if grads is not None:
        grads.finish()
    return rows


def class_index_row_terms(stats, target, class_weight, ignore_index, eps: float, classes: int):
    """``(loss rows, (3, rows) gradient terms)`` of class-index rows from
    their (4, rows) statistics (:func:`new_stats`'s layout after every
    class): the terms are the log-sum-exp, the softmax coefficient (NaN for
    a target out of range: on GPU nothing checked the range, a host check
    would synchronise, so such a row's loss and gradient are NaN, as the row
    kernels make them) and the target's coefficient, the first three rows of
    ``cross_entropy_chunk_grad_``'s ``row_terms``."""
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    out_of_range = valid & ((safe < 0) | (safe >= classes))
    safe = safe.clamp(0, classes - 1)
    running_max, sum_exp, target_logit, smooth = stats
    lse = running_max + torch.log(sum_exp)
    w_t = torch.ones_like(lse) if class_weight is None else class_weight[safe]
    rows, coef = class_index_loss(lse, target_logit, smooth, w_t, class_weight, eps, classes)
    rows = torch.where(valid, torch.where(out_of_range, math.nan, rows), 0.0)
    coef = torch.where(out_of_range, math.nan, coef)
    return rows, torch.stack((lse, coef.expand_as(lse), (1.0 - eps) * w_t))


def _class_index_rows(x, w, b, target, class_weight, ignore_index, eps, scale, step, acc, grads):
    rows_n, classes = x.shape[0], w.shape[0]
    smoothing = eps > 0
    stats = new_stats(rows_n, acc, x.device)
    buffer = torch.empty(rows_n * min(step, classes), dtype=x.dtype, device=x.device)
    stats_kernel = chunk_stats_op
    for start, z in _chunk_logits(x, w, b, step, buffer):
        chunk_weight = None if class_weight is None or not smoothing else class_weight[start:start + z.shape[1]]
        stats_kernel(z, target, chunk_weight, stats, start, ignore_index, smoothing)
    rows, terms = class_index_row_terms(stats, target, class_weight, ignore_index, eps, classes)
    if grads is None:
        return rows
    row_terms = torch.cat((terms, scale[None]))
    class_term = smoothing_term(class_weight, eps, classes, acc, x.device) if smoothing else None
    grad_kernel = chunk_grad_op
    grads.walk(b, step, buffer, lambda z, start, stop: grad_kernel(
        z, target, None if class_term is None else class_term[start:stop], row_terms, start, ignore_index))
    return rows


def smoothing_term(class_weight, eps: float, classes: int, acc, device, count=None):
    """Label smoothing's share of each class's target weight, ``eps / C *
    w_c``: the ``class_term`` of the chunk kernels; over ``class_weight``'s
    classes, or without class weights (``w_c = 1``) over ``count`` classes
    (default all ``classes``)."""
    if class_weight is None:
        return torch.full((classes if count is None else count,), eps / classes, dtype=acc, device=device)
    return eps / classes * class_weight


def probability_terms(class_weight, eps: float, classes: int, acc, device):
    """``(prob_weight, class_term)`` of the probability kernels, each
    ``(classes,)`` or None: ``q_c = p_c * prob_weight_c + class_term_c`` is
    torch's weighting of a probability target, ``((1 - eps) p_c + eps / C)
    w_c`` (``w_c = 1`` without class weights)."""
    if eps <= 0:
        return class_weight, None
    prob_weight = (torch.full((classes,), 1.0 - eps, dtype=acc, device=device) if class_weight is None
                   else (1.0 - eps) * class_weight)
    return prob_weight, smoothing_term(class_weight, eps, classes, acc, device)


def _sliced(terms, start, stop):
    return tuple(None if t is None else t[start:stop] for t in terms)


def probability_loss(stats):
    """``(loss rows, log-sum-exp, sum_c q_c)`` of probability rows from their
    statistics: ``sum_c q_c (lse - z_c) = lse * sum_c q_c - sum_c q_c z_c``."""
    lse = stats[0] + torch.log(stats[1])
    return stats[3] * lse - stats[2], lse, stats[3]


def whole_probability_rows(logits, probs, terms, scale, write_grad):
    """Loss rows (accumulation dtype) of ``(rows, classes)`` logits holding
    every class, against ``probs``, ``terms``: :func:`probability_terms`;
    with ``write_grad``, d loss / d logits times ``scale`` (1 element) is
    written over the logits."""
    rows_n = logits.shape[0]
    stats = new_stats(rows_n, scale.dtype, logits.device)  # the scale is in the accumulation dtype
    soft_chunk_stats_op(logits, probs, *terms, stats)
    rows, lse, mass = probability_loss(stats)
    if write_grad:
        row_terms = torch.stack((lse, mass, scale.expand(rows_n)))
        soft_chunk_grad_op(logits, probs, *terms, row_terms)
    return rows


def _probability_rows(x, w, b, probs, class_weight, eps, scale, step, acc, grads):
    """Probability targets: the same two walks with the soft chunk kernels."""
    rows_n, classes = x.shape[0], w.shape[0]
    device = x.device
    terms = probability_terms(class_weight, eps, classes, acc, device)
    stats = new_stats(rows_n, acc, device)
    buffer = torch.empty(rows_n * min(step, classes), dtype=x.dtype, device=device)
    stats_kernel = soft_chunk_stats_op
    for start, z in _chunk_logits(x, w, b, step, buffer):
        stop = start + z.shape[1]
        stats_kernel(z, probs[:, start:stop], *_sliced(terms, start, stop), stats)
    rows, lse, mass = probability_loss(stats)
    if grads is None:
        return rows
    row_terms = torch.stack((lse, mass, scale))
    grad_kernel = soft_chunk_grad_op
    grads.walk(b, step, buffer, lambda z, start, stop: grad_kernel(
        z, probs[:, start:stop], *_sliced(terms, start, stop), row_terms))
    return rows
