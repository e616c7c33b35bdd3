"""``python -m effilayers.bench`` / ``effilayers-bench``: what effilayers saves on a model.

Trains ResNet-50 and DenseNet-121 (or your model) on synthetic data, as plain
PyTorch and with effilayers layers, and prints activation bytes, CUDA peak
bytes, step time and images/s, each next to its ratio to plain PyTorch.
Runs on CUDA when available, otherwise on CPU at a small size.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import shlex
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import memory

__all__ = ["find_max_batch", "main"]

BUILTIN_MODELS = ("resnet50", "densenet121")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PLAIN = "plain PyTorch"
AS_GIVEN = "as given"
SEED = 0


class BenchError(Exception):
    """A problem with the user's request: reported as one line, exit status 2."""


def find_max_batch(try_step: Callable[[int], bool], start: int, limit: int) -> int:
    """Largest batch in ``[1, limit]`` for which ``try_step(batch)`` succeeds.

    Doubles from ``start`` until a failure (or ``limit``), then bisects
    between the last success and the first failure. Assumes success is
    monotone in the batch size, as memory use is. Never calls ``try_step``
    above ``limit``. Returns 0 when even batch 1 fails.
    """
    if start < 1 or limit < 1:
        raise ValueError(f"find_max_batch: start and limit must be >= 1, got start={start}, limit={limit}")
    start = min(start, limit)
    if try_step(start):
        fits, fails = start, None
        while fits < limit:
            candidate = min(2 * fits, limit)
            if try_step(candidate):
                fits = candidate
            else:
                fails = candidate
                break
        if fails is None:
            return fits
    else:
        fits, fails = 0, start
    while fails - fits > 1:
        middle = (fits + fails) // 2
        if try_step(middle):
            fits = middle
        else:
            fails = middle
    return fits


# ---- what to measure -----------------------------------------------------------------------


@dataclass
class Variant:
    model: str
    name: str
    build: Callable[[], nn.Module]
    # Loads the reference model's weights, so every variant starts from the
    # same point; None for a variant derived from the reference itself.
    load_reference: bool = True


@dataclass
class Result:
    model: str
    variant: str
    same_weights: bool
    activation_bytes: int
    cuda_peak_bytes: Optional[int]
    step_times_s: list[float]
    step_time_s: float
    images_per_s: float
    ratios: dict[str, Optional[float]] = field(default_factory=dict)
    losses: Optional[list[float]] = None
    final_loss_rel_diff: Optional[float] = None
    max_loss_rel_diff: Optional[float] = None
    max_batch: Optional[int] = None
    notes: list[str] = field(default_factory=list)


def _builtin_variants(name: str) -> list[Variant]:
    from . import models

    if name == "resnet50":
        return [Variant(name, label, lambda norm_act=norm_act: models.resnet50(norm_act=norm_act))
                for label, norm_act in ((PLAIN, "plain"), ("effilayers ABN", "abn"),
                                        ("effilayers InPlaceABN", "inplace"))]
    return [Variant(name, label, lambda efficient=efficient: models.densenet121(memory_efficient=efficient))
            for label, efficient in ((PLAIN, False), ("effilayers", True))]


def _import_callable(spec: str) -> Callable[[], Any]:
    module_name, _, attribute_path = spec.partition(":")
    if not module_name or not attribute_path:
        raise BenchError(f"--model {spec!r}: expected one of {', '.join(BUILTIN_MODELS)} or 'module:callable'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # an import can fail with anything the module raises
        raise BenchError(f"--model {spec!r}: cannot import {module_name!r}: {type(error).__name__}: {error}") from error
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise BenchError(f"--model {spec!r}: {module_name!r} has no attribute {attribute_path!r}")
        target = getattr(target, attribute)
    if not callable(target):
        raise BenchError(f"--model {spec!r}: {attribute_path!r} is not callable")
    return target


def _custom_variants(spec: str) -> list[Variant]:
    factory = _import_callable(spec)

    def build_given() -> nn.Module:
        model = factory()
        if not isinstance(model, nn.Module):
            raise BenchError(f"--model {spec!r}: returned {type(model).__name__}, expected an nn.Module")
        return model

    # Decide now whether the conversion variant exists, so the table never
    # lists a variant that is identical to the model as given.
    from .convert import convert

    probe = build_given()
    try:
        converts = bool(convert(copy.deepcopy(probe), mode="inplace").fused)
    except (TypeError, ValueError, RuntimeError):
        converts = False
    del probe
    variants = [Variant(spec, AS_GIVEN, build_given)]
    if converts:
        def build_converted() -> nn.Module:
            model = build_given()
            convert(model, mode="inplace")
            return model

        # Converting keeps the module tree's weights but may rename keys, so
        # build it from the same seed instead of loading a state dict.
        variants.append(Variant(spec, "effilayers convert(inplace)", build_converted, load_reference=False))
    return variants


# ---- one training step ---------------------------------------------------------------------


@dataclass
class Setup:
    device: torch.device
    batch: int
    size: int
    dtype: torch.dtype
    channels_last: bool
    steps: int
    train_steps: int
    compile: bool = False

    def autocast(self) -> ContextManager:
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def data(self, batch: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Generated on CPU from a fixed seed so every variant sees the same
        # numbers whatever the device's random number generator does.
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(batch, 3, self.size, self.size, generator=generator)
        labels = torch.randint(0, num_classes, (batch,), generator=generator)
        images = images.to(self.device)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.to(self.device)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, setup: Setup,
                images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with setup.autocast():
        logits = model(images)
        loss = F.cross_entropy(logits.float(), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # A small rate: at benchmark batch sizes BatchNorm is noisy, and the loss
    # curves should compare the variants, not show a divergence.
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _prepare(model: nn.Module, setup: Setup) -> nn.Module:
    model = model.to(setup.device)
    if setup.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def _num_classes(model: nn.Module, setup: Setup) -> int:
    # Eval mode and no grad: the probe must not move BatchNorm running stats.
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(torch.zeros(1, 3, setup.size, setup.size))
    except Exception as error:  # the user's model may raise anything on a wrong input shape
        raise BenchError(f"the model failed on a (1, 3, {setup.size}, {setup.size}) image batch: "
                         f"{type(error).__name__}: {error}") from error
    model.train(was_training)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise BenchError(f"the model returned {getattr(logits, 'shape', type(logits).__name__)}; "
                         "expected logits of shape (N, classes)")
    return logits.shape[1]


def _measure(model: nn.Module, setup: Setup, num_classes: int, tick: Callable[[], None],
             eager: Optional[nn.Module] = None) -> dict[str, Any]:
    """``model`` is what is timed (compiled with --compile); activation bytes
    are counted on ``eager`` (the same module uncompiled, the same function):
    saved-tensor hooks see what eager autograd keeps, not a compiled graph."""
    optimizer = _optimizer(model)
    images, labels = setup.data(setup.batch, num_classes, seed=SEED)
    with setup.autocast():
        activation = memory.activation_bytes(eager if eager is not None else model, images)
    # Warm-up: first-call allocations, kernel builds and, with --compile, compilation.
    _train_step(model, optimizer, setup, images, labels)
    tick()
    peak = None
    if setup.device.type == "cuda":
        with memory.track_cuda_peak(setup.device) as meter:
            _train_step(model, optimizer, setup, images, labels)
        peak = meter.peak_bytes
    times = []
    for _ in range(setup.steps):
        setup.synchronize()
        started = time.perf_counter()
        _train_step(model, optimizer, setup, images, labels)
        setup.synchronize()
        times.append(time.perf_counter() - started)
        tick()
    median = statistics.median(times)
    return {"activation_bytes": activation, "cuda_peak_bytes": peak, "step_times_s": times,
            "step_time_s": median, "images_per_s": setup.batch / median}


def _train_curve(model: nn.Module, setup: Setup, num_classes: int, tick: Callable[[], None]) -> list[float]:
    optimizer = _optimizer(model)
    losses = []
    for step in range(setup.train_steps):
        images, labels = setup.data(setup.batch, num_classes, seed=SEED + 1 + step)
        losses.append(float(_train_step(model, optimizer, setup, images, labels)))
        tick()
    return losses


def _cuda_max_batch(model: nn.Module, setup: Setup, num_classes: int, limit: int) -> int:
    optimizer = _optimizer(model)

    def try_step(batch: int) -> bool:
        fits = True
        try:
            images, labels = setup.data(batch, num_classes, seed=SEED)
            _train_step(model, optimizer, setup, images, labels)
            setup.synchronize()
        except torch.cuda.OutOfMemoryError:
            fits = False
        # Leaving the except block dropped the traceback and with it the
        # frames that held this try's tensors; free them before the next try.
        images = labels = None
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return fits

    return find_max_batch(try_step, setup.batch, limit)


# ---- driver --------------------------------------------------------------------------------


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, leave=False, unit="step")


def _ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    if value is None or not reference:
        return None
    return value / reference


def _run_model(variants: list[Variant], setup: Setup, max_batch_limit: Optional[int], bar: Any) -> list[Result]:
    torch.manual_seed(SEED)
    reference = variants[0].build()
    reference_state = copy.deepcopy(reference.state_dict())
    num_classes = _num_classes(reference, setup)
    del reference
    results = []
    for variant in variants:
        bar.set_description(f"{variant.model} / {variant.name}")
        notes = []
        torch.manual_seed(SEED)
        model = variant.build()
        same_weights = True
        if variant.load_reference and variant is not variants[0]:
            try:
                model.load_state_dict(reference_state)
            except RuntimeError:
                same_weights = False
                notes.append("state dict incompatible with plain PyTorch's: own initialisation from the same seed")
        initial_state = copy.deepcopy(model.state_dict())
        model = _prepare(model, setup)
        runner = model
        if setup.compile:
            # Modules under torch.compile: effilayers' ops are custom ops
            # with fake implementations, so they stay in the graph.
            runner = torch.compile(model)
        measured = _measure(runner, setup, num_classes, bar.update, eager=model)
        losses = None
        if setup.train_steps:
            model.load_state_dict(initial_state)
            losses = _train_curve(runner, setup, num_classes, bar.update)
        max_batch = None
        if max_batch_limit is not None:
            max_batch = _cuda_max_batch(runner, setup, num_classes, max_batch_limit)
        results.append(Result(variant.model, variant.name, same_weights, losses=losses, max_batch=max_batch,
                              notes=notes, **measured))
        del model, runner, initial_state
        gc.collect()
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    plain = results[0]
    for result in results:
        result.ratios = {
            "activation_bytes": _ratio(result.activation_bytes, plain.activation_bytes),
            "cuda_peak_bytes": _ratio(result.cuda_peak_bytes, plain.cuda_peak_bytes),
            "step_time": _ratio(result.step_time_s, plain.step_time_s),
            "images_per_s": _ratio(result.images_per_s, plain.images_per_s),
            "max_batch": _ratio(result.max_batch, plain.max_batch),
        }
        if result.losses and plain.losses:
            differences = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result.losses, plain.losses)]
            result.final_loss_rel_diff = differences[-1]
            result.max_loss_rel_diff = max(differences)
    return results


def _mib(value: Optional[int]) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def _times(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}x"


def format_table(results: list[Result]) -> str:
    show_max_batch = any(r.max_batch is not None for r in results)
    header = ["model", "variant", "activation MiB", "", "CUDA peak MiB", "", "step ms", "", "images/s", ""]
    if show_max_batch:
        header += ["max batch", ""]
    rows = [header]
    for r in results:
        row = [r.model, r.variant, _mib(r.activation_bytes), _times(r.ratios["activation_bytes"]),
               _mib(r.cuda_peak_bytes), _times(r.ratios["cuda_peak_bytes"]),
               f"{r.step_time_s * 1e3:.1f}", _times(r.ratios["step_time"]),
               f"{r.images_per_s:.1f}", _times(r.ratios["images_per_s"])]
        if show_max_batch:
            row += [str(r.max_batch), _times(r.ratios["max_batch"])]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    # Text columns left-aligned, numbers right-aligned so digits line up.
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


def format_losses(results: list[Result]) -> str:
    lines = ["training curves (same initial weights and data; relative difference to plain PyTorch)"]
    for r in results:
        if r.losses is None:
            continue
        line = f"  {r.model:<12} {r.variant:<28} final loss {r.losses[-1]:.4f}"
        if r.variant not in (PLAIN, AS_GIVEN):
            line += f"  final rel diff {r.final_loss_rel_diff:.2e}  max rel diff {r.max_loss_rel_diff:.2e}"
        lines.append(line)
    return "\n".join(lines)


def _plot(results: list[Result], path: str, pyplot: Any) -> None:
    labels = [f"{r.model}\n{r.variant}" for r in results]
    panels = 3 if any(r.losses for r in results) else 2
    figure, axes = pyplot.subplots(1, panels, figsize=(6 * panels, 5))
    axes[0].bar(range(len(results)), [r.activation_bytes / 2**20 for r in results])
    axes[0].set_ylabel("activation MiB (one forward)")
    axes[1].bar(range(len(results)), [r.step_time_s * 1e3 for r in results], color="tab:orange")
    axes[1].set_ylabel("median step time, ms")
    for axis in axes[:2]:
        axis.set_xticks(range(len(results)))
        axis.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    if panels == 3:
        for r in results:
            if r.losses:
                axes[2].plot(range(1, len(r.losses) + 1), r.losses, marker="o", label=f"{r.model} / {r.variant}")
        axes[2].xaxis.get_major_locator().set_params(integer=True)
        axes[2].set_xlabel("training step")
        axes[2].set_ylabel("loss")
        axes[2].legend(fontsize=8)
    figure.suptitle("effilayers bench: " + ", ".join(sorted({r.model for r in results})))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m effilayers.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", metavar="NAME",
                        help="resnet50, densenet121, or module:callable returning an nn.Module that maps "
                             "(N, 3, H, W) images to logits; repeatable (default: resnet50 and densenet121)")
    parser.add_argument("--batch", type=int, help="batch size (default: 32 on CUDA, 2 on CPU)")
    parser.add_argument("--size", type=int, help="image height and width (default: 224 on CUDA, 64 on CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="float32, or autocast to bfloat16/float16 (float16 needs CUDA)")
    parser.add_argument("--channels-last", action="store_true", help="channels_last model and images")
    parser.add_argument("--compile", action="store_true",
                        help="run every variant under torch.compile (the first step, which compiles, is not timed; "
                             "activation bytes are counted on the eager module)")
    parser.add_argument("--steps", type=int, help="timed training steps per variant (default: 10 on CUDA, 3 on CPU)")
    parser.add_argument("--train", type=int, default=0, metavar="N",
                        help="also train N steps per variant from the same weights and data; report the losses")
    parser.add_argument("--max-batch", action="store_true",
                        help="find the largest batch that trains one step, per variant (CUDA only)")
    parser.add_argument("--max-batch-limit", type=int, default=4096, metavar="N",
                        help="largest batch --max-batch tries (default: 4096)")
    parser.add_argument("--json", metavar="FILE", help="write all results, the environment and the command here")
    parser.add_argument("--plot", metavar="FILE.png", help="bar charts (and loss curves with --train); needs matplotlib")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    return parser


def _setup(args: argparse.Namespace) -> Setup:
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is available")
    on_cuda = device_type == "cuda"
    if args.max_batch and not on_cuda:
        raise BenchError("--max-batch needs CUDA (it searches for the batch that runs out of GPU memory); "
                         "no CUDA device in use here")
    dtype = DTYPES[args.dtype]
    if dtype == torch.float16 and not on_cuda:
        raise BenchError("--dtype float16 needs CUDA; on CPU use float32 or bfloat16")
    setup = Setup(device=torch.device(device_type),
                  batch=args.batch if args.batch is not None else (32 if on_cuda else 2),
                  size=args.size if args.size is not None else (224 if on_cuda else 64),
                  dtype=dtype, channels_last=args.channels_last,
                  steps=args.steps if args.steps is not None else (10 if on_cuda else 3), train_steps=args.train,
                  compile=args.compile)
    for name, value, minimum in (("--batch", setup.batch, 1), ("--size", setup.size, 32), ("--steps", setup.steps, 1),
                                 ("--train", setup.train_steps, 0), ("--max-batch-limit", args.max_batch_limit, 1)):
        if value < minimum:
            raise BenchError(f"{name} must be >= {minimum}, got {value}")
    return setup


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    setup = _setup(args)
    pyplot = None
    if args.plot:
        # Checked before the benchmark so a missing matplotlib costs nothing.
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as pyplot
        except ImportError as error:
            raise BenchError(f"--plot needs matplotlib ({error}); pip install matplotlib "
                             "or pip install 'effilayers[bench]'") from error
    variants_per_model = []
    for spec in args.model or BUILTIN_MODELS:
        variants_per_model.append(_builtin_variants(spec) if spec in BUILTIN_MODELS else _custom_variants(spec))

    print(f"effilayers bench: {setup.device.type}, batch {setup.batch}, {setup.size}x{setup.size}, "
          f"{args.dtype}{', channels_last' if setup.channels_last else ''}"
          f"{', torch.compile' if setup.compile else ''}, "
          f"1 warm-up + {setup.steps} timed steps per variant", flush=True)
    ticks_per_variant = 1 + setup.steps + setup.train_steps
    bar = _progress(sum(len(v) for v in variants_per_model) * ticks_per_variant)
    results: list[Result] = []
    try:
        for variants in variants_per_model:
            results += _run_model(variants, setup, args.max_batch_limit if args.max_batch else None, bar)
    finally:
        bar.close()

    print(format_table(results))
    if setup.device.type == "cpu":
        print("CUDA peak bytes: n/a on CPU. Activation bytes are device-independent: "
              "the ratios hold on a GPU at the same shapes.")
    if setup.dtype != torch.float32:
        print(f"Under autocast, activation bytes include the {args.dtype} copies of the weights that autocast "
              "keeps for backward (2 bytes per parameter), the same for every variant.")
    if setup.train_steps:
        print()
        print(format_losses(results))
    for r in results:
        for note in r.notes:
            print(f"note: {r.model} / {r.variant}: {note}")
    if args.json:
        from ._info import collect

        report = {
            "command": shlex.join([sys.executable, "-m", "effilayers.bench", *argv]),
            "argv": list(argv),
            "settings": {"device": setup.device.type, "batch": setup.batch, "size": setup.size, "dtype": args.dtype,
                         "channels_last": setup.channels_last, "compile": setup.compile, "steps": setup.steps,
                         "train": setup.train_steps,
                         "max_batch_limit": args.max_batch_limit if args.max_batch else None},
            "environment": collect(),
            "results": [vars(r) for r in results],
        }
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {args.json}")
    if pyplot is not None:
        _plot(results, args.plot, pyplot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except BenchError as error:
        print(f"effilayers-bench: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
