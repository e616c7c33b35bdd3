"""Activation checkpointing that keeps BatchNorm's running statistics right.

``checkpoint`` and ``checkpoint_sequential`` take the arguments of
``torch.utils.checkpoint``'s functions of the same names and run on torch's
non-reentrant checkpoint, with two differences:

* **Running statistics move once per forward.** Torch's checkpoint runs a
  segment's forward again in backward, so every BatchNorm in training mode
  inside it updates ``running_mean``, ``running_var`` and
  ``num_batches_tracked`` twice per step (with ``momentum=None`` the
  cumulative average then counts each batch twice). Here the recomputation
  runs on copies of the running statistics, so the real ones end where the
  plain model leaves them, and a norm also used outside the segment keeps
  the buffers its other graph saved unchanged. The normalisation itself needs no help: in training it
  uses the batch's statistics, which the recomputation reproduces from the
  same input. This covers every module with buffers named ``running_mean``,
  ``running_var`` or ``num_batches_tracked`` that the checkpointed function
  can reach: torch's ``_BatchNorm`` family (``SyncBatchNorm`` included),
  ``InstanceNorm`` with ``track_running_stats``, effilayers' ``ABN``,
  ``InPlaceABN``, ``InPlaceABNSync`` and the DenseNet bottleneck's
  ``norm1``. "Reach" means: the function itself when it is a module, the
  module of a bound method, the parts of a ``functools.partial``, the
  modules a function (a lambda, a nested function) refers to through its
  closure or as globals, and modules passed as arguments; ``checkpoint_sequential`` looks at each function of a
  segment. Running statistics updated some other way (a functional call on
  tensors the closure does not show) are not protected.
* **In-place layers at a segment's start work.** A segment whose first layer
  writes over its input (``InPlaceABN``, ``nn.ReLU(inplace=True)``) would
  destroy the input the recomputation starts from; torch's checkpoint then
  stops in backward with "modified by an inplace operation". Here the
  function receives a copy of each tensor argument (parameters excepted),
  so the saved input stays intact. The copy lives only while the segment's
  first layers use it; it is never kept for backward.

Dropout and other random ops replay the forward's draws as in torch
(``preserve_rng_state=True``). ``use_reentrant`` may only be ``None`` or
``False``. ``segments="sqrt"`` in ``checkpoint_sequential`` picks
``ceil(sqrt(len(functions)))`` segments, the sublinear-memory choice of Chen
et al. (2016, memonger): about ``2 sqrt(N)`` layers' activations are alive
at once instead of ``N``.

Under ``torch.compile`` the recomputation is the compiler's (the graph's
buffer updates run once), so the compiled path calls torch's checkpoint
with your ``context_fn`` and only the input copy added.

``recompute_in_backward(modules, input)`` is the leaner form ``effilayers.fit``
runs its segments with (a run of modules, one tensor in and out): the
forward runs without building a graph and keeps only the input, and the
backward recomputes the run with gradients and hands autograd the
gradients of the input and of the modules' parameters (so
``torch.autograd.grad`` and double backward work, unlike torch's reentrant
checkpoint). It skips what torch's non-reentrant checkpoint pays per saved
tensor in forward and recomputation (a hook call and a holder each, and
the check of every recomputed tensor's metadata), which on a CPU at small
batches is a visible share of a ResNet block's time. The recomputation
runs on copies of the running statistics, so the real buffers are written
once, by the forward. It is correct only where the run reads no tensor but
its input, its modules' parameters and buffers and what it makes from them;
``lean_segment_ok`` checks that once on a probe forward, and fit falls back
to ``checkpoint`` where it fails. Each call also falls back while a module
of the run has a forward hook (it could keep an inner output, which would
have no graph), a parameter has a hook (``torch.autograd.grad`` would run it
a second time) or a parameter is not a plain tensor (FSDP2's DTensors). A
module that registers a tensor hook inside its own forward fails there
("cannot register a hook on a tensor that doesn't require gradient"), as
under torch's reentrant checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import checkpoint as torch_checkpoint

from . import memory

__all__ = ["checkpoint", "checkpoint_sequential", "sqrt_segments", "recompute_in_backward", "lean_segment_ok",
           "selective_contexts", "keep_expensive", "KeepExpensive", "EXPENSIVE_OPS", "offload_saved_tensors"]

_RUNNING_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
# The keywords checkpoint_sequential passes on to checkpoint (torch's own
# checkpoint_sequential takes only preserve_rng_state).
_SEQUENTIAL_KEYWORDS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


def _modules_reached(objects: Iterable[Any]) -> list[nn.Module]:
    """The modules a checkpointed function can call: see the module docstring."""
    found: dict[int, nn.Module] = {}

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, nn.Module):
            found.setdefault(id(obj), obj)
            return
        # Two levels: a lambda over a list of modules, a partial of a method.
        if depth > 2:
            return
        if isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
        elif callable(obj):
            owner = getattr(obj, "__self__", None)
            if owner is not None:
                visit(owner, depth + 1)
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    contents = cell.cell_contents
                except ValueError:  # a cell not yet filled
                    continue
                visit(contents, depth + 1)
            # A lambda at a script's top level reads the model as a global.
            code, names = getattr(obj, "__code__", None), getattr(obj, "__globals__", None)
            if code is not None and isinstance(names, dict):
                for name in code.co_names:
                    if isinstance(names.get(name), nn.Module):
                        visit(names[name], depth + 1)

    for obj in objects:
        visit(obj, 0)
    return list(found.values())


def _module_tensors(modules: Iterable[nn.Module]) -> tuple[list[nn.Parameter], list[tuple[nn.Module, str]], bool]:
    """In one walk of ``modules`` and their submodules: their parameters and
    their running-statistics buffers (as (module, name) slots), each once
    (two modules may share one), and whether a forward hook, a hook on a
    parameter or a parameter that is not a plain tensor (a DTensor under
    FSDP2) rules out :func:`recompute_in_backward`'s lean path."""
    parameters: dict[int, nn.Parameter] = {}
    slots: dict[int, tuple[nn.Module, str]] = {}
    hooked = False
    for top in modules:
        for module in top.modules():
            hooked = hooked or bool(module._forward_hooks or module._forward_pre_hooks)
            for parameter in module._parameters.values():
                if parameter is not None:
                    parameters.setdefault(id(parameter), parameter)
                    hooked = hooked or bool(parameter._backward_hooks) or type(parameter.data) is not torch.Tensor
            for name in _RUNNING_BUFFERS:
                buffer = module._buffers.get(name)
                if buffer is not None:
                    slots.setdefault(id(buffer), (module, name))
    return list(parameters.values()), list(slots.values()), hooked


def _running_slots(objects: Iterable[Any]) -> list[tuple[nn.Module, str]]:
    return _module_tensors(_modules_reached(objects))[1]


class _ScratchRunningStatistics:
    """Recomputation context: the modules read and write copies of their
    running statistics inside, so the real buffers keep the values the
    forward left and their version counters, which a graph that saved them
    checks (a norm also used outside the recomputed run, a double
    backward). The originals come back on the way out, also when torch
    stops the recomputation early (it raises through this context).
    Reusable: a backward with ``retain_graph=True`` and a second one
    recompute twice."""

    def __init__(self, slots: list[tuple[nn.Module, str]]) -> None:
        self.slots = slots
        self.originals: list[torch.Tensor] = []

    def __enter__(self) -> "_ScratchRunningStatistics":
        self.originals = [module._buffers[name] for module, name in self.slots]
        for (module, name), buffer in zip(self.slots, self.originals):
            module._buffers[name] = buffer.clone()
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        for (module, name), buffer in zip(self.slots, self.originals):
            module._buffers[name] = buffer
        self.originals = []
        return False


class _Recompute:
    """The recomputation's context: the running statistics kept around the
    caller's own recompute context. Reusable, like torch's contexts: a
    backward with ``retain_graph=True`` and a second one recompute twice."""

    def __init__(self, keep: _ScratchRunningStatistics, context: ContextManager) -> None:
        self.keep, self.context = keep, context
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        self.stack = contextlib.ExitStack()
        with self.stack:
            self.stack.enter_context(self.keep)
            self.stack.enter_context(self.context)
            self.stack = self.stack.pop_all()

    def __exit__(self, *exc_info: Any) -> bool:
        return self.stack.__exit__(*exc_info)


def _fresh(value: Any) -> Any:
    # A copy the function may overwrite: the checkpoint keeps the original
    # for the recomputation. Parameters are read, never written.
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return value.clone()
    return value


def _on_copies(function: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        return function(*(_fresh(arg) for arg in args), **kwargs)

    return run


def _check_use_reentrant(use_reentrant: Any, owner: str) -> None:
    if use_reentrant is None or use_reentrant is False:
        return
    if use_reentrant is True:
        raise ValueError(f"{owner}: use_reentrant=True is not supported; effilayers' checkpoint is built on torch's "
                         "non-reentrant checkpoint (leave use_reentrant out or pass False), or call "
                         "torch.utils.checkpoint directly")
    raise TypeError(f"{owner}: use_reentrant must be None or False, got {use_reentrant!r}")


def _checkpoint(function: Callable, args: tuple, kwargs: dict, reached: Iterable[Any], *,
                use_reentrant: Any, context_fn: Callable, determinism_check: str, debug: bool,
                early_stop: bool, preserve_rng_state: bool, owner: str) -> Any:
    _check_use_reentrant(use_reentrant, owner)
    if not callable(function):
        raise TypeError(f"{owner}: function must be callable, got {type(function).__name__}")
    if not callable(context_fn):
        raise TypeError(f"{owner}: context_fn must be callable, got {type(context_fn).__name__}")
    settings = dict(use_reentrant=False, determinism_check=determinism_check, debug=debug, early_stop=early_stop,
                    preserve_rng_state=preserve_rng_state)
    run = _on_copies(function)
    # Compiled: the compiler recomputes from its graph, where the buffer
    # updates happen once, and it accepts only dispatch-mode contexts.
    slots = [] if torch.compiler.is_compiling() else _running_slots(reached)
    if not slots:
        if context_fn is not torch_checkpoint.noop_context_fn:
            settings["context_fn"] = context_fn
        # Passed on only when given: dynamo's checkpoint accepts no other
        # context_fn than a selective-checkpoint policy's.
        return torch_checkpoint.checkpoint(run, *args, **settings, **kwargs)
    if debug:
        raise ValueError(f"{owner}: debug=True cannot be combined with the running-statistics bookkeeping (torch's "
                         "debug mode replaces the recomputation context); debug with torch.utils.checkpoint")

    def contexts() -> tuple[ContextManager, ContextManager]:
        forward_context, recompute_context = context_fn()
        return forward_context, _Recompute(_ScratchRunningStatistics(slots), recompute_context)

    return torch_checkpoint.checkpoint(run, *args, context_fn=contexts, **settings, **kwargs)


def checkpoint(function: Callable, *args: Any, use_reentrant: bool | None = None,
               context_fn: Callable[[], tuple[ContextManager, ContextManager]] = torch_checkpoint.noop_context_fn,
               determinism_check: str = torch_checkpoint._DEFAULT_DETERMINISM_MODE, debug: bool = False,
               early_stop: bool = True, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in
    backward, as ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
    with running statistics updated once and the tensor arguments copied for
    the function (see :mod:`effilayers.checkpoint`)."""
    return _checkpoint(function, args, kwargs, (function, args, kwargs), use_reentrant=use_reentrant,
                       context_fn=context_fn, determinism_check=determinism_check, debug=debug,
                       early_stop=early_stop, preserve_rng_state=preserve_rng_state, owner="checkpoint")


def sqrt_segments(count: int) -> int:
    """``ceil(sqrt(count))``: the number of segments ``segments="sqrt"`` picks for ``count`` functions."""
    return math.isqrt(count - 1) + 1 if count > 0 else 0


def _functions_list(functions: Any) -> list[Callable]:
    if isinstance(functions, nn.Sequential):
        return list(functions.children())
    if isinstance(functions, nn.Module) or not isinstance(functions, Sequence) or isinstance(functions, str):
        raise TypeError("checkpoint_sequential: functions must be an nn.Sequential or a list or tuple of callables, "
                        f"got {type(functions).__name__}")
    for index, function in enumerate(functions):
        if not callable(function):
            raise TypeError(f"checkpoint_sequential: functions[{index}] is not callable "
                            f"({type(function).__name__})")
    return list(functions)


def _segment_count(segments: Union[int, str], count: int) -> int:
    if isinstance(segments, str):
        if segments != "sqrt":
            raise ValueError(f"checkpoint_sequential: segments must be a positive int or 'sqrt', got {segments!r}")
        return sqrt_segments(count)
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError("checkpoint_sequential: segments must be a positive int or 'sqrt', "
                        f"got {type(segments).__name__}")
    if segments < 1:
        raise ValueError(f"checkpoint_sequential: segments must be a positive int or 'sqrt', got {segments}")
    if segments > count:
        # torch raises ValueError here too (a zero step in range()).
        raise ValueError(f"checkpoint_sequential: segments={segments} is more than the {count} functions; "
                         "each segment needs at least one")
    return segments


def checkpoint_sequential(functions: Union[nn.Sequential, Sequence[Callable]], segments: Union[int, str],
                          input: Any, use_reentrant: bool | None = None, **kwargs: Any) -> Any:
    """Run ``functions`` in order on ``input``, checkpointing every segment
    but the last, split as ``torch.utils.checkpoint.checkpoint_sequential``
    splits them (``len(functions) // segments`` functions per checkpointed
    segment, the rest in the last). ``segments``: a positive int, or
    ``"sqrt"`` for ``ceil(sqrt(len(functions)))``. ``kwargs``: torch's
    ``preserve_rng_state``, and :func:`checkpoint`'s ``context_fn``,
    ``determinism_check``, ``debug``, ``early_stop``."""
    functions = _functions_list(functions)
    if not functions:
        raise ValueError("checkpoint_sequential: functions is empty")
    count = _segment_count(segments, len(functions))
    _check_use_reentrant(use_reentrant, "checkpoint_sequential")
    unexpected = [name for name in kwargs if name not in _SEQUENTIAL_KEYWORDS]
    if unexpected:
        raise ValueError(f"checkpoint_sequential: unexpected keyword arguments: {', '.join(unexpected)} "
                         f"(accepted: use_reentrant, {', '.join(_SEQUENTIAL_KEYWORDS)})")
    settings = dict(context_fn=torch_checkpoint.noop_context_fn,
                    determinism_check=torch_checkpoint._DEFAULT_DETERMINISM_MODE, debug=False, early_stop=True,
                    preserve_rng_state=True)
    settings.update(kwargs)

    def run_segment(segment: list[Callable]) -> Callable:
        def forward(value: Any) -> Any:
            for function in segment:
                value = function(value)
            return value

        return forward

    size = len(functions) // count
    end = 0
    for start in range(0, size * (count - 1), size):
        end = start + size
        segment = functions[start:end]
        input = _checkpoint(run_segment(segment), (input,), {}, segment, use_reentrant=False,
                            owner="checkpoint_sequential", **settings)
    return run_segment(functions[end:])(input)


def _run_modules(modules: Sequence[nn.Module], value: torch.Tensor) -> Any:
    for module in modules:
        value = module(value)
    return value


class _Replay:
    """The random-number and autocast state a segment's forward ran under, put back for its recomputation."""

    __slots__ = ("cpu_rng", "cuda_rng", "autocast", "autocast_cache")

    def __init__(self, input: torch.Tensor) -> None:
        self.cpu_rng = torch.get_rng_state()
        index = input.device.index if input.device.index is not None else 0
        self.cuda_rng = [(index, torch.cuda.get_rng_state(index))] if input.is_cuda else []
        # Backward runs outside the caller's autocast block; the recomputation
        # must cast as the forward did or it saves tensors of other dtypes.
        self.autocast = [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                         for kind in dict.fromkeys(("cpu", input.device.type))]
        self.autocast_cache = torch.is_autocast_cache_enabled()

    @contextlib.contextmanager
    def replayed(self):
        with torch.random.fork_rng(devices=[index for index, _ in self.cuda_rng]), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            for index, state in self.cuda_rng:
                torch.cuda.set_rng_state(state, index)
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            yield


class _RecomputedSegment(torch.autograd.Function):
    """Inputs: (modules, running-statistics slots, _Replay, input, *parameters)."""

    @staticmethod
    def forward(ctx, modules, slots, replay, input, *parameters):  # type: ignore[override]
        ctx.modules, ctx.slots, ctx.replay, ctx.parameters = modules, slots, replay, parameters
        ctx.save_for_backward(input)
        # A copy, so a first module that writes in place leaves the saved input intact.
        output = _run_modules(modules, input.clone())
        # A view leaving a custom Function may not be written in place later
        # (a Flatten ending the segment, an in-place ReLU after it).
        return output.detach() if output._is_view() else output

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        (input,) = ctx.saved_tensors
        input_needed = ctx.needs_input_grad[3]
        wanted = [p for p, needed in zip(ctx.parameters, ctx.needs_input_grad[4:]) if needed]
        input_grad: Optional[torch.Tensor] = None
        grads: dict[int, Optional[torch.Tensor]] = {}
        if input_needed or wanted:
            # Grad mode is on here only for a backward with create_graph=True.
            create_graph = torch.is_grad_enabled()
            with _ScratchRunningStatistics(ctx.slots), ctx.replay.replayed(), torch.enable_grad():
                # For second derivatives the gradients must be functions of
                # the input itself, not of a detached copy.
                leaf = input if create_graph else input.detach().requires_grad_(input_needed)
                output = _run_modules(ctx.modules, leaf.clone())
            sources = ([leaf] if input_needed else []) + wanted
            if output.requires_grad:
                found = list(torch.autograd.grad(output, sources, grad_output, allow_unused=True,
                                                 create_graph=create_graph))
                if input_needed:
                    input_grad = found.pop(0)
                grads = {id(p): grad for p, grad in zip(wanted, found)}
                if create_graph and input_grad is not None and input.grad_fn is not None and wanted:
                    # From the real input, the parameters' gradients also took
                    # the paths through the input's history (a parameter used
                    # before the segment too), which autograd adds again when it
                    # passes the input's gradient on: take them out here.
                    upstream = torch.autograd.grad(input, wanted, input_grad, allow_unused=True, create_graph=True)
                    for p, extra in zip(wanted, upstream):
                        if extra is not None and grads[id(p)] is not None:
                            grads[id(p)] = grads[id(p)] - extra
        return (None, None, None, input_grad, *(grads.get(id(p)) for p in ctx.parameters))


def _global_module_hooks() -> bool:
    module = nn.modules.module
    return bool(getattr(module, "_global_forward_hooks", None) or getattr(module, "_global_forward_pre_hooks", None))


def recompute_in_backward(modules: Sequence[nn.Module], input: torch.Tensor) -> torch.Tensor:
    """``modules`` run in order on ``input``, keeping only ``input`` for
    backward and recomputing the run there (see the module docstring; call
    it only where :func:`lean_segment_ok` holds). Running statistics move
    once per forward, random ops and autocast replay the forward's. While a
    module of the run has a forward hook (it may keep an inner output that
    would have no graph), a parameter has a hook (``torch.autograd.grad``
    would run it once more) or is not a plain tensor, it runs through
    :func:`checkpoint` instead. A module that registers a tensor hook in its
    own forward cannot run here (the forward builds no graph)."""
    modules = tuple(modules)
    parameters, slots, hooked = _module_tensors(modules)
    if hooked or _global_module_hooks():
        return checkpoint(functools.partial(_run_modules, modules), input)
    return _RecomputedSegment.apply(modules, slots, _Replay(input), input, *parameters)


def _tensors_in(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


class _OutsideReads(TorchFunctionMode):
    """Notes whether a torch function reads a tensor that is none of
    ``known`` (the input, the modules' parameters and buffers) and was not
    made by an earlier function in the block."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known
        self.found = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(id(tensor) not in self.known for tensor in _tensors_in((args, kwargs))):
            self.found = True
        result = func(*args, **kwargs)
        self.known.update(id(tensor) for tensor in _tensors_in(result))
        return result


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # Never the tensor itself: a node that saves its own output (a ReLU)
    # would hold that output, whose grad_fn holds the node, a cycle through
    # C++ that Python's collector cannot see, and the whole graph would
    # outlive the call. Autograd rebuilds the unpacked tensor's history.
    return tensor.detach()


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def lean_segment_ok(modules: Sequence[nn.Module], input: Any) -> bool:
    """Whether :func:`recompute_in_backward` gives ``modules`` on ``input``
    the gradients autograd would: a plain tensor in and out, and on a probe
    forward the run reads no tensor but its input, its modules' parameters
    and buffers and what it made from them. A tensor read from elsewhere
    would get no gradient, now or once it requires one, so it rules the
    lean path out. The probe keeps nothing, moves no running statistics and
    draws no random numbers."""
    modules = tuple(modules)
    if type(input) is not torch.Tensor:
        return False
    parameters, slots, _ = _module_tensors(modules)
    known = {id(p) for p in parameters} | {id(buffer) for top in modules for buffer in top.buffers()}
    probe = input.detach().requires_grad_(input.is_floating_point() or input.is_complex()).clone()
    known.add(id(probe))
    reads = _OutsideReads(known)
    # _Replay forks the random state as a recomputation does, so the probe draws none.
    with _ScratchRunningStatistics(slots), _Replay(input).replayed(), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(_detached, _unchanged):
        # The scratch buffers are what the modules read now.
        reads.known |= {id(module._buffers[name]) for module, name in slots}
        with reads:
            output = _run_modules(modules, probe)
    return type(output) is torch.Tensor and not reads.found


# ---- selective recomputation: keep the expensive outputs, recompute the cheap ones ----------------

def _aten_packets(*names: str) -> frozenset:
    # Ops some torch builds lack (cuDNN attention) are left out, not an error.
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


# Matrix products, convolutions and attention: what costs FLOPs to recompute.
# Their outputs are kept; everything else (norms, activations, dropout,
# elementwise arithmetic, views) is recomputed from them in backward.
EXPENSIVE_OPS = _aten_packets(
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward", "_scaled_mm")


def _draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` consumes random numbers on this call. Attention ops
    are tagged as seeded whatever their dropout; one with ``dropout_p == 0``
    draws nothing."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            value = args[index] if index < len(args) else kwargs.get("dropout_p", 0.0)
            return bool(value)
    return True


def keep_expensive(context: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The selective-checkpoint policy of :func:`selective_contexts`: keep
    the outputs of :data:`EXPENSIVE_OPS`, recompute the rest.

    An expensive op that draws random numbers (attention with dropout) is
    recomputed too: torch's checkpoint replays the forward's random state
    before the recomputation, and the draws line up only when every op that
    drew in the forward draws again, in the same order; a kept op would skip
    its draw and shift every later dropout mask."""
    packet = getattr(func, "overloadpacket", None)
    if packet in EXPENSIVE_OPS and not _draws_random(func, args, kwargs):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed_flops(func: Any, args: tuple, kwargs: dict) -> int:
    """FLOPs of an expensive op that is recomputed (it draws random
    numbers): torch's FLOP formula where it has one, else, for attention
    (torch has none for the CPU kernel), two matrix products over the
    query, key and value: 4 * query elements * key length."""
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        try:
            return int(formula(*args, **kwargs))
        except Exception:  # a formula that needs the output's shape: fall through to the estimate
            pass
    query, key = (list(_tensors_in(args)) + [None, None])[:2]
    if query is None or key is None or key.dim() < 2:
        return 0
    return 4 * query.numel() * key.shape[-2]


class KeepExpensive:
    """:func:`keep_expensive` with a count of what it did in the forwards it
    saw: ``kept_outputs``; ``recomputed_elements``, the largest tensor
    argument of each recomputed op that is not a view: the elementwise work
    the recomputation repeats, an estimate in the units of one FLOP per
    element; and ``recomputed_flops``, the FLOPs of the expensive ops it
    recomputes all the same (attention that draws dropout). (Compiled code
    takes :func:`keep_expensive` itself: the compiler reads the policy as a
    constant.) ``ops``: every op the forwards asked it about, each of which
    torch's selective checkpoint sends through a Python dispatch mode, in
    the forward and again in the recomputation."""

    def __init__(self) -> None:
        self.recomputed_elements = 0
        self.recomputed_flops = 0
        self.kept_outputs = 0
        self.ops = 0

    def __call__(self, context: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        policy = keep_expensive(context, func, *args, **kwargs)
        if not context.is_recompute:
            self.ops += 1
            packet = getattr(func, "overloadpacket", None)
            if policy == torch_checkpoint.CheckpointPolicy.MUST_SAVE:
                self.kept_outputs += 1
            elif packet in EXPENSIVE_OPS:
                self.recomputed_flops += _recomputed_flops(func, args, kwargs)
            elif packet is not None and not func.is_view:
                self.recomputed_elements += max((value.numel() for value in _tensors_in((args, kwargs))), default=0)
        return policy


def _cached_tensors(storage: Any) -> Iterable[tuple[torch.Tensor, Any]]:
    """(tensor, holder) of each output a selective checkpoint cached: the
    holders (torch's version wrappers) live exactly as long as the cache
    keeps the tensor. The storage maps each op to a list (torch 2.11) or a
    dict (later) of entries, each an output tree of wrappers."""
    for entries in storage.values():
        for entry in entries.values() if isinstance(entries, dict) else entries:
            for holder in torch.utils._pytree.tree_leaves(entry):
                if isinstance(getattr(holder, "val", None), torch.Tensor):
                    yield holder.val, holder


class _CountCached:
    """A selective checkpoint's forward context that reports what its cache
    keeps to the active activation meter (:func:`effilayers.memory.count_kept`):
    the cache is torch's own storage, which ``saved_tensors_hooks`` never sees."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        self.mode.__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        result = self.mode.__exit__(*exc_info)
        for tensor, holder in _cached_tensors(self.mode.storage):
            memory.count_kept(tensor, holder)
        return result


def selective_contexts(policy: Optional[Callable] = None) -> tuple[ContextManager, ContextManager]:
    """A ``context_fn`` for :func:`checkpoint`: torch's selective activation
    checkpointing (``create_selective_checkpoint_contexts``) with ``policy``
    (default :class:`KeepExpensive`), its cached outputs counted by the
    activation meter in eager mode::

        checkpoint(block, x, context_fn=selective_contexts)
    """
    forward_context, recompute_context = torch_checkpoint.create_selective_checkpoint_contexts(
        KeepExpensive() if policy is None else policy)
    if torch.compiler.is_compiling():
        return forward_context, recompute_context
    return _CountCached(forward_context), recompute_context


# ---- activation offload: saved tensors to host memory and back ahead of backward ---------------

_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class _Kept:
    """A saved tensor an offload leaves where it is (a parameter, a small tensor)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Offloaded:
    """A saved tensor's host copy, and its way back."""

    __slots__ = ("host", "device", "copied", "back", "arrived", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied: Any) -> None:
        self.host, self.device, self.copied = host, device, copied
        self.back: Optional[torch.Tensor] = None
        self.arrived: Any = None


# The last group entered on this process: the group entered next links to it
# (weakly), to fetch it while its own backward runs.
_LAST_GROUP: list = [lambda: None]


class offload_saved_tensors:
    """Move the tensors autograd saves inside the block to host memory, and
    bring them back ahead of their backward::

        for block in blocks:
            with offload_saved_tensors():
                x = block(x)

    Each block's ``with`` is one group. On CUDA a saved tensor of at least
    ``min_bytes`` (parameters excepted) is copied into pinned host memory on
    a side stream, after the work that made it (the stream waits for the
    compute stream), and the device tensor is released to the allocator once
    that copy is done (``record_stream``), so the copy overlaps the compute
    that follows. In backward the first use of a group's tensor starts the
    copies back of the whole group (if not started) and of the group entered
    before it, on the side stream: the earlier block's tensors travel while
    this block's backward computes. The compute stream waits for a tensor's
    own copy only when it needs it.

    On CPU the path is the same without streams: a host copy (a clone) of
    each offloaded tensor is what backward reads. It exists to test the
    logic (which tensors go, when each group comes back, the gradients),
    not to save memory. ``log``, when given, receives ``("offload", index,
    tensors, bytes)`` as a group closes, and ``("fetch", index)`` /
    ``("use", index)`` as backward starts a group's copies back and first
    reads one of its tensors; ``index`` counts the linked groups from 0.

    What is kept and what is copied is reported to the activation meter
    (:func:`effilayers.memory.count_kept`): host copies as
    ``offloaded_bytes``, the rest as ``bytes``.
    """

    def __init__(self, min_bytes: int = 1 << 10, log: Optional[list] = None) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"offload_saved_tensors: min_bytes must be an int >= 0, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self.log = log
        self.held: list[_Offloaded] = []
        self.fetched = False
        self.used = False
        self.previous: Callable[[], Any] = lambda: None
        self.index = 0
        self.hooks: Any = None

    def __enter__(self) -> "offload_saved_tensors":
        previous = _LAST_GROUP[0]()
        if previous is not None and not previous.fetched:
            self.previous, self.index = weakref.ref(previous), previous.index + 1
        _LAST_GROUP[0] = weakref.ref(self)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.hooks.__exit__(*exc_info)
        # The hooks hold this group through their bound methods: dropped, the
        # group lives exactly as long as the graph keeps its tensors, so a
        # forward without backward frees its host copies at once and is
        # never fetched by the next forward's groups.
        self.hooks = None
        if self.log is not None:
            self.log.append(("offload", self.index, len(self.held),
                             sum(held.host.numel() * held.host.element_size() for held in self.held)))

    def _pack(self, tensor: torch.Tensor) -> Any:
        parameter = isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)
        if parameter or tensor.numel() * tensor.element_size() < self.min_bytes or tensor.device.type not in ("cuda",
                                                                                                           "cpu"):
            kept = _Kept(_detached(tensor))
            memory.count_kept(tensor, kept)
            return kept
        if tensor.device.type == "cuda":
            stream = _side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                copied = stream.record_event()
            # The allocator may hand the device memory out again only after the copy.
            tensor.record_stream(stream)
        else:
            host, copied = tensor.detach().clone(), None
        held = _Offloaded(host, tensor.device, copied)
        self.held.append(held)
        memory.count_kept(host, held, offloaded=True)
        return self, held

    def fetch(self) -> None:
        """Start the copies back of this group's tensors (once)."""
        if self.fetched:
            return
        self.fetched = True
        if self.log is not None:
            self.log.append(("fetch", self.index))
        for held in self.held:
            if held.device.type != "cuda":
                continue
            stream = _side_stream(held.device)
            with torch.cuda.stream(stream):
                held.back = held.host.to(held.device, non_blocking=True)
                held.arrived = stream.record_event()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        group, held = packed
        if not group.used:
            group.used = True
            group.fetch()
            previous = group.previous()
            if previous is not None:
                previous.fetch()
            if group.log is not None:
                group.log.append(("use", group.index))
        if held.device.type != "cuda":
            return held.host
        if held.back is None:  # a backward that reads it again (retain_graph)
            group.fetched = False
            group.fetch()
        compute = torch.cuda.current_stream(held.device)
        compute.wait_event(held.arrived)
        tensor = held.back
        tensor.record_stream(compute)
        return tensor
