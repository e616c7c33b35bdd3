"""GPU memory and step time of FSDP2 with CPUOffloadPolicy, stepped by
effilayers' ChunkedAdamW and by torch.optim.AdamW, against plain FSDP2 with
fused AdamW on the GPU (the project's target: offload at <= 0.35x the plain
peak GPU bytes and <= 1.5x its step time).

One process, world size 1, one GPU::

    python3 benchmarks/bench_fsdp_offload.py --json fsdp-offload-h200.json

``--device cpu`` (gloo, no offload policy: torch refuses it without an
accelerator) runs the same path with the policy left out, for the CPU test.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# the checkout's effilayers, also when run as a file without installing it (as on the GPU machine)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import effilayers  # noqa: E402
from effilayers.optim import ChunkedAdamW  # noqa: E402

TARGET = {"peak_ratio": 0.35, "time_ratio": 1.5}
VARIANTS = ("chunked_adamw", "torch_adamw", "plain")  # plain last: the others need its numbers only for the ratios


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8192, help="tokens per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps first (optimizer states, allocator, cuBLAS)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="compute dtype")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    if min(args.dim, args.layers, args.batch, args.steps) < 1 or args.warmup < 0:
        parser.error("--dim, --layers, --batch and --steps must be positive, --warmup not negative")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard(base: nn.Module, args, device: torch.device, offload: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # An explicit mesh: fully_shard's default one follows the accelerator, a CUDA mesh even under --device cpu.
    kwargs = {"mesh": init_device_mesh(device.type, (1,))}
    if args.dtype == "bfloat16":
        # MixedPrecisionPolicy rather than autocast: FSDP2 casts each block's parameters to bf16 once, before
        # the all-gather, so the unsharded (GPU-resident) copies are bf16, half autocast's fp32 ones, and the
        # fp32 master shards stay where the policy keeps them (CPU with offload). fp32 gradient reduction keeps
        # param.grad fp32 like the parameters, as both optimizers require.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    model = copy.deepcopy(base).to(device)
    for block in model[:-1]:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def optimizer_for(name: str, params, lr: float):
    if name == "chunked_adamw":
        return ChunkedAdamW(params, lr=lr, offload="cpu")
    if name == "torch_adamw":
        # fused=False: the shards are CPU tensors under the policy; foreach left to torch's default.
        return torch.optim.AdamW(params, lr=lr, fused=False)
    return torch.optim.AdamW(params, lr=lr, fused=True)


def train_step(model: nn.Module, optimizer, data) -> torch.Tensor:
    x, y = data
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x).float(), y)  # bf16 output under the mixed-precision policy
    loss.backward()
    optimizer.step()
    return loss.detach()


def run_variant(name: str, base: nn.Module, data, args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    offload = cuda and name != "plain"
    model = shard(base, args, device, offload)
    optimizer = optimizer_for(name, model.parameters(), args.lr)
    for _ in range(args.warmup):
        train_step(model, optimizer, data)
    times, peaks, resident = [], [], None
    for _ in range(args.steps):
        # synchronize and the host clock: the offloaded steps run partly on the CPU, which CUDA events miss
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated() if resident is None else resident
        started = time.perf_counter()
        loss = train_step(model, optimizer, data)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated())
    result = {"offload": offload, "optimizer": type(optimizer).__name__,
              "peak_bytes": max(peaks) if cuda else None, "resident_bytes": resident,
              "step_seconds": statistics.median(times), "steps_seconds": times, "final_loss": float(loss)}
    # free this variant's GPU memory before the next one is measured
    del model, optimizer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def report(args, results: dict, device: torch.device, params: int, backend: str) -> dict:
    plain = results["plain"]
    for result in results.values():
        result["time_ratio"] = result["step_seconds"] / plain["step_seconds"]
        result["peak_ratio"] = None if plain["peak_bytes"] is None else result["peak_bytes"] / plain["peak_bytes"]
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "effilayers": effilayers.__version__,
            "adam_step_cpu_backend": backend,
            "offload": device.type == "cuda", "target": TARGET,
            "settings": {k: getattr(args, k) for k in ("device", "dim", "layers", "batch", "steps", "warmup", "dtype",
                                                       "lr")},
            "params": params, "variants": results}


def _model(args) -> nn.Module:
    torch.manual_seed(0)  # the same weights for every variant (each gets a deep copy)
    return nn.Sequential(*(Block(args.dim) for _ in range(args.layers)), nn.LayerNorm(args.dim))


def print_table(summary: dict) -> None:
    print(f"{summary['device']}, torch {summary['torch']}, {summary['params'] / 1e6:.1f}M params, "
          f"offload policy: {summary['offload']}, settings {summary['settings']}")
    print(f"{'variant':<15}{'peak GiB':>10}{'peak x':>8}{'step s':>10}{'time x':>8}{'loss':>12}")
    for name, r in summary["variants"].items():
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.3f}"
        ratio = "-" if r["peak_ratio"] is None else f"{r['peak_ratio']:.3f}"
        print(f"{name:<15}{peak:>10}{ratio:>8}{r['step_seconds']:>10.4f}{r['time_ratio']:>8.3f}{r['final_loss']:>12.6g}")
    print(f"target: offload peak <= {TARGET['peak_ratio']}x and step time <= {TARGET['time_ratio']}x of plain")


def main(argv=None) -> dict:
    args = parse(argv)
    # ChunkedAdamW steps CPU shards with this kernel; building it (first run: a minute) here keeps it out of the steps
    backend = effilayers.backends.choice("adam_step_", "cpu").backend
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # gloo beside NCCL for any collective on the CPU shards the policy leaves (the GPU test does the same)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        base = _model(args)
        generator = torch.Generator().manual_seed(1)
        data = tuple(torch.randn(args.batch, args.dim, generator=generator).to(device) for _ in range(2))
        results = {name: run_variant(name, base, data, args, device) for name in VARIANTS}
        summary = report(args, results, device, sum(p.numel() for p in base.parameters()), backend)
    finally:
        dist.destroy_process_group()
    print_table(summary)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)
    bad = [name for name, r in summary["variants"].items() if not math.isfinite(r["final_loss"])]
    if bad:
        raise SystemExit(f"non-finite loss in {bad}")
    return summary


if __name__ == "__main__":
    main()
