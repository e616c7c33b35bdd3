"""DTensor parameters (``torch.distributed.fsdp.fully_shard``, tensor
parallelism) in the chunked optimizers.

Adam is elementwise, so a rank updates its local shard alone: the chunks
hold the local tensors (``p.to_local()``) and their gradients' local
shards, and the kernels never see a DTensor. What the user sees keeps
torch's layout: like ``torch.optim.AdamW``'s, a DTensor parameter's state
entries ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` and
``master_param`` are DTensors with the parameter's mesh and placements
(here wrapping views of the chunks), and ``step`` is a plain tensor, so
``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` save and load them, resharding included.

Everything that depends on DTensor lives here; plain tensors pass through
each function unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["is_sharded", "local", "local_grad", "shard_like", "local_value", "check_group_placement"]

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None


def is_sharded(tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel updates: a DTensor's local shard (the tensor
    itself, not a copy, so writes reach the DTensor), else ``tensor``."""
    return tensor._local_tensor if is_sharded(tensor) else tensor


def local_grad(param: torch.Tensor, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The local shard of ``grad`` laid out like ``param``'s. A gradient
    placed otherwise than its parameter (a ``Partial`` sum, a replicated
    gradient of a sharded parameter) is redistributed first: a collective,
    which every rank then runs in the same order, as torch.optim's DTensor
    arithmetic would."""
    if grad is None or not is_sharded(param):
        return grad
    if not is_sharded(grad):
        raise TypeError("a DTensor parameter has a plain torch.Tensor gradient; FSDP2 and DTensor autograd produce "
                        "DTensor gradients, so set param.grad to a DTensor with the parameter's mesh")
    if grad.device_mesh != param.device_mesh or tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor


def shard_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local tensor shaped like ``param``'s shard) as a DTensor
    placed like ``param`` (no copy, no communication); unchanged for plain
    parameters."""
    if not is_sharded(param):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def local_value(param: torch.Tensor, value, key: str):
    """The local part of a state value loaded for ``param``: a DTensor value
    is redistributed to ``param``'s placements (a collective when they
    differ) and its shard taken; a plain tensor shaped like the whole
    parameter is cut to this rank's shard (what a full, unsharded state dict
    holds). Scalars (``step``) and plain parameters pass through."""
    if not is_sharded(param) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        if is_sharded(value) and not is_sharded(param):
            return value.full_tensor()
        return value
    if is_sharded(value):
        if value.device_mesh != param.device_mesh or tuple(value.placements) != tuple(param.placements):
            value = value.redistribute(param.device_mesh, param.placements)
        return value._local_tensor
    if value.shape != param.shape:
        raise ValueError(f"state {key!r} of a DTensor parameter of shape {tuple(param.shape)} is a plain tensor of "
                         f"shape {tuple(value.shape)}; give the whole (unsharded) tensor or a DTensor")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return value[tuple(slice(start, start + size) for start, size in zip(offset, shape))]


def check_group_placement(owner: str, params: list, names: list, where: str) -> None:
    """One param group holds either plain tensors or DTensors on a single
    mesh: the chunks of a group share one step and one state device, and a
    mix is almost always a model only partly wrapped by FSDP2 or a second
    mesh by mistake. ``names``: the parameters' names where given (named
    param groups), else None per parameter."""
    first = None
    for position, (p, name) in enumerate(zip(params, names)):
        label = f"parameter {position}" + (f" ({name!r})" if name else "") + f" of {where}"
        if first is None:
            first = (p, label)
            continue
        reference, reference_label = first
        if is_sharded(p) != is_sharded(reference):
            kinds = {True: "a DTensor", False: "a plain torch.Tensor"}
            raise ValueError(f"{owner}: {label} is {kinds[is_sharded(p)]} but {reference_label} is "
                             f"{kinds[is_sharded(reference)]}; one param group holds either DTensors (FSDP2, tensor "
                             "parallel) or plain tensors: shard the whole model, or put them in separate groups")
        if is_sharded(p) and p.device_mesh != reference.device_mesh:
            raise ValueError(f"{owner}: {label} is on device mesh {p.device_mesh} but {reference_label} is on "
                             f"{reference.device_mesh}; one param group holds DTensors of one mesh: put parameters "
                             "of different meshes in separate param groups")
