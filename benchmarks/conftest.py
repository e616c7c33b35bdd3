"""Benchmark fixtures: each op is timed against plain PyTorch in the same
run and the same group, so pytest-benchmark's table shows the ratios."""

from __future__ import annotations

import pytest
import torch

import effilayers


def devices():
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    return found


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


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
