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
