"""The chunked pass, its two composition ops, the autograd Function over them and
the public function (see the package docstring for numerics and contracts)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..._core import registry
from ..._core.dtypes import accumulation_dtype
from ..._core.layout import refuse_forward_ad

# The cross_entropy family's row op, run on each chunk of logits.
from ..cross_entropy.op import rows_op
from .contract import INPUT_DTYPES, OP, check_arguments, check_target_range
from .reference import class_index_grads_reference, class_index_stats_reference
from .vocab_chunks import (
    accumulate_product,
    class_index_row_terms,
    gradient_chunk,
    probability_terms,
    smoothing_term,
    vocab_chunk_bytes,
    vocab_chunked_rows,
    whole_probability_rows,
)
from .vocab_parallel import is_sharded, runs_vocab_parallel, vocab_parallel_linear_cross_entropy

# The functions effilayers.functional exports from this family (effilayers/functional.py finds them here).
FUNCTIONAL = ("linear_cross_entropy",)

# A chunk of logits takes at most this many bytes, or the input's own size
# when that is larger: a large input (many tokens, a wide hidden size) gets
# taller chunks and fewer trips through the loop, while a chunk stays no
# larger than a tensor the caller already holds. 8 MiB, not 16: at issue
# 32's CPU shape (4096 tokens x hidden 256 x 32768 classes, float32) the
# gradients alone are 0.07x the logits, and a 16 MiB chunk left the peak
# above the 0.1x target (benchmarks/results/linear_cross_entropy-cpu-table-*).
CHUNK_LOGITS_BYTES = 8 << 20

# The fused path's float32 sum of grad_input (fp16/bf16 inputs) takes at most
# this share of the gradients' own bytes, the memory a step cannot avoid:
# more tokens than that are summed a block at a time, each later block
# forming its logits again. At Gemma-2's head (8192 x 2304 x 256000, bf16)
# the whole sum is 6% of the gradients, one block; at Llama-3's (8192 x 4096
# x 128256) it would be 12%, so two blocks. Together with the buffer of the
# logits' gradient (vocab_chunks.gradient_chunk) this keeps the peak within
# the 1.1x of the gradients.
INPUT_SUM_SHARE = 1 / 16


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
    kernels run (CUDA, or CPU tensors under TRITON_INTERPRET=1 when forced);
    else None, and the chunked path runs. Neither sums with atomics, so the
    fused path is deterministic and runs under
    ``torch.use_deterministic_algorithms(True)`` too. Fake CUDA tensors on a
    machine without CUDA (a graph traced for a GPU elsewhere) take the
    chunked path, which resolves its kernels where it runs."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    stats, grads = (registry.choice(name, device.type) for name in
                    ("linear_cross_entropy_stats", "linear_cross_entropy_grads"))
    if stats.backend != "triton" or grads.backend != "triton":
        return None
    return stats.kernel, grads.kernel


@torch.compiler.assume_constant_result
def _fused_on(device_type: str) -> bool:
    # A constant to torch.compile: resolving the registry (its lock) is not
    # something dynamo traces, and the answer does not change within a graph.
    return _fused_kernels(torch.device(device_type)) is not None


def _runs_fused(input, target, chunk_size) -> bool:
    """Whether a call takes the fused path: class indices, no ``chunk_size``,
    and the fused kernels on the input's device."""
    return not target.is_floating_point() and chunk_size is None and _fused_on(input.device.type)


def _unit_stride(t):
    """``t`` with unit stride along its last dimension (the kernels' rows), a copy only where it has none."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _fused_rows(input, weight, target, bias, class_weight, ignore_index, label_smoothing, compute_dtype):
    """Loss rows (accumulation dtype) of the fused path's statistics pass, and
    the (3, tokens) terms its gradient pass reads (log-sum-exp, softmax and
    target coefficients: 12 bytes a token, kept whether or not a gradient
    follows). x, W and b are read in their own dtypes: under autocast the
    kernel rounds each tile to the compute dtype, so no cast copy is made."""
    acc = accumulation_dtype(compute_dtype)
    classes = weight.shape[0]
    target = target.to(torch.int64).contiguous()
    class_weight = None if class_weight is None else class_weight.to(acc).contiguous()
    smoothing = label_smoothing > 0
    stats = _fused_kernels(input.device)[0](
        _unit_stride(input), _unit_stride(weight), None if bias is None else bias.contiguous(), target,
        class_weight if smoothing else None, smoothing, dtype=compute_dtype)
    rows, terms = class_index_row_terms(stats, target, class_weight, ignore_index, label_smoothing, classes)
    return rows, terms


def _add_product(out, a, b):
    """``out += a @ b`` in ``out``'s dtype; on CPU (the interpreter's runs),
    which has no mixed-dtype GEMM, through float32 copies of this chunk's
    operands."""
    if a.dtype != out.dtype and out.device.type != "cuda":
        a, b = a.to(out.dtype), b.to(out.dtype)
    accumulate_product(out, a, b)


def _write_product(out, a, b):
    """``out = a @ b``, rounded once to ``out``'s dtype."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    elif out.device.type == "cuda":
        torch.mm(a, b, out_dtype=out.dtype, out=out)  # float32 out of fp16/bf16 operands (torch >= 2.11)
    else:
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def _fused_gradients(input, weight, target, bias, class_weight, terms, ignore_index, label_smoothing, scale, needs,
                     compute_dtype, filter_eps):
    """(grad_input, grad_weight, grad_bias) in the dtypes of input, weight
    and bias (None where not wanted) of the rows' loss scaled per row by
    ``scale`` (tokens,), from the statistics pass's ``terms``. Classes are
    walked in chunks (``vocab_chunks.gradient_chunk``): the gradient kernel
    writes the chunk's d loss / d logits, every scale applied before its one
    rounding to the compute dtype, into one reused buffer G; then
    ``grad_weight[chunk] = G^T x`` is written straight into the gradient
    (one GEMM, one rounding), ``grad_input += G W[chunk]`` accumulates in
    float32 (into grad_input itself when it is float32), and ``grad_bias
    [chunk] = sum G``. No atomics, no weight-sized float32 sum: the memory
    above the gradients is G, the float32 sum of grad_input for fp16/bf16
    inputs (a block of tokens at a time where the whole would pass
    ``INPUT_SUM_SHARE`` of the gradients), and per-token terms."""
    tokens, hidden = input.shape
    classes = weight.shape[0]
    device = input.device
    acc = accumulation_dtype(compute_dtype)
    target = target.to(torch.int64).contiguous()
    x, w, b = _unit_stride(input), _unit_stride(weight), None if bias is None else bias.contiguous()
    class_term = None
    if label_smoothing > 0:
        class_term = smoothing_term(None if class_weight is None else class_weight.to(acc), label_smoothing,
                                    classes, acc, device).contiguous()
    row_terms = torch.cat((terms, scale.reshape(1, tokens)))
    width = gradient_chunk(tokens, classes, compute_dtype.itemsize, input.numel() * input.element_size())
    buffer = torch.empty(tokens * min(width, classes), dtype=compute_dtype, device=device)
    grad_input = grad_weight = grad_bias = x_low = None
    new = torch.empty if tokens else torch.zeros  # no tokens: no chunk writes them
    if needs[1]:
        grad_weight = new(weight.shape, dtype=weight.dtype, device=device)
        x_low = x if x.dtype == compute_dtype else x.to(compute_dtype)  # autocast: the GEMM's operand, once
    if needs[2]:
        grad_bias = new(classes, dtype=bias.dtype, device=device)
    # grad_input's float32 sum, for fp16/bf16 inputs (a float32 input sums
    # into grad_input itself): for a block of tokens at a time where all of
    # them would take more than INPUT_SUM_SHARE of the gradients' bytes.
    block = max(tokens, 1)
    if needs[0]:
        # Summed into where the input is float32; written block by block from the sum where not.
        grad_input = (torch.zeros if input.dtype == acc else torch.empty)((tokens, hidden), dtype=input.dtype,
                                                                          device=device)
        if input.dtype != acc:
            gradient_bytes = sum(t.numel() * t.element_size() for t, wanted in zip((input, weight, bias), needs)
                                 if wanted)
            blocks = math.ceil(tokens * hidden * acc.itemsize / max(1.0, INPUT_SUM_SHARE * gradient_bytes))
            block = max(1, math.ceil(tokens / max(1, blocks)))
    input_sum = None
    if needs[0] and input.dtype != acc:
        input_sum = torch.empty((block, hidden), dtype=acc, device=device)
    kernel = _fused_kernels(device)[1]
    # The first walk over the classes forms G for every token when grad_weight
    # or grad_bias is wanted (their chunks are written once, whole) and sums
    # the first block's grad_input; each later block walks the classes again
    # for its own tokens (the price of a smaller sum: those logits formed
    # once more).
    for begin in range(0, tokens, block):
        end = min(begin + block, tokens)
        if begin > 0 and not needs[0]:
            break
        whole = begin == 0 and (needs[1] or needs[2] or block == tokens)
        rows = slice(0, tokens) if whole else slice(begin, end)
        summed = None
        if needs[0]:
            summed = grad_input[begin:end] if input_sum is None else input_sum[:end - begin].zero_()
        for start in range(0, classes, width):
            stop = min(start + width, classes)
            g = buffer[:(rows.stop - rows.start) * (stop - start)].view(rows.stop - rows.start, stop - start)
            kernel(x[rows], w, b, target[rows], class_term, row_terms[:, rows], ignore_index, start, g,
                   filter_eps=filter_eps)
            if needs[0]:
                chunk = w[start:stop]
                _add_product(summed, g[begin - rows.start:end - rows.start],
                             chunk if chunk.dtype == compute_dtype else chunk.to(compute_dtype))
            if whole and needs[1]:
                _write_product(grad_weight[start:stop], g.t(), x_low)
            if whole and needs[2]:
                grad_bias[start:stop] = g.sum(0, dtype=acc)
        if input_sum is not None:
            grad_input[begin:end] = summed
    return grad_input, grad_weight, grad_bias


def _chunks(input, weight, target, bias, class_weight, ignore_index, label_smoothing, chunk_size, compute_dtype,
            grad_scale, row_scale, needs, keep_rows):
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
            rows = rows_op(view, target[start:stop], kernel_weight, view if write_grad else None, grad_scale,
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
# Composition ops: the forward pass (with the gradients, for the chunked path's
# mean and sum) and the deferred backward pass (the fused path, every
# reduction="none", and fp16 on the chunked path)
# ---------------------------------------------------------------------------

_ARGUMENTS = ("Tensor input, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, Tensor? token_weight, "
              "SymInt ignore_index, float label_smoothing")
_WANTS = ("int? chunk_size, bool grad_input, bool grad_weight, bool grad_bias, ScalarType compute_dtype, "
          "float filter_eps")


def _forward(input, weight, target, bias, class_weight, token_weight, ignore_index, label_smoothing, reduction,
             chunk_size, grad_input, grad_weight, grad_bias, compute_dtype, filter_eps, loss_dtype, fused):
    """(loss, grad_input, grad_weight, grad_bias, terms): the loss in
    ``loss_dtype``; on the chunked path, the gradients of the reduced loss
    (those asked for), grad_input in the input's dtype, grad_weight /
    grad_bias in the accumulation dtype (cast once, in backward, after
    scaling by grad_output); on the fused path (``fused``, decided by the
    caller, which never computes gradients here), the (3, tokens) terms its
    gradient pass reads in backward; empty where not wanted."""
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
        terms = _nothing(input, acc)
        gi = gw = gb = None
        if fused:
            rows, terms = _fused_rows(input, weight, target, bias, class_weight, ignore_index, label_smoothing,
                                      compute_dtype)
        else:
            rows, gi, gw, gb = _chunks(input, weight, target, bias, class_weight, ignore_index, label_smoothing,
                                       chunk_size, compute_dtype, grad_scale, row_scale, needs, keep_rows=True)
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
            gb if gb is not None else _nothing(input, acc),
            terms)


def _backward_deferred(grad_output, input, weight, target, bias, class_weight, token_weight, terms, ignore_index,
                       label_smoothing, reduction, chunk_size, grad_input, grad_weight, grad_bias, compute_dtype,
                       filter_eps, fused):
    """Gradients of the loss for ``grad_output``, computed here rather than in
    forward: the fused path from its statistics pass's ``terms``, the
    chunked path recomputing each chunk's logits. grad_output, the mean's
    scale and the token weights are multiplied in float32 before the logits'
    gradient is rounded to the compute dtype (a loss scaler's factor keeps
    fp16's small gradients from underflowing, as in torch). grad_weight /
    grad_bias in the parameters' dtypes."""
    acc = accumulation_dtype(compute_dtype)
    needs = (grad_input, grad_weight, grad_bias and bias is not None)
    with torch.autocast(input.device.type, enabled=False):
        grad_output = grad_output.to(acc)
        if reduction == "none":
            grad_scale, row_scale = torch.ones(1, dtype=acc, device=input.device), grad_output.reshape(-1)
            if token_weight is not None:
                row_scale = row_scale * token_weight.to(acc)
        else:
            grad_scale = grad_output.reshape(1)
            if reduction == "mean":
                total = _mean_divisor(target, class_weight, token_weight, ignore_index, acc)
                grad_scale = torch.where(total == 0, math.nan, grad_scale / total)
            row_scale = None if token_weight is None else token_weight.to(acc)
        if fused:
            scale = grad_scale.expand(input.shape[0]) if row_scale is None else grad_scale * row_scale
            gi, gw, gb = _fused_gradients(input, weight, target, bias, class_weight, terms, ignore_index,
                                          label_smoothing, scale, needs, compute_dtype, filter_eps)
        else:
            _, gi, gw, gb = _chunks(input, weight, target, bias, class_weight, ignore_index, label_smoothing,
                                    chunk_size, compute_dtype, grad_scale, row_scale, needs, keep_rows=False)
            gw = None if gw is None else gw.to(weight.dtype)
            gb = None if gb is None else gb.to(bias.dtype)
    return (gi if gi is not None else _nothing(input, input.dtype),
            gw if gw is not None else _nothing(input, weight.dtype),
            gb if gb is not None else _nothing(input, input.dtype))


def _forward_fake(input, weight, target, bias, class_weight, token_weight, ignore_index, label_smoothing, reduction,
                  chunk_size, grad_input, grad_weight, grad_bias, compute_dtype, filter_eps, loss_dtype, fused):
    acc = accumulation_dtype(compute_dtype)
    loss = input.new_empty((input.shape[0],) if reduction == "none" else (), dtype=loss_dtype)
    gi = input.new_empty(input.shape) if grad_input else _nothing(input, input.dtype)
    gw = input.new_empty(weight.shape, dtype=acc) if grad_weight else _nothing(input, acc)
    gb = input.new_empty((weight.shape[0],), dtype=acc) if grad_bias and bias is not None else _nothing(input, acc)
    terms = input.new_empty((3, input.shape[0]), dtype=acc) if fused else _nothing(input, acc)
    return loss, gi, gw, gb, terms


def _backward_fake(grad_output, input, weight, target, bias, class_weight, token_weight, terms, ignore_index,
                   label_smoothing, reduction, chunk_size, grad_input, grad_weight, grad_bias, compute_dtype,
                   filter_eps, fused):
    gi = input.new_empty(input.shape) if grad_input else _nothing(input, input.dtype)
    gw = weight.new_empty(weight.shape) if grad_weight else _nothing(input, weight.dtype)
    gb = bias.new_empty(bias.shape) if grad_bias and bias is not None else _nothing(input, input.dtype)
    return gi, gw, gb


# Compositions (chunk loops over matmuls and the row kernels): a traced graph
# holds one op each way, with the shapes of the fake kernels above.
_linear_cross_entropy_forward = registry.declare(
    "linear_cross_entropy_forward",
    f"({_ARGUMENTS}, str reduction, {_WANTS}, ScalarType loss_dtype, bool fused) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _forward_fake, composition=_forward)
_linear_cross_entropy_backward = registry.declare(
    "linear_cross_entropy_backward",
    f"(Tensor grad_output, {_ARGUMENTS[:_ARGUMENTS.index(', SymInt')]}, Tensor terms, "
    f"SymInt ignore_index, float label_smoothing, str reduction, {_WANTS}, bool fused) -> (Tensor, Tensor, Tensor)",
    _backward_fake, composition=_backward_deferred)


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
        fused = _runs_fused(input, target, chunk_size)
        if filter_eps and not fused:
            raise ValueError(
                f"effilayers {OP}: filter_eps={filter_eps} applies to the fused Triton path (CUDA, class-index "
                "targets, no chunk_size); this call runs the chunked path, whose gradients are exact: pass "
                "filter_eps=0")
        # The gradients wait for backward (and its grad_output) on the fused
        # path, for reduction="none" (grad_weight = sum_i g_i * dl_i^T x_i
        # cannot be rebuilt from an unscaled sum) and for fp16, whose
        # gradient must be scaled (by a GradScaler's factor, say) before it
        # is rounded; the chunked path's fp32/bf16 mean and sum compute them
        # here, with the logits at hand, and backward only scales them.
        ctx.fused = fused
        ctx.deferred = fused or reduction == "none" or compute_dtype == torch.float16
        early = any(needs) and not ctx.deferred
        forward = _forward if registry.runs_eagerly(input) else _linear_cross_entropy_forward
        loss, gi, gw, gb, terms = forward(
            input, weight, target, bias, class_weight, token_weight, ignore_index, label_smoothing, reduction,
            chunk_size, early and needs[0], early and needs[1], early and needs[2], compute_dtype, filter_eps,
            loss_dtype, fused)
        if early:
            ctx.save_for_backward(gi, gw, gb)
        elif any(needs):
            # References to the inputs (no copy), and the fused path's per-token terms.
            ctx.save_for_backward(input, weight, target, bias, class_weight, token_weight, terms)
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
        if ctx.deferred:
            input, weight, target, bias, class_weight, token_weight, terms = ctx.saved_tensors
            backward = _backward_deferred if registry.runs_eagerly(grad_output) else _linear_cross_entropy_backward
            gi, gw, gb = backward(grad_output, input, weight, target, bias, class_weight, token_weight, terms,
                                  ignore_index, label_smoothing, reduction, chunk_size, *needs, compute_dtype,
                                  filter_eps, ctx.fused)
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
    gradient pass zeroes a tile of tokens x classes whose every
    ``|d loss / d logit|`` (before the reduction's scale) is below it, as Cut
    Cross-Entropy's filtering does: inexact by up to that much per zeroed
    logit (and, with cuBLAS multiplying the chunk whole, no cheaper). A call
    that runs the chunked path refuses it.
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
