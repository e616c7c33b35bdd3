"""Measure memory the way every effilayers claim is measured.

Activation bytes
    What autograd keeps for backward: the non-parameter tensors saved by the
    graph, counted through ``torch.autograd.graph.saved_tensors_hooks`` and
    de-duplicated per storage by the bytes the saved tensors *span*. A saved
    tensor spans the bytes from its lowest- to its highest-addressed element;
    the spans of all tensors saved on one storage are merged, so a tensor
    saved by several nodes, or several views of one tensor, or the output of
    an in-place op that shares its input's storage, counts once, and a saved
    slice ``X[:32]`` of a large ``X`` counts its slice, not all of ``X``. The
    whole storages that the saved tensors keep allocated (``X`` itself, in
    that example) are reported beside it: ``SavedStorage.storage_bytes`` and
    ``ActivationMeter.storage_bytes``. Exact and device-independent: it works
    on CPU, so tests can hold memory claims.

    Tensors kept for backward outside ``saved_tensors_hooks`` (the outputs a
    selective checkpoint caches, what an activation offload keeps) count
    too where their keeper reports them with :func:`count_kept`; host copies
    an offload made count as ``offloaded_bytes``, apart from ``bytes``.

    The meter follows the saved tensors while they live. ``bytes`` is what
    is saved *now*; ``peak_bytes`` the most that was saved at any moment
    since the block began (updated as tensors are saved and as autograd
    releases them). A ``backward()`` that frees the graph releases
    everything it saved, so after ``loss.backward()`` inside or after the
    block ``bytes`` reads 0 (or what other live graphs still hold) and
    ``peak_bytes`` is the figure to read::

        with track_activations(exclude=model) as meter:
            loss = model(x).sum()          # meter.bytes == meter.peak_bytes here
            loss.backward()                # meter.bytes == 0 now
        print(meter.peak_bytes)            # what the forward kept for backward

    Without a dropped graph in between, ``peak_bytes`` equals ``bytes`` at
    the end of the forward; ``activation_bytes()`` returns that.

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

import collections
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
    "storage_key",
    "count_kept",
    "CudaPeakMeter",
    "track_cuda_peak",
    "cuda_peak_bytes",
]

Excludable = Union[nn.Module, torch.Tensor, Iterable[Union[nn.Module, torch.Tensor]], None]


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """(device, data pointer) of ``tensor``'s storage: how the meter tells
    storages apart (``SavedStorage.key``)."""
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _excluded_tensors(exclude: Excludable) -> list[torch.Tensor]:
    if exclude is None:
        return []
    items = [exclude] if isinstance(exclude, (nn.Module, torch.Tensor)) else list(exclude)
    tensors = []
    for item in items:
        if isinstance(item, nn.Module):
            tensors += [*item.parameters(), *item.buffers()]
        elif isinstance(item, torch.Tensor):
            tensors.append(item)
        else:
            raise TypeError(
                f"exclude: expected nn.Module, torch.Tensor or an iterable of them, got {type(item).__name__}"
            )
    return [t for t in tensors if t.untyped_storage().nbytes() > 0]


def _copy_candidates(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """The excluded tensors of two or more dimensions (weights), by shape,
    dtype and device: a saved tensor equal to one of them is a copy of it in
    another layout. torch.compile on CPU keeps channels_last copies of the
    convolution weights for backward (inductor's layout optimisation); they
    are parameter data, as big as the weights however small the batch, and
    would otherwise drown the activations they sit beside."""
    found: dict[tuple, list[torch.Tensor]] = collections.defaultdict(list)
    for tensor in tensors:
        if tensor.dim() >= 2:
            found[(tuple(tensor.shape), tensor.dtype, tensor.device)].append(tensor)
    return found


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte offsets into its storage from the tensor's lowest-
    to just past its highest-addressed element (empty for no elements)."""
    itemsize = tensor.element_size()
    start = tensor.storage_offset()
    if tensor.numel() == 0:
        return start * itemsize, start * itemsize
    last = start + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    return start * itemsize, (last + 1) * itemsize


def _union_length(spans: Iterable[tuple[int, int]]) -> int:
    total = 0
    covered_to = None
    for start, end in sorted(spans):
        if covered_to is None or start > covered_to:
            total += end - start
            covered_to = end
        elif end > covered_to:
            total += end - covered_to
            covered_to = end
    return total


@dataclass(frozen=True)
class SavedStorage:
    """One distinct storage that autograd keeps for backward.

    ``span_bytes`` is what counts as activation bytes: the union of the byte
    ranges the saved tensors on this storage span. ``storage_bytes`` is the
    whole storage they keep allocated (larger when only a slice is saved).
    """

    span_bytes: int
    storage_bytes: int
    device: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the first saved tensor seen on this storage
    saved_by: int  # how many live saved-tensor slots point into it
    # storage_key() of the storage, valid while it lives: which module saved
    # what, for tools that attribute bytes (effilayers.fit).
    key: tuple[str, int] = ("", 0)

    @property
    def nbytes(self) -> int:
        """The bytes that count: ``span_bytes``."""
        return self.span_bytes


class _StorageRecord:
    """The live saved tensors on one storage: their spans and its counted bytes."""

    __slots__ = ("key", "storage_bytes", "device", "dtype", "shape", "spans", "saved_by", "span_bytes", "counted",
                 "offloaded")

    def __init__(self, key: tuple[str, int], storage_bytes: int, tensor: torch.Tensor) -> None:
        self.key = key
        self.storage_bytes = storage_bytes
        self.device = str(tensor.device)
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.spans: collections.Counter = collections.Counter()  # (start, end) -> live saved tensors
        self.saved_by = 0
        self.span_bytes = 0
        # False once the storage turns out to be a parameter's: its later
        # releases then change nothing.
        self.counted = True
        # A host copy an offload made of a saved tensor: host bytes, not the
        # device bytes ``bytes`` counts.
        self.offloaded = False


class _Saved:
    """What the meter hands autograd for one saved tensor."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


class _Release(weakref.ref):
    """Weak reference to a holder that remembers what to take off the count
    when autograd drops the holder (after backward, or with its graph)."""

    __slots__ = ("record", "span")


class ActivationMeter:
    """Context manager that records every tensor autograd saves inside it.

    ``bytes`` counts the tensors saved in the block that autograd still
    keeps when you read it; ``peak_bytes`` the most it kept at any moment
    since the block began (see the module docstring: after ``backward()``
    read ``peak_bytes``). The meter keeps weak references, so a graph you
    drop stops counting, and the meter itself never keeps memory alive.
    Parameters (``nn.Parameter``) never count, nor do views of them (the
    ``weight.t()`` a Linear saves) or anything else saved on a storage of a
    parameter saved in the block; pass modules or tensors in ``exclude`` to
    leave out their storages as well (a module: its parameters and buffers),
    and any saved tensor equal to one of their tensors of two or more
    dimensions in shape, dtype and values: a copy of a weight in another
    layout, as torch.compile keeps for its convolutions.

    Cost: one small holder and one weak reference per saved tensor; each
    save or release re-merges the spans of that one storage only.
    """

    def __init__(self, exclude: Excludable = None) -> None:
        self._exclude = exclude
        self._excluded: set[tuple[str, int]] = set()
        self._copy_candidates: dict[tuple, list[torch.Tensor]] = {}
        # Storages of the parameters seen saved, themselves or through a view.
        self._parameter_storages: set[tuple[str, int]] = set()
        self._records: dict[tuple[str, int], _StorageRecord] = {}
        self._releases: set[_Release] = set()
        # Weak-reference callbacks only queue the release: they can fire in
        # the middle of _pack (a garbage collection) or on autograd's
        # backward threads, and a deque append is atomic in both cases.
        self._released: collections.deque = collections.deque()
        self._current = 0
        self._peak = 0
        self._current_offloaded = 0
        self._peak_offloaded = 0
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _pack(self, tensor: torch.Tensor) -> "_Saved":
        # Hand autograd a holder of a detached alias (same storage and version
        # counter), not the tensor itself: a node that saves its own output
        # would otherwise hold that output, whose grad_fn holds the node, and
        # the graph would never be freed. The weak reference then lives
        # exactly as long as autograd keeps the saved tensor.
        saved = _Saved(tensor.detach(), tensor._version)
        self._track(tensor, saved, offloaded=False)
        return saved

    def _track(self, tensor: torch.Tensor, holder: Any, offloaded: bool) -> None:
        """Count ``tensor`` while ``holder`` lives (see :func:`count_kept`)."""
        self._apply_releases()
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        key = (str(tensor.device), storage.data_ptr())
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            self._parameter_storages.add(key)
            record = self._records.pop(key, None)
            if record is not None:
                # Saved before the parameter itself (a detached alias of it):
                # counted no longer, though a peak already reached keeps it.
                self._add(record, -record.span_bytes)
                record.counted = False
            return
        if key in self._excluded or key in self._parameter_storages:
            return
        candidates = self._copy_candidates.get((tuple(tensor.shape), tensor.dtype, tensor.device))
        if candidates and any(torch.equal(tensor, candidate) for candidate in candidates):
            self._excluded.add(key)
            return
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = _StorageRecord(key, storage.nbytes(), tensor)
            record.offloaded = offloaded
        release = _Release(holder, self._released.append)
        release.record = record
        release.span = _byte_span(tensor)
        self._releases.add(release)
        record.saved_by += 1
        record.spans[release.span] += 1
        self._recount(record)

    def _add(self, record: _StorageRecord, change: int) -> None:
        if record.offloaded:
            self._current_offloaded += change
            self._peak_offloaded = max(self._peak_offloaded, self._current_offloaded)
        else:
            self._current += change
            self._peak = max(self._peak, self._current)

    def _recount(self, record: _StorageRecord) -> None:
        span_bytes = _union_length(record.spans)
        self._add(record, span_bytes - record.span_bytes)
        record.span_bytes = span_bytes

    def _apply_releases(self) -> None:
        while self._released:
            release = self._released.popleft()
            self._releases.discard(release)
            record = release.record
            record.saved_by -= 1
            record.spans[release.span] -= 1
            if not record.spans[release.span]:
                del record.spans[release.span]
            if not record.counted:
                continue
            self._recount(record)
            if record.saved_by == 0 and self._records.get(record.key) is record:
                del self._records[record.key]

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
        excluded = _excluded_tensors(self._exclude)
        self._excluded = {storage_key(t) for t in excluded}
        self._copy_candidates = _copy_candidates(excluded)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        assert self._hooks is not None
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc_info)
        self._hooks = None

    def storages(self) -> list[SavedStorage]:
        """The distinct storages saved tensors still keep, largest span first
        (offloaded host copies not included)."""
        self._apply_releases()
        found = [SavedStorage(r.span_bytes, r.storage_bytes, r.device, r.dtype, r.shape, r.saved_by, r.key)
                 for r in self._records.values() if not r.offloaded]
        return sorted(found, key=lambda s: (-s.span_bytes, -s.storage_bytes))

    @property
    def bytes(self) -> int:
        """Activation bytes saved now: merged spans of the saved tensors autograd still keeps."""
        self._apply_releases()
        return self._current

    @property
    def peak_bytes(self) -> int:
        """The most activation bytes saved at any moment since the block began."""
        self._apply_releases()
        return self._peak

    @property
    def offloaded_bytes(self) -> int:
        """Host bytes now held for backward by an activation offload (copies of
        saved tensors reported with ``count_kept(..., offloaded=True)``); not in ``bytes``."""
        self._apply_releases()
        return self._current_offloaded

    @property
    def peak_offloaded_bytes(self) -> int:
        """The most ``offloaded_bytes`` at any moment since the block began."""
        self._apply_releases()
        return self._peak_offloaded

    @property
    def storage_bytes(self) -> int:
        """The whole storages the saved tensors keep allocated now (>= ``bytes``)."""
        return sum(s.storage_bytes for s in self.storages())

    def largest(self, n: int = 10) -> list[SavedStorage]:
        return self.storages()[:n]


# The meters entered on this thread, innermost last: count_kept reports to the innermost.
_ACTIVE: list[ActivationMeter] = []


def count_kept(tensor: torch.Tensor, holder: Any, *, offloaded: bool = False) -> None:
    """Count ``tensor`` in the innermost active meter, as a saved tensor, for
    as long as ``holder`` (any object a weak reference can point to) lives.

    For tensors kept for backward where ``saved_tensors_hooks`` does not see
    them: the outputs a selective checkpoint caches in its own storage, the
    tensors an activation offload keeps or copies to host inside its own
    hooks (``offloaded=True``: host copies, counted in ``offloaded_bytes``,
    not in ``bytes``). No meter active: nothing happens.
    """
    if _ACTIVE:
        _ACTIVE[-1]._track(tensor, holder, offloaded)


def track_activations(exclude: Excludable = None) -> ActivationMeter:
    """``with track_activations(exclude=model) as meter: ...``; see :class:`ActivationMeter`."""
    return ActivationMeter(exclude)


def activation_bytes(fn: Callable, *args: Any, exclude: Excludable = None, **kwargs: Any) -> int:
    """Activation bytes of one forward call ``fn(*args, **kwargs)``: what
    autograd keeps when it returns (the meter's ``bytes`` at that moment).

    Runs with gradients enabled and drops the result afterwards. When ``fn``
    is an ``nn.Module`` its parameters and buffers are excluded.
    """
    if not callable(fn):
        raise TypeError(f"activation_bytes: fn must be callable, got {type(fn).__name__}")
    if exclude is None:
        excluded: list = []
    else:
        excluded = [exclude] if isinstance(exclude, (nn.Module, torch.Tensor)) else list(exclude)
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
