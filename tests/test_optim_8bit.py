"""8-bit block-quantized optimizer states: ``effilayers::adam_step_8bit_`` and
``ChunkedAdam(W)(state_dtype="8bit")``.

Kernels are compared with the pure-PyTorch reference (float32 decode ->
update -> encode) on the same inputs: codes may differ by one step where a
value sits on a rounding boundary and the kernels' float32 arithmetic differs
in the last bit (Triton's bias corrections, the C++ kernel's grouping of
``(1 - beta2) * g * g``); scales and parameters to float32 rounding.
Trajectories are compared with torch.optim.AdamW (fp32 states) with the
measured, documented tolerance below.
"""

from __future__ import annotations

import copy

import pytest
import torch

import effilayers
from effilayers._core.layout import memory_flat
from effilayers.ops.adam import (
    QUANT_BLOCK,
    AdamHyperParams,
    adam_step_8bit_,
    adam_step_8bit_reference,
    dequantize_exp_avg,
    dequantize_exp_avg_sq,
    gather_padded,
    padded_numel,
    quantize_exp_avg,
    quantize_exp_avg_sq,
)
from effilayers.optim import ChunkedAdam, ChunkedAdamW

from .accuracy import TRAJECTORY_BOUNDS, assert_close
from .conftest import backend_params, forced_backend, required_backend
from .helpers import NewStorages
from .optim_cases import make_net


@pytest.fixture(params=backend_params("adam_step_8bit_"))
def adam8_device(request):
    backend = request.param[0]
    for device in forced_backend(request, "adam_step_8bit_"):
        yield backend, device


def _spread(numel, seed, low=-4.0, positive=False):
    """Random values over several decades (like Adam states within a block)."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(low, 0, numel)[torch.randperm(numel, generator=generator)]
    values = torch.randn(numel, generator=generator) * magnitudes
    return values.abs() + 1e-12 if positive else values


def _pad(params, pieces):
    out = torch.zeros(sum(padded_numel(p.numel()) for p in params))
    offset = 0
    for p, piece in zip(params, pieces):
        out[offset:offset + p.numel()] = piece
        offset += padded_numel(p.numel())
    return out


def _inputs(shapes, param_dtype, master, amsgrad, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator).to(param_dtype) for s in shapes]
    grads = [(torch.randn(s, generator=generator) * 3).to(param_dtype) for s in shapes]
    m = _pad(params, [_spread(p.numel(), seed + 10 + i) * 0.1 for i, p in enumerate(params)])
    v = _pad(params, [_spread(p.numel(), seed + 20 + i, low=-8, positive=True) * 0.01 for i, p in enumerate(params)])
    states = [*quantize_exp_avg(m), *quantize_exp_avg_sq(v)]
    if amsgrad:
        states += list(quantize_exp_avg_sq(v * 1.5))
    else:
        states += [None, None]
    master_flat = _pad(params, [p.float().reshape(-1) + 1e-3 for p in params]) if master else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return [p.to(device) for p in params], [g.to(device) for g in grads], [move(s) for s in states], move(master_flat)


OPTIONS = [
    dict(weight_decay=0.1, decoupled_weight_decay=True, maximize=False, amsgrad=False, scaled=False),
    dict(weight_decay=0.1, decoupled_weight_decay=False, maximize=True, amsgrad=True, scaled=True),
]
DTYPES = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True), (torch.float16, False)]


@pytest.mark.parametrize("param_dtype,master", DTYPES, ids=["fp32", "fp32-master", "bf16-master", "fp16"])
@pytest.mark.parametrize("options", OPTIONS, ids=["adamw", "adam-maximize-amsgrad-scaled"])
def test_kernel_matches_reference(adam8_device, param_dtype, master, options):
    backend, device = adam8_device
    if backend == "triton" and device.type == "cpu" and param_dtype != torch.float32:
        pytest.skip("the Triton interpreter has no bf16/fp16 arithmetic (covered on the GPU)")
    options = dict(options)
    amsgrad, scaled = options.pop("amsgrad"), options.pop("scaled")
    # odd sizes, one element, exactly one block, and a long parameter (one
    # over a C++ grain; shorter under the interpreter, still over one program)
    long = 1100 if backend == "triton" and device.type == "cpu" else 70001
    shapes = [(3, 5), (300,), (1,), (2, QUANT_BLOCK // 2), (long,)]
    params, grads, states, master_flat = _inputs(shapes, param_dtype, master, amsgrad, device)
    expected = [[t.detach().cpu().clone() for t in params], [g.cpu() for g in grads],
                [None if s is None else s.cpu().clone() for s in states],
                None if master_flat is None else master_flat.cpu().clone()]
    scale = torch.tensor([1024.0], device=device) if scaled else None
    if scaled:
        grads = [g * 1024 for g in grads]
        expected[1] = [g * 1024 for g in expected[1]]
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, **options)
    with effilayers.use_backend("reference"):
        adam_step_8bit_reference(expected[0], expected[1], *expected[2], expected[3], torch.tensor([7.0]),
                                 None if scale is None else scale.cpu(), None, hyper)
    before = [None if s is None else s.clone() for s in states]
    adam_step_8bit_(params, grads, *states, master_flat, torch.tensor([7.0], device=device), scale, None,
                    hyper=hyper)

    for index, (actual, wanted, old) in enumerate(zip(states, expected[2], before)):
        if actual is None:
            continue
        actual = actual.cpu()
        if index % 2 == 0:  # codes
            assert not torch.equal(actual, old.cpu())  # the kernel wrote them
            assert (actual.int() - wanted.int()).abs().max() <= 1, index
            assert (actual != wanted).float().mean() < 1e-3, index
        else:  # absmax per block
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=0)
    for actual, wanted in zip(params, expected[0]):
        assert_close(actual.cpu().float(), wanted.float(), param_dtype, "adam_8bit_param")
    if master_flat is not None:
        assert_close(master_flat.cpu(), expected[3], torch.float32, "adam_8bit_param")
        flat_params = torch.cat([p.cpu().reshape(-1).float() for p in params])
        assert torch.equal(flat_params, _unpad(master_flat.cpu(), params).to(param_dtype).float())
    # padding codes stay zero
    for codes in states[0::2]:
        if codes is not None:
            assert _unpad_mask(params).logical_not().logical_and(codes.cpu() != 0).sum() == 0


def _unpad(flat, params):
    pieces, offset = [], 0
    for p in params:
        pieces.append(flat[offset:offset + p.numel()])
        offset += padded_numel(p.numel())
    return torch.cat(pieces)


def _unpad_mask(params):
    return _pad(params, [torch.ones(p.numel()) for p in params]).bool()


def test_kernel_skipped_step_writes_nothing(adam8_device):
    _, device = adam8_device
    params, grads, states, _ = _inputs([(5, 3), (1030,)], torch.float32, False, True, device)
    before = [t.clone() for t in (*params, *states)]
    grads = [g.clone().fill_(float("inf")) for g in grads]
    adam_step_8bit_(params, grads, *states, None, torch.tensor([3.0], device=device),
                    torch.tensor([2.0 ** 16], device=device), torch.tensor([1.0], device=device),
                    hyper=AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                          decoupled_weight_decay=True, maximize=False))
    for old, new in zip(before, (*params, *states)):
        assert torch.equal(old, new)


def test_opcheck():
    params, grads, states, _ = _inputs([(5, 3), (7,)], torch.float32, False, True, "cpu")
    torch.library.opcheck(
        torch.ops.effilayers.adam_step_8bit_.default,
        (params, grads, *states, None, torch.tensor([2.0]), None, None, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, False),
    )


# -- the codes ------------------------------------------------------------------

def test_round_trip_error_bounds_per_block():
    """exp_avg: t = sqrt(|x|/a) is rounded to 1/127, so |x - x'| <= a * h * (2t + h)
    with h = 0.5/127. exp_avg_sq: t = (x/a)^(1/4) rounded to 1/255, so
    |x - x'| <= a * 4 h (t + h)^3 with h = 0.5/255, except that a non-zero
    value never decodes to 0 (code 1: at most a / 255^4 above it)."""
    blocks = 64
    m = _spread(blocks * QUANT_BLOCK, 1, low=-6) * torch.logspace(-3, 3, blocks).repeat_interleave(QUANT_BLOCK)
    codes, absmax = quantize_exp_avg(m)
    assert codes.dtype == torch.int8 and absmax.shape == (blocks,) and codes.abs().max() <= 127
    decoded = dequantize_exp_avg(codes, absmax)
    a = absmax.repeat_interleave(QUANT_BLOCK).double()
    t, h = (m.double().abs() / a).sqrt(), 0.5 / 127
    bound = a * h * (2 * t + h) * (1 + 1e-5) + a * 1e-7
    assert ((decoded.double() - m.double()).abs() <= bound).all()
    assert (torch.sign(decoded) * torch.sign(m) >= 0).all()  # never flips a sign
    # each block's largest magnitude decodes exactly
    assert torch.equal(decoded.view(blocks, -1).abs().amax(1), m.view(blocks, -1).abs().amax(1))
    # relative error where it matters (top two decades of each block): <= 1.6 %
    top = t >= 0.1
    assert ((decoded.double() - m.double()).abs() / m.double().abs())[top].max() <= 2 * h / 0.1 + 1e-6

    v = _spread(blocks * QUANT_BLOCK, 2, low=-12, positive=True) * torch.logspace(-8, 0, blocks).repeat_interleave(
        QUANT_BLOCK)
    codes, absmax = quantize_exp_avg_sq(v)
    assert codes.dtype == torch.uint8
    decoded = dequantize_exp_avg_sq(codes, absmax)
    a = absmax.repeat_interleave(QUANT_BLOCK).double()
    t, h = (v.double() / a) ** 0.25, 0.5 / 255
    bound = torch.maximum(a * 4 * h * (t + h) ** 3, a / 255.0 ** 4) * (1 + 1e-5) + a * 1e-7
    assert ((decoded.double() - v.double()).abs() <= bound).all()
    assert (decoded > 0).all()  # a non-zero second moment never becomes 0
    # decode -> encode reproduces the codes (what a state-dict round trip relies on)
    again_codes, again_absmax = quantize_exp_avg_sq(decoded)
    assert torch.equal(again_codes, codes) and torch.equal(again_absmax, absmax)


def test_linear_code_would_lose_small_second_moments():
    """Why the code is companded: a block with one large v and values four
    decades below it. The 4th-power code keeps them within 1.6 % relative
    (the top 2.5 decades) / ~10 % (4 decades down); a linear 8-bit code would
    round them all to 0 (denominator -> eps)."""
    v = torch.full((QUANT_BLOCK,), 1e-4)
    v[0] = 1.0
    codes, absmax = quantize_exp_avg_sq(v)
    decoded = dequantize_exp_avg_sq(codes, absmax)
    assert ((decoded[1:] - 1e-4).abs() / 1e-4).max() < 0.1
    linear = torch.round(v / v.max() * 255) / 255 * v.max()
    assert (linear[1:] == 0).all()


# -- the optimizer ----------------------------------------------------------------

def _train(model, optimizer, steps, seed=1, scaler=None, overflow_at=None):
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        param = next(model.parameters())  # (the data follows the model's device and dtype)
        x = torch.randn(16, 7, generator=generator).to(param.device, param.dtype)
        y = torch.randn(16, 5, generator=generator).to(param.device, param.dtype)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        if step == overflow_at:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


def _assert_close_to_torch(actual, expected, atol=TRAJECTORY_BOUNDS["8bit"]["atol"],
                           rel_l2=TRAJECTORY_BOUNDS["8bit"]["rel_l2"]):
    for (name, p), q in zip(actual.named_parameters(), expected.parameters()):
        p, q = p.detach().double().cpu(), q.detach().double().cpu()
        assert (p - q).abs().max() <= atol, (name, (p - q).abs().max())
        assert (p - q).norm() / q.norm() <= rel_l2, (name, (p - q).norm() / q.norm())


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_trajectory_tracks_torch_adamw(adam8_device, amsgrad):
    backend, device = adam8_device
    steps = 100 if backend != "triton" or device.type == "cuda" else 15  # the interpreter is slow
    expected, actual = make_net(spare=False).to(device), make_net(spare=False).to(device)
    _train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2, amsgrad=amsgrad), steps)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, amsgrad=amsgrad, state_dtype="8bit", chunk_size=600)
    _train(actual, optimizer, steps)
    _assert_close_to_torch(actual, expected)
    assert all(entry["state_dtype"] == "8bit" for entry in optimizer.chunk_layout())
    # and the 8-bit states are not simply fp32 in disguise: they differ from torch's
    assert any((p - q).abs().max() > 1e-6 for p, q in zip(actual.parameters(), expected.parameters()))


def test_trains_like_fp32_adamw():
    """A learnable task (2-layer MLP, 10-class linear teacher, lr 1e-2, 100
    steps): the 8-bit optimizer's loss falls like torch's. Measured: mean loss
    of the last 20 steps 0.354 (8-bit) vs 0.355 (torch), from 2.25."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    twin = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    teacher = torch.randn(32, 10, generator=generator)
    losses = {"torch": [], "8bit": []}
    pairs = [("torch", twin, torch.optim.AdamW(twin.parameters(), lr=1e-2)),
             ("8bit", model, ChunkedAdamW(model.parameters(), lr=1e-2, state_dtype="8bit"))]
    for _ in range(100):
        x = torch.randn(64, 32, generator=generator)
        y = (x @ teacher).argmax(1)
        for name, net, optimizer in pairs:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    first = sum(losses["torch"][:5]) / 5
    final = {name: sum(values[-20:]) / 20 for name, values in losses.items()}
    assert final["torch"] < 0.5 * first
    assert abs(final["8bit"] - final["torch"]) <= 0.1 * final["torch"], final


def test_state_bytes_per_parameter():
    """Measured through the optimizer's state tensors: ~2 bytes per parameter
    plus 2 x 4 / 256 for the scales (and the per-parameter block padding)
    against 8 for fp32 states."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    numel = sum(p.numel() for p in model.parameters())

    def state_bytes(optimizer):
        total = 0
        for entry in optimizer.state.values():
            total += sum(t.numel() * t.element_size() for key, t in entry.items() if key != "step")
        return total

    results = {}
    for state_dtype in (torch.float32, torch.bfloat16, "8bit"):
        optimizer = ChunkedAdamW(model.parameters(), lr=1e-3, state_dtype=state_dtype)
        model(torch.randn(2, 256)).sum().backward()
        optimizer.step()
        results[state_dtype] = state_bytes(optimizer) / numel
    assert results[torch.float32] == 8.0
    assert results[torch.bfloat16] == 4.0
    # all sizes here are multiples of 256: no padding, 2 + 8 / 256 bytes
    assert results["8bit"] == pytest.approx(2 + 8 / QUANT_BLOCK, abs=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-fp32-master"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_padding_bytes_per_parameter_as_documented(dtype, amsgrad):
    """README: a parameter of n elements takes P = 256 * ceil(n / 256) slots
    in every flat buffer of its chunk: each code buffer (2, 3 with amsgrad)
    and the fp32 master of a fp16/bf16 parameter, plus 4 bytes of absmax per
    block per code buffer and a 4-byte step counter."""
    sizes = [1, 300, 256]
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]
    optimizer = ChunkedAdamW(params, state_dtype="8bit", amsgrad=amsgrad)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    buffers = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
               "max_exp_avg_sq_absmax", "master", "steps")
    measured = sum(getattr(chunk, name).numel() * getattr(chunk, name).element_size()
                   for chunks in optimizer._store.chunks.values() for chunk in chunks
                   for name in buffers if getattr(chunk, name) is not None)
    slots = sum(-(-n // QUANT_BLOCK) * QUANT_BLOCK for n in sizes)  # 256 + 512 + 256
    code_buffers = 3 if amsgrad else 2
    expected = slots * code_buffers + slots // QUANT_BLOCK * 4 * code_buffers + 4 * len(sizes)
    if dtype is torch.bfloat16:
        expected += 4 * slots
    assert measured == expected


def test_low_precision_params_keep_fp32_masters():
    for dtype in (torch.bfloat16, torch.float16):
        expected, actual = make_net(spare=False), make_net(dtype, spare=False)
        _train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2), 60)
        optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, state_dtype="8bit")
        _train(actual, optimizer, 60)
        for p in actual.parameters():
            entry = optimizer.state[p]
            assert entry["master_param"].dtype == torch.float32
            assert entry["exp_avg_codes"].dtype == torch.int8 and entry["exp_avg_sq_codes"].dtype == torch.uint8
            assert torch.equal(p.detach(), entry["master_param"].to(dtype))
        _assert_close_to_torch(actual, expected, atol=3e-2, rel_l2=0.08)


def test_float64_params_keep_float64_states():
    param = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    optimizer = ChunkedAdamW([param], state_dtype="8bit")
    param.grad = torch.randn(10, dtype=torch.float64)
    optimizer.step()
    assert optimizer.state[param]["exp_avg"].dtype == torch.float64


def test_grad_scaler_overflow_changes_nothing():
    model = make_net(spare=False)
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, state_dtype="8bit", amsgrad=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    _train(model, optimizer, 3, scaler=scaler)
    raw_before = {p: {k: t.clone() for k, t in optimizer.state[p].items()} for p in model.parameters()}
    params_before = [p.detach().clone() for p in model.parameters()]
    _train(model, optimizer, 1, seed=5, scaler=scaler, overflow_at=0)
    assert scaler.get_scale() == 2.0 ** 9
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
    for p in model.parameters():
        for key, value in raw_before[p].items():
            assert torch.equal(optimizer.state[p][key], value), key
    _train(model, optimizer, 1, seed=6, scaler=scaler)
    assert float(optimizer.state_dict()["state"][0]["step"]) == 4.0


def test_state_dict_round_trip_through_torch_adamw_and_chunk_sizes():
    model = make_net(spare=False)
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, state_dtype="8bit", amsgrad=True, chunk_size=600)
    _train(model, optimizer, 5)
    saved = optimizer.state_dict()
    # torch.optim.AdamW's layout: fp32 tensors shaped like the parameters
    for p, entry in zip(model.parameters(), saved["state"].values()):
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        assert entry["exp_avg"].dtype == torch.float32 and entry["exp_avg"].shape == p.shape
    torch_model = make_net(spare=False)
    torch_model.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, amsgrad=True)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    # back into 8-bit with another chunk size: identical decoded states
    twin = make_net(spare=False)
    twin.load_state_dict(model.state_dict())
    reloaded = ChunkedAdamW(twin.parameters(), lr=1e-2, state_dtype="8bit", amsgrad=True, chunk_size=1 << 20)
    reloaded.load_state_dict(torch_opt.state_dict())
    for index, entry in reloaded.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, saved["state"][index][key]), (index, key)
    # and it continues exactly like the original
    _train(model, optimizer, 5, seed=9)
    _train(twin, reloaded, 5, seed=9)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    # torch continues from the decoded states: close to the 8-bit run
    _train(torch_model, torch_opt, 5, seed=9)
    _assert_close_to_torch(model, torch_model, atol=2e-3, rel_l2=0.01)


def test_state_assigned_directly_is_encoded_like_load_state_dict():
    """`optimizer.state[p] = entry` (what ZeroRedundancyOptimizer.load_state_dict
    does) with torch's fp32 layout: encoded into the 8-bit chunks exactly as
    load_state_dict encodes it."""
    model = make_net(spare=False)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, torch_opt, 3)
    loaded_model, assigned_model = copy.deepcopy(model), copy.deepcopy(model)
    loaded = ChunkedAdamW(loaded_model.parameters(), lr=1e-2, state_dtype="8bit")
    loaded.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assigned = ChunkedAdamW(assigned_model.parameters(), lr=1e-2, state_dtype="8bit")
    for p, q in zip(assigned_model.parameters(), model.parameters()):
        assigned.state[p] = copy.deepcopy(torch_opt.state[q])
    _train(loaded_model, loaded, 3, seed=4)
    _train(assigned_model, assigned, 3, seed=4)
    for p, q in zip(assigned_model.parameters(), loaded_model.parameters()):
        assert torch.equal(p, q)
    assert all(float(entry["step"]) == 6.0 for entry in assigned.state_dict()["state"].values())


def test_fp32_checkpoint_loads_into_8bit_within_quantization_error():
    model = make_net(spare=False)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, torch_opt, 5)
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, state_dtype="8bit")
    optimizer.load_state_dict(torch_opt.state_dict())
    for index, entry in optimizer.state_dict()["state"].items():
        original = torch_opt.state_dict()["state"][index]
        for key, atol_rel in (("exp_avg", 2 / 127), ("exp_avg_sq", 4 / 255)):
            scale = original[key].abs().max()
            torch.testing.assert_close(entry[key], original[key], rtol=0, atol=float(scale) * atol_rel)


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-params", "staging-pipeline"])
def test_offload_cpu_matches_on_device_8bit(staged):
    """offload="cpu" with 8-bit states: the same C++ kernel on the same
    states, so the non-offloaded 8-bit optimizer's result to float32 rounding."""
    expected, actual = make_net(spare=False), make_net(spare=False)
    _train(expected, ChunkedAdamW(expected.parameters(), lr=1e-2, amsgrad=True, state_dtype="8bit",
                                  chunk_size=600), 20)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, amsgrad=True, state_dtype="8bit", offload="cpu",
                             chunk_size=600)
    optimizer._force_staging = staged
    _train(actual, optimizer, 20)
    # The staged path hands the kernel whole padded blocks (all through the
    # vector body); in place, each parameter's last block ends in the scalar
    # tail, whose float32 rounding may differ in the last bit.
    for p, q in zip(actual.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(entry["state_device"] == "cpu" for entry in optimizer.chunk_layout())


@pytest.mark.gpu
def test_offload_cuda_8bit_keeps_no_state_on_gpu():
    expected, actual = make_net(spare=False).cuda(), make_net(spare=False).to("cuda", torch.bfloat16)
    _train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2), 20)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, offload="cpu", state_dtype="8bit")
    _train(actual, optimizer, 20)
    for entry in optimizer.state.values():
        assert all(t.device.type == "cpu" for t in entry.values())
    _assert_close_to_torch(actual, expected, atol=5e-2, rel_l2=0.1)


def test_parameters_without_grad_in_some_steps():
    """A parameter that misses steps keeps its own step count and its blocks untouched."""
    model = make_net(spare=False)
    optimizer = ChunkedAdam(model.parameters(), lr=1e-2, state_dtype="8bit", chunk_size=1 << 20)
    _train(model, optimizer, 2)
    frozen = model.body[2].weight
    codes = optimizer.state[frozen]["exp_avg_codes"].clone()
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 7, generator=generator)).sum().backward()
        frozen.grad = None
        optimizer.step()
    assert torch.equal(optimizer.state[frozen]["exp_avg_codes"], codes)
    steps = [float(entry["step"]) for entry in optimizer.state_dict()["state"].values()]
    assert steps == [4.0, 4.0, 2.0, 4.0, 4.0, 4.0]


# -- errors ---------------------------------------------------------------------

def test_bad_state_dtype_is_named():
    with pytest.raises(TypeError, match="state_dtype must be torch.float32, torch.bfloat16 or '8bit'"):
        ChunkedAdamW([torch.nn.Parameter(torch.randn(3))], state_dtype="int4")
    with pytest.raises(TypeError, match="state_dtype must be"):
        ChunkedAdamW([torch.nn.Parameter(torch.randn(3))], state_dtype=torch.uint8)


def test_kernel_rejects_bad_arguments():
    params, grads, states, _ = _inputs([(3, 4)], torch.float32, False, False, "cpu")
    step = torch.tensor([1.0])
    hyper = AdamHyperParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            decoupled_weight_decay=False, maximize=False)
    m, m_absmax, v, v_absmax, _, _ = states
    with pytest.raises(ValueError, match="exp_avg must be a contiguous 1-D torch.int8 tensor of 256"):
        adam_step_8bit_(params, grads, m[:12], m_absmax, v, v_absmax, None, None, None, step, hyper=hyper)
    with pytest.raises(ValueError, match="exp_avg_sq must be a contiguous 1-D torch.uint8"):
        adam_step_8bit_(params, grads, m, m_absmax, v.to(torch.int8), v_absmax, None, None, None, step, hyper=hyper)
    with pytest.raises(ValueError, match="exp_avg_absmax must be a contiguous 1-D float32 tensor of 1"):
        adam_step_8bit_(params, grads, m, torch.zeros(2), v, v_absmax, None, None, None, step, hyper=hyper)
    with pytest.raises(ValueError, match="max_exp_avg_sq and max_exp_avg_sq_absmax go together"):
        adam_step_8bit_(params, grads, m, m_absmax, v, v_absmax, v.clone(), None, None, step, hyper=hyper)
    with pytest.raises(TypeError, match="float64 parameters keep float64 states"):
        adam_step_8bit_([params[0].double()], [grads[0].double()], m, m_absmax, v, v_absmax, None, None, None,
                        step, hyper=hyper)
    with pytest.raises(ValueError, match="master must be a 1-D float32 tensor of 256"):
        adam_step_8bit_(params, grads, m, m_absmax, v, v_absmax, None, None, torch.zeros(12), step, hyper=hyper)
    with effilayers.use_backend("reference"):  # the op checks before its Python kernels
        with pytest.raises(ValueError, match="exp_avg_sq_absmax must be a contiguous 1-D float32 tensor of 1"):
            torch.ops.effilayers.adam_step_8bit_(params, grads, m, m_absmax, v, torch.zeros(3), None, None, None,
                                                 step, None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)
    with effilayers.use_backend("cpp"):
        if effilayers.backends.choice("adam_step_8bit_", "cpu").kernel is not None:
            with pytest.raises(ValueError, match="exp_avg_sq_absmax must be a contiguous 1-D float32 CPU tensor"):
                torch.ops.effilayers.adam_step_8bit_(params, grads, m, m_absmax, v, torch.zeros(3), None, None,
                                                     None, step, None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0,
                                                     False, False)


def test_compile_fullgraph_matches_eager():
    """The op's fake implementation and mutation annotations let
    torch.compile(fullgraph=True) trace a step (aot_eager: the traced graph
    runs the same kernel, without building Inductor code here)."""
    params, grads, states, _ = _inputs([(5, 3), (300,)], torch.float32, False, True, "cpu")
    eager = [[p.clone() for p in params], [s.clone() for s in states]]
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            decoupled_weight_decay=True, maximize=False)

    def step(params, states, step_count):
        torch.ops.effilayers.adam_step_8bit_(params, grads, *states, None, step_count, None, None, *hyper.values)

    step(eager[0], eager[1], torch.tensor([2.0]))
    torch.compile(step, fullgraph=True, backend="aot_eager")(params, states, torch.tensor([2.0]))
    for actual, wanted in zip([*params, *states], [*eager[0], *eager[1]]):
        assert torch.equal(actual, wanted)


@pytest.mark.gpu
def test_triton_kernel_over_2_31_elements():
    """One chunk of more than 2^31 elements (a parameter bigger than the
    chunk size): the blocks at its end are updated like those at its start,
    so the kernel's int64 offsets do not wrap."""
    from .conftest import activate_backend

    n = 2**31 + 10 * QUANT_BLOCK
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    param = torch.randn(n, device=device, generator=generator)
    grad = torch.randn(n, device=device, generator=generator)
    blocks = n // QUANT_BLOCK
    states = [torch.zeros(n, dtype=torch.int8, device=device), torch.zeros(blocks, device=device),
              torch.zeros(n, dtype=torch.uint8, device=device), torch.zeros(blocks, device=device)]
    step = torch.tensor([1.0], device=device)
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            decoupled_weight_decay=True, maximize=False)
    ends = {"head": (0, 8), "tail": (blocks - 8, blocks)}  # in blocks
    expected = {}
    for name, (first, last) in ends.items():
        values = slice(first * QUANT_BLOCK, last * QUANT_BLOCK)
        part = [states[0][values].clone(), states[1][first:last].clone(), states[2][values].clone(),
                states[3][first:last].clone()]
        p, g = param[values].clone(), grad[values].clone()
        adam_step_8bit_reference([p], [g], *part, None, None, None, step, None, None, hyper)
        expected[name] = (p, part)
    context = activate_backend("adam_step_8bit_", "triton", "cuda")
    try:
        adam_step_8bit_([param], [grad], *states, None, None, None, step, None, None, hyper=hyper)
    finally:
        context.__exit__(None, None, None)
    for name, (first, last) in ends.items():
        values = slice(first * QUANT_BLOCK, last * QUANT_BLOCK)
        p, part = expected[name]
        torch.testing.assert_close(param[values], p, rtol=1e-5, atol=1e-6, msg=name)
        for actual, wanted in ((states[0][values], part[0]), (states[2][values], part[2])):
            assert (actual.int() - wanted.int()).abs().max() <= 1, name
        torch.testing.assert_close(states[1][first:last], part[1], rtol=1e-5, atol=0, msg=name)
        torch.testing.assert_close(states[3][first:last], part[3], rtol=1e-5, atol=0, msg=name)


def test_a_nan_gradient_makes_its_block_nan_on_every_backend(adam8_device):
    """A NaN is never hidden behind finite codes: the block holding it gets a
    NaN scale (codes 0), so it decodes to NaN, as the reference's amax gives;
    the other blocks are untouched by it."""
    backend, device = adam8_device
    params, grads, states, _ = _inputs([(3 * QUANT_BLOCK,)], torch.float32, False, False, device)
    grads[0][QUANT_BLOCK + 3] = float("nan")
    expected_states = [None if s is None else s.cpu().clone() for s in states]
    with effilayers.use_backend("reference"):
        adam_step_8bit_reference([params[0].cpu().clone()], [grads[0].cpu()], *expected_states, None,
                                 torch.tensor([2.0]), None, None,
                                 AdamHyperParams(1e-2, 0.9, 0.999, 1e-8, 0.0, True, False))
    adam_step_8bit_(params, grads, *states, None, torch.tensor([2.0], device=device), None, None,
                    hyper=AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                          decoupled_weight_decay=True, maximize=False))
    for absmax, wanted in ((states[1], expected_states[1]), (states[3], expected_states[3])):
        absmax = absmax.cpu()
        assert torch.isnan(absmax[1]) and torch.isnan(wanted[1])
        assert torch.isfinite(absmax[[0, 2]]).all()
        torch.testing.assert_close(absmax[[0, 2]], wanted[[0, 2]], rtol=1e-5, atol=0)
    block = slice(QUANT_BLOCK, 2 * QUANT_BLOCK)
    assert torch.equal(states[0].cpu()[block], expected_states[0][block])
    assert torch.equal(states[2].cpu()[block], expected_states[2][block])
    assert torch.isnan(dequantize_exp_avg(states[0].cpu(), states[1].cpu())[block]).all()


# -- the Triton kernel on chunks of several parameters ----------------------------

@pytest.fixture(params=backend_params("adam_step_8bit_", backends=("triton",)))
def triton8_device(request):
    """adam_step_8bit_ forced to the Triton kernel; yields the device."""
    yield from forced_backend(request, "adam_step_8bit_")


# odd sizes around the 256-element block and the 1024-element tile, and a
# channels_last 4-D parameter
MULTI_SHAPES = [(1,), (7,), (1023,), (1025,), (3000,), (4, 3, 5, 5)]


def _multi_inputs(param_dtype, master, device):
    params, grads, states, _ = _inputs(MULTI_SHAPES, param_dtype, False, True, device, seed=3)
    params[-1] = params[-1].contiguous(memory_format=torch.channels_last)
    grads[-1] = grads[-1].contiguous(memory_format=torch.channels_last)
    master_flat = None
    if master:  # the padded layout, each parameter in its memory order
        master_flat = _pad(params, [memory_flat(p).cpu().float() + 1e-3 for p in params]).to(device)
    return params, grads, states, master_flat


@pytest.mark.parametrize("param_dtype,master", [(torch.float32, False), (torch.float16, True),
                                                (torch.float16, False), (torch.bfloat16, True)],
                         ids=["fp32", "fp16-master", "fp16", "bf16-master"])
def test_triton_multi_parameter_chunk_matches_reference(triton8_device, param_dtype, master):
    device = triton8_device
    if device.type == "cpu" and param_dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter truncates fp32 -> bf16 instead of rounding (covered on the GPU)")
    params, grads, states, master_flat = _multi_inputs(param_dtype, master, device)
    expected = [[p.cpu().clone() for p in params], [s.cpu().clone() for s in states],
                None if master_flat is None else master_flat.cpu().clone()]
    hyper = AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            decoupled_weight_decay=False, maximize=True)
    scaled_grads = [g * 1024 for g in grads]  # exact: a power of two
    adam_step_8bit_reference(expected[0], [g.cpu() for g in grads], *expected[1], expected[2], torch.tensor([4.0]),
                             None, None, hyper)
    adam_step_8bit_(params, scaled_grads, *states, master_flat, torch.tensor([4.0], device=device),
                    torch.tensor([1024.0], device=device), None, hyper=hyper)

    for index, (actual, wanted) in enumerate(zip(states, expected[1])):
        actual = actual.cpu()
        if index % 2 == 0:  # codes
            assert (actual.int() - wanted.int()).abs().max() <= 1, index
            assert (actual != wanted).float().mean() < 2e-3, index
            assert _unpad_mask(params).logical_not().logical_and(actual != 0).sum() == 0  # padding stays zero
        else:  # absmax per block
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=0)
    for actual, wanted in zip(params, expected[0]):
        assert actual.stride() == wanted.stride()
        assert_close(actual.cpu().float(), wanted.float(), param_dtype, "adam_8bit_multi_param")
    if master_flat is not None:
        assert_close(master_flat.cpu(), expected[2], torch.float32, "adam_8bit_multi_param")


def test_triton_multi_parameter_chunk_skipped_step_writes_nothing(triton8_device):
    device = triton8_device
    params, grads, states, master_flat = _multi_inputs(torch.float16, True, device)
    before = [t.clone() for t in (*params, *states, master_flat)]
    grads = [g.clone().fill_(float("inf")) for g in grads]
    adam_step_8bit_(params, grads, *states, master_flat, torch.tensor([3.0], device=device),
                    torch.tensor([2.0 ** 16], device=device), torch.tensor([1.0], device=device),
                    hyper=AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                          decoupled_weight_decay=True, maximize=False))
    for old, new in zip(before, (*params, *states, master_flat)):
        assert torch.equal(old, new)


def test_triton_multi_parameter_chunk_allocates_no_padded_temporary():
    """The parameters and gradients are read in place: no zero-padded
    gather (the recorder sees one) and no scatter back; the tables are the
    only new storages, and a second call finds them cached."""
    with required_backend("adam_step_8bit_", "triton", "cpu"):
        params, grads, states, _ = _multi_inputs(torch.float32, False, "cpu")
        padded_bytes = sum(padded_numel(p.numel()) for p in params) * 4
        with NewStorages() as recorder:
            gather_padded(params)
        assert max(recorder.allocated) >= padded_bytes
        kernel = effilayers.backends.kernel("adam_step_8bit_", torch.device("cpu"))
        expected = [[p.clone() for p in params], [s.clone() for s in states]]
        hyper = AdamHyperParams(1e-2, 0.9, 0.999, 1e-8, 0.1, True, False)
        calls = []
        for step in (1.0, 2.0):
            adam_step_8bit_reference(expected[0], grads, *expected[1], None, torch.tensor([step]), None, None, hyper)
            with NewStorages() as recorder:
                kernel(params, grads, *states, None, torch.tensor([step]), None, None, *hyper.values)
            assert not any("foreach" in op or "cat" in op for op in recorder.ops), recorder.ops
            calls.append(recorder.allocated)
        assert max(calls[0], default=0) <= 256 < padded_bytes // 64, calls[0]
        assert not any(calls[1]), calls[1]
        for actual, wanted in zip(params, expected[0]):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-6)
