"""softmax's surface: argument errors, the nn modules, autocast,
torch.compile, the custom ops (opcheck), effilayers.info, and the GPU-only
checks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import effilayers
import effilayers.nn as enn
from effilayers.functional import log_softmax, scaled_masked_softmax, softmax
from effilayers.ops.softmax import op as softmax_op

from .conftest import REQUIRE_COMPILED, activate_backend, fake_cuda_autocast
from .softmax_cases import (
    assert_grad_matches,
    assert_matches,
    check_grad,
    expected,
    grad_formula,
    softmax_backend_fixture,
    varied,
)

backend = softmax_backend_fixture()


# --------------------------------------------------------------------------- errors


def test_integer_input_with_a_floating_dtype_like_torch(backend):
    # torch.softmax(x, dim, dtype=...) accepts integer and bool x when dtype
    # is floating (it converts x first); without one both refuse.
    _, device = backend
    values = torch.arange(-7, 8, device=device).view(3, 5) * 3
    for x in (values, values.to(torch.int32), (values + 21).to(torch.uint8), values > 0):
        for fn, theirs in ((softmax, torch.softmax), (log_softmax, torch.log_softmax)):
            for dtype in (torch.float32, torch.float64, torch.float16):
                y = fn(x, 1, dtype=dtype)
                assert y.dtype == dtype
                reference = theirs(x.cpu().double(), 1)
                assert_matches(y, reference, dtype, fn is log_softmax)
                assert_matches(fn(x.t(), 0, dtype=dtype), reference.t(), dtype, fn is log_softmax)
            with pytest.raises(TypeError, match="integer and bool input needs a floating dtype="):
                fn(x, 1)
            with pytest.raises(TypeError, match="dtype must be float16"):
                fn(x, 1, dtype=torch.int64)


def test_forward_mode_ad_is_refused(backend):
    # No forward-mode rule: torch would hand back a zero tangent silently.
    _, device = backend
    x, tangent = varied((3, 5), torch.float32, device), varied((3, 5), torch.float32, device, seed=1)
    for fn in (lambda t: softmax(t, 1), lambda t: log_softmax(t, 0), lambda t: scaled_masked_softmax(t, None, 0.5),
               lambda t: scaled_masked_softmax(x, t, 0.5)):  # a float mask's tangent too
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.func.jvp(fn, (x,), (tangent,))
        with torch.autograd.forward_ad.dual_level():
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                fn(torch.autograd.forward_ad.make_dual(x, tangent))


def test_errors():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        softmax([1.0, 2.0], 0)
    with pytest.raises(TypeError, match="x dtype must be"):
        softmax(torch.arange(4), 0)
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        softmax(x, 2)
    with pytest.raises(IndexError, match="dim -3 is out of range"):
        log_softmax(x, -3)
    with pytest.raises(TypeError, match="dim must be an int"):
        softmax(x, 1.0)
    with pytest.raises(TypeError, match="dim must be an int"):
        softmax(x, True)
    with pytest.raises(TypeError, match="dtype must be float16"):
        softmax(x, 1, dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        log_softmax(x, 1, dtype="float32")
    with pytest.raises(TypeError, match="mask dtype must be bool"):
        scaled_masked_softmax(x, torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_masked_softmax(x, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_masked_softmax(x, torch.ones(2, 3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        scaled_masked_softmax(x, [[True] * 4] * 3)
    with pytest.raises(ValueError, match="scale must be finite"):
        scaled_masked_softmax(x, scale=math.inf)
    with pytest.raises(ValueError, match="scale must be finite"):
        scaled_masked_softmax(x, scale=math.nan)
    with pytest.raises(TypeError, match="scale must be a float"):
        scaled_masked_softmax(x, scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match="scale must be a float"):
        scaled_masked_softmax(x, scale=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        scaled_masked_softmax(x, causal=1)
    with pytest.raises(ValueError, match="at least 2"):
        scaled_masked_softmax(torch.randn(5), causal=True)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        scaled_masked_softmax(torch.tensor(1.0))


def test_double_backward(backend):
    _, device = backend
    x = varied((2, 5), torch.float64, device).requires_grad_()
    xi = varied((2, 3, 2), torch.float64, device).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: softmax(t, 1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: log_softmax(t, 1), (xi,))
    mask = torch.tensor([True, False, True, True, True], device=device)
    assert torch.autograd.gradgradcheck(lambda t: scaled_masked_softmax(t, mask, 0.7), (x,))

def test_cpp_kernel_checks_its_arguments():
    context = activate_backend("softmax_forward", "cpp", "cpu")
    context.__exit__(None, None, None)
    ops = torch.ops.effilayers
    with pytest.raises(IndexError, match="out of range"):
        ops.softmax_forward(torch.randn(2, 3), 2, False, None)
    with pytest.raises(TypeError, match="dtype"):
        ops.softmax_forward(torch.arange(3), 0, False, None)
    with pytest.raises(ValueError, match="grad has shape"):
        ops.softmax_backward(torch.randn(2, 3), torch.randn(3, 2), 1, False, 1.0, torch.float32)
    with pytest.raises(ValueError, match="broadcast"):
        ops.scaled_masked_softmax_forward(torch.randn(2, 3), torch.ones(2, dtype=torch.bool), 1.0, False)
    with pytest.raises(ValueError, match="finite"):
        ops.scaled_masked_softmax_forward(torch.randn(2, 3), None, math.inf, False)
    with pytest.raises(ValueError, match="causal"):
        ops.scaled_masked_softmax_forward(torch.randn(3), None, 1.0, True)


# --------------------------------------------------------------------------- modules, autocast, compile, registry


def test_modules_are_drop_ins():
    x = varied((2, 3, 4), torch.float32).requires_grad_()
    for ours, theirs in ((enn.Softmax(dim=2), torch.nn.Softmax(dim=2)),
                         (enn.LogSoftmax(dim=-1), torch.nn.LogSoftmax(dim=-1))):
        assert isinstance(ours, type(theirs))
        assert repr(ours) == repr(theirs)
        ours.load_state_dict(theirs.state_dict())
        torch.testing.assert_close(ours(x), theirs(x))
    # dim=None: torch's implicit choice (dim 0 for 3-D, dim 1 for 2-D/4-D), with its warning at the caller
    for shape in ((2, 3, 4), (3, 5), (2, 3, 4, 5), (6,)):
        xs = varied(shape, torch.float32)
        for ours, theirs in ((enn.Softmax(), torch.nn.Softmax()), (enn.LogSoftmax(), torch.nn.LogSoftmax())):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = ours(xs)
                reference = theirs(xs)
            assert [str(w.message) for w in caught][0] == [str(w.message) for w in caught][1]
            assert "Implicit dimension choice" in str(caught[0].message)
            assert caught[0].filename == __file__
            torch.testing.assert_close(result, reference)


@pytest.mark.slow
def test_modules_with_implicit_dim_compile_fullgraph():
    # torch.nn.Softmax() compiles with fullgraph=True (its warning is issued
    # while tracing); a warnings.warn call in the traced forward broke the graph.
    for shape in ((2, 3, 4), (2, 3, 4, 5)):
        x = varied(shape, torch.float32)
        for ours, theirs in ((enn.Softmax(), torch.nn.Softmax()), (enn.LogSoftmax(), torch.nn.LogSoftmax())):
            torch._dynamo.reset()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = torch.compile(ours, fullgraph=True)(x)
                reference = theirs(x)
            assert any("Implicit dimension choice" in str(w.message) for w in caught)
            torch.testing.assert_close(result, reference)


def test_autocast_keeps_the_input_dtype():
    # The documented choice: the input dtype (what torch does on CPU).
    xb = varied((4, 9), torch.bfloat16)
    xf = varied((4, 9), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert softmax(xb, -1).dtype == torch.softmax(xb, -1).dtype == torch.bfloat16
        assert log_softmax(xf, -1).dtype == torch.log_softmax(xf, -1).dtype == torch.float32
        assert scaled_masked_softmax(xb, causal=True).dtype == torch.bfloat16
    # CUDA autocast (fake CUDA tensors run torch's AutocastCUDA kernels without
    # a GPU): torch returns float32, ours the input dtype, as documented.
    with fake_cuda_autocast(torch.float16):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.empty(4, 9, dtype=dtype, device="cuda")
            for mine, theirs in ((softmax, torch.softmax), (log_softmax, torch.log_softmax)):
                assert theirs(x, -1).dtype == torch.float32 and mine(x, -1).dtype == dtype
                assert mine(x, -1, dtype=torch.float32).dtype == torch.float32
            assert scaled_masked_softmax(x, causal=True).dtype == dtype


@pytest.mark.gpu
def test_autocast_cuda_keeps_fp16_where_torch_gives_fp32():
    x = varied((4, 9), torch.float16, "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.softmax(x, -1).dtype == torch.float32  # torch: softmax is on autocast's fp32 list
        assert softmax(x, -1).dtype == torch.float16  # ours: the input dtype, half the saved bytes
        assert softmax(x, -1, dtype=torch.float32).dtype == torch.float32


@pytest.mark.slow
def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def block(x, mask):
        return softmax(x, 1) * log_softmax(x, -1, dtype=torch.float32) + scaled_masked_softmax(x, mask, 0.5, True)

    x = varied((2, 3, 5, 5), torch.float32).requires_grad_()
    mask = torch.rand(5, 5) > 0.3
    compiled = torch.compile(block, fullgraph=True)
    expected_out = block(x, mask)
    actual = compiled(x, mask)
    torch.testing.assert_close(actual, expected_out)
    grad = torch.randn_like(actual)
    torch.testing.assert_close(torch.autograd.grad(actual, x, grad)[0], torch.autograd.grad(expected_out, x, grad)[0])


def test_opcheck():
    x = varied((3, 4, 5), torch.float32).requires_grad_()
    torch.library.opcheck(softmax_op._softmax_forward_op, (x, 1, False, None))
    torch.library.opcheck(softmax_op._softmax_forward_op, (x.detach().half(), -1, True, torch.float32))
    xl = varied((2, 3, 4, 5), torch.float32).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(softmax_op._softmax_forward_op, (xl, 1, False, None))
    torch.library.opcheck(softmax_op._scaled_masked_softmax_op, (x, torch.rand(5) > 0.5, 0.5, True))
    y = torch.softmax(x.detach(), 1)
    torch.library.opcheck(softmax_op._softmax_backward_op, (torch.randn_like(y), y, 1, False, 1.0, torch.float16))


# Dense layouts whose leading dimensions do not merge for the last dim: a
# kernel that kept the input's strides where the fake kernel says contiguous
# (the C++ scaled_masked_softmax did) fails test_faketensor here, and
# torch.compile's stride assertion in a compiled graph.
OPCHECK_LAYOUTS = {
    "permuted": lambda x: x.permute(1, 0, 2, 3),
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
}
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("layout", list(OPCHECK_LAYOUTS))
def test_opcheck_layouts(backend, layout):
    _, device = backend
    x = OPCHECK_LAYOUTS[layout](varied((2, 3, 4, 5), torch.float32, device, seed=21))
    mask = (torch.rand(5, generator=torch.Generator().manual_seed(3)) > 0.3).to(device)
    for args in ((x, None, 0.5, False), (x, mask, 0.5, True)):
        torch.library.opcheck(softmax_op._scaled_masked_softmax_op, args, test_utils=OPCHECK_UTILS)
    for dim in (1, 3):
        torch.library.opcheck(softmax_op._softmax_forward_op, (x, dim, dim == 3, None), test_utils=OPCHECK_UTILS)
        y = torch.softmax(x, dim)
        # the gradient's layout follows the saved output's: y contiguous, and y laid out like x
        for saved in (y.contiguous(), torch.empty_like(x).copy_(y)):
            for grad in (torch.randn_like(x), torch.randn(x.shape, device=device)):
                torch.library.opcheck(softmax_op._softmax_backward_op, (grad, saved, dim, False, 1.0, torch.float32),
                                      test_utils=OPCHECK_UTILS)
    # In eager too: the leading dims do not merge, so the output is contiguous (the rule of output_like).
    assert scaled_masked_softmax(x, mask, 0.5).stride() == torch.empty(x.shape).stride()


def test_info_lists_the_ops():
    report = effilayers._info.collect()
    cpu = {entry["op"]: entry["backend"] for entry in report["ops"] if entry["device"] == "cpu"}
    for op in ("softmax_forward", "softmax_backward", "scaled_masked_softmax_forward"):
        assert op in cpu
        assert cpu[op] in ("cpp", "reference", "triton")


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_log_softmax_gradient_beyond_fp16_range(backend):
    """test_triton_gpu_rows' longest fp16 row on the CPU kernels (the GPU
    test runs the same on Triton): some exact log-softmax gradients exceed
    fp16's range (|sum(g)| ~ 1.3e5 over 262144 columns) and must come out as
    infinities of their sign, the rest within tolerance. Two H200 sessions
    failed the GPU test on its own expectation, which compared those
    infinities with the finite float64 values."""
    context = activate_backend("softmax_forward", backend, "cpu")
    try:
        x = varied((3, 262144), torch.float16).requires_grad_()
        y = log_softmax(x, -1)
        grad = varied((3, 262144), torch.float16, seed=1)
        (gx,) = torch.autograd.grad(y, x, grad)
    finally:
        context.__exit__(None, None, None)
    reference = grad_formula(grad, y, -1, True)
    assert reference.to(torch.float16).isinf().sum() > 0  # the case the test is about
    check_grad(gx, y, grad, -1, True, torch.float16)


def test_gradient_check_rejects_a_finite_value_where_the_gradient_overflows():
    reference = torch.tensor([1.0, -1e6, 2.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="overflowed gradient"):
        assert_grad_matches(torch.tensor([1.0, -65504.0, 2.0], dtype=torch.float16), reference, torch.float16)
    assert_grad_matches(torch.tensor([1.0, -math.inf, 2.0], dtype=torch.float16), reference, torch.float16)


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [1000, 4096, 32768, 65537, 262144])
def test_triton_gpu_rows(dtype, cols):
    with effilayers.use_backend("triton"):
        x = varied((16, cols), dtype, "cuda").requires_grad_()
        for log, fn in ((False, softmax), (True, log_softmax)):
            y = fn(x, -1)
            assert_matches(y, expected(x, -1, log), dtype, log)
            grad = varied((16, cols), dtype, "cuda", seed=1)
            (gx,) = torch.autograd.grad(y, x, grad)
            check_grad(gx, y, grad, -1, log, dtype)


@pytest.mark.gpu
def test_triton_gpu_over_2_31_elements():
    # 2**31 + 32768 fp16 elements: offsets past int32 must be formed in int64.
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        # An 80 GB GPU has room: in CI (EFFILAYERS_REQUIRE_COMPILED=1) a full
        # GPU is an error to see, not a reason to go green without the test.
        (pytest.fail if REQUIRE_COMPILED else pytest.skip)(f"needs ~12 GiB of free GPU memory, {free / 2**30:.1f} free")
    with effilayers.use_backend("triton"):
        x = torch.randn(65537, 32768, dtype=torch.float16, device="cuda")
        y = softmax(x, -1)
        torch.testing.assert_close(y[-2:].float(), torch.softmax(x[-2:].float(), -1), rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(y[:2].float(), torch.softmax(x[:2].float(), -1), rtol=1e-3, atol=1e-6)


# --------------------------------------------------------------------------- the C++ autograd
# An eager call on a CPU tensor takes the C++ autograd (csrc/common/softmax_autograd.h)
# when the CPU library is loaded; the Python Function serves the rest. The `backend`
# rows above run both ("cpp" the C++ one, "reference" the Python one); these check that
# the choice is the one meant and that the two agree on everything the op does.


def _compiled_autograd_or_skip():
    from effilayers._core import registry

    if not registry.compiled_autograd("softmax", torch.empty(1)):
        if REQUIRE_COMPILED:
            pytest.fail(f"the C++ autograd of softmax is not registered: {registry.library_report()}")
        pytest.skip("the compiled CPU library is not loaded")


def test_eager_cpu_calls_take_the_compiled_autograd():
    _compiled_autograd_or_skip()
    x = varied((3, 5), torch.float64, "cpu").requires_grad_()
    assert "Softmax" in softmax(x, 1).grad_fn.name() and type(softmax(x, 1).grad_fn).__name__ == "CppFunction"
    assert type(enn.LogSoftmax(1)(x).grad_fn).__name__ == "CppFunction"
    with effilayers.use_backend("reference"):
        assert type(softmax(x, 1).grad_fn).__name__ == "_EagerSoftmaxBackward"


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype, out_dtype", [(torch.float64, None), (torch.float16, None),
                                              (torch.bfloat16, torch.float32)])
def test_compiled_and_python_autograd_agree(log, dtype, out_dtype):
    """Output, gradient, dtype, layout and the bytes kept for backward, on a
    non-contiguous input, bit for bit: the same kernels run under both."""
    from effilayers import memory

    _compiled_autograd_or_skip()
    results = []
    for path in ("compiled", "python"):
        x = varied((6, 4, 9), dtype, "cpu").transpose(0, 2).requires_grad_()
        grad = varied((9, 4, 6), out_dtype or dtype, "cpu", seed=1)
        with memory.track_activations() as meter:
            if path == "compiled":
                out = (log_softmax if log else softmax)(x, 1, dtype=out_dtype)
            else:
                out = softmax_op._EagerSoftmax.apply(x, 1, log, out_dtype)
        kept = meter.bytes
        out.backward(grad)
        results.append((out.detach(), out.stride(), x.grad, kept))
    compiled, python = results
    assert compiled[1] == python[1] and compiled[3] == python[3]
    torch.testing.assert_close(compiled[0], python[0], rtol=0, atol=0)
    torch.testing.assert_close(compiled[2], python[2], rtol=0, atol=0)


def test_compiled_autograd_double_backward_no_grad_and_inference_mode():
    _compiled_autograd_or_skip()
    x = varied((3, 7), torch.float64, "cpu").requires_grad_()
    # create_graph=True: the backward op's own derivative makes the gradient differentiable
    assert torch.autograd.gradgradcheck(lambda t: softmax(t, 1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: log_softmax(t, 0), (x,))
    expected_output = softmax_op._EagerSoftmax.apply(x, 1, False, None).detach()
    with torch.no_grad():
        out = softmax(x, 1)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, expected_output, rtol=0, atol=0)
    with torch.inference_mode():
        out = softmax(x, 1)
    assert out.is_inference()
    torch.testing.assert_close(out, expected_output, rtol=0, atol=0)
