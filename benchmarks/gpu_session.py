"""The whole GPU validation as one command: ``benchmarks/gpu_session.sh all``.

A GPU is lent to this project rarely, for about 15 minutes of device time in
all (machine start and idle waits included) and at most 10 minutes a
command, so everything it should measure is prepared here and runs in one
call of at most 540 s. Each step has its own time budget; a step that runs
out is stopped with everything it started, recorded as cut short, and the
next one starts. Benchmark steps whose family has no fresh GPU result in the
ledger (``benchmarks/ledger.py``) run first and get their time first
(``allocate``): together the steps need more than one call.

    benchmarks/gpu_session.sh prebuild DIR      # here, with torch 2.11+cu130 and Triton 3.6
    benchmarks/gpu_session.sh all --prebuilt DIR   # on the GPU machine
    benchmarks/gpu_session.sh all --dry-run     # the plan, without running anything
    benchmarks/gpu_session.sh STEP ...          # some steps only (a rerun)

``prebuild`` compiles both compiled libraries against the GPU image's torch
and fills a Triton cache for sm_90 through the full kernel report (every
configuration, failing on a row that fails; CI compiles them pairwise), so
the GPU's minutes are not spent compiling: ``all`` places the libraries
in its build cache when their stamp matches the sources there, else builds
them, and reports how many Triton kernels it still had to compile.

Everything lands in one folder; it is packed after every step into
``$OUT/gpu-session-<device>-<date>.tar.gz`` (the device tool brings back at
most 8 files), beside ``summary-<device>-<date>.md``. Without ``$OUT`` the
folder is ``benchmarks/results/gpu-session-<device>-<date>/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
TOTAL_BUDGET = 540
# A cut-short command gets this long to end after SIGINT.
GRACE = 8

# The tests that failed on the first H200 session (results/gpu_tests-h200-2026-11-27.log),
# run first so their verdict comes back even if the full run is cut short.
FAILED_ON_H200 = (
    "tests/test_cross_entropy_api.py::test_cuda_autocast_float32_loss_like_torch",
    "tests/test_cross_entropy_autograd.py::test_retain_graph_backward_twice",
    "tests/test_linear_cross_entropy_api.py::test_cuda_matches_float64_and_peak_stays_small",
    "tests/test_optim_kernel.py::test_triton_kernel_over_2_31_elements",
    "tests/test_reductions.py::test_overflow_table",
    "tests/test_stats.py::test_random_shapes_and_layouts",
    "tests/test_softmax_api.py::test_triton_gpu_rows",
)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    budget: int  # seconds, an upper bound: a step that ends early leaves its time to the last one
    commands: tuple[str, ...]
    family: Optional[str] = None  # the ledger family it measures; None: runs in plan order


def plan(device: str, date: str, results: str) -> list[Step]:
    """Every step, in the issue's order, with ``{...}`` filled in."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.ledger import op_families  # the standard library only

    def bench(family: str, path: str, selection: str) -> str:
        return (f"python3 -m pytest {path} -k {selection!r} -q -p no:cacheprovider --benchmark-group-by=group "
                f"--benchmark-json={results}/{family}-{device}-{date}.json")

    def effilayers_bench(name: str, arguments: str) -> str:
        return f"python3 -m effilayers.bench --device cuda {arguments} --json {results}/{name}-{device}-{date}.json"

    failed = " ".join(FAILED_ON_H200)
    return [
        Step("build", 20, ("python3 benchmarks/gpu_session.py load-libraries",)),
        Step("selftest", 70, ("python3 -m effilayers.info --selftest",
                              "python3 benchmarks/gpu_session.py triton-first-launch")),
        # The budgets of build, selftest and tests are what they took on the
        # H200 (gpu-session-h200-2026-11-30-steps.md) and a margin. -n 8:
        # more workers would run more of the tests that each need tens of
        # GiB at once. The benchmark budgets below are what each needs whole, from
        # that session's durations; they add up to more than one call, and
        # allocate() gives the time to the stale families first. The compile
        # rows (torch.compile per shape) are most of the kernels' steps.
        Step("tests", 150, (
            f"python3 -m pytest {failed} -m gpu -q -rfE -p no:cacheprovider --timeout=60 "
            f"--junitxml={results}/gpu_tests_failed_before-{device}-{date}.xml",
            f"python3 -m pytest -m gpu tests -q -rfEs -p no:cacheprovider -n 8 --timeout=120 "
            f"--junitxml={results}/gpu_tests-{device}-{date}.xml")),
        # Each op family's cuda cases, with the seconds its bench file
        # declares (LEDGER; ledger.op_families finds them), the shortest
        # first: among stale families measured on the same day (or never),
        # one session then measures the most.
        *(Step(family.name, family.gpu_seconds, (bench(family.prefixes[0], family.bench, "cuda"),),
               family=family.name)
          for family in sorted(op_families(), key=lambda family: family.gpu_seconds) if family.gpu_seconds),
        Step("max_batch", 180, (effilayers_bench("bench", "--max-batch --model resnet50 --model densenet121"),),
             family="max_batch"),
        # torch.compile under the budget compiles the model once: most of a
        # minute on the H200 for ResNet-50 (2026-11-28), longer for
        # DenseNet-121's many layers. One family each, so that one session's
        # time can go to one of them whole. (bench_fit.py's selective case
        # times the CPU by process time: not a GPU session's work.)
        Step("fit_resnet50", 150, (
            effilayers_bench("budget-resnet50-0.35",
                             "--model resnet50 --budget 0.35 --batch 32 --size 224 --dtype bfloat16 --steps 5"),),
             family="fit_resnet50"),
        Step("fit_densenet121", 150, (
            effilayers_bench("budget-densenet121-0.25",
                             "--model densenet121 --budget 0.25 --batch 32 --size 224 --dtype bfloat16 --steps 5"),),
             family="fit_densenet121"),
        # GPT-2 small from transformers (on the GPU image) at a training
        # shape: fit within 0.35 beside torch's checkpointing and compile
        # budget, then within 0.25 with offloading to host memory allowed.
        Step("fit_gpt2", 240, tuple(
            effilayers_bench(f"budget-gpt2_small-{budget}",
                             f"--model benchmarks.transformer_models:gpt2_small --tokens 1024 --batch 8 "
                             f"--dtype bfloat16 --budget {budget.split('-')[0]}{options} --steps 5")
            # The offload target compares fit with plain alone: the torch
            # rows (an inductor compile and auto-SAC's estimate among them)
            # ran once at 0.35.
            for budget, options in (("0.35", ""), ("0.25-offload", " --offload --budget-rows fit"))),
            family="fit_gpt2"),
        # A quarter of the script's default tokens and half its layers: the
        # offloaded steps run Adam on the CPU (13 s in all on the H200).
        # The launch-configuration sweep (benchmarks/tune.py): its own
        # budget is under the step's, so it ends and writes its winners
        # before the step's cut; allocate() runs it after the stale families.
        Step("tune", 120,
             (f"python3 benchmarks/tune.py sweep --budget 100 --out {results}/tuned-{device}-{date}.json",)),
        Step("offload", 15,
             (f"python3 benchmarks/bench_fsdp_offload.py --layers 4 --batch 4096 --steps 3 --warmup 1 "
              f"--json {results}/fsdp_offload-{device}-{date}.json",),
             family="offload"),
        # What the others leave (the last step takes it all).
        Step("sanitizer", 60, (
            "compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest tests/test_stats.py "
            "tests/test_abn.py -k 'cuda-cuda and not random and not gloo' -x -q -p no:cacheprovider",
            "compute-sanitizer --tool racecheck --error-exitcode 1 python3 -m pytest tests/test_abn.py "
            "-k 'cuda-cuda and not random and not gloo' -x -q -p no:cacheprovider")),
    ]


def ledger_state() -> tuple[Optional[set[str]], dict[str, Optional[str]]]:
    """The families whose newest GPU result in the ledger is fresh, and per
    family that result's date (None: never measured on a GPU). (None, {})
    when the ledger cannot tell (no git history, as on a copy of the tree
    without .git: then every family counts as stale)."""
    try:
        sys.path.insert(0, str(ROOT))
        from benchmarks.ledger import ledger_rows
        rows = ledger_rows(ROOT)
        return {row.family for row in rows if row.fresh}, {row.family: row.result_date for row in rows}
    except Exception as error:
        print(f"gpu_session: no ledger ({type(error).__name__}: {error}): every family counts as stale", flush=True)
        return None, {}


# A step given less than this is not started: it would spend its time
# importing torch and end with nothing measured.
SHORTEST = 15


def allocate(steps: list[Step], fresh: Optional[set[str]], total: int = TOTAL_BUDGET,
             measured: Optional[dict[str, Optional[str]]] = None) -> list[Step]:
    """Order and time for one call: the fixed steps first (build, self-test,
    tests), then the benchmark steps of stale families, least recently
    measured first (``measured``: family -> date of its newest GPU result,
    None or missing for never), then the tuning sweep, then the benchmark
    steps of fresh families, ties and fresh families in plan order, the
    sanitizer last. The stale steps add up to more than one call when every
    family is stale, as after a round of kernel work; oldest first, the
    families the last call left out are the next call's first, so a few
    calls measure them all. (The sweep never takes time a stale family
    needs, and goes before re-measuring what is already fresh.) Time goes in that
    order: each of those steps gets its full budget while the total allows,
    the first that does not fit gets what is left, and a step left under
    SHORTEST seconds is dropped, so the stalest families are measured
    whole and the rest wait for the next call. The sanitizer takes what
    remains (the run also gives the last step whatever the others did not
    use)."""
    fresh = fresh or set()
    measured = measured or {}
    head = [s for s in steps if not s.family and s.name not in ("sanitizer", "tune")]
    tail = [s for s in steps if s.name == "sanitizer"]
    # ISO dates sort as text; "" (never measured) before any of them. sorted() keeps plan order in ties.
    stale = sorted((s for s in steps if s.family and s.family not in fresh),
                   key=lambda s: measured.get(s.family) or "")
    ordered = (stale + [s for s in steps if s.name == "tune"]
               + [s for s in steps if s.family and s.family in fresh])
    left = total - sum(s.budget for s in head) - SHORTEST * len(tail)
    given = []
    for step in ordered:
        seconds = min(step.budget, left)
        if seconds >= SHORTEST:
            given.append(dataclasses.replace(step, budget=seconds))
            left -= seconds
    tail = [dataclasses.replace(s, budget=total - sum(x.budget for x in head + given)) for s in tail]
    return head + given + tail


def check_budgets(steps: list[Step]) -> None:
    total = sum(step.budget for step in steps)
    if total > TOTAL_BUDGET:
        raise SystemExit(f"gpu_session: the steps' budgets add up to {total}s, over {TOTAL_BUDGET}s")


def device_name() -> Optional[str]:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name().replace("NVIDIA", "").split()[0].split("-")[0].lower()


def run_command(command: str, seconds: float, log, env: dict) -> tuple[str, float]:
    """(outcome, seconds taken): 'passed', 'failed (exit N)' or 'cut short'.
    The command runs in its own process group, so a cut takes everything it
    started (pytest's workers, compute-sanitizer's child)."""
    started = time.monotonic()
    if seconds <= 1:
        return "not run (no time left)", 0.0
    # A job started in the background of a shell (as the device tool runs
    # commands) inherits SIGINT ignored, and Python then keeps ignoring it:
    # restored, so the cut below can end pytest gracefully.
    process = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # The cut's grace periods come out of the command's own time.
        reserve = min(GRACE + 2, seconds / 4)
        code = process.wait(timeout=seconds - reserve)
    except subprocess.TimeoutExpired:
        # SIGINT first: pytest then ends its session as after Ctrl-C, and
        # pytest-benchmark still writes the JSON of what it timed.
        for sig, wait in ((signal.SIGINT, reserve - 1), (signal.SIGTERM, 1), (signal.SIGKILL, None)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return "cut short", time.monotonic() - started
    return ("passed" if code == 0 else f"failed (exit {code})"), time.monotonic() - started


def tail(path: Path, lines: int) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def pack(folder: Path, out: Optional[Path], device: str, date: str) -> None:
    """The results folder as one archive in $OUT (rewritten after each step,
    so a call that ends early still brings back what was done)."""
    if out is None:
        return
    archive = out / f"gpu-session-{device}-{date}.tar.gz"
    partial = archive.with_suffix(".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(folder, arcname=folder.name,
                filter=lambda info: None if "/cache" in info.name else info)
    partial.replace(archive)
    # The summary, and the tuning sweep's winners (for tune.py merge), also
    # beside the archive.
    for path in (folder / f"summary-{device}-{date}.md", folder / f"tuned-{device}-{date}.json"):
        if path.exists():
            shutil.copy2(path, out / path.name)


def write_summary(folder: Path, device: str, date: str, header: list[str], rows: list[dict]) -> None:
    lines = [f"# GPU session, {device}, {date}", "", *header, "",
             "| step | budget s | took s | outcome | command |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['step']} | {row['budget']} | {row['seconds']:.0f} | {row['outcome']} | "
                     f"`{row['command']}` |")
    (folder / f"summary-{device}-{date}.md").write_text("\n".join(lines) + "\n")
    (folder / f"summary-{device}-{date}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))


def environment_lines() -> list[str]:
    import torch

    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}"]
    try:
        import triton
        lines[0] += f", triton {triton.__version__}"
    except ImportError:
        lines[0] += ", no triton"
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        lines.append(f"{properties.name}, {properties.total_memory // 2**20} MiB, "
                     f"{properties.multi_processor_count} SMs, {os.cpu_count()} CPU cores")
    commit = ROOT / ".gpu-prebuilt" / "COMMIT"
    lines.append(f"checkout: {commit.read_text().strip() if commit.exists() else 'commit unknown'}")
    return lines


def run_all(names: list[str], prebuilt: Optional[Path], dry_run: bool) -> int:
    import torch

    device = device_name() if torch.cuda.is_available() else None
    if device is None and not dry_run:
        print("gpu_session: needs a CUDA device (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    device = device or "DEVICE"
    date = datetime.date.today().isoformat()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    folder = (Path("/tmp") if out else ROOT / "benchmarks" / "results") / f"gpu-session-{device}-{date}"
    steps = plan(device, date, str(folder))
    # STEP=SECONDS: a rerun's own budget for that step.
    overrides = {name: int(seconds) for name, _, seconds in (n.partition("=") for n in names) if seconds}
    names = [n.partition("=")[0] for n in names]
    steps = [dataclasses.replace(s, budget=overrides.get(s.name, s.budget)) for s in steps]
    if names == ["all"]:
        fresh, measured = ledger_state()
        steps = allocate(steps, fresh, measured=measured)
    else:
        known = {s.name for s in steps}
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"gpu_session: unknown step {unknown}; steps: all, {', '.join(s.name for s in steps)}",
                  file=sys.stderr)
            return 2
        steps = [s for s in steps if s.name in names or s.name == "build"]
    check_budgets(steps)
    if dry_run:
        for step in steps:
            print(f"step {step.name} budget {step.budget}s: {' ; '.join(step.commands)}")
        print(f"total budget {sum(s.budget for s in steps)}s")
        return 0

    folder.mkdir(parents=True, exist_ok=True)
    cache = folder / "cache"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1", "EFFILAYERS_REQUIRE_COMPILED": "1", "TORCH_CUDA_ARCH_LIST": "9.0",
           "EFFILAYERS_CACHE_DIR": str(cache / "effilayers"), "TRITON_CACHE_DIR": str(cache / "triton")}
    header = environment_lines()
    if prebuilt is not None:
        header += place_prebuilt(prebuilt, cache)
    print("\n".join(header), flush=True)
    deadline = time.monotonic() + TOTAL_BUDGET
    rows: list[dict] = []
    failed = False
    for index, step in enumerate(steps):
        left = deadline - time.monotonic()
        # The last step takes whatever the others left.
        budget = left if index == len(steps) - 1 else min(step.budget, left)
        step_end = time.monotonic() + budget
        log_path = folder / f"{step.name}-{device}-{date}.log"
        print(f"\n=== step {step.name}: budget {budget:.0f}s", flush=True)
        for command in step.commands:
            with open(log_path, "a") as log:
                log.write(f"+ {command}\n")
                log.flush()
                outcome, seconds = run_command(command, step_end - time.monotonic(), log, env)
            print(f"{tail(log_path, 6)}\n-> {outcome} in {seconds:.0f}s", flush=True)
            rows.append(dict(step=step.name, budget=round(budget), seconds=seconds, outcome=outcome,
                             command=command))
            failed |= outcome != "passed"
        write_summary(folder, device, date, header, rows)
        pack(folder, out, device, date)
    print(f"\n{'step':10} {'took':>6}  outcome")
    for row in rows:
        print(f"{row['step']:10} {row['seconds']:5.0f}s  {row['outcome']}: {row['command'][:70]}")
    return 1 if failed else 0


# --------------------------------------------------------------------------
# Compiled libraries and Triton cache: built here, placed there
# --------------------------------------------------------------------------

def prebuild(directory: Path) -> int:
    """Run with the GPU image's torch (2.11+cu130) and Triton (3.6): both
    libraries and a Triton cache of every kernel configuration for sm_90."""
    from effilayers._core import build

    directory.mkdir(parents=True, exist_ok=True)
    for kind in ("cpu", "cuda"):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        print(f"{kind}: {build.export_library(kind, directory)}", flush=True)
    cache = directory / "triton-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    # Every configuration the kernel report knows (what the launchers pick
    # at the benchmark shapes), compiled for sm_90 as the JIT would there:
    # the full report, which CI compiles only pairwise (--pairwise), so a
    # failing row stops the prebuild here, before the GPU's time is spent.
    subprocess.run([sys.executable, "-m", "effilayers.info", "--kernels", "--target", "sm_90"], cwd=ROOT, env=env,
                   check=True)
    for entry in cache.iterdir():
        # A cache hit reads the metadata and the cubin; the compiler's
        # intermediate forms would make the call's working tree too large.
        for path in entry.iterdir():
            if path.suffix in (".llir", ".ttir", ".ttgir", ".source"):
                path.unlink()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    (directory / "COMMIT").write_text(commit.stdout.strip() + (" with uncommitted changes" if dirty else "") + "\n")
    print(f"triton cache: {sum(1 for _ in cache.iterdir())} sm_90 kernels; {directory}", flush=True)
    return 0


def place_prebuilt(directory: Path, cache: Path) -> list[str]:
    from effilayers._core import build

    os.environ["EFFILAYERS_CACHE_DIR"] = str(cache / "effilayers")
    lines = [build.import_library(kind, directory) for kind in ("cpu", "cuda")]
    shipped = directory / "triton-cache"
    if shipped.is_dir():
        shutil.copytree(shipped, cache / "triton", dirs_exist_ok=True)
        relocate_triton_cache(cache / "triton")
        lines.append(f"triton cache: {sum(1 for _ in shipped.iterdir())} kernels shipped")
    else:
        lines.append(f"triton cache: none shipped in {directory}")
    return lines


def relocate_triton_cache(cache: Path) -> None:
    """Triton's group files name their members by absolute path, and a
    member that is not where its group says is skipped (the entry then
    misses): point them at this copy, dropping the members not shipped."""
    for group in cache.glob("*/__grp__*.json"):
        data = json.loads(group.read_text())
        children = {name: str(group.parent / Path(path).name) for name, path in data["child_paths"].items()
                    if (group.parent / Path(path).name).exists()}
        group.write_text(json.dumps({"child_paths": children}))


def load_libraries() -> int:
    """The 'build' step: load both libraries (built now if what was shipped
    did not match) and say where each came from."""
    from effilayers._core import build

    for kind in ("cpu", "cuda"):
        print(f"{kind}: {build.build_and_load(kind)}", flush=True)
    return 0


def triton_first_launch() -> int:
    """What the first launch of a Triton kernel costs with the shipped cache
    and without one, in fresh processes: softmax's forward on one bf16 shape.
    Also how many kernels the self-test had to compile although a cache was
    shipped (entries in the session's cache beyond those shipped)."""
    probe = ("import time, torch, effilayers.functional as F\n"
             "x = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16)\n"
             "torch.cuda.synchronize(); t = time.perf_counter(); F.softmax(x, -1); torch.cuda.synchronize()\n"
             "first = time.perf_counter() - t; t = time.perf_counter(); F.softmax(x, -1); torch.cuda.synchronize()\n"
             "print(f'{first:.3f} {time.perf_counter() - t:.6f}')\n")
    session_cache = Path(os.environ["TRITON_CACHE_DIR"])
    shipped = ROOT / ".gpu-prebuilt" / "triton-cache"
    pristine, empty = session_cache.parent / "triton-shipped", session_cache.parent / "triton-empty"
    probes = [("with an empty cache", empty)]
    if shipped.is_dir():
        shutil.copytree(shipped, pristine, dirs_exist_ok=True)
        relocate_triton_cache(pristine)
        probes.insert(0, ("with the shipped cache", pristine))
    for label, directory in probes:
        env = {**os.environ, "TRITON_CACHE_DIR": str(directory)}
        done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"probe {label} failed:\n{done.stderr[-2000:]}")
            return 1
        first, second = done.stdout.split()[-2:]
        print(f"softmax bf16 4096x4096: first call {float(first) * 1e3:.0f} ms, second {float(second) * 1e3:.2f} ms "
              f"({label})", flush=True)
    for directory in (pristine, empty):
        shutil.rmtree(directory, ignore_errors=True)
    if shipped.is_dir():
        new = sorted({p.name for p in session_cache.iterdir()} - {p.name for p in shipped.iterdir()})
        print(f"triton cache: the self-test compiled {len(new)} kernels here although "
              f"{sum(1 for _ in shipped.iterdir())} were shipped", flush=True)
    return 0


def check_plan() -> int:
    """On CPU, what a GPU session would find wrong first: every pytest
    selection of the plan collects at least one test (the cuda benchmark
    cases listed through EFFILAYERS_BENCH_COLLECT_CUDA), every option is
    one pytest or the bench command accepts, every script exists and
    answers --help. One process, so torch is imported once."""
    import shlex
    import tempfile

    import pytest

    from effilayers.bench.cli import _parser

    os.environ["EFFILAYERS_BENCH_COLLECT_CUDA"] = "1"
    sys.path.insert(0, str(ROOT))

    class Count:
        def __init__(self):
            self.items = 0

        def pytest_collection_finish(self, session):
            self.items = len(session.items)

    problems = []
    with tempfile.TemporaryDirectory() as results:
        for step in plan("DEVICE", "DATE", results):
            for command in step.commands:
                words = shlex.split(command)
                if words[0] == "compute-sanitizer":  # on the GPU machine only; what it wraps is checked here
                    words = words[words.index("python3"):]
                if words[:3] == ["python3", "-m", "pytest"]:
                    arguments = [w for w in words[3:]]
                    if "-n" in arguments:  # collecting needs no workers
                        index = arguments.index("-n")
                        del arguments[index:index + 2]
                    count = Count()
                    # no:unraisableexception: that plugin runs five full
                    # garbage collections after each session, each a walk
                    # of every object the earlier collections left behind.
                    code = pytest.main([*arguments, "--collect-only", "-q", "-p", "no:cacheprovider",
                                        "-p", "no:unraisableexception"], plugins=[count])
                    if code != 0 or count.items == 0:
                        problems.append(f"step {step.name}: {count.items} tests collected (exit {code}): {command}")
                elif words[:3] == ["python3", "-m", "effilayers.info"]:
                    helped = subprocess.run([sys.executable, "-m", "effilayers.info", "--help"], cwd=ROOT,
                                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                    missing = [w for w in words[3:] if w not in helped.stdout]
                    if helped.returncode != 0 or missing:
                        problems.append(f"step {step.name}: effilayers.info lacks {missing}: {command}")
                elif words[:3] == ["python3", "-m", "effilayers.bench"]:
                    try:
                        arguments = _parser().parse_args(words[3:])
                    except SystemExit:
                        problems.append(f"step {step.name}: the bench command refuses: {command}")
                        continue
                    if arguments.device != "cuda" or not arguments.json:
                        problems.append(f"step {step.name}: the bench must run on cuda and write JSON: {command}")
                elif words[0] == "python3" and words[1].endswith(".py"):
                    script = ROOT / words[1]
                    subcommand = [w for w in words[2:3] if not w.startswith("-")]
                    helped = subprocess.run([sys.executable, str(script), *subcommand, "--help"], cwd=ROOT,
                                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                    if not script.exists() or helped.returncode != 0:
                        problems.append(f"step {step.name}: {words[1]} missing or --help fails: {command}")
                    for option in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
                        if option not in helped.stdout:
                            problems.append(f"step {step.name}: {words[1]} has no option {option}")
                else:
                    problems.append(f"step {step.name}: unrecognised command: {command}")
    for problem in problems:
        print(problem)
    print(f"check-plan: {len(problems)} problems")
    return 1 if problems else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_session.sh", description=__doc__.splitlines()[0])
    parser.add_argument("steps", nargs="+", metavar="STEP",
                        help="all, or step names (see --dry-run); or one of: prebuild DIR, load-libraries, "
                             "triton-first-launch, check-plan")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--prebuilt", type=Path, metavar="DIR",
                        help="libraries and Triton cache made by 'prebuild DIR' (default: .gpu-prebuilt when present)")
    args = parser.parse_args(argv)
    if args.steps[0] == "prebuild":
        if len(args.steps) != 2:
            parser.error("prebuild takes one directory")
        return prebuild(Path(args.steps[1]))
    if args.steps == ["load-libraries"]:
        return load_libraries()
    if args.steps == ["triton-first-launch"]:
        return triton_first_launch()
    if args.steps == ["check-plan"]:
        return check_plan()
    prebuilt = args.prebuilt
    if prebuilt is None and (ROOT / ".gpu-prebuilt").is_dir():
        prebuilt = ROOT / ".gpu-prebuilt"
    return run_all(args.steps, prebuilt, args.dry_run)


if __name__ == "__main__":
    raise SystemExit(main())
