"""The DenseNet bottleneck's 1x1 ops (BatchNorm + ReLU + convolution over a
virtual concatenation of feature maps): PyTorch on CPU and the Triton
kernels, against float64, on every backend the registry declares; their
layouts, tables, TF32 choice and fake kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import effilayers
from effilayers.models.densenet import DenseNet
from effilayers.ops import densenet as densenet_ops

from .accuracy import assert_close
from .conftest import activate_backend, backend_params, forced_backend
from .densenet_cases import assert_models_agree

# No TF32 here unless a test asks (conftest.full_float32 says why).
pytestmark = pytest.mark.usefixtures("full_float32")


# cpp: the CPU path composes ABN's C++ kernels around PyTorch's convolution.
@pytest.fixture(params=backend_params("dense_bottleneck_forward"))
def op_device(request):
    """Both 1x1 ops forced to one backend (the forward op's name decides the
    skip; both ops have the same backends)."""
    yield from forced_backend(request, "dense_bottleneck_forward")


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Triton's output buffers start as NaN, so an element no kernel writes fails."""
    try:
        from effilayers.ops.densenet import triton as kernels
    except ImportError:
        return
    original = kernels._output_like
    monkeypatch.setattr(kernels, "_output_like",
                        lambda first, channels, dtype=None: original(first, channels, dtype).fill_(float("nan")))


def _op_case(device, dtype, layout, channels=(8, 37, 5), size=(2, 7, 5), seed=0, c_out=70):
    gen = torch.Generator().manual_seed(seed)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    features = [(torch.randn(size[0], c, *size[1:], generator=gen) * (1 + i) + i)
                .to(device=device, dtype=dtype).contiguous(memory_format=memory_format)
                for i, c in enumerate(channels)]
    total = sum(channels)
    mean = torch.cat([f.double().mean((0, 2, 3)) for f in features]).float()
    var = torch.cat([f.double().var((0, 2, 3), unbiased=False) for f in features]).float()
    invstd = torch.rsqrt(var + 1e-5)
    weight = torch.rand(total, generator=gen) + 0.5
    bias = torch.randn(total, generator=gen) * 0.3
    conv_weight = (torch.randn(c_out, total, 1, 1, generator=gen) / total ** 0.5).to(dtype)
    vectors = [t.to(device) for t in (mean, invstd, weight, bias)]
    return features, vectors, conv_weight.to(device)


def _op_reference(features, vectors, conv_weight, grad_out, batch_stats, padding=0):
    """float64 autograd through cat, batch_norm, relu, conv2d."""
    x = torch.cat([f.detach().double().cpu() for f in features], 1).requires_grad_()
    mean, invstd, weight, bias = (v.double().cpu().requires_grad_() for v in vectors)
    cw = conv_weight.detach().double().cpu().requires_grad_()
    if batch_stats:
        # The statistics are the batch's own: their dependence on x is part of dx.
        var, mu = torch.var_mean(x, dim=(0, 2, 3), correction=0)
        x_hat = (x - mu.view(1, -1, 1, 1)) * torch.rsqrt(var.view(1, -1, 1, 1) + 1e-5)
    else:
        x_hat = (x - mean.detach().view(1, -1, 1, 1)) * invstd.detach().view(1, -1, 1, 1)
    out = F.conv2d(F.relu(x_hat * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)), cw, padding=padding)
    out.backward(grad_out.double().cpu())
    return out, x.grad, bias.grad, weight.grad, cw.grad


@pytest.mark.parametrize("batch_stats", [True, False], ids=["batch-stats", "running-stats"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_pointwise_ops_match_float64(op_device, poisoned_outputs, dtype, layout, batch_stats):
    if dtype == torch.bfloat16 and op_device.type == "cpu" \
            and effilayers.backends.choice("dense_bottleneck_forward", "cpu").backend == "triton":
        pytest.skip("the Triton interpreter has no bf16 arithmetic (bf16 Triton runs on the GPU)")
    features, vectors, conv_weight = _op_case(op_device, dtype, layout)
    grad_out = torch.randn(2, 70, 7, 5, generator=torch.Generator().manual_seed(1)).to(op_device, dtype)
    out = densenet_ops._forward_op(features, *vectors, conv_weight, 0)
    grad_input, grad_bias, grad_weight, grad_conv = densenet_ops._backward_op(
        grad_out, features, *vectors, conv_weight, batch_stats, True, True, 0)
    expected = _op_reference(features, vectors, conv_weight, grad_out, batch_stats)
    assert out.dtype == dtype and grad_input.dtype == dtype and grad_conv.dtype == dtype
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)
    for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"],
                               [out, grad_input, grad_bias, grad_weight, grad_conv], expected):
        assert_close(got.double().cpu(), want, dtype, "densenet_gemm", msg=name)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_padded_ops_match_float64(op_device, layout):
    """A 3x3 convolution (norm2 -> conv2 of a dense layer) through the same
    ops: the CPU kernel composes ABN's C++ kernels, Triton hands it to
    PyTorch ops."""
    features, vectors, _ = _op_case(op_device, torch.float32, layout, channels=(6, 3))
    conv_weight = (torch.randn(5, 9, 3, 3, generator=torch.Generator().manual_seed(2)) / 9).to(op_device)
    grad_out = torch.randn(2, 5, 7, 5, generator=torch.Generator().manual_seed(1)).to(op_device)
    out = densenet_ops._forward_op(features, *vectors, conv_weight, 1)
    grads = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, True, 1)
    expected = _op_reference(features, vectors, conv_weight, grad_out, True, padding=1)
    for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"],
                               [out, *grads], expected):
        assert_close(got.double().cpu(), want, torch.float32, "densenet_gemm", msg=name)


def test_pointwise_ops_skip_what_is_not_asked_for(op_device):
    features, vectors, conv_weight = _op_case(op_device, torch.float32, "contiguous")
    grad_out = torch.randn(2, 70, 7, 5, device=op_device)
    grad_input, grad_bias, grad_weight, grad_conv = densenet_ops._backward_op(
        grad_out, features, *vectors, conv_weight, True, False, True, 0)
    assert grad_input.numel() == grad_bias.numel() == grad_weight.numel() == 0
    expected = _op_reference(features, vectors, conv_weight, grad_out, True)[4]
    assert_close(grad_conv.double().cpu(), expected, torch.float32, "densenet_gemm")
    grad_input, _, _, grad_conv = densenet_ops._backward_op(
        grad_out, features, *vectors, conv_weight, True, True, False, 0)
    assert grad_input.shape == (2, 50, 7, 5) and grad_conv.numel() == 0


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_triton_fp16_grad_input_is_rounded_once(triton_device, poisoned_outputs, layout):
    """dx = scale * (dz - mean(dz) - x_hat * mean(dz * x_hat)) cancels on
    small elements, so dz stays float32 until dx is rounded to fp16: every
    element within about one fp16 rounding of float64. Measured (this case,
    interpreter, both layouts): max |error| / (|expected| + 1e-3 max
    |expected|) 4.8e-4; the kernel that stored dz in fp16 reached 1.6e-2."""
    features, vectors, conv_weight = _op_case(triton_device, torch.float16, layout)
    grad_out = torch.randn(2, 70, 7, 5, generator=torch.Generator().manual_seed(1)).to(triton_device, torch.float16)
    grad_input = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, False, 0)[0]
    expected = _op_reference(features, vectors, conv_weight, grad_out, True)[1]
    error = (grad_input.double().cpu() - expected).abs() / (expected.abs() + 1e-3 * expected.abs().max())
    assert error.max() < 1e-3, error.max()


def test_triton_tables_merge_a_block_buffer_and_are_cached(triton_device):
    """A dense block's maps are adjacent channel slices of its buffer: one
    table row, full K tiles (growth rate 12: 3 tiles for 36 channels, not
    one per map), the same results as separate maps, and a second call with
    the same maps reuses the device tables (no host-to-device copy)."""
    from effilayers.ops.densenet import triton as kernels

    features, vectors, conv_weight = _op_case(triton_device, torch.float32, "channels_last", channels=(12, 12, 12),
                                              c_out=8)
    slices = _buffer_slices(features)
    assert len(kernels._rows(slices)) == 1 and len(kernels._rows(features)) == 3
    table, tiles, num_tiles, _ = kernels._tables(slices)
    assert num_tiles == 2 and kernels._tables(features)[2] == 3
    assert kernels._tables(slices)[0] is table and kernels._tables(list(slices))[1] is tiles
    grad_out = torch.randn(2, 8, 7, 5, generator=torch.Generator().manual_seed(1)).to(triton_device)
    expected = _op_reference(features, vectors, conv_weight, grad_out, True)
    for maps in (slices, features):
        out = densenet_ops._forward_op(maps, *vectors, conv_weight, 0)
        grads = densenet_ops._backward_op(grad_out, maps, *vectors, conv_weight, True, True, True, 0)
        for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"], [out, *grads],
                                   expected):
            assert_close(got.double().cpu(), want, torch.float32, "densenet_gemm", msg=name)
    # The same maps in another buffer: another table.
    moved = _buffer_slices(features)
    assert len(kernels._rows(moved)) == 1 and kernels._tables(moved)[0] is not table


def test_tf32_follows_cudnn_convolution_flags():
    """The Triton GEMMs may use TF32 exactly when PyTorch's cuDNN convolutions
    may, whichever API set it (the legacy flag raised on a read once conv and
    rnn had different new-API settings)."""
    kernels = pytest.importorskip("effilayers.ops.densenet.triton")
    torch.backends.cudnn.allow_tf32 = True
    assert kernels._allow_tf32(torch.float32) and not kernels._allow_tf32(torch.float16)
    assert not kernels._allow_tf32(torch.bfloat16)
    torch.backends.cudnn.allow_tf32 = False
    assert not kernels._allow_tf32(torch.float32)
    if not hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision"):
        return  # torch < 2.9: the legacy flag is the only one
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # rnn still tf32: a legacy read raises
    assert not kernels._allow_tf32(torch.float32)
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    assert kernels._allow_tf32(torch.float32)
    torch.backends.cudnn.conv.fp32_precision = "none"  # defers to cuDNN's, then the generic setting
    torch.backends.cudnn.fp32_precision = "none"
    torch.backends.fp32_precision = "ieee"
    assert not kernels._allow_tf32(torch.float32)
    torch.backends.fp32_precision = "tf32"
    assert kernels._allow_tf32(torch.float32)


class _LaunchSpy:
    """Stands in for a Triton kernel and records one constexpr of each launch."""

    def __init__(self, kernel, seen, name="ALLOW_TF32"):
        self.kernel, self.seen, self.name = kernel, seen, name

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.seen.append(kwargs[self.name])
            return launch(*args, **kwargs)
        return run


def _misaligned(feature):
    """``feature`` copied into a view one element past a 16-byte boundary
    (NCHW strides, an offset pointer)."""
    storage = torch.empty(feature.numel() + 1, dtype=feature.dtype, device=feature.device)
    view = storage[1:].view(feature.shape)
    view.copy_(feature)
    assert view.data_ptr() % 16
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("maps", ["nchw", "nchw-odd-hw", "channels_last", "offset-view", "forced-general"])
def test_triton_aligned_specialisation(triton_device, monkeypatch, dtype, maps):
    """Every kernel launch takes VECTOR = 16 bytes of elements exactly when
    all maps are NCHW with 16-byte aligned pointers and strides (4x4 maps:
    H*W = 16), else VECTOR = 1 (5x7 maps, channels_last, an offset view);
    both specialisations meet float64 on the same maps (``forced-general``
    runs the aligned case's maps through the general kernels)."""
    from effilayers.ops.densenet import triton as kernels

    seen = []
    for name in ("_forward", "_grad_input", "_finish_grad_input", "_grad_weight"):
        monkeypatch.setattr(kernels, name, _LaunchSpy(getattr(kernels, name), seen, "VECTOR"))
    size = (2, 7, 5) if maps == "nchw-odd-hw" else (2, 4, 4)
    layout = "channels_last" if maps == "channels_last" else "contiguous"
    features, vectors, conv_weight = _op_case(triton_device, dtype, layout, channels=(8, 12, 5), size=size, c_out=9)
    if maps == "offset-view":
        features[1] = _misaligned(features[1])
    if maps == "forced-general":
        monkeypatch.setattr(kernels, "_vector_width", lambda rows, element_size: 1)
    grad_out = torch.randn(2, 9, *size[1:], generator=torch.Generator().manual_seed(1)).to(triton_device, dtype)
    out = densenet_ops._forward_op(features, *vectors, conv_weight, 0)
    grads = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, True, 0)
    expected = 16 // dtype.itemsize if maps == "nchw" else 1
    assert seen == [expected] * 4
    reference = _op_reference(features, vectors, conv_weight, grad_out, True)
    for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"], [out, *grads],
                               reference):
        assert_close(got.double().cpu(), want, dtype, "densenet_gemm", msg=name)


@pytest.fixture(params=backend_params("dense_bottleneck_forward", backends=("triton",)))
def triton_device(request):
    yield from forced_backend(request, "dense_bottleneck_forward")


@pytest.mark.parametrize("tf32", [False, True], ids=["ieee", "tf32"])
def test_triton_precision_follows_the_flag(triton_device, monkeypatch, tf32):
    """Each Triton GEMM gets ALLOW_TF32 from the cuDNN flag (fp32 only) and
    meets float64 at the precision it allows. Under the interpreter both
    branches compute in full float32 (it ignores input_precision), so there
    this checks the decision and that the ieee branch runs; on a GPU the TF32
    branch is held to TF32's bound and the ieee one to float32's."""
    from effilayers.ops.densenet import triton as kernels

    seen = []
    for name in ("_forward", "_grad_input", "_grad_weight"):
        monkeypatch.setattr(kernels, name, _LaunchSpy(getattr(kernels, name), seen))
    torch.backends.cudnn.allow_tf32 = tf32
    features, vectors, conv_weight = _op_case(triton_device, torch.float32, "channels_last")
    grad_out = torch.randn(2, 70, 7, 5, generator=torch.Generator().manual_seed(1)).to(triton_device)
    out = densenet_ops._forward_op(features, *vectors, conv_weight, 0)
    grads = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, True, 0)
    assert seen == [tf32] * 3
    expected = _op_reference(features, vectors, conv_weight, grad_out, True)
    for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"], [out, *grads],
                               expected):
        tier = "densenet_gemm_tf32" if tf32 and triton_device.type == "cuda" else "densenet_gemm"
        assert_close(got.double().cpu(), want, torch.float32, tier, msg=name)
    seen.clear()
    half = _op_case(triton_device, torch.float16, "contiguous")
    densenet_ops._forward_op(*half[:1], *half[1], half[2], 0)
    assert seen == [False]  # fp16 GEMMs never take the TF32 flag


@pytest.fixture(params=backend_params("dense_bottleneck_forward"))
def model_device(request):
    """The 1x1 ops on one backend, every other op on its compiled kernel
    (ABN's ops have no Triton kernels: with Triton they take the device's
    compiled one)."""
    backend, device = request.param
    preference = f"triton,{'cpp' if device == 'cpu' else 'cuda'}" if backend == "triton" else backend
    context = activate_backend("dense_bottleneck_forward", preference, device)
    try:
        yield torch.device(device)
    finally:
        context.__exit__(None, None, None)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_model_on_the_pointwise_backend_matches_the_naive_model(model_device, layout):
    """memory_efficient DenseNet with its 1x1 ops on this backend against the
    plain model (float32; the naive model runs PyTorch's own kernels), NCHW
    and channels_last (where the first layer of every block reads a
    non-dense channels_last slice of the block buffer)."""
    op_device = model_device
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    options = dict(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=5,
                   small_inputs=True)
    efficient = DenseNet(memory_efficient=True, **options).to(op_device, memory_format=memory_format)
    naive = DenseNet(memory_efficient=False, **options).to(op_device, memory_format=memory_format)
    naive.load_state_dict(efficient.state_dict())
    x = torch.randn(3, 3, 12, 12, device=op_device).contiguous(memory_format=memory_format)
    assert_models_agree(efficient.train(), naive.train(), x, rtol=1e-4, atol=1e-4)
    for a, b in zip(efficient.buffers(), naive.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        block_output = efficient.features[:2](x)  # the stem and the first block
    assert block_output.is_contiguous(memory_format=memory_format)


def _buffer_slices(features):
    """The maps as channel slices of one channels_last buffer, as a dense
    block holds them (channels_last but not dense)."""
    first = features[0]
    buffer = torch.empty((first.shape[0], sum(f.shape[1] for f in features) + 3, *first.shape[2:]),
                         dtype=first.dtype, device=first.device, memory_format=torch.channels_last)
    slices = list(torch.split(buffer[:, :-3], [f.shape[1] for f in features], 1))
    for piece, f in zip(slices, features):
        piece.copy_(f)
    assert not slices[0].is_contiguous(memory_format=torch.channels_last)
    return slices


# (layout, a function of the maps): the layouts a model gives the ops, and mixtures.
OPCHECK_LAYOUTS = {
    "contiguous": ("contiguous", lambda f: f),
    "channels_last": ("channels_last", lambda f: f),
    "channels_last-one-slice": ("channels_last", lambda f: _buffer_slices(f)[:1]),
    "channels_last-slices": ("channels_last", _buffer_slices),
    "contiguous-slice": ("contiguous", lambda f: [torch.cat(f, 1)[:, :f[0].shape[1]]]),
    "mixed-channels-last-first": ("channels_last", lambda f: [f[0], f[1].contiguous()]),
    "mixed-contiguous-first": ("contiguous", lambda f: [f[0], f[1].contiguous(memory_format=torch.channels_last)]),
}


@pytest.mark.parametrize("padding", [0, 1], ids=["1x1", "3x3"])
@pytest.mark.parametrize("case", list(OPCHECK_LAYOUTS))
def test_pointwise_ops_opcheck(op_device, case, padding):
    """The fake kernels and every backend agree on shapes, dtypes and strides
    (the first map's suggest_memory_format), for the layouts a channels_last
    or NCHW model hands the ops, non-dense channel slices and mixtures
    included."""
    if padding and effilayers.backends.choice("dense_bottleneck_forward", op_device.type).backend == "triton":
        pytest.skip("the Triton backend hands the 3x3 case to the reference's code")
    layout, arrange = OPCHECK_LAYOUTS[case]
    features, vectors, _ = _op_case(op_device, torch.float32, layout, channels=(3, 2), size=(2, 3, 4))
    features = arrange(features)
    channels = sum(f.shape[1] for f in features)
    kernel = 2 * padding + 1
    conv_weight = torch.randn(4, channels, kernel, kernel, device=op_device) / channels
    vectors = [v[:channels] for v in vectors]
    grad_out = torch.randn(2, 4, 3, 4, device=op_device)
    expected = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    out = densenet_ops._forward_op(features, *vectors, conv_weight, padding)
    grad_input = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, True, padding)[0]
    assert out.is_contiguous(memory_format=expected) and grad_input.is_contiguous(memory_format=expected)
    # Every check for the two plain layouts; the others are about layouts,
    # which test_faketensor compares (aot_dispatch_dynamic costs seconds).
    checks = None if case in ("contiguous", "channels_last") else ("test_schema", "test_faketensor")
    kwargs = {} if checks is None else dict(test_utils=checks)
    torch.library.opcheck(densenet_ops._forward_op, (features, *vectors, conv_weight, padding), **kwargs)
    torch.library.opcheck(densenet_ops._backward_op,
                          (grad_out, features, *vectors, conv_weight, True, True, True, padding), **kwargs)
