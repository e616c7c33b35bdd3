"""The functional core of the chunked optimizers (as ``torch.optim.adam.adam``
is torch's): one Adam/AdamW step of a run of parameters with flat states.
``ChunkedAdam.step`` calls it once per run of a chunk's parameters that share
a step count, with ``check=False``; it is also usable on its own.

Steps without host synchronisation
----------------------------------
The step counters are tensors on the state device. Before a run's kernel
runs, its counters are increased by ``found_inf == 0`` (by 1 without a
GradScaler; an indicator, because GradScaler sums found_inf over devices),
and the kernel derives the bias corrections from the counter itself and
writes nothing when ``found_inf`` is non-zero: a skipped step changes
nothing, step count included, without the host reading a flag.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..ops.adam import AdamHyperParams, check_adam_8bit_arguments, check_adam_arguments
from ..ops.adam.op import call

__all__ = ["chunked_adam", "chunked_adam_8bit"]


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
    _call_op("adam_step_", params, grads, (exp_avg, exp_avg_sq, max_exp_avg_sq), master, steps, grad_scale,
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
    _call_op("adam_step_8bit_", params, grads, states, master, steps, grad_scale, found_inf, hyper)


def _advance_steps(steps: torch.Tensor, found_inf: Optional[torch.Tensor]) -> None:
    if found_inf is None:
        steps.add_(1)
    else:
        # An indicator, not the value: GradScaler sums found_inf over devices
        # (2.0 with two overflowing GPUs). Non-zero (NaN included) skips, as
        # in the kernels. A copy to the CPU blocks: a non_blocking one may
        # return before the value lands, and add_ reads it at once.
        steps.add_(found_inf.to(steps.device, non_blocking=steps.device.type != "cpu") == 0)


def _call_op(name: str, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             states: Sequence[Optional[torch.Tensor]], master: Optional[torch.Tensor], steps: torch.Tensor,
             grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor], hyper: AdamHyperParams) -> None:
    """The op boundary: advance ``steps``, then run op ``name`` on states in
    its order, unchecked, with the record unpacked into the op's scalars
    (the one place it is unpacked), through ``ops.adam.call``."""
    _advance_steps(steps, found_inf)
    device = states[0].device
    args = (params, grads, *states, master, steps[:1],
            None if grad_scale is None else grad_scale.to(device, torch.float32),
            None if found_inf is None else found_inf.to(device, torch.float32), *hyper.values)
    call(name, args, [*params, *states, master])
