"""Input makers and recorders shared by op tests (tolerances: accuracy.py)."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def channel_varied(shape, dtype, device="cpu", seed=0, offset_scale=5.0):
    """Random (N, C, ...) data whose channels have different means and scales
    (no zeros, no two channels alike)."""
    generator = torch.Generator().manual_seed(seed)
    channels = shape[1]
    view = [1, channels] + [1] * (len(shape) - 2)
    scale = torch.logspace(-1, 1, channels, dtype=torch.float64).view(view)
    offset = (torch.rand(channels, generator=generator, dtype=torch.float64) * 2 - 1).view(view) * offset_scale
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * scale + offset
    return values.to(dtype=dtype, device=device)


def to_layout(x, layout):
    """Same values, different strides."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "channels_last":
        if x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        if x.dim() == 5:
            return x.contiguous(memory_format=torch.channels_last_3d)
        # rank 2/3: channels innermost via a permuted copy viewed back
        perm = [0] + list(range(2, x.dim())) + [1]
        inverse = [perm.index(i) for i in range(x.dim())]
        return x.permute(perm).contiguous().permute(inverse)
    if layout == "strided":
        # every other element of a wider tensor along the last dim: neither layout
        wide = torch.stack([x, x + 1], dim=-1).flatten(-2)
        result = wide[..., ::2]
        assert x.shape[-1] == 1 or not result.is_contiguous()  # size-1 last dims stay contiguous
        return result
    raise ValueError(layout)


class NewStorages(TorchDispatchMode):
    """Records the ATen ops that run and the bytes of every storage an op
    creates (an output whose storage is none of the op's inputs': views and
    in-place ops create none). What runs inside a custom op is not seen (the
    mode is off while the op runs): record the kernel itself."""

    def __init__(self):
        super().__init__()
        self.ops, self.allocated = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tree_leaves((args, kwargs))
        known = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        known |= {x.data_ptr() for x in inputs if isinstance(x, torch.UntypedStorage)}
        out = func(*args, **kwargs)
        self.ops.append(str(func.overloadpacket))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in known:
                self.allocated.append(x.untyped_storage().nbytes())
        return out


class LaunchSpy:
    """Stands in for a jitted Triton kernel: records each launch's grid and
    keyword arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


class OutputSpy(nn.Module):
    """A ReLU (its backward reads its own output, so autograd saves the
    output) that keeps weak references to what it returned: a graph leaked
    by a saved-tensor hook that holds the output shows as a reference still
    alive after ``gc.collect()``."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = torch.relu(x)
        self.outputs.append(weakref.ref(output))
        return output

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.outputs)
