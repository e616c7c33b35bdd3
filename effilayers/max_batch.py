"""The largest batch that trains: ``effilayers.find_max_batch``.

``find_max_batch(step_fn, start, limit)`` calls ``step_fn(batch)`` (one
training step at that batch size, written by you) at growing batch sizes:
it doubles from ``start`` until a step runs out of memory or ``limit`` is
reached, then bisects between the last batch that fit and the first that
did not, down to one batch, or with ``precision=p`` until the first that did
not is within ``p`` of the last that fit (``p=0.02``: within 2%, fewer of the
largest and slowest steps). Between tries it frees what the last one left (the gradients of
``model``, unreferenced tensors, the CUDA caching allocator's free blocks).
It returns a :class:`MaxBatch`: the batch, the CUDA peak bytes of its step,
and how many steps it ran::

    found = effilayers.find_max_batch(step, start=32, limit=4096, model=model)
    print(found.batch, found.peak_bytes, found.tries)

"Runs out of memory" means ``torch.OutOfMemoryError``, or a RuntimeError
saying "out of memory" or that cuBLAS or cuDNN failed to allocate
(:func:`is_out_of_memory`); cuDNN's "not supported" counts once a smaller
batch has trained (it then means the batch is too large for its workspace or
indexing; before, a configuration error). A batch that BatchNorm refuses in
training because it leaves one value per channel does not train either
(found 0 when that is all there is). Any other error propagates. The search
assumes that a batch fits when a larger one does, as memory use is monotone
in the batch size; it never tries a batch twice or one above ``limit``.

The memory is CUDA's: on other devices nothing runs out cleanly, and
``peak_bytes`` is None. To test a step function (or this search) without a
GPU, raise ``torch.OutOfMemoryError`` above a batch size of your choosing.
``effilayers-bench --max-batch`` runs this search on each variant.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from . import memory

__all__ = ["MaxBatch", "find_max_batch", "is_out_of_memory", "max_tries", "release_memory",
           "too_small_for_batch_norm", "DEFAULT_LIMIT"]

DEFAULT_LIMIT = 4096

# Allocation failures that do not raise torch.OutOfMemoryError: cuBLAS and
# cuDNN report a failed workspace allocation as a plain RuntimeError.
_OUT_OF_MEMORY_TEXT = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
# cuDNN also finds no algorithm ("not supported") for a batch too large for
# its workspace or indexing: "does not fit" once a smaller batch has trained,
# a configuration error when nothing has.
_TOO_LARGE_TEXT = "CUDNN_STATUS_NOT_SUPPORTED"
_OUT_OF_MEMORY_ERROR = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
# BatchNorm in training refuses a batch with one value per channel: batch 1
# does not train such a model, whatever the memory. torch says "Expected
# more than 1 value per channel when training, ..."; effilayers' ABN and
# DenseNet bottleneck say the same after their own name ("bottleneck:
# expected ...").
_ONE_VALUE_PER_CHANNEL = "expected more than 1 value per channel when training"

Releasable = Union[nn.Module, Iterable[torch.Tensor], None]
DeviceLike = Union[None, int, str, torch.device]


@dataclass(frozen=True)
class MaxBatch:
    """What :func:`find_max_batch` found."""

    batch: int  # the largest batch whose step ran; 0 when none did
    peak_bytes: Optional[int]  # CUDA peak bytes of that step (track_cuda_peak); None off CUDA or when batch is 0
    tries: int  # how many times step_fn ran


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` means "this batch does not fit", not a bug."""
    if isinstance(error, _OUT_OF_MEMORY_ERROR):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY_TEXT)


def too_small_for_batch_norm(error: BaseException) -> bool:
    """Whether ``error`` is BatchNorm (torch's, or effilayers' ABN and DenseNet
    bottleneck) refusing a training batch that leaves one value per channel."""
    return isinstance(error, ValueError) and _ONE_VALUE_PER_CHANNEL in str(error).lower()


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def release_memory(model: Releasable = None, device: DeviceLike = None) -> None:
    """Free what a training step left behind: ``model``'s gradients (a module,
    or tensors; a step that ran out of memory in backward leaves some), then
    unreferenced tensors (``gc.collect``) and, on CUDA, the caching
    allocator's free blocks (``torch.cuda.empty_cache``)."""
    model = _releasable(model, "release_memory")
    if isinstance(model, nn.Module):
        model.zero_grad(set_to_none=True)
    elif model is not None:
        for tensor in model:
            tensor.grad = None
    gc.collect()
    _empty_cache(_resolve_device(device))


def max_tries(start: int, limit: int) -> int:
    """An upper bound on the steps :func:`find_max_batch` runs (for a progress bar)."""
    start = min(start, limit)
    return 1 + math.ceil(math.log2(limit / start)) + math.ceil(math.log2(limit))


def _bisect(fits: Callable[[int], bool], start: int, limit: int, precision: float = 0.0) -> int:
    """Largest batch in ``[1, limit]`` for which ``fits(batch)``, doubling from
    ``start`` then bisecting until the smallest batch known not to fit is at
    most ``max(1, precision * largest)`` above the largest that fits; 0 when
    batch 1 does not fit."""
    start = min(start, limit)
    if fits(start):
        largest, smallest_failing = start, None
        while largest < limit:
            candidate = min(2 * largest, limit)
            if fits(candidate):
                largest = candidate
            else:
                smallest_failing = candidate
                break
        if smallest_failing is None:
            return largest
    else:
        largest, smallest_failing = 0, start
    while smallest_failing - largest > max(1, precision * largest):
        middle = (largest + smallest_failing) // 2
        if fits(middle):
            largest = middle
        else:
            smallest_failing = middle
    return largest


def _resolve_device(device: DeviceLike) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"device must be None, an int, a str or a torch.device, got {type(device).__name__}")
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _releasable(model: Any, owner: str) -> Releasable:
    """``model`` as release_memory takes it, with an iterator (``parameters()``)
    made a list so that every try drops the same gradients."""
    if model is None or isinstance(model, nn.Module):
        return model
    if isinstance(model, torch.Tensor):
        return [model]
    try:
        tensors = list(model)
    except TypeError:
        raise TypeError(f"{owner}: model must be None, an nn.Module or an iterable of tensors, "
                        f"got {type(model).__name__}") from None
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{owner}: model must be None, an nn.Module or an iterable of tensors; "
                            f"it holds a {type(tensor).__name__}")
    return tensors


def _check_arguments(step_fn: Any, start: Any, limit: Any, on_try: Any, precision: Any = 0.0) -> None:
    if not callable(step_fn):
        raise TypeError(f"find_max_batch: step_fn must be callable, got {type(step_fn).__name__}")
    for name, value in (("start", start), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"find_max_batch: {name} must be an int, got {type(value).__name__}")
    if start < 1 or limit < 1:
        raise ValueError(f"find_max_batch: start and limit must be >= 1, got start={start}, limit={limit}")
    if on_try is not None and not callable(on_try):
        raise TypeError(f"find_max_batch: on_try must be callable or None, got {type(on_try).__name__}")
    if isinstance(precision, bool) or not isinstance(precision, (int, float)):
        raise TypeError(f"find_max_batch: precision must be a float in [0, 1), got {type(precision).__name__}")
    if not 0 <= precision < 1:
        raise ValueError(f"find_max_batch: precision must be in [0, 1), got {precision!r}")


def find_max_batch(step_fn: Callable[[int], Any], start: int, limit: int = DEFAULT_LIMIT, *,
                   model: Releasable = None, device: DeviceLike = None,
                   on_try: Optional[Callable[[int, bool], None]] = None, precision: float = 0.0) -> MaxBatch:
    """The largest batch in ``[1, limit]`` at which ``step_fn(batch)`` runs
    without running out of memory (see :mod:`effilayers.max_batch`).

    ``step_fn(batch)``: one full training step at that batch size (forward,
    backward, optimizer step), raising as CUDA does when memory runs out.
    ``start``: the first batch tried (a size you expect to fit; above
    ``limit`` it is ``limit``). ``limit``: the largest batch tried.
    ``model``: the module (or tensors) whose gradients are dropped after
    every try. ``device``: the CUDA device whose peak bytes are measured and
    whose cache is emptied (default: the current one when CUDA is
    available; a CPU device measures nothing). ``on_try(batch, fits)``:
    called after every try, for a progress display. ``precision``: 0 finds
    the largest batch exactly; ``p`` in (0, 1) stops once a batch that does
    not fit is within ``p`` of one that does (the batch found is then at
    most that far below the largest).
    """
    _check_arguments(step_fn, start, limit, on_try, precision)
    model = _releasable(model, "find_max_batch")
    where = _resolve_device(device)
    on_cuda = where.type == "cuda"
    peaks: dict[int, int] = {}
    tries = 0
    trained = False

    def fits(batch: int) -> bool:
        nonlocal tries, trained
        tries += 1
        fitted = False
        try:
            if on_cuda:
                with memory.track_cuda_peak(where) as meter:
                    step_fn(batch)
                peaks[batch] = meter.peak_bytes
            else:
                step_fn(batch)
            fitted = trained = True
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not (is_out_of_memory(error) or (trained and _TOO_LARGE_TEXT in str(error))):
                raise
        except ValueError as error:
            if not too_small_for_batch_norm(error):
                raise
        # The except block is over: the traceback, and with it the frames
        # holding this try's tensors, are gone; now they can be freed.
        release_memory(model, where)
        if on_try is not None:
            on_try(batch, fitted)
        return fitted

    batch = _bisect(fits, start, limit, precision)
    return MaxBatch(batch=batch, peak_bytes=peaks.get(batch), tries=tries)
