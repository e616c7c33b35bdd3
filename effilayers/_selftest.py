"""``python -m effilayers.info --selftest``: every compiled kernel, once, on
small inputs, against its pure-PyTorch reference, on this machine.

The ops and their backends come from the op registry, so a new op is
enumerated without touching this file; its inputs come from its family's
``ops/<family>/selftest.py`` or ``op.py`` (``CASES``, one entry per op; see
``_core/selftest.py``), and an op without one is reported as a failure,
never skipped. Each row runs one backend (``cpp``, ``cuda``, ``triton``) of one op
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
from ._core.families import family_modules
from ._core.selftest import TOLERANCES, Case

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16


def _family_declarations() -> tuple[dict[str, Case], dict, dict]:
    """Every family's cases, tolerance tiers and scaled tiers, from its
    ``ops/<family>/selftest.py`` or, in a small family, its ``op.py``,
    merged; two declarations of the same op or tier is an error, not an
    override."""
    cases: dict[str, Case] = {}
    tiers: dict = {"default": TOLERANCES}
    scaled: dict = {}
    for module in family_modules("selftest") + family_modules("op"):
        for name, mapping in (("CASES", cases), ("TIERS", tiers), ("SCALED", scaled)):
            declared = getattr(module, name, {})
            clash = sorted(set(declared) & set(mapping))
            if clash:
                raise RuntimeError(f"{module.__name__}.{name} declares {clash} again")
            mapping.update(declared)
    return cases, tiers, scaled


CASES, TIERS, SCALED = _family_declarations()


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
    """The case's tier, or its TF32 variant where the op's Triton kernels
    round float32 inputs to TF32 at the present settings."""
    if backend == "triton" and case.tf32 is not None and torch.cuda.is_available() and case.tf32(dtype):
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
                rows.append(Row(op, backend, device, "-", "FAIL", detail="no self-test inputs for this op: add a Case "
                                "to CASES in effilayers/ops/<family>/selftest.py"))
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
