"""Measure memory the way every effilayers claim is measured.

Activation bytes
    The total size of the distinct, non-parameter storages that autograd keeps
    for backward after a forward pass. Counted through
    ``torch.autograd.graph.saved_tensors_hooks`` and de-duplicated by storage,
    so a tensor saved by several nodes, or a view of it, or the output of an
    in-place op that shares its input's storage, counts once. Exact and
    device-independent: it works on CPU, so tests can hold memory claims.

CUDA peak bytes
    ``torch.cuda.reset_peak_memory_stats()`` then ``max_memory_allocated()``
    around one call (typically one full training step).

Both come as a function and as a context manager::

    from effilayers import memory

    saved = memory.activation_bytes(model, x)          # model's parameters and buffers excluded
    with memory.track_activations(exclude=model) as meter:
        loss = model(x).sum()
    print(meter.bytes, meter.largest(5))

    peak = memory.cuda_peak_bytes(train_step)           # needs CUDA
    with memory.track_cuda_peak() as peak:
        train_step()
    print(peak.peak_bytes, peak.step_bytes)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

__all__ = [
    "SavedStorage",
    "ActivationMeter",
    "track_activations",
    "activation_bytes",
    "CudaPeakMeter",
    "track_cuda_peak",
    "cuda_peak_bytes",
]

Excludable = Union[nn.Module, torch.Tensor, Iterable[Union[nn.Module, torch.Tensor]], None]


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _excluded_keys(exclude: Excludable) -> set[tuple[str, int]]:
    if exclude is None:
        return set()
    items = [exclude] if isinstance(exclude, (nn.Module, torch.Tensor)) else list(exclude)
    keys = set()
    for item in items:
        if isinstance(item, nn.Module):
            tensors = [*item.parameters(), *item.buffers()]
        elif isinstance(item, torch.Tensor):
            tensors = [item]
        else:
            raise TypeError(
                f"exclude: expected nn.Module, torch.Tensor or an iterable of them, got {type(item).__name__}"
            )
        keys.update(_storage_key(t) for t in tensors if t.untyped_storage().nbytes() > 0)
    return keys


@dataclass(frozen=True)
class SavedStorage:
    """One distinct storage that autograd keeps for backward."""

    nbytes: int
    device: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the first saved tensor seen on this storage
    saved_by: int  # how many saved-tensor slots point into it


class _Saved:
    """What the meter hands autograd for one saved tensor."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


class ActivationMeter:
    """Context manager that records every tensor autograd saves inside it.

    Only tensors that are still saved when you read ``bytes`` count: the
    meter keeps weak references, so a graph you drop inside the block stops
    counting, and the meter itself never keeps memory alive. Parameters
    (``nn.Parameter``) never count, nor do views of them (the ``weight.t()``
    a Linear saves) or anything else saved on a storage of a parameter
    saved in the block; pass modules or tensors in ``exclude`` to leave out
    their storages as well (a module: its parameters and buffers).
    """

    def __init__(self, exclude: Excludable = None) -> None:
        self._exclude = exclude
        self._excluded: set[tuple[str, int]] = set()
        # Storages of the parameters seen saved, themselves or through a view.
        self._parameter_storages: set[tuple[str, int]] = set()
        self._saved: list[weakref.ref] = []
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _pack(self, tensor: torch.Tensor) -> "_Saved":
        # Hand autograd a holder of a detached alias (same storage and version
        # counter), not the tensor itself: a node that saves its own output
        # would otherwise hold that output, whose grad_fn holds the node, and
        # the graph would never be freed. The weak reference then lives
        # exactly as long as autograd keeps the saved tensor.
        saved = _Saved(tensor.detach(), tensor._version)
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            self._parameter_storages.add(_storage_key(tensor))
        else:
            self._saved.append(weakref.ref(saved))
        return saved

    @staticmethod
    def _unpack(saved: "_Saved") -> torch.Tensor:
        # With hooks installed autograd skips its own check that a saved
        # tensor was not modified in place; keep it, or an in-place layer
        # misused under the meter would give silently wrong gradients.
        if saved.tensor._version != saved.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a saved {tuple(saved.tensor.shape)} {saved.tensor.dtype} tensor is at version "
                f"{saved.tensor._version}; expected version {saved.version} (effilayers.memory meter)"
            )
        return saved.tensor

    def __enter__(self) -> "ActivationMeter":
        self._excluded = _excluded_keys(self._exclude)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc_info)
        self._hooks = None

    def storages(self) -> list[SavedStorage]:
        """The distinct saved storages, largest first."""
        found: dict[tuple[str, int], list] = {}
        for ref in self._saved:
            holder = ref()
            if holder is None:
                continue
            tensor = holder.tensor
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = _storage_key(tensor)
            if key in self._excluded or key in self._parameter_storages:
                continue
            if key in found:
                found[key][4] += 1
            else:
                found[key] = [storage.nbytes(), str(tensor.device), tensor.dtype, tuple(tensor.shape), 1]
        return sorted((SavedStorage(*entry) for entry in found.values()), key=lambda s: -s.nbytes)

    @property
    def bytes(self) -> int:
        """Activation bytes: total size of the distinct saved storages."""
        return sum(s.nbytes for s in self.storages())

    def largest(self, n: int = 10) -> list[SavedStorage]:
        return self.storages()[:n]


def track_activations(exclude: Excludable = None) -> ActivationMeter:
    """``with track_activations(exclude=model) as meter: ...``; see :class:`ActivationMeter`."""
    return ActivationMeter(exclude)


def activation_bytes(fn: Callable, *args: Any, exclude: Excludable = None, **kwargs: Any) -> int:
    """Activation bytes of one forward call ``fn(*args, **kwargs)``.

    Runs with gradients enabled and drops the result afterwards. When ``fn``
    is an ``nn.Module`` its parameters and buffers are excluded.
    """
    if not callable(fn):
        raise TypeError(f"activation_bytes: fn must be callable, got {type(fn).__name__}")
    excluded: list = [] if exclude is None else ([exclude] if isinstance(exclude, (nn.Module, torch.Tensor)) else list(exclude))
    if isinstance(fn, nn.Module):
        excluded.append(fn)
    with torch.enable_grad(), ActivationMeter(excluded) as meter:
        output = fn(*args, **kwargs)
    result = meter.bytes
    del output
    return result


def _cuda_device(device: Union[None, int, str, torch.device]) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "CUDA peak bytes need a CUDA device and none is available; "
            "effilayers.memory.activation_bytes measures saved activations on any device"
        )
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {resolved}")
    return resolved


class CudaPeakMeter:
    """Context manager: the peak CUDA memory allocated inside the block.

    ``peak_bytes`` is ``torch.cuda.max_memory_allocated`` over the block (what
    decides whether a step fits); ``baseline_bytes`` what was allocated on
    entry (parameters, optimizer state, ...); ``step_bytes`` the difference.
    """

    def __init__(self, device: Union[None, int, str, torch.device] = None) -> None:
        self.device = _cuda_device(device)
        self.peak_bytes = 0
        self.baseline_bytes = 0

    @property
    def step_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes

    def __enter__(self) -> "CudaPeakMeter":
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.baseline_bytes = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        torch.cuda.synchronize(self.device)
        self.peak_bytes = torch.cuda.max_memory_allocated(self.device)


def track_cuda_peak(device: Union[None, int, str, torch.device] = None) -> CudaPeakMeter:
    """``with track_cuda_peak() as peak: step()``; see :class:`CudaPeakMeter`."""
    return CudaPeakMeter(device)


def cuda_peak_bytes(fn: Callable, *args: Any, device: Union[None, int, str, torch.device] = None, **kwargs: Any) -> int:
    """Peak CUDA bytes allocated while ``fn(*args, **kwargs)`` runs (one training step, say)."""
    if not callable(fn):
        raise TypeError(f"cuda_peak_bytes: fn must be callable, got {type(fn).__name__}")
    with CudaPeakMeter(device) as meter:
        fn(*args, **kwargs)
    return meter.peak_bytes
