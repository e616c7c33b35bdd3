"""What a ``python -m effilayers.bench --budget`` protocol costs before it is
run: the rows' planning (``fit`` and the torch-checkpoint walk) and a few
training steps of each eager row, on the process's CPU time, one thread
(the bench's ``--clock cpu --threads 1``), for example::

    python -m benchmarks.budget_step_times --model benchmarks.transformer_models:gpt2_small \\
        --tokens 512 --batch 2 --budget 0.35 --steps 1 --json /tmp/gpt2-step-times.json

The rows are the bench's own (:func:`effilayers.bench.budget.budget_variants`),
built as the bench builds them; the torch.compile row is left out (its
compile is not a step) and so is auto-SAC (it needs a CUDA device). Each row
takes a warm-up step, then ``--steps`` timed ones. Prints, per row, its note
and step times, and the projection of the bench's protocol: per run, the
planning plus, per row, a gradient-check step, a warm-up step, about a third
of a step for the meter's forward and ``--protocol-steps`` timed steps.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import statistics
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

from effilayers.bench import budget
from effilayers.bench.variants import Variant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="module:callable building a language model")
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budget", type=budget.budget_argument, default=0.35)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per row, after one warm-up step")
    parser.add_argument("--protocol-steps", type=int, default=100, help="the protocol's timed steps per row")
    parser.add_argument("--runs", type=int, default=3, help="the protocol's runs")
    parser.add_argument("--json", help="write the times here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.tokens < 1 or args.batch < 1:
        parser.error("--steps, --tokens and --batch must be >= 1")
    module, _, name = args.model.partition(":")
    build = getattr(importlib.import_module(module), name)
    torch.set_num_threads(1)
    clock = time.process_time
    torch.manual_seed(0)
    probe = build()
    vocabulary = probe.get_output_embeddings().out_features
    del probe
    ids = torch.randint(0, vocabulary, (args.batch, args.tokens + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def no_auto_sac(*_: object, **__: object) -> None:
        raise ImportError("not timed here")

    plain = Variant(args.model, "as given", build)
    started = clock()
    with mock.patch.object(budget, "plan_auto_sac", no_auto_sac):
        rows, _ = budget.budget_variants([plain], args.budget, lambda: inputs, lambda model: model.train(),
                                         contextlib.nullcontext)
    result = {"command": " ".join(sys.argv), "planning_cpu_s": clock() - started, "rows": {}}
    print(f"planning (fit, the torch-checkpoint walk): {result['planning_cpu_s']:.1f} s of CPU")
    for row in [plain] + [row for row in rows if not row.compiled]:
        torch.manual_seed(0)
        model = row.build().train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        times = []
        for _ in range(1 + args.steps):
            began = clock()
            logits = model(inputs).logits
            F.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(clock() - began)
        result["rows"][row.name] = {"note": row.note, "warm_up_s": times[0], "steps_s": times[1:]}
        print(f"{row.name}: warm-up {times[0]:.1f} s, steps {', '.join(f'{t:.1f}' for t in times[1:])} s"
              + (f"\n  {row.note}" if row.note else ""))
        del model, optimizer
        gc.collect()
    per_step = [statistics.median(row["steps_s"]) for row in result["rows"].values()]
    # compile row: counted as a plain step, its compile left out
    per_run = result["planning_cpu_s"] + sum((2 + 1 / 3 + args.protocol_steps) * step
                                             for step in per_step + per_step[:1])
    result["projected_cpu_s"] = args.runs * per_run
    print(f"projected: {args.runs} run(s) of {args.protocol_steps} steps per row, {len(per_step) + 1} rows "
          f"(torch.compile's counted as plain's steps, its compile left out): {args.runs * per_run / 60:.0f} "
          "minutes of one core")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
