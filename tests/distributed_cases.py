"""Running a test body on several gloo processes (the distributed tests share this).

``run_ranks(worker, tmp_path, *args)`` spawns ``world`` processes running
``worker(rank, world, workdir, *args)``; a worker opens the process group
with ``with gloo(rank, world, workdir):`` and hands its results back with
``save(workdir, rank, value)``. Every collective has a timeout
(``COLLECTIVE_TIMEOUT``) and the whole run a deadline, so a rank waiting on
a peer that never comes fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
RUN_DEADLINE_S = 240


@contextlib.contextmanager
def gloo(rank: int, world: int, workdir: str, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
         backend: str = "gloo"):
    """The default process group (``backend="nccl"`` for the GPU tests)."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two cores: no intra-op threads to oversubscribe
    dist.init_process_group(backend, init_method=f"file://{os.path.join(workdir, 'init')}", rank=rank,
                            world_size=world, timeout=timeout)
    try:
        yield dist.group.WORLD
        # Tear down together: a rank that destroys its gloo group while its
        # peer still uses the connection can abort the process.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save(workdir: str, rank: int, value) -> None:
    torch.save(value, os.path.join(workdir, f"result.{rank}"))


def run_ranks(worker, tmp_path, *args, world: int = 2, deadline_s: float = RUN_DEADLINE_S) -> list:
    """Each rank's saved value, in rank order. A rank that raises fails the
    test with its traceback; a run past ``deadline_s`` is killed and fails."""
    import torch.multiprocessing as mp

    workdir = str(tmp_path)
    context = mp.start_processes(worker, args=(world, workdir, *args), nprocs=world, join=False,
                                 start_method="spawn")
    stop = time.monotonic() + deadline_s
    while not context.join(timeout=max(1.0, stop - time.monotonic())):
        if time.monotonic() >= stop:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(f"{worker.__name__}: ranks still running after {deadline_s} s (a hang)")
    return [torch.load(os.path.join(workdir, f"result.{rank}"), weights_only=False) for rank in range(world)]


# -- a small FSDP2 model --------------------------------------------------------

def small_model():
    """Linear layers whose parameters shard unevenly over two ranks; the last
    bias has one element, so rank 1 holds an empty shard of it."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 19), nn.Tanh(), nn.Linear(19, 1))


def shard(model, mixed=False):
    """``fully_shard`` on each Linear and on the root (FSDP2), optionally with
    bf16 compute and fp32 gradient reduction."""
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def rank_batch(step: int, rank: int, world: int, seed: int = 1):
    """Rank ``rank``'s slice of step ``step``'s global batch of 16 samples:
    with FSDP averaging gradients, any number of ranks sees the same
    gradients as one rank with the whole batch."""
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    x, y = torch.randn(16, 7, generator=generator), torch.randn(16, 1, generator=generator)
    size = 16 // world
    return x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]
