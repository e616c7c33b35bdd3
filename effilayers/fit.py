"""Fit a model's activation memory into a budget: ``effilayers.fit(model, example_input, budget)``.

The plan is a fixed chain of steps, cheapest extra time first; ``fit``
applies them to the model in place one at a time, measures the activation
bytes after each (:func:`effilayers.memory.activation_bytes`, one forward of
``example_input``; a checkpoint step that cannot meet the budget is not
measured, see below) and stops at the first that meets the budget:

1. ``inplace_abn``: BatchNorm + activation pairs become
   :class:`effilayers.nn.InPlaceABN` (:func:`effilayers.convert`,
   ``mode="inplace"``): no recomputation beyond inverting the activation in
   backward. In place needs an invertible activation, so a ReLU becomes
   leaky_relu(0.01); with ``exact=True`` (the default) the step is skipped
   when that would change the model's function, and the report says so.
   The activations that cannot be inverted (SiLU, GELU, ...) become an
   exact, not in-place ``ABN``, which keeps the norm's input and drops its
   output (convert's report says so per pair).
2. ``densenet_memory_efficient``: effilayers DenseNet layers and transitions
   built with ``memory_efficient=False`` switch it on (the concatenation,
   norm and ReLU are recomputed in backward: elementwise work, no
   convolution); timm's DenseNet gets the same forwards as ``convert``
   gives it (``effilayers.convert.timm_densenet``), its function unchanged.
3. ``checkpoint``: units, found in any model whatever container holds
   them, outermost first: the children of every outermost plain
   ``nn.Sequential`` with two or more children (a ResNet's ``layer1``..
   ``layer4``, whose children are blocks; a DenseNet's ``features``: the
   stem's modules, the dense blocks and transitions), the members of an
   ``nn.ModuleList`` / ``nn.ModuleDict`` (a transformer's blocks, looped
   over in forward: GPT-2's ``transformer.h``, Llama's ``model.layers``,
   ``nn.TransformerEncoder``'s ``layers``), and the instances of a class
   with children that the model holds two or more of (repeated blocks held
   as plain attributes, as FSDP's transformer auto-wrap finds them), and
   chains: runs of sibling modules outside those that the forward calls
   one after another, each on the output of the one before, which no other
   code reads (a torchvision ResNet's stem: ``conv1``, ``bn1``, ``relu``,
   ``maxpool``, called from ``ResNet.forward``; :func:`_chain_parts`
   finds them in one forward without gradients).
   One run per step, in the order of most predicted bytes saved per unit of
   recomputation (a unit's FLOPs plus one per output element), each step's
   gain predicted given the steps before it.
   A Sequential's or a chain's children run in segments: adjacent
   checkpointed children join into segments that save again, while
   recomputed, no more than the largest of memonger's segments
   (``ceil(n / ceil(sqrt(n)))`` children of an ``n``-child part) in any
   part of the model (``_Profile.segment_cap``): where a part's tensors
   are smaller than the largest part's (a CNN's later stages) its segments
   grow longer and keep fewer inputs; a run is at most one segment long. A
   chain's segment runs from its first member, which returns the
   segment's output, and the members after it pass that output on, while
   the parent's forward runs in training mode (hooks fit puts on the
   parent say when) and no member has hooks; a forward that strays from
   the traced one (a member called with something else while the
   segment's output waits for it) raises instead of computing. Segments
   run through :func:`effilayers.checkpoint.recompute_in_backward` (no
   graph in forward, only the segment's input kept, gradients of the input
   and parameters from a recomputation in backward) where a probe forward
   of the segment, once, shows that its output depends on no tensor
   requiring gradients other than its input and its modules' parameters;
   elsewhere, and compiled, through :func:`effilayers.checkpoint.checkpoint`.
   Any other unit is checkpointed whole, in place: its class becomes a
   subclass of its own (:func:`unit_class`) whose forward runs the
   original under :func:`effilayers.checkpoint.checkpoint` (torch's
   non-reentrant checkpoint: any positional and keyword arguments, any
   outputs, random draws such as dropout replayed), so parameters,
   state-dict keys, module names, hooks (outside the checkpoint, run once),
   ``isinstance``, pickling, ``torch.compile`` and a later FSDP2
   ``fully_shard`` of the same blocks keep working. An argument that is an
   object the unit may write into (HF's KV cache, which each layer appends
   to) is copied, tensors shared, before the forward, and the
   recomputation runs on a fresh copy of that copy, so the cache is
   written once and the recomputation sees it as the forward did.
   Both keep BatchNorm running statistics moving once per step. Only the
   checkpointed units are recomputed in backward, so fit stops at the
   first run that brings the bytes within the budget instead of
   recomputing whole parts.

   Before any whole checkpoint, a unit may run **selective** (one step per
   unit): torch's selective activation checkpointing
   (``create_selective_checkpoint_contexts``, non-reentrant) with
   :func:`effilayers.checkpoint.keep_expensive` as its policy: the outputs
   of matrix products, convolutions and attention are kept, the norms,
   activations, dropout masks and elementwise ops recomputed from them in
   backward. Attention that draws dropout is recomputed too, so that every
   op that drew random numbers in the forward draws them again, in order,
   from the replayed random state: dropout is exact. The meter counts the
   outputs torch's cache keeps (:func:`effilayers.memory.count_kept`). One
   profiled forward with every unit selective gives each unit's bytes saved
   and the elementwise work it repeats (:class:`effilayers.checkpoint.KeepExpensive`
   counts it, one FLOP per element, plus the FLOPs of attention recomputed
   for its dropout); the units go selective in the order of most bytes
   saved per FLOP, skipping a unit where recomputing it whole costs fewer
   FLOPs per byte saved, then the whole checkpoints follow, in the order above, a
   selective unit's taking it from selective to whole. So a unit ends as
   keep, selective or whole, and the report's ``units`` say which and why.
   On a CUDA model the cost also counts host time: torch's selective
   checkpoint sends every op of a unit through a Python dispatch mode, in the
   forward and again in the recomputation, and next to a GPU's kernels that
   time, not the elementwise FLOPs, is what a selective unit costs. A timed
   forward with every candidate unit selective, against a plain one, gives
   it; split among the units by their ops, counted twice, and turned into
   FLOPs at the forward's measured rate, it joins the comparison (so on
   CUDA this choice, like offload's, follows timings).
4. ``offload`` (``fit(..., offload=True)``, CUDA models only, and first in
   the chain when allowed): a unit's saved tensors go to pinned host memory
   on a side stream and come back one unit ahead of backward
   (:class:`effilayers.checkpoint.offload_saved_tensors`), for the units
   whose copy their own forward compute hides (:func:`offload_hides`, from a
   timed forward and a timed host copy); the last unit stays, as nothing
   runs before its backward to hide the way back. Its host copies are not
   activation bytes (the meter counts them as ``offloaded_bytes``). On a
   CPU model it would save nothing (the tensors are host memory already);
   the report notes it.

Why measured, not only predicted: the predictions (from one profiled
forward: which storages each unit saved tensors on, and its first
tensor input) miss what checkpointing changes beyond dropping saved tensors (an
in-place first layer writing over a copy, say), so fit stops only at a
measured step. The chain depends on the model and the example input, never
on the budget; walking it and stopping at the first step whose measurement
is within the budget makes the result monotone: a smaller budget never ends
with more bytes. A checkpoint step is left unmeasured when the bytes that
checkpointing cannot remove (what the un-checkpointed children and the code
around the parts save) are above the budget already: it cannot be the first
within the budget, so skipping its measurement stops the walk at the same
step. Every step is applied, whatever its measurement: a step that saved
nothing still recomputes its children (none did on ResNet-50 or
DenseNet-121).

"Activation bytes" is the project's figure (what autograd keeps after the
forward). A checkpointed segment's activations come back during its
backward; the report's ``recompute_bytes`` predicts the largest such
segment.

Every measuring forward runs under :func:`torch.random.fork_rng` and puts the
model's buffers back afterwards, so running statistics end where they began.
``effilayers.revert(model)`` undoes what ``fit`` did (and, like after
``convert``, turns fused norms back into plain ones). ``fit(...,
dry_run=True)`` walks the same chain on a deep copy and returns its report
(steps, predicted and measured bytes, extra compute), leaving the model
alone; the chain, and so the plan, depends on the model and the shapes of
the example input, not on its values (where what the model saves depends
on shapes only: no data-dependent control flow).

Where fit cannot get under the budget its ``ValueError`` lists the notes
that say why (no unit found, none that saves bytes, no BatchNorm +
activation pair, or convert's reason for each pair it left alone, e.g. an
activation it does not support, such as PReLU).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.flop_counter import FlopCounterMode

from . import memory
from .checkpoint import (
    KeepExpensive,
    _global_module_hooks,
    _tensors_in,
    checkpoint,
    keep_expensive,
    lean_segment_ok,
    offload_saved_tensors,
    recompute_in_backward,
    selective_contexts,
    sqrt_segments,
)
from .convert import FIT_UNDO_ATTR as UNDO_ATTR, convert, revert, timm_densenet
from .models import densenet

__all__ = ["fit", "FitReport", "FitStep", "UnitChoice", "offload_hides", "parse_budget",
           "CheckpointedSequential", "checkpoint_runs_to", "unit_class"]

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
    the model's activation bytes after this step (and those before it);
    ``measured_bytes`` is None for a checkpoint step fit did not measure, as
    the bytes it cannot remove were above the budget already (module
    docstring).
    ``extra_compute``: the forward FLOPs this step recomputes in backward, as a
    fraction of a training step's (forward + backward ~ 3x forward) FLOPs.
    FLOPs are what ``torch.utils.flop_counter`` counts: convolutions and
    matrix products. A selective step counts one per element of each op it
    recomputes (norms, activations, dropout: an estimate; drawing a dropout
    mask costs far more than one FLOP per element on a CPU) and the FLOPs of
    attention recomputed for its dropout, and on a CUDA model the host time
    of torch's dispatch mode, in FLOPs at the forward's measured rate
    (module docstring). Elsewhere elementwise recomputation (norms,
    activations, concatenations: the memory-efficient DenseNet step) counts
    as none, and the checkpoint machinery's own host work is not in it
    either; both take time all the same, most visibly on a CPU at small
    batches."""

    kind: str  # "inplace_abn", "densenet_memory_efficient", "offload", "selective" or "checkpoint"
    target: str  # the module path ("" for the root), or "model" for whole-model steps
    detail: str
    predicted_bytes: int
    measured_bytes: Optional[int]
    extra_compute: float = 0.0


@dataclass(frozen=True)
class UnitChoice:
    """How one unit (a module checkpointed whole: a transformer block, a
    ModuleList member) runs after :func:`fit`, and why."""

    target: str  # its module path
    mode: str  # "keep", "selective", "full" (recomputed whole) or "offload"
    why: str


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
    units: list[UnitChoice] = field(default_factory=list)  # every unit found, in module order

    def __str__(self) -> str:
        lines = [f"effilayers.fit: {self.before_bytes} -> {self.measured_bytes} activation bytes "
                 f"(budget {self.budget_bytes}, predicted {self.predicted_bytes}, "
                 f"{self.measured_bytes / max(self.before_bytes, 1):.3f}x), extra compute "
                 f"{self.extra_compute:.3f} of a training step"]
        lines += [f"  {step.kind} {step.target}: {step.detail} -> "
                  + ("not measured" if step.measured_bytes is None else f"{step.measured_bytes} bytes")
                  + f" (predicted {step.predicted_bytes}, extra compute {step.extra_compute:.3f})"
                  for step in self.steps]
        lines += [f"  unit {unit.target}: {unit.mode}: {unit.why}" for unit in self.units]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


class CheckpointedSequential(nn.Sequential):
    """An ``nn.Sequential`` some of whose children run as checkpointed
    segments (``_fit_segments``: disjoint (start, end) index pairs in order;
    the children outside them run as usual). ``fit`` swaps a Sequential's
    class to this one, so children, parameters and state-dict keys stay
    where they are; revert swaps it back."""

    _fit_segments: list[tuple[int, int]]

    def forward(self, input: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(input)
        children = list(self)
        done = 0
        for start, end in self._fit_segments:
            input = _run_in_order(children[done:start])(input)
            input = self._checkpoint_segment(children[start:end], input)
            done = end
        return _run_in_order(children[done:])(input)

    def _checkpoint_segment(self, modules: list[nn.Module], input: Any) -> Any:
        """The lean recomputation where its probe allows it (checked once per
        run of modules), else effilayers' checkpoint; compiled, always the
        latter, which the compiler recomputes from its graph. A subclass may
        run another checkpoint (the bench's torch peer)."""
        if not torch.compiler.is_compiling() and type(input) is torch.Tensor:
            key = tuple(map(id, modules))
            lean = self.__dict__.get("_fit_lean", {})
            if key not in lean:
                # Answers for modules no longer here (a deepcopy carries the
                # original's) go; the dict holds at most one per segment.
                children = set(map(id, self))
                lean = {probed: ok for probed, ok in lean.items() if children.issuperset(probed)}
                lean[key] = lean_segment_ok(modules, input)
                self.__dict__["_fit_lean"] = lean
            if lean[key]:
                return recompute_in_backward(modules, input)
        return checkpoint(_run_in_order(modules), input)


def _run_in_order(modules: list[nn.Module]) -> Callable:
    # A closure over the list: effilayers.checkpoint finds the modules (and
    # their running statistics) through it.
    def run(value: Any) -> Any:
        for module in modules:
            value = module(value)
        return value

    return run


# ---- units: any module run whole under checkpoint ----------------------------------------------

_UNIT_CLASSES: dict[type, type] = {}
_PLAIN_CLASS_ATTR = "_fit_plain_class"
# Set on a unit whose class another swap has built on since (FSDP2's
# fully_shard makes FSDP<class> of it): revert cannot take the class back
# without dropping that one, so the unit runs its plain forward instead.
_UNIT_OFF_ATTR = "_fit_unit_off"
# How a unit runs: "full" (checkpointed whole; the default), "selective"
# (torch's selective checkpoint: matmul and attention outputs kept, the rest
# recomputed) or "offload" (saved tensors to host memory and back).
_MODE_ATTR = "_fit_mode"
# The selective policy of each unit's last forward: what it kept and recomputed, for the plan.
_LAST_POLICY: "weakref.WeakKeyDictionary[nn.Module, KeepExpensive]" = weakref.WeakKeyDictionary()
_PLAIN_VALUES = (torch.Tensor, nn.Module, bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _holds_state(value: Any) -> bool:
    """Whether ``value`` may be an object the unit's forward writes into
    (HF's DynamicCache appends each layer's keys and values to itself)."""
    if value is None or isinstance(value, _PLAIN_VALUES):
        return False
    return not isinstance(value, tuple) or any(map(_holds_state, value))


def _frozen_copy(value: Any) -> Any:
    """A copy of ``value``'s Python objects and containers sharing its tensors
    and modules, so that a recomputation sees such an object as the forward
    first saw it and leaves the real one alone. Where the copy fails the
    object itself is passed, as torch's checkpoint would pass it."""
    shared: dict[int, Any] = {}
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, (torch.Tensor, nn.Module)):
            shared[id(item)] = item
        elif id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple, set))
                         else vars(item).values() if hasattr(item, "__dict__") else ())
    try:
        return copy.deepcopy(value, shared)
    except Exception:  # an object deepcopy cannot take (a lock, a process group)
        return value


def _checkpointed_call(unit: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
    if not torch.is_grad_enabled() or unit.__dict__.get(_UNIT_OFF_ATTR):
        return forward(*args, **kwargs)
    mode = unit.__dict__.get(_MODE_ATTR, "full")
    if mode == "offload":
        # Nothing is recomputed, so a KV cache is written once as it is.
        with offload_saved_tensors():
            return forward(*args, **kwargs)
    context_fn = torch_checkpoint.noop_context_fn
    if mode == "selective" and torch.compiler.is_compiling():
        context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, keep_expensive)
    elif mode == "selective":
        policy = _LAST_POLICY[unit] = KeepExpensive()
        context_fn = functools.partial(selective_contexts, policy)
    # The keywords travel in closures, not through checkpoint's own keywords
    # (a unit's debug= or context_fn= would be taken for them).
    frozen = {key: _frozen_copy(value) for key, value in (*enumerate(args), *kwargs.items()) if _holds_state(value)}
    if not frozen:
        # No side effect in the checkpointed function: torch.compile traces it whole.
        return checkpoint(lambda *args: forward(*args, **kwargs), *args, context_fn=context_fn)
    # The real state objects reach the first call only, and nothing the
    # checkpoint keeps refers to them: the forward writes this unit's own
    # outputs into them (a KV cache's keys), whose graph holds the
    # checkpoint's hooks, which hold this function. Held here, that would be
    # a cycle through autograd's C++ nodes, freed by a backward but never by
    # the collector: a forward without backward (fit's measuring ones) would
    # keep the unit's whole graph.
    first = [(args, kwargs)]
    rest = {key: value for key, value in kwargs.items() if key not in frozen}

    def run(*passed: Any) -> Any:
        if first:
            real_args, real_kwargs = first.pop()
            return forward(*real_args, **real_kwargs)
        # A recomputation: a fresh copy of the state each time (a backward
        # with retain_graph=True recomputes again).
        return forward(*(_frozen_copy(frozen[i]) if i in frozen else value for i, value in enumerate(passed)),
                       **rest, **{key: _frozen_copy(frozen[key]) for key in frozen if isinstance(key, str)})

    return checkpoint(run, *(None if i in frozen else value for i, value in enumerate(args)), context_fn=context_fn)


def _new_unit(plain: type) -> nn.Module:
    return object.__new__(unit_class(plain))


def _reduce_unit(self: nn.Module, protocol: int) -> Any:
    # The class is made at run time: pickle and deepcopy rebuild it from the
    # plain class, which pickles by name.
    return _new_unit, (getattr(type(self), _PLAIN_CLASS_ATTR),), self.__dict__


def unit_class(plain: type) -> type:
    """The subclass of ``plain`` that ``fit`` swaps a unit's class to: its
    forward runs ``plain``'s under :func:`effilayers.checkpoint.checkpoint`
    (torch's non-reentrant checkpoint: any arguments and outputs, random
    draws replayed) while gradients are on. Parameters, buffers, state-dict
    keys, hooks and ``isinstance(unit, plain)`` stay; one class per ``plain``."""
    if plain not in _UNIT_CLASSES:
        # plain's forward by closure, not looked up through type(self): a
        # class built on this one (FSDP<class>) must still reach plain's.
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _checkpointed_call(self, functools.partial(plain.forward, self), args, kwargs)

        _UNIT_CLASSES[plain] = type(f"Checkpointed{plain.__name__}", (plain,), {
            "forward": forward, _PLAIN_CLASS_ATTR: plain, "__reduce_ex__": _reduce_unit, "__module__": __name__})
    return _UNIT_CLASSES[plain]


@dataclass
class _RestoreUnit:
    unit: nn.Module
    previous_mode: Optional[str] = None  # the mode before this step; None: the unit was plain

    def __call__(self) -> None:
        if self.previous_mode is not None:
            self.unit.__dict__[_MODE_ATTR] = self.previous_mode
            return
        self.unit.__dict__.pop(_MODE_ATTR, None)
        plain = type(self.unit).__dict__.get(_PLAIN_CLASS_ATTR)
        if plain is None:
            self.unit.__dict__[_UNIT_OFF_ATTR] = True
        else:
            self.unit.__class__ = plain


def _checkpoint_unit(unit: nn.Module, mode: str = "full") -> Callable[[], None]:
    """Make ``unit`` run in ``mode`` (see ``_MODE_ATTR``); returns what puts it back."""
    previous = unit.__dict__.get(_MODE_ATTR, "full") if _PLAIN_CLASS_ATTR in type(unit).__dict__ else None
    unit.__class__ = unit_class(getattr(type(unit), _PLAIN_CLASS_ATTR, type(unit)))
    unit.__dict__.pop(_UNIT_OFF_ATTR, None)
    unit.__dict__[_MODE_ATTR] = mode
    return _RestoreUnit(unit, previous)


# ---- chains: sibling modules a forward calls one after another -----------------------------------

_CHAIN_CLASSES: dict[type, type] = {}
# On a chain member in a checkpointed segment: (its _ChainRun, its position in it).
_RUN_ATTR = "_fit_chain_run"


class _PlainForward(nn.Module):
    """A chain member's own forward, without the chained one: what a
    segment runs, in forward and in its recomputation. Not registered in
    the model (it lives in a _ChainRun), so state dicts never see it."""

    def __init__(self, member: nn.Module) -> None:
        super().__init__()
        self.member = member

    def forward(self, value: Any) -> Any:
        return getattr(type(self.member), _PLAIN_CLASS_ATTR).forward(self.member, value)


class _ChainRun:
    """One checkpointed segment of a chain. While its parent's forward runs
    in training mode (the parent's hooks arm and disarm it), the first
    member, called with gradients on, runs the whole segment (recomputed in
    backward) and returns the segment's output; each later member, handed
    exactly that output in turn, passes it on unchanged. Anything else
    (outside the parent's forward, in eval mode, without gradients, compiled,
    a member or module hook present, a replica's member) runs the member's
    own forward. A member called with something else while the segment's
    output waits for it, or a parent's forward that ends before the
    segment's members were all called, raises: the forward did not go as
    the one fit traced, and the segment's output would be wrong."""

    def __init__(self, members: list[nn.Module], names: list[str]) -> None:
        self.plain = [_PlainForward(member) for member in members]
        self.names = names
        self.pending: Optional[torch.Tensor] = None
        self.next = 0
        self.armed = False
        self.lean: Optional[bool] = None

    def __getstate__(self) -> dict:
        # A copy taken mid-forward (or after one that raised) starts clean,
        # and holds no output with a graph (deepcopy refuses those).
        return {**self.__dict__, "pending": None, "next": 0, "armed": False}

    def arm(self, parent: nn.Module, args: Any, kwargs: Any = None) -> None:
        self.armed, self.pending, self.next = parent.training, None, 0

    def disarm(self, parent: nn.Module, args: Any, output: Any) -> None:
        waiting = self.pending is not None
        self.armed, self.pending, self.next = False, None, 0
        if waiting:
            raise RuntimeError(f"fit: the forward returned before it called {self.names[-1]} on the output of the "
                               f"checkpointed run {self.names[0]}..{self.names[-1]}: it did not follow the forward "
                               "fit traced; effilayers.revert(model) undoes the fit")

    def first(self, member: nn.Module, input: torch.Tensor) -> Optional[torch.Tensor]:
        """The segment's output, or None where the member runs its own forward."""
        if (not self.armed or self.pending is not None or self.plain[0].member is not member
                or not torch.is_grad_enabled() or torch.compiler.is_compiling() or _global_module_hooks()
                or any(plain.member._forward_hooks or plain.member._forward_pre_hooks for plain in self.plain)):
            return None
        if self.lean is None:
            self.lean = lean_segment_ok(self.plain, input)
        output = (recompute_in_backward(self.plain, input) if self.lean
                  else checkpoint(_run_in_order(self.plain), input))
        self.pending, self.next = (output, 1) if len(self.plain) > 1 else (None, 0)
        return output

    def passes(self, position: int, value: Any) -> bool:
        if self.pending is None:
            return False
        if value is not self.pending or position != self.next:
            self.pending, self.next = None, 0
            raise RuntimeError(f"fit: {self.names[position]} was called with another input than the output of the "
                               f"checkpointed run {self.names[0]}..{self.names[-1]} it belongs to: the forward did "
                               "not follow the one fit traced; effilayers.revert(model) undoes the fit")
        self.next += 1
        if self.next == len(self.plain):
            self.pending, self.next = None, 0
        return True


def chain_class(plain: type) -> type:
    """The subclass of ``plain`` that a chain member in a checkpointed
    segment takes (see :class:`_ChainRun`); one class per ``plain``,
    pickled and copied as ``unit_class``'s are."""
    if plain not in _CHAIN_CLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            entry = self.__dict__.get(_RUN_ATTR)
            if entry is not None and len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor:
                run, position = entry
                if position == 0:
                    output = run.first(self, args[0])
                    if output is not None:
                        return output
                elif run.passes(position, args[0]):
                    return args[0]
            return plain.forward(self, *args, **kwargs)

        _CHAIN_CLASSES[plain] = type(f"Chained{plain.__name__}", (plain,), {
            "forward": forward, _PLAIN_CLASS_ATTR: plain, "__reduce_ex__": _reduce_chained, "__module__": __name__})
    return _CHAIN_CLASSES[plain]


def _new_chained(plain: type) -> nn.Module:
    return object.__new__(chain_class(plain))


def _reduce_chained(self: nn.Module, protocol: int) -> Any:
    return _new_chained, (getattr(type(self), _PLAIN_CLASS_ATTR),), self.__dict__


class _ChainHooks:
    """The forward hooks fit puts on a chain's parent: they arm the chain's
    runs while the parent's forward runs, and disarm them as it ends,
    raised or not (see :class:`_ChainRun`)."""

    def __init__(self) -> None:
        self.runs: list[_ChainRun] = []

    def arm(self, parent: nn.Module, args: Any, kwargs: Any) -> None:
        for run in self.runs:
            run.arm(parent, args)

    def disarm(self, parent: nn.Module, args: Any, output: Any) -> None:
        errors = []
        for run in self.runs:
            try:
                run.disarm(parent, args, output)
            except RuntimeError as error:
                errors.append(error)
        if errors:
            raise errors[0]


# On a chain's parent: {the chain's first member's name: its _ChainHooks}.
_HOOKS_ATTR = "_fit_chain_hooks"


@dataclass
class _RestoreChain:
    # (member, its run entry or None: not chained) before the step; the
    # parent's hooks and their runs before the step, and the handles to
    # remove where this step added the hooks. No class objects: a chained
    # class pickles by its plain one only.
    members: list
    parent: nn.Module
    key: str
    hooks: _ChainHooks
    runs: list
    handles: list

    def __call__(self) -> None:
        self.hooks.runs = self.runs
        if self.handles:
            for handle in self.handles:
                handle.remove()
            chains = self.parent.__dict__.get(_HOOKS_ATTR, {})
            chains.pop(self.key, None)
            if not chains:
                self.parent.__dict__.pop(_HOOKS_ATTR, None)
        for member, entry in self.members:
            plain = type(member).__dict__.get(_PLAIN_CLASS_ATTR)
            if plain is None and hasattr(type(member), _PLAIN_CLASS_ATTR):
                # A class built on the chained one since (FSDP2's fully_shard):
                # keep it; without its run entry the member runs its own forward.
                member.__dict__.pop(_RUN_ATTR, None)
                continue
            plain = plain or type(member)
            member.__class__ = chain_class(plain) if entry is not None else plain
            if entry is None:
                member.__dict__.pop(_RUN_ATTR, None)
            else:
                member.__dict__[_RUN_ATTR] = entry


def _set_chain_segments(part: "_Part", segments: list[tuple[int, int]]) -> Callable[[], None]:
    """Make ``part``'s chain checkpoint ``segments``; returns what puts it back as it was."""
    members = part.members
    key = part.chain[0][0]
    chains = part.module.__dict__.setdefault(_HOOKS_ATTR, {})
    handles = []
    if key not in chains:
        chains[key] = _ChainHooks()
        handles = [part.module.register_forward_pre_hook(chains[key].arm, with_kwargs=True),
                   part.module.register_forward_hook(chains[key].disarm, always_call=True)]
    hooks = chains[key]
    restore = _RestoreChain([(member, member.__dict__.get(_RUN_ATTR)) for member in members], part.module, key,
                            hooks, list(hooks.runs), handles)
    for member in members:
        member.__class__ = getattr(type(member), _PLAIN_CLASS_ATTR, type(member))
        member.__dict__.pop(_RUN_ATTR, None)
    hooks.runs = []
    for start, end in segments:
        run = _ChainRun(members[start:end], [part.name(index) for index in range(start, end)])
        hooks.runs.append(run)
        for position, member in enumerate(members[start:end]):
            member.__class__ = chain_class(type(member))
            member.__dict__[_RUN_ATTR] = (run, position)
    return restore


def _chain_parts(model: nn.Module, call: "_Call", parts: list["_Part"]) -> list["_Part"]:
    """Runs of two or more sibling modules, outside every part, that the
    model's forward calls one after another, each on the output of the one
    before (a torchvision ResNet's stem: conv1, bn1, relu, maxpool, called
    from ResNet.forward), found in one forward without gradients. A link
    from one sibling to the next holds only where the next is handed the
    first's output as its one argument, no code reads that output but the
    next sibling, the parent does not return it and nothing else holds it
    when the forward ends (a list of features the model returns, a module's
    attribute): a segment of the chain computes it once, inside the
    segment, and nothing outside may need it. Siblings called more than
    once (a shared ReLU) or with hooks of their own are left out, and of
    chains inside the members of others only the outermost are kept."""
    covered: set[int] = set()
    holds_part: set[int] = set()
    names = {id(module): name for name, module in model.named_modules()}
    for part in parts:
        covered.update(id(module) for module in part.module.modules())
        path = part.path
        while path:
            path = path.rpartition(".")[0]
            holds_part.add(id(model.get_submodule(path)) if path else id(model))
        holds_part.add(id(model))
    candidates: dict[int, tuple[nn.Module, str, nn.Module]] = {}  # id(child) -> (parent, name, child)
    for parent in model.modules():
        if id(parent) in covered or type(parent) is nn.Sequential:
            continue
        for name, child in parent.named_children():
            # A member's own hooks would see the segment's output, or not run.
            if (id(child) not in covered and id(child) not in holds_part
                    and not (child._forward_hooks or child._forward_pre_hooks)):
                candidates[id(child)] = (parent, name, child)
    if not candidates:
        return []
    calls: list[dict] = []  # per call, in order: child, input id, output id
    stack: list[int] = []
    produced: dict[int, int] = {}  # output id -> the call that made it
    # output id -> (op number, call stack) of each op that read it
    readers: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    ops = [0]
    returned: dict[int, set[int]] = {}  # id(parent) -> ids of the tensors it returned
    # The outputs stay alive during the trace, so their ids are not reused;
    # one reference each, so that afterwards a count above it shows an
    # output something else holds (a list of features the model returns).
    keep: dict[int, torch.Tensor] = {}
    outputs: list[Any] = []  # the model's own: what it returns holds its tensors

    class Reads(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            ops[0] += 1
            for tensor in _tensors_in((args, kwargs or {})):
                if id(tensor) in produced:
                    readers.setdefault(id(tensor), []).append((ops[0], tuple(stack)))
            return func(*args, **(kwargs or {}))

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        single = len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor
        calls.append({"child": module, "input": id(args[0]) if single else None, "output": None})
        stack.append(len(calls) - 1)

    def after(module: nn.Module, args: tuple, output: Any) -> None:
        number = stack.pop()
        calls[number]["end"] = ops[0]
        if type(output) is torch.Tensor:
            calls[number]["output"] = id(output)
            produced.setdefault(id(output), number)
            keep[id(output)] = output

    def parent_after(module: nn.Module, args: tuple, output: Any) -> None:
        # Ids only: a reference here would count as something holding the output.
        returned.setdefault(id(module), set()).update(id(tensor) for tensor in _tensors_in(output))

    handles = []
    parents = {id(parent): parent for parent, _, _ in candidates.values()}
    try:
        for _, _, child in candidates.values():
            handles.append(child.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(child.register_forward_hook(after))
        for parent in parents.values():
            handles.append(parent.register_forward_hook(parent_after))
        with _Restored(model, call), torch.no_grad(), Reads():
            outputs.append(model(*call.args, **call.kwargs))
    finally:
        for handle in handles:
            handle.remove()
    times: dict[int, int] = {}
    for entry in calls:
        times[id(entry["child"])] = times.get(id(entry["child"]), 0) + 1
    found = []
    for parent_id, parent in parents.items():
        sequence = [(number, entry) for number, entry in enumerate(calls)
                    if candidates[id(entry["child"])][0] is parent]

        def linked(earlier: tuple[int, dict], later: tuple[int, dict]) -> bool:
            (_, first), (number, second) = earlier, later
            output = first["output"]
            return (output is not None and second["input"] == output and times[id(first["child"])] == 1
                    and times[id(second["child"])] == 1 and output not in returned.get(parent_id, set())
                    # held by something but the trace (the model's output, a module's attribute)
                    and sys.getrefcount(keep[output]) <= 2
                    and all(number in reading for op, reading in readers.get(output, []) if op > first["end"]
                            # An in-place member returns its input: later reads are of its output.
                            and (second["output"] != output or op <= second["end"])))

        run = sequence[:1]
        for later in sequence[1:] + [None]:
            if later is not None and linked(run[-1], later):
                run.append(later)
                continue
            if len(run) >= 2:
                chain = tuple((candidates[id(entry["child"])][1], entry["child"]) for _, entry in run)
                found.append(_Part(names[parent_id], parent, unit=False, chain=chain))
            run = [later] if later is not None else []
    # The outermost chains only, as parts are outermost: a chain inside a
    # member of another would share its storages with it.
    inside = {id(module) for part in found for member in part.members for module in member.modules()}
    return [part for part in found if id(part.module) not in inside]


@dataclass(frozen=True)
class _Call:
    """``example_input`` as the call ``model(*args, **kwargs)``."""

    args: tuple
    kwargs: dict

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(_tensors_in((self.args, self.kwargs)))


def _as_call(example_input: Any) -> _Call:
    if isinstance(example_input, dict):
        # Keywords: an attention mask, use_cache=... beside the input ids.
        call = _Call((), dict(example_input))
        if not all(isinstance(key, str) for key in example_input) or not call.tensors:
            raise TypeError("fit: example_input as a dict holds the keyword arguments of one forward, str keys and "
                            "at least one tensor")
        return call
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    if not args or not all(isinstance(value, torch.Tensor) for value in args):
        raise TypeError("fit: example_input must be a tensor, a tuple of tensors or a dict of keyword arguments, "
                        f"got {type(example_input).__name__}")
    return _Call(args, {})


class _Restored:
    """Puts the model's buffers (running statistics) and the RNG back after a measuring forward."""

    def __init__(self, model: nn.Module, call: _Call) -> None:
        self.model = model
        self.devices = sorted({value.device for value in call.tensors if value.device.type == "cuda"}, key=str)
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


def _measure(model: nn.Module, call: _Call) -> int:
    with _Restored(model, call):
        return memory.activation_bytes(model, *call.args, **call.kwargs)


def _span_bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _sequential_parts(model: nn.Module) -> list[tuple[str, nn.Sequential]]:
    """Outermost plain ``nn.Sequential`` modules with two or more children, in module order."""
    return [(part.path, part.module) for part in _checkpoint_parts(model, units=False)]


@dataclass(frozen=True)
class _Part:
    """What fit checkpoints: a plain ``nn.Sequential`` whose adjacent
    children join into segments, or one unit (any other module, run whole
    under checkpoint by a class swap)."""

    path: str
    module: nn.Module
    unit: bool
    # A run of ``module``'s children that its forward calls one after
    # another (see _chain_parts): (name, child) each; empty for the others.
    chain: tuple = ()

    @property
    def members(self) -> list[nn.Module]:
        if self.chain:
            return [child for _, child in self.chain]
        return [self.module] if self.unit else list(self.module)

    def name(self, index: int) -> str:
        if self.chain:
            return self.chain[index][0]
        return self.path if self.unit else list(self.module._modules)[index]


def _checkpoint_parts(model: nn.Module, units: bool = True) -> list[_Part]:
    """In module order, the outermost of: plain ``nn.Sequential`` modules
    with two or more children, and (``units``) the members of an
    ``nn.ModuleList`` / ``nn.ModuleDict`` and the instances of a class with
    children that the model holds two or more of (its repeated blocks, the
    way FSDP's transformer auto-wrap finds layers: a transformer's blocks
    live in a ModuleList looped over in forward, whatever the model calls
    it). A repeated leaf (Linear, Dropout, LayerNorm) is one op, not a
    block: checkpointing it alone keeps its input, most of what it saves."""
    counts: dict[type, int] = {}
    for module in model.modules():
        counts[type(module)] = counts.get(type(module), 0) + 1
    parts: list[_Part] = []

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if type(child) is nn.Sequential and len(child) >= 2:
                parts.append(_Part(child_path, child, unit=False))
            elif units and (isinstance(module, (nn.ModuleList, nn.ModuleDict))
                            or (counts[type(child)] >= 2 and len(child._modules) > 0)):
                parts.append(_Part(child_path, child, unit=True))
            else:
                visit(child, child_path)

    if type(model) is nn.Sequential and len(model) >= 2:
        return [_Part("", model, unit=False)]
    visit(model, "")
    return parts


@dataclass
class _Child:
    """One child of a sequential part, seen in one plain forward."""

    # storage key (memory.storage_key) -> (bytes the storage's count grew by,
    # saved tensors put on it) while the child ran
    saves: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    input_key: Optional[tuple] = None
    input_bytes: int = 0
    flops: int = 0
    output_elements: int = 0

    @property
    def cost(self) -> int:
        # Recomputation cost for the plan's order: the FLOPs the counter sees
        # (matmuls, convolutions) plus one per output element, so that
        # norms, activations and poolings are cheap, not free.
        return self.flops + self.output_elements


@dataclass
class _Storage:
    bytes: int
    owners: set  # (part index, child index) of the children that saved tensors on it
    outside: bool  # something outside the parts' children saved on it too
    growth: dict  # owner -> the bytes the count grew by while it ran
    outside_growth: int  # what it grew by outside the parts' children


@dataclass
class _Profile:
    """What the plan needs from one forward: per child of every part, what
    it saved and its cost; per storage, who saved on it."""

    children: list[list[_Child]]
    storages: dict[tuple, _Storage]
    total_flops: int
    _inside: dict = field(default_factory=dict, repr=False)
    _cap: Optional[int] = field(default=None, repr=False)

    def longest(self, part: int) -> int:
        """Memonger's segment length: ceil(n / ceil(sqrt(n))) of the part's n
        children (every child checkpointed gives ceil(sqrt(n)) segments)."""
        count = len(self.children[part])
        return -(-count // sqrt_segments(count))

    def inside_bytes(self, part: int, start: int, end: int) -> int:
        """Predicted bytes children ``start`` to ``end`` of ``part`` save
        again while recomputed as one segment in backward."""
        key = (part, start, end)
        if key not in self._inside:
            inside = {(part, index) for index in range(start, end)}
            self._inside[key] = sum(storage.bytes for storage in self.storages.values() if storage.owners & inside)
        return self._inside[key]

    @property
    def segment_cap(self) -> int:
        """The most one segment may save again while recomputed: the largest
        of memonger's segments over every part checkpointed whole. A segment
        in a part of smaller tensors (a CNN's later stages) grows past
        memonger's length up to it, keeping fewer segment inputs; no segment
        saves more than that largest one of memonger's would (at a budget
        met before the largest parts are checkpointed, more than memonger's
        segments of the parts checkpointed would). Depends on the model and
        input only: the chain stays the same for every budget."""
        if self._cap is None:
            self._cap = max((self.inside_bytes(part, start, min(start + self.longest(part), len(records)))
                             for part, records in enumerate(self.children)
                             for start in range(0, len(records), self.longest(part))), default=0)
        return self._cap

    def reach(self, part: int, start: int, stop: Optional[int] = None) -> int:
        """The end of the longest segment from ``start`` (before ``stop``)
        within ``segment_cap``; one child at least."""
        stop = len(self.children[part]) if stop is None else stop
        end = start + 1
        while end < stop and self.inside_bytes(part, start, end + 1) <= self.segment_cap:
            end += 1
        return end

    def segments(self, part: int, checked: frozenset) -> list[tuple[int, int]]:
        """Runs of adjacent checkpointed children, each cut into segments as
        long as ``segment_cap`` allows, from the run's first child on."""
        found = []
        indices = sorted(checked)
        start = 0
        while start < len(indices):
            end = start
            while end + 1 < len(indices) and indices[end + 1] == indices[end] + 1:
                end += 1
            first, stop = indices[start], indices[end] + 1
            while first < stop:
                cut = self.reach(part, first, stop)
                found.append((first, cut))
                first = cut
            start = end + 1
        return found

    def kept_bytes(self, state: tuple[frozenset, ...]) -> int:
        """Predicted activation bytes with the children in ``state`` (per part,
        the checkpointed indices) checkpointed: every storage some
        un-checkpointed child (or code outside the parts) saved on, and each
        segment's input."""
        checked = {(part, index) for part, indices in enumerate(state) for index in indices}
        kept = {key for key, storage in self.storages.items() if storage.outside or not storage.owners <= checked}
        total = sum(self.storages[key].bytes for key in kept)
        for part, indices in enumerate(state):
            for start, _ in self.segments(part, indices):
                child = self.children[part][start]
                if child.input_key not in kept:
                    kept.add(child.input_key)
                    total += child.input_bytes
        return total

    def lower_bound(self, state: tuple[frozenset, ...]) -> int:
        """Bytes the model keeps whatever the checkpointed children in
        ``state`` do: on every storage, the most that one un-checkpointed
        child (or the code outside the parts) added to the count. Those
        modules save the same tensors however their inputs were made; a
        checkpointed segment can only add its input, or split a storage in
        two (a copied input an in-place layer writes over), never merge two.
        """
        checked = {(part, index) for part, indices in enumerate(state) for index in indices}
        total = 0
        for storage in self.storages.values():
            shares = [growth for owner, growth in storage.growth.items() if owner not in checked]
            if storage.outside:
                shares.append(storage.outside_growth)
            total += max(shares, default=0)
        return total

    def largest_segment_bytes(self, state: tuple[frozenset, ...]) -> int:
        """Predicted bytes the largest checkpointed segment saves again while it is recomputed in backward."""
        largest = 0
        for part, indices in enumerate(state):
            for start, end in self.segments(part, indices):
                largest = max(largest, self.inside_bytes(part, start, end))
        return largest


def _profile(model: nn.Module, call: _Call, parts: list[_Part], flops: bool = True) -> _Profile:
    """One forward with the meter: per child of each part, the storages it
    saved on; one with the FLOP counter (``flops``; without it the FLOPs
    read 0). Two forwards: FlopCounterMode installs global module hooks,
    and a hooked DenseNet layer calls its modules instead of recomputing,
    which would change what is saved."""
    children = [[_Child() for _ in part.members] for part in parts]

    def forward_with(before: Callable, after: Callable, at_end: Callable = lambda: None) -> None:
        handles = []
        for part, records in zip(parts, children):
            for child, record in zip(part.members, records):
                # A unit may be called with keywords only (hidden_states=...).
                handles.append(child.register_forward_pre_hook(
                    lambda module, args, kwargs, record=record: before(record, (args, kwargs)), with_kwargs=True))
                handles.append(child.register_forward_hook(
                    lambda module, args, output, record=record: after(record, output)))
        try:
            with _Restored(model, call), torch.enable_grad():
                output = model(*call.args, **call.kwargs)
                at_end()
                del output
        finally:
            for handle in handles:
                handle.remove()

    snapshots: list[dict] = []
    final: dict = {}
    # Storages are told apart by address. A child's input that nothing saves
    # (a norm's output, which a ReLU does not keep) is freed once the child
    # ran, and a later storage a child saves can take its address: the plan
    # would count that input as kept already, and its order would depend on
    # the allocator's state. An input whose storage is gone when the forward
    # ends (while every saved storage still lives) gets a key of its own.
    # Weak references, not the inputs themselves: holding them would add
    # their bytes to the profile's peak, on a model that is being fitted
    # because memory is short.
    inputs: list[tuple[_Child, weakref.ref]] = []

    with memory.track_activations(exclude=model) as meter:
        def seen() -> dict:
            return {storage.key: (storage.span_bytes, storage.saved_by) for storage in meter.storages()}

        def saves_before(record: _Child, arguments: tuple) -> None:
            first = next(_tensors_in(arguments), None)
            if first is not None:
                record.input_key, record.input_bytes = memory.storage_key(first), _span_bytes(first)
                inputs.append((record, weakref.ref(first.untyped_storage())))
            snapshots.append(seen())

        def saves_after(record: _Child, output: Any) -> None:
            before, now = snapshots.pop(), seen()
            for key, (span, count) in now.items():
                old_span, old_count = before.get(key, (0, 0))
                if count > old_count or span > old_span:
                    record.saves[key] = (max(span - old_span, 0), max(count - old_count, 0))
            record.output_elements = sum(value.numel() for value in _tensors_in(output))

        def at_end() -> None:
            final.update(seen())
            for number, (record, storage) in enumerate(inputs):
                if storage() is None:
                    record.input_key = ("freed input", number)

        forward_with(saves_before, saves_after, at_end)
    storages = {}
    for key, (span, count) in final.items():
        owners = {(part, index) for part, records in enumerate(children)
                  for index, record in enumerate(records) if key in record.saves}
        growth = {owner: children[owner[0]][owner[1]].saves[key][0] for owner in owners}
        by_children = sum(children[part][index].saves[key][1] for part, index in owners)
        storages[key] = _Storage(span, owners, outside=count > by_children, growth=growth,
                                 outside_growth=max(span - sum(growth.values()), 0))
    if not flops:
        return _Profile(children, storages, 0)
    counter = FlopCounterMode(display=False)
    # Its global hooks make memory-efficient DenseNet layers call their
    # modules (same FLOPs) and warn once per process: keep that warning for
    # the user's own hooks.
    warned = set(densenet._WARNED)
    with counter, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        def flops_before(record: _Child, arguments: tuple) -> None:
            record.flops -= counter.get_total_flops()

        def flops_after(record: _Child, output: Any) -> None:
            record.flops += counter.get_total_flops()

        forward_with(flops_before, flops_after)
    densenet._WARNED.intersection_update(warned)
    return _Profile(children, storages, counter.get_total_flops())


def _with_run(state: tuple[frozenset, ...], part: int, start: int, end: int) -> tuple[frozenset, ...]:
    """``state`` (checkpointed child indices per part) with children ``start``
    to ``end`` of ``part`` checkpointed too."""
    return state[:part] + (state[part] | frozenset(range(start, end)),) + state[part + 1:]


def _plan(profile: _Profile) -> list[tuple[int, int, int]]:
    """The checkpoint steps, in order: (part, start, end) runs of children to
    add. Each time, the run of at most one segment's length with the most
    predicted bytes saved per unit of recomputation (see ``_Child.cost``)
    given the steps before it, split into its first children where they
    save bytes alone; until no run saves anything. Depends on the
    model and the example input only, never on the budget, so the chain
    that fit walks is the same for every budget."""
    state = tuple(frozenset() for _ in profile.children)
    kept = profile.kept_bytes(state)
    moves = []
    while True:
        best, best_key = None, None
        for part, records in enumerate(profile.children):
            for start in range(len(records)):
                cost = 0
                for end in range(start + 1, profile.reach(part, start) + 1):
                    if end - 1 in state[part]:
                        break
                    cost += records[end - 1].cost
                    trial = _with_run(state, part, start, end)
                    gain = kept - profile.kept_bytes(trial)
                    if gain <= 0:
                        continue
                    # Ties: more bytes first, then the earlier run.
                    key = (gain / max(cost, 1), gain, -part, -start)
                    if best_key is None or key > best_key:
                        best, best_key = (part, start, end), key
        if best is None:
            return moves
        part, start, end = best
        # The run's first children alone, where they save bytes already: steps
        # to stop at, so the walk need not take the whole run to meet a budget.
        first = start
        for cut in range(start + 1, end + 1):
            trial = _with_run(state, part, first, cut)
            gain = kept - profile.kept_bytes(trial)
            if gain > 0 or cut == end:
                moves.append((part, first, cut))
                state, kept, first = trial, kept - gain, cut


# The undo steps fit leaves on the model are objects, not closures: a
# deepcopy of a fitted model then reverts its own modules (a closure would
# still point at the original's), and torch.save can pickle the model.
@dataclass
class _RestoreSegments:
    part: nn.Module
    previous_class: type
    previous: Optional[list]

    def __call__(self) -> None:
        self.part.__class__ = self.previous_class
        self.part.__dict__.pop("_fit_lean", None)
        if self.previous is None:
            del self.part._fit_segments
        else:
            self.part._fit_segments = self.previous


@dataclass
class _MemoryEfficientOff:
    modules: list
    timm_modules: list = field(default_factory=list)  # swapped to effilayers' forwards: timm's class back

    def __call__(self) -> None:
        for module in self.modules:
            module.memory_efficient = False
        for module in self.timm_modules:
            timm_densenet.restore(module)


def _set_segments(part: nn.Sequential, segments: list[tuple[int, int]],
                  sequential: type = CheckpointedSequential) -> Callable[[], None]:
    """Make ``part`` checkpoint ``segments`` (a class swap to ``sequential``); returns what puts it back as it was."""
    restore = _RestoreSegments(part, type(part), part.__dict__.get("_fit_segments"))
    part.__class__ = sequential
    part._fit_segments = segments
    part.__dict__.pop("_fit_lean", None)
    return restore


def _memory_efficient_densenet(model: nn.Module) -> tuple[list[str], Callable[[], None]]:
    switched = [(name, module) for name, module in model.named_modules()
                if isinstance(module, (densenet.DenseLayer, densenet.Transition, densenet.DenseNet))
                and not module.memory_efficient]
    for _, module in switched:
        module.memory_efficient = True
    # timm's DenseNet: the same forwards, by class swaps (what convert does to it)
    swapped = timm_densenet.memory_efficient_densenet(model)
    return [name for name, _ in switched + swapped], _MemoryEfficientOff(
        [module for _, module in switched], [module for _, module in swapped])


def fit(model: nn.Module, example_input: Union[torch.Tensor, tuple, dict], budget: Union[int, str, float], *,
        exact: bool = True, dry_run: bool = False, offload: bool = False) -> FitReport:
    """Make ``model`` keep at most ``budget`` activation bytes for backward, in place.

    Args:
        model: the model to change (in place; ``effilayers.revert(model)`` undoes it).
        example_input: the inputs of one training forward, on which the
            activation bytes are measured: a tensor, a tuple of tensors
            (``model(*example_input)``) or a dict of keyword arguments
            (``model(**example_input)``: input ids with an attention mask,
            ``use_cache``...).
        budget: bytes (int), a size string (``"2GiB"``, ``"500MB"``) or a float
            in (0, 1]: that fraction of the model's activation bytes now.
        exact: keep the model's function: skip in-place ABN where it would
            turn ReLU into leaky_relu. ``False`` allows it.
        dry_run: plan and measure on a deep copy of the model (a second copy
            of its parameters in memory) and return the report, leaving
            ``model`` as it is.
        offload: on a CUDA model, let the plan move the saved tensors of
            units whose compute hides the copy to pinned host memory
            (:func:`effilayers.checkpoint.offload_saved_tensors`; host bytes,
            which the budget does not count). Ignored on CPU, where it
            would save nothing.

    Returns a :class:`FitReport`; where the model kept no more than the
    budget already it changes nothing and its note says so. Raises
    ``ValueError`` naming the smallest reachable figure, and the report's
    notes (why no step could do more), when no step of the chain gets under
    ``budget``; the model's steps are then undone (with ``exact=False``, a
    conversion made on the way is reverted as :func:`effilayers.revert` does
    it: a ReLU comes back as the LeakyReLU(0.01) the fused norm computed).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fit: model must be a torch.nn.Module, got {type(model).__name__}")
    for name, flag in (("exact", exact), ("dry_run", dry_run), ("offload", offload)):
        if not isinstance(flag, bool):
            raise TypeError(f"fit: {name} must be a bool, got {type(flag).__name__}")
    if UNDO_ATTR in model.__dict__:
        raise ValueError("fit: model was already fitted; call effilayers.revert(model) first")
    call = _as_call(example_input)
    if dry_run:
        return fit(copy.deepcopy(model), example_input, budget, exact=exact, offload=offload)
    before = _measure(model, call)
    budget_bytes = parse_budget(budget, before)
    undo: list[Callable[[], None]] = []
    model.__dict__[UNDO_ATTR] = undo
    report = FitReport(budget_bytes, before, before, before, 0.0, 0)
    try:
        _walk_chain(model, call, budget_bytes, exact, report, undo, offload)
    except BaseException:
        _revert_fit(model, report)
        raise
    if report.measured_bytes > budget_bytes:
        smallest = report.measured_bytes
        _revert_fit(model, report)
        raise ValueError(f"fit: budget {budget_bytes} bytes is below the smallest reachable figure, {smallest} "
                         f"activation bytes ({smallest / max(before, 1):.3f}x of the {before} now)"
                         + ("; exact=False also allows in-place ABN with leaky_relu"
                            if any("exact=True" in note for note in report.notes) else "")
                         + "".join(f"\n  {note}" for note in report.notes))
    return report


def _revert_fit(model: nn.Module, report: FitReport) -> None:
    """Undo what this call did: its own steps, and the conversion when it made one."""
    for undo in reversed(model.__dict__.pop(UNDO_ATTR, [])):
        undo()
    if any(step.kind == "inplace_abn" for step in report.steps):
        revert(model)


def _left_alone_note(left_alone: list) -> str:
    """Why convert fused no pair, in its own words, each reason once."""
    if not left_alone:
        return "inplace_abn: no BatchNorm + activation pair to convert"
    reasons: dict[str, list[str]] = {}
    for entry in left_alone:
        reasons.setdefault(entry.reason, []).append(entry.path or "(root)")
    return "inplace_abn: convert fused no norm: " + "; ".join(
        f"{paths[0]}{f' and {len(paths) - 1} more' if len(paths) > 1 else ''}: {reason}"
        for reason, paths in reasons.items())


def _walk_chain(model: nn.Module, call: _Call, budget_bytes: int, exact: bool, report: FitReport,
                undo: list, offload: bool = False) -> None:
    """Apply the chain's steps until one measures within the budget (see the module docstring)."""
    def done() -> bool:
        return report.measured_bytes <= budget_bytes

    def record(step: FitStep) -> None:
        report.steps.append(step)
        report.predicted_bytes = step.predicted_bytes
        if step.measured_bytes is not None:
            report.measured_bytes = step.measured_bytes
        report.extra_compute += step.extra_compute

    if done():
        report.notes.append(f"nothing to do: the model keeps {report.before_bytes} activation bytes, within the "
                            f"budget of {budget_bytes}; it is unchanged")
        return
    if not _offload_available(call):
        report.notes.append("offload not offered: on CPU it saves nothing (the tensors are host memory already)")
    elif not offload:
        report.notes.append("offload not allowed: pass offload=True to let the plan move the saved tensors of units "
                            "whose compute hides the copy to pinned host memory")
    trial = copy.deepcopy(model)
    trial.__dict__.pop(UNDO_ATTR, None)
    trial_report = convert(trial, "inplace")
    if not trial_report.fused:
        report.notes.append(_left_alone_note(trial_report.left_alone))
    elif exact and trial_report.function_changed:
        report.notes.append("inplace_abn skipped: it would turn ReLU into leaky_relu (exact=True; pass exact=False "
                            "to allow it)")
    else:
        predicted = _measure(trial, call)
        del trial
        if predicted < report.measured_bytes:
            conversion = convert(model, "inplace")
            record(FitStep("inplace_abn", "model", f"{len(conversion.fused)} norm + activation pairs fused",
                           predicted, _measure(model, call)))
    if done():
        return
    switched, undo_switch = _memory_efficient_densenet(model)
    if switched:
        undo.append(undo_switch)
        measured = _measure(model, call)
        # The recomputing Function reproduces the plain path's bytes minus the
        # concatenations and norm outputs it drops; measured, there is no
        # separate per-layer prediction.
        record(FitStep("densenet_memory_efficient", "model", f"{len(switched)} DenseNet modules recompute "
                       "cat + norm + ReLU in backward", measured, measured))
        report.notes.append("densenet_memory_efficient: its recomputation is elementwise (cat, norm, ReLU), so "
                            "extra_compute, which counts convolution and matmul FLOPs, counts none of it; it "
                            "takes time all the same")
    if done():
        return
    parts = _checkpoint_parts(model)
    parts += _chain_parts(model, call, parts)
    if not parts:
        report.notes.append("checkpoint: no unit to checkpoint (no nn.Sequential with two or more children, no "
                            "member of an nn.ModuleList or nn.ModuleDict, no block class with two or more "
                            "instances)")
    else:
        _checkpoint_chain(model, call, parts, report, undo, record, done, offload)


def _checkpoint_chain(model, call, parts, report, undo, record, done, offload=False) -> None:
    """The chain's unit and checkpoint steps, in order, until the measured
    bytes are within the budget: with ``offload``, units whose saved tensors
    the compute hides on their way to host memory (``_offload_plan``); then
    units made selective (``_selective_plan``); then whole checkpoints of
    units and runs of children in the plan's order (``_plan``), a selective
    unit's taking it from selective to whole. A step is measured unless the
    profile's lower bound on its bytes (``_Profile.lower_bound``, counting
    offloaded and selective units as checkpointed: they keep no more than a
    checkpointed unit keeps at least) is above the budget already: such a
    step cannot be the first within the budget, so the walk stops where
    measuring every step would stop. The last step is always measured: its
    bytes are the smallest reachable figure."""
    profile = _profile(model, call, parts)
    units = [index for index, part in enumerate(parts) if part.unit]
    kept_by = {index: sum(span for span, _ in profile.children[index][0].saves.values()) for index in units}
    step_flops = 3 * max(profile.total_flops, 1)
    state = tuple(frozenset() for _ in parts)
    # The prediction counts what the parts' children and their inputs keep;
    # the measurement also counts what no prediction moves.
    offset = report.measured_bytes - profile.kept_bytes(state)
    modes = {index: "keep" for index in units}
    why: dict[int, str] = {}
    # Bytes that offloaded and selective units no longer keep, beside the profile's prediction.
    moved: dict[int, int] = {}

    def bound_state() -> tuple[frozenset, ...]:
        return tuple(indices | (frozenset({0}) if modes.get(index, "keep") != "keep" else frozenset())
                     for index, indices in enumerate(state))

    def step(kind: str, index: int, detail: str, extra: float, last: bool) -> None:
        measured = None
        if last or profile.lower_bound(bound_state()) <= report.budget_bytes:
            measured = _measure(model, call)
        predicted = offset + profile.kept_bytes(state) - sum(moved.values())
        record(FitStep(kind, parts[index].path, detail, predicted, measured, extra))

    if offload and units:
        chosen, unhidden = _offload_plan(model, call, parts, profile, units, kept_by)
        if unhidden:
            report.notes.append(unhidden)
        for index, reason in chosen:
            if done():
                break
            undo.append(_checkpoint_unit(parts[index].module, "offload"))
            modes[index], why[index], moved[index] = "offload", reason, kept_by[index]
            step("offload", index, reason, 0.0, last=False)
    selective = {} if done() else _selective_plan(model, call, parts, profile,
                                                  [index for index in units if modes[index] == "keep"], kept_by)
    moves = [move for move in _plan(profile) if modes.get(move[0], "keep") != "offload"]
    for index, plan in selective.items():
        full_cost = profile.children[index][0].cost
        cost, gain = plan.cost, plan.gain
        host = (f"; the host time of its {plan.ops} ops through torch's dispatch mode, forward and "
                f"recomputation, counts as {plan.host_flops} FLOPs at the measured forward rate"
                if plan.host_flops else "")
        if gain <= 0:
            why[index] = "selective recomputation saves nothing here (what it would drop is kept anyway)"
            continue
        if cost / gain > full_cost / max(kept_by[index], 1):
            why[index] = (f"selective skipped: {cost / gain:.3g} FLOPs per byte saved, more than recomputing it "
                          f"whole ({full_cost / max(kept_by[index], 1):.3g} FLOPs per byte){host}")
            continue
        if done():
            break
        undo.append(_checkpoint_unit(parts[index].module, "selective"))
        modes[index], moved[index] = "selective", gain
        why[index] = (f"keeps its {plan.kept_outputs} matmul/attention outputs and recomputes the rest "
                      f"(norms, activations, dropout, elementwise): saves {gain} bytes for ~{plan.elements} element "
                      "ops" + (f" and {plan.flops} FLOPs of attention that draws dropout (a kept output would skip "
                               "its draw)" if plan.flops else "")
                      + f"{host}, {cost / max(full_cost, 1):.1%} of recomputing it whole")
        step("selective", index, why[index], cost / step_flops, last=False)
    for number, (index, start, end) in enumerate(moves, 1):
        if done():
            break
        part = parts[index]
        state = _with_run(state, index, start, end)
        segments = profile.segments(index, state[index])
        if part.unit:
            if modes[index] == "selective":
                why[index] = (f"selective left {kept_by[index] - moved[index]} of its {kept_by[index]} bytes; "
                              f"recomputing it whole keeps only its input, for {profile.children[index][0].flops} "
                              "FLOPs")
            else:
                why[index] = (f"recomputed whole for {profile.children[index][0].flops} FLOPs, keeping only its "
                              "input" + (f" ({why[index]})" if index in why else ""))
            modes[index] = "full"
            moved.pop(index, None)
            undo.append(_checkpoint_unit(part.module, "full"))
            detail = f"{getattr(type(part.module), _PLAIN_CLASS_ATTR).__name__} checkpointed whole"
        else:
            undo.append(_set_chain_segments(part, segments) if part.chain else _set_segments(part.module, segments))
            children = part.name(start) if end - start == 1 else f"{part.name(start)}..{part.name(end - 1)}"
            detail = f"{children} checkpointed; segments now {segments}"
        flops = sum(child.flops for child in profile.children[index][start:end])
        step("checkpoint", index, detail, flops / step_flops, last=number == len(moves))
    if "selective" in modes.values():
        report.notes.append("selective units allow one backward per forward (torch's selective checkpoint frees "
                            "its cache in the first): a backward with retain_graph=True through them fails the "
                            "second time")
    if report.steps and report.steps[-1].measured_bytes is None:
        # The chain ended on an unmeasured step: its bytes are the smallest reachable figure.
        last = dataclasses.replace(report.steps[-1], measured_bytes=_measure(model, call))
        report.steps[-1] = last
        report.measured_bytes = last.measured_bytes
    if not report.steps:
        paths = [part.path or "(root)" for part in parts]
        report.notes.append(f"checkpoint: no run of the units found ({', '.join(paths[:4])}"
                            f"{f' and {len(paths) - 4} more' if len(paths) > 4 else ''}) saves bytes: what they "
                            "save is kept all the same, as a checkpoint's input or by the code around them")
    for index in units:
        reason = why.get(index, "")
        if modes[index] == "keep":
            reason = "kept: the budget was met before its step" + (f"; {reason}" if reason else "")
        report.units.append(UnitChoice(parts[index].path, modes[index], reason))
    report.recompute_bytes = profile.largest_segment_bytes(state)


class _Selective(NamedTuple):
    """What making one unit selective saves and costs (``_selective_plan``)."""

    gain: int  # bytes saved
    elements: int  # element ops recomputed, one FLOP each
    flops: int  # FLOPs of expensive ops recomputed (attention that draws dropout)
    kept_outputs: int
    ops: int  # ops its forward sent through torch's dispatch mode
    host_flops: int  # the host time of those ops, twice, in FLOPs at the forward's rate (CUDA only)

    @property
    def cost(self) -> int:
        return self.elements + self.flops + self.host_flops


def _selective_plan(model: nn.Module, call: _Call, parts: list[_Part], profile: _Profile, units: list[int],
                    kept_by: dict[int, int]) -> dict[int, _Selective]:
    """Per unit in ``units``, in the order the chain makes them selective
    (most bytes saved per unit of cost first, then module order), what it
    saves and costs, from one profiled forward with every one of them
    selective: what each saved there (its input and the outputs its
    checkpoint cached, both counted by the meter) against what it saved
    plain. On a CUDA model also the host time torch's selective checkpoint
    adds, a timed forward with every one of them selective against a plain
    one: split among the units by their ops, and counted twice (the
    recomputation sends the ops through the dispatch mode again)."""
    if not units:
        return {}
    device = _cuda_device(call)
    undo = [_checkpoint_unit(parts[index].module, "selective") for index in units]
    try:
        for index in units:
            _LAST_POLICY.pop(parts[index].module, None)
        selective = _profile(model, call, parts, flops=False)
        # A unit the forward never called (an unused ModuleDict member) has no policy: it saves nothing.
        policies = {index: _LAST_POLICY.get(parts[index].module, KeepExpensive()) for index in units}
        selective_seconds = _forward_seconds(model, call, device) if device is not None else 0.0
    finally:
        for restore in reversed(undo):
            restore()
    host_flops_per_op = 0.0
    if device is not None:
        plain_seconds = _forward_seconds(model, call, device)
        ops = max(sum(policy.ops for policy in policies.values()), 1)
        host_flops_per_op = (2 * max(selective_seconds - plain_seconds, 0.0) / ops
                             * max(profile.total_flops, 1) / plain_seconds)
    found = {}
    for index in units:
        kept = sum(span for span, _ in selective.children[index][0].saves.values())
        policy = policies[index]
        found[index] = _Selective(kept_by[index] - kept, policy.recomputed_elements, policy.recomputed_flops,
                                  policy.kept_outputs, policy.ops, round(host_flops_per_op * policy.ops))
    order = sorted(found, key=lambda index: (-found[index].gain / max(found[index].cost, 1), index))
    return {index: found[index] for index in order}


_HOST_BANDWIDTH: dict = {}


def _cuda_device(call: _Call) -> Optional[torch.device]:
    return next((value.device for value in call.tensors if value.device.type == "cuda"), None)


def _offload_available(call: _Call) -> bool:
    return _cuda_device(call) is not None


def _forward_seconds(model: nn.Module, call: _Call, device: torch.device) -> float:
    """The model's forward on its CUDA device, in seconds: the faster of two
    timed calls after a warm one."""
    seconds = []
    for _ in range(3):
        with _Restored(model, call), torch.enable_grad():
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            output = model(*call.args, **call.kwargs)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - began)
            del output
    return min(seconds[1:])


def _device_rates(model: nn.Module, call: _Call, total_flops: int) -> tuple[float, float]:
    """(FLOPs per second of the model's forward, host copy bytes per second),
    measured on its CUDA device: a timed forward (:func:`_forward_seconds`),
    and a pinned copy of 64 MiB from the device, once per device and process."""
    device = _cuda_device(call)
    if device not in _HOST_BANDWIDTH:
        source = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        for _ in range(3):
            host.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        _HOST_BANDWIDTH[device] = 3 * source.numel() / (time.perf_counter() - began)
    return max(total_flops, 1) / _forward_seconds(model, call, device), _HOST_BANDWIDTH[device]


def offload_hides(saved_bytes: int, flops: int, flops_per_second: float, bytes_per_second: float) -> bool:
    """Whether a unit's ``saved_bytes`` reach host memory in no more time
    than its own ``flops`` take to compute: the copy of a unit's tensors runs
    beside the compute of the units after it, and the way back beside the
    backward of the unit after it, which costs about twice the forward."""
    return saved_bytes / bytes_per_second <= flops / flops_per_second


def _offload_plan(model: nn.Module, call: _Call, parts: list[_Part], profile: _Profile, units: list[int],
                  kept_by: dict[int, int]) -> tuple[list[tuple[int, str]], str]:
    """The units to offload, most bytes first (then module order), with why:
    those whose transfer their compute hides (:func:`offload_hides`), on a
    CUDA model; and a note naming the units whose copy their compute would
    not hide ("" when none). The last unit in module order stays: its
    backward comes first, with nothing before it to hide its tensors' way
    back."""
    if not _offload_available(call):
        return [], ""
    flops_per_second, bytes_per_second = _device_rates(model, call, profile.total_flops)
    chosen, unhidden = [], []
    for index in units[:-1]:
        saved, flops = kept_by[index], profile.children[index][0].flops
        copy_ms, compute_ms = saved / bytes_per_second * 1e3, flops / flops_per_second * 1e3
        if saved > 0 and offload_hides(saved, flops, flops_per_second, bytes_per_second):
            chosen.append((index, f"its {saved} saved bytes cross to host in {copy_ms:.3g} ms at the measured "
                                  f"{bytes_per_second / 1e9:.3g} GB/s, within its {compute_ms:.3g} ms of forward "
                                  "compute"))
        elif saved > 0:
            unhidden.append(f"{parts[index].path} ({copy_ms:.3g} ms against {compute_ms:.3g} ms)")
    note = ""
    if unhidden:
        note = (f"offload: {len(unhidden)} unit(s) not offloaded, their copy to host at the measured "
                f"{bytes_per_second / 1e9:.3g} GB/s taking longer than their forward compute: "
                + ", ".join(unhidden))
    return sorted(chosen, key=lambda item: (-kept_by[item[0]], item[0])), note


def checkpoint_runs_to(model: nn.Module, example_input: Union[torch.Tensor, tuple, dict], target_bytes: int,
                       first: Optional[dict[str, list[tuple[int, int]]]] = None,
                       sequential: type = CheckpointedSequential,
                       unit: Optional[Callable[[nn.Module], Callable[[], None]]] = None,
                       ) -> tuple[dict[str, list[tuple[int, int]]], int]:
    """The checkpoint segments, per path of the model's parts (the ones
    ``fit`` finds: plain sequential parts and units), with which ``model``
    keeps at most ``target_bytes`` activation bytes: the segments in
    ``first`` (e.g. a fitted model's ``_fit_segments``, and ``[(0, 1)]`` for
    each unit it recomputes whole), then whole checkpoints of units and runs
    of children in ``fit``'s own order (``_plan`` on a profile of ``model``
    as it is) until the measured bytes are within the target; a step is
    measured only where its lower bound could be. While measured, parts run
    as ``sequential`` (a :class:`CheckpointedSequential` whose
    ``_checkpoint_segment`` may call another checkpoint) and each unit
    checkpointed whole by ``unit(module)``, which returns what puts it back
    (fit's own class swap when None); ``model`` is left as it was. Returns
    ``(segments, measured bytes)``, a unit's segments ``[(0, 1)]``: bytes
    above the target are the least every run reached."""
    call = _as_call(example_input)
    parts = _checkpoint_parts(model)
    paths = [part.path for part in parts]
    unknown = sorted(set(first or ()) - set(paths))
    if unknown:
        raise ValueError(f"checkpoint_runs_to: {', '.join(unknown)} is not a part fit checkpoints, a plain "
                         f"nn.Sequential or a unit (parts: {', '.join(paths) or 'none'})")
    for part in parts:
        runs = (first or {}).get(part.path, ())
        if any(not 0 <= start < end <= len(part.members) for start, end in runs):
            raise ValueError(f"checkpoint_runs_to: first[{part.path!r}] = {runs} has a run outside its "
                             f"{len(part.members)} member(s); each run is (start, end) with "
                             f"0 <= start < end <= {len(part.members)}" + (", [(0, 1)] for a unit" if part.unit
                                                                           else ""))
    state = tuple(frozenset(index for start, end in (first or {}).get(path, ()) for index in range(start, end))
                  for path in paths)
    profile = _profile(model, call, parts)
    checkpoint_unit = unit or _checkpoint_unit

    def measure(state: tuple[frozenset, ...]) -> int:
        undo = [checkpoint_unit(part.module) if part.unit
                else _set_segments(part.module, profile.segments(index, state[index]), sequential)
                for index, part in enumerate(parts) if state[index]]
        try:
            return _measure(model, call)
        finally:
            for restore in reversed(undo):
                restore()

    measured, measured_state = measure(state), state
    for part, start, end in _plan(profile):
        if measured <= target_bytes:
            break
        grown = _with_run(state, part, start, end)
        if grown == state:
            continue
        state = grown
        if profile.lower_bound(state) <= target_bytes:
            measured, measured_state = measure(state), state
    if measured_state != state:
        # The whole plan, none of it within the lower bound: what it reaches.
        measured, measured_state = measure(state), state
    segments = {path: profile.segments(index, state[index]) for index, path in enumerate(paths) if state[index]}
    return segments, measured
