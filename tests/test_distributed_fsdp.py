"""ChunkedAdamW on FSDP2 (``fully_shard``) models: DTensor parameters, two
gloo ranks. Trajectories against torch.optim.AdamW on the same sharded
model, mixed precision, gradient clipping, torch's state layout, and the
errors for param groups that mix placements."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from effilayers.optim import ChunkedAdamW

from .accuracy import tolerance
from .conftest import activate_backend
from .distributed_cases import gloo, run_ranks, save, shard, small_model

pytestmark = pytest.mark.slow

STEPS = 20


def train(model, optimizer, rank, steps, *, clip=None, seed=1):
    """`steps` steps on rank-dependent data (FSDP averages the gradients)."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 7, generator=generator), torch.randn(8, 1, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x).float(), y).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm.full_tensor() > clip  # the clip does act
        optimizer.step()


def full(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def layout(state_dict):
    """Per entry and key: (DTensor or not, placements, full value)."""
    out = {}
    for number, entry in state_dict["state"].items():
        for key, value in entry.items():
            placed = hasattr(value, "placements")
            out[(number, key)] = (placed, tuple(value.placements) if placed else None,
                                  value.full_tensor() if placed else value.clone())
    return out


CONFIGS = {"fp32": {}, "mixed-bf16": dict(mixed=True), "clip": dict(clip=0.05)}


def _trajectory_worker(rank, world, workdir):
    results = {}
    with gloo(rank, world, workdir):
        for name, config in CONFIGS.items():
            mixed = config.get("mixed", False)
            ours, theirs = shard(small_model(), mixed), shard(small_model(), mixed)
            optimizer = ChunkedAdamW(ours.parameters(), lr=1e-2, chunk_size=200)
            reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
            train(ours, optimizer, rank, STEPS, clip=config.get("clip"))
            train(theirs, reference, rank, STEPS, clip=config.get("clip"))
            results[name] = {"ours": full(ours), "theirs": full(theirs),
                             "layout": layout(optimizer.state_dict()),
                             "reference_layout": layout(reference.state_dict()),
                             "local_sizes": [p.to_local().numel() for p in ours.parameters()],
                             "chunks": optimizer.chunk_layout()}
    save(workdir, rank, results)


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    activate_backend("adam_step_", "cpp", "cpu").__exit__(None, None, None)  # build once, before the workers
    return run_ranks(_trajectory_worker, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp2_trajectory_matches_torch_adamw(trajectories, config):
    # fp32 to rounding over 20 steps; bf16 compute rounds the forward of two
    # models whose fp32 parameters differ in the last bits
    tol = tolerance(torch.bfloat16) if config == "mixed-bf16" else dict(rtol=1e-6, atol=1e-7)
    for rank, result in enumerate(trajectories):
        for index, (p, q) in enumerate(zip(result[config]["ours"], result[config]["theirs"])):
            torch.testing.assert_close(p, q, **tol, msg=lambda m: f"rank {rank}, parameter {index}: {m}")
    # the ranks agree, and the model did train
    for p, q in zip(trajectories[0][config]["ours"], trajectories[1][config]["ours"]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    start = [p.detach() for p in small_model().parameters()]
    assert all((p - q).abs().max() > 1e-3 for p, q in zip(trajectories[0][config]["ours"], start))


def test_fsdp2_state_dict_has_torch_layout(trajectories):
    """Same keys, DTensors where torch has DTensors (placements included),
    a plain ``step``, and the values of torch's run."""
    for result in trajectories:
        ours, theirs = result["fp32"]["layout"], result["fp32"]["reference_layout"]
        assert sorted(ours) == sorted(theirs)
        for key, (placed, placements, value) in theirs.items():
            assert ours[key][:2] == (placed, placements), key
            torch.testing.assert_close(ours[key][2], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    # rank 1 holds an empty shard of the last bias and steps it like the others
    assert trajectories[1]["fp32"]["local_sizes"][-1] == 0
    assert sum(chunk["numel"] for chunk in trajectories[1]["fp32"]["chunks"]) == sum(
        trajectories[1]["fp32"]["local_sizes"])
