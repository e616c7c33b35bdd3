"""A launch-configuration sweep of the Triton launchers (softmax,
cross_entropy, reductions) at the benchmark shapes, short enough for a lent GPU.

    python3 benchmarks/tune.py sweep --budget 100 --out tuned.json   # on a GPU: time, write the winners
    python3 benchmarks/tune.py sweep --dry-run                       # here: every key and its candidates
    TRITON_INTERPRET=1 python3 benchmarks/tune.py sweep --tiny --out x.json   # here: every candidate runs, correct
    python3 benchmarks/tune.py merge tuned.json                      # winners -> ops/<family>/tuned_<arch>.json

Keys come from the launchers themselves (``tuning.probe``: a launch on meta
tensors of the bench's shapes stops at its table lookup), candidates from
each family's ``tuning_candidates`` (the heuristic and its neighbours, next
to the heuristic in ``ops/<family>/triton.py``). Each candidate is timed
through the same lookup a committed table takes (``tuning.install``), with
CUDA events (``conftest.device_median_seconds``). The budget is the
script's own: a candidate is not started with under RESERVE seconds left,
the JSON is rewritten after every key (and on SIGINT, as a GPU session's
cut sends), and keys the committed table already has are skipped unless
--retune, so successive sessions go on where the last stopped. ``merge``
takes the keys whose every candidate was timed.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # the budget counts the imports below too

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Iterator, NamedTuple, Optional  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import bench_cross_entropy, bench_reductions, bench_softmax  # noqa: E402
from benchmarks.conftest import device_median_seconds  # noqa: E402
from effilayers._core import tuning  # noqa: E402
from effilayers.ops.cross_entropy import triton as cross_entropy_kernels  # noqa: E402
from effilayers.ops.reductions import triton as reductions_kernels  # noqa: E402
from effilayers.ops.softmax import triton as softmax_kernels  # noqa: E402

FAMILIES = {"softmax": softmax_kernels, "cross_entropy": cross_entropy_kernels, "reductions": reductions_kernels}
# Seconds a candidate may need: its compilation (about a second for these
# kernels) and do_bench's warm-up and repetitions (REP_MS).
RESERVE = 4.0
REP_MS = 25


class Case(NamedTuple):
    """One launch of one launcher: ``make(device, tiny)`` returns a
    callable that launches it and returns what it wrote."""
    family: str
    label: str
    make: Callable[[str, bool], Callable[[], tuple]]


def _softmax(shape, dim, dtype, direction: str) -> Case:
    def make(device, tiny):
        size, local_dtype = (((1, 300, 2, 3) if len(shape) == 4 else (2, 1500)), torch.float32) if tiny else \
            (shape, dtype)
        x = _randn(size, local_dtype, device)
        if len(size) == 4 and dim == 1:
            x = x.contiguous(memory_format=torch.channels_last)  # as bench_softmax times it on CUDA
        if direction == "forward":
            return lambda: (softmax_kernels.softmax_forward(x, dim, False, None),)
        y = torch.softmax(x.float(), dim).to(local_dtype) if device != "meta" else torch.empty_like(x)
        grad = torch.randn_like(x) if device != "meta" else torch.empty_like(x)
        return lambda: (softmax_kernels.softmax_backward(grad, y, dim, False, 1.0, local_dtype),)
    return Case("softmax", f"softmax {direction} {'x'.join(map(str, shape))} dim={dim} {_name(dtype)}", make)


def _masked_softmax(shape, dtype) -> Case:
    def make(device, tiny):
        size, local_dtype = ((1, 2, 3, 1500), torch.float32) if tiny else (shape, dtype)
        x = _randn(size, local_dtype, device)
        mask = torch.ones(size[-2:], dtype=torch.bool, device=device)
        return lambda: (softmax_kernels.scaled_masked_softmax_forward(x, mask, size[-1] ** -0.5, True),)
    return Case("softmax", f"scaled_masked_softmax causal {'x'.join(map(str, shape))} {_name(dtype)}", make)


def _cross_entropy(shape, dtype) -> Case:
    def make(device, tiny):
        (rows, classes), local_dtype = ((2, 1500), torch.float32) if tiny else (shape, dtype)
        logits = _randn((rows, classes, 1), local_dtype, device)
        target = torch.zeros(rows, dtype=torch.int64, device=device)
        if device != "meta":
            target.random_(0, classes)
        grad = torch.empty_like(logits)
        scale = torch.full((1,), 1 / rows, dtype=torch.float64 if local_dtype == torch.float64 else torch.float32,
                           device=device)
        return lambda: (cross_entropy_kernels.cross_entropy_rows_triton(logits, target, None, grad, scale, -100, 0.0),
                        grad)
    return Case("cross_entropy", f"cross_entropy rows+grad {'x'.join(map(str, shape))} {_name(dtype)}", make)


def _reduction(shape, dim_name, kind, dtype) -> Case:
    def make(device, tiny):
        size, local_dtype = ({"rows": (2, 1500), "columns": (150, 40), "all": (20, 300)}[dim_name], torch.float32) \
            if tiny else (shape, dtype)
        rows, columns = size
        # The (outer, reduced, inner) view the op hands over for a contiguous matrix.
        view = {"rows": (rows, columns, 1), "columns": (1, rows, columns), "all": (1, rows * columns, 1)}[dim_name]
        x = _randn(size, local_dtype, device).view(view)
        out = torch.empty((view[0], view[2]), dtype=local_dtype, device=device)

        def launch():
            reductions_kernels.reduce_triton(x, out, kind, 1.0)
            return (out,)
        return launch
    return Case("reductions", f"{kind} {dim_name} of {'x'.join(map(str, shape))} {_name(dtype)}", make)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _randn(shape, dtype, device) -> torch.Tensor:
    if device == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    return (torch.randn(shape, device=device) * 3 + 1).to(dtype)


def cases() -> Iterator[Case]:
    """The launches the GPU benches time, from their own case lists,
    alternating between families (so a budget that runs out leaves some keys
    of each), bfloat16 first (what the benches' targets are set on)."""
    # The benches list their cuda cases without a GPU too (for --dry-run and --tiny).
    collect = os.environ.get("EFFILAYERS_BENCH_COLLECT_CUDA")
    os.environ["EFFILAYERS_BENCH_COLLECT_CUDA"] = "1"
    try:
        listed = [list(bench.cases()) for bench in (bench_softmax, bench_cross_entropy, bench_reductions)]
    finally:
        if collect is None:
            del os.environ["EFFILAYERS_BENCH_COLLECT_CUDA"]
        else:
            os.environ["EFFILAYERS_BENCH_COLLECT_CUDA"] = collect
    softmax = []
    for device, shape, dim, dtype, op in (p.values for p in listed[0]):
        if device == "cuda" and op == "softmax":  # log/non-log and the backward share the launchers' keys
            softmax += [_softmax(shape, dim, dtype, "forward"), _softmax(shape, dim, dtype, "backward")]
    softmax += [_masked_softmax(shape, dtype) for shape, dtype in bench_softmax.MASKED_CASES["cuda"]]
    cross_entropy = [_cross_entropy(shape, dtype) for device, shape, dtype in
                     (p.values for p in listed[1]) if device == "cuda"]
    reductions = [_reduction(bench_reductions.GPU_SHAPE, dim_name, kind, dtype) for device, dtype, dim_name, kind in
                  (p.values for p in listed[2]) if device == "cuda"]
    queues = [sorted(q, key=lambda case: "bfloat16" not in case.label) for q in (softmax, cross_entropy, reductions)]
    while any(queues):
        for queue in queues:
            if queue:
                yield queue.pop(0)


class Key(NamedTuple):
    family: str
    key: str
    case: Case
    candidates: list


def keys(families) -> list[Key]:
    """Every distinct key the benchmark launches look up, with its candidates."""
    found, seen = [], set()
    for case in cases():
        if case.family not in families:
            continue
        request = tuning.probe(case.make("meta", False))
        if (case.family, request.key) in seen:
            continue
        seen.add((case.family, request.key))
        candidates = FAMILIES[case.family].tuning_candidates(request.launcher, request.sizes, request.dtype)
        found.append(Key(case.family, request.key, case, candidates))
    return found


def check_tiny(key: Key, checked: set) -> list[dict]:
    """Every candidate of ``key`` installed for the same launcher at a tiny
    shape (under TRITON_INTERPRET on the CPU), its result against the
    heuristic's. The interpreter ignores warps and stages, so a candidate
    differing only in those is run once."""
    launch = key.case.make("cpu", True)
    tiny = tuning.probe(launch)
    arch = tuning.arch(torch.device("cpu"))
    fresh = []
    for config in key.candidates:
        blocks = (key.family, tiny.key, tuple(sorted((k, v) for k, v in config.items()
                                                     if k.isupper() or k in ("splits", "split", "persistent"))))
        if blocks not in checked:
            checked.add(blocks)
            fresh.append(config)
    if not fresh:
        return []
    tuning.install(key.family, arch, {})
    reference = [t.clone() for t in launch()]
    rows = []
    for config in fresh:
        tuning.install(key.family, arch, {tiny.key: config})
        row = {"family": key.family, "key": key.key, "tiny_key": tiny.key, "config": config}
        try:
            for got, expected in zip(launch(), reference):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True)
            row["ok"] = True
        except Exception as error:  # noqa: BLE001 - a wrong or failing candidate is a row of the report
            row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:500]}")
        rows.append(row)
    return rows


def time_key(key: Key, arch: str, deadline: float) -> dict:
    """Each candidate's CUDA-event median (us) until the deadline; the
    winner among those timed, and whether every candidate was."""
    launch = key.case.make("cuda", False)
    timings = []
    for config in key.candidates:
        if time.monotonic() + RESERVE > deadline:
            break
        tuning.install(key.family, arch, {key.key: config})
        try:
            timings.append({"config": config, "us": device_median_seconds(launch, "cuda", rep_ms=REP_MS) * 1e6})
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: recorded, not fatal
            timings.append({"config": config, "error": f"{type(error).__name__}: {str(error)[:300]}"})
    timed = [t for t in timings if "us" in t]
    entry = {"case": key.case.label, "heuristic": key.candidates[0], "complete": len(timings) == len(key.candidates),
             "timings": timings}
    if timed and timings[0]["config"] == key.candidates[0] and "us" in timings[0]:
        best = min(timed, key=lambda t: t["us"])
        entry.update(config=best["config"], us=best["us"], heuristic_us=timings[0]["us"])
    else:  # without the heuristic's time there is nothing to compare a winner with
        entry["complete"] = False
    return entry


def _write(path: Path, report: dict) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=1) + "\n")
    partial.replace(path)


def sweep(args) -> int:
    families = args.families.split(",") if args.families else list(FAMILIES)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        print(f"tune: unknown families {unknown}; known: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    found = keys(families)
    if args.dry_run:
        for key in found:
            print(f"{key.family}: {key.key} ({key.case.label}): {len(key.candidates)} candidates")
            for config in key.candidates:
                print(f"    {json.dumps(config)}")
        print(f"{len(found)} keys, {sum(len(k.candidates) for k in found)} candidates")
        return 0
    out = Path(args.out)
    report = {"command": " ".join(["python3", *sys.argv]), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "budget_s": args.budget}
    if args.tiny:
        if tuning.arch(torch.device("cpu")) is None:
            print("tune: --tiny runs the kernels on the CPU under TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        checked: set = set()
        rows = [row for key in found for row in check_tiny(key, checked)]
        tuning.clear()
        report.update(tiny=rows, keys=len(found))
        _write(out, report)
        failed = [row for row in rows if not row["ok"]]
        for row in failed:
            print(f"FAILED {row['family']} {row['tiny_key']} {row['config']}: {row['error']}")
        print(f"tune --tiny: {len(rows)} candidate runs of {len(found)} keys, {len(failed)} failed; {out}")
        return 1 if failed else 0

    if not torch.cuda.is_available():
        print("tune: the sweep needs a CUDA device (--dry-run or --tiny run without one)", file=sys.stderr)
        return 2
    import triton

    arch = tuning.arch(torch.device("cuda"))
    report.update(device=torch.cuda.get_device_name(), arch=arch, triton=triton.__version__, stopped=None,
                  entries={})
    deadline = STARTED + args.budget
    try:
        for key in found:
            if not args.retune and key.key in tuning.table(key.family, arch):
                continue
            if time.monotonic() + RESERVE > deadline:
                report["stopped"] = "budget"
                break
            entry = time_key(key, arch, deadline)
            tuning.clear()
            report["entries"].setdefault(key.family, {})[key.key] = entry
            _write(out, report)
            if "us" in entry:
                print(f"{key.family} {key.key}: {entry['heuristic_us']:.1f} us -> {entry['us']:.1f} us "
                      f"{json.dumps(entry['config'])}{'' if entry['complete'] else ' (cut short)'}", flush=True)
    except KeyboardInterrupt:  # a GPU session's cut: keep what was measured
        report["stopped"] = "interrupted"
    finally:
        tuning.clear()
        _write(out, report)
    print(f"tune: {sum(len(v) for v in report['entries'].values())} keys timed in "
          f"{time.monotonic() - STARTED:.0f}s, stopped: {report['stopped'] or 'done'}; {out}")
    return 0


def merge(args) -> int:
    """The complete entries of a sweep into the committed tables, key by key
    (other keys of a table are kept)."""
    winners = json.loads(Path(args.winners).read_text())
    arch = winners["arch"]
    for family, entries in winners["entries"].items():
        path = tuning.table_path(family, arch, Path(args.ops) if args.ops else None)
        table = json.loads(path.read_text()) if path.exists() else {"arch": arch, "entries": {}}
        for key, entry in sorted(entries.items()):
            if not entry.get("complete"):
                print(f"{family} {key}: not every candidate was timed; left out")
                continue
            table["entries"][key] = {"config": entry["config"], "us": round(entry["us"], 2),
                                     "heuristic_us": round(entry["heuristic_us"], 2), "device": winners["device"],
                                     "date": winners["date"], "torch": winners["torch"], "triton": winners["triton"]}
            print(f"{family} {key}: {entry['heuristic_us']:.1f} us -> {entry['us']:.1f} us")
        table["entries"] = dict(sorted(table["entries"].items()))
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/tune.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("sweep", help="time the candidates (GPU), list them (--dry-run) or run them (--tiny)")
    run.add_argument("--budget", type=float, default=100, help="seconds for the whole script, imports included")
    run.add_argument("--out", default="tuned.json", help="the winners' JSON")
    run.add_argument("--families", help=f"comma-separated, of {', '.join(FAMILIES)} (default: all)")
    run.add_argument("--retune", action="store_true", help="time keys the committed table already has too")
    run.add_argument("--dry-run", action="store_true", help="list every key and its candidates; run nothing")
    run.add_argument("--tiny", action="store_true",
                     help="with TRITON_INTERPRET=1 on the CPU: run every candidate at a tiny shape against the "
                          "heuristic's result")
    merging = commands.add_parser("merge", help="a sweep's complete winners into ops/<family>/tuned_<arch>.json")
    merging.add_argument("winners", help="the JSON a sweep wrote")
    merging.add_argument("--ops", help="the ops folder holding the families (default: the package's)")
    args = parser.parse_args(argv)
    return sweep(args) if args.command == "sweep" else merge(args)


if __name__ == "__main__":
    raise SystemExit(main())
