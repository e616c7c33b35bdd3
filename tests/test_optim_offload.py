"""ChunkedAdam(W)(offload="cpu"): states on the CPU, the staging pipeline,
and the optimizer's own copy of the parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from effilayers.optim import ChunkedAdamW

from .accuracy import tolerance
from .optim_cases import assert_same_params, make_net, train_steps

# -- offload ------------------------------------------------------------------

@pytest.mark.parametrize("staged", [False, True], ids=["cpu-params", "staging-pipeline"])
def test_offload_cpu_matches_torch(staged):
    """offload="cpu": with CPU parameters the ordinary path; `staged` runs the
    CUDA pipeline's code (staging buffers, chunk-by-chunk download, CPU
    kernel, upload) with the streams replaced by synchronous copies."""
    expected, actual = make_net(), make_net()
    train_steps(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2, amsgrad=True), 30, spare_every=4)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, amsgrad=True, offload="cpu", chunk_size=256)
    optimizer._force_staging = staged
    train_steps(actual, optimizer, 30, spare_every=4)
    assert_same_params(actual, expected, **tolerance(torch.float32))
    assert all(entry["state_device"] == "cpu" for entry in optimizer.chunk_layout())


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_offload_cuda_keeps_no_state_on_gpu_and_matches_torch(param_dtype):
    expected, actual = make_net().cuda(), make_net().to("cuda", param_dtype)
    train_steps(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2), 20)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, offload="cpu", chunk_size=256)
    train_steps(actual, optimizer, 20)
    for entry in optimizer.state.values():
        assert all(t.device.type == "cpu" for t in entry.values())
    tol = tolerance(torch.float32) if param_dtype == torch.float32 else dict(rtol=0, atol=5e-2)
    assert_same_params(actual, expected, **tol)


def test_parameter_changes_between_steps_reach_the_offload_copy():
    """offload='cpu' keeps its own copy of the parameters (here through the
    staging pipeline on CPU parameters): model.load_state_dict() and clamp_()
    between steps must not be reverted by the next step."""
    expected, actual = make_net(), make_net()
    initial = copy.deepcopy(expected.state_dict())
    reference = torch.optim.AdamW(expected.parameters(), lr=1e-2)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, offload="cpu", chunk_size=256)
    optimizer._force_staging = True
    for model, opt in ((expected, reference), (actual, optimizer)):
        train_steps(model, opt, 3)
        model.load_state_dict(initial)
        with torch.no_grad():
            model.head.weight.clamp_(-0.05, 0.05)
        train_steps(model, opt, 3, seed=4)
    assert_same_params(actual, expected, **tolerance(torch.float32))
