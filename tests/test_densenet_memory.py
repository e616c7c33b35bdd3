"""DenseNet memory: the activation bytes the recomputation saves, the
statistics computed once per feature map, and the block buffer (zero-copy
concatenation) and when it is freed."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from effilayers import memory, models
from effilayers.models.densenet import DenseNet

# No TF32 here unless a test asks (conftest.full_float32 says why).
pytestmark = pytest.mark.usefixtures("full_float32")


# ---- memory -----------------------------------------------------------------------------------


def _linear_fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    residual = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    total = sum((y - my) ** 2 for y in ys)
    return slope, intercept, 1 - residual / total


def test_activation_bytes_grow_linearly_with_depth():
    depths = [40, 100, 190]
    # Depth is what grows: a small image keeps each forward cheap.
    x = torch.randn(2, 3, 16, 16)
    measured = {}
    for memory_efficient in (True, False):
        measured[memory_efficient] = []
        for depth in depths:
            layers = (depth - 4) // 6
            model = DenseNet(growth_rate=12, block_config=(layers,) * 3, num_init_features=24, small_inputs=True,
                             num_classes=10, memory_efficient=memory_efficient)
            measured[memory_efficient].append(memory.activation_bytes(model, x))
    slope, intercept, r2 = _linear_fit(depths, measured[True])
    naive_slope, naive_intercept, naive_r2 = _linear_fit(depths, measured[False])
    print(f"\nDenseNet-BC k=12, 2x3x16x16, activation bytes at depths {depths}:")
    print(f"  memory_efficient: {measured[True]} -> {slope:.0f} B/depth + {intercept:.0f}, R^2 = {r2:.6f}")
    print(f"  naive:            {measured[False]} -> {naive_slope:.0f} B/depth + {naive_intercept:.0f}, "
          f"R^2 = {naive_r2:.6f}")
    assert r2 > 0.999
    assert slope < 0.5 * naive_slope


def test_densenet121_at_224_keeps_at_most_a_third_of_the_activations():
    """The issue's target: <= 0.33x the naive model's activation bytes at
    224x224 (measured 0.268x; torchvision-style checkpointing: 0.48x)."""
    x = torch.randn(1, 3, 224, 224)
    torch.manual_seed(0)
    efficient = models.densenet121(memory_efficient=True)
    naive = models.densenet121(memory_efficient=False)
    efficient_bytes = memory.activation_bytes(efficient, x)
    naive_bytes = memory.activation_bytes(naive, x)
    inplace_bytes = memory.activation_bytes(models.densenet121(norm_act="inplace"), x)
    ratio = efficient_bytes / naive_bytes
    print(f"\ndensenet121 1x3x224x224: memory_efficient {efficient_bytes} B ({ratio:.3f}x), "
          f"norm_act='inplace' {inplace_bytes} B ({inplace_bytes / naive_bytes:.3f}x), naive {naive_bytes} B")
    assert ratio <= 0.33
    # In place, norm2 keeps the same one map as the recomputation does; the
    # stem (norm0 in place, no int64 pool indices) is where it saves.
    assert inplace_bytes < efficient_bytes


def test_statistics_are_computed_once_per_feature_map(monkeypatch):
    """In training, each channel of a block is reduced once when its map
    appears (plus each layer's norm2 input), not once per later layer."""
    from effilayers.models import densenet as densenet_module
    from effilayers.ops import _batchnorm as ops_module

    reduced = []

    def counting(original):
        def wrapper(x, *args):
            reduced.append(x.shape[1])
            return original(x, *args)
        return wrapper

    monkeypatch.setattr(densenet_module, "batch_stats", counting(densenet_module.batch_stats))
    monkeypatch.setattr(ops_module, "channel_stats", counting(ops_module.channel_stats))
    fused = ops_module.fused_statistics

    def counting_fused(x, *args):  # one tensor's statistics and running update in one call
        result = fused(x, *args)
        if result is not None:
            reduced.append(x.shape[1])
        return result

    monkeypatch.setattr(ops_module, "fused_statistics", counting_fused)
    growth, layers, start, bn_size = 4, 5, 6, 2
    block = densenet_module.DenseBlock(layers, start, bn_size, growth, 0.0, memory_efficient=True)
    block(torch.randn(2, start, 5, 5, requires_grad=True)).sum().backward()
    # block input + every new map, each once; every layer's norm2 input once.
    assert sorted(reduced) == sorted([start] + [growth] * (layers - 1) + [bn_size * growth] * layers)


# ---- the block buffer: zero-copy concatenation -------------------------------------------------


def _block(layers=3, start=6, growth=4, bn_size=2):
    from effilayers.models.densenet import DenseBlock

    torch.manual_seed(0)
    return DenseBlock(layers, start, bn_size, growth, 0.0, memory_efficient=True)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_block_keeps_its_maps_once(layout):
    """Saved for backward: views of the block buffer (input and every new map
    but the last, once: the last is only the output), each layer's norm2
    input and the per-channel statistics; nothing else. The meter counts the
    bytes the buffer views span, and the whole buffer as its storage."""
    layers, start, growth, bn_size = 3, 6, 4, 2
    block = _block(layers, start, growth, bn_size)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(2, start, 5, 5).contiguous(memory_format=memory_format).requires_grad_()
    with memory.track_activations(exclude=block) as meter:
        out = block(x * 1)
    total = start + layers * growth
    inner = bn_size * growth
    pixels = 2 * 5 * 5
    statistics = sum(2 * (start + i * growth) + 2 * inner for i in range(layers)) * 4  # mean, invstd per norm
    kept = start + (layers - 1) * growth  # channels 0..kept-1 of the buffer are saved
    if layout == "contiguous":
        # image 0 whole, then image 1 up to the end of channel kept-1
        buffer_span = (total * 25 + kept * 25) * 4
    else:
        # (n, h, w, c) order: every pixel's channels, up to channel kept-1 of the last pixel
        buffer_span = ((pixels - 1) * total + kept) * 4
    assert meter.bytes == buffer_span + layers * inner * pixels * 4 + statistics, meter.largest()
    assert meter.largest(1)[0].storage_bytes == total * pixels * 4
    assert out.shape == (2, total, 5, 5)
    assert out.is_contiguous(memory_format=memory_format)
    del out


def test_block_output_changed_in_place_is_caught():
    block = _block()
    x = torch.randn(2, 6, 5, 5, requires_grad=True)
    out = block(x * 1)
    out.relu_()
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        out.sum().backward()


def test_block_output_used_out_of_place_trains():
    block = _block()
    naive = _block()
    for layer in naive.values():
        layer.memory_efficient = False
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64, requires_grad=True)
    block.double(), naive.double()
    outputs = []
    for model in (block, naive):
        x.grad = None
        out = torch.relu(model(x * 1))
        out.square().sum().backward()
        outputs.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(outputs[0][1], outputs[1][1], rtol=0, atol=1e-12)
    for a, b in zip(outputs[0][2], outputs[1][2]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("mode", ["plain", "checkpoint", pytest.param("save_on_cpu", marks=pytest.mark.gpu)])
def test_saved_tensor_hooks_free_the_block_buffer_after_forward(monkeypatch, mode):
    """Under torch.utils.checkpoint nothing of the block but its input may
    stay alive between forward and backward, and under save_on_cpu nothing
    of it on the GPU: the block buffer's storage must be freed once the
    output is dropped (an autograd node kept it through a non-tensor
    attribute, which saved-tensor hooks cannot see). Without hooks the saved
    maps keep it, which shows the probe works. Gradients are the naive
    block's either way."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.checkpoint import checkpoint

    from effilayers.models import densenet as densenet_module

    buffers = []

    class RecordedBuffer(densenet_module._BlockBuffer):
        def __init__(self, like, channels):
            super().__init__(like, channels)
            buffers.append(StorageWeakRef(self.buffer.untyped_storage()))

    monkeypatch.setattr(densenet_module, "_BlockBuffer", RecordedBuffer)
    device = "cuda" if mode == "save_on_cpu" else "cpu"
    block, naive = _block().to(device, torch.float64), _block().to(device, torch.float64)
    for layer in naive.values():
        layer.memory_efficient = False
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64, device=device, requires_grad=True)
    if mode == "checkpoint":
        out = checkpoint(block, x, use_reentrant=False)
    else:
        with torch.autograd.graph.save_on_cpu() if mode == "save_on_cpu" else contextlib.nullcontext():
            out = block(x)
    loss = (out * 2).square().sum()
    del out
    assert len(buffers) == 1
    assert buffers[0].expired() == (mode != "plain")
    grad = torch.autograd.grad(loss, [x, *block.parameters()])
    expected = torch.autograd.grad((naive(x) * 2).square().sum(), [x, *naive.parameters()])
    for a, b in zip(grad, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.gpu
def test_densenet264_trains_at_batch_64_bf16_224():
    """Issue 4's capacity target: DenseNet-264, batch 64, 224x224, bf16
    autocast, one training step on one 80 GB GPU."""
    model = models.densenet264().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(64, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (64,), device="cuda")
    with memory.track_cuda_peak() as peak:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), target)
        loss.backward()
        torch.cuda.synchronize()
    print(f"\ndensenet264 64x3x224x224 bf16: peak {peak.peak_bytes / 2**30:.1f} GiB")
    assert torch.isfinite(loss)
    assert peak.peak_bytes < 80 * 10**9
