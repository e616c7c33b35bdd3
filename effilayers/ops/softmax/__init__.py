"""Softmax, log-softmax and scaled/masked softmax that accumulate in fp32.

Public functions (also in :mod:`effilayers.functional`)::

    softmax(x, dim, dtype=None)
    log_softmax(x, dim, dtype=None)
    scaled_masked_softmax(x, mask=None, scale=1.0, causal=False)

Numerics
    Every backend converts each value to the accumulation type as it reads
    it: float32 for float16/bfloat16/float32 input, float64 when the input or
    the requested ``dtype`` is float64. The row maximum is subtracted before
    ``exp`` (so fp16 rows with values above ~11 do not overflow), the sum of
    exponentials and the log-sum-exp are formed in that type, and only the
    final value is rounded to the output dtype. ``dtype`` names the output
    dtype; unlike ``torch.softmax(x, dim, dtype=...)`` no converted copy of
    ``x`` is made first. Integer and bool ``x`` are accepted with a floating
    ``dtype``, as torch accepts them: they are converted to float32 (float64
    for ``dtype=torch.float64``) first, the one copy this makes.

    A row whose values are all ``-inf`` (a fully masked row) gives zeros from
    softmax and ``-inf`` from log-softmax, not the NaNs ``torch.softmax``
    returns; its softmax gradient is zero. A NaN or ``+inf`` anywhere in a
    row makes the whole row NaN, as in torch.

What autograd saves
    Only the output (softmax: ``y``, log-softmax: ``log y``), as torch does;
    ``effilayers.memory`` counts exactly the output's bytes. The backward is
    one fused kernel per row: ``gx = y * (g - sum(g * y))`` for softmax,
    ``gx = g - exp(y) * sum(g)`` for log-softmax (times ``scale`` for
    :func:`scaled_masked_softmax`), computed in float32 and returned in the
    *input's* dtype even when ``dtype`` asked for another output dtype.

Layouts
    ``x`` is read in place as ``(outer, reduced, inner)`` problems
    (:func:`effilayers._core.layout.three_groups`): contiguous tensors with any
    ``dim``, channels_last with ``dim=1``, transposed matrices and most
    slices. When the dimensions before or after ``dim`` cannot be merged into
    one strided index (for example ``x.permute(1, 0, 2)`` with ``dim=2``), the
    kernels first make a contiguous copy of ``x`` (one input-sized buffer,
    freed when the op returns). One layout rule for the outputs of all three
    ops (and the gradient), on every backend and in the fake kernels that
    ``torch.compile`` traces (:func:`contract.output_like`): the input's
    strides when the input is dense and its dimensions around ``dim`` (the
    last one for :func:`scaled_masked_softmax`) merge, else contiguous, also
    where a kernel could have read the input in place. (``torch.softmax`` always
    returns a contiguous tensor; the values are the same.)

    :func:`scaled_masked_softmax` reads ``mask`` through its broadcast
    strides (0 along broadcast dimensions); the C++ and Triton kernels never
    expand it into an ``x``-sized tensor, except the Triton kernel for inputs
    of more than four dimensions whose leading dimensions do not merge. The
    pure-PyTorch reference (the fallback) does materialise it.

Double backward (``create_graph=True``) works: the backward op's own
gradient is written in PyTorch ops (it saves ``g`` and ``y``), not fused.

Autocast
    The ops keep the input dtype under ``torch.autocast``: a bfloat16/float16
    input gives a bfloat16/float16 output. On CPU that is what torch does; on
    CUDA, torch's autocast runs softmax in float32 and returns float32, which
    doubles the bytes of the activation that backward keeps. Since the
    accumulation is float32 here anyway, the narrow output costs only its
    final rounding; pass ``dtype=torch.float32`` for a float32 output.
"""

from .contract import SUPPORTED_DTYPES
from .op import log_softmax, scaled_masked_softmax, softmax
from .reference import scaled_masked_softmax_forward_reference, softmax_backward_reference, softmax_forward_reference

__all__ = ["softmax", "log_softmax", "scaled_masked_softmax", "softmax_forward_reference", "softmax_backward_reference",
           "scaled_masked_softmax_forward_reference", "SUPPORTED_DTYPES"]
