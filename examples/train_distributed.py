"""Data-parallel training of a converted ResNet with ChunkedAdamW.

The ResNet's BatchNorm + ReLU pairs become InPlaceABNSync modules (batch
statistics over every rank), the model is wrapped with DDP or sharded with
FSDP2 (``fully_shard``), and ChunkedAdamW steps it (on FSDP2, on each rank's
shards). Data is synthetic. Launch one process per device::

    torchrun --nproc-per-node=2 examples/train_distributed.py --mode ddp
    torchrun --nproc-per-node=2 examples/train_distributed.py --mode fsdp --steps 50 --image-size 64

Without CUDA the processes use gloo on the CPU; with CUDA, NCCL and one GPU
per process. Run without torchrun it trains alone (one process).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import effilayers
from effilayers.optim import ChunkedAdamW


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("ddp", "fsdp"), default="ddp",
                        help="DistributedDataParallel, or FSDP2 fully_shard on each residual stage")
    parser.add_argument("--model", default="resnet18", help="an effilayers.models ResNet builder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per process and step")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="collective timeout: a rank left waiting fails instead of hanging")
    return parser.parse_args(argv)


def setup(timeout_s: float) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # started without torchrun: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, str]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = getattr(effilayers.models, args.model)(num_classes=args.classes)
    # SyncBatchNorm first, then effilayers.convert: each SyncBatchNorm + ReLU
    # becomes one InPlaceABNSync (convert_sync_batchnorm after convert would
    # not see the fused modules, README "Distributed")
    nn.SyncBatchNorm.convert_sync_batchnorm(model)
    report = effilayers.convert(model)
    model.to(device)
    if args.mode == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    else:
        from torch.distributed.fsdp import fully_shard

        for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
            fully_shard(stage)
        wrapped = fully_shard(model)
    return wrapped, f"{len(report.fused)} BatchNorm+activation pairs fused into InPlaceABNSync"


def synthetic_batch(args: argparse.Namespace, step: int, rank: int, device: torch.device):
    generator = torch.Generator().manual_seed(step * 1000 + rank)  # each rank its own samples
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(0, args.classes, (args.batch_size,), generator=generator)
    return images.to(device), labels.to(device)


def main(argv=None) -> None:
    args = parse(argv)
    rank, world, device = setup(args.timeout_s)
    try:
        model, summary = build(args, device)
        optimizer = ChunkedAdamW(model.parameters(), lr=args.lr)
        if rank == 0:
            print(f"{args.model} on {world} process(es), {args.mode}, {device.type}: {summary}", flush=True)
        model.train()
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            images, labels = synthetic_batch(args, step, rank, device)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            if rank == 0:
                print(f"step {step}/{args.steps}  loss {mean_loss.item():.4f}  "
                      f"{time.perf_counter() - started:.3f} s/step", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
