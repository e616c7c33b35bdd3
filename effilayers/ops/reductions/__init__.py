"""Overflow-free sum, mean, var, std and vector 2-norm for fp16/bf16 (issue 5).

``sum(x, dim=None, keepdim=False, *, dtype=None)``, ``mean`` (same),
``var(x, dim=None, unbiased=None, keepdim=False, *, correction=None,
dtype=None)``, ``std`` (same; torch.var's two signatures: ``correction``
any real, None meaning 1, or ``unbiased``) and ``norm(x, dim=None,
keepdim=False, *, ord=None, p=None, dtype=None)`` (the vector norm
``torch.linalg.vector_norm(x, ord, dim)``, any order torch takes, plus
torch.norm's "fro" and "nuc"; the 2-norm is the op's own kernel, ord 1 its
sum, and the docstring of ``norm`` says which orders torch computes) follow
torch's semantics for
``dim`` (an int, a tuple, ``None`` or ``()`` for all dimensions, negative
values) and ``keepdim``. The result has the input's dtype unless ``dtype`` is
given (``dtype=torch.float32`` returns the float32 result of fp16/bf16 input
without rounding it to the input dtype first). Inputs must be float16,
bfloat16, float32 or float64, except that ``sum`` and ``mean`` take integer
and bool inputs with a floating ``dtype``, as torch's do (through a float32
copy, float64 for ``dtype=torch.float64``); other integer inputs raise
TypeError (``torch.sum`` without ``dtype`` would return an int64 sum;
``var``, ``std`` and ``norm`` refuse them in torch too). The output is a new
contiguous tensor.

Contract
    Accumulation is in float32 for fp16/bf16/fp32 input (float64 for float64)
    and the result is formed in float64 before its one rounding to the output
    dtype, so a finite fp16/bf16 input whose true result is representable in
    the output dtype never gives inf. Examples where torch 2.13 on CPU does
    (kept in ``tests/test_reductions.py::test_overflow_table`` with both
    results): the bf16 mean of 100,000 values of 3e38 (torch: inf), the bf16
    2-norm of values of 1e20 (torch: inf; the squares overflow float32), a
    bf16 sum whose partial sums overflow but whose total is 1 (torch: nan),
    the naive fp16 ``x.pow(2).sum().sqrt()`` and ``x.sum() / n``.

Method (CPU kernel, csrc/cpu/reductions.cpp)
    The reduced range is cut into blocks of at most 4096 values, a block is
    reduced in float32 with vector accumulators (var/std: a two-pass mean and
    M2 inside the block), and block results are combined in float64 in a fixed
    order (Chan's formula for mean/M2), so results do not depend on the thread
    count. fp16 values cannot overflow a float32 block (65504^2 * 4096 ~
    1.8e13). A bf16/fp32 block whose float32 result is not finite while its
    values are is recomputed with its values multiplied by 2^-e (e the exponent
    of the block's largest magnitude), exactly as BLAS nrm2 scales, and its
    result is scaled back by 2^e (2^2e for squares and M2) in float64. Only
    values more than 2^126 below the block maximum lose bits there. The rescue
    runs only for blocks that overflowed, so the common case costs nothing.

Method (Triton kernel, effilayers/ops/reductions/triton.py)
    One program per output (or per tile of adjacent outputs) loops over the
    reduced range in blocks; each block is scaled by a power of two from its
    largest magnitude and the running result carries its own exponent, so
    nothing overflows float32 in one pass. Large full reductions split the
    range across programs and combine the per-program partials (count,
    mean/sum, M2, exponent) in float64.

Layouts
    The input is viewed as (outer, reduced, inner) without copying where the
    reduced dims are consecutive and each group's strides nest
    (``effilayers._core.layout.three_groups``): the last dims of a contiguous
    tensor, leading dims, the channel dim of channels_last, transposed
    matrices. A full reduction of any dense tensor (no overlap, no gaps) reads
    it in memory order without a copy. Other cases (dims (0, 2) of a
    contiguous 3-D tensor, strided slices) move the reduced dims last and copy
    the input once (an input-sized buffer in the input dtype).

Autograd (what is saved)
    sum/mean save nothing but shapes: the backward broadcasts the gradient
    (divided by n for the mean, in float32, rounded at output size) as an
    expanded view, without an input-sized buffer. var saves the input; its backward
    recomputes the float32 mean with this op (one more read of the input,
    instead of keeping an output-sized float32 tensor), std and norm also
    save their output. Backward products are formed in float32 per element
    (``2 (x - mean) / (n - correction) * g``; ``(x / norm) * g``, in that
    order so nothing overflows fp16; bf16 values beyond ~1.7e38 of both signs
    can still overflow float32's ``x - mean`` there) with PyTorch ops on one input-sized
    float32 temporary (updated in place; 2x the input's bytes for fp16/bf16,
    alive during backward only), and rounded once to the input dtype. As in
    torch, the gradient of std and norm is 0 where the result is 0.

Edge cases (as torch): an empty reduction gives sum 0, norm 0, mean/var/std
nan; var divides M2 by max(0, n - correction) (inf, or nan when M2 is 0), for
any int or float ``correction`` (0.5 and -1 included, as torch takes them);
``dim=()`` reduces everything; a 0-dim input accepts dim 0 and -1.

Autocast: each function returns what the torch op it replaces returns under
``torch.autocast``. CUDA autocast runs ``torch.sum`` and
``torch.linalg.vector_norm`` (and ``torch.norm``) in float32 when no
``dtype`` is given, so with CUDA autocast enabled :func:`sum` and
:func:`norm` (every ``ord``) of float16/bfloat16 input return float32: the
float32 result the kernel formed anyway, not rounded to the input dtype, and
without the float32 copy of the input torch makes. ``mean``, ``var`` and
``std`` are not on autocast's lists and keep the input dtype; CPU autocast
changes none of the five. An explicit ``dtype=`` always wins, as in torch.

Reference (pure PyTorch, the fallback and the float64 oracle): converts the
input to float64 and uses torch's reductions; that copy is 4x the input's
bytes for fp16/bf16.
"""

# op.py's sum/mean/... shadow the builtins inside this package, which uses none of them.
# as_three and the op _reduce_op (effilayers::reduce) are imported from here by the tests.
from .contract import KINDS, as_three  # noqa: F401
from .op import _reduce_op, mean, norm, std, sum, var  # noqa: F401
from .reference import reduce_reference, reduce_three_reference

__all__ = ["sum", "mean", "var", "std", "norm", "reduce_reference", "reduce_three_reference", "KINDS"]
