"""examples/train_distributed.py under torchrun: two gloo processes, two
steps on small images, with DDP and with FSDP2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import activate_backend

ROOT = Path(__file__).resolve().parents[1]


def run_example(mode: str) -> list[float]:
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "examples" / "train_distributed.py"), "--mode", mode, "--steps", "2", "--image-size", "32",
               "--batch-size", "2", "--timeout-s", "60"]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "20 BatchNorm+activation pairs fused into InPlaceABNSync" in finished.stdout, finished.stdout
    losses = [float(loss) for loss in re.findall(r"step \d+/2  loss (\S+)", finished.stdout)]
    assert len(losses) == 2, finished.stdout
    return losses


@pytest.mark.slow
def test_train_distributed_example_ddp_and_fsdp_agree():
    activate_backend("abn_forward", "cpp", "cpu").__exit__(None, None, None)  # build once, before the workers
    ddp, fsdp = run_example("ddp"), run_example("fsdp")
    # same initial weights and data: the same losses, the second one after
    # an update that went through DDP's all-reduce or FSDP2's shards
    assert ddp == pytest.approx(fsdp, abs=2e-4)
