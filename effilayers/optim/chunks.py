"""The chunks of ``ChunkedAdam``: a run of parameters of one param group,
device and dtype whose states (and fp32 masters, offload staging) live in
flat buffers. A chunk knows its layout and hands out the functional core's
arguments for a run of parameters that share a step count (``_Chunk.run``);
the optimizer makes the call.

Runs
----
Parameters that get no gradient in a step are left out of that step (like
torch), which splits the chunk into runs of parameters that share a step
count; the host tracks which parameters may have diverged from the pattern
of gradients it has seen, so the common case stays one kernel per chunk.

8-bit states
------------
``state_dtype="8bit"`` stores ``exp_avg`` as int8 and ``exp_avg_sq`` /
``max_exp_avg_sq`` as uint8 codes with one float32 absmax per block of 256
elements (``effilayers.ops.adam.reference`` describes the companded codes
and why they are not linear). In these chunks every parameter starts on a
block boundary, so each flat buffer (codes, master weights, offload staging)
is padded per parameter to a multiple of 256 and a block never mixes
parameters. State
memory: 2 + 8/256 bytes per parameter plus the padding, against 8 for fp32
states. ``self.state[p]`` holds the raw payload (``exp_avg_codes``,
``exp_avg_absmax``, ``exp_avg_sq_codes``, ``exp_avg_sq_absmax``, ...);
``state_dict()`` exports the decoded float32 states in torch's layout (new
tensors, so a checkpoint loads into ``torch.optim.AdamW``) and
``load_state_dict`` encodes them again (decode -> encode reproduces the
codes). Measured accuracy: docs/guide/optim.md.

Chunk size
----------
Default ``2**24`` elements (64 MiB of fp32 per state buffer): provisional,
not the CPU optimum. Measured on CPU only (benchmarks/bench_optim.py
``test_chunk_size``: 256M fp32 parameters in 4096x1024 matrices and
1024-long vectors, 4x the largest size compared; results/
optim-chunk-size-cpu-2026-11-23*.json, a 2-core machine shared with other
jobs, load average 3-5): chunk sizes 2^20, 2^22, 2^24, 2^26 give 127, 126,
21 and 5 chunks, and one step took (medians) 1104, 929, 740, 568 ms with 2
threads in one run and 545, 526, 502, 402 ms in a second run in reverse
order; with 1 thread 468, 465, 450, 426 ms (reverse order; the other
1-thread run was noisier). The arithmetic per element is the same at every
size: a chunk is one kernel call, i.e. one fork/join of the CPU threads,
and on a loaded machine a join waits for a thread another job has
preempted, so fewer chunks are faster mostly with several threads.
What remains unmeasured, and why the default stays at 2^24: offload
pipelines chunk by chunk (the CPU updates one chunk while the next one's
gradients travel), so a larger chunk overlaps less, and neither the GPU step
nor the offload pipeline has been timed at any chunk size. (The Triton
kernel reads the parameters and gradients of a chunk in place through a
device table of addresses, so a larger chunk no longer costs GPU
temporaries: only its tile table, 16 bytes per 1024 elements.) For
CPU-only training ``chunk_size=2**26`` was faster here. Chunks are
allocated at the size of what they hold, so a partly filled last chunk
wastes nothing.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch

from .._core.layout import memory_flat, same_layout
from ..ops.adam import (
    QUANT_BLOCK,
    dequantize_exp_avg,
    dequantize_exp_avg_sq,
    gather_padded,
    padded_numel,
    quantize_exp_avg,
    quantize_exp_avg_sq,
)
from .sharded import is_sharded, local, local_grad, local_value, shard_like

__all__ = ["DEFAULT_CHUNK_SIZE", "EIGHT_BIT", "refuse_sparse"]

DEFAULT_CHUNK_SIZE = 1 << 24
# state_dtype spelling of the 8-bit block-quantized states
EIGHT_BIT = "8bit"
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def refuse_sparse(owner: str, grad: torch.Tensor) -> None:
    if grad.is_sparse:
        raise RuntimeError(f"{owner} does not support sparse gradients, please consider SparseAdam instead")


class _Chunk:
    """The states of a run of parameters of one group, device and dtype."""

    def __init__(self, owners: list[torch.Tensor], state_device: torch.device, state_dtype, master: bool,
                 amsgrad: bool, staged: bool, pin: bool) -> None:
        # `owners`: the optimizer's parameters (the keys of its state);
        # `params`: the tensors the kernels update, the owners themselves or,
        # for DTensors, their local shards (sharded.py)
        self.owners = owners
        self.sharded = any(is_sharded(p) for p in owners)
        params = self.params = [local(p) for p in owners] if self.sharded else owners
        self.sizes = [p.numel() for p in params]
        # 8-bit states: every parameter starts on a quantization block, so a
        # block (one absmax) never mixes parameters; all flat buffers of the
        # chunk (master, staging) share that padded layout.
        self.quantized = state_dtype == EIGHT_BIT
        spans = [padded_numel(n) for n in self.sizes] if self.quantized else self.sizes
        self.offsets = [0, *itertools.accumulate(spans)]
        self.numel = self.offsets[-1]
        self.param_dtype = params[0].dtype
        self.param_device = params[0].device
        # The layout every state range was made in: a parameter's range holds
        # it in this memory order, whatever the parameter's strides are now.
        self.strides = [p.stride() for p in params]
        # Cached for the per-step checks (a cheap int compare per parameter):
        # a parameter whose storage address differs was re-pointed since
        # (model.to(dtype / device / memory_format), `p.data = t`), and a
        # contiguous parameter with a contiguous gradient needs no stride
        # comparison.
        self.pointers = [p.data_ptr() for p in params]
        self.device_index = params[0].get_device()
        self.contiguous = [p.is_contiguous() for p in params]
        self.state_device = state_device
        self.pin = pin
        self.state_dtype = state_dtype
        self.exp_avg_absmax = self.exp_avg_sq_absmax = self.max_exp_avg_sq_absmax = None
        if self.quantized:
            self.exp_avg = self._zeros(torch.int8)
            self.exp_avg_absmax = self._zeros(torch.float32, self.numel // QUANT_BLOCK)
            self.exp_avg_sq = self._zeros(torch.uint8)
            self.exp_avg_sq_absmax = self._zeros(torch.float32, self.numel // QUANT_BLOCK)
        else:
            self.exp_avg = self._zeros(state_dtype)
            self.exp_avg_sq = self._zeros(state_dtype)
        self.max_exp_avg_sq = None
        if amsgrad:
            self.ensure_amsgrad()
        self.master = None
        if master or staged:
            # staged (offloaded) chunks keep the parameters' CPU copy here
            dtype = torch.float32 if master else self.param_dtype
            self.master = self._empty(dtype)
            self.master.copy_(self._flat_params().to(state_device))
        self.master_is_fp32 = master
        # Offload staging: the gradients come down into `grad_staging`; a
        # low-precision parameter copy goes up from `param_staging`.
        self.staged = staged
        # (zeroed when padded: the padding must stay zero through the kernel)
        staging = self._zeros if self.quantized else self._empty
        self.grad_staging = staging(self.param_dtype) if staged else None
        self.param_staging = staging(self.param_dtype) if staged and master else None
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=state_device)
        # Host-side classes of parameters known to share a step count, and
        # the counters' version after the optimizer's last write: an in-place
        # write from outside (`state[p]["step"].zero_()` on the view) moves
        # it, and the classes are recomputed from the values.
        self.step_class = [0] * len(params)
        self.uniform = True
        self.steps_version = self.steps._version
        # The parameters' version counters when the optimizer last wrote them
        # (or seeded its copy); only chunks that keep their own copy of the
        # parameters (fp32 masters, offload) need them.
        self.versions: Optional[list[int]] = None
        self.record_versions()

    def find_shards(self) -> None:
        """The DTensor owners' local shards as they are now: FSDP2 may give a
        sharded parameter a new local tensor (``reset_sharded_param``), which
        the storage-address checks then treat like ``p.data = t``."""
        self.params = [local(p) for p in self.owners]

    def record_versions(self) -> None:
        if self.master is not None:
            self.versions = [p._version for p in self.owners]

    def repoint(self, index: int) -> bool:
        """Parameter ``index`` has a new storage address. True when it kept
        its dtype, device and strides (``p.data = t``): the chunk still fits,
        and its copy of the parameter is re-seeded at the next
        :meth:`reseed_changed`. False when the chunk no longer fits (new
        dtype, device or memory order); the old address stays recorded, so
        that :meth:`export_master` can tell the parameter was re-pointed."""
        param = self.params[index]
        if (param.dtype is not self.param_dtype or param.get_device() != self.device_index
                or param.stride() != self.strides[index]):
            return False
        self.pointers[index] = param.data_ptr()
        if self.versions is not None:
            self.versions[index] = None  # differs from any counter
        return True

    def reseed_changed(self, pointers: bool = False) -> bool:
        """Parameters written by the user since the optimizer last wrote them
        (``p.clamp_()``, ``model.load_state_dict()``: their version counter
        moved) are copied into the chunk's own copy, so the next update starts
        from the user's value, as with torch's optimizers. A master element
        whose rounding still equals the parameter keeps its extra bits.
        ``pointers``: also compare storage addresses, which ``p.data = t``
        moves without touching the version counter (the step compares them
        in :meth:`gradients` for parameters with a gradient; exports and syncs ask
        here). Returns False when a parameter was re-pointed at a tensor the
        chunk no longer fits: the states must move (``ChunkStore.rechunk``)."""
        if self.versions is None:
            return True
        fits = True
        if pointers:
            if self.sharded:
                self.find_shards()
            for index, (p, pointer) in enumerate(zip(self.params, self.pointers)):
                if p.data_ptr() != pointer and not self.repoint(index):
                    fits = False
        now = [p._version for p in self.owners]
        if now != self.versions:
            for index, (old, new) in enumerate(zip(self.versions, now)):
                if old != new:
                    self.seed_copy(index)
            self.versions = now
        return fits

    def export_master(self, index: int) -> torch.Tensor:
        """The fp32 master of parameter ``index`` as a re-chunk carries it
        over: the view itself, or, when the parameter was re-pointed at a
        tensor of another dtype, device or memory order (``p.data = t``,
        ``model.to(...)``), the master where the new value, rounded to the
        chunk's parameter dtype, equals the rounded master (a conversion of
        the old parameter keeps the master's bits), else the new value."""
        master = self.view(self.master, index)
        param = self.params[index]
        if param.data_ptr() != self.pointers[index]:
            value = param.detach().to(master.device)
            unchanged = value.to(self.param_dtype) == master.to(self.param_dtype)
            master = torch.where(unchanged, master, value.to(torch.float32))
        return shard_like(self.owners[index], master)

    def seed_copy(self, index: int) -> None:
        """The chunk's copy of parameter ``index`` from the parameter."""
        copy = self.view(self.master, index)
        param = self.params[index].detach().to(copy.device, non_blocking=False)
        if self.master_is_fp32:
            rounded = copy.to(param.dtype)
            copy.copy_(torch.where(rounded == param, copy, param.to(copy.dtype)))
        else:
            copy.copy_(param)

    def _empty(self, dtype: torch.dtype, numel: Optional[int] = None) -> torch.Tensor:
        numel = self.numel if numel is None else numel
        return torch.empty(numel, dtype=dtype, device=self.state_device, pin_memory=self.pin)

    def _zeros(self, dtype: torch.dtype, numel: Optional[int] = None) -> torch.Tensor:
        return self._empty(dtype, numel).zero_()

    def _flat_params(self) -> torch.Tensor:
        if self.quantized:
            return gather_padded([p.detach() for p in self.params])
        return torch.cat([memory_flat(p.detach()) for p in self.params])

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        # the flat range holds the parameter in the memory order it had when
        # the chunk was made: view it with those strides (channels_last stays
        # channels_last, and a later layout change of the parameter does not
        # scramble the values read through the view)
        return flat.as_strided(self.params[index].shape, self.strides[index],
                               flat.storage_offset() + self.offsets[index])

    def ensure_amsgrad(self) -> None:
        if self.max_exp_avg_sq is None:
            if self.quantized:
                self.max_exp_avg_sq = self._zeros(torch.uint8)
                self.max_exp_avg_sq_absmax = self._zeros(torch.float32, self.numel // QUANT_BLOCK)
            else:
                self.max_exp_avg_sq = self._zeros(self.state_dtype)

    def run(self, start: int, stop: int, amsgrad: bool) -> list[Optional[torch.Tensor]]:
        """The functional core's state arguments for parameters [start, stop)
        (:func:`~effilayers.optim.functional.chunked_adam`, or
        ``chunked_adam_8bit`` for a quantized chunk): the flat state ranges in
        the op's order, the fp32 master range (or None) and the step counters."""
        lo, hi = self.offsets[start], self.offsets[stop]
        master = self.master[lo:hi] if self.master_is_fp32 else None
        if not self.quantized:
            return [self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], self.max_exp_avg_sq[lo:hi] if amsgrad else None,
                    master, self.steps[start:stop]]
        blo, bhi = lo // QUANT_BLOCK, hi // QUANT_BLOCK
        return [self.exp_avg[lo:hi], self.exp_avg_absmax[blo:bhi], self.exp_avg_sq[lo:hi],
                self.exp_avg_sq_absmax[blo:bhi], self.max_exp_avg_sq[lo:hi] if amsgrad else None,
                self.max_exp_avg_sq_absmax[blo:bhi] if amsgrad else None, master, self.steps[start:stop]]

    def _quantized_names(self) -> list[tuple[str, Callable, Callable]]:
        names = [("exp_avg", quantize_exp_avg, dequantize_exp_avg),
                 ("exp_avg_sq", quantize_exp_avg_sq, dequantize_exp_avg_sq)]
        if self.max_exp_avg_sq is not None:
            names.append(("max_exp_avg_sq", quantize_exp_avg_sq, dequantize_exp_avg_sq))
        return names

    def export_state(self, index: int) -> dict[str, torch.Tensor]:
        """torch.optim.Adam's entry for a parameter of an 8-bit chunk: the
        states decoded to float32, shaped (and strided) like the parameter."""
        param = self.params[index]
        lo, hi = self.offsets[index], self.offsets[index + 1]
        entry = {"step": self.steps[index]}
        for name, _, decode in self._quantized_names():
            codes, absmax = getattr(self, name), getattr(self, name + "_absmax")
            values = decode(codes[lo:hi], absmax[lo // QUANT_BLOCK:hi // QUANT_BLOCK])
            out = torch.empty_strided(param.shape, self.strides[index], dtype=torch.float32,
                                      device=self.state_device)
            memory_flat(out).copy_(values[:self.sizes[index]])
            entry[name] = out
        if self.master_is_fp32:
            entry["master_param"] = self.view(self.master, index)
        return self._placed(index, entry)

    def _placed(self, index: int, entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torch's entry for a DTensor parameter: the tensors shaped like the
        parameter as DTensors placed like it (``step`` stays a plain tensor)."""
        if not self.sharded:
            return entry
        owner = self.owners[index]
        return {key: value if key == "step" else shard_like(owner, value) for key, value in entry.items()}

    def import_state(self, index: int, name: str, value: torch.Tensor) -> None:
        """Encode a float state tensor shaped like parameter ``index`` into its blocks."""
        param = self.params[index]
        lo, hi = self.offsets[index], self.offsets[index + 1]
        encode = {n: e for n, e, _ in self._quantized_names()}[name]
        shaped = torch.empty_strided(param.shape, self.strides[index], dtype=torch.float32,
                                     device=self.state_device)
        shaped.copy_(value)
        padded = torch.zeros(hi - lo, dtype=torch.float32, device=self.state_device)
        padded[:self.sizes[index]] = memory_flat(shaped)
        codes, absmax = encode(padded)
        getattr(self, name)[lo:hi].copy_(codes)
        getattr(self, name + "_absmax")[lo // QUANT_BLOCK:hi // QUANT_BLOCK].copy_(absmax)

    def torch_entry(self, index: int) -> dict[str, torch.Tensor]:
        """torch.optim.Adam's entry for parameter ``index`` (views, or decoded
        copies for 8-bit states)."""
        return self.export_state(index) if self.quantized else self.param_state(index)

    def storages(self) -> list[int]:
        """Addresses of the storages of the chunk's buffers."""
        buffers = (self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.exp_avg_absmax, self.exp_avg_sq_absmax,
                   self.max_exp_avg_sq_absmax, self.master, self.steps)
        return [buffer.untyped_storage().data_ptr() for buffer in buffers if buffer is not None]

    def reset(self, index: int) -> None:
        """Fresh state for parameter ``index``: step 0, zero moments, its copy
        (master / offload) from the parameter."""
        lo, hi = self.offsets[index], self.offsets[index + 1]
        self.steps[index].zero_()
        for name in _MOMENTS:
            if getattr(self, name) is not None:
                getattr(self, name)[lo:hi].zero_()
                if self.quantized:
                    getattr(self, name + "_absmax")[lo // QUANT_BLOCK:hi // QUANT_BLOCK].zero_()
        if self.master is not None:
            self.view(self.master, index).copy_(self.params[index].detach())

    def import_value(self, index: int, key: str, value: Any) -> None:
        """One value of a state entry (torch's layout, or this class's raw
        8-bit payload) into the chunk; unknown keys are ignored, as torch does."""
        if key == "step":
            if is_sharded(value):  # a step saved as a DTensor (replicated): its local copy
                value = value.to_local()
            self.steps[index].copy_(torch.as_tensor(value, dtype=torch.float32))
            return
        if key == "master_param":
            if self.master_is_fp32:
                self.view(self.master, index).copy_(local_value(self.owners[index], value, key))
            return
        name, part, _ = key.partition("_codes") if key.endswith("_codes") else key.partition("_absmax")
        if name not in _MOMENTS or (part and not self.quantized):
            return
        if not part:  # a float tensor shaped like the parameter (the raw 8-bit ranges are local already)
            value = local_value(self.owners[index], value, key)
        if name == "max_exp_avg_sq":
            self.ensure_amsgrad()
        lo, hi = self.offsets[index], self.offsets[index + 1]
        if not part:  # a float tensor shaped like the parameter
            if self.quantized:
                self.import_state(index, name, value)
            else:
                self.view(getattr(self, name), index).copy_(value)
        elif part == "_codes":
            getattr(self, name)[lo:hi].copy_(value)
        else:
            getattr(self, key)[lo // QUANT_BLOCK:hi // QUANT_BLOCK].copy_(value)

    def param_state(self, index: int) -> dict[str, torch.Tensor]:
        if self.quantized:
            # the raw payload: 1-D code ranges (padded) and their block scales
            lo, hi = self.offsets[index], self.offsets[index + 1]
            state = {"step": self.steps[index]}
            for name, _, _ in self._quantized_names():
                state[name + "_codes"] = getattr(self, name)[lo:hi]
                state[name + "_absmax"] = getattr(self, name + "_absmax")[lo // QUANT_BLOCK:hi // QUANT_BLOCK]
            if self.master_is_fp32:
                state["master_param"] = shard_like(self.owners[index], self.view(self.master, index))
            return state
        state = {
            "step": self.steps[index],
            "exp_avg": self.view(self.exp_avg, index),
            "exp_avg_sq": self.view(self.exp_avg_sq, index),
        }
        if self.max_exp_avg_sq is not None:
            state["max_exp_avg_sq"] = self.view(self.max_exp_avg_sq, index)
        if self.master_is_fp32:
            state["master_param"] = self.view(self.master, index)
        return self._placed(index, state)

    def runs(self, grads: list[Optional[torch.Tensor]], complete: bool) -> list[tuple[int, int]]:
        """Maximal ranges of parameters that have a gradient now and share a
        step count; updates the host-side classes for the ones left out.
        ``complete``: every parameter has a gradient."""
        count = len(self.params)
        if self.uniform and complete:
            return [(0, count)]
        has_grad = [g is not None for g in grads]
        runs: list[tuple[int, int]] = []
        start = None
        for index in range(count + 1):
            ends = (index == count or not has_grad[index]
                    or (start is not None and self.step_class[index] != self.step_class[start]))
            if start is not None and ends:
                runs.append((start, index))
                start = None
            if index < count and has_grad[index] and start is None:
                start = index
        # Parameters skipped now fall behind the ones that step: new classes.
        renamed: dict[int, int] = {}
        fresh = max(self.step_class) + 1
        for index, present in enumerate(has_grad):
            if not present:
                old = self.step_class[index]
                if old not in renamed:
                    renamed[old] = fresh
                    fresh += 1
                self.step_class[index] = renamed[old]
        self.uniform = len(set(self.step_class)) == 1
        return runs

    def reclassify_from_steps(self) -> None:
        """Step classes from the counters' values (a host read: only after
        writes from outside, never on the ordinary step path)."""
        values = self.steps.tolist()
        ids: dict[float, int] = {}
        self.step_class = [ids.setdefault(v, len(ids)) for v in values]
        self.uniform = len(ids) <= 1
        self.steps_version = self.steps._version

    def updated(self) -> None:
        """After the optimizer's own update: the parameters' and the
        counters' versions now are its writes, not the user's."""
        self.record_versions()
        self.steps_version = self.steps._version

    def check_steps(self) -> None:
        """Recompute the step classes if a counter was written in place from
        outside since the optimizer's last write (a host-side int compare)."""
        if self.steps._version != self.steps_version:
            self.reclassify_from_steps()

    def gradients(self, owner: str) -> Optional[tuple[list[Optional[torch.Tensor]], bool]]:
        """The chunk's gradients in its parameters' layout and whether every
        parameter has one; None when a parameter's dtype or device changed.
        ``owner``: the optimizer's name, for the error messages."""
        grads = []
        complete = True
        if self.sharded:
            self.find_shards()
        for index, (p, contiguous, pointer) in enumerate(zip(self.params, self.contiguous, self.pointers)):
            g = self.owners[index].grad
            if g is None:
                complete = False
            else:
                if self.sharded:
                    g = local_grad(self.owners[index], g)
                # a new storage address is the one cheap sign of `p.data = t`
                # and of a changed dtype, device or memory order (a copy)
                if p.data_ptr() != pointer and not self.repoint(index):
                    return None
                if not (contiguous and g.is_contiguous()):  # (a sparse tensor is not contiguous)
                    refuse_sparse(owner, g)
                    if g.stride() != p.stride() and not same_layout(g, p):
                        g = torch.empty_like(p).copy_(g)  # the parameter's strides
            grads.append(g)
        return grads, complete
