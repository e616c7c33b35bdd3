"""The fused adam_step_ kernel on every backend the registry declares,
against the reference computed in float64 on the same (already rounded)
inputs; the Triton kernel on chunks of several parameters (read in place
through a device table), its memory and its compiled accesses.
"""

from __future__ import annotations

import pytest
import torch

import effilayers
from effilayers._core.layout import memory_flat
from effilayers.ops.adam import AdamHyperParams, adam_step_, adam_step_reference
from effilayers.optim import ChunkedAdamW

from .accuracy import assert_close
from .conftest import activate_backend, backend_params, forced_backend, required_backend
from .helpers import NewStorages


def _varied(shape, dtype, seed, scale=1.0, positive=False):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    values = values * torch.logspace(-2, 0, values.numel(), dtype=torch.float64).view(shape) * scale
    if positive:
        values = values.abs() + 1e-4 * scale
    return values.to(dtype)


# -- the kernel ---------------------------------------------------------------

KERNEL_SHAPES = [(3, 5), (17,), (1,), (70001,), (2, 3, 4)]  # odd sizes, one longer than a CPU grain
DTYPE_CASES = [  # (param dtype, state dtype, fp32 master)
    (torch.float32, torch.float32, False),
    (torch.float32, torch.bfloat16, False),
    (torch.bfloat16, torch.float32, True),
    (torch.float16, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float64, torch.float64, False),
]
OPTION_CASES = [
    dict(weight_decay=0.1, decoupled_weight_decay=True, maximize=False, amsgrad=False, scaled=False),
    dict(weight_decay=0.1, decoupled_weight_decay=False, maximize=True, amsgrad=True, scaled=True),
    dict(weight_decay=0.0, decoupled_weight_decay=False, maximize=False, amsgrad=True, scaled=False),
]


def _kernel_inputs(param_dtype, state_dtype, master, amsgrad, device, shapes=KERNEL_SHAPES):
    params = [_varied(s, param_dtype, seed=i).to(device) for i, s in enumerate(shapes)]
    grads = [_varied(s, param_dtype, seed=100 + i, scale=3.0).to(device) for i, s in enumerate(shapes)]
    n = sum(p.numel() for p in params)
    exp_avg = _varied((n,), state_dtype, seed=7, scale=0.1).to(device)
    exp_avg_sq = _varied((n,), state_dtype, seed=8, scale=0.01, positive=True).to(device)
    max_exp_avg_sq = (_varied((n,), state_dtype, seed=9, scale=0.01, positive=True).to(device)
                      if amsgrad else None)
    master_flat = (torch.cat([p.reshape(-1) for p in params]).float() + 1e-4) if master else None
    return params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master_flat


@pytest.mark.parametrize("param_dtype,state_dtype,master", DTYPE_CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("options", OPTION_CASES, ids=["adamw", "adam-maximize-amsgrad-scaled", "amsgrad"])
def test_kernel_matches_float64_reference(adam_device, param_dtype, state_dtype, master, options):
    backend, device = adam_device
    if backend == "triton" and (param_dtype == torch.float64 or (device.type == "cpu" and (
            param_dtype != torch.float32 or state_dtype != torch.float32))):
        pytest.skip("the Triton interpreter has no bf16/fp16 arithmetic; the GPU kernel has no float64")
    options = dict(options)
    amsgrad, scaled = options.pop("amsgrad"), options.pop("scaled")
    inputs = _kernel_inputs(param_dtype, state_dtype, master, amsgrad, device)
    params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master_flat = inputs
    # the expected result: the same rounded inputs, in float64
    def float64_copy(x):
        if x is None:
            return None
        return x.double().clone() if isinstance(x, torch.Tensor) else [t.double().clone() for t in x]

    expected = [float64_copy(x) for x in (params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq)]
    exp_params = [t.clone() for t in expected[0]]
    if master_flat is not None:
        pieces = torch.split(master_flat.double(), [p.numel() for p in params])
        exp_params = [piece.view(p.shape).clone() for piece, p in zip(pieces, params)]
    scale = torch.tensor([1024.0], device=device) if scaled else None
    exp_grads = [g * 1024.0 for g in expected[1]] if scaled else expected[1]
    real_grads = [(g.double() * 1024.0).to(param_dtype) for g in grads] if scaled else grads
    step = torch.tensor([7.0], device=device)
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, **options)
    adam_step_reference(exp_params, [g.cpu() for g in exp_grads] if device.type == "cpu" else exp_grads,
                        expected[2], expected[3], expected[4], None, step, scale, None,
                        hyper)
    adam_step_(params, real_grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master_flat, step, scale, None, hyper=hyper)

    # fp32: |g| up to 3, so the rounding of m - g is ~1e-7 absolute
    state_tier = "adam_state" if state_dtype != torch.float64 else "elementwise"
    assert_close(exp_avg.double(), expected[2].to(device), state_dtype, state_tier)
    assert_close(exp_avg_sq.double(), expected[3].to(device), state_dtype, state_tier)
    if amsgrad:
        assert_close(max_exp_avg_sq.double(), expected[4].to(device), state_dtype, state_tier)
    for actual, wanted in zip(params, exp_params):
        assert_close(actual.double(), wanted.to(device), param_dtype, "elementwise")
    if master_flat is not None:
        assert_close(master_flat.double(), torch.cat([p.reshape(-1) for p in exp_params]).to(device),
                     torch.float32, "elementwise")
        # the low-precision parameter is the master rounded once
        torch.testing.assert_close(torch.cat([p.reshape(-1) for p in params]), master_flat.to(param_dtype),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("found_inf", [1.0, 2.0])  # 2.0: GradScaler sums the flags of two devices
def test_kernel_skipped_step_writes_nothing(adam_device, found_inf):
    _, device = adam_device
    inputs = _kernel_inputs(torch.float32, torch.float32, False, True, device, shapes=[(5, 3), (1030,)])
    before = [t.clone() for t in (*inputs[0], inputs[2], inputs[3], inputs[4])]
    grads = [g.clone().fill_(float("inf")) for g in inputs[1]]
    adam_step_(inputs[0], grads, inputs[2], inputs[3], inputs[4], None, torch.tensor([3.0], device=device),
               torch.tensor([2.0 ** 16], device=device), torch.tensor([found_inf], device=device),
               hyper=AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                     decoupled_weight_decay=True, maximize=False))
    for old, new in zip(before, (*inputs[0], inputs[2], inputs[3], inputs[4])):
        assert torch.equal(old, new)


def test_opcheck():
    """Schema, fake implementation and the mutation annotations agree."""
    inputs = _kernel_inputs(torch.float32, torch.float32, False, True, "cpu", shapes=[(5, 3), (7,)])
    params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, _ = inputs
    torch.library.opcheck(
        torch.ops.effilayers.adam_step_.default,
        (params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, None, torch.tensor([2.0]), None, None,
         1e-2, 0.9, 0.999, 1e-8, 0.1, True, False),
    )


def test_kernel_rejects_bad_arguments():
    params = [torch.randn(3, 4)]
    grads = [torch.randn(3, 4)]
    state = torch.zeros(12)
    step = torch.tensor([1.0])
    hyper = AdamHyperParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            decoupled_weight_decay=False, maximize=False)
    with pytest.raises(ValueError, match="exp_avg must be a contiguous 1-D tensor of 12"):
        adam_step_(params, grads, torch.zeros(11), state.clone(), None, None, step, hyper=hyper)
    with pytest.raises(TypeError, match="grads\\[0\\] must all have dtype"):
        adam_step_(params, [grads[0].double()], state.clone(), state.clone(), None, None, step, hyper=hyper)
    with pytest.raises(ValueError, match="grads\\[0\\] must have its strides"):
        adam_step_([torch.randn(4, 3).t()], grads, state.clone(), state.clone(), None, None, step, hyper=hyper)
    # the op checks before its Python kernels, as the compiled one checks for itself
    with effilayers.use_backend("reference"):
        with pytest.raises(ValueError, match="exp_avg must be a contiguous 1-D tensor of 12"):
            torch.ops.effilayers.adam_step_(params, grads, torch.zeros(11), state.clone(), None, None, step,
                                            None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)
    with effilayers.use_backend("cpp"):
        if effilayers.backends.choice("adam_step_", "cpu").kernel is not None:
            with pytest.raises(ValueError, match="states must be contiguous 1-D CPU tensors of 12"):
                torch.ops.effilayers.adam_step_(params, grads, torch.zeros(11), state.clone(), None, None, step,
                                                None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)


@pytest.mark.gpu
def test_triton_kernel_over_2_31_elements():
    """A parameter larger than the chunk size gets a chunk of its own, so one
    flat run can exceed 2^31 elements (34 GB of fp32 param, grad and states
    here): its last elements are updated exactly like its first, i.e. the
    kernel's offsets do not wrap."""
    n = 2**31 + 3000
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    param = torch.randn(n, device=device, generator=generator)
    grad = torch.randn(n, device=device, generator=generator)
    exp_avg = torch.zeros(n, device=device)
    exp_avg_sq = torch.zeros(n, device=device)
    step = torch.tensor([1.0], device=device)
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            decoupled_weight_decay=True, maximize=False)
    ends = {"head": slice(0, 4096), "tail": slice(n - 4096, n)}
    expected = {}
    for name, part in ends.items():
        p, g, m, v = (t[part].clone() for t in (param, grad, exp_avg, exp_avg_sq))
        adam_step_reference([p], [g], m, v, None, None, step, None, None, hyper)
        expected[name] = (p, m, v)
    context = activate_backend("adam_step_", "triton", "cuda")
    try:
        adam_step_([param], [grad], exp_avg, exp_avg_sq, None, None, step, None, None, hyper=hyper)
    finally:
        context.__exit__(None, None, None)
    for name, part in ends.items():
        for actual, wanted in zip((param[part], exp_avg[part], exp_avg_sq[part]), expected[name]):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.gpu
def test_functional_step_counters_on_cpu_wait_for_a_cuda_found_inf():
    """chunked_adam with CPU states and a CUDA found_inf (offloaded state,
    GradScaler on the GPU): the flag must be read after the GPU wrote it."""
    from effilayers.optim import chunked_adam

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = [torch.randn(16)]
    before = params[0].clone()
    steps = torch.zeros(1)
    found_inf = torch.zeros(1, device="cuda")
    torch.cuda._sleep(200_000_000)  # the GPU is busy when the flag is queued
    found_inf.fill_(1.0)
    chunked_adam(params, [torch.randn(16)], torch.zeros(16), torch.zeros(16), None, None, steps,
                 found_inf=found_inf, hyper=AdamHyperParams(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                                                            weight_decay=0.0, decoupled_weight_decay=True,
                                                            maximize=False))
    assert float(steps) == 0.0 and torch.equal(params[0], before)


# -- the Triton kernel on chunks of several parameters ----------------------------
#
# The kernel reads every parameter and gradient in place through a device
# table of addresses (effilayers/ops/adam/triton.py). These tests run it under
# the interpreter in fp32 and fp16 (bf16 and the large cases on a GPU).

@pytest.fixture(params=backend_params("adam_step_", backends=("triton",)))
def triton_device(request):
    """adam_step_ forced to the Triton kernel; yields the device."""
    yield from forced_backend(request, "adam_step_")


# (shapes, whether the kernel takes its ALIGNED specialisation): odd sizes
# around the 1024-element tile, and sizes that are all multiples of 8; each
# list holds a channels_last 4-D parameter.
MULTI_LAYOUTS = {
    "odd": ([(1,), (7,), (1023,), (1025,), (3000,), (4, 3, 5, 5)], False),
    "multiples-of-8": ([(8,), (1024,), (8, 3, 5, 5), (3000,)], True),
}
# the kernel tests' cases the GPU kernel supports, and fp16 without a master
MULTI_DTYPES = [case for case in DTYPE_CASES if case[0] != torch.float64] + [(torch.float16, torch.float32, False)]


def _laid_out(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous(memory_format=torch.channels_last) if values.dim() == 4 else values


def _multi_inputs(shapes, param_dtype, state_dtype, master, device):
    params = [_laid_out(_varied(s, param_dtype, seed=i)).to(device) for i, s in enumerate(shapes)]
    grads = [_laid_out(_varied(s, param_dtype, seed=50 + i, scale=3.0)).to(device) for i, s in enumerate(shapes)]
    n = sum(p.numel() for p in params)
    states = [_varied((n,), state_dtype, seed=7, scale=0.1).to(device),
              _varied((n,), state_dtype, seed=8, scale=0.01, positive=True).to(device),
              _varied((n,), state_dtype, seed=9, scale=0.01, positive=True).to(device)]
    # the states (and master) follow each parameter's memory order
    master_flat = torch.cat([memory_flat(p) for p in params]).float() + 1e-4 if master else None
    return params, grads, states, master_flat


def _skip_without_bf16(device, *dtypes):
    if device.type == "cpu" and torch.bfloat16 in dtypes:
        # the interpreter converts fp32 to bf16 by truncation, the GPU (and
        # the reference) round to nearest even
        pytest.skip("the Triton interpreter truncates fp32 -> bf16 instead of rounding (covered on the GPU)")


@pytest.mark.parametrize("param_dtype,state_dtype,master", MULTI_DTYPES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("layout", list(MULTI_LAYOUTS))
def test_triton_multi_parameter_chunk_matches_float64_reference(triton_device, layout, param_dtype, state_dtype,
                                                                master):
    from effilayers.ops.adam.triton import _operands

    device = triton_device
    _skip_without_bf16(device, param_dtype, state_dtype)
    shapes, aligned = MULTI_LAYOUTS[layout]
    params, grads, states, master_flat = _multi_inputs(shapes, param_dtype, state_dtype, master, device)
    assert params[-1 if layout == "odd" else 2].is_contiguous(memory_format=torch.channels_last)
    assert _operands(params, grads, state_dtype, padded=False).aligned == aligned
    expected_params = [p.double() for p in params]  # (keeps channels_last)
    if master_flat is not None:
        pieces = torch.split(master_flat.double(), [p.numel() for p in params])
        expected_params = [torch.empty_like(p, dtype=torch.float64) for p in params]
        for target, piece in zip(expected_params, pieces):
            memory_flat(target).copy_(piece)
    expected_states = [s.double() for s in states]
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            decoupled_weight_decay=False, maximize=True)
    scale = torch.tensor([1024.0], device=device)
    scaled_grads = [(g.double() * 1024.0).to(param_dtype) for g in grads]  # exact: a power of two
    adam_step_reference(expected_params, [g.double() for g in grads], *expected_states, None,
                        torch.tensor([7.0], device=device), None, None, hyper)
    adam_step_(params, scaled_grads, *states, master_flat, torch.tensor([7.0], device=device), scale, None,
               hyper=hyper)

    for actual, wanted in zip(states, expected_states):
        assert_close(actual.double(), wanted, state_dtype, "adam_state")
    for actual, wanted in zip(params, expected_params):
        assert actual.stride() == wanted.stride()
        assert_close(actual.double(), wanted, param_dtype, "elementwise")
    if master_flat is not None:
        assert_close(master_flat.double(), torch.cat([memory_flat(p) for p in expected_params]), torch.float32,
                     "elementwise")
        # the low-precision parameter is the master rounded once
        assert torch.equal(torch.cat([memory_flat(p) for p in params]), master_flat.to(param_dtype))


@pytest.mark.parametrize("found_inf", [1.0, float("nan")])
def test_triton_multi_parameter_chunk_skipped_step_writes_nothing(triton_device, found_inf):
    device = triton_device
    shapes, _ = MULTI_LAYOUTS["odd"]
    params, grads, states, master_flat = _multi_inputs(shapes, torch.float16, torch.float32, True, device)
    before = [t.clone() for t in (*params, *states, master_flat)]
    grads = [g.clone().fill_(float("inf")) for g in grads]
    adam_step_(params, grads, *states, master_flat, torch.tensor([3.0], device=device),
               torch.tensor([2.0 ** 16], device=device), torch.tensor([found_inf], device=device),
               hyper=AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                     decoupled_weight_decay=True, maximize=False))
    for old, new in zip(before, (*params, *states, master_flat)):
        assert torch.equal(old, new)


def test_triton_multi_parameter_chunk_allocates_no_chunk_sized_temporary():
    """No gather into a flat temporary (torch.cat) and no scatter back
    (_foreach_copy_): the only new storages are the small tables, built on
    the first call; a second call with the same tensors finds them cached,
    and new gradient tensors (new addresses) get a new parameter table and
    are read, not the old ones."""
    from effilayers.ops.adam import triton as kernels

    with required_backend("adam_step_", "triton", "cpu"):
        shapes, _ = MULTI_LAYOUTS["odd"]
        params, grads, states, _ = _multi_inputs(shapes, torch.float32, torch.float32, False, "cpu")
        chunk_bytes = sum(p.numel() for p in params) * 4
        hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                decoupled_weight_decay=True, maximize=False)
        expected = [[p.clone() for p in params], [s.clone() for s in states]]
        new_grads = [g.flip(0).contiguous(memory_format=torch.channels_last) if g.dim() == 4 else g.flip(0)
                     for g in grads]
        for step, step_grads in ((1.0, grads), (2.0, grads), (3.0, new_grads)):
            adam_step_reference(expected[0], step_grads, *expected[1], None, torch.tensor([step]), None, None,
                                hyper)

        # the recorder does see a gather
        with NewStorages() as recorder:
            torch.cat([memory_flat(p) for p in params])
        assert "aten.cat" in recorder.ops and max(recorder.allocated) >= chunk_bytes

        kernels._TILE_TABLES.clear()
        kernels._PARAMETER_TABLES.clear()
        # the kernel itself, as the optimizer calls it (through the op, the
        # recorder would see the op but not what runs inside it)
        kernel = effilayers.backends.kernel("adam_step_", torch.device("cpu"))
        calls = []
        for step, step_grads in ((1.0, grads), (2.0, grads), (3.0, new_grads)):
            with NewStorages() as recorder:
                kernel(params, step_grads, *states, None, torch.tensor([step]), None, None, *hyper.values)
            calls.append(recorder)
            assert not any("cat" in op or "foreach" in op for op in recorder.ops), recorder.ops
        # first call: the tables (9 tiles x 16 bytes); second: nothing new
        assert 0 < max(calls[0].allocated) <= 256 < chunk_bytes // 64, calls[0].allocated
        assert not any(calls[1].allocated), calls[1].allocated
        assert len(kernels._TILE_TABLES) == 1 and len(kernels._PARAMETER_TABLES) == 2
        for actual, wanted in zip([*params, *states], [*expected[0], *expected[1]]):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7)


def test_triton_gradient_in_another_memory_order_matches_torch(triton_device):
    """The op requires each gradient to have its parameter's strides (checked,
    see test_kernel_rejects_bad_arguments); the optimizer copies a gradient of
    another memory order (a contiguous gradient of a channels_last weight, a
    transposed one of a matrix) into the parameter's layout first, so the
    kernel still pairs the right elements."""
    device = triton_device

    def make():
        torch.manual_seed(0)
        conv = torch.nn.Parameter(torch.randn(8, 3, 3, 3, device=device).contiguous(memory_format=torch.channels_last))
        matrix = torch.nn.Parameter(torch.randn(6, 5, device=device))
        bias = torch.nn.Parameter(torch.randn(7, device=device))
        return [conv, matrix, bias]

    results = []
    for cls in (torch.optim.AdamW, ChunkedAdamW):
        params = make()
        optimizer = cls(params, lr=1e-2, **({} if cls is torch.optim.AdamW else {"chunk_size": 1000}))
        generator = torch.Generator().manual_seed(3)
        for _ in range(3):
            conv, matrix, bias = params
            conv.grad = torch.randn(8, 3, 3, 3, generator=generator).to(device)  # NCHW
            matrix.grad = torch.randn(5, 6, generator=generator).to(device).t()  # strides (1, 6)
            bias.grad = torch.randn(7, generator=generator).to(device)
            assert not conv.grad.is_contiguous(memory_format=torch.channels_last) and matrix.grad.stride() == (1, 6)
            optimizer.step()
        results.append(params)
        if cls is ChunkedAdamW:
            assert len(optimizer.chunk_layout()) == 1  # one chunk of three parameters
    for actual, wanted in zip(*results[::-1]):
        assert_close(actual, wanted, torch.float32, "adam_trajectory_triton")


def test_triton_multi_parameter_chunk_under_torch_compile(triton_device):
    """torch.compile(fullgraph=True) traces the op (its fake implementation)
    and the traced graph runs the Triton kernel (aot_eager: no Inductor
    code generation here)."""
    device = triton_device
    params, grads, states, _ = _multi_inputs(MULTI_LAYOUTS["odd"][0], torch.float32, torch.float32, False, device)
    eager = [[p.clone() for p in params], [s.clone() for s in states]]
    hyper = (1e-2, 0.9, 0.999, 1e-8, 0.1, True, False)

    def step(params, states, step_count):
        torch.ops.effilayers.adam_step_(params, grads, *states, None, step_count, None, None, *hyper)

    step(eager[0], eager[1], torch.tensor([2.0], device=device))
    torch.compile(step, fullgraph=True, backend="aot_eager")(params, states, torch.tensor([2.0], device=device))
    for actual, wanted in zip([*params, *states], [*eager[0], *eager[1]]):
        assert torch.equal(actual, wanted)


@pytest.mark.gpu
def test_triton_multi_parameter_chunk_peak_memory_on_cuda():
    """A 2^24-element chunk of four fp32 parameters: the step allocates only
    its tables (the gather it replaced took two chunk-sized temporaries,
    128 MiB), and matches the reference."""
    device = torch.device("cuda")
    shapes = [(2**22 + 3,), (5,), (2**23,), (2**22 - 8,)]
    generator = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=generator) for s in shapes]
    grads = [torch.randn(s, device=device, generator=generator) for s in shapes]
    n = sum(p.numel() for p in params)
    states = [torch.randn(n, device=device, generator=generator) * 0.1,
              torch.rand(n, device=device, generator=generator) * 0.01]
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            decoupled_weight_decay=True, maximize=False)
    expected = [[p.clone() for p in params], [s.clone() for s in states]]
    adam_step_reference(expected[0], grads, *expected[1], None, None, torch.tensor([5.0], device=device), None,
                        None, hyper)
    with required_backend("adam_step_", "triton", "cuda"):
        step = torch.tensor([5.0], device=device)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        adam_step_(params, grads, *states, None, None, step, hyper=hyper)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    for actual, wanted in zip([*params, *states], [*expected[0], *expected[1]]):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-6)


def test_triton_kernels_compile_to_vector_accesses(tmp_path):
    """Compiled for sm_90 (no GPU needed), a chunk of several aligned
    parameters gets the same 128-bit loads and stores as a one-parameter
    chunk, plus its six 64-bit table loads; without the ALIGNED facts the
    compiler falls back to one access per element."""
    import json
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "tests.ptx_accesses"], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    accesses = json.loads(done.stdout.strip().splitlines()[-1])
    for kind in ("fp32", "8bit"):
        single, aligned = accesses[f"{kind}-single"], dict(accesses[f"{kind}-aligned"])
        assert aligned.pop("ld.global.b64") == 6 and aligned == single, (kind, single, aligned)
        assert single.get("ld.global.v4.b32", 0) >= 4 and single.get("st.global.v4.b32", 0) >= 2
    assert not any(".v4." in access for access in accesses["fp32-unaligned"]), accesses["fp32-unaligned"]
