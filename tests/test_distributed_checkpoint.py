"""torch.distributed.checkpoint with ChunkedAdamW on FSDP2: state saved
through ``get_state_dict`` from two gloo ranks, loaded through
``set_state_dict`` into two ranks and into one (resharded), and into
torch.optim.AdamW; training then continues as the uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from effilayers.optim import ChunkedAdamW

from .conftest import activate_backend
from .distributed_cases import gloo, rank_batch, run_ranks, save, shard, small_model

pytestmark = pytest.mark.slow

BEFORE, AFTER = 4, 4
OPTIMIZERS = {"ChunkedAdamW": lambda params: ChunkedAdamW(params, lr=1e-2, chunk_size=100),
              "torch.AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2)}


def train(model, optimizer, rank, world, steps):
    for step in steps:
        x, y = rank_batch(step, rank, world)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def full(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _save_worker(rank, world, workdir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with gloo(rank, world, workdir):
        model = shard(small_model())
        optimizer = OPTIMIZERS["ChunkedAdamW"](model.parameters())
        train(model, optimizer, rank, world, range(BEFORE))
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(workdir, "checkpoint"))
        train(model, optimizer, rank, world, range(BEFORE, BEFORE + AFTER))
        save(workdir, rank, full(model))


def _load_worker(rank, world, workdir, checkpoint, optimizer_name):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with gloo(rank, world, workdir):
        torch.manual_seed(5)  # another initialisation: everything must come from the checkpoint
        model = shard(nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 19), nn.Tanh(), nn.Linear(19, 1)))
        optimizer = OPTIMIZERS[optimizer_name](model.parameters())
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        steps = {float(entry["step"]) for entry in optimizer.state_dict()["state"].values()}
        train(model, optimizer, rank, world, range(BEFORE, BEFORE + AFTER))
        save(workdir, rank, {"params": full(model), "steps": steps})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    activate_backend("adam_step_", "cpp", "cpu").__exit__(None, None, None)
    workdir = tmp_path_factory.mktemp("saved")
    uninterrupted = run_ranks(_save_worker, workdir)
    return str(workdir / "checkpoint"), uninterrupted[0]


@pytest.mark.parametrize("world,optimizer_name", [(2, "ChunkedAdamW"), (1, "ChunkedAdamW"), (1, "torch.AdamW")],
                         ids=["2-ranks", "1-rank", "1-rank-into-torch-AdamW"])
def test_checkpoint_resumes_like_the_uninterrupted_run(saved, tmp_path, world, optimizer_name):
    checkpoint, uninterrupted = saved
    results = run_ranks(_load_worker, tmp_path, checkpoint, optimizer_name, world=world)
    for rank, result in enumerate(results):
        assert result["steps"] == {float(BEFORE)}  # the saved counters, not the dummy step of get_state_dict
        for index, (p, q) in enumerate(zip(result["params"], uninterrupted)):
            # one rank averages the whole batch's gradient in another order than two
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, param {index}: {m}")
    fresh = [p.detach() for p in small_model().parameters()]
    assert any((p - q).abs().max() > 1e-3 for p, q in zip(uninterrupted, fresh))
