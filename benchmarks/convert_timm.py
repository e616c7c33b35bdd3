"""Activation bytes of timm models after ``effilayers.convert``, as
fractions of the plain model's (the project's meter, ``effilayers.memory``;
random weights, float32, CPU): the figures of the ABN guide's timm section.

    python benchmarks/convert_timm.py --json benchmarks/results/convert_timm-cpu-<date>.json

needs timm (and a torchvision from torch's own index; see the install
section of the README). Bytes do not depend on the device or the weights,
only on the shapes and on what autograd keeps.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from datetime import date

import torch

# model, input side, convert mode
CASES = (("efficientnet_b0", 96, "inplace"), ("densenet121", 64, "inplace"), ("densenet121", 64, "abn"),
         ("seresnet50", 64, "inplace"))


def measure(name: str, side: int, mode: str) -> dict:
    import timm

    from effilayers import convert, memory

    torch.manual_seed(0)
    plain = timm.create_model(name, num_classes=10)
    converted = copy.deepcopy(plain)
    report = convert(converted, mode=mode)
    x = torch.randn(2, 3, side, side)
    plain_bytes, converted_bytes = memory.activation_bytes(plain, x), memory.activation_bytes(converted, x)
    return {"model": name, "input": [2, 3, side, side], "mode": mode, "fused": len(report.fused),
            "plain_bytes": plain_bytes, "converted_bytes": converted_bytes,
            "ratio": converted_bytes / plain_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows, the command and the versions here")
    args = parser.parse_args(argv)
    import timm

    rows = [measure(*case) for case in CASES]
    for row in rows:
        print(f"{row['model']:16} {row['mode']:8} {row['fused']:3} fused  {row['ratio']:.3f}x of the plain "
              f"model's activation bytes")
    if args.json:
        result = {"command": " ".join(["python", "benchmarks/convert_timm.py", *(argv or sys.argv[1:])]),
                  "date": date.today().isoformat(), "torch": torch.__version__, "timm": timm.__version__,
                  "python": platform.python_version(), "rows": rows}
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
