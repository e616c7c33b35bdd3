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

8-bit states
------------
``state_dtype="8bit"`` stores ``exp_avg`` as int8 and ``exp_avg_sq`` /
``max_exp_avg_sq`` as uint8 codes with one float32 absmax per block of 256
elements (``effilayers.ops.adam`` describes the companded codes and why they
are not linear). In these chunks every parameter starts on a block boundary,
so each flat buffer (codes, master weights, offload staging) is padded per
parameter to a multiple of 256 and a block never mixes parameters. State
memory: 2 + 8/256 bytes per parameter plus the padding, against 8 for fp32
states. ``self.state[p]`` holds the raw payload (``exp_avg_codes``,
``exp_avg_absmax``, ``exp_avg_sq_codes``, ``exp_avg_sq_absmax``, ...);
``state_dict()`` exports the decoded float32 states in torch's layout (new
tensors, so a checkpoint loads into ``torch.optim.AdamW``) and
``load_state_dict`` encodes them again (decode -> encode reproduces the
codes). Measured accuracy: README, "Chunked Adam / AdamW".

Steps without host synchronisation
----------------------------------
The step counters are tensors on the state device. Before a chunk's kernel
runs, its counters are increased by ``found_inf == 0`` (by 1 without a
GradScaler; an indicator, because GradScaler sums found_inf over devices),
and the kernel derives the bias corrections from the counter
itself and writes nothing when ``found_inf`` is non-zero: a skipped step
changes nothing, step count included, without the host reading a flag.
Parameters that get no gradient in a step are left out of that step (like
torch), which splits the chunk into runs of parameters that share a step
count; the host tracks which parameters may have diverged from the pattern
of gradients it has seen, so the common case stays one kernel per chunk.

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

Offload
-------
``offload="cpu"`` keeps states and master weights in CPU memory (pinned when
CUDA is present). For CUDA parameters each chunk's gradients are copied down
into a pinned staging buffer on a side stream, the C++ CPU kernel updates the
chunk, and the parameters are copied back up on another side stream, the
copies of one chunk overlapping the CPU work on its neighbour. For CPU
parameters the states are already on the CPU and the step is the ordinary one.
The staged pipeline has not been run on a GPU in this repository yet (no GPU
was available when it was written); the same code runs in the tests with the
streams replaced by synchronous copies.
"""

from __future__ import annotations

import copy
import itertools
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch.optim import Optimizer

from .._core import registry
from .._core.layout import is_dense, memory_flat, same_layout
from ..ops.adam import (PARAM_DTYPES, QUANT_BLOCK, STATE_DTYPES, AdamHyperParams, check_adam_8bit_arguments,
                        check_adam_arguments, dequantize_exp_avg, dequantize_exp_avg_sq, gather_padded, padded_numel,
                        quantize_exp_avg, quantize_exp_avg_sq)

__all__ = ["ChunkedAdam", "ChunkedAdamW", "chunked_adam", "chunked_adam_8bit", "DEFAULT_CHUNK_SIZE", "EIGHT_BIT"]

DEFAULT_CHUNK_SIZE = 1 << 24
# state_dtype spelling of the 8-bit block-quantized states
EIGHT_BIT = "8bit"
_OFFLOAD = (None, "cpu")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# attributes a pickled or deep-copied optimizer keeps besides torch's
_PICKLED_SETTINGS = ("state_dtype", "master_weights", "offload", "chunk_size", "_force_staging")


def chunked_adam(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor], master: Optional[torch.Tensor],
                 steps: torch.Tensor, grad_scale: Optional[torch.Tensor] = None,
                 found_inf: Optional[torch.Tensor] = None, *, hyper: AdamHyperParams, check: bool = True) -> None:
    """One Adam/AdamW step of a run of parameters that share a step count,
    with flat states (``exp_avg`` etc. cover the params laid end to end, the
    layout of ``effilayers.ops.adam.adam_step_``). ``steps`` holds one
    float32 counter per parameter; it is advanced by one here (by nothing
    when ``found_inf`` is non-zero), on its own device, before the kernel
    reads it. ``check=False`` skips the Python-side argument checks (the
    optimizer's chunks satisfy them by construction; the C++ kernel checks
    regardless)."""
    if check:
        check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, steps[:1])
    _fused_update(False, params, grads, [exp_avg, exp_avg_sq, max_exp_avg_sq], master, steps, grad_scale,
                  found_inf, hyper)


def chunked_adam_8bit(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: torch.Tensor,
                      exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor, exp_avg_sq_absmax: torch.Tensor,
                      max_exp_avg_sq: Optional[torch.Tensor], max_exp_avg_sq_absmax: Optional[torch.Tensor],
                      master: Optional[torch.Tensor], steps: torch.Tensor, grad_scale: Optional[torch.Tensor] = None,
                      found_inf: Optional[torch.Tensor] = None, *, hyper: AdamHyperParams,
                      check: bool = True) -> None:
    """:func:`chunked_adam` on 8-bit block-quantized states (the layout of
    ``effilayers.ops.adam.adam_step_8bit_``: each parameter's states padded to
    a multiple of ``QUANT_BLOCK``)."""
    states = [exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq, max_exp_avg_sq_absmax]
    if check:
        check_adam_8bit_arguments(params, grads, *states, master, steps[:1])
    _fused_update(True, params, grads, states, master, steps, grad_scale, found_inf, hyper)


def _advance_steps(steps: torch.Tensor, found_inf: Optional[torch.Tensor]) -> None:
    if found_inf is None:
        steps.add_(1)
    else:
        # An indicator, not the value: GradScaler sums found_inf over devices
        # (2.0 with two overflowing GPUs). Non-zero (NaN included) skips, as
        # in the kernels. A copy to the CPU blocks: a non_blocking one may
        # return before the value lands, and add_ reads it at once.
        steps.add_(found_inf.to(steps.device, non_blocking=steps.device.type != "cpu") == 0)


def _fused_update(quantized: bool, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  states: Sequence[Optional[torch.Tensor]], master: Optional[torch.Tensor], steps: torch.Tensor,
                  grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
                  hyper: AdamHyperParams) -> None:
    """Advance ``steps`` and run one kernel on states in the op's order
    (``quantized``: the 8-bit op's codes and scales), without checks.

    Eager steps call the kernel the op would run (``registry.kernel``)
    directly and bump the version counters of what it wrote in one call, as
    the op's ADInplaceOrView step does: the custom op's Python-level dispatch
    (a version bump per tensor, alias checks) costs more than the update of
    a small tensor (bench_optim.py, ``step overhead``). Under torch.compile
    the op itself is called."""
    _advance_steps(steps, found_inf)
    device = states[0].device
    args = (params, grads, *states, master, steps[:1],
            None if grad_scale is None else grad_scale.to(device, torch.float32),
            None if found_inf is None else found_inf.to(device, torch.float32), *hyper)
    if torch.compiler.is_compiling():
        (torch.ops.effilayers.adam_step_8bit_ if quantized else torch.ops.effilayers.adam_step_)(*args)
        return
    registry.kernel("adam_step_8bit" if quantized else "adam_step", device)(*args)
    written = [*params, *(t for t in states if t is not None)]
    if master is not None:
        written.append(master)
    torch.autograd.graph.increment_version(written)


class _Chunk:
    """The states of a run of parameters of one group, device and dtype."""

    def __init__(self, params: list[torch.Tensor], state_device: torch.device, state_dtype, master: bool,
                 amsgrad: bool, staged: bool, pin: bool) -> None:
        self.params = params
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

    def record_versions(self) -> None:
        if self.master is not None:
            self.versions = [p._version for p in self.params]

    def repointed(self, param: torch.Tensor) -> bool:
        """``param`` (one of the chunk's) has a new storage address: see
        :meth:`repoint`."""
        return self.repoint(next(i for i, member in enumerate(self.params) if member is param))

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
        in ``_grads`` for parameters with a gradient; exports and syncs ask
        here). Returns False when a parameter was re-pointed at a tensor the
        chunk no longer fits: the states must move (``_rechunk``)."""
        if self.versions is None:
            return True
        fits = True
        if pointers:
            for index, (p, pointer) in enumerate(zip(self.params, self.pointers)):
                if p.data_ptr() != pointer and not self.repoint(index):
                    fits = False
        now = [p._version for p in self.params]
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
        if param.data_ptr() == self.pointers[index]:
            return master
        value = param.detach().to(master.device)
        unchanged = value.to(self.param_dtype) == master.to(self.param_dtype)
        return torch.where(unchanged, master, value.to(torch.float32))

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

    def state_args(self, lo: int, hi: int, amsgrad: bool) -> list[Optional[torch.Tensor]]:
        """The state arguments of the kernel for flat range [lo, hi), in the
        op's order (without master)."""
        if not self.quantized:
            return [self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], self.max_exp_avg_sq[lo:hi] if amsgrad else None]
        blo, bhi = lo // QUANT_BLOCK, hi // QUANT_BLOCK
        return [self.exp_avg[lo:hi], self.exp_avg_absmax[blo:bhi], self.exp_avg_sq[lo:hi],
                self.exp_avg_sq_absmax[blo:bhi], self.max_exp_avg_sq[lo:hi] if amsgrad else None,
                self.max_exp_avg_sq_absmax[blo:bhi] if amsgrad else None]

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
        return entry

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
            self.steps[index].copy_(torch.as_tensor(value, dtype=torch.float32))
            return
        if key == "master_param":
            if self.master_is_fp32:
                self.view(self.master, index).copy_(value)
            return
        name, part, _ = key.partition("_codes") if key.endswith("_codes") else key.partition("_absmax")
        if name not in _MOMENTS or (part and not self.quantized):
            return
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
                state["master_param"] = self.view(self.master, index)
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
        return state

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


class _Transfers:
    """Copies between parameter device and CPU states for offloaded chunks.
    On CUDA: side streams and events, so chunk i+1's gradients come down while
    the CPU updates chunk i, and parameters go up while the CPU works on the
    next chunk. Without CUDA every copy is synchronous and waits are no-ops."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.down = torch.cuda.Stream(device)
            self.up = torch.cuda.Stream(device)
            self.main = torch.cuda.current_stream(device)

    def copy_down(self, chunk: _Chunk, start: int, stop: int, grads: list[torch.Tensor]):
        targets = [chunk.view(chunk.grad_staging, i) for i in range(start, stop)]
        if not self.cuda:
            torch._foreach_copy_(targets, grads)
            return None
        # the gradients were produced on the main stream
        self.down.wait_stream(self.main)
        with torch.cuda.stream(self.down):
            torch._foreach_copy_(targets, grads, non_blocking=True)
            for g in grads:
                g.record_stream(self.down)
            done = torch.cuda.Event()
            done.record(self.down)
        return done

    def wait_down(self, done) -> None:
        if done is not None:
            done.synchronize()

    def copy_up(self, chunk: _Chunk, start: int, stop: int) -> None:
        source = chunk.param_staging if chunk.param_staging is not None else chunk.master
        params = [p.detach() for p in chunk.params[start:stop]]
        sources = [chunk.view(source, i) for i in range(start, stop)]
        if not self.cuda:
            torch._foreach_copy_(params, sources)
            return
        self.up.wait_stream(self.main)
        with torch.cuda.stream(self.up):
            torch._foreach_copy_(params, sources, non_blocking=True)

    def finish(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.up)


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
      the decoded block. See the module docstring for the layout and
      state-dict behaviour.
    * ``master_weights``: keep an fp32 copy of fp16/bf16 parameters in the
      chunks and update that (default True); the parameter receives the
      rounded result.
    * ``offload``: ``None`` or ``"cpu"`` (states and master weights in CPU
      memory; see the module docstring).
    * ``chunk_size``: elements per chunk (default ``2**24``; on CPU
      ``2**26`` measured faster, see the module docstring).

    Host synchronisation: none per step on GPU, except that ``lr`` (and
    betas, eps, weight_decay) are read with ``float()`` once per param group
    per step: a CUDA tensor ``lr`` costs one device-to-host sync per group
    per step; a Python float or a CPU tensor costs none.

    Works with ``torch.amp.GradScaler`` (``scaler.step(opt)`` hands the scale
    and the overflow flag to the kernel), LR schedulers,
    ``zero_grad(set_to_none=True)`` and parameters without a gradient in a
    step. Not supported, with an error: sparse gradients, complex parameters,
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
        _check_hyperparameters(name, lr, betas, eps, weight_decay)
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
        self.state_dtype = state_dtype
        self.master_weights = bool(master_weights)
        self.offload = offload
        self.chunk_size = chunk_size
        # (group index, device, dtype) -> chunks, in order of first use
        self._chunks: dict[tuple[int, torch.device, torch.dtype], list[_Chunk]] = defaultdict(list)
        # id(param) -> (chunk, index); ids, not tensors, as keys: a tensor
        # hashes through a Python-level __hash__, several times slower
        self._location: dict[int, tuple[_Chunk, int]] = {}
        # group index -> (ids of its params, its params without a chunk yet)
        self._unlocated: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        # ids of each group's params at the last step (edits are compared with it)
        self._members: Optional[list[list[int]]] = None
        # Exercise the offload staging on CPU parameters (tests); on CUDA it
        # is on whenever offload="cpu".
        self._force_staging = False
        self._transfers: dict[torch.device, _Transfers] = {}
        super().__init__(params, defaults)
        # GradScaler.step hands us `grad_scale` and `found_inf` as attributes.
        self._step_supports_amp_scaling = True

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
                if not is_dense(p):
                    raise ValueError(f"{name}: parameters must be dense, contiguous or a permutation of it like "
                                     f"channels_last (got strides {p.stride()} for shape {tuple(p.shape)}); "
                                     "call .contiguous() on the parameter's data")
        _check_listed_once(name, [item[1] if isinstance(item, tuple) else item for item in params],
                           f"param group {len(self.param_groups)}")
        group = dict(param_group, params=params)  # a generator is consumed by the checks above
        _check_hyperparameters(name, group.get("lr", self.defaults["lr"]), group.get("betas", self.defaults["betas"]),
                               group.get("eps", self.defaults["eps"]),
                               group.get("weight_decay", self.defaults["weight_decay"]))
        super().add_param_group(group)

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
            state.mark(chunk.params[index])
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
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in owned:
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
        for index, p in enumerate(chunk.params):
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
                for index, p in enumerate(chunk.params):
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
        self._chunks.clear()
        self._location.clear()
        self._unlocated.clear()
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
               for (group_index, _, _), chunks in self._chunks.items() for chunk in chunks for p in chunk.params):
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
                    for index, member in enumerate(chunk.params):
                        self._location[id(member)] = (chunk, index)
                    self._refresh_state(chunk)

            for p in members:
                span = padded_numel(p.numel()) if state_dtype == EIGHT_BIT else p.numel()
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
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, please consider "
                                       "SparseAdam instead")
                fresh.append(p)
        if fresh:
            self._assign(group_index, fresh)

    def chunk_layout(self) -> list[dict[str, Any]]:
        """One entry per chunk: group, device, dtypes, element count, params."""
        layout = []
        for (group_index, device, dtype), chunks in self._chunks.items():
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
        if self.state.pending:
            self._sync_state()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        hypers = [_hyper_params(group) for group in self.param_groups]
        for group_index, device, work in self._collect_work():
            amsgrad = self.param_groups[group_index]["amsgrad"]
            if any(chunk.staged for chunk, _, _ in work):
                self._step_staged(work, device, grad_scale, found_inf, amsgrad, hypers[group_index])
                continue
            for chunk, grads, complete in work:
                self._step_chunk(chunk, grads, complete, grad_scale, found_inf, amsgrad, hypers[group_index])
        return loss

    def _collect_work(self) -> list[tuple[int, torch.device, list]]:
        """(group index, device, [(chunk, grads, every param has a grad)])
        for every chunk, checked before any kernel runs: when a parameter
        changed dtype or device, the states are moved first (_rechunk)."""
        for _ in range(2):
            members = self._check_groups()
            for group_index, group in enumerate(self.param_groups):
                self._locate_new(group_index, group, members[group_index])
            collected, moved = [], False
            for (group_index, device, _), chunks in self._chunks.items():
                work = [(chunk, self._grads(chunk)) for chunk in chunks]
                if any(grads is None for _, grads in work):
                    moved = True
                    break
                collected.append((group_index, device, [(chunk, *grads) for chunk, grads in work]))
            if not moved:
                return collected
            self._rechunk()
        raise AssertionError("parameters still differ from their chunks after re-chunking")

    def _grads(self, chunk: _Chunk) -> Optional[tuple[list[Optional[torch.Tensor]], bool]]:
        """The chunk's gradients in its parameters' layout and whether every
        parameter has one; None when a parameter's dtype or device changed."""
        grads = []
        complete = True
        for p, contiguous, pointer in zip(chunk.params, chunk.contiguous, chunk.pointers):
            g = p.grad
            if g is None:
                complete = False
            else:
                # a new storage address is the one cheap sign of `p.data = t`
                # and of a changed dtype, device or memory order (a copy)
                if p.data_ptr() != pointer and not chunk.repointed(p):
                    return None
                if not (contiguous and g.is_contiguous()):  # (a sparse tensor is not contiguous)
                    if g.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, please "
                                           "consider SparseAdam instead")
                    if g.stride() != p.stride() and not same_layout(g, p):
                        g = torch.empty_like(p).copy_(g)  # the parameter's strides
            grads.append(g)
        return grads, complete

    def _before_update(self, chunk: _Chunk, amsgrad: bool) -> None:
        """What a chunk needs before its update: the user's writes to the
        parameters in its copy, amsgrad's buffer if just switched on, step
        classes redone after an outside write to the counters."""
        chunk.reseed_changed()
        if amsgrad and chunk.max_exp_avg_sq is None:
            chunk.ensure_amsgrad()
            self._refresh_state(chunk)
        chunk.check_steps()

    def _step_chunk(self, chunk: _Chunk, grads, complete: bool, grad_scale, found_inf, amsgrad: bool,
                    hyper: AdamHyperParams) -> None:
        self._before_update(chunk, amsgrad)
        for start, stop in chunk.runs(grads, complete):
            lo, hi = chunk.offsets[start], chunk.offsets[stop]
            _update(chunk, chunk.params[start:stop], grads[start:stop], lo, hi,
                    chunk.master[lo:hi] if chunk.master is not None else None, chunk.steps[start:stop],
                    grad_scale, found_inf, amsgrad, hyper)
        chunk.updated()

    def _step_staged(self, chunks: list, device: torch.device, grad_scale, found_inf, amsgrad: bool,
                     hyper: AdamHyperParams) -> None:
        """Offloaded chunks: gradients down, CPU kernel, parameters up; the
        next run's gradients are on their way while the CPU works."""
        transfers = self._transfers.get(device)
        if transfers is None:
            transfers = self._transfers[device] = _Transfers(device)
        work = []
        for chunk, grads, complete in chunks:
            self._before_update(chunk, amsgrad)
            for start, stop in chunk.runs(grads, complete):
                work.append((chunk, start, stop, grads[start:stop]))
        if not work:
            return
        # Blocking copies: a non_blocking device-to-host copy may return before
        # the value lands, and the CPU kernel must wait for the gradients anyway.
        cpu_scale = None if grad_scale is None else grad_scale.to("cpu", torch.float32)
        cpu_found = None if found_inf is None else found_inf.to("cpu", torch.float32)
        pending = transfers.copy_down(*work[0])
        for position, (chunk, start, stop, _) in enumerate(work):
            done = pending
            if position + 1 < len(work):
                pending = transfers.copy_down(*work[position + 1])
            transfers.wait_down(done)
            lo, hi = chunk.offsets[start], chunk.offsets[stop]
            grad_flat = chunk.grad_staging[lo:hi]
            if chunk.master_is_fp32:
                params, master = [chunk.param_staging[lo:hi]], chunk.master[lo:hi]
            else:
                params, master = [chunk.master[lo:hi]], None
            _update(chunk, params, [grad_flat], lo, hi, master, chunk.steps[start:stop], cpu_scale, cpu_found,
                    amsgrad, hyper)
            transfers.copy_up(chunk, start, stop)
        transfers.finish()
        for chunk, _, _ in chunks:
            chunk.updated()

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
        self._settle()
        # torch's packing: parameters numbered by position across the
        # groups (a repeated parameter keeps its first number)
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
        state_dict = {"state": packed_state, "param_groups": groups}
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
        name = type(self).__name__
        state_dict = state_dict.copy()  # shallow, as torch's: a pre hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
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
        self._chunks.clear()
        self._location.clear()
        self._unlocated.clear()
        self.state = {p: saved_state[i] for group, saved in zip(groups, saved_groups)
                      for p, i in zip(group["params"], saved["params"]) if i in saved_state}
        self._sync_state()
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

    def _exported(self, compact: bool) -> dict[str, Any]:
        self._settle()
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
        super().__setstate__(state)
        self._chunks = defaultdict(list)
        self._location = {}
        self._unlocated = {}
        self._members = None
        self._transfers = {}
        self._step_supports_amp_scaling = True
        self.state = entries


def _update(chunk: _Chunk, params, grads, lo: int, hi: int, master, steps, grad_scale, found_inf, amsgrad: bool,
            hyper: AdamHyperParams) -> None:
    """One kernel call for the run [lo, hi) of a chunk, on its state format."""
    _fused_update(chunk.quantized, params, grads, chunk.state_args(lo, hi, amsgrad), master, steps, grad_scale,
                  found_inf, hyper)


def _hyper_params(group: dict[str, Any]) -> AdamHyperParams:
    """The group's settings for the kernels. AdamHyperParams reads them with
    float(): a CUDA tensor lr or beta costs a host sync here (README)."""
    beta1, beta2 = group["betas"]
    return AdamHyperParams(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"], decoupled_weight_decay=group["decoupled_weight_decay"],
                           maximize=group["maximize"])


class ChunkedAdamW(ChunkedAdam):
    """``torch.optim.AdamW`` (decoupled weight decay, default 0.01) on flat
    chunks; see :class:`ChunkedAdam` for the extra arguments."""

    _default_decoupled = True

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


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


def _check_hyperparameters(name: str, lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{name}: lr as a Tensor must have one element, got {lr.numel()}")
        lr = float(lr)
    if not isinstance(lr, (int, float)) or not 0.0 <= lr:
        raise ValueError(f"{name}: lr must be a float >= 0, got {lr!r}")
    if not 0.0 <= eps:
        raise ValueError(f"{name}: eps must be >= 0, got {eps!r}")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}") from None
    for index, beta in enumerate((beta1, beta2)):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"{name}: betas[{index}] must be in [0, 1), got {beta!r}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay!r}")
