"""Triton kernels of ``effilayers::adam_step_`` and ``effilayers::adam_step_8bit_`` on GPU.

Why Triton and not CUDA: it runs in CI on CPU tensors under
``TRITON_INTERPRET=1``, and this file was written on a machine without a GPU.
The choice is provisional: CUDA versus Triton for this op must be re-decided
by measurement on a GPU (achieved bandwidth of the step against a
device-to-device copy of the same bytes), and the loser deleted.

Parameters and gradients in place
---------------------------------
A chunk's states are flat buffers; its parameters and gradients are separate
tensors wherever the model put them. The kernels reach them through two
small int64 tables on the device (the multi-tensor-apply pattern):

* the parameter table, one row per parameter: (parameter address, gradient
  address, numel, first element of its states in the flat buffers);
* the tile table, one row per program: (parameter row, first element of the
  tile in the parameter), so a program updates up to ``BLOCK`` elements of
  one parameter and a tile never straddles two.

The addresses are those of the parameters' and gradients' memory (a dense
tensor's ``data_ptr`` is its lowest address, in any permuted layout), and a
gradient has its parameter's strides (``contract.check_adam_arguments``; the optimizer
copies a gradient of another layout into the parameter's first), so element
``k`` of a parameter's memory, of its gradient's and ``first + k`` of the
state buffers belong together. Offsets are int64 throughout: a parameter
larger than the chunk size gets a chunk of its own, which may exceed 2^31
elements.

Bytes moved per element: every parameter, gradient and state element is
read once and written at most once. fp32 parameters with fp32 states: read
p, g, m, v and write p, m, v = 28 bytes (the floor of a one-pass update);
with bf16 states 20; fp16/bf16 parameters with fp32 masters and fp32 states:
read g, master, m, v and write p, master, m, v = 28 (the low-precision
parameter is written, not read); amsgrad adds a read and a write of its
state (8 bytes in fp32). 8-bit states, fp32 parameters: p and g 4 bytes
each way, one byte per moment each way, plus the two float32 scales of each
256-element block read and written: 16.06 bytes. On top, each program reads
its 16-byte tile row and its parameter's 32-byte row: under 0.05 bytes per
element. (Before, a multi-parameter chunk was gathered with ``torch.cat``
into flat temporaries and scattered back with ``torch._foreach_copy_``:
~52 bytes per fp32 element, and two chunk-sized temporaries.) None of this
has been measured on a GPU yet.

Vector accesses: for tensor arguments the launcher tells the compiler which
pointers are 16-byte aligned and which integers are multiples of 16, and
that is what lets it turn a thread's contiguous elements into 128-bit loads
and stores. Addresses and numels read from a table carry no such facts, so
the host checks them once per table (every parameter and gradient on 16
bytes, every numel a multiple of ``VECTOR``, the elements in 16 bytes of the
narrowest buffer indexed per element, so every parameter's first state
element is one too) and, when they hold, the kernels are specialised
(``ALIGNED``) to assert them with ``tl.multiple_of``. Compiled for sm_90 on
a machine without a GPU (Triton 3.9, ``triton.compile`` to PTX;
tests/test_optim_kernel.py::test_triton_kernels_compile_to_vector_accesses), the
aligned multi-parameter kernels have the same vector accesses as the
one-parameter ones, and the unaligned ones one 32-bit or narrower access
per parameter and gradient element (and per state element, except the 8-bit
codes, whose blocks are always aligned); what that costs in bandwidth is
unmeasured. Real models' parameters are almost always aligned (separate
allocations, sizes multiples of 8).

Host work per call (after the op's argument checks): one pass over the parameters
reading numel and the two addresses, and two dictionary lookups. The tile
table depends only on the numels, the parameter table on the addresses too;
both stay on the device in small caches (``_TILE_TABLES``,
``_PARAMETER_TABLES``) keyed by everything they hold plus device and
stream, so an entry is right for any call that finds it. In a steady
training loop the caching allocator normally hands the gradients the same
addresses every step, also with ``zero_grad(set_to_none=True)``, and the
tables are built once (not verified on a GPU here). A miss costs one small
host-to-device copy per table, from pinned memory, queued on the current
stream without making the host wait (the caching host allocator keeps the
pinned buffer until the copy has run). The stream is part of the key, so a
table is only read by kernels on the stream its memory was allocated on, and
a table evicted from the cache goes back to the allocator ordered after
them. A chunk of one parameter needs no table at all: the kernels are
specialised (``SINGLE``) to take it as an argument, as before.

Not supported: CUDA graph capture (a missing table is copied from the host
during the call, and a captured graph would go on reading cached tables
after the cache let them go).

No host synchronisation: the step count, the gradient scale and the
overflow flag are read by the kernel from device memory; with ``found_inf``
non-zero every store is masked off.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from ..._core.cache import TableCache
from ..._core.kernel_spec import KernelSpec
from ..._core.layout import memory_flat
from .contract import QUANT_BLOCK, AdamHyperParams, padded_numel

# 1024 elements x (p, g, m, v) per program: enough bytes in flight per SM for
# a memory-bound update; 4 warps keep 8 elements per thread.
BLOCK = 1024
NUM_WARPS = 4
PARAMETER_COLUMNS = tl.constexpr(4)  # (param address, grad address, numel, first state element)
# Tables kept on each device (per stream). One entry per chunk (per run of
# parameters sharing a step count) is used each step; the tile table of a
# chunk of 2^24 elements is 256 KiB (0.2 % of its fp32 states).
CACHED_TABLES = 256


@triton.jit
def _locate(parameter_table, tile_table, first_param, first_grad, n, SINGLE: tl.constexpr, ALIGNED: tl.constexpr,
            VECTOR: tl.constexpr, STATE_MULTIPLE: tl.constexpr, BLOCK: tl.constexpr):
    """This program's work: (parameter pointer, gradient pointer, the
    parameter's numel, its first element in the flat state buffers, the
    tile's first element in the parameter). ``STATE_MULTIPLE``: what every
    first state element is known to be a multiple of (the 8-bit layout's
    block).

    (The alignment hints are given here, on the loads themselves: a
    ``tl.multiple_of`` on one result of a call of this function was seen, in
    Triton 3.9's TTIR, to mark every value the function returns.)"""
    program = tl.program_id(0).to(tl.int64)
    if SINGLE:
        param = first_param
        grad = first_grad
        numel = n
        state_first = 0
        first = program * BLOCK
    else:
        parameter = tl.load(tile_table + 2 * program)
        first = tl.multiple_of(tl.load(tile_table + 2 * program + 1), BLOCK)
        row = parameter_table + PARAMETER_COLUMNS * parameter
        # first_param's pointer type: the parameters' dtype (grads share it)
        param = tl.load(row).to(first_param.dtype)
        grad = tl.load(row + 1).to(first_param.dtype)
        numel = tl.load(row + 2)
        state_first = tl.load(row + 3)
        if ALIGNED:
            # What the launcher would know of tensor arguments, checked on the
            # host (_parameter_table): without it the compiler cannot prove
            # that VECTOR elements starting at a multiple of VECTOR are all in
            # or all out of range and 16-byte aligned, and emits one 32-bit
            # access per element instead of 128-bit ones (seen in the PTX for
            # sm_90; the speed difference is unmeasured).
            param = tl.multiple_of(param, 16)
            grad = tl.multiple_of(grad, 16)
            numel = tl.multiple_of(numel, VECTOR)
        if STATE_MULTIPLE > 1:
            state_first = tl.multiple_of(state_first, STATE_MULTIPLE)
        elif ALIGNED:
            state_first = tl.multiple_of(state_first, VECTOR)
    return param, grad, numel, state_first, first


@triton.jit
def _bias_corrections(step_ptr, lr, log_beta1, log_beta2):
    """(step size, square root of the second bias correction) for the step
    number in device memory. log(beta) comes from the host in float64
    rounded once: beta2 = 0.999 rounded to float32 first would move
    log(beta2) by 3e-5 relative.

    Computed in float64, once per program: 1 - beta2**step subtracts two
    numbers near 1 in the first steps, so a float32 exp a few units in the
    last place off (the GPU's exp is an approximation) moves it by up to
    about 1e-4 relative, and every update with it; the reference takes these
    factors in float64 too. (The likely cause of the H200's failing
    2^31-element test, 2026-11-27, whose bound is 1e-5 relative.)"""
    step = tl.load(step_ptr).to(tl.float64)
    bias_correction1 = 1.0 - tl.exp(step * log_beta1)
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * log_beta2))
    return (lr / bias_correction1).to(tl.float32), bias_correction2_sqrt.to(tl.float32)


@triton.jit
def _gradient_and_parameter(grad_ptr, param_ptr, master_ptr, offsets, states, mask, state_mask, grad_scale_ptr,
                            weight_decay, decay_factor, HAS_MASTER: tl.constexpr, SCALED: tl.constexpr,
                            MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr):
    """The gradient (unscaled, signed, plus L2 decay) and the parameter
    (the master where kept, decoupled decay applied) in float32. ``mask``
    covers the parameter's elements, ``state_mask`` the state elements."""
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        g = g / tl.load(grad_scale_ptr).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        p = tl.load(master_ptr + states, mask=state_mask, other=0.0)
    else:
        p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT_DECAY:
        if DECOUPLED:
            p = p * decay_factor
        else:
            g = g + weight_decay * p
    return g, p


@triton.jit
def _adam_kernel(parameter_table, tile_table, first_param, first_grad, n, exp_avg_ptr, exp_avg_sq_ptr,
                 max_exp_avg_sq_ptr, master_ptr, step_ptr, grad_scale_ptr, found_inf_ptr,
                 lr, log_beta1, log_beta2, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay_factor,
                 SINGLE: tl.constexpr, ALIGNED: tl.constexpr, VECTOR: tl.constexpr, HAS_MASTER: tl.constexpr,
                 AMSGRAD: tl.constexpr, SCALED: tl.constexpr, CHECK_INF: tl.constexpr, DECOUPLED: tl.constexpr,
                 MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, BLOCK: tl.constexpr):
    param_ptr, grad_ptr, numel, state_first, first = _locate(parameter_table, tile_table, first_param, first_grad,
                                                             n, SINGLE, ALIGNED, VECTOR, 1, BLOCK)
    offsets = first + tl.arange(0, BLOCK)
    limit = numel
    if CHECK_INF:
        # A skipped step stores nothing: no element is in range.
        limit = tl.where(tl.load(found_inf_ptr) == 0, numel, 0)
    mask = offsets < limit
    states = state_first + offsets
    step_size, bias_correction2_sqrt = _bias_corrections(step_ptr, lr, log_beta1, log_beta2)
    g, p = _gradient_and_parameter(grad_ptr, param_ptr, master_ptr, offsets, states, mask, mask, grad_scale_ptr,
                                   weight_decay, decay_factor, HAS_MASTER, SCALED, MAXIMIZE, HAS_WEIGHT_DECAY,
                                   DECOUPLED)
    m = tl.load(exp_avg_ptr + states, mask=mask, other=0.0).to(tl.float32)
    m = m + one_minus_beta1 * (g - m)
    v = tl.load(exp_avg_sq_ptr + states, mask=mask, other=0.0).to(tl.float32)
    v = v * beta2 + one_minus_beta2 * g * g
    v_hat = v
    if AMSGRAD:
        previous = tl.load(max_exp_avg_sq_ptr + states, mask=mask, other=0.0).to(tl.float32)
        v_hat = tl.where((v != v) | (v > previous), v, previous)
        tl.store(max_exp_avg_sq_ptr + states, v_hat.to(max_exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    denom = tl.sqrt(v_hat) / bias_correction2_sqrt + eps
    p = p + (-step_size) * (m / denom)
    tl.store(exp_avg_ptr + states, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + states, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + states, p, mask=mask)
    tl.store(param_ptr + offsets, p.to(first_param.dtype.element_ty), mask=mask)


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


# -- the tables ---------------------------------------------------------------------

# thread-safe LRU caches (threads stepping optimizers at once share them)
_TILE_TABLES = TableCache(entries=CACHED_TABLES)  # -> tile table
_PARAMETER_TABLES = TableCache(entries=CACHED_TABLES)  # -> (parameter table, aligned)


def _upload(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host int64 table on ``device``, without making the host wait."""
    if device.type != "cuda":
        return rows  # the interpreter reads CPU tensors
    return rows.pin_memory().to(device, non_blocking=True)


def _tile_rows(numels: tuple[int, ...]) -> torch.Tensor:
    """(parameter row, first element) of every BLOCK-element tile."""
    counts = torch.tensor([-(-numel // BLOCK) for numel in numels], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first_tile = torch.cumsum(counts, 0) - counts
    firsts = (torch.arange(rows.numel()) - first_tile[rows]) * BLOCK
    return torch.stack((rows, firsts), dim=1)


def _parameter_rows(numels: tuple[int, ...], addresses: tuple[int, ...], padded: bool) -> torch.Tensor:
    spans = [padded_numel(numel) for numel in numels] if padded else numels
    rows, state_first = [], 0
    for index, (numel, span) in enumerate(zip(numels, spans)):
        rows.append((addresses[2 * index], addresses[2 * index + 1], numel, state_first))
        state_first += span
    return torch.tensor(rows, dtype=torch.int64)


def _parameter_table(numels: tuple[int, ...], addresses: tuple[int, ...], padded: bool, vector: int,
                     device: torch.device) -> tuple[torch.Tensor, bool]:
    """The table on the device, and whether every parameter and gradient
    starts on 16 bytes and every numel (hence every parameter's first state
    element) is a multiple of ``vector``: the kernels' ALIGNED case."""
    aligned = all(address % 16 == 0 for address in addresses) and all(numel % vector == 0 for numel in numels)
    return _upload(_parameter_rows(numels, addresses, padded), device), aligned


class _Operands(NamedTuple):
    """The kernels' first five arguments, their grid and specialisation."""
    parameter_table: torch.Tensor
    tile_table: torch.Tensor
    first_param: torch.Tensor
    first_grad: torch.Tensor
    numel: int
    programs: int
    single: bool
    aligned: bool
    vector: int


def _operands(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], state_dtype: torch.dtype,
              padded: bool) -> _Operands:
    """Tables (cached on the device) for a chunk of several parameters;
    the tensors themselves for a chunk of one."""
    first_param, first_grad = memory_flat(params[0]), memory_flat(grads[0])
    # elements per 16 bytes of the narrowest buffer indexed by element
    # offsets (8-bit states are indexed by whole 256-element blocks)
    narrowest = first_param.element_size() if padded else min(first_param.element_size(), state_dtype.itemsize)
    vector = 16 // narrowest
    if len(params) == 1:
        numel = first_param.numel()
        # (the tables are not read: any tensor will do; the launcher itself
        # specialises on the alignment of the tensors and of numel)
        return _Operands(first_param, first_param, first_param, first_grad, numel, triton.cdiv(numel, BLOCK),
                         True, False, vector)
    device = first_param.device
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    numels = tuple(p.numel() for p in params)
    addresses = tuple(address for p, g in zip(params, grads) for address in (p.data_ptr(), g.data_ptr()))
    tile_table = _TILE_TABLES.get((device, stream, numels), lambda: _upload(_tile_rows(numels), device))
    parameter_table, aligned = _PARAMETER_TABLES.get(
        (device, stream, padded, vector, numels, addresses),
        lambda: _parameter_table(numels, addresses, padded, vector, device))
    return _Operands(parameter_table, tile_table, first_param, first_grad, 0, tile_table.shape[0], False, aligned,
                     vector)


def _on_parameter_device(launcher: Callable) -> Callable:
    """Runs a launcher under a device guard of the parameters' device:
    Triton launches on the current device's stream, and the tables are
    cached under the stream of the parameters' device; the two must agree
    (and the kernel must run where its pointers live) whatever device is
    current."""

    @functools.wraps(launcher)
    def guarded(params, *args):
        if params and params[0].device.type == "cuda":
            with torch.cuda.device(params[0].device):
                return launcher(params, *args)
        return launcher(params, *args)

    return guarded


def _launch(kernel, operands: _Operands, states: Sequence[torch.Tensor], master: Optional[torch.Tensor],
            stand_in: torch.Tensor, step: torch.Tensor, grad_scale: Optional[torch.Tensor],
            found_inf: Optional[torch.Tensor], amsgrad: bool, lr: float, beta1: float, beta2: float, eps: float,
            weight_decay: float, decoupled_weight_decay: bool, maximize: bool, **constants) -> None:
    """``kernel`` over the operands' programs. Absent optional tensors are
    passed as a stand-in of their dtype (never read: the kernel is
    specialised on their absence); ``states`` already hold stand-ins."""
    if operands.programs == 0:
        return
    kernel[(operands.programs,)](
        *operands[:5], *states, master if master is not None else stand_in,
        step, grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step,
        *_scalars(lr, beta1, beta2, eps, weight_decay),
        **_specialisation(operands.single, operands.aligned, operands.vector, master is not None, amsgrad,
                          grad_scale is not None, found_inf is not None, weight_decay, decoupled_weight_decay,
                          maximize),
        num_warps=NUM_WARPS, **constants,
    )


def _scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> tuple[float, ...]:
    """The kernels' float arguments, lr to decay_factor."""
    return (lr, _log(beta1), _log(beta2), beta2, 1.0 - beta1, 1.0 - beta2, eps, weight_decay, 1.0 - lr * weight_decay)


def _specialisation(single: bool, aligned: bool, vector: int, has_master: bool, amsgrad: bool, scaled: bool,
                    check_inf: bool, weight_decay: float, decoupled_weight_decay: bool, maximize: bool) -> dict:
    """The constexprs both kernels are specialised on (also what the kernel
    report compiles, ``kernel_specialisations``)."""
    return dict(SINGLE=single, ALIGNED=aligned, VECTOR=vector, HAS_MASTER=has_master, AMSGRAD=amsgrad,
                SCALED=scaled, CHECK_INF=check_inf, DECOUPLED=decoupled_weight_decay, MAXIMIZE=maximize,
                HAS_WEIGHT_DECAY=weight_decay != 0)


@_on_parameter_device
def adam_step_triton(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale, found_inf, lr,
                     beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize) -> None:
    """``effilayers::adam_step_`` on CUDA (or on CPU tensors under the
    interpreter): the op's arguments, the hyper-parameters as its scalars."""
    if params[0].dtype == torch.float64:
        raise TypeError("adam_step_ (triton): float64 parameters are not supported on the GPU kernel")
    amsgrad = max_exp_avg_sq is not None
    _launch(_adam_kernel, _operands(params, grads, exp_avg.dtype, padded=False),
            (exp_avg, exp_avg_sq, max_exp_avg_sq if amsgrad else exp_avg), master, exp_avg, step, grad_scale,
            found_inf, amsgrad, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize, BLOCK=BLOCK)


# -- 8-bit block-quantized states ------------------------------------------------

# Four 256-element quantization blocks per program: the same 1024 elements in
# flight as the unquantized kernel (so both share the tile table: a tile is
# four whole blocks of the padded layout), and the per-block absmax is a row
# reduction of a (4, 256) tile.
BLOCKS_PER_PROGRAM = 4
assert BLOCKS_PER_PROGRAM * QUANT_BLOCK == BLOCK


@triton.jit
def _adam_8bit_kernel(parameter_table, tile_table, first_param, first_grad, n, exp_avg_ptr, exp_avg_absmax_ptr,
                      exp_avg_sq_ptr, exp_avg_sq_absmax_ptr, max_exp_avg_sq_ptr, max_exp_avg_sq_absmax_ptr,
                      master_ptr, step_ptr, grad_scale_ptr, found_inf_ptr,
                      lr, log_beta1, log_beta2, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay,
                      decay_factor,
                      SINGLE: tl.constexpr, ALIGNED: tl.constexpr, VECTOR: tl.constexpr, HAS_MASTER: tl.constexpr,
                      AMSGRAD: tl.constexpr, SCALED: tl.constexpr, CHECK_INF: tl.constexpr, DECOUPLED: tl.constexpr,
                      MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, QBLOCK: tl.constexpr,
                      ROWS: tl.constexpr):
    param_ptr, grad_ptr, numel, state_first, first = _locate(parameter_table, tile_table, first_param, first_grad,
                                                             n, SINGLE, ALIGNED, VECTOR, QBLOCK, ROWS * QBLOCK)
    limit = numel
    if CHECK_INF:
        limit = tl.where(tl.load(found_inf_ptr) == 0, numel, 0)
    # Blocks of the parameter's padded span: the states cover whole blocks
    # (their padding stays zero: zero gradient, zero moments), the parameter
    # and its gradient only their first numel elements.
    local_blocks = first // QBLOCK + tl.arange(0, ROWS)
    block_mask = local_blocks * QBLOCK < limit
    elements = local_blocks[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    element_mask = elements < limit
    mask = block_mask[:, None]
    blocks = state_first // QBLOCK + local_blocks
    states = state_first + elements
    step_size, bias_correction2_sqrt = _bias_corrections(step_ptr, lr, log_beta1, log_beta2)

    # decode: m = sign(q) (|q|/127)^2 a,  v = (q/255)^4 a
    q_m = tl.load(exp_avg_ptr + states, mask=mask, other=0).to(tl.float32)
    t = tl.abs(q_m) / 127.0
    magnitude = (t * t) * tl.load(exp_avg_absmax_ptr + blocks, mask=block_mask, other=0.0)[:, None]
    m = tl.where(q_m < 0, -magnitude, magnitude)
    t = tl.load(exp_avg_sq_ptr + states, mask=mask, other=0).to(tl.float32) / 255.0
    t = t * t
    v = (t * t) * tl.load(exp_avg_sq_absmax_ptr + blocks, mask=block_mask, other=0.0)[:, None]

    g, p = _gradient_and_parameter(grad_ptr, param_ptr, master_ptr, elements, states, element_mask, mask,
                                   grad_scale_ptr, weight_decay, decay_factor, HAS_MASTER, SCALED, MAXIMIZE,
                                   HAS_WEIGHT_DECAY, DECOUPLED)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    v_hat = v
    if AMSGRAD:
        t = tl.load(max_exp_avg_sq_ptr + states, mask=mask, other=0).to(tl.float32) / 255.0
        t = t * t
        previous = (t * t) * tl.load(max_exp_avg_sq_absmax_ptr + blocks, mask=block_mask, other=0.0)[:, None]
        v_hat = tl.where((v != v) | (v > previous), v, previous)
    denom = tl.sqrt_rn(v_hat) / bias_correction2_sqrt + eps
    p = p + (-step_size) * (m / denom)
    if HAS_MASTER:
        tl.store(master_ptr + states, p, mask=mask)
    tl.store(param_ptr + elements, p.to(first_param.dtype.element_ty), mask=element_mask)

    # encode with a fresh absmax per block (row); NaN when the block holds a
    # NaN, like the reference's amax: codes 0, the block decodes to NaN
    absmax = _nan_aware_max(tl.abs(m))
    ratio = _block_ratio(tl.abs(m), absmax)
    q = tl.minimum(tl.floor(tl.sqrt_rn(ratio) * 127.0 + 0.5), 127.0)
    q = tl.where(m < 0, -q, q)
    tl.store(exp_avg_ptr + states, q.to(tl.int32).to(tl.int8), mask=mask)
    tl.store(exp_avg_absmax_ptr + blocks, absmax, mask=block_mask)
    _encode_unsigned(v, exp_avg_sq_ptr, exp_avg_sq_absmax_ptr, states, blocks, mask, block_mask)
    if AMSGRAD:
        _encode_unsigned(v_hat, max_exp_avg_sq_ptr, max_exp_avg_sq_absmax_ptr, states, blocks, mask, block_mask)


@triton.jit
def _nan_aware_max(values):
    """Row maxima of a (blocks, QBLOCK) tile, NaN for a row holding a NaN
    (tl.max does not promise to propagate it)."""
    has_nan = tl.max((values != values).to(tl.int32), axis=1) > 0
    return tl.where(has_nan, float("nan"), tl.max(values, axis=1))


@triton.jit
def _block_ratio(magnitudes, absmax):
    """|x| / absmax per row; 0 where absmax is 0 (no 0/0) or NaN."""
    usable = absmax > 0
    return tl.where(usable[:, None], magnitudes / tl.where(usable, absmax, 1.0)[:, None], 0.0)


@triton.jit
def _encode_unsigned(v, codes_ptr, absmax_ptr, offsets, blocks, mask, block_mask):
    absmax = _nan_aware_max(v)
    ratio = _block_ratio(v, absmax)
    q = tl.minimum(tl.floor(tl.sqrt_rn(tl.sqrt_rn(ratio)) * 255.0 + 0.5), 255.0)
    q = tl.where((q == 0) & (v > 0), 1.0, q)  # a non-zero second moment never encodes to 0
    tl.store(codes_ptr + offsets, q.to(tl.int32).to(tl.uint8), mask=mask)
    tl.store(absmax_ptr + blocks, absmax, mask=block_mask)


@_on_parameter_device
def adam_step_8bit_triton(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq,
                          max_exp_avg_sq_absmax, master, step, grad_scale, found_inf, lr, beta1, beta2, eps,
                          weight_decay, decoupled_weight_decay, maximize) -> None:
    """Like adam_step_triton, on the padded layout: the parameter table's
    state offsets follow the padded spans, and a tile is four whole blocks of
    one parameter."""
    amsgrad = max_exp_avg_sq is not None
    states = (exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq if amsgrad else exp_avg_sq,
              max_exp_avg_sq_absmax if amsgrad else exp_avg_sq_absmax)
    _launch(_adam_8bit_kernel, _operands(params, grads, exp_avg.dtype, padded=True), states, master,
            exp_avg_absmax, step, grad_scale, found_inf, amsgrad, lr, beta1, beta2, eps, weight_decay,
            decoupled_weight_decay, maximize, QBLOCK=QUANT_BLOCK,
            ROWS=BLOCKS_PER_PROGRAM)


# -- kernel report ---------------------------------------------------------------

_FLOATS = ("lr", "log_beta1", "log_beta2", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "weight_decay",
           "decay_factor")
# benchmarks/bench_optim.py: AdamW(lr=1e-3, weight_decay=0.01), one 4096x1024
# matrix per chunk of one parameter
BENCHMARK_HYPER = AdamHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
BENCHMARK_NUMEL = 4096 * 1024
_UNALIGNED = ("a chunk whose parameters are not all 16-byte aligned with numels multiple of VECTOR: one "
              "access per element, by design (ALIGNED=False)")
_BLOCK_SCALES = f"{BLOCKS_PER_PROGRAM} block scales per program (not bandwidth-bound)"
_CODES = (f"one-byte codes: {BLOCK} per program over {NUM_WARPS * 32} threads is {BLOCK // (NUM_WARPS * 32)} bytes "
          "per thread, 64 bits at most")


def bytes_per_element(param_size: int, state_size: float, master: bool, amsgrad: bool) -> float:
    """Bytes a one-pass update moves per parameter: g read; p read (or the
    master) and written (and the master written); m and v (and amsgrad's
    max) read and written; an 8-bit state is its byte plus a float32 scale
    per QUANT_BLOCK elements. A perfect kernel moves the same, so this is
    both the kernel's traffic and the family's roofline."""
    moved = param_size + (4 + 4 + param_size if master else 2 * param_size)
    return moved + 2 * (3 if amsgrad else 2) * state_size


def kernel_specialisations():
    """Both kernels for each parameter/state dtype pair of the benchmarks
    (and 16-bit parameters with fp32 masters, or bf16 throughout), for a
    chunk of one parameter, of aligned and of unaligned parameters; with the
    benchmark's AdamW settings and with every optional branch (amsgrad, grad
    scaler, skip on inf). The constexprs come from the launcher's
    ``_specialisation``."""
    hyper = BENCHMARK_HYPER
    kinds = ((torch.float32, torch.float32, False), (torch.float32, torch.bfloat16, False),
             (torch.bfloat16, torch.float32, True), (torch.float16, torch.float32, True),
             (torch.bfloat16, torch.bfloat16, False), (torch.float32, "8bit", False), (torch.bfloat16, "8bit", True),
             (torch.float16, "8bit", True))
    for param_dtype, state_dtype, has_master in kinds:
        quantized = state_dtype == "8bit"
        param_size = param_dtype.itemsize
        narrowest = param_size if quantized else min(param_size, state_dtype.itemsize)
        vector = 16 // narrowest
        for layout in ("single", "aligned", "unaligned"):
            single = layout == "single"
            for amsgrad, scaled, check_inf in ((False, False, False), (True, True, True)):
                constants = _specialisation(single, layout == "aligned", vector, has_master, amsgrad, scaled,
                                            check_inf, hyper.weight_decay, hyper.decoupled_weight_decay,
                                            hyper.maximize)
                arguments = dict(parameter_table=torch.int64, tile_table=torch.int64, first_param=param_dtype,
                                 first_grad=param_dtype, n=BENCHMARK_NUMEL if single else 0,
                                 master_ptr=torch.float32 if has_master else param_dtype, step_ptr=torch.float32,
                                 grad_scale_ptr=torch.float32, found_inf_ptr=torch.float32,
                                 **dict(zip(_FLOATS, _scalars(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                                                               hyper.weight_decay))))
                options = "amsgrad+scaler+inf" if amsgrad else "adamw"
                config = (f"{str(param_dtype)[6:]} params{' +fp32 master' if has_master else ''}, "
                          f"{state_dtype if quantized else str(state_dtype)[6:]} states, {layout}, {options}")
                narrow = {"*": _UNALIGNED} if layout == "unaligned" else {}
                if quantized:
                    arguments.update(exp_avg_ptr=torch.int8, exp_avg_absmax_ptr=torch.float32,
                                     exp_avg_sq_ptr=torch.uint8, exp_avg_sq_absmax_ptr=torch.float32,
                                     max_exp_avg_sq_ptr=torch.uint8, max_exp_avg_sq_absmax_ptr=torch.float32)
                    moved = bytes_per_element(param_size, 1 + 4 / QUANT_BLOCK, has_master, amsgrad)
                    narrow = narrow or {"exp_avg_absmax_ptr": _BLOCK_SCALES, "exp_avg_sq_absmax_ptr": _BLOCK_SCALES,
                                        "max_exp_avg_sq_absmax_ptr": _BLOCK_SCALES, "exp_avg_ptr": _CODES,
                                        "exp_avg_sq_ptr": _CODES, "max_exp_avg_sq_ptr": _CODES}
                    yield KernelSpec(_adam_8bit_kernel, arguments,
                                     dict(constants, QBLOCK=QUANT_BLOCK, ROWS=BLOCKS_PER_PROGRAM), NUM_WARPS, config,
                                     moved, moved, narrow)
                else:
                    arguments.update(exp_avg_ptr=state_dtype, exp_avg_sq_ptr=state_dtype,
                                     max_exp_avg_sq_ptr=state_dtype)
                    moved = bytes_per_element(param_size, state_dtype.itemsize, has_master, amsgrad)
                    yield KernelSpec(_adam_kernel, arguments, dict(constants, BLOCK=BLOCK), NUM_WARPS, config, moved,
                                     moved, narrow)
