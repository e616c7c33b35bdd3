"""The self-test's inputs for the stats ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

import torch

from ..._core.selftest import Case, f32, positive, randn


def _batch_stats(device, dtype, g):
    return [(randn((4, 3, 5, 5), g, dtype, device, 2.0, 3.0), 0),
            (randn((4, 3, 5, 5), g, dtype, device, 2.0, 3.0).to(memory_format=torch.channels_last), 1)]


def _normalizing_statistics(device, dtype, g):
    x = randn((4, 3, 5, 5), g, dtype, device, 2.0, 3.0)
    running = randn((3,), g, f32, device), positive((3,), g, device)
    return [(x, *running, torch.tensor(3, device=device), 0.1, False, 1e-5)]


def _finish_statistics(device, dtype, g):
    acc = torch.float64 if dtype == torch.float64 else f32
    mean, var = randn((3,), g, acc, device), positive((3,), g, device).to(acc)
    running = randn((3,), g, f32, device), positive((3,), g, device)
    return [(mean, var, 40, *running, torch.tensor(3, device=device), 0.1, False, 1e-5),
            (mean, var, 40, *running, torch.tensor(3, device=device), 0.0, True, 1e-5)]


CASES = {
    "batch_stats": Case(_batch_stats),
    "normalizing_statistics": Case(_normalizing_statistics),
    "finish_statistics": Case(_finish_statistics),
}
