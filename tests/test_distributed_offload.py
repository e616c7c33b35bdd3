"""ChunkedAdamW(offload="cpu") on CPU-resident DTensor shards, as FSDP2 hands
them over on CPU (two gloo ranks): LR schedulers, gradient clipping,
gradient accumulation, parameters without gradients, the staged offload
pipeline, and 8-bit states chosen independently of the sharding. The real
``CPUOffloadPolicy`` needs an accelerator: ``test_cpu_offload_policy_on_gpu``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from effilayers.optim import ChunkedAdamW

from .conftest import activate_backend
from .distributed_cases import gloo, run_ranks, save

pytestmark = pytest.mark.slow

STEPS = 8


class WithSpare(nn.Module):
    """A body, a head, and a spare head used on every third step only: its
    parameters have no gradient on the other steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 19), nn.Tanh())
        self.head = nn.Linear(19, 3)
        self.spare = nn.Linear(19, 3)

    def forward(self, x, use_spare=False):
        h = self.body(x)
        return self.head(h) + self.spare(h) if use_spare else self.head(h)


def sharded_model(policy=None, device="cpu"):
    from torch.distributed.fsdp import fully_shard

    model = WithSpare().to(device)
    kwargs = {} if policy is None else {"offload_policy": policy}
    for module in (*model.body, model.head, model.spare):
        if isinstance(module, nn.Linear):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train(model, optimizer, rank, *, scheduler=None, clip=None, micro_batches=1, device="cpu"):
    from torch.distributed.fsdp import FSDPModule

    generator = torch.Generator().manual_seed(10 + rank)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            if isinstance(model, FSDPModule):  # reduce-scatter once, after the last micro-batch
                model.set_requires_gradient_sync(micro == micro_batches - 1)
            x, y = torch.randn(6, 7, generator=generator), torch.randn(6, 3, generator=generator)
            loss = nn.functional.mse_loss(model(x.to(device), use_spare=step % 3 == 0), y.to(device))
            (loss / micro_batches).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def full(model):
    return [p.full_tensor().detach().cpu().clone() for p in model.parameters()]


def _offload_worker(rank, world, workdir):
    results = {}
    with gloo(rank, world, workdir):
        for name, staged in (("offload", False), ("offload-staged", True)):
            ours, theirs = sharded_model(), sharded_model()
            optimizer = ChunkedAdamW(ours.parameters(), lr=2e-2, offload="cpu", chunk_size=300)
            optimizer._force_staging = staged  # the GPU pipeline's copies, made synchronously on CPU
            reference = torch.optim.AdamW(theirs.parameters(), lr=2e-2)
            assert isinstance(optimizer, torch.optim.Optimizer)
            schedules = [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) for opt in (optimizer, reference)]
            for model, opt, schedule in ((ours, optimizer, schedules[0]), (theirs, reference, schedules[1])):
                train(model, opt, rank, scheduler=schedule, clip=0.05, micro_batches=2)
            results[name] = {"ours": full(ours), "theirs": full(theirs), "lr": optimizer.param_groups[0]["lr"],
                             "steps": {index: float(optimizer.state[p]["step"])
                                       for index, p in enumerate(ours.parameters())},
                             "reference_steps": {index: float(reference.state[p]["step"])
                                                 for index, p in enumerate(theirs.parameters())}}
        model = sharded_model()
        optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, state_dtype="8bit", chunk_size=300)
        train(model, optimizer, rank)
        results["8bit"] = {"kinds": [sorted(optimizer.state[p]) for p in model.parameters()],
                           "local_sizes": [p.to_local().numel() for p in model.parameters()]}
    save(workdir, rank, results)


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    activate_backend("adam_step_", "cpp", "cpu").__exit__(None, None, None)
    return run_ranks(_offload_worker, tmp_path_factory.mktemp("offload"))


@pytest.mark.parametrize("name", ["offload", "offload-staged"])
def test_offloaded_dtensor_shards_match_torch_adamw(offloaded, name):
    """StepLR, clip_grad_norm_ on DTensors, two accumulated micro-batches,
    and a spare head without gradients on most steps."""
    for rank, result in enumerate(offloaded):
        run = result[name]
        for index, (p, q) in enumerate(zip(run["ours"], run["theirs"])):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"rank {rank}, param {index}: {m}")
        assert run["lr"] == pytest.approx(2e-2 * 0.5 ** (STEPS // 3))
        # the spare head stepped only when it had a gradient, as in torch
        assert run["steps"] == run["reference_steps"]
        assert run["steps"][len(run["steps"]) - 1] == len(range(0, STEPS, 3)) < STEPS


def test_eight_bit_states_do_not_depend_on_the_sharding(offloaded):
    """Every parameter gets 8-bit states on each rank, whatever the size of
    its local shard (empty ones included), as it does unsharded."""
    unsharded = WithSpare()
    optimizer = ChunkedAdamW(unsharded.parameters(), lr=1e-2, state_dtype="8bit")
    unsharded.head(unsharded.body(torch.randn(4, 7))).sum().backward()
    unsharded.spare(torch.randn(4, 19)).sum().backward()
    optimizer.step()
    expected = [sorted(optimizer.state[p]) for p in unsharded.parameters()]
    assert all("exp_avg_codes" in kinds for kinds in expected)
    sizes = [size for result in offloaded for size in result["8bit"]["local_sizes"]]
    assert min(sizes) < 256 <= max(sizes)  # shards on both sides of one quantization block
    for result in offloaded:
        assert result["8bit"]["kinds"] == expected


def _cpu_offload_policy_worker(rank, world, workdir):
    from torch.distributed.fsdp import CPUOffloadPolicy

    torch.cuda.set_device(rank)
    # NCCL for FSDP2's collectives on the GPU, gloo for anything on the CPU shards
    with gloo(rank, world, workdir, backend="cpu:gloo,cuda:nccl"):
        ours, theirs = sharded_model(CPUOffloadPolicy(), "cuda"), sharded_model(CPUOffloadPolicy(), "cuda")
        assert all(p.to_local().device.type == "cpu" for p in ours.parameters())  # FSDP2 keeps the shards on the CPU
        optimizer = ChunkedAdamW(ours.parameters(), lr=2e-2, offload="cpu")
        reference = torch.optim.AdamW(theirs.parameters(), lr=2e-2)
        train(ours, optimizer, rank, device="cuda")
        train(theirs, reference, rank, device="cuda")
        save(workdir, rank, {"ours": [p.to_local().detach().clone() for p in ours.parameters()],
                             "theirs": [p.to_local().detach().clone() for p in theirs.parameters()]})


@pytest.mark.gpu
def test_cpu_offload_policy_on_gpu(tmp_path):
    """The real CPUOffloadPolicy (one rank per GPU present, at most two):
    each rank's CPU shards follow torch.optim.AdamW's."""
    world = min(2, torch.cuda.device_count())
    for rank, result in enumerate(run_ranks(_cpu_offload_policy_worker, tmp_path, world=world)):
        for index, (p, q) in enumerate(zip(result["ours"], result["theirs"])):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, param {index}: {m}")
