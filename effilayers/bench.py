"""``python -m effilayers.bench`` / ``effilayers-bench``: what effilayers saves on a model.

Trains ResNet-50 and DenseNet-121 (or your model) on synthetic data, as plain
PyTorch, with effilayers layers and with peer libraries when they are
installed, and prints activation bytes, CUDA peak bytes, step time and
images/s, each next to its ratio to plain PyTorch. Runs on CUDA when
available, otherwise on CPU at a small size.

``--train N`` also trains every variant N steps from the same weights and
data and checks the losses: each variant is compared with a float64 run of
plain PyTorch modules computing the same function, and must stay within
``LOSS_NOISE_FACTOR`` times the distance between plain PyTorch's own losses
at the benchmark's precision (float32, or bfloat16/float16 autocast) and its
float64 run (its rounding noise at these settings), and never closer than
``LOSS_TOLERANCE_FLOOR`` demands. Every curve reseeds the random number
generator at each step, so dropout draws the same masks in all of them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import importlib
import itertools
import json
import math
import os
import shlex
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import memory, models
from .convert import convert, revert
from .models.densenet import DenseLayer
from .models.resnet import INPLACE_SLOPE, _ResidualBlock
from .nn import ABN

__all__ = ["find_max_batch", "search_max_batch", "is_out_of_memory", "builtin_models", "plot", "main"]

PROG = "effilayers-bench"
DEFAULT_MODELS = ("resnet50", "densenet121")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PLAIN = "plain PyTorch"
AS_GIVEN = "as given"
SEED = 0
# --train: a variant's loss at step t may differ from its float64 reference by
# this factor times the largest relative distance between plain PyTorch's own
# losses and their float64 reference up to step t (the rounding noise of the
# setting: at batch 2 or at initialisation, BatchNorm backward can lose
# percents in float32), and by at least the per-dtype floor.
LOSS_NOISE_FACTOR = 10.0
LOSS_TOLERANCE_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# Plain PyTorch this far from float64 means the check is weak here: say so.
ILL_CONDITIONED = 1e-3
# Where --max-batch may run: elsewhere nothing runs out of memory cleanly
# (tests widen it to search on CPU against a simulated limit).
MAX_BATCH_DEVICES = ("cuda",)
DEFAULT_MAX_BATCH_LIMIT = 4096
LEAKY = "leaky_relu(0.01)"


class BenchError(Exception):
    """A problem with the user's request: reported as one line, exit status 2."""


# ---- the max-batch search ------------------------------------------------------------------


def find_max_batch(try_step: Callable[[int], bool], start: int, limit: int) -> int:
    """Largest batch in ``[1, limit]`` for which ``try_step(batch)`` succeeds.

    Doubles from ``start`` until a failure (or ``limit``), then bisects
    between the last success and the first failure. Assumes success is
    monotone in the batch size, as memory use is. Never calls ``try_step``
    above ``limit``. Returns 0 when even batch 1 fails.
    """
    if start < 1 or limit < 1:
        raise ValueError(f"find_max_batch: start and limit must be >= 1, got start={start}, limit={limit}")
    start = min(start, limit)
    if try_step(start):
        fits, fails = start, None
        while fits < limit:
            candidate = min(2 * fits, limit)
            if try_step(candidate):
                fits = candidate
            else:
                fails = candidate
                break
        if fails is None:
            return fits
    else:
        fits, fails = 0, start
    while fails - fits > 1:
        middle = (fits + fails) // 2
        if try_step(middle):
            fits = middle
        else:
            fails = middle
    return fits


def max_tries(start: int, limit: int) -> int:
    """An upper bound on the calls :func:`find_max_batch` makes (for the progress bar)."""
    start = min(start, limit)
    return 1 + math.ceil(math.log2(limit / start)) + math.ceil(math.log2(limit))


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


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` means "this batch does not fit", not a bug."""
    if isinstance(error, _OUT_OF_MEMORY_ERROR):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY_TEXT)


def _too_small_for_batch_norm(error: BaseException) -> bool:
    return isinstance(error, ValueError) and _ONE_VALUE_PER_CHANNEL in str(error).lower()


def search_max_batch(step: Callable[[int], None], release: Callable[[], None], start: int, limit: int,
                     tick: Callable[[], None] = lambda: None) -> int:
    """:func:`find_max_batch` over ``step(batch)``, which trains one step and
    may run out of memory (:func:`is_out_of_memory`; cuDNN's "not supported"
    too once a smaller batch has trained; a batch BatchNorm refuses because it
    leaves one value per channel does not train either; other errors
    propagate). ``release()`` runs after every try, fitting or not, to free
    what it left behind before the next one; ``tick()`` once per try."""
    trained = False

    def try_step(batch: int) -> bool:
        nonlocal trained
        tick()
        try:
            step(batch)
            fits = trained = True
        except RuntimeError as error:
            if not (is_out_of_memory(error) or (trained and _TOO_LARGE_TEXT in str(error))):
                raise
            fits = False
        except ValueError as error:
            if not _too_small_for_batch_norm(error):
                raise
            fits = False
        # The except block is over: the traceback, and with it the frames
        # holding this try's tensors, are gone; release() can free them.
        release()
        return fits

    return find_max_batch(try_step, start, limit)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- variants: what to measure -------------------------------------------------------------


@dataclass
class Variant:
    model: str
    name: str
    build: Callable[[], nn.Module]
    # Loads the reference model's weights, so every variant starts from the
    # same point; False for a variant built from the same seed instead.
    load_reference: bool = True
    # The function the variant computes when it is not plain PyTorch's (e.g.
    # "leaky_relu(0.01)"), and how to express it with plain PyTorch modules
    # (given a copy of the initialised variant; returns the module and notes):
    # the float64 reference of the --train check.
    function: Optional[str] = None
    plain_equivalent: Optional[Callable[[nn.Module], tuple[nn.Module, list[str]]]] = None
    note: Optional[str] = None


def _reverted(model: nn.Module) -> tuple[nn.Module, list[str]]:
    report = revert(model)
    return model, [f"{pair.norm}: {pair.note}" for pair in report.restored if pair.note]


def builtin_models() -> dict[str, str]:
    """The model builders of :mod:`effilayers.models`, name -> family ("resnet" or "densenet")."""
    names = {name: "resnet" for name in models.resnet.__all__ if name[0].islower()}
    names.update({name: "densenet" for name in models.densenet.__all__ if name[0].islower()})
    return names


def _import_peer(module_name: str) -> tuple[Optional[ModuleType], str]:
    """(the module, "") or (None, why it cannot be used)."""
    try:
        return importlib.import_module(module_name), ""
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name == module_name:
            return None, f"{module_name} is not installed"
        return None, f"cannot import {module_name}: {error}"
    except Exception as error:  # noqa: BLE001 - e.g. a CUDA torchvision on a CPU torch fails loading its ops
        return None, f"cannot import {module_name}: {type(error).__name__}: {error}"


class _SeparateSumMixin:
    """An effilayers ResNet block whose norms are another library's in-place
    ABN modules, which cannot take the shortcut into their call: every norm
    applies its own activation except the last, whose sum with the shortcut
    is activated afterwards (mapillary's own residual blocks do the same)."""

    def _activated(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def _activated_sum(self, norm: nn.Module, x: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        # Out of place: the norm keeps its output for backward.
        return F.leaky_relu(norm(x) + identity, INPLACE_SLOPE, inplace=True)


_SEPARATE_SUM_BLOCKS: dict[type, type] = {}


def peer_inplace_abn_resnet(builder: Callable[..., nn.Module], peer_module: ModuleType) -> nn.Module:
    """``builder(norm_act="inplace")`` with every effilayers ABN replaced by
    ``peer_module.InPlaceABN`` (mapillary's ``inplace_abn``; same arguments,
    same state-dict keys): the same network, function and weights."""
    model = builder(norm_act="inplace")
    block_final = set()
    for block in model.modules():
        if isinstance(block, _ResidualBlock):
            block_final.add(id(block.norms()[-1]))
            kind = type(block)
            if kind not in _SEPARATE_SUM_BLOCKS:
                _SEPARATE_SUM_BLOCKS[kind] = type(f"SeparateSum{kind.__name__}", (_SeparateSumMixin, kind), {})
            block.__class__ = _SEPARATE_SUM_BLOCKS[kind]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, ABN):
                continue
            activation = "identity" if id(child) in block_final else child.activation
            replacement = peer_module.InPlaceABN(child.num_features, eps=child.eps, momentum=child.momentum,
                                                 affine=child.affine, track_running_stats=child.track_running_stats,
                                                 activation=activation, activation_param=child.activation_param)
            replacement.load_state_dict(child.state_dict())
            setattr(parent, name, replacement)
    return model


def _peer_inplace_abn_reference(builder: Callable[..., nn.Module],
                                peer_module: ModuleType) -> Callable[[nn.Module], tuple[nn.Module, list]]:
    def plain_equivalent(peer_model: nn.Module) -> tuple[nn.Module, list[str]]:
        model = builder(norm_act="inplace")
        state = peer_model.state_dict()
        # mapillary scales by |weight| + eps: start the reference there, so
        # both follow the same trajectory while the weights stay positive.
        for name, module in peer_model.named_modules():
            if isinstance(module, peer_module.InPlaceABN) and module.weight is not None:
                state[f"{name}.weight"] = module.weight.detach().abs() + module.eps
        model.load_state_dict(state)
        model, notes = _reverted(model)
        return model, notes + ["reference scale |weight| + eps, as inplace_abn computes it"]

    return plain_equivalent


def _resnet_variants(name: str) -> tuple[list[Variant], list[str]]:
    builder = getattr(models, name)
    variants = [
        Variant(name, PLAIN, lambda: builder(norm_act="plain")),
        Variant(name, "effilayers ABN", lambda: builder(norm_act="abn")),
        Variant(name, "effilayers InPlaceABN", lambda: builder(norm_act="inplace"), function=LEAKY,
                plain_equivalent=_reverted),
    ]
    peer, why_not = _import_peer("inplace_abn")
    if peer is None:
        return variants, [f"{name} / inplace_abn (mapillary): skipped, {why_not}"]
    variants.append(Variant(name, "inplace_abn (mapillary)", lambda: peer_inplace_abn_resnet(builder, peer),
                            function=LEAKY, plain_equivalent=_peer_inplace_abn_reference(builder, peer)))
    return variants, []


class CheckpointedDenseLayer(DenseLayer):
    """A dense layer whose bottleneck ``cat -> norm1 -> relu1 -> conv1``
    runs under ``torch.utils.checkpoint`` (torchvision's recipe), with the
    same modules and state-dict keys."""

    def forward(self, features, batch_statistics=None):
        features = [features] if isinstance(features, torch.Tensor) else list(features)

        def bottleneck(*maps):
            return self.conv1(self.relu1(self.norm1(torch.cat(maps, 1))))

        out = checkpoint(bottleneck, *features, use_reentrant=False)
        out = self.conv2(self.relu2(self.norm2(out)))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        return out


def checkpointed_densenet(model: nn.Module) -> nn.Module:
    """``model`` (an effilayers DenseNet built with ``memory_efficient=False``)
    with every dense layer's bottleneck under activation checkpointing, in
    place: the standard way to save memory in PyTorch. The recomputed forward
    updates norm1's running statistics a second time per step."""
    for module in model.modules():
        if isinstance(module, DenseLayer):
            module.__class__ = CheckpointedDenseLayer
    return model


def torchvision_densenet(name: str) -> tuple[Optional[Callable[[], nn.Module]], str]:
    """(a builder of torchvision's ``name(memory_efficient=True)``, "") or (None, why not)."""
    torchvision, why_not = _import_peer("torchvision")
    if torchvision is None:
        return None, why_not
    builder = getattr(getattr(torchvision, "models", None), name, None)
    if builder is None:
        return None, f"torchvision has no {name}"
    return (lambda: builder(memory_efficient=True)), ""


def _densenet_variants(name: str) -> tuple[list[Variant], list[str]]:
    builder = getattr(models, name)
    variants = [
        Variant(name, PLAIN, lambda: builder(memory_efficient=False)),
        Variant(name, "torch.utils.checkpoint", lambda: checkpointed_densenet(builder(memory_efficient=False)),
                note="checkpointed bottlenecks update norm1's running statistics twice per step"),
    ]
    skipped = []
    torchvision_builder, why_not = torchvision_densenet(name)
    if torchvision_builder is None:
        skipped.append(f"{name} / torchvision memory_efficient: skipped, {why_not}")
    else:
        variants.append(Variant(name, "torchvision memory_efficient", torchvision_builder))
    variants.append(Variant(name, "effilayers", lambda: builder(memory_efficient=True)))
    return variants, skipped


def _import_callable(spec: str) -> Callable[[], Any]:
    module_name, _, attribute_path = spec.partition(":")
    if not module_name or not attribute_path:
        raise BenchError(f"--model {spec!r}: expected one of {', '.join(builtin_models())} or 'module:callable'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # an import can fail with anything the module raises
        raise BenchError(f"--model {spec!r}: cannot import {module_name!r}: {type(error).__name__}: {error}") from error
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise BenchError(f"--model {spec!r}: {module_name!r} has no attribute {attribute_path!r}")
        target = getattr(target, attribute)
    if not callable(target):
        raise BenchError(f"--model {spec!r}: {attribute_path!r} is not callable")
    return target


def _custom_variants(spec: str) -> tuple[list[Variant], list[str]]:
    factory = _import_callable(spec)

    def build_given() -> nn.Module:
        try:
            model = factory()
        except Exception as error:  # the user's builder may raise anything; say so in one line, as for imports
            raise BenchError(f"--model {spec!r}: building the model raised {type(error).__name__}: {error}") from error
        if not isinstance(model, nn.Module):
            raise BenchError(f"--model {spec!r}: returned {type(model).__name__}, expected an nn.Module")
        return model

    # Decide now whether the conversion variant exists, so the table never
    # lists a variant that is identical to the model as given.
    probe = build_given()
    try:
        report = convert(copy.deepcopy(probe), mode="inplace")
        converts, function_changed = bool(report.fused), report.function_changed
    except (TypeError, ValueError, RuntimeError):
        converts = function_changed = False
    del probe
    variants = [Variant(spec, AS_GIVEN, build_given)]
    if converts:
        def build_converted() -> nn.Module:
            model = build_given()
            convert(model, mode="inplace")
            return model

        # Converting keeps the module tree's weights but may rename keys, so
        # build it from the same seed instead of loading a state dict.
        variants.append(Variant(spec, "effilayers convert(inplace)", build_converted, load_reference=False,
                                function=LEAKY if function_changed else None,
                                plain_equivalent=_reverted if function_changed else None))
    return variants, []


def variants_for(spec: str) -> tuple[list[Variant], list[str]]:
    """The variants of ``--model spec`` and one line per peer variant skipped."""
    family = builtin_models().get(spec)
    if family == "resnet":
        return _resnet_variants(spec)
    if family == "densenet":
        return _densenet_variants(spec)
    return _custom_variants(spec)


# ---- one training step ---------------------------------------------------------------------


@dataclass
class Setup:
    device: torch.device
    batch: int
    size: int
    dtype: torch.dtype
    channels_last: bool
    steps: int
    train_steps: int
    compile: bool = False

    def autocast(self) -> ContextManager:
        if self.dtype not in (torch.bfloat16, torch.float16):
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def data(self, batch: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Generated on CPU from a fixed seed so every variant sees the same
        # numbers whatever the device's random number generator does.
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(batch, 3, self.size, self.size, generator=generator)
        labels = torch.randint(0, num_classes, (batch,), generator=generator)
        images = images.to(self.device, torch.float64 if self.dtype == torch.float64 else torch.float32)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.to(self.device)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, setup: Setup,
                images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with setup.autocast():
        logits = model(images)
        # float32 at least (autocast may give bf16 logits); float64 stays.
        loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # A small rate: at benchmark batch sizes BatchNorm is noisy, and the loss
    # curves should compare the variants, not show a divergence.
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _prepare(model: nn.Module, setup: Setup) -> nn.Module:
    model = model.to(setup.device)
    if setup.channels_last:
        # Module.to(memory_format=channels_last) raises on 5-D tensors.
        five_d = [name for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
                  if tensor.dim() == 5]
        if five_d:
            raise BenchError(f"--channels-last: the model has 5-D weights ({', '.join(five_d[:3])}"
                             f"{', ...' if len(five_d) > 3 else ''}), which have no channels_last layout "
                             "(torch.channels_last is for 4-D tensors); run without --channels-last")
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def _num_classes(model: nn.Module, setup: Setup) -> int:
    # Eval mode and no grad: the probe must not move BatchNorm running stats.
    # Two images (never more than --batch): a norm without running statistics
    # normalises with the batch's in eval too, and one image can leave it one
    # value per channel.
    was_training = model.training
    model.eval()
    shape = (min(setup.batch, 2), 3, setup.size, setup.size)
    try:
        with torch.no_grad():
            logits = model(torch.zeros(shape))
    except Exception as error:  # the user's model may raise anything on a wrong input shape
        advice = "; use a larger --batch or --size" if _too_small_for_batch_norm(error) else ""
        raise BenchError(f"the model failed on a {shape} image batch: {type(error).__name__}: {error}"
                         f"{advice}") from error
    model.train(was_training)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise BenchError(f"the model returned {getattr(logits, 'shape', type(logits).__name__)}; "
                         "expected logits of shape (N, classes)")
    return logits.shape[1]


def time_call(call: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``call()`` takes: between two CUDA events on CUDA (what the
    GPU's stream spends, launch gaps included), else the host clock."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _measure(model: nn.Module, setup: Setup, num_classes: int, tick: Callable[[], None],
             eager: Optional[nn.Module] = None) -> dict[str, Any]:
    """``model`` is what is timed (compiled with --compile); activation bytes
    are counted on ``eager`` (the same module uncompiled, the same function):
    saved-tensor hooks see what eager autograd keeps, not a compiled graph.

    A variant that runs out of memory at ``setup.batch`` is measured as such
    (``out_of_memory``, no numbers): on a GPU, plain PyTorch failing at a
    batch that the memory-efficient variants train is the point of the
    comparison. A batch BatchNorm cannot train (one value per channel) is the
    user's setting to change, reported as a BenchError."""
    counted_tick = _CountedTick(tick)
    try:
        return _measure_fitting(model, setup, num_classes, counted_tick, eager)
    except ValueError as error:
        if not _too_small_for_batch_norm(error):
            raise
        raise BenchError(f"batch {setup.batch} at {setup.size}x{setup.size} leaves BatchNorm one value per channel "
                         f"in training ({error}); use a larger --batch or --size") from None
    except RuntimeError as error:
        if not is_out_of_memory(error):
            raise
    # Out of the except block: the frames holding the failed step's tensors are gone.
    _release(model, setup.device)
    counted_tick.finish(1 + setup.steps)
    return {"activation_bytes": None, "cuda_peak_bytes": None, "step_times_s": [], "step_time_s": None,
            "images_per_s": None, "out_of_memory": True}


class _CountedTick:
    """A progress tick that counts its calls, so that work stopped early (out
    of memory, a failed reference) can still move the bar by the steps it
    did not take."""

    def __init__(self, tick: Callable[[], None]) -> None:
        self.tick, self.count = tick, 0

    def __call__(self) -> None:
        self.count += 1
        self.tick()

    def finish(self, total: int) -> None:
        for _ in range(total - self.count):
            self.tick()


def _release(model: nn.Module, device: torch.device) -> None:
    # An out-of-memory error in backward leaves some gradients behind.
    model.zero_grad(set_to_none=True)
    gc.collect()
    _empty_cache(device)


def _measure_fitting(model: nn.Module, setup: Setup, num_classes: int, tick: Callable[[], None],
                     eager: Optional[nn.Module]) -> dict[str, Any]:
    optimizer = _optimizer(model)
    images, labels = setup.data(setup.batch, num_classes, seed=SEED)
    with setup.autocast():
        activation = memory.activation_bytes(eager if eager is not None else model, images)
    # Warm-up: first-call allocations, kernel builds and, with --compile, compilation.
    _train_step(model, optimizer, setup, images, labels)
    tick()
    peak = None
    if setup.device.type == "cuda":
        with memory.track_cuda_peak(setup.device) as meter:
            _train_step(model, optimizer, setup, images, labels)
        peak = meter.peak_bytes
    times = []
    for _ in range(setup.steps):
        setup.synchronize()
        times.append(time_call(lambda: _train_step(model, optimizer, setup, images, labels), setup.device))
        tick()
    median = statistics.median(times)
    return {"activation_bytes": activation, "cuda_peak_bytes": peak, "step_times_s": times,
            "step_time_s": median, "images_per_s": setup.batch / median}


def _train_curve(model: nn.Module, setup: Setup, num_classes: int, tick: Callable[[], None]) -> list[float]:
    optimizer = _optimizer(model)
    losses = []
    for step in range(setup.train_steps):
        images, labels = setup.data(setup.batch, num_classes, seed=SEED + 1 + step)
        # Every curve (each variant's and the float64 reference's) draws the
        # same dropout masks at a step: without this the reference's masks
        # differ, and the check measures the masks, not the arithmetic. On
        # CPU the masks of one seed do not depend on the dtype.
        torch.manual_seed(SEED + 1 + step)
        losses.append(float(_train_step(model, optimizer, setup, images, labels)))
        tick()
    return losses


def _float64_curve(variant: Variant, pristine: nn.Module, setup: Setup, num_classes: int,
                   tick: Callable[[], None]) -> tuple[Optional[list[float]], str, list[str]]:
    """The --train reference: (float64 losses or None, what it is or why it
    is missing, notes)."""
    notes: list[str] = []
    what = "float64 plain PyTorch" + (f" computing {variant.function}" if variant.function else "")
    exact = dataclasses.replace(setup, dtype=torch.float64, compile=False)
    counted_tick = _CountedTick(tick)
    try:
        model = pristine
        if variant.plain_equivalent is not None:
            model, notes = variant.plain_equivalent(model)
        model = _prepare(model.to(torch.float64), exact)
        return _train_curve(model, exact, num_classes, counted_tick), what, notes
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:
        counted_tick.finish(setup.train_steps)
        return None, f"{what} failed: {type(error).__name__}: {error}", notes


def _max_batch(model: nn.Module, setup: Setup, num_classes: int, limit: int, tick: Callable[[], None]) -> int:
    optimizer = _optimizer(model)

    def step(batch: int) -> None:
        images, labels = setup.data(batch, num_classes, seed=SEED)
        _train_step(model, optimizer, setup, images, labels)
        setup.synchronize()

    return search_max_batch(step, lambda: _release(model, setup.device), setup.batch, limit, tick)


# ---- driver --------------------------------------------------------------------------------


@dataclass
class Result:
    model: str
    variant: str
    same_weights: bool
    # None (with out_of_memory) when the variant did not fit at the batch
    activation_bytes: Optional[int]
    cuda_peak_bytes: Optional[int]
    step_times_s: list[float]
    step_time_s: Optional[float]
    images_per_s: Optional[float]
    out_of_memory: bool = False
    ratios: dict[str, Optional[float]] = field(default_factory=dict)
    losses: Optional[list[float]] = None
    # Against plain PyTorch's losses at the same --dtype (what a user would compare).
    final_loss_rel_diff: Optional[float] = None
    max_loss_rel_diff: Optional[float] = None
    # The --train check: against the float64 reference of the same function.
    loss_reference: Optional[str] = None
    reference_losses: Optional[list[float]] = None
    loss_rel_errors: Optional[list[float]] = None
    loss_noise_floor: Optional[float] = None
    loss_tolerances: Optional[list[float]] = None
    loss_tolerance: Optional[float] = None
    losses_agree: Optional[bool] = None
    max_batch: Optional[int] = None
    notes: list[str] = field(default_factory=list)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, leave=False, unit="step")


def _ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    if value is None or not reference:
        return None
    return value / reference


def _relative_errors(values: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(values, reference)]


def _ticks(variants: list[Variant], setup: Setup, max_batch_limit: Optional[int]) -> int:
    per_variant = 1 + setup.steps + setup.train_steps
    if max_batch_limit is not None:
        per_variant += max_tries(setup.batch, max_batch_limit)
    references = len({variant.function for variant in variants}) * setup.train_steps
    return len(variants) * per_variant + references


def _run_model(variants: list[Variant], setup: Setup, max_batch_limit: Optional[int], bar: Any) -> list[Result]:
    torch.manual_seed(SEED)
    reference = variants[0].build()
    reference_state = copy.deepcopy(reference.state_dict())
    num_classes = _num_classes(reference, setup)
    del reference
    results = []
    float64_losses: dict[Optional[str], tuple[Optional[list[float]], str, list[str]]] = {}
    for variant in variants:
        bar.set_description(f"{variant.model} / {variant.name}")
        notes = [variant.note] if variant.note else []
        torch.manual_seed(SEED)
        model = variant.build()
        same_weights = True
        if variant.load_reference and variant is not variants[0]:
            try:
                model.load_state_dict(reference_state)
            except RuntimeError:
                same_weights = False
                notes.append("state dict incompatible with plain PyTorch's: own initialisation from the same seed")
        initial_state = copy.deepcopy(model.state_dict())
        pristine = None
        if setup.train_steps and variant.function not in float64_losses:
            pristine = copy.deepcopy(model)
        model = _prepare(model, setup)
        runner = model
        if setup.compile:
            # Modules under torch.compile: effilayers' ops are custom ops
            # with fake implementations, so they stay in the graph. Variants
            # share code (ResNet.forward, the blocks'): without a reset each
            # one recompiles the frames of those before it, against dynamo's
            # recompile_limit (past it a frame silently runs eager while the
            # row says compiled), and shapes or floats that differed between
            # variants would be compiled as dynamic.
            import torch._dynamo as dynamo

            dynamo.reset()
            runner = torch.compile(model)
        measured = _measure(runner, setup, num_classes, bar.update, eager=model)
        losses = None
        if measured.get("out_of_memory"):
            notes.append(f"out of memory at batch {setup.batch}: no time, activation bytes or losses")
            bar.update(setup.train_steps)
            pristine = None  # a later variant computing the same function runs the float64 reference
        elif setup.train_steps:
            model.load_state_dict(initial_state)
            losses = _train_curve(runner, setup, num_classes, bar.update)
            if pristine is not None:
                float64_losses[variant.function] = _float64_curve(variant, pristine, setup, num_classes, bar.update)
                del pristine
        max_batch = None
        if max_batch_limit is not None:
            tries = 0

            def tick() -> None:
                nonlocal tries
                tries += 1
                bar.update()

            max_batch = _max_batch(runner, setup, num_classes, max_batch_limit, tick)
            bar.update(max_tries(setup.batch, max_batch_limit) - tries)
        results.append(Result(variant.model, variant.name, same_weights, losses=losses, max_batch=max_batch,
                              notes=notes, **measured))
        del model, runner, initial_state
        gc.collect()
        _empty_cache(setup.device)
    # float64 references no variant ran (each variant computing it did not fit)
    bar.update(setup.train_steps * len({v.function for v in variants} - set(float64_losses)))
    plain = results[0]
    for result in results:
        result.ratios = {
            "activation_bytes": _ratio(result.activation_bytes, plain.activation_bytes),
            "cuda_peak_bytes": _ratio(result.cuda_peak_bytes, plain.cuda_peak_bytes),
            "step_time": _ratio(result.step_time_s, plain.step_time_s),
            "images_per_s": _ratio(result.images_per_s, plain.images_per_s),
            "max_batch": _ratio(result.max_batch, plain.max_batch),
        }
        if result.losses and plain.losses:  # both trained
            differences = _relative_errors(result.losses, plain.losses)
            result.final_loss_rel_diff = differences[-1]
            result.max_loss_rel_diff = max(differences)
    if setup.train_steps:
        _check_losses(results, variants, float64_losses, setup.dtype)
    return results


def _check_losses(results: list[Result], variants: list[Variant],
                  float64_losses: dict[Optional[str], tuple[Optional[list[float]], str, list[str]]],
                  dtype: torch.dtype) -> None:
    """Fill in the --train check of every result (see LOSS_NOISE_FACTOR)."""
    plain = results[0]
    if plain.losses is None:
        for result in results:
            result.notes.append("losses not checked: plain PyTorch did not train at this batch (no noise floor)")
        return
    plain_reference, why_not, _ = float64_losses[None]
    if plain_reference is None:
        for result in results:
            result.notes.append(f"losses not checked: no noise floor ({why_not})")
        return
    noise = _relative_errors(plain.losses, plain_reference)
    tolerances = [max(LOSS_NOISE_FACTOR * largest, LOSS_TOLERANCE_FLOOR[dtype])
                  for largest in itertools.accumulate(noise, max)]
    for result, variant in zip(results, variants):
        if result.losses is None:
            continue
        reference, what, notes = float64_losses[variant.function]
        result.loss_reference = what
        result.notes += [f"float64 reference: {note}" for note in notes]
        if reference is None:
            result.notes.append(f"losses not checked: {what}")
            continue
        result.reference_losses = reference
        result.loss_rel_errors = _relative_errors(result.losses, reference)
        result.loss_noise_floor = max(noise)
        result.loss_tolerances = tolerances
        result.loss_tolerance = max(tolerances)
        # Plain PyTorch defines the noise floor: it agrees by construction.
        if result is not plain:
            result.losses_agree = all(error <= tolerance
                                      for error, tolerance in zip(result.loss_rel_errors, tolerances))


def _mib(value: Optional[int]) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f}"


def measured_cells(result: dict[str, Any]) -> list[str]:
    """Activation MiB, CUDA peak MiB, step ms, images/s of one result (a
    :class:`Result`'s fields): "OOM" for a variant that did not fit."""
    if result.get("out_of_memory"):
        return ["OOM"] * 4
    return [_mib(result["activation_bytes"]), _mib(result.get("cuda_peak_bytes")),
            f"{result['step_time_s'] * 1e3:.1f}", f"{result['images_per_s']:.1f}"]


def _times(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}x"


def agreement(result: dict[str, Any]) -> str:
    """The --train check of one result (a :class:`Result`'s fields) in words."""
    if result.get("loss_tolerance") is None:
        return "n/a"
    if result.get("losses_agree") is None:
        return f"noise floor {result['loss_noise_floor']:.1e}"
    return ("agree" if result["losses_agree"] else "DIFFER") + f" (tol {result['loss_tolerance']:.1e})"


def format_table(results: list[Result]) -> str:
    show_max_batch = any(r.max_batch is not None for r in results)
    show_losses = any(r.losses is not None for r in results)
    header = ["model", "variant", "activation MiB", "", "CUDA peak MiB", "", "step ms", "", "images/s", ""]
    if show_max_batch:
        header += ["max batch", ""]
    if show_losses:
        header += ["losses vs float64"]
    rows = [header]
    for r in results:
        activation, peak, step, speed = measured_cells(vars(r))
        row = [r.model, r.variant, activation, _times(r.ratios["activation_bytes"]),
               peak, _times(r.ratios["cuda_peak_bytes"]), step, _times(r.ratios["step_time"]),
               speed, _times(r.ratios["images_per_s"])]
        if show_max_batch:
            row += [str(r.max_batch), _times(r.ratios["max_batch"])]
        if show_losses:
            row += [agreement(vars(r))]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    # Text columns left-aligned, numbers right-aligned so digits line up.
    text_columns = {0, 1, len(header) - 1} if show_losses else {0, 1}
    lines = ["  ".join(cell.ljust(w) if i in text_columns else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


def precision_name(dtype: torch.dtype) -> str:
    """How the losses of a run at ``dtype`` were computed, in words."""
    name = str(dtype).removeprefix("torch.")
    return name if dtype == torch.float32 else f"{name} autocast"


def format_losses(results: list[Result], dtype: torch.dtype = torch.float32) -> str:
    precision = precision_name(dtype)
    lines = [f"training check: each variant's loss against a float64 run of plain PyTorch computing the same "
             f"function; tolerance at step t = max({LOSS_NOISE_FACTOR:g} x plain PyTorch's largest relative "
             f"distance to its float64 run up to t, floor)"]
    for r in results:
        if r.losses is None:
            continue
        line = f"  {r.model:<12} {r.variant:<30} final loss {r.losses[-1]:.4f}"
        if r.loss_rel_errors is not None:
            line += f"  max rel err {max(r.loss_rel_errors):.1e}  {agreement(vars(r))}"
        if r.max_loss_rel_diff is not None and r.variant not in (PLAIN, AS_GIVEN):
            line += f"  (vs plain {precision}: max rel diff {r.max_loss_rel_diff:.1e})"
        lines.append(line)
    return "\n".join(lines)


def loss_warnings(results: list[Result], dtype: torch.dtype = torch.float32) -> list[str]:
    """One line per variant whose losses left the tolerance, and per model
    whose noise floor makes the check weak (``dtype``: the runs' --dtype)."""
    precision = precision_name(dtype)
    lines = []
    for r in results:
        if r.losses_agree is False:
            step = next(t for t, (e, tol) in enumerate(zip(r.loss_rel_errors, r.loss_tolerances)) if not e <= tol)
            lines.append(f"{r.model} / {r.variant}: losses differ from {r.loss_reference} beyond the tolerance: "
                         f"step {step + 1}, relative error {r.loss_rel_errors[step]:.2e} > "
                         f"{r.loss_tolerances[step]:.2e}")
        if r.losses_agree is None and r.loss_noise_floor is not None and r.loss_noise_floor > ILL_CONDITIONED:
            lines.append(f"{r.model}: plain PyTorch's own {precision} losses are up to {r.loss_noise_floor:.1e} (relative) "
                         f"from float64 here, so the check only holds the variants to "
                         f"{r.loss_tolerance:.1e}; BatchNorm over few values per channel (small --batch/--size) "
                         f"and deep residual networks at initialisation are ill-conditioned in {precision}")
    return lines


def plot(results: list[Result], path: str, pyplot: Any) -> Any:
    """Save bar charts (activation MiB, step ms, and CUDA peak MiB, max batch,
    loss curves when measured) to ``path``; returns the matplotlib figure."""
    labels = [f"{r.model}\n{r.variant}" for r in results]
    plain_of = {}
    for r in results:
        plain_of.setdefault(r.model, r)
    panels: list[tuple[str, Callable[[Result], Optional[float]], str]] = [
        ("activation MiB (one forward)",
         lambda r: None if r.activation_bytes is None else r.activation_bytes / 2**20, "activation_bytes"),
        ("median step time, ms", lambda r: None if r.step_time_s is None else r.step_time_s * 1e3, "step_time"),
    ]
    if any(r.cuda_peak_bytes is not None for r in results):
        panels.append(("CUDA peak MiB (one step)",
                       lambda r: None if r.cuda_peak_bytes is None else r.cuda_peak_bytes / 2**20, "cuda_peak_bytes"))
    if any(r.max_batch is not None for r in results):
        panels.append(("largest batch that trains", lambda r: r.max_batch, "max_batch"))
    trained = [r for r in results if r.losses]
    count = len(panels) + (2 if trained else 0)
    figure, axes = pyplot.subplots(1, count, figsize=(5 * count, 5.5), squeeze=False)
    axes = list(axes[0])
    for axis, (title, value, ratio_key) in zip(axes, panels):
        shown = [(i, value(r), r.ratios.get(ratio_key)) for i, r in enumerate(results) if value(r) is not None]
        bars = axis.bar([i for i, _, _ in shown], [v for _, v, _ in shown], color="tab:blue")
        axis.bar_label(bars, labels=["" if ratio is None else f"{ratio:.2f}x" for _, _, ratio in shown], fontsize=8)
        axis.set_title(title)
        axis.set_xticks(range(len(results)))
        axis.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    if trained:
        curves, errors = axes[len(panels)], axes[len(panels) + 1]
        for r in trained:
            steps = range(1, len(r.losses) + 1)
            curves.plot(steps, r.losses, marker="o", label=f"{r.model} / {r.variant}")
            if r.loss_rel_errors is not None:
                errors.semilogy(steps, [max(e, 1e-12) for e in r.loss_rel_errors], marker="o",
                                label=f"{r.model} / {r.variant}")
        for r in plain_of.values():
            if r.loss_tolerances is not None:
                errors.semilogy(range(1, len(r.loss_tolerances) + 1), r.loss_tolerances, "k:",
                                label=f"{r.model} tolerance")
        curves.set_title("training loss (same weights and data)")
        errors.set_title("|loss - float64 reference| / reference")
        for axis in (curves, errors):
            axis.set_xlabel("training step")
            axis.xaxis.get_major_locator().set_params(integer=True)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize=7)
    figure.suptitle("effilayers bench: " + ", ".join(sorted({r.model for r in results}))
                    + " (bar labels: ratio to plain PyTorch)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return figure


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(builtin_models())
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", metavar="NAME",
                        help=f"{names}, or module:callable returning an nn.Module that maps (N, 3, H, W) images "
                             "to logits; repeatable (default: resnet50 and densenet121)")
    parser.add_argument("--batch", type=int, help="batch size (default: 32 on CUDA, 2 on CPU)")
    parser.add_argument("--size", type=int,
                        help="image height and width, >= 32 (default: 224 on CUDA, 64 on CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="float32, or autocast to bfloat16/float16 (float16 needs CUDA)")
    parser.add_argument("--channels-last", action="store_true", help="channels_last model and images")
    parser.add_argument("--compile", action="store_true",
                        help="run every variant under torch.compile (the first step, which compiles, is not timed; "
                             "activation bytes are counted on the eager module; with --train, random ops such as "
                             "dropout run eager's kernels, torch._inductor.config.fallback_random, so the compiled "
                             "variants draw the float64 reference's masks)")
    parser.add_argument("--steps", type=int, help="timed training steps per variant (default: 10 on CUDA, 3 on CPU)")
    parser.add_argument("--train", type=int, default=0, metavar="N",
                        help="also train N steps per variant from the same weights and data, and check the losses "
                             "against a float64 run of plain PyTorch computing the same function: at step t the "
                             f"relative difference must be <= max({LOSS_NOISE_FACTOR:g} x plain PyTorch's own largest "
                             "relative difference up to t between its --dtype run and float64, 1e-5 float32 / 1e-3 "
                             "float16 / 1e-2 bfloat16); a variant outside it gets a warning")
    parser.add_argument("--check-train", action="store_true",
                        help="with --train: exit with status 1 when a variant's losses leave the tolerance")
    parser.add_argument("--max-batch", action="store_true",
                        help="find the largest batch that trains one step, per variant (CUDA only)")
    parser.add_argument("--max-batch-limit", type=int, metavar="N",
                        help=f"with --max-batch: the largest batch it tries (default: {DEFAULT_MAX_BATCH_LIMIT})")
    parser.add_argument("--json", metavar="FILE", help="write all results, the environment and the command here")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="bar charts with ratios (and loss curves with --train); needs matplotlib")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    return parser


def _max_batch_limit(args: argparse.Namespace) -> Optional[int]:
    """The --max-batch search's limit, None without --max-batch."""
    if not args.max_batch:
        return None
    return DEFAULT_MAX_BATCH_LIMIT if args.max_batch_limit is None else args.max_batch_limit


def _setup(args: argparse.Namespace) -> Setup:
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is available")
    on_cuda = device_type == "cuda"
    if args.max_batch and device_type not in MAX_BATCH_DEVICES:
        raise BenchError("--max-batch needs CUDA (it searches for the batch that runs out of GPU memory); "
                         "no CUDA device in use here")
    if args.check_train and not args.train:
        raise BenchError("--check-train needs --train N (N >= 1)")
    if args.max_batch_limit is not None and not args.max_batch:
        raise BenchError("--max-batch-limit needs --max-batch")
    dtype = DTYPES[args.dtype]
    if dtype == torch.float16 and not on_cuda:
        raise BenchError("--dtype float16 needs CUDA; on CPU use float32 or bfloat16")
    setup = Setup(device=torch.device(device_type),
                  batch=args.batch if args.batch is not None else (32 if on_cuda else 2),
                  size=args.size if args.size is not None else (224 if on_cuda else 64),
                  dtype=dtype, channels_last=args.channels_last,
                  steps=args.steps if args.steps is not None else (10 if on_cuda else 3), train_steps=args.train,
                  compile=args.compile)
    limit = DEFAULT_MAX_BATCH_LIMIT if args.max_batch_limit is None else args.max_batch_limit
    for name, value, minimum in (("--batch", setup.batch, 1), ("--size", setup.size, 32), ("--steps", setup.steps, 1),
                                 ("--train", setup.train_steps, 0), ("--max-batch-limit", limit, 1)):
        if value < minimum:
            raise BenchError(f"{name} must be >= {minimum}, got {value}")
    return setup


def _check_output_path(option: str, path: str) -> None:
    """Fail before the benchmark, not after it, on a file that cannot be written."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise BenchError(f"{option} {path!r} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise BenchError(f"{option} {path!r}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise BenchError(f"{option} {path!r}: directory {directory!r} is not writable")


def _load_pyplot(path: str) -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as error:
        raise BenchError(f"--plot needs matplotlib ({error}); pip install matplotlib "
                         "or pip install 'effilayers[bench]'") from error
    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise BenchError(f"--plot {path!r}: the file name must end in one of "
                         f"{', '.join('.' + name for name in sorted(formats))}")
    return pyplot


def _compiled_random_like_eager(setup: Setup) -> ContextManager:
    """With --compile --train: inductor calls eager's random kernels instead
    of generating its own numbers, so a compiled variant's dropout draws the
    masks of its eager float64 reference (otherwise they differ whatever the
    seed, and so would the losses)."""
    if not (setup.compile and setup.train_steps):
        return nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch(fallback_random=True)


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    setup = _setup(args)
    for option in ("json", "plot"):
        if getattr(args, option):
            _check_output_path(f"--{option}", getattr(args, option))
    # Checked before the benchmark so a missing matplotlib costs nothing.
    pyplot = _load_pyplot(args.plot) if args.plot else None
    variants_per_model = []
    skipped: list[str] = []
    for spec in args.model or DEFAULT_MODELS:
        variants, skipped_here = variants_for(spec)
        variants_per_model.append(variants)
        skipped += skipped_here

    print(f"effilayers bench: {setup.device.type}, batch {setup.batch}, {setup.size}x{setup.size}, "
          f"{args.dtype}{', channels_last' if setup.channels_last else ''}"
          f"{', torch.compile' if setup.compile else ''}, "
          f"1 warm-up + {setup.steps} timed steps per variant", flush=True)
    for line in skipped:
        print(line, flush=True)
    max_batch_limit = _max_batch_limit(args)
    bar = _progress(sum(_ticks(variants, setup, max_batch_limit) for variants in variants_per_model))
    results: list[Result] = []
    try:
        with _compiled_random_like_eager(setup):
            for variants in variants_per_model:
                results += _run_model(variants, setup, max_batch_limit, bar)
    finally:
        bar.close()

    print(format_table(results))
    if setup.device.type == "cpu":
        print("CUDA peak bytes: n/a on CPU. Activation bytes count the tensors autograd keeps, which these "
              "layers choose the same way on every device; a GPU run adds the peak bytes.")
    if setup.dtype != torch.float32:
        print(f"Under autocast, activation bytes include the {args.dtype} copies of the weights that autocast "
              "keeps for backward (2 bytes per parameter), the same for every variant.")
    if setup.train_steps:
        print()
        print(format_losses(results, setup.dtype))
    for r in results:
        for note in r.notes:
            print(f"note: {r.model} / {r.variant}: {note}")
    warnings = loss_warnings(results, setup.dtype)
    for line in warnings:
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    if args.json:
        from ._info import collect

        report = {
            "command": shlex.join([sys.executable, "-m", "effilayers.bench", *argv]),
            "argv": list(argv),
            "settings": {"device": setup.device.type, "batch": setup.batch, "size": setup.size, "dtype": args.dtype,
                         "channels_last": setup.channels_last, "compile": setup.compile, "steps": setup.steps,
                         "train": setup.train_steps, "max_batch_limit": max_batch_limit,
                         "loss_noise_factor": LOSS_NOISE_FACTOR,
                         "loss_tolerance_floor": LOSS_TOLERANCE_FLOOR[setup.dtype]},
            "skipped": skipped,
            "environment": collect(),
            "results": [vars(r) for r in results],
        }
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {args.json}")
    if pyplot is not None:
        pyplot.close(plot(results, args.plot, pyplot))
        print(f"wrote {args.plot}")
    disagreeing = [r for r in results if r.losses_agree is False]
    if args.check_train and disagreeing:
        print(f"{PROG}: --check-train: {len(disagreeing)} variant(s) left the loss tolerance: "
              + ", ".join(f"{r.model} / {r.variant}" for r in disagreeing), file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except BenchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
