"""``effilayers.info()`` / ``python -m effilayers.info``: versions, devices and
the backend each op uses on each device, with the reason.

Resolving a backend builds the compiled library on first use, so the first
run on a machine can take a minute; later runs load it from the cache.
``python -m effilayers.info --demo`` adds a small memory demonstration.
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Any, Optional

import torch

from ._core import build, registry


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect() -> dict[str, Any]:
    """Everything ``info()`` prints, as a dict (for bug reports and benchmark JSON)."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    table = []
    for op in registry.registered_ops():
        for device in devices:
            chosen = registry.choice(op, device)
            table.append({"op": op, "device": device, "backend": chosen.backend, "reason": chosen.reason})
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({_cpu_name()})",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "backend_preference": ",".join(registry.current_preference() or ()) or "automatic",
        "extension_cache": str(build.cache_root()),
        "libraries": registry.library_report(),
        "ops": table,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = ["effilayers environment", ""]
    for key in ("python", "torch", "triton", "torch_cuda", "device", "cpu_capability", "threads",
                "backend_preference", "extension_cache"):
        lines.append(f"  {key:<20} {report[key]}")
    lines.append("")
    lines.append("compiled libraries")
    for kind, status in report["libraries"].items():
        lines.append(f"  {kind:<20} {status}")
    lines.append("")
    rows = [("op", "device", "backend", "why")] + [
        (row["op"], row["device"], row["backend"], row["reason"]) for row in report["ops"]
    ]
    widths = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines.append("backends")
    for r in rows:
        lines.append("  " + "  ".join(str(v).ljust(w) for v, w in zip(r[:3], widths)) + "  " + r[3])
    return "\n".join(lines)


def info(file: Optional[Any] = None) -> dict[str, Any]:
    """Print the environment and backend table; return it as a dict."""
    report = collect()
    print(format_report(report), file=file or sys.stdout)
    return report


def _demo() -> None:
    from . import memory
    from .models import resnet50
    from .ops import batch_stats

    torch.manual_seed(0)
    x = torch.randn(2, 3, 128, 128)
    print("\nmemory demo: activation bytes autograd keeps for one ResNet-50 forward, 2x3x128x128 fp32")
    print("(effilayers.memory.activation_bytes; CPU; the ratio holds on any device)")
    measured = {}
    for norm_act, what in (("plain", "BatchNorm2d + ReLU (torchvision)"), ("abn", "ABN: fused, exact ReLU"),
                           ("inplace", "InPlaceABN: in place, leaky_relu(0.01)")):
        measured[norm_act] = memory.activation_bytes(resnet50(norm_act=norm_act), x)
        print(f"  {norm_act:<8} {measured[norm_act] / 2**20:8.1f} MiB  "
              f"{measured[norm_act] / measured['plain']:.2f}x  {what}")

    big = (torch.randn(4, 3, 64, 64) * 16 + 10000).half()
    mean, var, count = batch_stats(big)
    exact_var, exact_mean = torch.var_mean(big.double(), dim=(0, 2, 3), correction=0)
    naive = (big.float() ** 2).mean((0, 2, 3)) - big.float().mean((0, 2, 3)) ** 2
    print("\nbatch_stats on fp16 values 1e4 + 16 * randn (fp16 steps by 8 there):")
    print(f"  effilayers var  {[round(v, 3) for v in var.tolist()]}  (count {int(count)})")
    print(f"  float64 var     {[round(v, 3) for v in exact_var.tolist()]}")
    print(f"  naive E[x^2]-E[x]^2 in fp32: {[round(v, 1) for v in naive.tolist()]}")


def main(argv: Optional[list[str]] = None) -> int:
    # The docstring's first paragraph: its first line alone stops mid-sentence.
    parser = argparse.ArgumentParser(prog="python -m effilayers.info",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--demo", action="store_true", help="also run a small memory and accuracy demo")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--selftest", action="store_true",
                        help="run every compiled kernel once against its reference on this machine (exit 1 on a "
                             "failure)")
    parser.add_argument("--failures", action="store_true",
                        help="with --selftest: list only the kernels that failed or did not run, with the reason")
    parser.add_argument("--kernels", action="store_true",
                        help="compile every GPU kernel for sm_90 and sm_80 (no GPU needed) and report registers, "
                             "spills, shared memory and access widths; exit 1 on a failure, a spill or a narrow "
                             "access")
    parser.add_argument("--target", action="append", choices=("sm_90", "sm_80"),
                        help="with --kernels: compile for this target only (repeatable; default both)")
    parser.add_argument("--pairwise", action="store_true",
                        help="with --kernels: of each Triton kernel's configurations, only enough that every "
                             "setting (constexpr value, num_warps, ...) is compiled with every dtype it is used "
                             "with, instead of every configuration")
    args = parser.parse_args(argv)
    if args.failures and not args.selftest:
        parser.error("--failures goes with --selftest")
    if args.target and not args.kernels:
        parser.error("--target goes with --kernels")
    if args.pairwise and not args.kernels:
        parser.error("--pairwise goes with --kernels")
    if args.selftest:
        from . import _selftest

        return _selftest.main(failures_only=args.failures)
    if args.kernels:
        from . import _kernel_report

        targets = tuple(int(target[3:]) for target in args.target) if args.target else _kernel_report.TARGETS
        return _kernel_report.main(json_output=args.json, targets=targets, pairwise_only=args.pairwise)
    if args.json:
        import json

        print(json.dumps(collect(), indent=2))
    else:
        info()
    if args.demo:
        _demo()
    return 0


