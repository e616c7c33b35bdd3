"""What ``effilayers-bench`` measures per variant: activation bytes, CUDA
peak bytes and step time at the batch, the largest batch that trains
(``--max-batch``), and the ``--train`` loss check.

``--train N`` trains every variant N steps from the same weights and data
and checks the losses: each variant is compared with a float64 run of plain
PyTorch modules computing the same function, and must stay within
``LOSS_NOISE_FACTOR`` times the distance between plain PyTorch's own losses
at the benchmark's precision (float32, or bfloat16/float16 autocast) and its
float64 run (its rounding noise at these settings), and never closer than
``LOSS_TOLERANCE_FLOOR`` demands. Every curve reseeds the random number
generator at each step, so dropout draws the same masks in all of them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import memory
from .._core.dtypes import accumulation_dtype
from ..max_batch import find_max_batch, is_out_of_memory, max_tries, release_memory, too_small_for_batch_norm
from .variants import BenchError, Variant

__all__ = ["Setup", "Result", "time_call", "SEED", "LOSS_NOISE_FACTOR", "LOSS_TOLERANCE_FLOOR", "count_ticks",
           "run_model", "SPREAD_WARNING", "CLOCKS", "GRADIENT_TOLERANCE", "step_gradients", "gradient_check_dtype",
           "compare_gradients", "MAX_BATCH_PRECISION"]

SEED = 0
# --train: a variant's loss at step t may differ from its float64 reference by
# this factor times the largest relative distance between plain PyTorch's own
# losses and their float64 reference up to step t (the rounding noise of the
# setting: at batch 2 or at initialisation, BatchNorm backward can lose
# percents in float32), and by at least the per-dtype floor.
LOSS_NOISE_FACTOR = 10.0
LOSS_TOLERANCE_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# A variant whose timed steps spread (max - min) over more than this fraction
# of their median gets a warning: something else used the machine, and the
# time ratios are less certain than their digits.
SPREAD_WARNING = 0.15
# What a CPU step is timed by (--clock): the host's wall clock, or the CPU
# time of the bench's process (all its threads), which does not count the
# time the process waits while others use the cores.
CLOCKS = {"wall": "wall clock", "cpu": "process CPU time"}
# --max-batch stops bisecting once a batch that does not fit is within 2% of
# one that does: the largest steps, the slow ones, are the last tries, and
# the targets are ratios between variants.
MAX_BATCH_PRECISION = 0.02
# --budget's gradient check: a row's gradients match plain PyTorch's when, in
# every parameter, the largest difference is at most this fraction of the
# largest plain gradient. On CPU the check's step runs in float64 (the model
# is converted for that step and back): a BatchNorm at batch 2 amplifies
# float32 rounding to percents in a weight's gradient (DenseNet-121's first
# norm weight: plain float32 is 3% from float64), and a row that sums in
# another order would differ by as much; in float64 that amplified rounding
# stays many orders below the tolerance. Recomputation that replays the
# forward's random draws runs the same kernels on the same numbers (0 on
# CPU); a compiled graph reorders sums (~1e-6 in float32); a dropout mask
# drawn again differs by the order of the gradients themselves. On a GPU a
# float32 model's check runs in float32, without autocast or TF32
# (gradient_check_dtype), not float64: fused kernels draw their dropout
# masks per dtype, and a float64 step would leave the kernels the timed
# steps run.
GRADIENT_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# The seed the gradient check's dropout draws from, the same for every row.
GRADIENT_SEED = SEED + 7919


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
    clock: str = "wall"
    # Intra-op threads the timed steps run on (torch.get_num_threads()).
    threads: int = field(default_factory=torch.get_num_threads)
    # --tokens T: the model is a language model taking (N, T) token ids, and
    # the step's loss is next-token cross-entropy; None: (N, 3, size, size)
    # images and one label each.
    tokens: Optional[int] = None

    @property
    def sample(self) -> str:
        """What one of the batch's N is, for the report's settings line."""
        return f"{self.tokens} tokens" if self.tokens else f"{self.size}x{self.size}"

    def autocast(self) -> ContextManager:
        if self.dtype not in (torch.bfloat16, torch.float16):
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def data(self, batch: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: (images, labels), or with --tokens (token ids, the ids
        that follow each), ``num_classes`` being the vocabulary."""
        # Generated on CPU from a fixed seed so every variant sees the same
        # numbers whatever the device's random number generator does.
        generator = torch.Generator().manual_seed(seed)
        if self.tokens:
            ids = torch.randint(0, num_classes, (batch, self.tokens + 1), generator=generator).to(self.device)
            return ids[:, :-1], ids[:, 1:]
        images = torch.randn(batch, 3, self.size, self.size, generator=generator)
        labels = torch.randint(0, num_classes, (batch,), generator=generator)
        images = images.to(self.device, accumulation_dtype(self.dtype))
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.to(self.device)


def _logits(output: Any) -> Any:
    """The logits of a model's output: the tensor itself, or the ``logits``
    of an output object (Hugging Face's ``ModelOutput``), or the first item
    of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def _loss(model: nn.Module, setup: Setup, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with setup.autocast():
        logits = _logits(model(images))
        # float32 at least (autocast may give bf16 logits); float64 stays.
        logits = logits.to(accumulation_dtype(logits.dtype))
        # With --tokens, every position predicts the token after it.
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, setup: Setup,
                images: torch.Tensor, labels: torch.Tensor, forward: Any = None) -> torch.Tensor:
    """One step; ``forward``: a context manager around the forward alone (a CUDA peak meter)."""
    with forward or nullcontext():
        loss = _loss(model, setup, images, labels)
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
    """The classes of the model's logits (with --tokens, its vocabulary),
    from one probe."""
    # Eval mode and no grad: the probe must not move BatchNorm running stats.
    # Two images (never more than --batch): a norm without running statistics
    # normalises with the batch's in eval too, and one image can leave it one
    # value per channel.
    was_training = model.training
    model.eval()
    rows = min(setup.batch, 2)
    if setup.tokens:
        probe, what, expected = torch.zeros(rows, setup.tokens, dtype=torch.long), "token batch", 3
        expectation = "logits of shape (N, tokens, vocabulary), or an output whose .logits are"
    else:
        probe, what, expected = torch.zeros(rows, 3, setup.size, setup.size), "image batch", 2
        expectation = "logits of shape (N, classes) (a language model taking token ids needs --tokens T)"
    try:
        with torch.no_grad():
            logits = _logits(model(probe))
    except Exception as error:  # the user's model may raise anything on a wrong input shape
        advice = "; use a larger --batch or --size" if too_small_for_batch_norm(error) else ""
        if not setup.tokens and "indices" in str(error):  # an embedding given float images
            advice = "; a language model taking token ids needs --tokens T"
        raise BenchError(f"the model failed on a {tuple(probe.shape)} {what}: {type(error).__name__}: {error}"
                         f"{advice}") from error
    model.train(was_training)
    if not isinstance(logits, torch.Tensor) or logits.dim() != expected or (
            setup.tokens and logits.shape[1] != setup.tokens):
        raise BenchError(f"the model returned {getattr(logits, 'shape', type(logits).__name__)}; "
                         f"expected {expectation}")
    return logits.shape[-1]


def step_gradients(model: nn.Module, runner: nn.Module, setup: Setup, num_classes: int) -> dict[str, torch.Tensor]:
    """The parameters' gradients (on the host, by name in ``model``) of one
    training step of ``runner`` (the model, or what runs it) on the bench's
    first batch, dropout drawing from GRADIENT_SEED; the gradients are then
    cleared, and the buffers (running statistics) and random state put back,
    so the step the row is timed from is unchanged."""
    images, labels = setup.data(setup.batch, num_classes, seed=SEED)
    devices = [setup.device.index or 0] if setup.device.type == "cuda" else []
    with torch.no_grad():
        buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(GRADIENT_SEED)
        _loss(runner, setup, images, labels).backward()
    gradients = {name: parameter.grad.detach().to("cpu", copy=True)
                 for name, parameter in model.named_parameters() if parameter.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, value in buffers:
            buffer.copy_(value)
    return gradients


def gradient_check_dtype(model: nn.Module, setup: Setup) -> torch.dtype:
    """The dtype --budget's gradient check runs in (see GRADIENT_TOLERANCE),
    for a float32 model: float64 on CPU; float32 on a GPU (without autocast,
    and without TF32: :func:`_exact_float32`), where fp16/bf16 rounding
    alone parts gradients that are sums with cancellation (a BatchNorm
    weight's) once a row's kernels round in another order. Any other model:
    the bench's ``setup.dtype``."""
    floating = {tensor.dtype for tensor in itertools.chain(model.parameters(), model.buffers())
                if tensor.is_floating_point()}
    if floating != {torch.float32}:
        return setup.dtype
    return torch.float64 if setup.device.type == "cpu" else torch.float32


@contextlib.contextmanager
def _exact_float32() -> Iterator[None]:
    """float32 matrix products and convolutions in float32, not TF32: torch's
    ``fp32_precision`` settings of both, put back as they were. (The legacy
    ``allow_tf32`` flags, mixed with them, leave torch refusing to read either;
    ``cudnn.flags`` would also reset cuDNN's other settings.)"""
    settings = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    before = [setting.fp32_precision for setting in settings]
    try:
        for setting in settings:
            setting.fp32_precision = "ieee"
        yield
    finally:
        for setting, value in zip(settings, before):
            setting.fp32_precision = value


def compare_gradients(gradients: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                      dtype: torch.dtype) -> tuple[bool, float, str]:
    """(whether ``gradients`` match ``reference`` within GRADIENT_TOLERANCE
    at ``dtype``, the largest relative difference over the parameters, the
    parameter where it is, or the first one with a gradient on one side only)."""
    missing = sorted(set(gradients) ^ set(reference))
    if missing:
        return False, float("inf"), missing[0]
    worst, where = 0.0, ""
    for name, expected in reference.items():
        difference = (gradients[name].double() - expected.double()).abs().max().item()
        relative = difference / max(expected.double().abs().max().item(), 1e-30)
        if relative > worst or not where:
            worst, where = relative, name
    return worst <= GRADIENT_TOLERANCE[dtype], worst, where


def time_call(call: Callable[[], Any], device: torch.device, clock: str = "wall") -> float:
    """Seconds ``call()`` takes: between two CUDA events on CUDA (what the
    GPU's stream spends, launch gaps included), else the host's wall clock,
    or with ``clock="cpu"`` the CPU time of this process (every thread's,
    OpenMP's spin-waits included; time spent descheduled is not counted)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    read = time.process_time if clock == "cpu" else time.perf_counter
    started = read()
    call()
    return read() - started


@dataclass
class _Session:
    """One variant between its phases: built and warmed up, then timed in
    turn with the others, then trained and searched (--train, --max-batch)."""
    variant: Variant
    model: nn.Module  # eager: activation bytes and the --train curve run on it
    runner: nn.Module  # what is timed: the model, or torch.compile of it
    notes: list[str]
    same_weights: bool
    initial_state: Optional[dict[str, torch.Tensor]]
    pristine: Optional[nn.Module]
    tick: "_CountedTick"
    measured: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    # One timed training step; None before the warm-up and after timing or running out of memory.
    step: Optional[Callable[[], None]] = None
    # --budget's gradient check (Result's fields of the same names).
    gradients_match: Optional[bool] = None
    gradient_max_rel_diff: Optional[float] = None
    gradient_dtype: Optional[str] = None


def _fits(call: Callable[[], Any], setup: Setup) -> bool:
    """Run ``call``: False when it ran out of memory (on a GPU, plain PyTorch
    failing at a batch that the memory-efficient variants train is the point
    of the comparison). A batch BatchNorm cannot train (one value per
    channel) is the user's setting to change, reported as a BenchError."""
    try:
        call()
        return True
    except ValueError as error:
        if not too_small_for_batch_norm(error):
            raise
        raise BenchError(f"batch {setup.batch} at {setup.sample} leaves BatchNorm one value per channel "
                         f"in training ({error}); use a larger --batch or --size") from None
    except RuntimeError as error:
        if not is_out_of_memory(error):
            raise
    return False


def _out_of_memory(session: _Session, setup: Setup) -> None:
    # Called out of the except block: the frames holding the failed step's
    # tensors are gone. An out-of-memory error in backward leaves some
    # gradients behind.
    session.step = None
    release_memory(session.model, setup.device)
    session.tick.finish(1 + setup.steps)
    session.measured = {"activation_bytes": None, "cuda_peak_bytes": None, "cuda_forward_peak_bytes": None,
                        "step_times_s": [],
                        "step_time_s": None, "step_time_min_s": None, "step_time_max_s": None,
                        "step_time_spread": None, "images_per_s": None, "out_of_memory": True}


class _PeakSoFar:
    """The allocator's peak when the block ends, read without synchronizing
    (it counts an allocation when it is made), so the step around it runs as
    it would: backward starts while an offloaded unit's copies are in flight."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: Optional[int] = None

    def __enter__(self) -> "_PeakSoFar":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.peak_bytes = torch.cuda.max_memory_allocated(self.device)


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """The bytes of the storages on ``device`` that a row keeps between
    steps: its parameters, buffers and gradients, and its optimizer's state,
    each storage once."""
    tensors = itertools.chain(model.parameters(), model.buffers(),
                              (p.grad for p in model.parameters() if p.grad is not None),
                              (value for state in optimizer.state.values() for value in state.values()
                               if isinstance(value, torch.Tensor)))
    storages = {memory.storage_key(tensor): tensor.untyped_storage().nbytes() for tensor in tensors
                if tensor.device.type == device.type and device.index in (None, tensor.device.index)}
    return sum(storages.values())


def _warm_up(session: _Session, setup: Setup, num_classes: int) -> None:
    """The warm-up step (first-call allocations, kernel builds, compilation),
    activation bytes and the CUDA peak; leaves ``session.step`` ready to be
    timed. For a row under torch.compile the bytes are the compiled graph's,
    counted after the step that compiled it: what the partitioner chose to
    keep, the compiled copies of the weights left out (effilayers.memory)."""
    model, runner = session.model, session.runner
    optimizer = _optimizer(runner)
    images, labels = setup.data(setup.batch, num_classes, seed=SEED)

    def step() -> None:
        _train_step(runner, optimizer, setup, images, labels)

    def saved() -> int:
        with setup.autocast():
            return memory.activation_bytes(runner, images, exclude=model)

    # Counted after the compiling step: the meter's hooks must see the
    # compiled graph's saved tensors, not take part in tracing it.
    activation = None if session.variant.under_compile or session.variant.compiled else saved()
    step()
    session.tick()
    if activation is None:
        activation = saved()
    peak = forward_peak = None
    if setup.device.type == "cuda":
        # The rows warmed up before this one are still on the device (they
        # are timed together): a row's peak is the allocator's less what it
        # holds outside this row, so no row pays for the models and optimizer
        # states of the rows before it.
        elsewhere = torch.cuda.memory_allocated(setup.device) - resident_bytes(model, optimizer, setup.device)
        # The forward's peak beside the step's: whether a row's peak comes
        # while the activations are made or in backward (recomputation, its
        # workspaces), where the two differ between rows.
        forward = _PeakSoFar(setup.device)
        with memory.track_cuda_peak(setup.device) as meter:
            _train_step(runner, optimizer, setup, images, labels, forward=forward)
        peak, forward_peak = meter.peak_bytes - elsewhere, forward.peak_bytes - elsewhere
    session.measured = {"activation_bytes": activation, "cuda_peak_bytes": peak,
                        "cuda_forward_peak_bytes": forward_peak}
    session.step = step


def _time_in_turn(sessions: list[_Session], setup: Setup) -> None:
    """The timed steps, one variant after another in each round (step 1 of
    every variant, then step 2, ...): a load that comes and goes on the
    machine falls on all of them alike instead of on whichever variant it
    met, and each variant's spread shows how much it moved the times."""
    for _ in range(setup.steps):
        for session in sessions:
            if session.step is None:
                continue
            setup.synchronize()
            step = session.step
            if _fits(lambda: session.times.append(time_call(step, setup.device, setup.clock)), setup):
                session.tick()
            else:
                _out_of_memory(session, setup)
    for session in sessions:
        if session.step is None:
            continue
        # The optimizer and the batch go with the step: the later phases make their own.
        session.step = None
        times = session.times
        median = statistics.median(times)
        session.measured.update(step_times_s=times, step_time_s=median, step_time_min_s=min(times),
                                step_time_max_s=max(times), step_time_spread=(max(times) - min(times)) / median,
                                images_per_s=setup.batch / median)


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
    """--max-batch: effilayers.find_max_batch over one training step, from --batch."""
    optimizer = _optimizer(model)
    # A step's memory does not depend on the numbers: one batch drawn once
    # (on the CPU from the seed, as every variant's), its samples repeated on
    # the device to each size tried, instead of drawing every size's numbers
    # on the CPU, which a fast GPU would wait on for most of the search.
    images, labels = setup.data(min(setup.batch, limit), num_classes, seed=SEED)

    def step(batch: int) -> None:
        index = torch.arange(batch, device=images.device) % images.shape[0]
        batch_images = images.index_select(0, index)
        if setup.channels_last and batch_images.dim() == 4:
            batch_images = batch_images.contiguous(memory_format=torch.channels_last)
        _train_step(model, optimizer, setup, batch_images, labels.index_select(0, index))
        setup.synchronize()

    found = find_max_batch(step, setup.batch, limit, model=model, device=setup.device,
                           on_try=lambda batch, fits: tick(), precision=MAX_BATCH_PRECISION)
    return found.batch


# ---- driver --------------------------------------------------------------------------------


@dataclass
class Result:
    model: str
    variant: str
    same_weights: bool
    # None (with out_of_memory) when the variant did not fit at the batch
    activation_bytes: Optional[int]
    # On CUDA: max_memory_allocated over one training step, less what the
    # allocator held outside this row when it began (resident_bytes).
    cuda_peak_bytes: Optional[int]
    step_times_s: list[float]
    step_time_s: Optional[float]
    images_per_s: Optional[float]
    # The fastest and slowest timed step, and (max - min) / median.
    step_time_min_s: Optional[float] = None
    step_time_max_s: Optional[float] = None
    step_time_spread: Optional[float] = None
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
    # --budget: whether one step's parameter gradients, dropout drawing,
    # equal plain PyTorch's (GRADIENT_TOLERANCE), and the largest relative
    # difference; None where not checked (plain itself is the reference).
    gradients_match: Optional[bool] = None
    gradient_max_rel_diff: Optional[float] = None
    # The dtype that step ran in ("float64" on CPU: gradient_check_dtype).
    gradient_dtype: Optional[str] = None
    # On CUDA: the same over the step's forward alone.
    cuda_forward_peak_bytes: Optional[int] = None
    notes: list[str] = field(default_factory=list)


def _ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    if value is None or not reference:
        return None
    return value / reference


def _relative_errors(values: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(values, reference)]


def count_ticks(variants: list[Variant], setup: Setup, max_batch_limit: Optional[int]) -> int:
    """How many times :func:`run_model` ticks the progress bar for ``variants`` (its total)."""
    per_variant = 1 + setup.steps + setup.train_steps
    if max_batch_limit is not None:
        per_variant += max_tries(setup.batch, max_batch_limit)
    references = len({variant.function for variant in variants}) * setup.train_steps
    return len(variants) * per_variant + references


def _check_step(session: _Session, setup: Setup, num_classes: int, dtype: torch.dtype,
                compiled: bool) -> dict[str, torch.Tensor]:
    """The gradient check's step of a session in ``dtype`` (step_gradients)."""
    if dtype == setup.dtype:
        return step_gradients(session.model, session.runner, setup, num_classes)
    # Parameters and buffers go to the check's dtype and back in place
    # (float32 -> float64 -> float32 is exact; on a GPU they stay float32 and
    # only autocast is off), so hooks, fit's wrappers and a compiled forward
    # stay those of the model the steps time.
    session.model.to(dtype)
    try:
        gradients = step_gradients(session.model, session.runner, dataclasses.replace(setup, dtype=dtype),
                                   num_classes)
    finally:
        session.model.to(torch.float32)
    if compiled:
        # torch 2.11's dynamo guards a module's parameters by identity, not
        # dtype: the check's graph (float64, or float32 without autocast)
        # would serve the timed steps.
        from torch import _dynamo

        _dynamo.reset()
    return gradients


def _check_gradients(session: _Session, setup: Setup, num_classes: int, first: bool,
                     reference: dict[str, torch.Tensor]) -> None:
    """--budget's gradient check of a started session, in
    :func:`gradient_check_dtype`: the first variant's gradients become
    ``reference``, the others' are compared with them. A row that compiles
    (``Variant.compiled``) compiles here, with eager's random kernels
    (torch._inductor.config.fallback_random), so that its forward draws
    plain's dropout masks and a difference comes from its backward."""
    dtype = gradient_check_dtype(session.model, setup)
    session.gradient_dtype = str(dtype).removeprefix("torch.")
    compiled = session.variant.compiled or session.variant.under_compile
    with contextlib.ExitStack() as context:
        if dtype == torch.float32 and setup.device.type == "cuda":
            context.enter_context(_exact_float32())
        if compiled:
            from torch._inductor import config as inductor_config

            context.enter_context(inductor_config.patch(fallback_random=True))
        gradients = _check_step(session, setup, num_classes, dtype, compiled)
    if compiled:
        session.notes.append(
            "gradient check: compiled with torch._inductor.config.fallback_random=True (eager's random kernels), "
            "so its forward draws plain's dropout masks; " + (
                "compiled again for the timed steps, at the bench's dtype and without it" if dtype != setup.dtype else
                "the timed steps run that compiled graph"))
    if first:
        reference.update(gradients)
        return
    if not reference:
        session.notes.append("gradient check: no reference (plain PyTorch did not run its check)")
        return
    match, worst, where = compare_gradients(gradients, reference, dtype)
    session.gradients_match, session.gradient_max_rel_diff = match, worst
    if not match:
        session.notes.append(f"gradients differ from plain PyTorch's: largest relative difference {worst:.2e} "
                             f"(in {where}), above {GRADIENT_TOLERANCE[dtype]:g} in {session.gradient_dtype}")


def _start(variant: Variant, reference_state: dict[str, torch.Tensor], first: bool, setup: Setup,
           num_classes: int, bar: Any, gradient_reference: Optional[dict[str, torch.Tensor]] = None) -> _Session:
    """Build ``variant`` from the reference's weights and warm it up (after
    its gradient check, when it has one: ``gradient_reference`` holds the
    first variant's gradients)."""
    bar.set_description(f"{variant.model} / {variant.name}")
    notes = [variant.note] if variant.note else []
    torch.manual_seed(SEED)
    model = variant.build()
    same_weights = True
    if variant.load_reference and not first:
        try:
            model.load_state_dict(reference_state)
        except RuntimeError:
            same_weights = False
            notes.append("state dict incompatible with plain PyTorch's: own initialisation from the same seed")
    # Taken before the model moves to the device: the copies wait on the host.
    initial_state = copy.deepcopy(model.state_dict()) if setup.train_steps else None
    # Every variant keeps one with --train: whether it runs the float64
    # reference of its function is known only when the variants before it
    # have trained (one that ran out of memory leaves it to the next).
    pristine = copy.deepcopy(model) if setup.train_steps else None
    model = _prepare(model, setup)
    runner = model
    if variant.under_compile:
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
    session = _Session(variant, model, runner, notes, same_weights, initial_state, pristine, _CountedTick(bar.update))
    if variant.check_gradients and not _fits(
            lambda: _check_gradients(session, setup, num_classes, first, gradient_reference
                                     if gradient_reference is not None else {}), setup):
        session.notes.append(f"gradient check: out of memory at batch {setup.batch}")
    if not _fits(lambda: _warm_up(session, setup, num_classes), setup):
        _out_of_memory(session, setup)
    return session


def run_model(variants: list[Variant], setup: Setup, max_batch_limit: Optional[int], bar: Any) -> list[Result]:
    """Measure every variant of one model, from the same weights and data;
    the first is the baseline of the ratios and of the --train check.

    The variants are warmed up one by one, then timed in turn
    (:func:`_time_in_turn`), so all of them are alive together for the
    timing; on a GPU each then waits on the host while the others train and
    search, so --max-batch and --train see one variant's memory, as before.
    The rows under torch.compile (--compile's, ``Variant.under_compile``)
    are timed alone, after the eager ones: dynamo's caches are reset for
    each of them (see :func:`_start`), which would recompile the others in
    their timed steps. Results come back in the order of ``variants``."""
    torch.manual_seed(SEED)
    reference = variants[0].build()
    reference_state = copy.deepcopy(reference.state_dict())
    num_classes = _num_classes(reference, setup)
    del reference
    finished: dict[int, Result] = {}
    float64_losses: dict[Optional[str], tuple[Optional[list[float]], str, list[str]]] = {}
    # Plain's gradients of one step, while the rows that check theirs are started.
    gradient_reference: dict[str, torch.Tensor] = {}
    groups = [[variant for variant in variants if not variant.under_compile]]
    groups += [[variant] for variant in variants if variant.under_compile]
    for group in groups:
        sessions = [_start(variant, reference_state, variant is variants[0], setup, num_classes, bar,
                           gradient_reference) for variant in group]
        if len(sessions) > 1:
            bar.set_description(f"{group[0].model} / {len(sessions)} variants in turn")
        _time_in_turn(sessions, setup)
        park = len(sessions) > 1 and setup.device.type != "cpu"
        if park:
            for session in sessions:
                session.model.to("cpu")
            release_memory(None, setup.device)
        while sessions:
            session = sessions.pop(0)
            if park:
                session.model = session.runner = _prepare(session.model, setup)
            finished[id(session.variant)] = _finish(session, setup, num_classes, max_batch_limit, bar,
                                                    float64_losses)
            del session
            release_memory(None, setup.device)
    gradient_reference.clear()
    # float64 references no variant ran (each variant computing it did not fit)
    bar.update(setup.train_steps * len({v.function for v in variants} - set(float64_losses)))
    results = [finished[id(variant)] for variant in variants]
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
    _against_compiled_plain(results, variants)
    if setup.train_steps:
        _check_losses(results, variants, float64_losses, setup.dtype)
    return results


def _against_compiled_plain(results: list[Result], variants: list[Variant]) -> None:
    """The table's ratios are to eager plain PyTorch; a compiled row's note
    adds its ratios to the first compiled row (plain PyTorch compiled)."""
    compiled = [(result, variant) for result, variant in zip(results, variants) if variant.under_compile]
    if not compiled:
        return
    plain = compiled[0][0]
    for result, _ in compiled[1:]:
        ratios = [f"{name} {value:.2f}x" for name, value in (
            ("activation bytes", _ratio(result.activation_bytes, plain.activation_bytes)),
            ("step time", _ratio(result.step_time_s, plain.step_time_s))) if value is not None]
        if ratios:
            result.notes.append(f"{', '.join(ratios)} of {plain.variant}'s")


def _finish(session: _Session, setup: Setup, num_classes: int, max_batch_limit: Optional[int], bar: Any,
            float64_losses: dict[Optional[str], tuple[Optional[list[float]], str, list[str]]]) -> Result:
    """The --train curves and the --max-batch search of a timed variant."""
    variant, notes, measured = session.variant, session.notes, session.measured
    bar.set_description(f"{variant.model} / {variant.name}")
    losses = None
    if measured.get("out_of_memory"):
        notes.append(f"out of memory at batch {setup.batch}: no time, activation bytes or losses")
        bar.update(setup.train_steps)
    elif setup.train_steps:
        session.model.load_state_dict(session.initial_state)
        losses = _train_curve(session.runner, setup, num_classes, bar.update)
        if variant.function not in float64_losses:
            float64_losses[variant.function] = _float64_curve(variant, session.pristine, setup, num_classes,
                                                              bar.update)
    session.pristine = None
    max_batch = None
    if max_batch_limit is not None:
        counted_tick = _CountedTick(bar.update)
        max_batch = _max_batch(session.runner, setup, num_classes, max_batch_limit, counted_tick)
        counted_tick.finish(max_tries(setup.batch, max_batch_limit))
    session.model = session.runner = None  # type: ignore[assignment]
    return Result(variant.model, variant.name, session.same_weights, losses=losses, max_batch=max_batch,
                  gradients_match=session.gradients_match, gradient_max_rel_diff=session.gradient_max_rel_diff,
                  gradient_dtype=session.gradient_dtype, notes=notes, **measured)


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


