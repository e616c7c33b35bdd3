"""The bench's per-row accounting (effilayers.bench.measure): what a row
keeps between steps, and on CUDA a row's peak counting that row alone
while the rows before it stay on the device to be timed in turn."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from effilayers.bench.measure import Setup, resident_bytes, run_model
from effilayers.bench.variants import Variant


def _wide_head() -> nn.Module:
    # Parameters far above the step's activations: a row that counted the
    # parameters and momentum of the rows before it would read far above them.
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.Linear(2048, 10))


def test_resident_bytes_counts_parameters_buffers_gradients_and_optimizer_state_once():
    model = _wide_head()
    model[-1].weight = nn.Parameter(model[-2].weight.detach()[:10])  # shares a storage: counted once
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters() if p is not model[-1].weight)
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    device = torch.device("cpu")
    assert resident_bytes(model, optimizer, device) == parameters + buffers
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()  # momentum: a buffer per parameter, the view's its own
    view_momentum = model[-1].weight.numel() * 4
    assert resident_bytes(model, optimizer, device) == 3 * parameters + buffers + 2 * view_momentum
    optimizer.zero_grad(set_to_none=True)
    assert resident_bytes(model, optimizer, device) == 2 * parameters + buffers + view_momentum
    assert resident_bytes(model, optimizer, torch.device("meta")) == 0


class _Bar:
    def set_description(self, text: str) -> None:
        pass

    def update(self, count: int = 1) -> None:
        pass


@pytest.mark.gpu
def test_a_rows_cuda_peak_does_not_count_the_rows_warmed_up_before_it():
    variants = [Variant("wide_head", name, _wide_head) for name in ("first", "second", "third")]
    setup = Setup(torch.device("cuda"), batch=8, size=32, dtype=torch.float32, channels_last=False, steps=1,
                  train_steps=0)
    results = run_model(variants, setup, None, _Bar())
    peaks = [result.cuda_peak_bytes for result in results]
    # Each row keeps its parameters and momentum (about 34 MB) on the device
    # while the next warms up: uncorrected, the third would read 68 MB above the first.
    parameters = sum(p.numel() * p.element_size() for p in _wide_head().parameters())
    assert all(peak > 2 * parameters for peak in peaks), peaks
    assert max(peaks) - min(peaks) <= parameters // 10, peaks
    forward = [result.cuda_forward_peak_bytes for result in results]
    assert max(forward) - min(forward) <= parameters // 10, forward
