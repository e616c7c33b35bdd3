"""Viewing a tensor as (outer, reduced, inner) without copying it.

Row-wise ops (softmax over ``dim``, cross-entropy over the class dimension)
and reductions over some dimensions all walk the same three index ranges:
``outer`` independent problems, each reducing ``reduced`` values that sit
``reduced_stride`` elements apart, repeated for ``inner`` neighbouring
problems ``inner_stride`` apart. A kernel written for that form reads the last
dimension of a contiguous tensor (``inner == 1``), a leading dimension
(``outer == 1``), the channel dimension of a channels_last tensor, a transposed
matrix and most slices in place, because each group of dimensions is merged
only where its strides nest (``stride[d] == stride[d + 1] * size[d + 1]``).

Where a group does not merge (a reduction over dimensions 0 and 2 of a
contiguous tensor, a doubly strided slice), :func:`three_groups` returns
``None`` and the caller copies (``.contiguous()`` after moving the reduced
dimensions together); kernels document that copy as the one case that costs an
input-sized buffer.

They also share :func:`refuse_forward_ad`: their custom ops have no
forward-mode derivative, and torch would drop an input's tangent silently.

The same ops share one autocast rule, :func:`autocast_to_float32`: where
``torch.autocast`` runs the torch op an effilayers op replaces in float32,
the effilayers op returns float32 too (its reduced result or loss only; the
input is never copied to float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.autograd import forward_ad

__all__ = ["ThreeGroups", "merge_dims", "three_groups", "three_view", "normalize_dims", "autocast_to_float32",
           "refuse_forward_ad", "is_dense", "same_layout", "memory_flat"]


@dataclass(frozen=True)
class ThreeGroups:
    outer: int
    reduced: int
    inner: int
    outer_stride: int
    reduced_stride: int
    inner_stride: int

    @property
    def numel(self) -> int:
        return self.outer * self.reduced * self.inner


def normalize_dims(dim, ndim: int, name: str = "dim", op: str = "effilayers") -> tuple[int, ...]:
    """``dim`` (int, sequence of ints or None for all) as sorted, distinct,
    non-negative ints; raises TypeError/IndexError like torch does."""
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) and not isinstance(dim, bool) else dim
    try:
        dims = list(dims)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an int, a sequence of ints or None, got {type(dim).__name__}") from None
    result = []
    rank = max(ndim, 1)  # a 0-dim tensor accepts dim 0 and -1, as torch does
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"{op}: {name} must contain ints, got {d!r}")
        if not -rank <= d < rank:
            raise IndexError(f"{op}: {name} {d} is out of range for a tensor with {ndim} dimensions "
                             f"(expected -{rank} <= {name} < {rank})")
        d = d % rank
        if d in result:
            raise ValueError(f"{op}: {name} {d} appears more than once in {dim!r}")
        result.append(d)
    return tuple(sorted(result))


def merge_dims(sizes: Sequence[int], strides: Sequence[int]) -> Optional[tuple[int, int]]:
    """(size, stride) of one index running over ``sizes`` in row-major order,
    or None when the strides do not nest. Size-1 dimensions are ignored."""
    pairs = [(s, t) for s, t in zip(sizes, strides) if s != 1]
    if not pairs:
        return 1, 1
    size, stride = pairs[-1]
    for s, t in reversed(pairs[:-1]):
        if t != stride * size:
            return None
        size *= s
    return size, stride


def three_groups(x: torch.Tensor, dims: Sequence[int]) -> Optional[ThreeGroups]:
    """``x`` as (outer, reduced, inner) when ``dims`` (sorted, distinct) are a
    run of consecutive dimensions and each of the three groups merges;
    otherwise None. An empty run (``dims == ()``) reduces one value."""
    sizes, strides = list(x.shape), list(x.stride())
    if dims and list(dims) != list(range(dims[0], dims[-1] + 1)):
        return None
    first = dims[0] if dims else x.dim()
    last = dims[-1] + 1 if dims else x.dim()
    groups = []
    for lo, hi in ((0, first), (first, last), (last, x.dim())):
        merged = merge_dims(sizes[lo:hi], strides[lo:hi])
        if merged is None:
            return None
        groups.append(merged)
    (outer, outer_stride), (reduced, reduced_stride), (inner, inner_stride) = groups
    return ThreeGroups(outer, reduced, inner, outer_stride, reduced_stride, inner_stride)


def three_view(x: torch.Tensor, dims: Sequence[int]) -> Optional[torch.Tensor]:
    """``x`` as an (outer, reduced, inner) view over ``dims`` (see
    :func:`three_groups`) without a copy, or None when its strides do not
    allow one."""
    groups = three_groups(x, dims)
    if groups is None:
        return None
    return x.as_strided((groups.outer, groups.reduced, groups.inner),
                        (groups.outer_stride, groups.reduced_stride, groups.inner_stride), x.storage_offset())


# torch.autocast's policy is per device: an op is either left alone or run in
# float32 on eligible (float16/bfloat16/float32) inputs; float64 is never
# touched. What torch 2.13 does with the ops effilayers replaces (measured by
# running them under autocast, CUDA through fake CUDA tensors, and matching
# the AutocastCPU/AutocastCUDA kernels the dispatcher registers):
#   float32 on CPU and CUDA: cross_entropy (CPU lists cross_entropy_loss; CUDA
#                            lists the log_softmax and nll_loss it decomposes into)
#   float32 on CUDA only:    sum, linalg_vector_norm / norm, softmax, log_softmax
#   input dtype everywhere:  mean, var, std
_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def autocast_to_float32(x: torch.Tensor, device_types: Sequence[str]) -> bool:
    """True when ``torch.autocast`` is enabled for ``x``'s device, that device
    type is one of ``device_types`` (where torch's autocast runs the op in
    float32) and ``x``'s dtype is one autocast casts."""
    device_type = x.device.type
    return (device_type in device_types and x.dtype in _AUTOCAST_ELIGIBLE
            and torch.is_autocast_enabled(device_type))


def refuse_forward_ad(op: str, *tensors: Optional[torch.Tensor]) -> None:
    """Raise where one of ``tensors`` carries a forward-mode tangent
    (``torch.func.jvp`` / ``jacfwd``, ``torch.autograd.forward_ad``): the
    custom ops register no forward-mode rule, and torch then returns the
    output without a tangent, which jvp reads as a zero derivative (a wrong
    answer, silently). Outside a dual level (every ordinary call) this is one
    integer comparison."""
    if forward_ad._current_level < 0:
        return
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and forward_ad.unpack_dual(tensor).tangent is not None:
            raise NotImplementedError(
                f"{op}: forward-mode AD (torch.func.jvp, torch.func.jacfwd, torch.autograd.forward_ad) is not "
                "supported: the effilayers op has no forward derivative and torch would return a zero tangent; "
                "use reverse mode (backward, torch.autograd.grad) or the torch op"
            )


def is_dense(t: torch.Tensor) -> bool:
    """``t`` fills one block of memory without gaps or overlaps (contiguous,
    channels_last or any other permutation of contiguous): then
    ``empty_like`` keeps its strides and its elements can be walked flat."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same strides wherever a dimension has more than one element."""
    return all(size == 1 or sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


def memory_flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as a 1-D view."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())
