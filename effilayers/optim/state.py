"""``optimizer.state`` of the chunked optimizers and its link to the chunks.

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
  moves into chunks of the current groups (``_check_groups``); a parameter
  in no group keeps its entry (torch's layout) and is not updated, as in
  torch, until it rejoins a group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch

from ..ops.adam import PARAM_DTYPES, padded_numel
from .chunks import EIGHT_BIT, _Chunk, refuse_sparse
from .sharded import local

__all__ = ["_ChunkedState", "_OptimizerState", "_ParamState", "_plain_state"]

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


class _ChunkedState:
    """The part of ``ChunkedAdam`` that keeps ``optimizer.state`` and the
    chunks in step: gives parameters their chunks, installs the chunks'
    views as the state entries, imports entries written from outside,
    re-chunks when parameters or param groups change, and maps the state to
    torch's state-dict layout and back. The optimizer provides
    ``param_groups`` and the settings ``state_dtype``, ``master_weights``,
    ``offload``, ``chunk_size``, ``_force_staging`` and
    ``_default_decoupled``."""

    def _clear_chunks(self) -> None:
        # (group index, device, dtype) -> chunks, in order of first use
        self._chunks: dict[tuple[int, torch.device, torch.dtype], list[_Chunk]] = defaultdict(list)
        # id(param) -> (chunk, index); ids, not tensors, as keys: a tensor
        # hashes through a Python-level __hash__, several times slower
        self._location: dict[int, tuple[_Chunk, int]] = {}
        # group index -> (ids of its params, its params without a chunk yet)
        self._unlocated: dict[int, tuple[list[int], list[torch.Tensor]]] = {}

    # -- optimizer.state ------------------------------------------------
    # Outside writes into the state (ZeroRedundancyOptimizer.load_state_dict,
    # `state[p] = ...`, a whole new mapping) are collected by _OptimizerState
    # and copied into the chunks by _sync_state before the next step or
    # state_dict(); a state assigned wholesale (also through torch's
    # __setstate__, which updates __dict__ directly) is wrapped on first use.
    @property
    def state(self) -> _OptimizerState:
        state = self.__dict__.get("state")
        if type(state) is not _OptimizerState:
            state = self._adopt_state(state or {})
        return state

    @state.setter
    def state(self, value) -> None:
        self._adopt_state(value)

    def _adopt_state(self, value) -> _OptimizerState:
        state = value if type(value) is _OptimizerState else _OptimizerState(value)
        # parameters that have a chunk but no entry in the new mapping start afresh, as in torch
        for chunk, index in getattr(self, "_location", {}).values():
            state.mark(chunk.owners[index])
        self.__dict__["state"] = state
        return state

    def _sync_state(self) -> None:
        """Copy the entries written from outside into the chunks: a replaced
        or deleted entry resets the parameter's state and imports what the
        new entry holds; a write into one of our entries imports the values
        that changed. Parameters without a chunk get one (in group order)."""
        state = self.state
        pending, state.pending = state.pending, {}
        # (param, reset its state first, values to import), decided before
        # new chunks re-install any entry
        located, fresh = [], defaultdict(list)
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) not in pending:
                    continue
                entry = dict.get(state, p)
                place = self._location.get(id(p))
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
            owned = {address for chunks in self._chunks.values() for chunk in chunks for address in chunk.storages()}
            for values in imported:
                for key, value in values.items():
                    if isinstance(value, torch.Tensor) and local(value).untyped_storage().data_ptr() in owned:
                        values[key] = value.clone()
        # the user's writes to parameters reach the chunks' copies before
        # anything is imported over them (and before versions are recorded)
        fits = self._reseed_copies()
        for group_index, items in fresh.items():
            self._assign(group_index, [p for p, _, _ in items])
            located.extend(items)
        touched = {}
        with torch.no_grad():
            for p, reset, values in located:
                chunk, index = self._location[id(p)]
                if reset:
                    chunk.reset(index)
                for key, value in values.items():
                    chunk.import_value(index, key, value)
                touched[id(chunk)] = chunk
        for chunk in touched.values():
            chunk.reclassify_from_steps()
            self._refresh_state(chunk)
        if not fits:
            self._rechunk()

    def _reseed_copies(self) -> bool:
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
            for chunks in self._chunks.values():
                for chunk in chunks:
                    fits = chunk.reseed_changed(pointers=True) and fits
        return fits

    def _settle(self) -> None:
        """Before the state is exported (state_dict, deepcopy, pickle): the
        entries written from outside are imported, the parameters' writes
        reach the chunks' copies, and parameters re-pointed at a tensor of
        another dtype, device or memory order move the states."""
        if self.state.pending:
            self._sync_state()  # reseeds too, and re-chunks when needed
        elif not self._reseed_copies():
            self._rechunk()

    def _refresh_state(self, chunk: _Chunk) -> None:
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

    def _rechunk(self) -> None:
        """Some parameter changed dtype or device since its chunk was made
        (``model.to(torch.bfloat16)``), or the param groups were edited: move
        every state into chunks keyed by the parameters' current group, dtype
        and device (for a moment both copies exist). New fp32 masters are
        seeded from the parameters; masters of parameters that stay
        fp16/bf16 are kept. A parameter that is in no group any more keeps
        its entry, as torch does, as a copy in torch's layout (8-bit states
        decoded), so the old chunks can be freed; it is imported again if the
        parameter rejoins a group."""
        name = type(self).__name__
        grouped = {id(p) for group in self.param_groups for p in group["params"]}
        for group_index, group in enumerate(self.param_groups):
            for position, p in enumerate(group["params"]):
                if id(p) in self._location and (p.is_complex() or p.dtype not in PARAM_DTYPES):
                    raise TypeError(f"{name}: parameter {position} of param group {group_index} is now {p.dtype} "
                                    f"(its dtype changed after its optimizer state was created); {name} supports "
                                    "float16, bfloat16, float32 and float64 parameters")
        self._reseed_copies()
        state = self.state
        for chunks in self._chunks.values():
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
        self._clear_chunks()
        self._sync_state()

    def _check_groups(self) -> list[list[int]]:
        """The ids of each group's parameters. Compared with the snapshot
        taken at the last step (the list compare the step needs anyway to
        find parameters without a chunk), so edits of ``param_groups`` after
        steps are seen: a parameter removed from its group's list, moved to
        another group, a group popped, new parameters or groups. When a
        parameter with a chunk is no longer in the group its chunk was made
        for (or in none), the states are re-chunked by the current groups,
        each parameter keeping its state as torch keeps state by parameter;
        a parameter that rejoins a group gets its kept entry back."""
        members = [list(map(id, group["params"])) for group in self.param_groups]
        if members == self._members:
            return self._members
        name = type(self).__name__
        group_of: dict[int, int] = {}
        where: dict[int, tuple[int, int]] = {}
        for group_index, ids in enumerate(members):
            for position, key in enumerate(ids):
                if key in where:
                    raise ValueError(f"{name}: parameter {position} of param group {group_index} is the same tensor "
                                     f"as parameter {where[key][1]} of param group {where[key][0]} (param_groups "
                                     "were edited; a parameter listed twice would be updated twice per step); "
                                     "list each parameter once")
                where[key] = (group_index, position)
                group_of[key] = group_index
        self._unlocated.clear()
        if any(group_of.get(id(p)) != group_index
               for (group_index, _, _), chunks in self._chunks.items() for chunk in chunks for p in chunk.owners):
            self._rechunk()
        # parameters without a chunk that hold an entry (back in a group
        # after a removal, or given one while in no group): import it
        state = self.state
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in self._location and dict.get(state, p):
                    state.mark(p)
        if state.pending:
            self._sync_state()
        self._members = members
        return members

    # -- chunk bookkeeping ---------------------------------------------
    def _state_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu") if self.offload == "cpu" else device

    def _staged(self, device: torch.device) -> bool:
        return self.offload == "cpu" and (device.type != "cpu" or self._force_staging)

    def _assign(self, group_index: int, params: list[torch.Tensor]) -> None:
        """Give chunks to parameters that have none yet, in the order given."""
        group = self.param_groups[group_index]
        self._unlocated.clear()
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for p in params:
            by_key[(p.device, p.dtype)].append(p)
        for (device, dtype), members in by_key.items():
            state_dtype = torch.float64 if dtype == torch.float64 else self.state_dtype
            master = self.master_weights and dtype in _LOW_PRECISION
            staged = self._staged(device)
            state_device = self._state_device(device)
            pin = state_device.type == "cpu" and device.type == "cuda"
            current: list[torch.Tensor] = []
            filled = 0

            def close() -> None:
                if current:
                    chunk = _Chunk(list(current), state_device, state_dtype, master, group["amsgrad"], staged, pin)
                    self._chunks[(group_index, device, dtype)].append(chunk)
                    for index, member in enumerate(chunk.owners):
                        self._location[id(member)] = (chunk, index)
                    self._refresh_state(chunk)

            for p in members:
                numel = local(p).numel()  # a DTensor's chunk holds its local shard
                span = padded_numel(numel) if state_dtype == EIGHT_BIT else numel
                if current and filled + span > self.chunk_size:
                    close()
                    current, filled = [], 0
                current.append(p)
                filled += span
            close()

    def _locate_new(self, group_index: int, group: dict[str, Any], ids: list[int]) -> None:
        """Chunks for parameters that get their first gradient now. The
        parameters still without a chunk are cached per group (keyed by the
        list of ids of the group's parameters that :meth:`_check_groups`
        returns, the same object while the groups are unchanged), so a step
        does not look every parameter up once all have chunks."""
        cached = self._unlocated.get(group_index)
        if cached is None or cached[0] is not ids:
            params = group["params"]
            cached = self._unlocated[group_index] = (ids, [p for p in params if id(p) not in self._location])
        fresh = []
        for p in cached[1]:
            if p.grad is not None:
                refuse_sparse(type(self).__name__, p.grad)
                fresh.append(p)
        if fresh:
            self._assign(group_index, fresh)

    # -- torch's state-dict layout ------------------------------------------
    def _packed_state_dict(self) -> dict[str, Any]:
        """The state in torch.optim.Adam's state-dict layout: parameters
        numbered by position across the groups (a repeated parameter keeps
        its first number), 8-bit states decoded to float32 (new tensors)."""
        numbers: dict[int, int] = {}
        groups, start = [], 0
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            for number, p in enumerate(group["params"], start):
                numbers.setdefault(id(p), number)
            packed["params"] = [numbers[id(p)] for p in group["params"]]
            start += len(group["params"])
            groups.append(packed)
        packed_state = {}
        for p, entry in self.state.items():
            if not isinstance(p, torch.Tensor):
                packed_state[p] = entry
                continue
            if id(p) not in numbers:
                # torch.optim raises a bare KeyError here
                raise KeyError(f"{type(self).__name__}.state_dict: optimizer.state holds an entry for a parameter "
                               f"of shape {tuple(p.shape)} that is in no param group; put it back into a group or "
                               "delete its entry (del optimizer.state[p])")
            located = self._location.get(id(p))
            if located is not None and located[0].quantized:
                entry = located[0].export_state(located[1])
            elif isinstance(entry, dict):
                entry = dict(entry)  # a plain dict, not our tracked entry
            packed_state[numbers[id(p)]] = entry
        return {"state": packed_state, "param_groups": groups}

    def _load_packed(self, state_dict: dict[str, Any]) -> None:
        """The inverse of :meth:`_packed_state_dict`: the groups' settings
        and every entry, imported into new chunks."""
        name = type(self).__name__
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"{name}.load_state_dict: loaded state dict has {len(saved_groups)} parameter groups, "
                             f"this optimizer has {len(groups)}")
        for group, saved in zip(groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"{name}.load_state_dict: loaded state dict contains a parameter group that "
                                 "doesn't match the size of optimizer's group")
        for group, saved in zip(groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            group.setdefault("decoupled_weight_decay", self._default_decoupled)
        saved_state = state_dict["state"]
        self._clear_chunks()
        self.state = {p: saved_state[i] for group, saved in zip(groups, saved_groups)
                      for p, i in zip(group["params"], saved["params"]) if i in saved_state}
        self._sync_state()
