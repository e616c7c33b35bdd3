"""``python -m effilayers.bench`` / ``effilayers-bench``: what effilayers saves on a model.

Trains ResNet-50 and DenseNet-121 (or your model) on synthetic data, as plain
PyTorch, with effilayers layers and with peer libraries when they are
installed, and prints activation bytes, CUDA peak bytes, step time and
images/s, each next to its ratio to plain PyTorch. Runs on CUDA when
available, otherwise on CPU at a small size. ``--train N`` also checks every
variant's losses against float64 (see :mod:`effilayers.bench.measure`).

This module parses the command line, runs the measurements and prints them;
exit status 0, 1 when ``--check-train`` finds a variant outside the loss
tolerance, 2 for a request it cannot run (:class:`BenchError`).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from typing import Any, ContextManager, Optional

import torch

from ..max_batch import DEFAULT_LIMIT
from .budget import BUDGET_ROWS, budget_argument, budget_rows_argument, budget_variants
from .measure import CLOCKS, LOSS_NOISE_FACTOR, MAX_BATCH_PRECISION, SEED, Result, Setup, count_ticks, run_model
from .report import (
    conclusion,
    format_losses,
    format_table,
    load_pyplot,
    loss_warnings,
    plot,
    timing_warning,
    write_json,
)
from .variants import BenchError, builtin_models, compiled_twin, variants_for

__all__ = ["main"]

PROG = "effilayers-bench"
DEFAULT_MODELS = ("resnet50", "densenet121")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Where --max-batch may run: elsewhere nothing runs out of memory cleanly
# (tests widen it to search on CPU against a simulated limit).
MAX_BATCH_DEVICES = ("cuda",)
DEFAULT_MAX_BATCH_LIMIT = DEFAULT_LIMIT


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


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(builtin_models())
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", metavar="NAME",
                        help=f"{names}, or module:callable returning an nn.Module that maps (N, 3, H, W) images "
                             "to logits (with --tokens, (N, T) token ids to (N, T, vocabulary) logits); repeatable "
                             "(default: resnet50 and densenet121)")
    parser.add_argument("--batch", type=int, help="batch size (default: 32 on CUDA, 2 on CPU)")
    parser.add_argument("--size", type=int,
                        help="image height and width, >= 32 (default: 224 on CUDA, 64 on CPU)")
    parser.add_argument("--tokens", type=int, metavar="T",
                        help="the models are language models: each sample is T random token ids, the output's "
                             "logits (a tensor, or an output object's .logits, as Hugging Face models return) "
                             "have one row of vocabulary per token, and the loss is next-token cross-entropy; "
                             "needs --model module:callable")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="float32, or autocast to bfloat16/float16 (float16 needs CUDA)")
    parser.add_argument("--channels-last", action="store_true", help="channels_last model and images")
    parser.add_argument("--compile", action="store_true",
                        help="also run every variant under torch.compile, a row '<variant> (compiled)' beside the "
                             "eager rows (the first step, which compiles, is not timed; activation bytes are the "
                             "compiled graph's, weights' compiled copies left out; each compiled row's note gives "
                             "its ratios to plain PyTorch compiled; with --train, random ops such as "
                             "dropout run eager's kernels, torch._inductor.config.fallback_random, so the compiled "
                             "variants draw the float64 reference's masks)")
    parser.add_argument("--steps", type=int, help="timed training steps per variant (default: 10 on CUDA, 3 on CPU)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="on CPU, what times a step: wall (the host clock, the default) or cpu (the CPU time of "
                             "the bench's process, all its threads: time spent waiting while other programs use "
                             "the cores is not counted, so ratios repeat on a shared machine; with more than one "
                             "--threads it counts OpenMP's spin-waits too); CUDA steps are timed with CUDA events")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="intra-op threads for the run (torch.set_num_threads, restored after; default: "
                             f"torch's, here {torch.get_num_threads()})")
    parser.add_argument("--train", type=int, default=0, metavar="N",
                        help="also train N steps per variant from the same weights and data, and check the losses "
                             "against a float64 run of plain PyTorch computing the same function: at step t the "
                             f"relative difference must be <= max({LOSS_NOISE_FACTOR:g} x plain PyTorch's own largest "
                             "relative difference up to t between its --dtype run and float64, 1e-5 float32 / 1e-3 "
                             "float16 / 1e-2 bfloat16); a variant outside it gets a warning")
    parser.add_argument("--check-train", action="store_true",
                        help="with --train: exit with status 1 when a variant's losses leave the tolerance")
    parser.add_argument("--max-batch", action="store_true",
                        help="find the largest batch that trains one step, per variant (CUDA only), within "
                             f"{MAX_BATCH_PRECISION * 100:g}%% of the largest (effilayers.find_max_batch's precision)")
    parser.add_argument("--max-batch-limit", type=int, metavar="N",
                        help=f"with --max-batch: the largest batch it tries (default: {DEFAULT_MAX_BATCH_LIMIT})")
    parser.add_argument("--budget", type=budget_argument, metavar="BUDGET",
                        help="also, per model, side by side: effilayers.fit(model, the first batch, BUDGET) "
                             "(a budget below reach prints fit's smallest reachable figure and drops the row); "
                             "torch's checkpoint_sequential (use_reentrant=False) over the parts fit checkpointed "
                             "children of, at ceil(sqrt(n)) segments each (over the outermost nn.Sequential parts "
                             "when fit checkpointed none); torch's checkpoint (use_reentrant=False) on the plain "
                             "model over fit's runs of children and the units it recomputes whole, then more in "
                             "fit's order until it keeps no more bytes than fit; torch checkpoint (every block): "
                             "torch's checkpoint around each block "
                             "fit finds (ModuleList and ModuleDict members, repeated block classes, the children "
                             "of the outermost nn.Sequential parts); and torch.compile of "
                             "the plain model under "
                             "torch._functorch.config.activation_memory_budget = BUDGET as a fraction, its "
                             "activation bytes counted on the compiled module; torch auto-SAC: torch's "
                             "torch.distributed._tools.sac_milp choice of modules and ops to checkpoint at the same "
                             "fraction (needs a CUDA device, pulp and pwlf; elsewhere a line says why it is dropped); "
                             "every row's 'grads = plain' says whether one step's parameter gradients, dropout "
                             "drawing, equal the plain model's (on CPU in a float64 step, so that float32 "
                             "rounding does not hide the answer); BUDGET: a fraction in (0, 1] of the "
                             "plain activation bytes (0.35) or bytes as fit takes them (123456, 2GiB, 512MiB, "
                             "1.5GB); not with --compile")
    parser.add_argument("--budget-rows", type=budget_rows_argument, metavar="ROW[,ROW...]",
                        help="with --budget: only these of its rows, beside the model's own "
                             f"({', '.join(BUDGET_ROWS)}; default: all); fit plans whichever are asked for: two "
                             "torch rows follow its plan, and a budget below reach shows before the timing")
    parser.add_argument("--offload", action="store_true",
                        help="with --budget on CUDA: fit(..., offload=True), whose plan may move the saved tensors "
                             "of units whose compute hides the copy to pinned host memory (the meter counts them "
                             "as host bytes, the budget does not)")
    parser.add_argument("--json", metavar="FILE", help="write all results, the environment and the command here")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="bar charts with ratios (and loss curves with --train); needs matplotlib")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        help="where the variants run: cuda (the first GPU) or cpu; default: cuda when available, "
                             "else cpu (which also changes the default --batch, --size and --steps)")
    parser.add_argument("--verbose", action="store_true",
                        help="also print what the measurements mean, every variant's notes and the per-variant "
                             "--train losses (the default report stays under 30 lines)")
    return parser


def _max_batch_limit(args: argparse.Namespace) -> Optional[int]:
    """The --max-batch search's limit, None without --max-batch."""
    if not args.max_batch:
        return None
    return DEFAULT_MAX_BATCH_LIMIT if args.max_batch_limit is None else args.max_batch_limit


def _setup(args: argparse.Namespace) -> Setup:
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is available")
    on_cuda = device_type == "cuda"
    if args.max_batch and device_type not in MAX_BATCH_DEVICES:
        raise BenchError("--max-batch needs CUDA (it searches for the batch that runs out of GPU memory); "
                         "no CUDA device in use here")
    if args.check_train and not args.train:
        raise BenchError("--check-train needs --train N (N >= 1)")
    if args.budget is not None and args.compile:
        raise BenchError("--budget adds its own torch.compile row; run it without --compile")
    if args.budget_rows is not None and args.budget is None:
        raise BenchError("--budget-rows chooses among --budget's rows; give --budget too")
    if args.offload and (args.budget is None or not on_cuda):
        raise BenchError("--offload goes with --budget on --device cuda (it moves saved tensors from GPU memory to "
                         "pinned host memory; on the CPU it would save nothing)")
    if args.max_batch_limit is not None and not args.max_batch:
        raise BenchError("--max-batch-limit needs --max-batch")
    if args.clock != "wall" and on_cuda:
        raise BenchError(f"--clock {args.clock} times the host; CUDA steps are timed with CUDA events "
                         "(use --device cpu to time on the CPU)")
    if args.tokens is not None:
        if args.size is not None or args.channels_last:
            raise BenchError("--tokens: the samples are token ids; --size and --channels-last are for images")
        builtin = [name for name in (args.model or []) if name in builtin_models()]
        if not args.model or builtin:
            raise BenchError(f"--tokens needs --model module:callable building a language model; "
                             f"{', '.join(builtin) or 'the default models'} take images")
    dtype = DTYPES[args.dtype]
    if dtype == torch.float16 and not on_cuda:
        raise BenchError("--dtype float16 needs CUDA; on CPU use float32 or bfloat16")
    setup = Setup(device=torch.device(device_type),
                  batch=args.batch if args.batch is not None else (32 if on_cuda else 2),
                  size=args.size if args.size is not None else (224 if on_cuda else 64),
                  dtype=dtype, channels_last=args.channels_last,
                  steps=args.steps if args.steps is not None else (10 if on_cuda else 3), train_steps=args.train,
                  compile=args.compile, clock=args.clock,
                  threads=args.threads if args.threads is not None else torch.get_num_threads(),
                  tokens=args.tokens)
    for name, value, minimum in (("--batch", setup.batch, 1), ("--tokens", args.tokens, 1), ("--size", setup.size, 32),
                                 ("--steps", setup.steps, 1),
                                 ("--threads", args.threads, 1),
                                 ("--train", setup.train_steps, 0), ("--max-batch-limit", args.max_batch_limit, 1)):
        if value is not None and value < minimum:
            raise BenchError(f"{name} must be >= {minimum}, got {value}")
    return setup


def _check_output_path(option: str, path: str) -> None:
    """Fail before the benchmark, not after it, on a file that cannot be written."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise BenchError(f"{option} {path!r} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise BenchError(f"{option} {path!r}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise BenchError(f"{option} {path!r}: directory {directory!r} is not writable")


def _compiled_random_like_eager(setup: Setup) -> ContextManager:
    """With --compile --train: inductor calls eager's random kernels instead
    of generating its own numbers, so a compiled variant's dropout draws the
    masks of its eager float64 reference (otherwise they differ whatever the
    seed, and so would the losses)."""
    if not (setup.compile and setup.train_steps):
        return nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch(fallback_random=True)


def _budget_rows(variants: list, args: argparse.Namespace, setup: Setup) -> tuple[list, list[str]]:
    # The images of the bench's first batch (drawn before the labels, so the
    # number of classes does not change them): fit's example input.
    return budget_variants(variants, args.budget, example=lambda: setup.data(setup.batch, 1, SEED)[0],
                           prepare=lambda model: model.to(setup.device).train(), autocast=setup.autocast,
                           offload=args.offload, only=args.budget_rows)


def _load_kernels(device_type: str) -> None:
    """Choose every op's backend now: on a cold cache this compiles the
    kernels, and their message prints before the progress bar instead of
    through it."""
    from .._core import registry

    for op_name in registry.registered_ops():
        registry.choice(op_name, device_type)


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    setup = _setup(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(setup.threads)
    try:
        return _run_with(args, argv, setup)
    finally:
        torch.set_num_threads(threads)


def _run_with(args: argparse.Namespace, argv: list[str], setup: Setup) -> int:
    for option in ("json", "plot"):
        if getattr(args, option):
            _check_output_path(f"--{option}", getattr(args, option))
    pyplot = load_pyplot(args.plot) if args.plot else None
    variants_per_model = []
    skipped: list[str] = []
    for spec in args.model or DEFAULT_MODELS:
        variants, skipped_here = variants_for(spec)
        skipped += skipped_here
        if args.compile:
            variants += [compiled_twin(variant) for variant in variants]
        if args.budget is not None:
            rows, dropped = _budget_rows(variants, args, setup)
            variants += rows
            skipped += dropped
        variants_per_model.append(variants)

    print(f"effilayers bench: {setup.device.type}, batch {setup.batch}, {setup.sample}, "
          f"{args.dtype}{', channels_last' if setup.channels_last else ''}"
          f"{', eager and torch.compile' if setup.compile else ''}, "
          f"1 warm-up + {setup.steps} timed steps per variant"
          f"{'' if setup.device.type == 'cuda' else f', timed by {CLOCKS[setup.clock]}'}, "
          f"{setup.threads} thread{'s' if setup.threads > 1 else ''}", flush=True)
    for line in skipped:
        print(line, flush=True)
    max_batch_limit = _max_batch_limit(args)
    _load_kernels(setup.device.type)
    bar = _progress(sum(count_ticks(variants, setup, max_batch_limit) for variants in variants_per_model))
    results_per_model: list[list[Result]] = []
    try:
        with _compiled_random_like_eager(setup):
            for variants in variants_per_model:
                results_per_model.append(run_model(variants, setup, max_batch_limit, bar))
    finally:
        bar.close()

    results = [result for model_results in results_per_model for result in model_results]
    on_cuda = setup.device.type == "cuda"
    print(format_table(results, "wall" if on_cuda else setup.clock, cuda=on_cuda,
                       rate="sequences/s" if setup.tokens else "images/s"))
    for model_results in results_per_model:
        print(conclusion(model_results))
    _print_notes(results, setup, args.dtype, args.verbose)
    for line in loss_warnings(results, setup.dtype):
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    spread = timing_warning(results)
    if spread:
        print(f"{PROG}: warning: {spread}", file=sys.stderr)
    if args.json:
        write_json(args.json, argv, setup, args.dtype, max_batch_limit, skipped, results)
        print(f"wrote {args.json}")
    if pyplot is not None:
        pyplot.close(plot(results, args.plot, pyplot, setup))
        print(f"wrote {args.plot}")
    disagreeing = [r for r in results if r.losses_agree is False]
    if args.check_train and disagreeing:
        print(f"{PROG}: --check-train: {len(disagreeing)} variant(s) left the loss tolerance: "
              + ", ".join(f"{r.model} / {r.variant}" for r in disagreeing), file=sys.stderr)
        return 1
    return 0


def _print_notes(results: list[Result], setup: Setup, dtype_name: str, verbose: bool) -> None:
    """What the table leaves out: in full with --verbose, else in a few short lines."""
    notes = [f"note: {r.model} / {r.variant}: {note}" for r in results for note in r.notes]
    if setup.dtype != torch.float32:
        print(f"Under autocast, activation bytes include the {dtype_name} copies of the weights that autocast "
              "keeps for backward (2 bytes per parameter), the same for every variant.")
    if not verbose:
        if setup.device.type == "cpu":
            print("No CUDA peak bytes on CPU (activation bytes do not depend on the device).")
        if setup.train_steps:
            print("losses vs float64: each variant against a float64 run of the same function (--verbose: per step).")
        if notes:
            print(f"{len(notes)} note(s) on the variants: --verbose prints them.")
        return
    if setup.device.type == "cpu":
        print("No CUDA peak bytes on CPU. Activation bytes count the tensors autograd keeps, which these "
              "layers choose the same way on every device; a GPU run adds the peak bytes.")
    if setup.compile:
        print("Under --compile each compiled row is timed alone (dynamo's caches are reset between them); "
              "the eager rows take turns, one timed step each.")
    if setup.train_steps:
        print()
        print(format_losses(results, setup.dtype))
    for line in notes:
        print(line)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except BenchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2

