"""Triton kernel for ``effilayers::adam_step_`` on GPU.

Why Triton and not CUDA: it runs in CI on CPU tensors under
``TRITON_INTERPRET=1``, and this file was written on a machine without a GPU.
The choice is provisional: CUDA versus Triton for this op must be re-decided
by measurement on a GPU (achieved bandwidth of the step against a
device-to-device copy of the same bytes), and the loser deleted.

The kernel works on flat buffers. The op's parameters and gradients are
separate tensors, so this wrapper gathers them (``torch.cat``) and scatters
the updated parameters back with one ``torch._foreach_copy_``: two extra
passes over the parameters and one over the gradients compared with the CPU
kernel, which reads them in place: ~52 bytes moved per fp32 parameter of a
multi-parameter chunk against the 28-byte floor, plus two chunk-sized
temporaries (a one-parameter chunk is a view and pays nothing). This is why
the GPU bandwidth target is open. A pointer-array kernel (one program per
block of one tensor, addresses from a device table, like apex's
multi-tensor-apply) or parameters kept as views of flat buffers would remove
them; measure on a GPU before choosing.

No host synchronisation: the step count, the gradient scale and the
overflow flag are read by the kernel from device memory; with ``found_inf``
non-zero every store is masked off.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ops.adam import (QUANT_BLOCK, check_adam_8bit_arguments, check_adam_arguments, gather_padded, memory_flat,
                        scatter_padded)

# 1024 elements x (p, g, m, v) per program: enough bytes in flight per SM for
# a memory-bound update; 4 warps keep 8 elements per thread.
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _adam_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, master_ptr,
                 step_ptr, grad_scale_ptr, found_inf_ptr, n,
                 lr, log_beta1, log_beta2, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay_factor,
                 HAS_MASTER: tl.constexpr, AMSGRAD: tl.constexpr, SCALED: tl.constexpr, CHECK_INF: tl.constexpr,
                 DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
                 BLOCK: tl.constexpr):
    # int64: one parameter larger than the chunk size gets a chunk of its own,
    # so a flat run may exceed 2^31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    limit = n
    if CHECK_INF:
        # A skipped step stores nothing: no element is in range.
        limit = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    mask = offsets < limit
    step = tl.load(step_ptr).to(tl.float32)
    # log(beta) comes from the host in float64 rounded once: beta2 = 0.999
    # rounded to float32 first would move log(beta2) by 3e-5 relative.
    bias_correction1 = 1.0 - tl.exp(step * log_beta1)
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * log_beta2))
    step_size = lr / bias_correction1

    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        g = g / tl.load(grad_scale_ptr).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        p = tl.load(master_ptr + offsets, mask=mask, other=0.0)
    else:
        p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT_DECAY:
        if DECOUPLED:
            p = p * decay_factor
        else:
            g = g + weight_decay * p
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = m + one_minus_beta1 * (g - m)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = v * beta2 + one_minus_beta2 * g * g
    v_hat = v
    if AMSGRAD:
        previous = tl.load(max_exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v_hat = tl.where((v != v) | (v > previous), v, previous)
        tl.store(max_exp_avg_sq_ptr + offsets, v_hat.to(max_exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    denom = tl.sqrt(v_hat) / bias_correction2_sqrt + eps
    p = p + (-step_size) * (m / denom)
    tl.store(exp_avg_ptr + offsets, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + offsets, p, mask=mask)
    tl.store(param_ptr + offsets, p.to(param_ptr.dtype.element_ty), mask=mask)


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return memory_flat(tensors[0])
    return torch.cat([memory_flat(t) for t in tensors])


def adam_step_triton(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale, found_inf,
                     lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize) -> None:
    check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step)
    if params[0].dtype == torch.float64:
        raise TypeError("adam_step_ (triton): float64 parameters are not supported on the GPU kernel")
    n = exp_avg.numel()
    flat_params = _flat(list(params))  # a view when there is one parameter: updated in place
    flat_grads = _flat(list(grads))
    dummy = exp_avg
    grid = (triton.cdiv(n, BLOCK),)
    _adam_kernel[grid](
        flat_params, flat_grads, exp_avg, exp_avg_sq,
        max_exp_avg_sq if max_exp_avg_sq is not None else dummy,
        master if master is not None else dummy,
        step, grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step, n,
        float(lr), _log(beta1), _log(beta2), float(beta2), float(1.0 - beta1), float(1.0 - beta2), float(eps),
        float(weight_decay), float(1.0 - lr * weight_decay),
        HAS_MASTER=master is not None, AMSGRAD=max_exp_avg_sq is not None, SCALED=grad_scale is not None,
        CHECK_INF=found_inf is not None, DECOUPLED=bool(decoupled_weight_decay), MAXIMIZE=bool(maximize),
        HAS_WEIGHT_DECAY=weight_decay != 0, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
    if len(params) > 1:
        pieces = torch.split(flat_params, [p.numel() for p in params])
        torch._foreach_copy_([memory_flat(p) for p in params], list(pieces))


# -- 8-bit block-quantized states ------------------------------------------------

# Four 256-element quantization blocks per program: the same 1024 elements in
# flight as the unquantized kernel, and the per-block absmax is a row
# reduction of a (4, 256) tile.
BLOCKS_PER_PROGRAM = 4


@triton.jit
def _adam_8bit_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_absmax_ptr, exp_avg_sq_ptr, exp_avg_sq_absmax_ptr,
                      max_exp_avg_sq_ptr, max_exp_avg_sq_absmax_ptr, master_ptr,
                      step_ptr, grad_scale_ptr, found_inf_ptr, num_blocks,
                      lr, log_beta1, log_beta2, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay,
                      decay_factor,
                      HAS_MASTER: tl.constexpr, AMSGRAD: tl.constexpr, SCALED: tl.constexpr,
                      CHECK_INF: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                      HAS_WEIGHT_DECAY: tl.constexpr, QBLOCK: tl.constexpr, ROWS: tl.constexpr):
    blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64 offsets below (> 2^31 elements)
    limit = num_blocks
    if CHECK_INF:
        limit = tl.where(tl.load(found_inf_ptr) == 0, num_blocks, 0)
    block_mask = blocks < limit
    offsets = blocks[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = block_mask[:, None]
    step = tl.load(step_ptr).to(tl.float32)
    bias_correction1 = 1.0 - tl.exp(step * log_beta1)
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * log_beta2))
    step_size = lr / bias_correction1

    # decode: m = sign(q) (|q|/127)^2 a,  v = (q/255)^4 a
    q_m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0).to(tl.float32)
    t = tl.abs(q_m) / 127.0
    magnitude = (t * t) * tl.load(exp_avg_absmax_ptr + blocks, mask=block_mask, other=0.0)[:, None]
    m = tl.where(q_m < 0, -magnitude, magnitude)
    t = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0).to(tl.float32) / 255.0
    t = t * t
    v = (t * t) * tl.load(exp_avg_sq_absmax_ptr + blocks, mask=block_mask, other=0.0)[:, None]

    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        g = g / tl.load(grad_scale_ptr).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        p = tl.load(master_ptr + offsets, mask=mask, other=0.0)
    else:
        p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT_DECAY:
        if DECOUPLED:
            p = p * decay_factor
        else:
            g = g + weight_decay * p
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    v_hat = v
    if AMSGRAD:
        t = tl.load(max_exp_avg_sq_ptr + offsets, mask=mask, other=0).to(tl.float32) / 255.0
        t = t * t
        previous = (t * t) * tl.load(max_exp_avg_sq_absmax_ptr + blocks, mask=block_mask, other=0.0)[:, None]
        v_hat = tl.where((v != v) | (v > previous), v, previous)
    denom = tl.sqrt_rn(v_hat) / bias_correction2_sqrt + eps
    p = p + (-step_size) * (m / denom)
    if HAS_MASTER:
        tl.store(master_ptr + offsets, p, mask=mask)
    tl.store(param_ptr + offsets, p.to(param_ptr.dtype.element_ty), mask=mask)

    # encode with a fresh absmax per block (row); NaN when the block holds a
    # NaN, like the reference's amax: codes 0, the block decodes to NaN
    absmax = _nan_aware_max(tl.abs(m))
    ratio = _block_ratio(tl.abs(m), absmax)
    q = tl.minimum(tl.floor(tl.sqrt_rn(ratio) * 127.0 + 0.5), 127.0)
    q = tl.where(m < 0, -q, q)
    tl.store(exp_avg_ptr + offsets, q.to(tl.int32).to(tl.int8), mask=mask)
    tl.store(exp_avg_absmax_ptr + blocks, absmax, mask=block_mask)
    _encode_unsigned(v, exp_avg_sq_ptr, exp_avg_sq_absmax_ptr, offsets, blocks, mask, block_mask)
    if AMSGRAD:
        _encode_unsigned(v_hat, max_exp_avg_sq_ptr, max_exp_avg_sq_absmax_ptr, offsets, blocks, mask, block_mask)


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


def adam_step_8bit_triton(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq,
                          max_exp_avg_sq_absmax, master, step, grad_scale, found_inf,
                          lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize) -> None:
    """Like adam_step_triton, on the padded layout: parameters and gradients
    are gathered into zero-padded flat buffers (a view for one parameter whose
    size is a multiple of the block), the zero padding stays zero through the
    update, and the parameters are scattered back."""
    check_adam_8bit_arguments(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                              max_exp_avg_sq, max_exp_avg_sq_absmax, master, step)
    flat_params = gather_padded(list(params))
    flat_grads = gather_padded(list(grads))
    num_blocks = exp_avg.numel() // QUANT_BLOCK
    amsgrad = max_exp_avg_sq is not None
    grid = (triton.cdiv(num_blocks, BLOCKS_PER_PROGRAM),)
    _adam_8bit_kernel[grid](
        flat_params, flat_grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
        max_exp_avg_sq if amsgrad else exp_avg_sq, max_exp_avg_sq_absmax if amsgrad else exp_avg_sq_absmax,
        master if master is not None else exp_avg_absmax,
        step, grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step,
        num_blocks,
        float(lr), _log(beta1), _log(beta2), float(beta2), float(1.0 - beta1), float(1.0 - beta2), float(eps),
        float(weight_decay), float(1.0 - lr * weight_decay),
        HAS_MASTER=master is not None, AMSGRAD=amsgrad, SCALED=grad_scale is not None,
        CHECK_INF=found_inf is not None, DECOUPLED=bool(decoupled_weight_decay), MAXIMIZE=bool(maximize),
        HAS_WEIGHT_DECAY=weight_decay != 0, QBLOCK=QUANT_BLOCK, ROWS=BLOCKS_PER_PROGRAM, num_warps=NUM_WARPS,
    )
    scatter_padded(flat_params, list(params))
