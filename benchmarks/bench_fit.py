"""Where ``effilayers.fit``'s extra step time goes, on CPU (issue 18).

    python -m pytest benchmarks/bench_fit.py -s --benchmark-group-by=group

Timed on the process's CPU time with one intra-op thread, interleaved (the
bench's ``--clock cpu --threads 1``): on a shared two-core machine the wall
clock also counts the time another program holds a core.

* ResNet-50 at a budget of 0.35 (fit checkpoints runs of blocks, no in-place
  ABN with ``exact=True``): a training step of the plain model, the fitted
  one, the plain model with torch's own checkpoint over fit's runs, and the
  forward of the checkpointed blocks alone with autograd recording (what the
  recomputation runs in backward). ``extra - recompute`` is what fit's
  segments cost beyond running that forward again (input copies, RNG and
  running-statistics state, the nested gradient call of
  ``effilayers.checkpoint.recompute_in_backward``), less what their forward
  saves by building no graph; torch's checkpoint pays a hook and a holder
  per saved tensor instead.
* DenseNet-121 at 0.25 (fit takes the memory-efficient layers, then
  checkpoints the stem): plain, memory-efficient layers alone, and the
  fitted model, at several image sizes. Extra time that stays the same in
  milliseconds as the images grow is per-call cost (the bottleneck's
  custom op and autograd Function), not recomputed arithmetic.

Ratios are in ``extra_info`` and printed with ``-s``.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

import effilayers
from effilayers.bench.budget import _with_torch_runs
from effilayers.fit import CheckpointedSequential, _memory_efficient_densenet
from effilayers.models import densenet121, resnet50

from .bench_call_path import interleaved_medians

BATCH = 2


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _training_step(model, images, labels):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _data(size, classes=1000):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(BATCH, 3, size, size, generator=generator),
            torch.randint(0, classes, (BATCH,), generator=generator))


def _recompute_only(model, images, segments):
    """The forward of the checkpointed runs of children on their inputs, with
    autograd recording as in the recomputation (on a copy of ``model``, so
    its running statistics stay the model's own)."""
    copied = copy.deepcopy(model)
    runs = [(copied.get_submodule(path), start, end) for path, found in segments.items() for start, end in found]
    inputs = {}
    handles = [part[start].register_forward_pre_hook(
        lambda module, args, key=(id(part), start): inputs.__setitem__(key, args[0].detach()))
        for part, start, end in runs]
    with torch.no_grad():
        copied(images)
    for handle in handles:
        handle.remove()

    def step():
        for part, start, end in runs:
            value = inputs[(id(part), start)]
            for child in list(part)[start:end]:
                value = child(value)
            del value

    return step


def _report(benchmark, group, medians, plain):
    benchmark.group = group
    benchmark.extra_info.update(median_ms={name: value * 1e3 for name, value in medians.items()},
                                ratio_to_plain={name: value / medians[plain] for name, value in medians.items()})
    print(f"\n{group}")
    for name, value in medians.items():
        print(f"  {name:45s} {value * 1e3:8.1f} ms  {value / medians[plain]:.3f}x plain")


def test_resnet50_fit_extra_time(benchmark, one_thread):
    torch.manual_seed(0)
    plain = resnet50(num_classes=1000).train()
    images, labels = _data(64)
    fitted = copy.deepcopy(plain)
    report = effilayers.fit(fitted, images, 0.35)
    segments = {path: list(module._fit_segments) for path, module in fitted.named_modules()
                if isinstance(module, CheckpointedSequential)}
    steps = {
        "plain": _training_step(plain, images, labels),
        "fit(0.35)": _training_step(fitted, images, labels),
        "torch checkpoint over fit's runs": _training_step(_with_torch_runs(copy.deepcopy(plain), segments),
                                                           images, labels),
        "recompute only (checkpointed blocks' forward)": _recompute_only(plain, images, segments),
    }
    # 40 rounds: with 20, the fit ratio of one run ranged from 1.15x to 1.27x.
    medians = interleaved_medians(steps, blocks=40, calls=1, warmup=2, clock=time.process_time)
    extra = medians["fit(0.35)"] - medians["plain"]
    recompute = medians["recompute only (checkpointed blocks' forward)"]
    benchmark.extra_info.update(predicted_extra_compute=report.extra_compute, segments=str(segments),
                                extra_minus_recompute_ms=(extra - recompute) * 1e3)
    _report(benchmark, "fit extra time resnet50 0.35 cpu threads=1 process time", medians, "plain")
    print(f"  extra {extra * 1e3:.1f} ms = recompute {recompute * 1e3:.1f} + the rest {(extra - recompute) * 1e3:.1f}; "
          f"fit's predicted extra compute (FLOPs) {report.extra_compute:.3f}")
    benchmark.pedantic(steps["fit(0.35)"], warmup_rounds=1, rounds=3)


@pytest.mark.parametrize("size", [32, 64, 96])
def test_densenet121_fit_extra_time_by_image_size(benchmark, one_thread, size):
    torch.manual_seed(0)
    plain = densenet121(num_classes=1000, memory_efficient=False).train()
    images, labels = _data(size)
    efficient = copy.deepcopy(plain)
    _memory_efficient_densenet(efficient)
    fitted = copy.deepcopy(plain)
    effilayers.fit(fitted, images, 0.25)
    steps = {"plain": _training_step(plain, images, labels),
             "memory-efficient layers": _training_step(efficient, images, labels),
             "fit(0.25)": _training_step(fitted, images, labels)}
    medians = interleaved_medians(steps, blocks=20, calls=1, warmup=2, clock=time.process_time)
    _report(benchmark, f"fit extra time densenet121 0.25 {size}x{size} cpu threads=1 process time", medians, "plain")
    extra = medians["memory-efficient layers"] - medians["plain"]
    print(f"  extra of the memory-efficient layers {extra * 1e3:.1f} ms")
    benchmark.pedantic(steps["fit(0.25)"], warmup_rounds=1, rounds=3)


def _selective(plain, images, recomputed_convolutions):
    """``plain`` (copied) with each of layer1..layer4 run as one torch
    selective checkpoint that keeps every convolution's output except those
    named in ``recomputed_convolutions`` ((layer, conv) pairs such as
    ("layer1", "conv3")): norms, activations and additions are recomputed
    in backward, and those convolutions too. Returns the model and its
    activation bytes. The meter cannot see what the selective checkpoint
    caches (no saved-tensor hook runs for it), so the kept convolution
    outputs are added from forward hooks: a lower bound on what it keeps."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    model = copy.deepcopy(plain)
    kept = set()
    for layer in ("layer1", "layer2", "layer3", "layer4"):
        for block in getattr(model, layer):
            for name, module in block.named_modules():
                if isinstance(module, torch.nn.Conv2d) and (layer, name) not in recomputed_convolutions:
                    kept.add(module)

    kept_weights = {id(m.weight) for m in kept}

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.convolution.default and id(args[1]) in kept_weights:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    class Selective(torch.nn.Sequential):
        def forward(self, input):
            return checkpoint(super().forward, input, use_reentrant=False,
                              context_fn=lambda: create_selective_checkpoint_contexts(policy))

    for layer in ("layer1", "layer2", "layer3", "layer4"):
        getattr(model, layer).__class__ = Selective
    kept_bytes = [0]
    handles = [m.register_forward_hook(lambda m, a, out: kept_bytes.__setitem__(0, kept_bytes[0] + out.nbytes))
               for m in kept]
    measured = effilayers.memory.activation_bytes(model, images) + kept_bytes[0]
    for handle in handles:
        handle.remove()
    return model, measured


def test_resnet50_selective_checkpoint_keeping_convolutions(benchmark, one_thread):
    """Recomputing only the cheap ops (torch's selective checkpoint keeping
    convolution outputs) against fit's whole-block checkpoints: fewer FLOPs
    recomputed, but on this CPU the norms' recomputed statistics and the
    dispatch mode's per-op Python cost more than the convolutions saved."""
    torch.manual_seed(0)
    plain = resnet50(num_classes=1000).train()
    images, labels = _data(64)
    fitted = copy.deepcopy(plain)
    effilayers.fit(fitted, images, 0.35)
    before = effilayers.memory.activation_bytes(plain, images)
    light, light_bytes = _selective(plain, images, set())
    deep, deep_bytes = _selective(plain, images, {(layer, "conv3") for layer in ("layer1", "layer2", "layer3")}
                                  | {("layer1", "conv1"), ("layer2", "conv1")})
    names = {"plain": 1.0, "fit(0.35)": effilayers.memory.activation_bytes(fitted, images) / before,
             "selective: convolutions kept": light_bytes / before,
             "selective: conv3 of layer1-3, conv1 of layer1-2 recomputed": deep_bytes / before}
    steps = dict(zip(names, (_training_step(m, images, labels) for m in (plain, fitted, light, deep))))
    medians = interleaved_medians(steps, blocks=20, calls=1, warmup=2, clock=time.process_time)
    benchmark.extra_info.update(activation_bytes_ratio=names)
    _report(benchmark, "selective checkpoint resnet50 cpu threads=1 process time", medians, "plain")
    for name, ratio in names.items():
        print(f"  {name:45s} {ratio:.3f}x plain's activation bytes")
    benchmark.pedantic(steps["fit(0.35)"], warmup_rounds=1, rounds=3)
