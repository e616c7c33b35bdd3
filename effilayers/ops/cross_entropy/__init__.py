"""Cross-entropy over class indices without an fp32 copy of the logits.

``cross_entropy(logits, target, weight=None, ignore_index=-100,
label_smoothing=0.0, reduction="mean", inplace_backward=False)`` computes
what ``torch.nn.functional.cross_entropy`` computes for class-index targets:
logits ``(N, C)`` with target ``(N,)``, or ``(N, C, d1, ...)`` with target
``(N, d1, ...)`` (the class dimension is 1), or unbatched ``(C,)`` with a
0-dim target. The loss is differentiable with respect to the logits only:
a ``weight`` that requires grad is refused (``ValueError``) while grad mode
is on, as torch refuses it. Probability ("soft") targets, a floating target
of the logits' shape, run torch's own formula with torch's ops (with
``label_smoothing`` the target becomes ``target * (1 - eps) + eps / C``; the
mean divides by the number of rows): the same values and gradients
(logits, target and weight) as torch, and torch's memory, not this op's.

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
    bumped (``torch.autograd.graph.increment_version`` in eager mode; under
    ``torch.compile`` by the dispatcher, because the op
    ``effilayers::cross_entropy_forward_`` declares ``logits`` mutated),
    so any other autograd node that saved the logits
    (``logits.sin()`` used elsewhere, say) raises at backward instead of
    silently using gradient values. A leaf tensor that requires grad, or a view of one
    (``w[:]``, ``w.view(...)`` of a parameter ``w``), is refused with a
    ``ValueError``, as torch refuses in-place ops on them (under ``no_grad``
    nothing is written and nothing is refused). When the class dimension cannot be walked in
    place (strides that do not merge into (N, C, rest), see ``effilayers._core.layout``),
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
    ``inf``; ``tests/test_cross_entropy_autograd.py::test_autocast_loss_dtype_follows_torch``).
    The value is the float32-accurate loss of the low-precision
    logits; torch's on CUDA is not: on an H200 (torch 2.11, 2026-11-28) its
    autocast loss of 64x1000 bf16 logits was 38.8737 where the float64 loss
    of the same logits, torch's float32 upcast and this op all gave 38.8539
    (``benchmarks/results/ce-autocast-diagnosis-h200-2026-11-28.log``).
    Unlike torch, no float32 copy of the
    logits is made: the kernels accumulate in float32 anyway, and the saved
    gradient (and ``inplace_backward``'s) stays in the logits' dtype, which is
    also the dtype of the gradient autograd hands back, as with torch.

Backends: a C++ CPU kernel (``csrc/cpu/cross_entropy.cpp``), a Triton GPU
kernel (``effilayers/ops/cross_entropy/triton.py``) and the chunked PyTorch
reference (``reference.py``); all implement one row-wise op,
``effilayers::cross_entropy(logits3, target, weight, grad3, grad_scale,
ignore_index, label_smoothing) -> loss_rows`` (declared in ``op.py``), on an
``(N, C, I)`` strided view of the logits.
"""

from .contract import REDUCTIONS
from .op import cross_entropy
from .reference import REFERENCE_CHUNK_ELEMENTS, cross_entropy_rows_reference

__all__ = ["cross_entropy", "cross_entropy_rows_reference", "REDUCTIONS", "REFERENCE_CHUNK_ELEMENTS"]
