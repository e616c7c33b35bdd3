"""Fit a model's activation memory into a budget: ``effilayers.fit(model, example_input, budget)``.

The plan is a fixed chain of steps, cheapest extra time first; ``fit``
applies them to the model in place one at a time, measures the activation
bytes after each (:func:`effilayers.memory.activation_bytes`, one forward of
``example_input``) and stops at the first that meets the budget:

1. ``inplace_abn``: BatchNorm + activation pairs become
   :class:`effilayers.nn.InPlaceABN` (:func:`effilayers.convert`,
   ``mode="inplace"``): no recomputation beyond inverting the activation in
   backward. It needs an invertible activation, so a ReLU becomes
   leaky_relu(0.01); with ``exact=True`` (the default) the step is skipped
   when that would change the model's function, and the report says so.
2. ``densenet_memory_efficient``: effilayers DenseNet layers and transitions
   built with ``memory_efficient=False`` switch it on (the concatenation,
   norm and ReLU are recomputed in backward: elementwise work, no
   convolution).
3. ``checkpoint``: the model's sequential parts (every outermost plain
   ``nn.Sequential`` with two or more children), one more per step, in the
   order of most bytes saved per recomputed FLOP; each runs as
   ``ceil(sqrt(n))`` checkpointed segments (memonger's choice) through
   :func:`effilayers.checkpoint.checkpoint`, which keeps BatchNorm running
   statistics moving once per step. The whole part is recomputed in
   backward.
4. ``save_on_cpu`` is not offered: on a CPU model it saves nothing (the
   tensors are already in host memory), and the CUDA form is not written
   yet; the report notes it.

Why measured, not only predicted: the predictions (from one profiled
forward, per child of each sequential part) ignore storages two modules
share, so the choice rests on measurements. Walking a fixed chain and
stopping at the first step whose measurement is within the budget makes the
result monotone: a smaller budget never ends with more bytes.

"Activation bytes" is the project's figure (what autograd keeps after the
forward). A checkpointed segment's activations come back during its
backward; the report's ``recompute_bytes`` predicts the largest such
segment.

Every measuring forward runs under :func:`torch.random.fork_rng` and puts the
model's buffers back afterwards, so running statistics end where they began.
``effilayers.revert(model)`` undoes what ``fit`` did (and, like after
``convert``, turns fused norms back into plain ones).
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from . import memory
from .checkpoint import checkpoint, sqrt_segments
from .convert import FIT_UNDO_ATTR as UNDO_ATTR, convert, revert
from .models import densenet

__all__ = ["fit", "FitReport", "FitStep", "parse_budget", "CheckpointedSequential"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_budget(budget: Any, current_bytes: int) -> int:
    """``budget`` in bytes: an int, a string such as ``"2GiB"`` / ``"500MB"``,
    or a float in (0, 1], a fraction of ``current_bytes``."""
    if isinstance(budget, bool):
        raise TypeError("fit: budget must be an int (bytes), a str like '2GiB' or a float fraction in (0, 1], "
                        "got bool")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"fit: budget must be a positive number of bytes, got {budget}")
        return budget
    if isinstance(budget, float):
        if not (math.isfinite(budget) and 0.0 < budget <= 1.0):
            raise ValueError(f"fit: budget as a float is a fraction of the current activation bytes, in (0, 1]; "
                             f"got {budget} (pass bytes as an int or a str like '2GiB')")
        return max(1, int(budget * current_bytes))
    if isinstance(budget, str):
        match = _SIZE.match(budget)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"fit: budget {budget!r} is not a size; write e.g. '2GiB', '500MB', '123456' "
                             f"(units: {', '.join(u for u in _UNITS if u)}, case-insensitive)")
        value = int(float(match.group(1)) * _UNITS[unit])
        if value <= 0:
            raise ValueError(f"fit: budget must be a positive size, got {budget!r}")
        return value
    raise TypeError("fit: budget must be an int (bytes), a str like '2GiB' or a float fraction in (0, 1], "
                    f"got {type(budget).__name__}")


@dataclass(frozen=True)
class FitStep:
    """One step ``fit`` applied. ``predicted_bytes`` / ``measured_bytes``:
    the model's activation bytes after this step (and those before it).
    ``extra_compute``: the forward FLOPs this step recomputes in backward, as a
    fraction of a training step's (forward + backward ~ 3x forward) FLOPs."""

    kind: str  # "inplace_abn", "densenet_memory_efficient" or "checkpoint"
    target: str  # the module path ("" for the root), or "model" for whole-model steps
    detail: str
    predicted_bytes: int
    measured_bytes: int
    extra_compute: float = 0.0


@dataclass
class FitReport:
    """What :func:`fit` did. Bytes are activation bytes (:mod:`effilayers.memory`)."""

    budget_bytes: int
    before_bytes: int
    predicted_bytes: int
    measured_bytes: int
    extra_compute: float  # sum of the steps' extra_compute
    recompute_bytes: int  # predicted activations of the largest checkpointed segment, live in its backward
    steps: list[FitStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"effilayers.fit: {self.before_bytes} -> {self.measured_bytes} activation bytes "
                 f"(budget {self.budget_bytes}, predicted {self.predicted_bytes}, "
                 f"{self.measured_bytes / max(self.before_bytes, 1):.3f}x), extra compute "
                 f"{self.extra_compute:.3f} of a training step"]
        lines += [f"  {step.kind} {step.target}: {step.detail} -> {step.measured_bytes} bytes "
                  f"(predicted {step.predicted_bytes}, extra compute {step.extra_compute:.3f})" for step in self.steps]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


class CheckpointedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose children run as checkpointed segments
    (``_fit_segments``: (start, end) index pairs covering every child).
    ``fit`` swaps a Sequential's class to this one, so children, parameters
    and state-dict keys stay where they are; revert swaps it back."""

    _fit_segments: list[tuple[int, int]]

    def forward(self, input: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(input)
        children = list(self)
        for start, end in self._fit_segments:
            input = checkpoint(_run_in_order(children[start:end]), input)
        return input


def _run_in_order(modules: list[nn.Module]) -> Callable:
    # A closure over the list: effilayers.checkpoint finds the modules (and
    # their running statistics) through it.
    def run(value: Any) -> Any:
        for module in modules:
            value = module(value)
        return value

    return run


def _as_tuple(example_input: Any) -> tuple:
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    if not inputs or not all(isinstance(value, torch.Tensor) for value in inputs):
        raise TypeError("fit: example_input must be a tensor or a tuple of tensors, "
                        f"got {type(example_input).__name__}")
    return inputs


class _Restored:
    """Puts the model's buffers (running statistics) and the RNG back after a measuring forward."""

    def __init__(self, model: nn.Module, inputs: tuple) -> None:
        self.model = model
        self.devices = sorted({value.device for value in inputs if value.device.type == "cuda"}, key=str)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.rng = torch.random.fork_rng(devices=[d.index or 0 for d in self.devices])
        self.rng.__enter__()
        with torch.no_grad():
            self.saved = [(buffer, buffer.clone()) for buffer in self.model.buffers()]

    def __exit__(self, *exc_info: Any) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
        self.saved = []
        self.rng.__exit__(*exc_info)


def _measure(model: nn.Module, inputs: tuple) -> int:
    with _Restored(model, inputs):
        return memory.activation_bytes(model, *inputs)


def _span_bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _sequential_parts(model: nn.Module) -> list[tuple[str, nn.Sequential]]:
    """Outermost plain ``nn.Sequential`` modules with two or more children, in module order."""
    parts: list[tuple[str, nn.Sequential]] = []

    def visit(module: nn.Module, path: str) -> None:
        if type(module) is nn.Sequential and len(module) >= 2:
            parts.append((path, module))
            return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return parts


@dataclass
class _Child:
    saved_bytes: int = 0  # what the meter saw saved while the child ran
    input_bytes: int = 0
    flops: int = 0


def _profile(model: nn.Module, inputs: tuple, parts: list[tuple[str, nn.Sequential]]
             ) -> tuple[dict[int, list[_Child]], int]:
    """Per child of each part: bytes saved, input bytes and FLOPs of one
    forward; and the model's forward FLOPs. Two forwards: FlopCounterMode
    installs global module hooks, and a hooked DenseNet layer calls its
    modules instead of recomputing, which would skew the bytes."""
    children = {id(part): [_Child() for _ in part] for _, part in parts}

    def forward_with(before: Callable, after: Callable) -> None:
        handles = []
        for _, part in parts:
            for child, record in zip(part, children[id(part)]):
                handles.append(child.register_forward_pre_hook(
                    lambda module, args, record=record: before(record, args)))
                handles.append(child.register_forward_hook(
                    lambda module, args, output, record=record: after(record)))
        try:
            with _Restored(model, inputs), torch.enable_grad():
                output = model(*inputs)
                del output
        finally:
            for handle in handles:
                handle.remove()

    with memory.track_activations(exclude=model) as meter:
        def saved_before(record: _Child, args: tuple) -> None:
            record.input_bytes = _span_bytes(args[0]) if args else 0
            record.saved_bytes -= meter.bytes

        def saved_after(record: _Child) -> None:
            record.saved_bytes += meter.bytes

        forward_with(saved_before, saved_after)
    counter = FlopCounterMode(display=False)
    # Its global hooks make memory-efficient DenseNet layers call their
    # modules (same FLOPs) and warn once per process: keep that warning for
    # the user's own hooks.
    warned = set(densenet._WARNED)
    with counter, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        def flops_before(record: _Child, args: tuple) -> None:
            record.flops -= counter.get_total_flops()

        def flops_after(record: _Child) -> None:
            record.flops += counter.get_total_flops()

        forward_with(flops_before, flops_after)
    densenet._WARNED.intersection_update(warned)
    return children, counter.get_total_flops()


def _segments(count: int) -> list[tuple[int, int]]:
    size = -(-count // sqrt_segments(count))
    return [(start, min(start + size, count)) for start in range(0, count, size)]


def _checkpoint_part(part: nn.Sequential, segments: list[tuple[int, int]]) -> Callable[[], None]:
    original = type(part)
    part.__class__ = CheckpointedSequential
    part._fit_segments = segments

    def undo() -> None:
        part.__class__ = original
        del part._fit_segments

    return undo


def _memory_efficient_densenet(model: nn.Module) -> tuple[list[str], Callable[[], None]]:
    switched = [(name, module) for name, module in model.named_modules()
                if isinstance(module, (densenet.DenseLayer, densenet.Transition, densenet.DenseNet))
                and not module.memory_efficient]
    for _, module in switched:
        module.memory_efficient = True

    def undo() -> None:
        for _, module in switched:
            module.memory_efficient = False

    return [name for name, _ in switched], undo


def fit(model: nn.Module, example_input: Union[torch.Tensor, tuple], budget: Union[int, str, float], *,
        exact: bool = True) -> FitReport:
    """Make ``model`` keep at most ``budget`` activation bytes for backward, in place.

    Args:
        model: the model to change (in place; ``effilayers.revert(model)`` undoes it).
        example_input: a tensor or tuple of tensors, the inputs of one training
            forward; activation bytes are measured on it.
        budget: bytes (int), a size string (``"2GiB"``, ``"500MB"``) or a float
            in (0, 1]: that fraction of the model's activation bytes now.
        exact: keep the model's function: skip in-place ABN where it would
            turn ReLU into leaky_relu. ``False`` allows it.

    Returns a :class:`FitReport`. Raises ``ValueError`` naming the smallest
    reachable figure when no step of the chain gets under ``budget``; the
    model's steps are then undone (with ``exact=False``, a conversion made on
    the way is reverted as :func:`effilayers.revert` does it: a ReLU comes
    back as the LeakyReLU(0.01) the fused norm computed).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fit: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(exact, bool):
        raise TypeError(f"fit: exact must be a bool, got {type(exact).__name__}")
    if UNDO_ATTR in model.__dict__:
        raise ValueError("fit: model was already fitted; call effilayers.revert(model) first")
    inputs = _as_tuple(example_input)
    before = _measure(model, inputs)
    budget_bytes = parse_budget(budget, before)
    undo: list[Callable[[], None]] = []
    model.__dict__[UNDO_ATTR] = undo
    report = FitReport(budget_bytes, before, before, before, 0.0, 0)
    try:
        _walk_chain(model, inputs, budget_bytes, exact, report, undo)
    except BaseException:
        _revert_fit(model, report)
        raise
    if report.measured_bytes > budget_bytes:
        smallest = report.measured_bytes
        _revert_fit(model, report)
        raise ValueError(f"fit: budget {budget_bytes} bytes is below the smallest reachable figure, {smallest} "
                         f"activation bytes ({smallest / max(before, 1):.3f}x of the {before} now)"
                         + ("; exact=False also allows in-place ABN with leaky_relu"
                            if any("exact=True" in note for note in report.notes) else ""))
    return report


def _revert_fit(model: nn.Module, report: FitReport) -> None:
    """Undo what this call did: its own steps, and the conversion when it made one."""
    for undo in reversed(model.__dict__.pop(UNDO_ATTR, [])):
        undo()
    if any(step.kind == "inplace_abn" for step in report.steps):
        revert(model)


def _walk_chain(model: nn.Module, inputs: tuple, budget_bytes: int, exact: bool, report: FitReport,
                undo: list) -> None:
    """Apply the chain's steps until one measures within the budget (see the module docstring)."""
    def done() -> bool:
        return report.measured_bytes <= budget_bytes

    def record(step: FitStep) -> None:
        report.steps.append(step)
        report.predicted_bytes, report.measured_bytes = step.predicted_bytes, step.measured_bytes
        report.extra_compute += step.extra_compute

    if done():
        return
    report.notes.append("save_on_cpu not offered: on CPU it saves nothing (the tensors are host memory already)"
                        if all(value.device.type == "cpu" for value in inputs)
                        else "save_on_cpu not offered: not implemented yet for CUDA models")
    trial = copy.deepcopy(model)
    trial.__dict__.pop(UNDO_ATTR, None)
    trial_report = convert(trial, "inplace")
    if not trial_report.fused:
        report.notes.append("inplace_abn: no BatchNorm + activation pair to convert")
    elif exact and trial_report.function_changed:
        report.notes.append("inplace_abn skipped: it would turn ReLU into leaky_relu (exact=True; pass exact=False "
                            "to allow it)")
    else:
        predicted = _measure(trial, inputs)
        del trial
        if predicted < report.measured_bytes:
            conversion = convert(model, "inplace")
            record(FitStep("inplace_abn", "model", f"{len(conversion.fused)} norm + activation pairs fused",
                           predicted, _measure(model, inputs)))
    if done():
        return
    switched, undo_switch = _memory_efficient_densenet(model)
    if switched:
        undo.append(undo_switch)
        measured = _measure(model, inputs)
        # The recomputing Function reproduces the plain path's bytes minus the
        # concatenations and norm outputs it drops; measured, there is no
        # separate per-layer prediction.
        record(FitStep("densenet_memory_efficient", "model", f"{len(switched)} DenseNet modules recompute "
                       "cat + norm + ReLU in backward", measured, measured))
    if done():
        return
    parts = _sequential_parts(model)
    if not parts:
        report.notes.append("checkpoint: no nn.Sequential with two or more children to checkpoint")
    else:
        _checkpoint_chain(model, inputs, parts, report, undo, record, done)


def _checkpoint_chain(model, inputs, parts, report, undo, record, done) -> None:
    children, total_flops = _profile(model, inputs, parts)
    step_flops = 3 * max(total_flops, 1)
    options = []
    for path, part in parts:
        profile = children[id(part)]
        segments = _segments(len(part))
        kept = sum(profile[start].input_bytes for start, _ in segments)
        saved = sum(child.saved_bytes for child in profile)
        flops = sum(child.flops for child in profile)
        largest = max(sum(child.saved_bytes for child in profile[start:end]) for start, end in segments)
        if saved > kept:
            options.append((path, part, segments, saved - kept, flops, largest))
    # Most bytes saved per recomputed FLOP first (ties: more bytes first).
    options.sort(key=lambda option: (-option[3] / max(option[4], 1), -option[3]))
    predicted = report.measured_bytes
    for path, part, segments, gain, flops, largest in options:
        if done():
            return
        undo.append(_checkpoint_part(part, segments))
        predicted -= gain
        report.recompute_bytes = max(report.recompute_bytes, largest)
        record(FitStep("checkpoint", path, f"{len(part)} children in {len(segments)} checkpointed segments",
                       predicted, _measure(model, inputs), flops / step_flops))
