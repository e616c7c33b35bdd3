"""``optimizer.state`` of the chunked optimizers and the :class:`ChunkStore`
that keeps it in step with the chunks.

State and parameters changed from outside
-----------------------------------------
``step()`` reads the chunks, not ``self.state``, so the optimizer keeps the
two consistent with what torch's optimizers would see:

* ``self.state`` is a ``defaultdict(dict)`` subclass that notes writes from
  outside: ``state[p] = {...}`` (what ``ZeroRedundancyOptimizer.
  load_state_dict`` does), ``del state[p]``, ``state[p][key] = value``, or a
  whole new mapping assigned to ``optimizer.state``. Before the next step
  (or ``state_dict()``) those entries are copied into the chunks: a new or
  deleted entry resets the parameter's state (step 0, zero moments, master
  from the parameter, as torch starts from an empty entry) and then imports
  what the entry holds (torch's layout, or this class's 8-bit payload;
  values that are views of the chunks themselves, such as
  ``dict(state[q])`` or one key swapped between two entries, are copied
  first). ``state.copy()`` is a plain ``defaultdict(dict)`` of
  the same entries.
* Entries hold views, so values edited in place take effect at the next
  step: ``state[p]["exp_avg"].mul_(0)``, ``exp_avg_sq``,
  ``max_exp_avg_sq``, ``master_param``, and with 8-bit states the raw
  ``*_codes`` / ``*_absmax`` ranges (the decoded tensors of
  ``state_dict()`` are copies: edit those and load them back). A step
  counter edited in place (``state[p]["step"].zero_()``) is seen through
  the counters' version counter: the next step re-reads the counters to
  regroup parameters by step count, one host read then, none otherwise.
  An entry fetched earlier stays the parameter's entry (the optimizer
  refills the same dict when it re-installs its views), so writes through
  it keep working after syncs and re-chunks.
* ``copy.deepcopy(optimizer)``, ``pickle`` and ``torch.save(optimizer)``
  keep ``self.state`` (torch's ``__getstate__``) plus this class's settings;
  the chunks are rebuilt from the entries at the next step, so a copy taken
  together with its model continues exactly. Pickles hold a compact copy of
  each entry (a pickled view would carry its whole chunk); ``deepcopy``
  copies each chunk once and keeps the entries views of the copy.
* The fp32 masters (and the CPU copy of offloaded parameters) are the
  optimizer's own copies of the parameters. The parameters' version
  counters (host-side ints) are recorded whenever the optimizer writes
  them; a parameter whose counter moved (``p.clamp_()``, ``p.copy_()``,
  ``model.load_state_dict()``, all under ``no_grad``) is copied into the
  copy before the next step and before anything syncs, exports
  (``state_dict()``, deepcopy, pickle) or re-chunks the state, so the
  update starts from the user's value as in torch. A master element whose
  rounding still equals the parameter keeps its extra bits. ``p.data = t``
  bypasses the version counter but moves the parameter's storage address,
  which each step compares for parameters with a gradient and every sync
  or export compares for all: the copy is re-seeded then (a ``t`` of
  another dtype, device or memory order re-chunks the states first, see
  below). In-place writes through ``p.data`` (``p.data.fill_()``) are not
  seen.
* A parameter whose dtype, device or memory order changed since its chunk
  was made (``model.to(torch.bfloat16)``, ``model.cuda()``,
  ``model.to(memory_format=torch.channels_last)``, all or some parameters;
  seen by its new storage address when it next has a gradient) makes that
  step (or a sync or export before it) move every state into chunks keyed
  by the new dtype and device, laid out in the parameters' new memory order
  (both copies exist for a moment); new fp32 masters are seeded from the
  parameters. A fp32 master carried over keeps its extra bits where the
  new parameter, rounded to the old parameter dtype, equals the old
  parameter (a conversion), and takes the new value elsewhere (new
  values assigned with ``p.data = t``). A dtype the optimizer does not
  support (complex) is a TypeError naming the parameter.
* ``param_groups`` edited after steps (a parameter removed from its
  group's list or moved to another group, a group popped or added): each
  step compares the groups' parameter ids with the last step's. When a
  parameter with a chunk is now in another group or in none, every state
  moves into chunks of the current groups (``ChunkStore.check_groups``); a
  parameter in no group keeps its entry (torch's layout) and is not
  updated, as in torch, until it rejoins a group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch

from ..ops.adam import PARAM_DTYPES, padded_numel
from .chunks import EIGHT_BIT, _Chunk, refuse_sparse
from .sharded import local

__all__ = ["ChunkStore", "_OptimizerState", "_ParamState", "_plain_state"]

# parameter dtypes that get an fp32 master (with master_weights=True)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Watched:
    """dict methods that report every key they write or delete to
    ``self._written(key)`` (a mixin in front of ``dict``)."""

    def _written(self, key) -> None:
        raise NotImplementedError

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._written(key)

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._written(key)

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return super().__getitem__(key)

    def pop(self, key, *default):
        present = key in self
        value = super().pop(key, *default)
        if present:
            self._written(key)
        return value

    def popitem(self):
        key, value = super().popitem()
        self._written(key)
        return key, value

    def clear(self) -> None:
        keys = list(self)
        super().clear()
        for key in keys:
            self._written(key)


class _ParamState(_Watched, dict):
    """``optimizer.state[p]`` of a parameter that has a chunk: views into the
    chunk. A write into it (``state[p]["step"] = ...``) marks ``p`` for
    re-import. The optimizer refills the same object when it re-installs
    the views (after a sync or a re-chunk), so a handle taken earlier stays
    live. Copies and pickles are plain dicts."""

    def __init__(self, values: dict, owner: "_OptimizerState", param: torch.Tensor,
                 chunk: Optional[_Chunk]) -> None:
        super().__init__(values)
        self.owner, self.param = owner, param
        self.reinstall(values, chunk)

    def reinstall(self, values: dict, chunk: Optional[_Chunk]) -> None:
        """Replace the contents without reporting a write. ``chunk=None``:
        the values are not views of any chunk (all of them get imported)."""
        dict.clear(self)
        dict.update(self, values)
        self.chunk = chunk
        # what the optimizer put there, to tell the user's writes apart
        self.installed = dict(values) if chunk is not None else {}

    def _written(self, key) -> None:
        self.owner.mark(self.param)

    def written_values(self) -> dict[str, Any]:
        return {key: value for key, value in self.items() if self.installed.get(key) is not value}

    def __reduce__(self):
        return dict, (dict(self),)


def _plain_state(items) -> defaultdict:
    return defaultdict(dict, items)


class _OptimizerState(_Watched, defaultdict):
    """``optimizer.state`` of the chunked optimizers: a ``defaultdict(dict)``
    that remembers which parameters' entries were written from outside
    (``state[p] = {...}`` as ZeroRedundancyOptimizer.load_state_dict does,
    ``del state[p]``, writes into an entry), so that the optimizer copies them
    into its chunks before it next uses them. The optimizer's own entries go
    in through :meth:`install`. Copies and pickles are plain defaultdicts."""

    def __init__(self, items=()) -> None:
        super().__init__(dict, items)
        self.pending: dict[int, torch.Tensor] = {id(p): p for p in self if isinstance(p, torch.Tensor)}

    def mark(self, param) -> None:
        if isinstance(param, torch.Tensor):
            self.pending[id(param)] = param

    _written = mark

    def install(self, param: torch.Tensor, entry: dict) -> None:
        dict.__setitem__(self, param, entry)

    def copy(self) -> defaultdict:
        """A plain ``defaultdict(dict)`` holding the same entries (a shallow
        copy, as ``torch.optim``'s state would give)."""
        return defaultdict(dict, self.items())

    __copy__ = copy

    def __or__(self, other):
        if not isinstance(other, dict):
            return NotImplemented
        merged = self.copy()
        merged.update(other)
        return merged

    def __ror__(self, other):
        if not isinstance(other, dict):
            return NotImplemented
        merged = defaultdict(dict, other)
        merged.update(self)
        return merged

    def __reduce__(self):
        return _plain_state, ([(key, dict(entry) if isinstance(entry, dict) else entry)
                               for key, entry in self.items()],)


class ChunkStore:
    """The chunks of one optimizer and ``optimizer.state`` kept in step with
    them: gives parameters their chunks, installs the chunks' views as the
    state entries, imports entries written from outside, re-chunks when
    parameters or param groups change. The optimizer owns one and passes
    its ``param_groups`` to each call that reads them (a group's list may be
    replaced, so the store keeps no reference to it).

    ``owner``: the optimizer's class name, for messages. The settings
    (``state_dtype``, ``master_weights``, ``offload``, ``chunk_size``,
    ``force_staging``) decide the layout of chunks made from then on."""

    def __init__(self, owner: str, state_dtype, master_weights: bool, offload: Optional[str],
                 chunk_size: int) -> None:
        self.owner = owner
        self.state_dtype = state_dtype
        self.master_weights = master_weights
        self.offload = offload
        self.chunk_size = chunk_size
        # Exercise the offload staging on CPU parameters (tests); on CUDA it
        # is on whenever offload="cpu".
        self.force_staging = False
        self.state = _OptimizerState()
        # ids of each group's params at the last step (edits are compared with it)
        self.members: Optional[list[list[int]]] = None
        self.clear()

    def clear(self) -> None:
        """Forget every chunk (the state entries stay)."""
        # (group index, device, dtype) -> chunks, in order of first use
        self.chunks: dict[tuple[int, torch.device, torch.dtype], list[_Chunk]] = defaultdict(list)
        # id(param) -> (chunk, index); ids, not tensors, as keys: a tensor
        # hashes through a Python-level __hash__, several times slower
        self.location: dict[int, tuple[_Chunk, int]] = {}
        # group index -> (ids of its params, its params without a chunk yet)
        self.unlocated: dict[int, tuple[list[int], list[torch.Tensor]]] = {}

    # -- optimizer.state ------------------------------------------------
    # Outside writes into the state (ZeroRedundancyOptimizer.load_state_dict,
    # `state[p] = ...`, a whole new mapping) are collected by _OptimizerState
    # and copied into the chunks by sync() before the next step or
    # state_dict().
    def adopt(self, value) -> _OptimizerState:
        """``value`` (any mapping) becomes ``optimizer.state``."""
        state = value if type(value) is _OptimizerState else _OptimizerState(value)
        # parameters that have a chunk but no entry in the new mapping start afresh, as in torch
        for chunk, index in self.location.values():
            state.mark(chunk.owners[index])
        self.state = state
        return state

    def sync(self, param_groups: list[dict]) -> None:
        """Copy the entries written from outside into the chunks: a replaced
        or deleted entry resets the parameter's state and imports what the
        new entry holds; a write into one of our entries imports the values
        that changed. Parameters without a chunk get one (in group order)."""
        state = self.state
        pending, state.pending = state.pending, {}
        # (param, reset its state first, values to import), decided before
        # new chunks re-install any entry
        located, fresh = [], defaultdict(list)
        for group_index, group in enumerate(param_groups):
            for p in group["params"]:
                if id(p) not in pending:
                    continue
                entry = dict.get(state, p)
                place = self.location.get(id(p))
                ours = isinstance(entry, _ParamState) and entry.param is p
                if place is not None and ours and entry.chunk is place[0]:
                    located.append((p, False, entry.written_values()))
                elif place is not None:
                    located.append((p, True, dict(entry or {})))
                elif entry:
                    fresh[group_index].append((p, True, dict(entry)))
        # A value may be a view of the chunks themselves (`state[p] =
        # dict(state[p])`, entries or single keys swapped between
        # parameters): copy those before a reset zeroes, or an earlier
        # import overwrites, what they show.
        imported = [values for items in (located, *fresh.values()) for _, _, values in items if values]
        if imported:
            owned = {address for chunks in self.chunks.values() for chunk in chunks for address in chunk.storages()}
            for values in imported:
                for key, value in values.items():
                    if isinstance(value, torch.Tensor) and local(value).untyped_storage().data_ptr() in owned:
                        values[key] = value.clone()
        # the user's writes to parameters reach the chunks' copies before
        # anything is imported over them (and before versions are recorded)
        fits = self.reseed_copies()
        for group_index, items in fresh.items():
            self.assign(param_groups, group_index, [p for p, _, _ in items])
            located.extend(items)
        touched = {}
        with torch.no_grad():
            for p, reset, values in located:
                chunk, index = self.location[id(p)]
                if reset:
                    chunk.reset(index)
                for key, value in values.items():
                    chunk.import_value(index, key, value)
                touched[id(chunk)] = chunk
        for chunk in touched.values():
            chunk.reclassify_from_steps()
            self.install(chunk)
        if not fits:
            self.rechunk(param_groups)

    def reseed_copies(self) -> bool:
        """Parameters written by the user since the optimizer last wrote them
        (version counter moved, or storage address moved: ``p.data = t``) are
        copied into the chunks' own copies (fp32 masters, offload). Every
        path that exports those copies or records the parameters' versions
        calls this first, so no pending write is lost or marked as seen.
        False when a parameter was re-pointed at a tensor its chunk no
        longer fits (new dtype, device or memory order): the caller
        re-chunks."""
        fits = True
        with torch.no_grad():
            for chunks in self.chunks.values():
                for chunk in chunks:
                    fits = chunk.reseed_changed(pointers=True) and fits
        return fits

    def settle(self, param_groups: list[dict]) -> None:
        """Before the state is exported (state_dict, deepcopy, pickle): the
        entries written from outside are imported, the parameters' writes
        reach the chunks' copies, and parameters re-pointed at a tensor of
        another dtype, device or memory order move the states."""
        if self.state.pending:
            self.sync(param_groups)  # reseeds too, and re-chunks when needed
        elif not self.reseed_copies():
            self.rechunk(param_groups)

    def install(self, chunk: _Chunk) -> None:
        """Install the chunk's views as its parameters' entries, refilling
        the entry objects already there (a handle the user holds stays live)."""
        with torch.no_grad():
            chunk.reseed_changed()
        state = self.state
        for index, p in enumerate(chunk.owners):
            entry = dict.get(state, p)
            if isinstance(entry, _ParamState) and entry.owner is state and entry.param is p:
                entry.reinstall(chunk.param_state(index), chunk)
            else:
                state.install(p, _ParamState(chunk.param_state(index), state, p, chunk))

    def rechunk(self, param_groups: list[dict]) -> None:
        """Some parameter changed dtype or device since its chunk was made
        (``model.to(torch.bfloat16)``), or the param groups were edited: move
        every state into chunks keyed by the parameters' current group, dtype
        and device (for a moment both copies exist). New fp32 masters are
        seeded from the parameters; masters of parameters that stay
        fp16/bf16 are kept. A parameter that is in no group any more keeps
        its entry, as torch does, as a copy in torch's layout (8-bit states
        decoded), so the old chunks can be freed; it is imported again if the
        parameter rejoins a group."""
        name = self.owner
        grouped = {id(p) for group in param_groups for p in group["params"]}
        for group_index, group in enumerate(param_groups):
            for position, p in enumerate(group["params"]):
                if id(p) in self.location and (p.is_complex() or p.dtype not in PARAM_DTYPES):
                    raise TypeError(f"{name}: parameter {position} of param group {group_index} is now {p.dtype} "
                                    f"(its dtype changed after its optimizer state was created); {name} supports "
                                    "float16, bfloat16, float32 and float64 parameters")
        self.reseed_copies()
        state = self.state
        for chunks in self.chunks.values():
            for chunk in chunks:
                for index, p in enumerate(chunk.owners):
                    # views of the old chunk in its layout, until imported
                    exported = chunk.torch_entry(index)
                    if chunk.master_is_fp32:
                        exported["master_param"] = chunk.export_master(index)
                    if id(p) not in grouped:
                        exported = {key: value.clone() for key, value in exported.items()}
                    entry = dict.get(state, p)
                    if isinstance(entry, _ParamState) and entry.owner is state and entry.param is p:
                        entry.reinstall(exported, None)  # the user's handle stays live
                    else:
                        state.install(p, exported)
                    state.mark(p)
        self.clear()
        self.sync(param_groups)

    def check_groups(self, param_groups: list[dict]) -> list[list[int]]:
        """The ids of each group's parameters. Compared with the snapshot
        taken at the last step (the list compare the step needs anyway to
        find parameters without a chunk), so edits of ``param_groups`` after
        steps are seen: a parameter removed from its group's list, moved to
        another group, a group popped, new parameters or groups. When a
        parameter with a chunk is no longer in the group its chunk was made
        for (or in none), the states are re-chunked by the current groups,
        each parameter keeping its state as torch keeps state by parameter;
        a parameter that rejoins a group gets its kept entry back."""
        members = [list(map(id, group["params"])) for group in param_groups]
        if members == self.members:
            return self.members
        group_of: dict[int, int] = {}
        where: dict[int, tuple[int, int]] = {}
        for group_index, ids in enumerate(members):
            for position, key in enumerate(ids):
                if key in where:
                    raise ValueError(f"{self.owner}: parameter {position} of param group {group_index} is the same "
                                     f"tensor as parameter {where[key][1]} of param group {where[key][0]} "
                                     "(param_groups were edited; a parameter listed twice would be updated twice "
                                     "per step); list each parameter once")
                where[key] = (group_index, position)
                group_of[key] = group_index
        self.unlocated.clear()
        if any(group_of.get(id(p)) != group_index
               for (group_index, _, _), chunks in self.chunks.items() for chunk in chunks for p in chunk.owners):
            self.rechunk(param_groups)
        # parameters without a chunk that hold an entry (back in a group
        # after a removal, or given one while in no group): import it
        state = self.state
        for group in param_groups:
            for p in group["params"]:
                if id(p) not in self.location and dict.get(state, p):
                    state.mark(p)
        if state.pending:
            self.sync(param_groups)
        self.members = members
        return members

    # -- chunk bookkeeping ---------------------------------------------
    def staged(self, device: torch.device) -> bool:
        return self.offload == "cpu" and (device.type != "cpu" or self.force_staging)

    def assign(self, param_groups: list[dict], group_index: int, params: list[torch.Tensor]) -> None:
        """Give chunks to parameters that have none yet, in the order given."""
        amsgrad = param_groups[group_index]["amsgrad"]
        self.unlocated.clear()
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for p in params:
            by_key[(p.device, p.dtype)].append(p)
        for (device, dtype), members in by_key.items():
            state_dtype = torch.float64 if dtype == torch.float64 else self.state_dtype
            master = self.master_weights and dtype in _LOW_PRECISION
            staged = self.staged(device)
            state_device = torch.device("cpu") if self.offload == "cpu" else device
            pin = state_device.type == "cpu" and device.type == "cuda"
            current: list[torch.Tensor] = []
            filled = 0

            def close() -> None:
                if current:
                    chunk = _Chunk(list(current), state_device, state_dtype, master, amsgrad, staged, pin)
                    self.chunks[(group_index, device, dtype)].append(chunk)
                    for index, member in enumerate(chunk.owners):
                        self.location[id(member)] = (chunk, index)
                    self.install(chunk)

            for p in members:
                numel = local(p).numel()  # a DTensor's chunk holds its local shard
                span = padded_numel(numel) if state_dtype == EIGHT_BIT else numel
                if current and filled + span > self.chunk_size:
                    close()
                    current, filled = [], 0
                current.append(p)
                filled += span
            close()

    def locate_new(self, param_groups: list[dict], group_index: int, ids: list[int]) -> None:
        """Chunks for parameters that get their first gradient now. The
        parameters still without a chunk are cached per group (keyed by the
        list of ids of the group's parameters that :meth:`check_groups`
        returns, the same object while the groups are unchanged), so a step
        does not look every parameter up once all have chunks."""
        cached = self.unlocated.get(group_index)
        if cached is None or cached[0] is not ids:
            params = param_groups[group_index]["params"]
            cached = self.unlocated[group_index] = (ids, [p for p in params if id(p) not in self.location])
        fresh = []
        for p in cached[1]:
            if p.grad is not None:
                refuse_sparse(self.owner, p.grad)
                fresh.append(p)
        if fresh:
            self.assign(param_groups, group_index, fresh)

    def collect_work(self, param_groups: list[dict]) -> list[tuple[int, torch.device, list]]:
        """(group index, device, [(chunk, grads, every param has a grad)])
        for every chunk, checked before any kernel runs: when a parameter
        changed dtype or device, the states are moved first (rechunk)."""
        for _ in range(2):
            members = self.check_groups(param_groups)
            for group_index, ids in enumerate(members):
                self.locate_new(param_groups, group_index, ids)
            collected, moved = [], False
            for (group_index, device, _), chunks in self.chunks.items():
                work = [(chunk, chunk.gradients(self.owner)) for chunk in chunks]
                if any(grads is None for _, grads in work):
                    moved = True
                    break
                collected.append((group_index, device, [(chunk, *grads) for chunk, grads in work]))
            if not moved:
                return collected
            self.rechunk(param_groups)
        raise AssertionError("parameters still differ from their chunks after re-chunking")

    def prepare(self, chunk: _Chunk, amsgrad: bool) -> None:
        """What a chunk needs before its update: the user's writes to the
        parameters in its copy, amsgrad's buffer if just switched on, step
        classes redone after an outside write to the counters."""
        chunk.reseed_changed()
        if amsgrad and chunk.max_exp_avg_sq is None:
            chunk.ensure_amsgrad()
            self.install(chunk)
        chunk.check_steps()

    def export_entry(self, p: torch.Tensor, entry):
        """``p``'s entry as torch's state dict holds it: 8-bit states decoded
        to float32 (new tensors), otherwise a plain dict of the same values."""
        located = self.location.get(id(p))
        if located is not None and located[0].quantized:
            return located[0].export_state(located[1])
        return dict(entry) if isinstance(entry, dict) else entry
