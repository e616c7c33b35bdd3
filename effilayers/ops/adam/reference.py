"""Pure-PyTorch Adam/AdamW updates: the test oracle and the fallback of
``effilayers::adam_step_`` and ``effilayers::adam_step_8bit_`` (arguments:
:mod:`effilayers.ops.adam.contract`).

The math is torch.optim.Adam's (single-tensor path), in float32 (float64 for
float64 params)::

    g = grad / grad_scale;  g = -g if maximize
    decoupled: p *= 1 - lr * weight_decay      else: g += weight_decay * p
    m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
    v_hat = max(v_max, v) (amsgrad) else v
    p -= lr / (1 - beta1^step) * m / (sqrt(v_hat) / sqrt(1 - beta2^step) + eps)

States stored in bfloat16 are read, updated in float32 and rounded to nearest
even when written.

The 8-bit code is companded, not linear (``a`` is the block's absmax)::

    exp_avg:    m = sign(q) * (|q| / 127)^2 * a      q in [-127, 127]  (int8)
    exp_avg_sq: v = (q / 255)^4 * a                  q in [0, 255]     (uint8)

and a value is encoded by rounding ``127 * sqrt(|m| / a)`` (resp.
``255 * (v / a)^(1/4)``) to nearest (``floor(x + 0.5)``). Why: the update is
``m / sqrt(v)``, and within a block ``v`` spans several decades. A linear
8-bit code rounds every ``v`` below ``a / 510`` to zero, the denominator
collapses to ``eps`` and the update explodes (measured: a 3-layer MLP with
lr 1e-2 diverges to NaN with linear codes). The 4th-power code keeps values
down to ``~1.5e-11 * a`` with a relative step of ``4 / q`` (1.6 % at the top
of the block); in addition a non-zero ``v`` never encodes to 0 (it keeps code
1, ``2.4e-10 * a``), so quantization can over-estimate but never zero the
denominator. ``m`` only multiplies, so its small values may round to 0; the
square-law code spends its levels on the large ones (relative step ``2 / q``).
Both codes cost two multiplies to decode and one or two square roots to
encode: no lookup table, cheap to vectorise on CPU and GPU.

Each kernel decodes a block into float32, runs the update above, takes a
fresh absmax of the new ``m`` / ``v`` per block and re-encodes. With
``found_inf`` non-zero nothing is written (codes and scales included).
A NaN (a NaN gradient without a GradScaler) makes its block's absmax NaN and
its codes 0 on every backend, so the whole block decodes to NaN: the
divergence stays visible in the states instead of being encoded as a finite
value (with float32 states only the element itself would be NaN).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..._core.dtypes import accumulation_dtype
from ..._core.layout import memory_flat
from .contract import EXP_AVG_LEVELS, EXP_AVG_SQ_LEVELS, QUANT_BLOCK, AdamHyperParams, padded_numel

__all__ = ["adam_step_reference", "adam_step_8bit_reference", "adam_step_reference_kernel",
           "adam_step_8bit_reference_kernel", "quantize_exp_avg", "quantize_exp_avg_sq",
           "dequantize_exp_avg", "dequantize_exp_avg_sq", "gather_padded", "scatter_padded"]


def adam_step_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor],
                        master: Optional[torch.Tensor], step: torch.Tensor, grad_scale: Optional[torch.Tensor],
                        found_inf: Optional[torch.Tensor], hyper: AdamHyperParams) -> None:
    """The reference update with the settings as one record (the tests'
    oracle); the op's reference kernel is :func:`adam_step_reference_kernel`."""
    adam_step_reference_kernel(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale,
                               found_inf, *hyper.values)


def adam_step_reference_kernel(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avg: torch.Tensor,
                               exp_avg_sq: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor],
                               master: Optional[torch.Tensor], step: torch.Tensor,
                               grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor], lr: float,
                               beta1: float, beta2: float, eps: float, weight_decay: float,
                               decoupled_weight_decay: bool, maximize: bool) -> None:
    """``effilayers::adam_step_`` in pure PyTorch: the update on flat copies,
    the hyper-parameters as the op's scalars. A skipped (``found_inf``) step
    is a ``torch.where`` on the results, not a host-side branch, so this
    path does not synchronise either."""
    acc = accumulation_dtype(params[0].dtype)
    flat_grad = torch.cat([memory_flat(g) for g in grads]).to(acc)
    old_param = master if master is not None else torch.cat([memory_flat(p) for p in params])
    param = old_param.to(acc)
    if grad_scale is not None:
        flat_grad = flat_grad / grad_scale.to(acc)
    if maximize:
        flat_grad = -flat_grad
    # step-derived factors, computed in float64 like torch's Python floats
    step64 = step.reshape(()).to(torch.float64)
    bias_correction1 = 1 - beta1 ** step64
    bias_correction2_sqrt = (1 - beta2 ** step64).sqrt()
    step_size = (lr / bias_correction1).to(acc)
    if weight_decay != 0:
        if decoupled_weight_decay:
            param = param * torch.tensor(1 - lr * weight_decay, dtype=torch.float64).to(acc)
        else:
            flat_grad = flat_grad + torch.tensor(weight_decay, dtype=torch.float64).to(acc) * param
    m = exp_avg.to(acc).lerp(flat_grad, 1 - beta1)
    v = exp_avg_sq.to(acc) * beta2 + (1 - beta2) * (flat_grad * flat_grad)
    v_hat = v
    new_max = None
    if max_exp_avg_sq is not None:
        new_max = torch.maximum(max_exp_avg_sq.to(acc), v)
        v_hat = new_max
    denom = v_hat.sqrt() / bias_correction2_sqrt.to(acc) + eps
    param = param - step_size * (m / denom)

    skip = None if found_inf is None else found_inf.reshape(()) != 0

    def commit(target: torch.Tensor, value: torch.Tensor) -> None:
        value = value.to(target.dtype)
        if skip is not None:
            value = torch.where(skip, target, value)
        target.copy_(value)

    commit(exp_avg, m)
    commit(exp_avg_sq, v)
    if new_max is not None:
        commit(max_exp_avg_sq, new_max)
    if master is not None:
        new_master = torch.where(skip, master, param.to(master.dtype)) if skip is not None else param.to(master.dtype)
        master.copy_(new_master)
        rounded = new_master
    else:
        flat_params = torch.cat([memory_flat(p) for p in params])
        rounded = param.to(params[0].dtype)
        if skip is not None:
            rounded = torch.where(skip, flat_params, rounded)
    pieces = torch.split(rounded.to(params[0].dtype), [p.numel() for p in params])
    torch._foreach_copy_([memory_flat(p) for p in params], list(pieces))


# -- 8-bit block-quantized states -------------------------------------------------

def dequantize_exp_avg(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """int8 codes + per-block absmax -> float32 ``sign(q) * (|q|/127)^2 * absmax``."""
    t = codes.to(torch.float32).abs() / EXP_AVG_LEVELS
    magnitude = ((t * t).view(-1, QUANT_BLOCK) * absmax.view(-1, 1)).view(-1)
    return torch.where(codes < 0, -magnitude, magnitude)


def dequantize_exp_avg_sq(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """uint8 codes + per-block absmax -> float32 ``(q/255)^4 * absmax``."""
    t = codes.to(torch.float32) / EXP_AVG_SQ_LEVELS
    t2 = t * t
    return ((t2 * t2).view(-1, QUANT_BLOCK) * absmax.view(-1, 1)).view(-1)


def _block_ratio(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = values.view(-1, QUANT_BLOCK).abs()
    absmax = blocks.amax(dim=1)
    scale = absmax.view(-1, 1)
    ratio = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks))
    return ratio, absmax


def quantize_exp_avg(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (length a multiple of QUANT_BLOCK) -> (int8 codes, float32 absmax per block)."""
    ratio, absmax = _block_ratio(values.to(torch.float32))
    q = torch.floor(ratio.sqrt() * EXP_AVG_LEVELS + 0.5).clamp_(max=EXP_AVG_LEVELS).view(-1)
    return torch.where(values < 0, -q, q).to(torch.int8), absmax


def quantize_exp_avg_sq(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 >= 0 (length a multiple of QUANT_BLOCK) -> (uint8 codes, float32 absmax per block).
    A non-zero value keeps at least code 1 (see the module docstring)."""
    ratio, absmax = _block_ratio(values.to(torch.float32))
    q = torch.floor(ratio.sqrt().sqrt() * EXP_AVG_SQ_LEVELS + 0.5).clamp_(max=EXP_AVG_SQ_LEVELS).view(-1)
    q = torch.where((q == 0) & (values.view(-1) > 0), torch.ones_like(q), q)
    return q.to(torch.uint8), absmax


def gather_padded(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements in memory order, each padded with zeros to a
    multiple of QUANT_BLOCK, end to end (a view when nothing needs padding)."""
    if len(tensors) == 1 and tensors[0].numel() % QUANT_BLOCK == 0:
        return memory_flat(tensors[0])
    flat = torch.zeros(sum(padded_numel(t.numel()) for t in tensors), dtype=tensors[0].dtype,
                       device=tensors[0].device)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(memory_flat(t))
        offset += padded_numel(t.numel())
    return flat


def scatter_padded(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of gather_padded (nothing to do when it returned a view)."""
    if len(tensors) == 1 and tensors[0].numel() % QUANT_BLOCK == 0:
        return
    offset, targets, pieces = 0, [], []
    for t in tensors:
        targets.append(memory_flat(t))
        pieces.append(flat[offset:offset + t.numel()])
        offset += padded_numel(t.numel())
    torch._foreach_copy_(targets, pieces)


def adam_step_8bit_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avg: torch.Tensor,
                             exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor,
                             exp_avg_sq_absmax: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor],
                             max_exp_avg_sq_absmax: Optional[torch.Tensor], master: Optional[torch.Tensor],
                             step: torch.Tensor, grad_scale: Optional[torch.Tensor],
                             found_inf: Optional[torch.Tensor], hyper: AdamHyperParams) -> None:
    """:func:`adam_step_reference` on 8-bit states (the op's reference kernel
    is :func:`adam_step_8bit_reference_kernel`)."""
    adam_step_8bit_reference_kernel(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                                    max_exp_avg_sq, max_exp_avg_sq_absmax, master, step, grad_scale, found_inf,
                                    *hyper.values)


def adam_step_8bit_reference_kernel(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                                    exp_avg: torch.Tensor, exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor,
                                    exp_avg_sq_absmax: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor],
                                    max_exp_avg_sq_absmax: Optional[torch.Tensor], master: Optional[torch.Tensor],
                                    step: torch.Tensor, grad_scale: Optional[torch.Tensor],
                                    found_inf: Optional[torch.Tensor], lr: float, beta1: float, beta2: float,
                                    eps: float, weight_decay: float, decoupled_weight_decay: bool,
                                    maximize: bool) -> None:
    """``effilayers::adam_step_8bit_`` in pure PyTorch: decode, the float32
    reference update on the padded flat layout, re-encode."""
    flat_params = gather_padded(params)
    flat_grads = gather_padded(grads)
    m = dequantize_exp_avg(exp_avg, exp_avg_absmax)
    v = dequantize_exp_avg_sq(exp_avg_sq, exp_avg_sq_absmax)
    v_max = None if max_exp_avg_sq is None else dequantize_exp_avg_sq(max_exp_avg_sq, max_exp_avg_sq_absmax)
    # padding: zero grads, params and states stay zero through the update
    adam_step_reference_kernel([flat_params], [flat_grads], m, v, v_max, master, step, grad_scale, found_inf, lr,
                               beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize)
    skip = None if found_inf is None else found_inf.reshape(()) != 0
    encoded = [(exp_avg, exp_avg_absmax, quantize_exp_avg(m)), (exp_avg_sq, exp_avg_sq_absmax, quantize_exp_avg_sq(v))]
    if v_max is not None:
        encoded.append((max_exp_avg_sq, max_exp_avg_sq_absmax, quantize_exp_avg_sq(v_max)))
    for codes, absmax, (new_codes, new_absmax) in encoded:
        if skip is not None:
            new_codes = torch.where(skip, codes, new_codes)
            new_absmax = torch.where(skip, absmax, new_absmax)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)
    scatter_padded(flat_params, params)
