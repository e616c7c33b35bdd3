"""Benchmark fixtures: each op is timed against plain PyTorch in the same
run and the same group, so pytest-benchmark's table shows the ratios."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

import effilayers


def devices():
    """cpu, and cuda where a GPU is present. EFFILAYERS_BENCH_COLLECT_CUDA=1
    lists the cuda cases without one, so a CPU test can check that each GPU
    selection of benchmarks/gpu_session.py collects something (they are
    only collected there: run, they would fail)."""
    found = ["cpu"]
    if torch.cuda.is_available() or os.environ.get("EFFILAYERS_BENCH_COLLECT_CUDA") == "1":
        found.append("cuda")
    return found


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_median_seconds(fn, device, rounds: int = 10, rep_ms: int = 100) -> float:
    """Median time of fn(): on CUDA from events (triton.testing.do_bench over
    about ``rep_ms`` ms after a quarter of that in warm-up), the device's
    time without the host's; on CPU the host clock over ``rounds`` calls."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=max(1, rep_ms // 4), rep=rep_ms, return_mode="median") / 1e3
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_copy_gb_per_s: dict[tuple, float] = {}


def copy_gb_per_s(like: torch.Tensor) -> float:
    """GB/s of a device-to-device copy of a tensor like ``like`` (bytes read
    plus bytes written), measured once per shape, dtype and device: the
    ceiling a memory-bound kernel over the same bytes is held against."""
    key = (tuple(like.shape), like.dtype, like.device.type)
    if key not in _copy_gb_per_s:
        source, destination = like.detach(), torch.empty_like(like)
        seconds = device_median_seconds(lambda: destination.copy_(source), like.device.type)
        _copy_gb_per_s[key] = 2 * like.numel() * like.element_size() / seconds / 1e9
    return _copy_gb_per_s[key]


def launch_configs(run) -> list[dict]:
    """Runs ``run()`` once and returns the distinct launch configurations
    the Triton launchers chose in it (``tuning.recording``: table key,
    configuration, "tuned" or "heuristic"), for a row's ``extra_info``: a
    later GPU run then tells which path each row timed (rows per program,
    split rows, a persistent grid) from the configuration, not the date."""
    from effilayers._core import tuning

    with tuning.recording() as launches:
        run()
    distinct = []
    for launch in launches:
        if launch not in distinct:
            distinct.append(launch)
    return distinct


@pytest.fixture
def run_with_backend():
    """``run_with_backend(op_name, backend, device)`` -> context manager that
    forces ``backend``; skips when it cannot run here."""

    def activate(op_name: str, backend: str, device: str):
        context = effilayers.use_backend(backend)
        with context:
            chosen = effilayers.backends.choice(op_name, device)
        if chosen.kernel is None:
            pytest.skip(chosen.error)
        return effilayers.use_backend(backend)

    return activate


def pytest_benchmark_update_machine_info(config, machine_info):
    """Record what a result needs to be reproduced: versions, device, command."""
    import shlex
    import sys

    from effilayers._info import collect

    report = collect()
    machine_info["effilayers"] = {
        "torch": report["torch"],
        "triton": report["triton"],
        "torch_cuda": report["torch_cuda"],
        "device": report["device"],
        "threads": report["threads"],
        "backends": report["ops"],
        "command": "python -m pytest " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    }


@pytest.hookimpl(trylast=True)  # after pytest's own reordering and -k
def pytest_collection_modifyitems(items):
    """Run each case's implementations one after another (pytest would run
    every case of the first implementation first), so that a run cut short,
    as a GPU session's steps can be, leaves whole comparisons rather than
    torch's rows alone. Test ids are unchanged."""
    groups: dict = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        params = {} if spec is None else {k: repr(v) for k, v in spec.params.items() if k != "implementation"}
        key = (item.fspath, item.originalname, tuple(sorted(params.items())))
        groups.setdefault(key, []).append(item)
    items[:] = [item for group in groups.values() for item in group]
