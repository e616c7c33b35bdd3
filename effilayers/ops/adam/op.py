"""The fused Adam/AdamW update of one chunk as declared ops:
``effilayers::adam_step_`` and ``effilayers::adam_step_8bit_`` (arguments:
:mod:`effilayers.ops.adam.contract`; math and 8-bit codes:
:mod:`effilayers.ops.adam.reference`).

Each op has one name, ``adam_step_`` / ``adam_step_8bit_``: the op
``effilayers::<name>`` (declared here from its one schema; the C++ library
adds its CPU kernel to it), its kernels in the registry and the Python
function here. A call through ``torch.ops`` is checked like one through
:func:`adam_step_`: the C++ kernel checks for itself, and the registry runs
``contract.check_adam_arguments`` before the Triton and reference kernels.
The schemas and every kernel take the hyper-parameters as scalars; the
Python functions take one
:class:`~effilayers.ops.adam.contract.AdamHyperParams` and unpack it into the
op (:func:`call`), the one place it is unpacked.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..._core import registry
from .contract import AdamHyperParams, check_adam_8bit_arguments, check_adam_arguments, op_schema
from .reference import adam_step_8bit_reference_kernel, adam_step_reference_kernel

__all__ = ["adam_step_", "adam_step_8bit_", "call"]

_ADAM_SCHEMA = op_schema(("exp_avg", "exp_avg_sq"), ("max_exp_avg_sq",))
_ADAM_8BIT_SCHEMA = op_schema(("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"),
                              ("max_exp_avg_sq", "max_exp_avg_sq_absmax"))


def _writes_in_place(*args) -> None:
    return None


def _check_adam(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, *scalars) -> None:
    check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step)


def _check_adam_8bit(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq,
                     max_exp_avg_sq_absmax, master, step, *scalars) -> None:
    check_adam_8bit_arguments(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq,
                              max_exp_avg_sq_absmax, master, step)


registry.register(registry.OpKernels(name="adam_step_", reference=adam_step_reference_kernel, cpp="adam_step_",
                                     triton="effilayers.ops.adam.triton:adam_step_triton"))
registry.register(registry.OpKernels(name="adam_step_8bit_", reference=adam_step_8bit_reference_kernel,
                                     cpp="adam_step_8bit_",
                                     triton="effilayers.ops.adam.triton:adam_step_8bit_triton"))

# Declared once here; csrc/cpu/adam.cpp adds the CPU kernels, the registry
# the Triton and reference ones where those are the choice.
_OPS = {
    "adam_step_": registry.declare("adam_step_", _ADAM_SCHEMA.schema, _writes_in_place, check=_check_adam),
    "adam_step_8bit_": registry.declare("adam_step_8bit_", _ADAM_8BIT_SCHEMA.schema, _writes_in_place,
                                        check=_check_adam_8bit),
}


def call(name: str, args: tuple, written: Sequence[Optional[torch.Tensor]]) -> None:
    """Run op ``name`` (``adam_step_`` or ``adam_step_8bit_``) on its
    arguments, checked already, and bump the version counters of the
    tensors in ``written`` (None skipped), as an in-place op's
    ADInplaceOrView step would (an op declared from a schema has none).

    In eager steps on plain tensors (``registry.runs_eagerly``) that is the
    kernel the op runs on this device, called directly: the compiled one is
    the op itself (one dispatcher hop, and it checks for itself), but the
    op's Triton or reference kernel would first repeat the Python argument
    checks, a loop over the parameters that costs more than a small update
    (ARCHITECTURE.md, "Declared ops"). Anywhere else (torch.compile, tensor
    subclasses such as DTensor, autograd recording) it is the op, checked
    there."""
    like = args[2]
    if registry.runs_eagerly(like):
        registry.kernel(name, like.device)(*args)
    else:
        _OPS[name](*args)
        if torch.compiler.is_compiling():
            return  # the graph writes the mutations back, which bumps them
    torch.autograd.graph.increment_version([t for t in written if t is not None])


def adam_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor], master: Optional[torch.Tensor],
               step: torch.Tensor, grad_scale: Optional[torch.Tensor] = None,
               found_inf: Optional[torch.Tensor] = None, *, hyper: AdamHyperParams) -> None:
    """One fused Adam/AdamW update of a run of parameters. Mutates
    ``params``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` and
    ``master`` in place."""
    params = list(params)
    check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step)
    call("adam_step_", (params, list(grads), exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale,
                        found_inf, *hyper.values), [*params, exp_avg, exp_avg_sq, max_exp_avg_sq, master])


def adam_step_8bit_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avg: torch.Tensor,
                    exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor, exp_avg_sq_absmax: torch.Tensor,
                    max_exp_avg_sq: Optional[torch.Tensor], max_exp_avg_sq_absmax: Optional[torch.Tensor],
                    master: Optional[torch.Tensor], step: torch.Tensor, grad_scale: Optional[torch.Tensor] = None,
                    found_inf: Optional[torch.Tensor] = None, *, hyper: AdamHyperParams) -> None:
    """One fused Adam/AdamW update with 8-bit block-quantized states.
    Mutates params, codes, scales and master in place."""
    params = list(params)
    states = (exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq, max_exp_avg_sq_absmax)
    check_adam_8bit_arguments(params, grads, *states, master, step)
    call("adam_step_8bit_", (params, list(grads), *states, master, step, grad_scale, found_inf, *hyper.values),
         [*params, *states, master])

