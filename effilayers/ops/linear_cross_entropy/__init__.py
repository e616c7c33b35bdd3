"""Fused linear + cross-entropy whose logits never exist whole.

``linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100,
label_smoothing=0.0, reduction="mean", class_weight=None, token_weight=None,
chunk_size=None, filter_eps=0.0)`` computes ``F.cross_entropy(F.linear(input, weight, bias),
target, weight=class_weight, ignore_index=..., label_smoothing=...,
reduction=...)``, with optional per-token weights, over chunks of tokens
(and of the classes, for vocabularies too wide for a useful token chunk).

How it runs
    For each chunk of ``chunk_size`` tokens: ``logits = x W^T + b`` (torch's
    matmul: MKL/oneDNN on CPU, cuBLAS on GPU), then one call of the
    cross_entropy family's row op (``effilayers::cross_entropy``: its C++
    kernel on CPU, the Triton ``cross_entropy_rows`` kernel on GPU, as for
    ``cross_entropy``) which accumulates the log-sum-exp in
    float32 and writes d loss / d logits over the chunk's logits; then
    ``grad_input[chunk] = dlogits @ W``, ``grad_weight += dlogits^T x`` and
    ``grad_bias += sum(dlogits)``, the last two in float32 accumulators
    (float64 for float64 input) whatever the number of chunks. Probability
    targets take the family's two probability kernels instead of the row
    kernel (``cross_entropy_soft_chunk_stats_``, then
    ``cross_entropy_soft_chunk_grad_`` writing the gradient over the logits),
    each chunk of whole rows being one chunk of every class for them.

The fused path: no logits in memory at all
    Where the cross_entropy family runs Triton (on CUDA; on CPU tensors
    under ``TRITON_INTERPRET=1`` when forced, as the tests do), class-index
    targets without an explicit ``chunk_size`` take two Triton kernels
    (``triton.py``) instead of the chunks. Forward: a statistics pass forms
    the logits tile by tile on the tensor cores and folds each tile into
    every token's running log-sum-exp, target logit and smoothing sum;
    autograd keeps those per-token terms (3 floats a token) and references
    to the inputs. Backward, for every reduction: the classes are walked in
    chunks (``vocab_chunks.gradient_chunk``: a buffer G of tokens x chunk in
    the compute dtype, at most ``max(8 MiB, a quarter of the input's
    bytes)``); per chunk a kernel forms the logits again and writes their
    gradient into G, then ``grad_weight[chunk] = G^T x`` goes straight into
    the gradient (one GEMM, one rounding), ``grad_input += G W[chunk]``
    sums in float32 and ``grad_bias[chunk] = sum G``. The logits are rounded
    to the compute dtype where they are made, as ``F.linear`` returns them,
    and their gradient once after every scale (grad_output's included), so
    the fused path computes what torch's unfused pair does. No atomics: it
    is deterministic. The chunked path runs instead for probability targets
    and an explicit ``chunk_size`` (which is how a benchmark compares the
    two). ``filter_eps`` (opt-in, default 0) zeroes the gradient of tiles
    whose every gradient is below it, Cut Cross-Entropy's filtering: inexact,
    so never the default; a call that runs the chunked path refuses it. (In
    this design it saves no GEMM work: cuBLAS multiplies the zeros.)

Chunk sizes, from the shapes (``op.chunk_shape``)
    A chunk of logits may take ``max(CHUNK_LOGITS_BYTES = 8 MiB, the
    input's bytes)``. By default a chunk is the most tokens whose whole
    vocabulary rows fit that (counting, for fp16/bf16 on CPU, the float32
    copy the weight gradient's GEMM reads); ``chunk_size`` sets the tokens
    instead. When the default leaves fewer than ``MIN_CHUNK_TOKENS = 32``
    tokens (fewer than all of them, for shorter inputs), e.g. 16 tokens of a
    262144-class vocabulary in float32, or an explicit ``chunk_size`` whose
    rows overflow the budget, the vocabulary is split too: chunks of 32
    tokens (or ``chunk_size``) by the most classes that fit, at the bytes per
    logit of ``vocab_chunks.vocab_chunk_bytes`` (the compute dtype, plus a
    float32 copy for fp16/bf16 gradients on CPU). Those chunks run
    ``vocab_chunks.py``: per token chunk, an online log-sum-exp over the
    vocabulary chunks (running maximum, rescaled sum of exponentials, the
    target's logit and the smoothing sums, all float32), then the gradient
    pass recomputing each vocabulary chunk's logits, into the same float32
    grad_weight / grad_bias accumulators (and a float32 grad_input row sum
    cast once per token chunk). For class indices each pass is one kernel
    per vocabulary chunk after its matmul (``cross_entropy_chunk_stats_``,
    then ``cross_entropy_chunk_grad_`` writing the gradient over the chunk's
    logits; C++ on CPU, Triton on GPU); probability targets run their two
    kernels the same way, reading the chunk's slice of the probabilities.

Mean with class and token weights
    With ``l_i`` torch's unreduced loss of token ``i`` (class weight and
    label smoothing included), ``s_i`` its token weight (1 without
    ``token_weight``) and ``d_i`` what torch's mean counts for it
    (``class_weight[t_i]``, or 1 without class weights, for a class index;
    0 for an ``ignore_index`` token; 1 for a probability target)::

        "none": s_i * l_i     "sum": sum_i s_i * l_i     "mean": sum_i s_i * l_i / sum_i s_i * d_i

    So token weights weight both the numerator and the denominator (a
    weighted mean: weights 2 on every token give torch's mean unchanged),
    and without them each is torch's value. A denominator of 0 gives NaN, as
    torch's mean does. ``reference.linear_cross_entropy_reference`` is this
    formula.

Memory: what is saved, and the peak
    Chunked path, ``"mean"`` / ``"sum"`` in fp32 / bf16: the gradients are
    computed during the forward pass (when anything requires grad), and
    autograd saves only them: grad_input (tokens x hidden, the input's
    dtype), grad_weight and grad_bias (float32 sums); backward multiplies
    them by ``grad_output`` in place and casts grad_weight / grad_bias to
    the parameters' dtypes, once. ``"none"``, and fp16 (whose gradient must
    see grad_output, a loss scaler's factor, before it is rounded): the
    forward computes losses only and saves its inputs (references to input,
    weight, bias, target and the weights, no copy); backward recomputes each
    chunk's logits and scales the logits' gradient by grad_output: one more
    pass of matmuls. Either way nothing saved or allocated grows with tokens
    x classes: the peak above the inputs is one chunk of logits (one buffer,
    reused by every chunk; plus a float32 copy of it for fp16/bf16 on CPU,
    which has no mixed-dtype GEMM; with the vocabulary chunked, one
    vocabulary chunk of logits, its float32 copy for fp16/bf16 on CPU) and
    the weight-sized accumulators
    (``tests/test_linear_cross_entropy_vocab_chunks.py`` checks the largest
    temporary stays the same as the vocabulary grows). Measured on CPU (4096 tokens,
    hidden 128, 32768 classes, float32: 512 MiB of logits), the process's
    peak resident set grows by about 35 MiB over forward + backward
    (``tests/test_linear_cross_entropy_api.py::test_peak_memory_of_a_step_in_a_fresh_process``
    holds it under 0.2x the logits).
    Fused path: above the gradients themselves, which a step must hold, one
    chunk's buffer G, grad_input's float32 sum for fp16/bf16 inputs (float32
    inputs sum into grad_input) and per-token terms: no weight-sized
    accumulator (``tests/test_linear_cross_entropy_fused.py::test_peak_within_a_tenth_above_the_gradients``
    holds the peak within 1.1x the gradients' bytes, counted by allocation).

Numerics
    The logits of a chunk are rounded to the compute dtype, as
    ``F.linear`` returns them; everything after (log-sum-exp, loss, the
    weight and bias sums) accumulates in float32. The logits' gradient is
    rounded to the compute dtype once, as torch's: on the fused path after
    every scale; on the chunked path after grad_output (fp16, ``"none"``)
    and the mean's scale, while the whole-rows chunks multiply token
    weights, or ``grad_output`` for ``"none"``, after that rounding.
    grad_input is rounded to the input's dtype per chunk (each of its rows
    is computed once).

Autocast
    Under ``torch.autocast`` (input of float16, bfloat16 or float32), as
    torch runs ``F.linear`` then ``F.cross_entropy``: the matmuls take the
    autocast dtype (input, weight and bias are cast to it chunk by chunk or
    once; the fused path's kernels round each tile as they load it, so the
    weight is never copied whole), and the loss is float32. The gradients are returned in the
    dtypes of input, weight and bias themselves (float32 master weights
    get a float32 grad_weight straight from the float32 accumulator, never
    rounded to the autocast dtype on the way).

Targets out of range
    On CPU an ``IndexError`` naming ``target`` before any chunk runs; on GPU
    no host check (it would synchronise), the row kernel makes that token's
    loss and gradient NaN (see the cross_entropy family).

Vocabulary-parallel
    A DTensor ``weight`` (and ``bias``) sharded over the classes
    (``Shard(0)`` on a 1-D mesh) runs ``vocab_parallel.py``: chunks of
    tokens against the rank's classes through the same vocabulary-chunk
    kernels, with the row statistics all-reduced across the mesh between
    their two passes (its docstring says what is supported). Any other DTensor weight or bias (sharded over the
    hidden dimension, replicated, a 2-D mesh) and the options the
    vocabulary-parallel loss does not serve gather the parameters first.

Not supported: double backward (a clear error), forward-mode AD, gradients
with respect to ``target``, ``class_weight`` or ``token_weight`` (refused
when they require grad).
"""

from .op import CHUNK_LOGITS_BYTES, MIN_CHUNK_TOKENS, chunk_shape, chunk_tokens, linear_cross_entropy
from .reference import linear_cross_entropy_reference

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "chunk_tokens", "chunk_shape",
           "CHUNK_LOGITS_BYTES", "MIN_CHUNK_TOKENS"]
