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
kernel, which reads them in place. A pointer-array kernel (one program per
block of one tensor, addresses from a device table, like apex's
multi-tensor-apply) would remove them; measure before choosing.

No host synchronisation: the step count, the gradient scale and the
overflow flag are read by the kernel from device memory; with ``found_inf``
non-zero every store is masked off.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ops.adam import check_adam_arguments, memory_flat

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
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
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
