"""``--budget BUDGET``: the rows that fit one model's activations into a
budget, side by side (issue 18). BUDGET is what ``effilayers.fit`` takes: a
fraction of the plain model's activation bytes or bytes (``2GiB``, issue 33).

* ``fit(BUDGET)``: the model after :func:`effilayers.fit` on the bench's
  own first batch;
* torch's ``torch.utils.checkpoint.checkpoint_sequential``
  (``use_reentrant=False``) over the sequential parts ``fit`` checkpointed
  children of (the whole part, as a user would call it), at
  ``ceil(sqrt(n))`` segments each, the number ``fit`` gives a part whose
  children it checkpoints all; when ``fit`` reached the budget without
  checkpointing, over the model's outermost sequential parts (the row's
  name says which);
* torch's ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``)
  on the plain model over the parts ``fit`` finds: the runs of children
  ``fit`` checkpointed and the units it recomputes whole (a transformer's
  blocks, by a forward set on the instance), then more runs and whole
  units in ``fit``'s own order until the plain model keeps no more bytes
  than ``fit``'s (:func:`effilayers.fit.checkpoint_runs_to`), so its time is
  the price of the same bytes with torch's checkpoint alone, and its note
  says how many units a user checkpoints by hand for them (``fit``'s
  selective units have no counterpart here: torch's checkpoint keeps a
  block's input or all it saves); where no run gets there, its note says
  what it reached;
* torch's ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``)
  around every block, what users write by hand: each unit ``fit`` can
  checkpoint (the members of a ``ModuleList``/``ModuleDict``, the repeated
  block classes: a transformer's layers) and each child of the sequential
  parts it can segment (a ResNet stage's blocks);
* ``torch.compile`` of the plain model compiled under
  ``torch._functorch.config.activation_memory_budget``, the budget as a
  fraction of the plain model's activation bytes;
* ``torch auto-SAC``: torch's integer program (``sac_milp``) choosing the
  modules to checkpoint selectively and their ops to keep, asked for the
  same fraction (:mod:`effilayers.bench.auto_sac`); dropped, with torch's
  own error, where its estimators cannot run (no CUDA device, or pulp or
  pwlf missing).

Every row starts from the plain model (the model's first variant), so the
ratios compare like with like. Every row, and the plain model, also checks
one training step's parameter gradients against the plain model's, dropout
drawing from the same seed (``Variant.check_gradients``; the table's
"grads = plain" column): a method that recomputes dropout must draw the
forward's masks again. torch.compile's budget recomputes dropout with new
masks (pytorch#190758), which this check shows. Imports variants only; cli
uses it; :mod:`effilayers.bench.auto_sac` holds the auto-SAC row's plan.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint, checkpoint_sequential

from .. import memory
from ..checkpoint import sqrt_segments
from ..fit import (
    _RUN_ATTR,
    CheckpointedSequential,
    FitReport,
    _checkpoint_parts,
    _run_in_order,
    _sequential_parts,
    _set_segments,
    checkpoint_runs_to,
    fit,
    parse_budget,
)
from .auto_sac import apply_auto_sac, plan_auto_sac
from .variants import BenchError, Variant

__all__ = ["budget_argument", "budget_label", "budget_variants", "TorchCheckpointedSequential", "TorchCheckpointedRuns",
           "compile_under_budget", "checkpoint_every_block", "FIT", "CHECKPOINT_SEQUENTIAL", "TORCH_CHECKPOINT",
           "EVERY_BLOCK", "COMPILE_BUDGET", "AUTO_SAC", "auto_sac_row", "BUDGET_ROWS", "budget_rows_argument"]

FIT = "fit({})"
CHECKPOINT_SEQUENTIAL = "checkpoint_sequential ({})"
TORCH_CHECKPOINT = "torch checkpoint (to fit's bytes)"
EVERY_BLOCK = "torch checkpoint (every block)"
COMPILE_BUDGET = "torch.compile budget {:.3g}"
AUTO_SAC = "torch auto-SAC"
# --budget-rows: each row's name on the command line, in the order the rows run.
BUDGET_ROWS = ("fit", "checkpoint-sequential", "checkpoint-to-fit", "checkpoint-every-block", "compile-budget",
               "auto-sac")


def budget_argument(text: str) -> Union[float, int]:
    """argparse type of ``--budget``: what :func:`effilayers.fit` takes as its
    budget, written on a command line. A number in (0, 1] is a fraction of
    the plain model's activation bytes (returned as a float, as fit takes
    it); anything else is a size in bytes, ``123456``, ``2GiB``, ``512MiB``,
    ``1.5GB``, read by fit's own :func:`~effilayers.fit.parse_budget` so that
    the two accept the same sizes (returned as an int)."""
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and 0.0 < number <= 1.0:
        return number
    # fit reads a size without a unit as bytes and drops what follows the
    # point ("1.5" is 1 byte): on a command line that is a mistyped fraction.
    if number is not None and not number.is_integer():
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a fraction in (0, 1] of the plain model's activation bytes nor a whole number "
            "of bytes; e.g. 0.35, 123456, 2GiB, 512MiB, 1.5GB")
    try:
        # A size does not depend on the model's bytes: 0 stands in for them.
        return parse_budget(text, 0)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{str(error).removeprefix('fit: ')}; or a fraction in (0, 1] of the "
                                         "plain model's activation bytes, e.g. 0.35") from None


def budget_rows_argument(text: str) -> frozenset[str]:
    """argparse type of ``--budget-rows``: comma-separated names from
    :data:`BUDGET_ROWS`."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in BUDGET_ROWS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, unknown))}: not a --budget row; the rows are "
                                         f"{', '.join(BUDGET_ROWS)} (comma-separated)")
    return frozenset(names)


def budget_label(budget: Union[float, int]) -> str:
    """``budget`` as the rows' names show it: the fraction, or bytes in the
    largest binary unit that keeps a number >= 1 (2GiB, not 2048 MiB)."""
    if isinstance(budget, float):
        return f"{budget:g}"
    unit, size = next((unit, size) for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                      if budget >= size)
    return f"{budget / size:.4g} {unit}"


class TorchCheckpointedSequential(nn.Sequential):
    """An ``nn.Sequential`` that trains through torch's own
    ``checkpoint_sequential`` in ``_bench_segments`` segments (class swapped
    in place, so children and state-dict keys stay where they are). Torch's
    BatchNorm running statistics move twice per step under it: the peer as
    users run it."""

    _bench_segments: int

    def forward(self, input: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(input)
        return checkpoint_sequential(self, self._bench_segments, input, use_reentrant=False)


class TorchCheckpointedRuns(CheckpointedSequential):
    """fit's class of a part with checkpointed runs of children, the runs
    through torch's own ``torch.utils.checkpoint.checkpoint``
    (``use_reentrant=False``): BatchNorm running statistics move twice per
    step under it, as users run it."""

    def _checkpoint_segment(self, modules: list[nn.Module], input: Any) -> Any:
        return torch_checkpoint(_run_in_order(modules), input, use_reentrant=False)


def _torch_checkpoint_unit(unit: nn.Module) -> Callable[[], None]:
    """``unit`` run whole under torch's checkpoint by a forward set on the
    instance (state-dict keys stay); returns what takes it off again."""
    unit.forward = functools.partial(_checkpointed_forward, unit.forward)
    return functools.partial(unit.__dict__.pop, "forward")


def _with_torch_runs(model: nn.Module, segments: dict[str, list[tuple[int, int]]]) -> nn.Module:
    """``model`` (in place) with torch's checkpoint over ``segments``, as
    :func:`~effilayers.fit.checkpoint_runs_to` returns them: runs of a
    sequential part's children, or a unit whole."""
    parts = {part.path: part for part in _checkpoint_parts(model)}
    for path, runs in segments.items():
        if parts[path].unit:
            _torch_checkpoint_unit(parts[path].module)
        else:
            _set_segments(parts[path].module, runs, TorchCheckpointedRuns)
    return model


def _shown(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _torch_checkpoint_row(plain: Variant, fitted: nn.Module, report: FitReport, images: torch.Tensor,
                          prepare: Callable[[nn.Module], nn.Module], autocast: Callable[[], Any]) -> Variant:
    """The plain model with torch's checkpoint over fit's runs and the units
    fit recomputes whole and, while it keeps more bytes than fit's model,
    more runs and whole units in fit's order: how many blocks a user
    checkpoints by hand with torch to keep fit's bytes."""
    fit_bytes = report.measured_bytes
    first = {path: list(module._fit_segments) for path, module in fitted.named_modules()
             if isinstance(module, CheckpointedSequential)}
    first.update({unit.target: [(0, 1)] for unit in report.units if unit.mode == "full"})
    with autocast():
        model = prepare(plain.build())
        parts = _checkpoint_parts(model)
        segments, reached = checkpoint_runs_to(model, images, fit_bytes, first, TorchCheckpointedRuns,
                                               _torch_checkpoint_unit)
    units = [part.path for part in parts if part.unit]
    whole = [path for path in units if path in segments]
    by_fit = [path for path in units if path in first]
    selective = [unit.target for unit in report.units if unit.mode == "selective"]
    fit_runs = [f"{path or 'the model'} children {runs}" for path, runs in first.items() if path not in units]
    if by_fit:
        fit_runs.append(f"{len(by_fit)} unit{'s' * (len(by_fit) != 1)}: {_shown(by_fit)}")
    done = [f"{path or 'the model'} checkpoints children {runs}" for path, runs in segments.items()
            if path not in units]
    if units:
        done.append(f"{len(whole)} of the {len(units)} units whole" + (f" ({_shown(whole)})" if whole else ""))
    reach = f"reaches {reached} bytes, fit's {fit_bytes}" if reached <= fit_bytes else \
        f"cannot reach fit's {fit_bytes} bytes: every run of fit's plan keeps {reached}"
    notes = [f"torch.utils.checkpoint.checkpoint, use_reentrant=False, on the plain model: what fit recomputes "
             f"whole ({'; '.join(fit_runs) or 'nothing'}), then more in fit's order", "; ".join(done) or
             "nothing checkpointed", reach]
    chained = [path for path, module in fitted.named_modules() if _RUN_ATTR in module.__dict__]
    if chained:
        notes.append(f"fit's checkpointed chain ({_shown(chained)}) has no counterpart here: its modules are called "
                     "one by one from their parent's forward, where torch's checkpoint has no function to wrap")
    if selective:
        notes.append(f"fit's {len(selective)} selective unit{'s' * (len(selective) != 1)} have no counterpart in "
                     "torch's checkpoint, which keeps a block's input or everything it saves")
    if any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules()):
        notes.append("torch's BatchNorm running statistics move twice per step")
    return Variant(plain.model, TORCH_CHECKPOINT, lambda: _with_torch_runs(plain.build(), segments),
                   note="; ".join(notes))


def _checkpoint_with_torch(model: nn.Module, segments: dict[str, int]) -> nn.Module:
    for path, count in segments.items():
        part = model.get_submodule(path)
        if type(part) is not nn.Sequential:
            raise BenchError(f"--budget: {path or 'the model'} is a {type(part).__name__}, "
                             "not the nn.Sequential fit checkpointed")
        part.__class__ = TorchCheckpointedSequential
        part._bench_segments = count
    return model


def _checkpointed_forward(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch_checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_every_block(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """``model`` (in place) with every block under torch's checkpoint, by a
    forward set on the instance (state-dict keys stay): the units fit can
    checkpoint and the children of the sequential parts it can segment.
    Returns the model and the blocks' paths. A child that runs in place
    (``inplace=True``: a DenseNet stem's ReLU) is left out: torch's
    checkpoint keeps its input to recompute from, which it then overwrites."""
    blocks = []
    for part in _checkpoint_parts(model):
        names = [part.path] if part.unit else [f"{part.path}.{name}" if part.path else name
                                               for name in part.module._modules]
        blocks += [(name, member) for name, member in zip(names, part.members)
                   if not getattr(member, "inplace", False)]
    for _, block in blocks:
        _torch_checkpoint_unit(block)
    return model, [name for name, _ in blocks]


def compile_under_budget(model: nn.Module, fraction: float,
                         compiler: Optional[Callable[[Callable], Callable]] = None) -> nn.Module:
    """``model`` (in place) whose forward is ``torch.compile`` of its own,
    called with ``torch._functorch.config.activation_memory_budget`` at
    ``fraction`` and restored after each call. The partitioner reads the
    setting when it compiles (the first training call, and any recompile);
    patching every call keeps it local to this model. The module keeps its
    parameters and state-dict keys, so the meter excludes them as for any
    other row. ``compiler``: torch.compile (looked up at the call), or a
    stand-in in tests."""
    import torch._dynamo
    import torch._functorch.config

    # A previous model's frames (ResNet.forward, the blocks') would count
    # against dynamo's recompile limit for this one.
    torch._dynamo.reset()
    compiled = (compiler or torch.compile)(model.forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return compiled(*args, **kwargs)

    model.forward = forward
    return model


def auto_sac_row(plain: Variant, fraction: float, images: torch.Tensor, autocast: Callable[[], Any]
                 ) -> tuple[Optional[Variant], str]:
    """The ``torch auto-SAC`` row of ``plain`` at ``fraction`` of its
    activation bytes, or (None, why it cannot run here): a package missing,
    or what torch's estimators raised, quoted."""
    try:
        # RuntimeEstimator prints its estimate on the way out: not the bench's to show.
        with autocast(), contextlib.redirect_stdout(io.StringIO()):
            plan = plan_auto_sac(plain.build, images, fraction)
    except ImportError as error:
        return None, str(error)
    except Exception as error:  # noqa: BLE001 - torch's estimators and solver raise what they raise; quoted
        where = "" if torch.cuda.is_available() or "cuda" not in str(error).lower() else (
            " (torch.distributed._tools' estimators model or time every op on a CUDA device, and this machine has "
            "none: the cost model asserts torch.cuda.is_available(), the benchmark mode times with CUDA events)")
        return None, f"torch's estimate or solver failed: {type(error).__name__}: {error}{where}"
    return Variant(plain.model, AUTO_SAC, lambda: apply_auto_sac(plain.build(), plan),
                   note=f"{plan.describe()}; the chosen modules run under torch's selective checkpoint "
                        "(use_reentrant=False) keeping the ops get_optimal_checkpointing_policy_per_module keeps"), ""


def _fitted_segments(model: nn.Module) -> dict[str, int]:
    """The parts fit checkpointed children of, path -> ceil(sqrt(n)) segments."""
    return {path: sqrt_segments(len(module)) for path, module in model.named_modules()
            if isinstance(module, CheckpointedSequential)}


def budget_variants(variants: list[Variant], budget: Union[float, int], example: Callable[[], torch.Tensor],
                    prepare: Callable[[nn.Module], nn.Module], autocast: Callable[[], Any],
                    offload: bool = False, only: Optional[frozenset[str]] = None
                    ) -> tuple[list[Variant], list[str]]:
    """The --budget rows of one model (``variants[0]`` is its plain form)
    and one line per row dropped. ``budget``: as :func:`budget_argument`
    returns it, a fraction (float) or bytes (int). ``example()``: the
    bench's first batch of images on its device; ``prepare``: moves a model
    there in training mode; ``autocast()``: the bench's --dtype context;
    ``offload``: fit may offload saved tensors (``fit(..., offload=True)``);
    ``only``: the rows to build, names from :data:`BUDGET_ROWS` (None: all;
    the model's own rows are not among them and always run). ``fit`` runs
    here, once, whichever rows are asked for: checkpoint_sequential and
    torch's checkpoint to fit's bytes follow its plan, and a budget below
    reach is known before the measurements."""
    def wanted(row: str) -> bool:
        return only is None or row in only

    plain = variants[0]
    # The reference of the rows' gradient check.
    plain.check_gradients = True
    model_name = plain.model
    # Its weights do not matter (bytes depend on shapes); the bench loads
    # plain PyTorch's into every row.
    fitted = prepare(plain.build())
    images = example()
    budget_name = budget_label(budget)
    fit_name = FIT.format(budget_name + (", offload" if offload else ""))
    with autocast():
        # torch.compile's budget is a fraction only: bytes over the plain
        # model's, at most 1 (a budget above them asks for no recomputation).
        fraction = budget if isinstance(budget, float) else \
            min(1.0, budget / max(1, memory.activation_bytes(fitted, images)))
        try:
            report = fit(fitted, images, budget, offload=offload)
        except ValueError as error:
            if "smallest reachable" not in str(error):
                raise
            fitted, unreachable = None, str(error)
    rows: list[Variant] = []
    lines: list[str] = []
    if fitted is None:
        if wanted("fit"):
            lines.append(f"{model_name} / {fit_name}: dropped, {unreachable}")
        if wanted("checkpoint-to-fit"):
            lines.append(f"{model_name} / {TORCH_CHECKPOINT}: dropped, fit has no plan to follow: {unreachable}")
        segments = _sqrt_segments(plain.build()) if wanted("checkpoint-sequential") else {}
        label = "sqrt(n) segments; fit dropped"
    else:
        # One checkpoint step per run of children: name each part once, with its segments.
        steps = ", ".join(dict.fromkeys(f"{step.kind} {step.target or 'the model'}" for step in report.steps)) \
            or "none needed"
        checkpointed = "".join(f"; {path or 'the model'} checkpoints children {module._fit_segments}"
                               for path, module in fitted.named_modules()
                               if isinstance(module, CheckpointedSequential))
        chained: dict[int, list[str]] = {}  # a chain's segments, each the paths of its members in order
        for path, module in fitted.named_modules():
            if _RUN_ATTR in module.__dict__:
                chained.setdefault(id(module.__dict__[_RUN_ATTR][0]), []).append(path)
        checkpointed += "".join(f"; {paths[0]}..{paths[-1]} checkpointed as one segment" if len(paths) > 1
                                else f"; {paths[0]} checkpointed alone" for paths in chained.values())
        fitted = fitted.to("cpu")
        if wanted("fit"):
            rows.append(Variant(model_name, fit_name, lambda: copy.deepcopy(fitted),
                                note=f"fit steps: {steps}{checkpointed}; predicted extra compute "
                                     f"{report.extra_compute:.3f} of a training step (recomputed convolution and "
                                     "matmul FLOPs, and on CUDA a selective unit's host time)"
                                     + "".join(f"; unit {unit.target}: {unit.mode}, {unit.why}"
                                               for unit in report.units)
                                     + "".join(f"; {note}" for note in report.notes)))
        if wanted("checkpoint-to-fit"):
            torch_row = _torch_checkpoint_row(plain, fitted, report, images, prepare, autocast)
        segments = _fitted_segments(fitted)
        label = "fit's parts"
        if not segments:
            segments, label = _sqrt_segments(fitted), "sqrt(n) segments; fit had none"
    if wanted("checkpoint-sequential") and segments:
        parts = ", ".join(f"{path or 'the model'} in {count}" for path, count in segments.items())
        rows.append(Variant(model_name, CHECKPOINT_SEQUENTIAL.format(label),
                            lambda: _checkpoint_with_torch(plain.build(), segments),
                            note=f"torch.utils.checkpoint.checkpoint_sequential, use_reentrant=False: {parts} "
                                 "segments (torch's BatchNorm running statistics move twice per step)"))
    elif wanted("checkpoint-sequential"):
        lines.append(f"{model_name} / checkpoint_sequential: dropped, the model has no nn.Sequential "
                     "with two or more children")
    if fitted is not None and wanted("checkpoint-to-fit"):
        rows.append(torch_row)
    blocks = checkpoint_every_block(plain.build())[1] if wanted("checkpoint-every-block") else []
    if blocks:
        shown = _shown(blocks)
        rows.append(Variant(model_name, EVERY_BLOCK, lambda: checkpoint_every_block(plain.build())[0],
                            note=f"torch.utils.checkpoint.checkpoint, use_reentrant=False, around every block of "
                                 f"the plain model: {shown}"))
    elif wanted("checkpoint-every-block"):
        lines.append(f"{model_name} / {EVERY_BLOCK}: dropped, fit finds no block in the model")
    if wanted("compile-budget"):
        rows.append(Variant(model_name, COMPILE_BUDGET.format(fraction),
                            lambda: compile_under_budget(plain.build(), fraction), compiled=True,
                            note=f"plain model under torch.compile, torch._functorch.config.activation_memory_budget "
                                 f"= {fraction:g}" + ("" if isinstance(budget, float) else
                                                      f" ({budget_name} over the plain model's activation bytes)")))
    if wanted("auto-sac"):
        auto_sac, why_not = auto_sac_row(plain, fraction, images, autocast)
        if auto_sac is None:
            lines.append(f"{model_name} / {AUTO_SAC}: dropped, {why_not}")
        else:
            rows.append(auto_sac)
    for row in rows:
        row.check_gradients = True
    return rows, lines


def _sqrt_segments(model: nn.Module) -> dict[str, int]:
    return {path: sqrt_segments(len(part)) for path, part in _sequential_parts(model)}
