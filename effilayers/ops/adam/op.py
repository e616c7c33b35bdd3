"""The fused Adam/AdamW update of one chunk as torch.library custom ops:
``effilayers::adam_step_`` and ``effilayers::adam_step_8bit_`` (arguments:
:mod:`effilayers.ops.adam.contract`; math and 8-bit codes:
:mod:`effilayers.ops.adam.reference`).

Each op has one name, ``adam_step_`` / ``adam_step_8bit_``: the custom op
``effilayers::<name>``, its kernels in the registry (the C++ one is
``effilayers_cpu::<name>``) and the Python function here. The ops' bodies
check their arguments (so a call through ``torch.ops`` is checked like one
through :func:`adam_step_`) and run the kernel the registry chose for the
states' device. The schemas and every kernel take the hyper-parameters as
scalars; the Python functions take one
:class:`~effilayers.ops.adam.contract.AdamHyperParams` and unpack it into the
op, the one place it is unpacked.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..._core import registry
from .contract import AdamHyperParams, check_adam_8bit_arguments, check_adam_arguments, op_schema
from .reference import adam_step_8bit_reference_kernel, adam_step_reference_kernel

__all__ = ["adam_step_", "adam_step_8bit_"]

_ADAM_SCHEMA = op_schema(("exp_avg", "exp_avg_sq"), ("max_exp_avg_sq",))
_ADAM_8BIT_SCHEMA = op_schema(("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"),
                              ("max_exp_avg_sq", "max_exp_avg_sq_absmax"))


@torch.library.custom_op("effilayers::adam_step_", mutates_args=_ADAM_SCHEMA.mutates, schema=_ADAM_SCHEMA.schema)
def _adam_step_op(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale, found_inf,
                  *scalars) -> None:
    check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step)
    registry.kernel("adam_step_", exp_avg.device)(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step,
                                                  grad_scale, found_inf, *scalars)


@torch.library.custom_op("effilayers::adam_step_8bit_", mutates_args=_ADAM_8BIT_SCHEMA.mutates,
                         schema=_ADAM_8BIT_SCHEMA.schema)
def _adam_step_8bit_op(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq,
                       max_exp_avg_sq_absmax, master, step, grad_scale, found_inf, *scalars) -> None:
    states = (exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq, max_exp_avg_sq_absmax)
    check_adam_8bit_arguments(params, grads, *states, master, step)
    registry.kernel("adam_step_8bit_", exp_avg.device)(params, grads, *states, master, step, grad_scale, found_inf,
                                                       *scalars)


def _writes_in_place(*args) -> None:
    return None


_adam_step_op.register_fake(_writes_in_place)
_adam_step_8bit_op.register_fake(_writes_in_place)

registry.register(registry.OpKernels(name="adam_step_", reference=adam_step_reference_kernel, cpp="adam_step_",
                                     triton="effilayers.ops.adam.triton:adam_step_triton"))
registry.register(registry.OpKernels(name="adam_step_8bit_", reference=adam_step_8bit_reference_kernel,
                                     cpp="adam_step_8bit_",
                                     triton="effilayers.ops.adam.triton:adam_step_8bit_triton"))


def adam_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor], master: Optional[torch.Tensor],
               step: torch.Tensor, grad_scale: Optional[torch.Tensor] = None,
               found_inf: Optional[torch.Tensor] = None, *, hyper: AdamHyperParams) -> None:
    """One fused Adam/AdamW update of a run of parameters. Mutates
    ``params``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` and
    ``master`` in place."""
    _adam_step_op(list(params), list(grads), exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale,
                  found_inf, *hyper.values)


def adam_step_8bit_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avg: torch.Tensor,
                    exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor, exp_avg_sq_absmax: torch.Tensor,
                    max_exp_avg_sq: Optional[torch.Tensor], max_exp_avg_sq_absmax: Optional[torch.Tensor],
                    master: Optional[torch.Tensor], step: torch.Tensor, grad_scale: Optional[torch.Tensor] = None,
                    found_inf: Optional[torch.Tensor] = None, *, hyper: AdamHyperParams) -> None:
    """One fused Adam/AdamW update with 8-bit block-quantized states.
    Mutates params, codes, scales and master in place."""
    _adam_step_8bit_op(list(params), list(grads), exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                       max_exp_avg_sq, max_exp_avg_sq_absmax, master, step, grad_scale, found_inf, *hyper.values)
