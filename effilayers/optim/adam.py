"""Adam and AdamW with their states in flat chunks, updated by one fused kernel
per chunk: drop-in replacements for ``torch.optim.Adam`` / ``torch.optim.AdamW``.

Layout
------
Each parameter's ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq`` with
amsgrad) and, for fp16/bf16 parameters, its fp32 master copy live in flat
buffers: *chunks* of at most ``chunk_size`` elements, one set per (param
group, device, parameter dtype), filled in the order in which parameters
first receive a gradient. A parameter larger than ``chunk_size`` gets a chunk
of its own. The parameters themselves stay where the user put them (their
``.data`` is never re-pointed into a flat buffer, so no user-visible storage
changes); the kernel reads each parameter and gradient in place and the
states from the chunk, in one pass. A step is therefore one
``effilayers::adam_step_`` call per chunk, with no per-tensor math in Python.

``self.state[p]`` holds views into the chunks (``step`` is a 0-dim view into
the chunk's per-parameter step counter), so ``state_dict()`` has exactly
``torch.optim.Adam``'s layout: ``{"state": {i: {"step", "exp_avg",
"exp_avg_sq"[, "max_exp_avg_sq"][, "master_param"]}}, "param_groups": [...]}``,
tensors shaped like their parameter. Like torch's, the returned tensors are
references (here: views of the chunks), not copies.

As ``torch.optim.Adam`` is a thin class over ``torch.optim.adam.adam``, the
class here is torch's API over two parts it owns or calls, one concern a
module: :mod:`.functional`, the functional core, which ``step`` calls once
per run of parameters of a chunk that share a step count (steps without host
synchronisation), and a :class:`~.state.ChunkStore` (``self._store``), which
keeps the chunks (:mod:`.chunks`: 8-bit states, chunk size) and
``optimizer.state`` in step (entries written from outside, parameters and
param groups that change). The class itself holds torch's surface: the
arguments and their checks, ``step``, the state-dict layout, pickling.
:mod:`.offload` is the CPU offload pipeline, :mod:`.sharded` DTensor
parameters (FSDP2: the chunks hold each rank's local shards).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from .._core.layout import is_dense
from ..ops.adam import PARAM_DTYPES, STATE_DTYPES, AdamHyperParams
from ..ops.adam.contract import check_hyperparameters
from .chunks import DEFAULT_CHUNK_SIZE, EIGHT_BIT
from .functional import chunked_adam, chunked_adam_8bit
from .offload import _Transfers
from .sharded import check_group_placement, local
from .state import ChunkStore, _OptimizerState, _plain_state

__all__ = ["ChunkedAdam", "ChunkedAdamW", "DEFAULT_CHUNK_SIZE"]

_OFFLOAD = (None, "cpu")
# attributes a pickled or deep-copied optimizer keeps besides torch's
_PICKLED_SETTINGS = ("state_dtype", "master_weights", "offload", "chunk_size", "_force_staging")


def _store_setting(name: str) -> property:
    """An optimizer attribute kept by its chunk store (read when chunks are made)."""
    return property(lambda self: getattr(self._store, name), lambda self, value: setattr(self._store, name, value),
                    doc=f"The ``{name}`` setting, kept by the chunk store: chunks made from then on follow it.")


class ChunkedAdam(Optimizer):
    """``torch.optim.Adam`` with flat-chunk states and one fused kernel per chunk.

    Arguments as ``torch.optim.Adam`` (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``amsgrad``, ``maximize``, ``decoupled_weight_decay``;
    ``foreach``, ``fused`` and ``capturable`` are accepted and ignored: there
    is one implementation), plus:

    * ``state_dtype``: ``torch.float32`` (default) or ``torch.bfloat16`` for
      ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq`` (float64 parameters
      always keep float64 states). bf16 states halve the optimizer memory;
      the update is computed in fp32 and rounded to nearest even on store.
      ``"8bit"``: block-quantized int8/uint8 states with an fp32 absmax per
      256 elements (~2.03 bytes per parameter instead of 8; amsgrad's
      ``max_exp_avg_sq`` is 8-bit too); the update is computed in fp32 on
      the decoded block. See :mod:`effilayers.optim.chunks` for the layout
      and state-dict behaviour.
    * ``master_weights``: keep an fp32 copy of fp16/bf16 parameters in the
      chunks and update that (default True); the parameter receives the
      rounded result.
    * ``offload``: ``None`` or ``"cpu"`` (states and master weights in CPU
      memory; see :mod:`effilayers.optim.offload`).
    * ``chunk_size``: elements per chunk (default ``2**24``; on CPU
      ``2**26`` measured faster, see :mod:`effilayers.optim.chunks`).

    Host synchronisation: none per step on GPU, except that ``lr`` (and
    betas, eps, weight_decay) are read with ``float()`` once per param group
    per step: a CUDA tensor ``lr`` costs one device-to-host sync per group
    per step; a Python float or a CPU tensor costs none.

    Works with ``torch.amp.GradScaler`` (``scaler.step(opt)`` hands the scale
    and the overflow flag to the kernel), LR schedulers,
    ``zero_grad(set_to_none=True)`` and parameters without a gradient in a
    step, DTensor parameters (FSDP2 ``fully_shard``, tensor parallel; one
    mesh per param group, see :mod:`effilayers.optim.sharded`) and
    ``ZeroRedundancyOptimizer``. Not supported, with an error: sparse gradients, complex parameters,
    parameters that are not dense (strided views), a parameter listed twice
    (torch.optim warns that this is deprecated and updates it twice per
    step), ``differentiable=True``.
    """

    _default_decoupled = False

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        decoupled_weight_decay: Optional[bool] = None,
        state_dtype: torch.dtype = torch.float32,
        master_weights: bool = True,
        offload: Optional[str] = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        name = type(self).__name__
        check_hyperparameters(name, lr, betas, eps, weight_decay)
        if differentiable:
            raise ValueError(f"{name}: differentiable=True is not supported (the update runs in a fused kernel)")
        if not (state_dtype == EIGHT_BIT or state_dtype in STATE_DTYPES):
            raise TypeError(f"{name}: state_dtype must be torch.float32, torch.bfloat16 or {EIGHT_BIT!r} "
                            f"(8-bit block-quantized), got {state_dtype!r}")
        if offload not in _OFFLOAD:
            raise ValueError(f"{name}: offload must be None or 'cpu', got {offload!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"{name}: chunk_size must be a positive int (elements per chunk), got {chunk_size!r}")
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._default_decoupled
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=False,
                        fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        self._store = ChunkStore(name, state_dtype, bool(master_weights), offload, chunk_size)
        self._transfers: dict[torch.device, _Transfers] = {}
        super().__init__(params, defaults)
        # GradScaler.step hands us `grad_scale` and `found_inf` as attributes.
        self._step_supports_amp_scaling = True

    state_dtype = _store_setting("state_dtype")
    master_weights = _store_setting("master_weights")
    offload = _store_setting("offload")
    chunk_size = _store_setting("chunk_size")
    _force_staging = _store_setting("force_staging")

    # torch's Optimizer reads and assigns ``self.state``; it is the store's.
    # A mapping assigned wholesale (``optimizer.state = {...}``) or written
    # into ``__dict__`` past the property (torch's ``Optimizer.__setstate__``)
    # is adopted: its entries are imported at the next step.
    @property
    def state(self) -> _OptimizerState:
        placed = self.__dict__.pop("state", None)
        if placed is not None:
            return self._store.adopt(placed)
        return self._store.state

    @state.setter
    def state(self, value) -> None:
        self._store.adopt(value)

    # -- construction --------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        name = type(self).__name__
        params = param_group["params"]
        if isinstance(params, set):
            # checked before list() below turns it into a list, as torch checks
            raise TypeError(f"{name}: a param group's params must be an ordered collection (a list or tuple), not "
                            "a set: the order of tensors in a set changes between runs, and state dicts number "
                            "parameters by position")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # named parameters, [("name", p), ...] (torch 2.x), get the same checks
        for p in (item[1] if isinstance(item, tuple) else item for item in params):
            if isinstance(p, torch.Tensor):
                if p.is_complex():
                    raise TypeError(f"{name} does not support complex parameters (got {p.dtype}); "
                                    "optimize torch.view_as_real(param) instead")
                if p.dtype not in PARAM_DTYPES:
                    raise TypeError(f"{name}: parameters must be floating point, got {p.dtype}")
                if not is_dense(local(p)):
                    raise ValueError(f"{name}: parameters must be dense, contiguous or a permutation of it like "
                                     f"channels_last (got strides {local(p).stride()} for shape "
                                     f"{tuple(local(p).shape)}); call .contiguous() on the parameter's data")
        tensors = [item[1] if isinstance(item, tuple) else item for item in params]
        where = f"param group {len(self.param_groups)}"
        _check_listed_once(name, tensors, where)
        check_group_placement(name, tensors, [item[0] if isinstance(item, tuple) else None for item in params],
                              where)
        group = dict(param_group, params=params)  # a generator is consumed by the checks above
        check_hyperparameters(name, group.get("lr", self.defaults["lr"]), group.get("betas", self.defaults["betas"]),
                              group.get("eps", self.defaults["eps"]),
                              group.get("weight_decay", self.defaults["weight_decay"]))
        super().add_param_group(group)

    def chunk_layout(self) -> list[dict[str, Any]]:
        """One entry per chunk: group, device, dtypes, element count, params."""
        layout = []
        for (group_index, device, dtype), chunks in self._store.chunks.items():
            for chunk in chunks:
                layout.append({"group": group_index, "device": str(device), "param_dtype": dtype,
                               "state_dtype": chunk.state_dtype, "numel": chunk.numel, "params": len(chunk.params),
                               "master": chunk.master_is_fp32, "state_device": str(chunk.state_device)})
        return layout

    # -- the step ---------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        store, groups = self._store, self.param_groups
        if self.state.pending:
            store.sync(groups)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        hypers = [_hyper_params(group) for group in groups]
        for group_index, device, work in store.collect_work(groups):
            amsgrad = groups[group_index]["amsgrad"]
            hyper = hypers[group_index]
            for chunk, _, _ in work:
                store.prepare(chunk, amsgrad)
            if any(chunk.staged for chunk, _, _ in work):
                transfers = self._transfers.get(device)
                if transfers is None:
                    transfers = self._transfers[device] = _Transfers(device)
                for chunk, start, stop, params, grads, scale, found in transfers.runs(work, grad_scale, found_inf):
                    core = chunked_adam_8bit if chunk.quantized else chunked_adam
                    core(params, grads, *chunk.run(start, stop, amsgrad), scale, found, hyper=hyper, check=False)
                for chunk, _, _ in work:
                    chunk.updated()
                continue
            # the functional core once per run of parameters that share a
            # step count (one run per chunk, unless some parameters skip
            # steps); the chunks satisfy its checks by construction
            for chunk, grads, complete in work:
                core = chunked_adam_8bit if chunk.quantized else chunked_adam
                for start, stop in chunk.runs(grads, complete):
                    core(chunk.params[start:stop], grads[start:stop], *chunk.run(start, stop, amsgrad), grad_scale,
                         found_inf, hyper=hyper, check=False)
                chunk.updated()
        return loss

    # -- state dict, copies, pickles ----------------------------------------
    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Adam's layout. Parameters with 8-bit states export them
        decoded to float32 (new tensors, not views), so the checkpoint loads
        into torch.optim.Adam/AdamW; loading it back re-encodes them. Hooks
        run as in torch: ``register_state_dict_pre_hook`` hooks before the
        state is read, ``register_state_dict_post_hook`` hooks on the
        finished state dict (decoded states included; a returned dict
        replaces it)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._store.settle(self.param_groups)
        state_dict = self._packed_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads torch.optim.Adam/AdamW state dicts and this class's own, into
        any chunk size. States are converted to this optimizer's
        ``state_dtype`` (an fp32 torch checkpoint loaded with
        ``state_dtype=torch.bfloat16`` is rounded to bf16; a bf16 checkpoint
        loaded with bf16 states stays bit-identical). Master weights come from
        ``master_param`` when present, else from the parameters. Hooks
        registered with ``register_load_state_dict_pre_hook`` /
        ``_post_hook`` run as in torch: pre hooks on a shallow copy of
        ``state_dict`` before anything is read (one may return a new state
        dict), post hooks after the state is loaded."""
        state_dict = state_dict.copy()  # shallow, as torch's: a pre hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        self._load_packed(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        """torch's Optimizer pickles only defaults, state and param_groups; the
        chunks are rebuilt from the state entries at the next step (so a
        deepcopied or unpickled optimizer continues exactly). The entries are
        compact copies: pickle writes a view's whole storage, which here is
        its chunk."""
        return self._exported(compact=True)

    def __deepcopy__(self, memo: dict) -> "ChunkedAdam":
        """As pickling does, minus the compact copies: deepcopy copies each
        chunk's storage once and keeps the entries views of the copy."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self._exported(compact=False), memo))
        return twin

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
            packed_state[numbers[id(p)]] = self._store.export_entry(p, entry)
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
        self._store.clear()
        self.state = {p: saved_state[i] for group, saved in zip(groups, saved_groups)
                      for p, i in zip(group["params"], saved["params"]) if i in saved_state}
        self._store.sync(groups)

    def _exported(self, compact: bool) -> dict[str, Any]:
        self._store.settle(self.param_groups)
        state = super().__getstate__()
        entries = []
        for p, entry in self.state.items():
            if isinstance(entry, dict):
                entry = {key: value.clone() if compact and isinstance(value, torch.Tensor) else value
                         for key, value in entry.items()}
            entries.append((p, entry))
        state["state"] = _plain_state(entries)
        for name in _PICKLED_SETTINGS:
            state[name] = getattr(self, name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        entries = state.pop("state", {})
        settings = {name: state.pop(name) for name in _PICKLED_SETTINGS if name in state}
        self._store = ChunkStore(type(self).__name__, settings.get("state_dtype", torch.float32),
                                 settings.get("master_weights", True), settings.get("offload"),
                                 settings.get("chunk_size", DEFAULT_CHUNK_SIZE))
        self._store.force_staging = settings.get("_force_staging", False)
        super().__setstate__(state)
        self._transfers = {}
        self._step_supports_amp_scaling = True
        self.state = entries


class ChunkedAdamW(ChunkedAdam):
    """``torch.optim.AdamW`` (decoupled weight decay, default 0.01) on flat
    chunks; see :class:`ChunkedAdam` for the extra arguments."""

    _default_decoupled = True

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


def _hyper_params(group: dict[str, Any]) -> AdamHyperParams:
    """The group's settings for the kernels. AdamHyperParams reads them with
    float(): a CUDA tensor lr or beta costs a host sync here (docs/guide/optim.md)."""
    beta1, beta2 = group["betas"]
    return AdamHyperParams(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"], decoupled_weight_decay=group["decoupled_weight_decay"],
                           maximize=group["maximize"])


def _check_listed_once(name: str, params: list, where: str) -> None:
    """A parameter listed twice would get two updates per step. torch.optim
    warns (deprecated, to become an error: pytorch issue 40967) and steps
    one shared state twice; here it is the error torch plans."""
    first: dict[int, int] = {}
    for position, p in enumerate(params):
        seen = first.setdefault(id(p), position)
        if seen != position:
            raise ValueError(f"{name}: parameter {position} of {where} is the same tensor as parameter {seen} "
                             "(a parameter listed twice would be updated twice per step); list each parameter once")
