"""``python -m effilayers.info --selftest``: every compiled kernel, once, on
small inputs, against its pure-PyTorch reference, on this machine.

The ops and their backends come from the op registry, so a new op is
enumerated without touching this file; its inputs come from :data:`CASES`
(one entry per op), and an op without one is reported as a failure, never
skipped. Each row runs one backend (``cpp``, ``cuda``, ``triton``) of one op
in one dtype and compares every tensor it returns or writes with the
reference run on float64 copies of the same inputs (the same dtype for the
optimizer steps, whose reference is defined on the 8-bit codes).

Where a kernel cannot run here the row says why: CUDA kernels without a
CUDA device, Triton kernels on a CPU without ``TRITON_INTERPRET=1``, a
compiled library that failed to build. Such rows are "not run", not
failures; the exit status is non-zero when any row that ran failed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ._core import registry
from .ops._activation import INVERTIBLE_ACTIVATIONS, TABLE

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

# (rtol, atol) per result dtype, for results computed from the same (already
# rounded) inputs as a float64 reference: the dtype's rounding plus float32
# accumulation. tests/accuracy.py starts its default tier from this table.
TOLERANCES = {f64: (1e-10, 1e-12), f32: (1e-5, 1e-6), f16: (1e-3, 1e-3), bf16: (1e-2, 1e-2)}
# Where a computation carries more error, for a stated reason:
TIERS = {
    "default": TOLERANCES,
    # A 1x1-convolution GEMM over the channels (the DenseNet bottleneck): float32
    # sums in another order; in fp16/bf16 the error comes from rounding the
    # GEMM's inputs, so atol is relative to the tensor's largest value
    # (``SCALED``). tests/accuracy.py ("densenet_gemm") gives the measurement.
    "gemm": {f32: (1e-4, 1e-4), f16: (2e-3, 8e-4), bf16: (1.6e-2, 5e-3)},
    # The same GEMMs in TF32 (float32 on a GPU whose convolutions may use it):
    # each input rounded to 10 mantissa bits; atol relative to the largest value.
    "gemm_tf32": {f32: (0.0, 4e-3)},
    # A reduction against float64: results that cancel to near zero while their terms are not.
    "reduction": {f64: (1e-10, 1e-10), f32: (1e-5, 1e-5), f16: (1e-3, 1e-3), bf16: (1e-2, 1e-2)},
    # The fused linear + cross-entropy passes: GEMMs whose operand, the logits'
    # gradient, is rounded to fp16/bf16 first (as the chunked path and
    # torch's unfused pair store it); atol relative to the largest value.
    "linear_cross_entropy": {f32: (1e-5, 1e-5), f16: (2e-3, 4e-3), bf16: (1.6e-2, 3e-2)},
    # 8-bit optimizer states against the reference's: a code one step off moves
    # an element's update by ~1e-6; codes themselves may differ by one.
    "adam_8bit": {f32: (1e-5, 2e-5), torch.int8: (0, 1), torch.uint8: (0, 1)},
}
SCALED = {"gemm": (f16, bf16), "gemm_tf32": (f32,), "linear_cross_entropy": (f16, bf16)}


@dataclass(frozen=True)
class Case:
    """Small inputs of one op: ``make(device, dtype, generator)`` returns the
    argument tuples to call the kernel with (one per path worth running:
    a row kernel and a tile kernel, one parameter and several)."""

    make: Callable[[torch.device, torch.dtype, torch.Generator], list[tuple]]
    dtypes: tuple = (f32, f16)
    tier: str = "default"
    float64_oracle: bool = True


@dataclass
class Row:
    op: str
    backend: str
    device: str
    dtype: str
    status: str  # "pass", "FAIL", "not run"
    max_error: Optional[float] = None
    worst: Optional[float] = None  # largest error / allowed error over all outputs (<= 1 passes)
    detail: str = ""


def _randn(shape, generator, dtype, device, scale=1.0, offset=0.0) -> torch.Tensor:
    """Random values of varied magnitude (never all zero)."""
    values = torch.randn(shape, generator=generator, dtype=f64) * scale + offset
    return values.to(dtype).to(device)


def _positive(shape, generator, device, low=0.5, high=2.0) -> torch.Tensor:
    return (torch.rand(shape, generator=generator, dtype=f64) * (high - low) + low).to(f32).to(device)


def _softmax_forward(device, dtype, g):
    return [(_randn((3, 37), g, dtype, device, 3.0), -1, False, None),
            (_randn((2, 5, 3, 4), g, dtype, device, 3.0), 1, True, None)]


def _softmax_backward(device, dtype, g):
    cases = []
    for shape, dim, log in (((3, 37), -1, False), ((2, 5, 3, 4), 1, True)):
        x = _randn(shape, g, f64, "cpu", 3.0)
        output = (torch.log_softmax(x, dim) if log else torch.softmax(x, dim)).to(dtype).to(device)
        cases.append((_randn(shape, g, dtype, device), output, dim, log, 1.0, dtype))
    return cases


def _scaled_masked_softmax(device, dtype, g):
    mask = (torch.rand((1, 1, 6, 9), generator=g) > 0.3).to(device)
    return [(_randn((2, 3, 6, 9), g, dtype, device, 3.0), mask, 0.5, False),
            (_randn((2, 3, 6, 9), g, dtype, device, 3.0), None, 0.5, True)]


def _cross_entropy(device, dtype, g):
    logits = _randn((4, 11, 3), g, dtype, device, 3.0)
    target = torch.randint(0, 11, (12,), generator=g).to(device)
    target[5] = -100  # an ignored row
    weight = _positive((11,), g, device)
    return [(logits, target, weight, torch.empty_like(logits), torch.tensor([0.125], device=device), -100, 0.1)]


def _chunk_rows(device, dtype, g):
    """A (rows, classes) vocabulary chunk at class 4, classes contiguous and
    rows a gap apart, with its targets: in the chunk, ignored, elsewhere."""
    chunk = _randn((5, 13), g, dtype, device, 3.0)[:, :11]
    target = torch.tensor([6, -100, 14, 1, 4], device=device)
    return chunk, target


def _cross_entropy_chunk_stats(device, dtype, g):
    chunk, target = _chunk_rows(device, dtype, g)
    stats = torch.stack([_randn((5,), g, f32, device), _positive((5,), g, device), torch.zeros(5, device=device),
                         _randn((5,), g, f32, device)])
    return [(chunk, target, _positive((11,), g, device), stats, 4, -100, True),
            (chunk, target, None, stats, 4, -100, False)]


def _cross_entropy_chunk_grad(device, dtype, g):
    chunk, target = _chunk_rows(device, dtype, g)
    lse = torch.logsumexp(chunk.float(), 1) + 0.5
    row_terms = torch.stack([lse, _positive((5,), g, device), _positive((5,), g, device), _positive((5,), g, device)])
    return [(chunk, target, _positive((11,), g, device, 0.001, 0.01), row_terms, 4, -100),
            (chunk, target, None, row_terms, 4, -100)]


def _linear_rows(device, dtype, g):
    """x (7 tokens, hidden 20, rows a gap apart), W (37 classes), b and
    targets (one ignored, one out of range): more than one tile of the
    fused kernels' smallest 16 in every dimension."""
    x = _randn((7, 24), g, dtype, device)[:, :20]
    w = _randn((37, 20), g, dtype, device, 0.3)
    target = torch.tensor([3, -100, 36, 0, 40, 17, 9], device=device)
    return x, w, _randn((37,), g, dtype, device), target


def _linear_cross_entropy_stats(device, dtype, g):
    x, w, b, target = _linear_rows(device, dtype, g)
    return [(x, w, b, target, _positive((37,), g, device), True), (x, w, None, target, None, False)]


def _linear_cross_entropy_grads(device, dtype, g):
    x, w, b, target = _linear_rows(device, dtype, g)
    lse = torch.logsumexp(torch.nn.functional.linear(x.float(), w.float(), b.float()), 1) + 0.25
    row_terms = torch.stack([lse, _positive((7,), g, device), _positive((7,), g, device), _positive((7,), g, device)])

    def sums():
        return (_randn((7, 20), g, f32, device), _randn((37, 20), g, f32, device), _randn((37,), g, f32, device))

    return [(x, w, b, target, _positive((37,), g, device, 0.001, 0.01), row_terms, -100, *sums()),
            (x, w, None, target, None, row_terms, -100, sums()[0], None, None)]


def _soft_chunk(device, dtype, g):
    """A chunk as _chunk_rows gives, probability rows over its classes (a
    gap between rows too) in the logits' dtype and in float32, and the two
    per-class vectors."""
    chunk, _ = _chunk_rows(device, dtype, g)
    probs = torch.softmax(_randn((5, 12), g, f32, device, 2.0), 1)[:, :11]
    prob_weight, class_term = _positive((11,), g, device), _positive((11,), g, device, 0.001, 0.01)
    return chunk, (probs.to(dtype), probs), prob_weight, class_term


def _cross_entropy_soft_chunk_stats(device, dtype, g):
    chunk, probs, prob_weight, class_term = _soft_chunk(device, dtype, g)
    stats = torch.stack([_randn((5,), g, f32, device), _positive((5,), g, device), _randn((5,), g, f32, device),
                         _positive((5,), g, device)])
    return [(chunk, probs[0], prob_weight, class_term, stats), (chunk, probs[1], None, None, stats)]


def _cross_entropy_soft_chunk_grad(device, dtype, g):
    chunk, probs, prob_weight, class_term = _soft_chunk(device, dtype, g)
    lse = torch.logsumexp(chunk.float(), 1) + 0.5
    row_terms = torch.stack([lse, _positive((5,), g, device), _positive((5,), g, device)])
    return [(chunk, probs[0], prob_weight, class_term, row_terms), (chunk, probs[1], None, None, row_terms)]


def _reduce(device, dtype, g):
    cases = []
    for kind, shape in (("sum", (3, 37, 1)), ("var", (2, 19, 5)), ("norm", (1, 40, 3))):
        x = _randn(shape, g, dtype, device, 2.0, 1.0)
        out = torch.empty((shape[0], shape[2]), dtype=dtype, device=device)
        cases.append((x, out, kind, 1.0 if kind == "var" else 0.0))
    return cases


def _bottleneck_inputs(device, dtype, g):
    features = [_randn((2, channels, 3, 5), g, dtype, device) for channels in (4, 3)]
    k = 7
    mean = _randn((k,), g, f32, device, 0.2)
    invstd = _positive((k,), g, device)
    weight, bias = _positive((k,), g, device), _randn((k,), g, f32, device, 0.1)
    conv_weight = _randn((6, k, 1, 1), g, dtype, device, 0.3)
    return features, mean, invstd, weight, bias, conv_weight


def _dense_forward(device, dtype, g):
    return [(*_bottleneck_inputs(device, dtype, g), 0)]


def _dense_backward(device, dtype, g):
    features, *rest = _bottleneck_inputs(device, dtype, g)
    grad_out = _randn((2, 6, 3, 5), g, dtype, device)
    return [(grad_out, features, *rest, batch_stats, True, True, 0) for batch_stats in (True, False)]


def _channels(device, g, c):
    return (_randn((c,), g, f32, device, 0.2), _positive((c,), g, device), _positive((c,), g, device),
            _randn((c,), g, f32, device, 0.1))


# The activations only ABN takes (no inverse): each once, from the saved input.
SMOOTH_ACTIVATIONS = tuple(name for name in TABLE if name not in INVERTIBLE_ACTIVATIONS and name != "relu")


def _abn_forward(device, dtype, g):
    mean, invstd, weight, bias = _channels(device, g, 3)
    x = _randn((2, 3, 4, 5), g, dtype, device)
    return [(x, mean, invstd, weight, bias, None, "leaky_relu", 0.01, 1e-5),
            (x, mean, invstd, weight, bias, _randn((2, 3, 4, 5), g, dtype, device), "elu", 1.0, 1e-5),
            *((x, mean, invstd, weight, bias, None, name, 0.0, 0.0) for name in SMOOTH_ACTIVATIONS)]


def _abn_backward_args(device, dtype, g, activation="leaky_relu"):
    mean, invstd, weight, bias = _channels(device, g, 3)
    grad, saved = _randn((2, 3, 4, 5), g, dtype, device), _randn((2, 3, 4, 5), g, dtype, device)
    return grad, saved, mean, invstd, weight, bias, None, activation, 0.01, 1e-5


def _abn_backward_reduce(device, dtype, g):
    # The smooth activations only from the saved input (not invertible).
    return [*((*_abn_backward_args(device, dtype, g), saved_is_output) for saved_is_output in (False, True)),
            *((*_abn_backward_args(device, dtype, g, name), False) for name in SMOOTH_ACTIVATIONS)]


def _abn_backward_elemt(device, dtype, g):
    means = _randn((3,), g, f32, device, 0.1), _randn((3,), g, f32, device, 0.1)
    return [(*_abn_backward_args(device, dtype, g), True, *means, False),
            *((*_abn_backward_args(device, dtype, g, name), False, *means, True) for name in SMOOTH_ACTIVATIONS)]


def _abn_backward(device, dtype, g):
    return [(*_abn_backward_args(device, dtype, g), True, 40, True, True, False)]


def _batch_stats(device, dtype, g):
    return [(_randn((4, 3, 5, 5), g, dtype, device, 2.0, 3.0), 0),
            (_randn((4, 3, 5, 5), g, dtype, device, 2.0, 3.0).to(memory_format=torch.channels_last), 1)]


def _normalizing_statistics(device, dtype, g):
    x = _randn((4, 3, 5, 5), g, dtype, device, 2.0, 3.0)
    running = _randn((3,), g, f32, device), _positive((3,), g, device)
    return [(x, *running, torch.tensor(3, device=device), 0.1, False, 1e-5)]


def _finish_statistics(device, dtype, g):
    acc = torch.float64 if dtype == torch.float64 else f32
    mean, var = _randn((3,), g, acc, device), _positive((3,), g, device).to(acc)
    running = _randn((3,), g, f32, device), _positive((3,), g, device)
    return [(mean, var, 40, *running, torch.tensor(3, device=device), 0.1, False, 1e-5),
            (mean, var, 40, *running, torch.tensor(3, device=device), 0.0, True, 1e-5)]


def _hyper():
    """The hyper-parameters, flat at the end of the kernels' arguments."""
    from .ops.adam.contract import AdamHyperParams

    return AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                           decoupled_weight_decay=True, maximize=False)


def _adam(device, dtype, g):
    cases = []
    for shapes in (((37,),), ((3, 5), (300,), (1,))):
        params = [_randn(s, g, dtype, device) for s in shapes]
        grads = [_randn(s, g, dtype, device, 3.0) for s in shapes]
        total = sum(p.numel() for p in params)
        exp_avg = _randn((total,), g, f32, device, 0.1)
        exp_avg_sq = _positive((total,), g, device, 1e-4, 1e-2)
        cases.append((params, grads, exp_avg, exp_avg_sq, exp_avg_sq * 1.5, None, torch.tensor([3.0], device=device),
                      None, None, *_hyper()))
    return cases


def _adam_8bit(device, dtype, g):
    from .ops.adam.contract import QUANT_BLOCK, padded_numel

    cases = []
    for shapes in (((37,),), ((3, 5), (300,), (1,))):
        params = [_randn(s, g, dtype, device) for s in shapes]
        grads = [_randn(s, g, dtype, device, 3.0) for s in shapes]
        total = sum(padded_numel(p.numel()) for p in params)
        blocks = total // QUANT_BLOCK
        # The states of a first step: all codes and scales zero.
        states = (torch.zeros(total, dtype=torch.int8, device=device), torch.zeros(blocks, device=device),
                  torch.zeros(total, dtype=torch.uint8, device=device), torch.zeros(blocks, device=device))
        cases.append((params, grads, *states, None, None, None, torch.tensor([1.0], device=device), None, None,
                      *_hyper()))
    return cases


CASES: dict[str, Case] = {
    "softmax_forward": Case(_softmax_forward),
    "softmax_backward": Case(_softmax_backward),
    "scaled_masked_softmax_forward": Case(_scaled_masked_softmax),
    "cross_entropy": Case(_cross_entropy),
    "cross_entropy_chunk_stats_": Case(_cross_entropy_chunk_stats),
    "cross_entropy_chunk_grad_": Case(_cross_entropy_chunk_grad),
    "cross_entropy_soft_chunk_stats_": Case(_cross_entropy_soft_chunk_stats),
    "cross_entropy_soft_chunk_grad_": Case(_cross_entropy_soft_chunk_grad),
    "linear_cross_entropy_stats": Case(_linear_cross_entropy_stats, dtypes=(f32, f16, bf16), tier="gemm"),
    "linear_cross_entropy_grads": Case(_linear_cross_entropy_grads, dtypes=(f32, f16, bf16),
                                       tier="linear_cross_entropy"),
    "reduce": Case(_reduce, tier="reduction"),
    "dense_bottleneck_forward": Case(_dense_forward, tier="gemm"),
    "dense_bottleneck_backward": Case(_dense_backward, tier="gemm"),
    "abn_forward": Case(_abn_forward),
    "abn_forward_": Case(_abn_forward),
    "abn_backward_reduce": Case(_abn_backward_reduce),
    "abn_backward_elemt": Case(_abn_backward_elemt),
    "abn_backward": Case(_abn_backward),
    "batch_stats": Case(_batch_stats),
    "normalizing_statistics": Case(_normalizing_statistics),
    "finish_statistics": Case(_finish_statistics),
    "adam_step": Case(_adam, dtypes=(f32,), float64_oracle=False),
    "adam_step_8bit": Case(_adam_8bit, dtypes=(f32,), tier="adam_8bit", float64_oracle=False),
}


# ---------------------------------------------------------------- running and comparing


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _leaves(value: Any) -> Iterator[Optional[torch.Tensor]]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, torch.Tensor) or value is None:
        yield value


def _oracle_inputs(args: tuple, float64: bool) -> tuple:
    """CPU copies of the arguments, floating ones in float64 when ``float64``
    (a dtype argument too: softmax_backward's input_dtype)."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu().clone()
        return t.double() if float64 and t.is_floating_point() else t
    return tuple(f64 if float64 and isinstance(a, torch.dtype) and a.is_floating_point
                 else _map_tensors(a, copy) for a in args)


def _compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tier: str) -> tuple[float, float]:
    """(max |error|, largest error / allowed error) of one output of a run
    in ``dtype``: floating outputs are held to the tolerance of the inputs'
    dtype (a float32 sum of fp16 products carries their rounding), integer
    ones (8-bit codes) to their own."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)}, reference {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0, 0.0
    key = dtype if actual.is_floating_point() else actual.dtype
    rtol, atol = TIERS[tier].get(key, TOLERANCES.get(key, (0.0, 0.0)))
    a, e = actual.detach().cpu().double(), expected.double()
    if key in SCALED.get(tier, ()):
        atol *= float(e.abs().max())
    both_nan = torch.isnan(a) & torch.isnan(e)
    error = torch.where(both_nan, torch.zeros_like(a), (a - e).abs())
    error = torch.where(torch.isnan(error), torch.full_like(error, math.inf), error)
    allowed = atol + rtol * e.abs()
    ratio = torch.where(error == 0, torch.zeros_like(error), error / allowed)
    return float(error.max()), float(ratio.max())


def _tier(case: Case, backend: str, dtype: torch.dtype) -> str:
    """The case's tier, or its TF32 variant where the Triton GEMMs round
    float32 inputs to TF32 (they follow PyTorch's flag for convolutions)."""
    if backend == "triton" and dtype == f32 and f"{case.tier}_tf32" in TIERS and torch.cuda.is_available():
        from .ops.densenet.triton import _allow_tf32

        if _allow_tf32(dtype):
            return f"{case.tier}_tf32"
    return case.tier


def _copy_keeping_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy with ``t``'s sizes and strides, gaps between rows included
    (``clone()`` compacts a view with gaps), so the kernel sees the layout
    its case built; tensors with overlapping (zero) strides are cloned."""
    if 0 in t.stride():
        return t.clone()
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def run_case(op: str, backend: str, device: str, dtype: torch.dtype, kernel: Callable, case: Case,
             reference: Callable) -> Row:
    generator = torch.Generator().manual_seed(0)
    tier = _tier(case, backend, dtype) if device == "cuda" else case.tier
    max_error = worst = 0.0
    for args in case.make(torch.device(device), dtype, generator):
        expected_args = _oracle_inputs(args, case.float64_oracle)
        expected = reference(*expected_args)
        actual_args = _map_tensors(args, _copy_keeping_layout)
        actual = kernel(*actual_args)
        if device == "cuda":
            torch.cuda.synchronize()
        pairs = list(zip(_leaves((actual, actual_args)), _leaves((expected, expected_args))))
        for index, (a, e) in enumerate(pairs):
            if (a is None) != (e is None):
                raise AssertionError(f"output {index}: {'no tensor' if a is None else 'a tensor'} where the "
                                     f"reference gives {'none' if e is None else 'one'}")
            if a is None:
                continue
            error, ratio = _compare(a, e, dtype, tier)
            max_error, worst = max(max_error, error), max(worst, ratio)
    status = "pass" if worst <= 1.0 else "FAIL"
    return Row(op, backend, device, str(dtype).replace("torch.", ""), status, max_error, worst,
               "" if tier == case.tier else f"tolerance {tier}")


def _device_of(backend: str) -> str:
    """Where a backend's kernels run on this machine (Triton: the GPU when
    there is one, else the CPU through the interpreter)."""
    if backend == "cpp":
        return "cpu"
    if backend == "cuda":
        return "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def selftest(ops: Optional[Sequence[str]] = None) -> list[Row]:
    """One row per (op, compiled backend, dtype)."""
    rows = []
    for op in ops if ops is not None else registry.registered_ops():
        kernels = registry.op_kernels(op)
        case = CASES.get(op)
        for backend in ("cpp", "cuda", "triton"):
            if not kernels.provides(backend):
                continue
            device = _device_of(backend)
            if case is None:
                rows.append(Row(op, backend, device, "-", "FAIL",
                                detail="no self-test inputs for this op: add a Case to effilayers/_selftest.py"))
                continue
            with registry.use_backend(backend):
                chosen = registry.choice(op, device)
            if chosen.kernel is None:
                for dtype in case.dtypes:
                    rows.append(Row(op, backend, device, str(dtype).replace("torch.", ""), "not run",
                                    detail=chosen.reason))
                continue
            for dtype in case.dtypes:
                try:
                    rows.append(run_case(op, backend, device, dtype, chosen.kernel, case, kernels.reference))
                except Exception as error:  # noqa: BLE001 - a crashing kernel is a failed row, and the rest still run
                    rows.append(Row(op, backend, device, str(dtype).replace("torch.", ""), "FAIL",
                                    detail=f"{type(error).__name__}: {error}".splitlines()[0][:200]))
    return rows


def format_rows(rows: Sequence[Row], failures_only: bool = False) -> str:
    """The summary line, then the table (with ``failures_only``, only the
    rows that failed or did not run, each with its reason)."""
    failed = sum(r.status == "FAIL" for r in rows)
    ran = sum(r.status != "not run" for r in rows)
    lines = [f"{ran - failed} passed, {failed} failed, {len(rows) - ran} not run "
             "(error/tol: largest |error| / (atol + rtol |reference|) over the outputs; <= 1 passes)"]
    if not torch.cuda.is_available():
        lines.append("no CUDA device: CUDA kernels not run" + (
            "" if os.environ.get("TRITON_INTERPRET") == "1" else
            "; Triton kernels not run (set TRITON_INTERPRET=1 to run them through the interpreter)"))
    shown = [r for r in rows if r.status != "pass"] if failures_only else list(rows)
    if not shown:
        return "\n".join(lines)
    header = ("op", "backend", "device", "dtype", "max |error|", "error/tol", "result")
    table = [header]
    for row in shown:
        table.append((row.op, row.backend, row.device, row.dtype,
                       "-" if row.max_error is None else f"{row.max_error:.2e}",
                       "-" if row.worst is None else f"{row.worst:.3f}",
                       row.status + (f": {row.detail}" if row.detail else "")))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    lines.append("")
    lines += ["  ".join(value.ljust(width) for value, width in zip(r[:-1], widths)) + "  " + r[-1] for r in table]
    return "\n".join(lines)


def main(file=None, failures_only: bool = False) -> int:
    """Print the summary and the table; 1 when a kernel that ran failed, else 0."""
    import sys

    rows = selftest()
    print(format_rows(rows, failures_only), file=file or sys.stdout)
    return 1 if any(row.status == "FAIL" for row in rows) else 0
