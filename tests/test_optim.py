"""ChunkedAdam / ChunkedAdamW and the fused adam_step_ kernel.

Kernel tests compare every backend with the reference computed in float64 on
the same (already rounded) inputs; optimizer tests compare 100-step
trajectories with torch.optim.Adam / AdamW (fp32: rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch

import effilayers
from effilayers._core.layout import memory_flat
from effilayers.ops.adam import AdamHyperParams, adam_step_, adam_step_reference
from effilayers.optim import ChunkedAdam, ChunkedAdamW

from .accuracy import TRAJECTORY_BOUNDS, assert_close, tolerance
from .conftest import activate_backend, backend_params, forced_backend, required_backend
from .helpers import NewStorages



@pytest.fixture(params=backend_params("adam_step"))
def adam_device(request):
    """Runs the test with adam_step forced to one backend; yields (backend, device)."""
    backend = request.param[0]
    for device in forced_backend(request, "adam_step"):
        yield backend, device


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
    # the compiled kernel checks for itself when called directly
    with effilayers.use_backend("cpp"):
        if effilayers.backends.choice("adam_step", "cpu").kernel is not None:
            with pytest.raises(ValueError, match="states must be contiguous 1-D CPU tensors of 12"):
                torch.ops.effilayers_cpu.adam_step_(params, grads, torch.zeros(11), state.clone(), None, None, step,
                                                     None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)


# -- optimizer trajectories ---------------------------------------------------

class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 19),
                                        torch.nn.Tanh())
        self.head = torch.nn.Linear(19, 5)
        self.spare = torch.nn.Linear(19, 5)  # used only on some steps

    def forward(self, x, use_spare=False):
        h = self.body(x)
        out = self.head(h)
        return out + self.spare(h) if use_spare else out


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return _Net().to(dtype)


def _train(model, optimizer, steps, *, sign=1.0, scheduler=None, clip=None, spare_every=0, set_to_none=True,
           seed=1):
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        param = next(model.parameters())  # (the data follows the model's device and dtype)
        x = torch.randn(16, 7, generator=generator).to(param.device, param.dtype)
        y = torch.randn(16, 5, generator=generator).to(param.device, param.dtype)
        optimizer.zero_grad(set_to_none=set_to_none)
        use_spare = spare_every > 0 and step % spare_every == 0
        loss = sign * torch.nn.functional.mse_loss(model(x, use_spare), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def _trajectory_tolerance(backend):
    """fp32 trajectories track torch to rounding; under the Triton kernel
    to its bias corrections' float32 rounding (accuracy.py)."""
    return tolerance(torch.float32, "adam_trajectory_triton" if backend == "triton" else "default")


def _assert_same_params(a, b, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach().double(), msg=lambda m: f"{name}: {m}", **tol)


TRAJECTORY_CASES = {
    "adamw": (torch.optim.AdamW, ChunkedAdamW, dict(lr=1e-2), {}),
    "adam-l2": (torch.optim.Adam, ChunkedAdam, dict(lr=1e-2, weight_decay=0.05), {}),
    "amsgrad": (torch.optim.AdamW, ChunkedAdamW, dict(lr=1e-2, amsgrad=True), {}),
    "maximize": (torch.optim.AdamW, ChunkedAdamW, dict(lr=1e-2, maximize=True), dict(sign=-1.0)),
    "no-grad-steps": (torch.optim.AdamW, ChunkedAdamW, dict(lr=1e-2, weight_decay=0.1), dict(spare_every=3)),
    "clip-zero-grad-keep": (torch.optim.Adam, ChunkedAdam, dict(lr=1e-2), dict(clip=0.5, set_to_none=False)),
}


@pytest.mark.parametrize("case", list(TRAJECTORY_CASES))
def test_trajectory_matches_torch(adam_device, case):
    backend, device = adam_device
    torch_class, our_class, kwargs, train = TRAJECTORY_CASES[case]
    steps = 100 if backend != "triton" or device.type == "cuda" else 15  # the interpreter is slow
    expected, actual = _net().to(device), _net().to(device)
    _train(expected, torch_class(expected.parameters(), **kwargs), steps, **train)
    # chunk_size 300: the net is split over several chunks, one parameter larger than a chunk
    _train(actual, our_class(actual.parameters(), chunk_size=300, **kwargs), steps, **train)
    _assert_same_params(actual, expected, **_trajectory_tolerance(backend))


def test_param_groups_and_scheduler_match_torch(adam_device):
    backend, device = adam_device
    steps = 100 if backend != "triton" or device.type == "cuda" else 12

    def groups(model):
        return [dict(params=model.body.parameters(), lr=3e-3, betas=(0.8, 0.99), weight_decay=0.2),
                dict(params=model.head.parameters(), eps=1e-6, amsgrad=True),
                dict(params=model.spare.parameters(), maximize=False, weight_decay=0.0)]

    expected, actual = _net().to(device), _net().to(device)
    for model, cls in ((expected, torch.optim.AdamW), (actual, ChunkedAdamW)):
        optimizer = cls(groups(model), lr=1e-2, **({} if cls is torch.optim.AdamW else {"chunk_size": 64}))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[3e-2, 1e-2, 5e-3], total_steps=steps)
        _train(model, optimizer, steps, scheduler=scheduler, spare_every=2)
    _assert_same_params(actual, expected, **_trajectory_tolerance(backend))


def _edit_groups(optimizer, params, edit):
    groups = optimizer.param_groups
    if edit == "remove-a-param":
        groups[0]["params"].pop(0)
    elif edit == "move-a-param-to-another-lr":
        groups[1]["params"].append(groups[0]["params"].pop(1))
    elif edit == "pop-a-group":
        groups.pop(0)
    elif edit == "replace-a-param-in-place":
        groups[1]["params"][0] = params[0]
        groups[0]["params"].pop(0)
    elif edit == "add-a-group":
        optimizer.add_param_group({"params": [params[4]], "lr": 0.05})


@pytest.mark.parametrize("edit", ["remove-a-param", "move-a-param-to-another-lr", "pop-a-group",
                                  "replace-a-param-in-place", "add-a-group", "remove-then-rejoin"])
def test_param_group_edits_after_steps_match_torch(edit):
    """Editing param_groups between steps (a parameter removed from its
    group's list, moved to another group, a group popped): torch keeps state
    by parameter and steps whatever the groups hold now; a parameter in no
    group is not updated and keeps its state."""
    results = []
    for cls in (torch.optim.AdamW, ChunkedAdamW):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(3, 5), (7,), (4, 2, 3), (300,), (6,)]]
        optimizer = cls([{"params": params[:2]}, {"params": params[2:4], "lr": 0.1}], lr=0.01)
        generator = torch.Generator().manual_seed(1)
        for step in range(7):
            if step == 3:
                _edit_groups(optimizer, params, "remove-a-param" if edit == "remove-then-rejoin" else edit)
            if step == 5 and edit == "remove-then-rejoin":
                optimizer.param_groups[1]["params"].append(params[0])
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
        results.append((params, {i: {key: value.clone() for key, value in optimizer.state[p].items()}
                                 for i, p in enumerate(params) if p in optimizer.state}))
    (expected, expected_state), (actual, actual_state) = results
    for p, q in zip(actual, expected):
        assert_close(p, q, torch.float32)
    assert actual_state.keys() == expected_state.keys()
    for index, entry in expected_state.items():
        for key, value in entry.items():
            assert_close(actual_state[index][key], value, torch.float32)


def test_param_group_edits_keep_8bit_states_of_removed_params_exactly():
    """8-bit states of a parameter taken out of every group are kept (in
    torch's layout) and re-encoded when it rejoins: the same codes as a run
    in which the parameter just got no gradient meanwhile."""
    runs = []
    for removed in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(3, 5), (7,), (300,)]]
        optimizer = ChunkedAdamW(params, lr=0.01, state_dtype="8bit")
        generator = torch.Generator().manual_seed(1)
        for step in range(6):
            if removed and step == 2:
                optimizer.param_groups[0]["params"].pop(1)
            if removed and step == 4:
                optimizer.param_groups[0]["params"].insert(1, params[1])
            for index, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=generator)
                if not removed and index == 1 and step in (2, 3):
                    p.grad = None
            optimizer.step()
        runs.append((params, optimizer.state_dict()["state"]))
    (params, saved), (twins, expected) = runs
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
    for index, entry in expected.items():
        for key, value in entry.items():
            assert torch.equal(saved[index][key], value), (index, key)


def test_param_group_edits_that_list_a_param_twice_are_a_clear_error():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    optimizer = ChunkedAdamW([{"params": [params[0]]}, {"params": [params[1]]}])
    for p in params:
        p.grad = torch.randn(3)
    optimizer.step()
    optimizer.param_groups[1]["params"].append(params[0])
    with pytest.raises(ValueError, match="parameter 1 of param group 1 is the same tensor as parameter 0 of param "
                                         "group 0"):
        optimizer.step()
    optimizer.param_groups[1]["params"].pop()
    optimizer.param_groups[0]["params"].pop()
    optimizer.step()  # params[0] in no group: kept, but state_dict cannot number it (as in torch)
    with pytest.raises(KeyError, match="in no param group"):
        optimizer.state_dict()


def test_bf16_states_track_fp32_within_documented_tolerance():
    expected, actual = _net(), _net()
    _train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2), 100)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, state_dtype=torch.bfloat16)
    _train(actual, optimizer, 100)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in optimizer.state.values())
    bounds = TRAJECTORY_BOUNDS[torch.bfloat16]
    _assert_same_params(actual, expected, rtol=0, atol=bounds["atol"])
    for p, q in zip(actual.parameters(), expected.parameters()):
        assert ((p - q).norm() / q.norm()).item() <= bounds["rel_l2"]
    worst = max((p - q).abs().max().item() for p, q in zip(actual.parameters(), expected.parameters()))
    assert worst > 1e-5  # bf16 rounding is really in play


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_with_master_follow_fp32(param_dtype):
    """Same gradients fed to an fp32 torch AdamW and to bf16/fp16 parameters
    with fp32 masters: the masters follow torch's fp32 parameters tightly,
    the parameters are the masters rounded."""
    torch.manual_seed(0)
    start = [torch.randn(13, 7).to(param_dtype), torch.randn(301).to(param_dtype)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.float()) for t in start]
    optimizer = ChunkedAdamW(ours, lr=1e-2, chunk_size=128)
    reference = torch.optim.AdamW(theirs, lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    for _ in range(30):
        grads = [torch.randn(p.shape, generator=generator).to(param_dtype) for p in ours]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.float()
        optimizer.step()
        reference.step()
    for p, q in zip(ours, theirs):
        master = optimizer.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert_close(master, q.detach(), torch.float32)
        assert torch.equal(p.detach(), master.to(param_dtype))


def test_low_precision_params_grad_scaler_skip_and_master_round_trip():
    """bf16 parameters, fp32 masters, GradScaler: an overflow step changes
    nothing; a reloaded optimizer continues from the saved masters (not from
    the rounded parameters)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(9, 5).to(torch.bfloat16)), torch.nn.Parameter(torch.randn(40).bfloat16())]
    optimizer = ChunkedAdamW(params, lr=1e-2, chunk_size=32)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    generator = torch.Generator().manual_seed(2)

    def step(overflow=False):
        optimizer.zero_grad()
        loss = sum((p.float() * torch.randn(p.shape, generator=generator)).sum() for p in params)
        scaler.scale(loss * (float("inf") if overflow else 1.0)).backward()
        scaler.step(optimizer)
        scaler.update()

    for _ in range(3):
        step()
    saved = copy.deepcopy(optimizer.state_dict())
    before = [p.detach().clone() for p in params]
    step(overflow=True)
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    after = optimizer.state_dict()["state"]
    for index, entry in saved["state"].items():
        assert float(after[index]["step"]) == float(entry["step"]) == 3.0
        assert torch.equal(after[index]["master_param"], entry["master_param"])
        assert not torch.equal(entry["master_param"], params[index].detach().float())  # masters carry more bits

    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reloaded = ChunkedAdamW(twin, lr=1e-2, chunk_size=1000)
    reloaded.load_state_dict(copy.deepcopy(saved))
    for index, entry in reloaded.state_dict()["state"].items():
        assert torch.equal(entry["master_param"], saved["state"][index]["master_param"])


# -- state dicts ----------------------------------------------------------------

def test_state_dict_has_torch_layout_and_loads_into_torch_and_back():
    torch_model, our_model = _net(), _net()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, amsgrad=True)
    our_opt = ChunkedAdamW(our_model.parameters(), lr=1e-2, amsgrad=True, chunk_size=200)
    _train(torch_model, torch_opt, 10, spare_every=3)
    _train(our_model, our_opt, 10, spare_every=3)
    ours, theirs = our_opt.state_dict(), torch_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert ours["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert ours["state"][index][key].shape == value.shape and ours["state"][index][key].dtype == value.dtype
            assert_close(ours["state"][index][key], value, torch.float32)

    # ours -> torch, torch -> ours (different chunk size), continue both
    next_torch_model, next_our_model = copy.deepcopy(our_model), copy.deepcopy(torch_model)
    next_torch_opt = torch.optim.AdamW(next_torch_model.parameters())
    next_torch_opt.load_state_dict(copy.deepcopy(ours))
    next_our_opt = ChunkedAdamW(next_our_model.parameters(), chunk_size=57)
    next_our_opt.load_state_dict(copy.deepcopy(theirs))
    assert next_our_opt.param_groups[0]["amsgrad"] and next_our_opt.param_groups[0]["lr"] == 1e-2
    _train(next_torch_model, next_torch_opt, 10, spare_every=3, seed=5)
    _train(next_our_model, next_our_opt, 10, spare_every=3, seed=5)
    _train(torch_model, torch_opt, 10, spare_every=3, seed=5)
    _assert_same_params(next_torch_model, torch_model, rtol=1e-4, atol=1e-5)
    _assert_same_params(next_our_model, torch_model, **tolerance(torch.float32))


def test_state_dict_round_trip_across_chunk_sizes_and_bf16_dtype_kept():
    model = _net()
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16, chunk_size=100)
    _train(model, optimizer, 5, spare_every=2)
    saved = copy.deepcopy(optimizer.state_dict())
    twin = copy.deepcopy(model)
    loaded = ChunkedAdamW(twin.parameters(), state_dtype=torch.bfloat16, chunk_size=10_000)
    loaded.load_state_dict(saved)
    assert len(loaded.chunk_layout()) == 1 and len(optimizer.chunk_layout()) > 1
    again = loaded.state_dict()
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            assert again["state"][index][key].dtype == value.dtype
            assert torch.equal(again["state"][index][key], value), (index, key)
    _train(model, optimizer, 5, spare_every=2, seed=9)
    _train(twin, loaded, 5, spare_every=2, seed=9)
    _assert_same_params(twin, model, rtol=0, atol=0)

    # an fp32 torch checkpoint loaded with bf16 states is rounded to bf16
    fp32_model = _net()
    fp32_opt = torch.optim.AdamW(fp32_model.parameters(), lr=1e-2)
    _train(fp32_model, fp32_opt, 3)
    into_bf16 = ChunkedAdamW(fp32_model.parameters(), state_dtype=torch.bfloat16)
    into_bf16.load_state_dict(fp32_opt.state_dict())
    theirs = fp32_opt.state_dict()["state"]
    for index, entry in into_bf16.state_dict()["state"].items():
        assert entry["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(entry["exp_avg"], theirs[index]["exp_avg"].to(torch.bfloat16))


HOOK_CASES = [(torch.optim.AdamW, {}), (ChunkedAdamW, {}), (ChunkedAdamW, dict(state_dtype="8bit"))]


def _stepped_once(optimizer_class, kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = optimizer_class(params, lr=0.01, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("optimizer_class,kwargs", HOOK_CASES, ids=["torch", "chunked", "chunked-8bit"])
def test_load_state_dict_runs_the_load_hooks_like_torch(optimizer_class, kwargs):
    """register_load_state_dict_pre_hook / _post_hook: the pre hook gets a
    shallow copy before anything is read and may return the state dict to
    load; the post hook runs after loading (torch.optim.Optimizer's order)."""
    params, optimizer = _stepped_once(optimizer_class, kwargs)
    saved = optimizer.state_dict()
    calls = []

    def pre_hook(opt, state_dict):
        calls.append(("pre", state_dict is not saved))
        edited = copy.deepcopy(state_dict)
        edited["param_groups"][0]["lr"] = 0.5
        edited["state"][1]["step"] = torch.tensor(7.0)
        return edited

    def post_hook(opt):
        calls.append(("post", opt.param_groups[0]["lr"], float(opt.state[params[1]]["step"])))

    optimizer.register_load_state_dict_pre_hook(pre_hook)
    optimizer.register_load_state_dict_post_hook(post_hook)
    optimizer.load_state_dict(saved)
    assert calls == [("pre", True), ("post", 0.5, 7.0)]
    assert saved["param_groups"][0]["lr"] == 0.01 and float(optimizer.state[params[0]]["step"]) == 1.0


@pytest.mark.parametrize("optimizer_class,kwargs", HOOK_CASES, ids=["torch", "chunked", "chunked-8bit"])
def test_state_dict_hooks_see_and_edit_torch_layout(optimizer_class, kwargs):
    """register_state_dict_pre_hook runs before the state is read (its
    writes are exported); a post hook sees torch's layout (8-bit states
    decoded) and its edits, or the dict it returns, are what state_dict()
    returns."""
    params, optimizer = _stepped_once(optimizer_class, kwargs)
    seen = {}

    def pre_hook(opt):
        opt.state[params[1]]["step"] = torch.tensor(4.0)

    def post_hook(opt, state_dict):
        seen["keys"] = sorted(state_dict["state"][0])
        state_dict["state"] = {index: {key: value if key == "step" else value.to(torch.bfloat16)
                                       for key, value in entry.items()}
                               for index, entry in state_dict["state"].items()}

    optimizer.register_state_dict_pre_hook(pre_hook)
    optimizer.register_state_dict_post_hook(post_hook)
    saved = optimizer.state_dict()
    assert seen["keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert float(saved["state"][1]["step"]) == 4.0
    optimizer.register_state_dict_post_hook(lambda opt, state_dict: {"replaced": True})
    assert optimizer.state_dict() == {"replaced": True}


def test_skipped_parameters_keep_their_own_step_counts():
    model = _net()
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 7, spare_every=3)  # spare gets gradients at steps 0, 3, 6
    state = optimizer.state_dict()["state"]
    steps = [float(entry["step"]) for entry in state.values()]
    assert steps == [7.0] * 6 + [3.0, 3.0]


# -- AMP ----------------------------------------------------------------------

def test_grad_scaler_overflow_step_changes_nothing_and_later_steps_match_torch():
    torch_model, our_model = _net(), _net()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    our_opt = ChunkedAdamW(our_model.parameters(), lr=1e-2, chunk_size=300)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    _train(our_model, our_opt, 2)
    _train(torch_model, torch_opt, 2)
    before = copy.deepcopy(our_opt.state_dict())
    params_before = [p.detach().clone() for p in our_model.parameters()]
    generator = torch.Generator().manual_seed(4)
    for step in range(6):
        x, y = torch.randn(16, 7, generator=generator), torch.randn(16, 5, generator=generator)
        for model, optimizer, scaler in ((torch_model, torch_opt, scalers[0]), (our_model, our_opt, scalers[1])):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 0:
                loss = loss * float("inf")  # overflow: the step must be skipped
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        if step == 0:
            assert all(torch.equal(p, q) for p, q in zip(our_model.parameters(), params_before))
            after = our_opt.state_dict()
            for index, entry in before["state"].items():
                for key, value in entry.items():
                    assert torch.equal(after["state"][index][key], value), (index, key)
            assert scalers[1].get_scale() == 2.0 ** 9
    _assert_same_params(our_model, torch_model, **tolerance(torch.float32))


@pytest.mark.parametrize("options", [{}, dict(state_dtype="8bit"), dict(offload="cpu", staged=True)],
                         ids=["fp32", "8bit", "offload-staged"])
def test_found_inf_above_one_skips_without_lowering_step_counts(options):
    """GradScaler sums found_inf over devices, so a skipped step may hand the
    optimizer found_inf = 2: nothing may change, step counts included."""
    options = dict(options)
    staged = options.pop("staged", False)
    model = _net()
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, chunk_size=300, **options)
    optimizer._force_staging = staged
    _train(model, optimizer, 3)
    before = copy.deepcopy(optimizer.state_dict())
    params_before = [p.detach().clone() for p in model.parameters()]
    torch.nn.functional.mse_loss(model(torch.randn(4, 7)), torch.randn(4, 5)).backward()
    optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.0), torch.tensor(2.0)
    optimizer.step()
    del optimizer.grad_scale, optimizer.found_inf
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
    after = optimizer.state_dict()["state"]
    for index, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after[index][key], value), (index, key)


# -- offload ------------------------------------------------------------------

@pytest.mark.parametrize("staged", [False, True], ids=["cpu-params", "staging-pipeline"])
def test_offload_cpu_matches_torch(staged):
    """offload="cpu": with CPU parameters the ordinary path; `staged` runs the
    CUDA pipeline's code (staging buffers, chunk-by-chunk download, CPU
    kernel, upload) with the streams replaced by synchronous copies."""
    expected, actual = _net(), _net()
    _train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2, amsgrad=True), 30, spare_every=4)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, amsgrad=True, offload="cpu", chunk_size=256)
    optimizer._force_staging = staged
    _train(actual, optimizer, 30, spare_every=4)
    _assert_same_params(actual, expected, **tolerance(torch.float32))
    assert all(entry["state_device"] == "cpu" for entry in optimizer.chunk_layout())


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_offload_cuda_keeps_no_state_on_gpu_and_matches_torch(param_dtype):
    expected, actual = _net().cuda(), _net().to("cuda", param_dtype)
    _train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2), 20)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, offload="cpu", chunk_size=256)
    _train(actual, optimizer, 20)
    for entry in optimizer.state.values():
        assert all(t.device.type == "cpu" for t in entry.values())
    tol = tolerance(torch.float32) if param_dtype == torch.float32 else dict(rtol=0, atol=5e-2)
    _assert_same_params(actual, expected, **tol)


# -- chunks ---------------------------------------------------------------------

def test_chunks_follow_first_use_and_size():
    model = _net()
    optimizer = ChunkedAdamW(model.parameters(), chunk_size=300)
    _train(model, optimizer, 1)  # spare gets no gradient in the first step
    layout = optimizer.chunk_layout()
    sizes = [p.numel() for p in list(model.parameters())[:6]]
    assert sum(entry["numel"] for entry in layout) == sum(sizes)
    assert all(entry["numel"] <= 300 or entry["params"] == 1 for entry in layout)
    _train(model, optimizer, 1, spare_every=1)
    assert optimizer.chunk_layout()[-1]["numel"] == sum(p.numel() for p in model.spare.parameters())


# -- errors -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(lr=-1.0), ValueError, "lr must be a float >= 0"),
    (dict(betas=(1.0, 0.999)), ValueError, "betas\\[0\\] must be in \\[0, 1\\)"),
    (dict(betas=(0.9, -0.1)), ValueError, "betas\\[1\\] must be in \\[0, 1\\)"),
    (dict(eps=-1e-8), ValueError, "eps must be >= 0"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
    (dict(state_dtype=torch.float16), TypeError, "state_dtype must be torch.float32, torch.bfloat16 or '8bit'"),
    (dict(offload="disk"), ValueError, "offload must be None or 'cpu'"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(differentiable=True), ValueError, "differentiable=True is not supported"),
])
def test_invalid_hyperparameters_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        ChunkedAdamW(_net().parameters(), **kwargs)


def test_invalid_group_hyperparameters_are_named():
    model = _net()
    with pytest.raises(ValueError, match="betas\\[1\\] must be in"):
        ChunkedAdamW([dict(params=model.head.parameters(), betas=(0.9, 1.5))])


@pytest.mark.parametrize("named", [False, True], ids=["tensors", "named-tensors"])
def test_complex_and_non_dense_parameters_are_rejected(named):
    """Also when given as named parameters, [("w", p)] (torch 2.x)."""
    def listed(p):
        return [("w", p)] if named else [p]

    with pytest.raises(TypeError, match="does not support complex parameters"):
        ChunkedAdam(listed(torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))))
    with pytest.raises(TypeError, match="parameters must be floating point"):
        ChunkedAdam(listed(torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="parameters must be dense"):
        ChunkedAdam(listed(torch.nn.Parameter(torch.randn(4, 6)[:, ::2])))
    optimizer = ChunkedAdam(listed(torch.nn.Parameter(torch.randn(3))))
    assert ("param_names" in optimizer.param_groups[0]) is named


def test_a_parameter_listed_twice_is_a_clear_error():
    """torch.optim warns (deprecated) and steps one shared state twice per
    step; ChunkedAdam raises the error torch announces, naming both places."""
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch.optim.AdamW([p, q, p])
    with pytest.raises(ValueError, match="parameter 2 of param group 0 is the same tensor as parameter 0"):
        ChunkedAdamW([p, q, p])
    optimizer = ChunkedAdamW([p])
    with pytest.raises(ValueError, match="parameter 1 of param group 1 is the same tensor as parameter 0"):
        optimizer.add_param_group({"params": [("a", q), ("b", q)]})
    assert len(optimizer.param_groups) == 1


def test_a_set_of_parameters_in_a_group_is_rejected_like_torch():
    """torch rejects a set (its order changes between runs, and state dicts
    number parameters by position); list() must not hide it first."""
    params = {torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))}
    with pytest.raises(TypeError, match="ordered collections"):
        torch.optim.AdamW([{"params": params}])
    with pytest.raises(TypeError, match="params must be an ordered collection .* not a set"):
        ChunkedAdamW([{"params": params}])


def test_channels_last_parameters_match_torch(adam_device):
    """Dense non-contiguous parameters (a channels_last conv, a transposed
    matrix) are updated in place in their own memory order; their states and
    state-dict entries keep the parameter's strides."""
    backend, device = adam_device
    steps = 30 if backend != "triton" or device.type == "cuda" else 8

    def make():
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 8, 3).to(device, memory_format=torch.channels_last)
        matrix = torch.nn.Parameter(torch.randn(6, 5, device=device).t())  # dense, strides (1, 5)
        return conv, matrix

    results = []
    for cls in (torch.optim.AdamW, ChunkedAdamW):
        conv, matrix = make()
        kwargs = {} if cls is torch.optim.AdamW else {"chunk_size": 100}
        optimizer = cls([*conv.parameters(), matrix], lr=1e-2, amsgrad=True, **kwargs)
        generator = torch.Generator().manual_seed(5)
        for _ in range(steps):
            x = torch.randn(2, 3, 6, 6, generator=generator).to(device).contiguous(memory_format=torch.channels_last)
            optimizer.zero_grad()
            (conv(x).square().mean() + (matrix @ torch.randn(6, 2, generator=generator).to(device)).square().mean()
             ).backward()
            optimizer.step()
        results.append((conv, matrix, optimizer))
    (conv_t, matrix_t, _), (conv_o, matrix_o, optimizer) = results
    assert conv_o.weight.is_contiguous(memory_format=torch.channels_last) and matrix_o.stride() == (1, 5)
    tol = _trajectory_tolerance(backend)
    for p, q in ((conv_o.weight, conv_t.weight), (conv_o.bias, conv_t.bias), (matrix_o, matrix_t)):
        torch.testing.assert_close(p, q, **tol)
    state = optimizer.state[conv_o.weight]
    assert state["exp_avg"].stride() == conv_o.weight.stride()


def test_sparse_gradients_are_rejected():
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = ChunkedAdamW(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        optimizer.step()


# -- ZeroRedundancyOptimizer ----------------------------------------------------

def _zero_worker(rank, world, init_file, result_file):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _net()
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=ChunkedAdamW, lr=1e-2,
                                            chunk_size=300)
        generator = torch.Generator().manual_seed(1)
        for _ in range(10):
            x, y = torch.randn(16, 7, generator=generator), torch.randn(16, 5, generator=generator)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()  # same data on both ranks: no all-reduce needed
            optimizer.step()
        optimizer.consolidate_state_dict(to=0)
        state = optimizer.state_dict() if rank == 0 else None
        torch.save({"params": [p.detach() for p in model.parameters()], "state": state}, f"{result_file}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero_redundancy_optimizer_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    activate_backend("adam_step", "cpp", "cpu").__exit__(None, None, None)  # build once, before the workers
    result_file = tmp_path / "result"
    mp.start_processes(_zero_worker, args=(2, str(tmp_path / "init"), str(result_file)), nprocs=2, join=True,
                       start_method="spawn")
    results = [torch.load(f"{result_file}.{rank}") for rank in range(2)]
    expected = _net()
    _train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2), 10)
    for result in results:
        for p, q in zip(result["params"], expected.parameters()):
            assert_close(p, q.detach(), torch.float32)
    state = results[0]["state"]
    assert sorted(state["state"]) == list(range(6))  # spare never gets a gradient here
    assert all(float(entry["step"]) == 10.0 for entry in state["state"].values())


@pytest.mark.gpu
def test_cuda_trajectory_matches_torch_fused():
    expected, actual = _net().cuda(), _net().cuda()
    _train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2, fused=True), 100)
    _train(actual, ChunkedAdamW(actual.parameters(), lr=1e-2, chunk_size=300), 100)
    _assert_same_params(actual, expected, **tolerance(torch.float32, "adam_trajectory_triton"))


def test_optimizer_is_exported():
    assert effilayers.optim.ChunkedAdamW is ChunkedAdamW
    assert "adam_step" in effilayers.backends.registered_ops()


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
    context = activate_backend("adam_step", "triton", "cuda")
    try:
        adam_step_([param], [grad], exp_avg, exp_avg_sq, None, None, step, None, None, hyper=hyper)
    finally:
        context.__exit__(None, None, None)
    for name, part in ends.items():
        for actual, wanted in zip((param[part], exp_avg[part], exp_avg_sq[part]), expected[name]):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7, msg=name)


# -- state written from outside the optimizer -------------------------------------

def _zero_run(optimizer_class, model, steps, seed, state_dict=None, **kwargs):
    """ZeroRedundancyOptimizer(optimizer_class) on one gloo rank: optionally
    load `state_dict`, train `steps`, return the consolidated state dict."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=1e-2, **kwargs)
    if state_dict is not None:
        optimizer.load_state_dict(state_dict)
    _train(model, optimizer, steps, seed=seed)
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict()


@pytest.mark.parametrize("optimizer_class,kwargs", [(torch.optim.AdamW, {}), (ChunkedAdamW, dict(chunk_size=300))],
                         ids=["torch-AdamW", "ChunkedAdamW"])
def test_zero_redundancy_optimizer_load_state_dict_continues_the_run(tmp_path, optimizer_class, kwargs):
    """ZeroRedundancyOptimizer.load_state_dict assigns `optim.state[p] = {...}`
    directly: the entries must reach the chunks (before, the steps restarted
    from 1 on fresh states). One gloo rank in this process is enough."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        model = _net()
        saved = _zero_run(optimizer_class, model, 4, seed=1, **kwargs)
        resumed = copy.deepcopy(model)
        resumed_state = _zero_run(optimizer_class, resumed, 4, seed=2, state_dict=copy.deepcopy(saved), **kwargs)
        _zero_run(optimizer_class, model, 4, seed=2, state_dict=copy.deepcopy(saved), **kwargs)
    finally:
        dist.destroy_process_group()
    expected = _net()
    reference = torch.optim.AdamW(expected.parameters(), lr=1e-2)
    _train(expected, reference, 4, seed=1)
    _train(expected, reference, 4, seed=2)
    _assert_same_params(resumed, expected, **tolerance(torch.float32))
    _assert_same_params(model, expected, **tolerance(torch.float32))
    assert all(float(entry["step"]) == 8.0 for entry in resumed_state["state"].values())


def test_direct_assignment_into_state_reaches_the_chunks():
    """`optimizer.state[p] = entry`, `del optimizer.state[p]` and writes into an
    entry take effect at the next step, as with torch.optim.AdamW."""
    torch_model, our_model = _net(), _net()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    our_opt = ChunkedAdamW(our_model.parameters(), lr=1e-2, chunk_size=300)
    _train(torch_model, torch_opt, 3)
    _train(our_model, our_opt, 1)  # chunks exist; their states are about to be replaced
    params = list(our_model.parameters())
    for p, q in zip(params, torch_model.parameters()):
        our_opt.state[p] = copy.deepcopy(torch_opt.state[q])
    torch.testing.assert_close(our_opt.state[params[0]]["exp_avg"], torch_opt.state_dict()["state"][0]["exp_avg"])
    with torch.no_grad():
        for p, q in zip(params, torch_model.parameters()):
            p.copy_(q)
    # a write into an entry, and a deleted entry (fresh state at the next step, like torch)
    our_opt.state[params[1]]["step"] = torch.tensor(7.0)
    torch_opt.state[list(torch_model.parameters())[1]]["step"] = torch.tensor(7.0)
    del our_opt.state[params[2]]
    del torch_opt.state[list(torch_model.parameters())[2]]
    _train(torch_model, torch_opt, 4, seed=3)
    _train(our_model, our_opt, 4, seed=3)
    _assert_same_params(our_model, torch_model, **tolerance(torch.float32))
    steps = {index: float(entry["step"]) for index, entry in our_opt.state_dict()["state"].items() if entry}
    assert [steps[index] for index in range(4)] == [7.0, 11.0, 4.0, 7.0]


def test_parameter_changes_between_steps_reach_the_master_weights():
    """bf16 parameters with fp32 masters, fed the same gradients as fp32
    torch.optim.AdamW parameters: values written into the parameters between
    steps (copy_, fill_) are what the next step starts from, in both."""
    torch.manual_seed(0)
    start = [torch.randn(13, 7).bfloat16(), torch.randn(301).bfloat16(), torch.randn(40).bfloat16()]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.float()) for t in start]
    optimizer = ChunkedAdamW(ours, lr=1e-2, chunk_size=128)
    reference = torch.optim.AdamW(theirs, lr=1e-2)
    generator = torch.Generator().manual_seed(3)

    def train(steps):
        for _ in range(steps):
            for p, q in zip(ours, theirs):
                g = torch.randn(p.shape, generator=generator).bfloat16()
                p.grad, q.grad = g, g.float()
            optimizer.step()
            reference.step()

    train(10)
    # far from the current values (so no element equals its rounded master)
    values = (torch.rand(13, 7, generator=generator) + 8.0).bfloat16()
    untouched = optimizer.state[ours[2]]["master_param"].clone()
    with torch.no_grad():
        ours[0].copy_(values)
        theirs[0].copy_(values.float())
        ours[1].fill_(5.0)
        theirs[1].fill_(5.0)
        ours[2].copy_(ours[2].clone())  # same values: the master keeps its extra bits
    train(1)
    assert not torch.equal(optimizer.state[ours[2]]["master_param"], untouched)
    train(9)
    for p, q in zip(ours, theirs):
        master = optimizer.state[p]["master_param"]
        assert_close(master, q.detach(), torch.float32)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


def test_parameter_changes_between_steps_reach_the_offload_copy():
    """offload='cpu' keeps its own copy of the parameters (here through the
    staging pipeline on CPU parameters): model.load_state_dict() and clamp_()
    between steps must not be reverted by the next step."""
    expected, actual = _net(), _net()
    initial = copy.deepcopy(expected.state_dict())
    reference = torch.optim.AdamW(expected.parameters(), lr=1e-2)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, offload="cpu", chunk_size=256)
    optimizer._force_staging = True
    for model, opt in ((expected, reference), (actual, optimizer)):
        _train(model, opt, 3)
        model.load_state_dict(initial)
        with torch.no_grad():
            model.head.weight.clamp_(-0.05, 0.05)
        _train(model, opt, 3, seed=4)
    _assert_same_params(actual, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("options", [dict(amsgrad=True), dict(state_dtype=torch.bfloat16), dict(state_dtype="8bit"),
                                     dict(param_dtype=torch.bfloat16)],
                         ids=["fp32-amsgrad", "bf16-states", "8bit-states", "bf16-params-fp32-masters"])
def test_deepcopied_or_pickled_optimizer_continues_identically(how, options):
    import io

    options = dict(options)
    model = _net(options.pop("param_dtype", torch.float32))
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, chunk_size=300, **options)
    _train(model, optimizer, 4, spare_every=3)
    if how == "deepcopy":
        twin_model, twin_opt = copy.deepcopy((model, optimizer))
    else:
        buffer = io.BytesIO()
        torch.save((model, optimizer), buffer)
        buffer.seek(0)
        twin_model, twin_opt = torch.load(buffer, weights_only=False)
    assert twin_opt.param_groups[0]["params"][0] is next(twin_model.parameters())
    _train(model, optimizer, 4, spare_every=3, seed=6)
    _train(twin_model, twin_opt, 4, spare_every=3, seed=6)
    _assert_same_params(twin_model, model, rtol=0, atol=0)
    ours, theirs = twin_opt.state_dict()["state"], optimizer.state_dict()["state"]
    for index, entry in theirs.items():
        for key, value in entry.items():
            assert torch.equal(ours[index][key], value), (index, key)


@pytest.mark.parametrize("part", ["all-params", "some-params-of-a-chunk"])
def test_parameter_dtype_change_after_steps_moves_the_states(part):
    """model.to(torch.bfloat16) after some steps (all parameters, or part of a
    chunk): the states move to chunks of the new dtype, bf16 parameters get
    fp32 masters seeded from their values, and the run continues like a
    fresh optimizer loaded with the state dict."""
    torch.manual_seed(0)
    first = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(13, 7))])
    second = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(301)), torch.nn.Parameter(torch.randn(40))])
    params = [*first, *second]
    optimizer = ChunkedAdamW(params, lr=1e-2, chunk_size=1000)  # one chunk holds all three
    generator = torch.Generator().manual_seed(5)

    def step(opt, targets, count):
        for _ in range(count):
            for p in targets:
                p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
            opt.step()

    step(optimizer, params, 3)
    saved = copy.deepcopy(optimizer.state_dict())
    (torch.nn.ModuleList([first, second]) if part == "all-params" else second).to(torch.bfloat16)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = ChunkedAdamW(twin, lr=1e-2, chunk_size=1000)
    twin_opt.load_state_dict(saved)
    generator_state = generator.get_state()
    step(optimizer, params, 4)
    generator.set_state(generator_state)
    step(twin_opt, twin, 4)
    for p, q in zip(params, twin):
        assert p.dtype == q.dtype
        assert torch.equal(p, q)
        if p.dtype == torch.bfloat16:
            assert optimizer.state[p]["master_param"].dtype == torch.float32
            assert torch.equal(p.detach(), optimizer.state[p]["master_param"].to(torch.bfloat16))
    assert all(float(entry["step"]) == 7.0 for entry in optimizer.state_dict()["state"].values())


@pytest.mark.gpu
def test_parameters_moved_to_cuda_after_steps_move_the_states():
    """model.cuda() after some CPU steps: the states follow the parameters to
    the GPU, and the run continues like a CUDA optimizer loaded with the
    state dict."""
    model = _net()
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, chunk_size=300)
    _train(model, optimizer, 3)
    saved = copy.deepcopy(optimizer.state_dict())
    model.cuda()
    twin = copy.deepcopy(model)
    twin_opt = ChunkedAdamW(twin.parameters(), lr=1e-2, chunk_size=300)
    twin_opt.load_state_dict(saved)
    _train(model, optimizer, 3, seed=8)
    _train(twin, twin_opt, 3, seed=8)
    _assert_same_params(model, twin, rtol=0, atol=0)
    assert all(entry["state_device"].startswith("cuda") for entry in optimizer.chunk_layout())
    assert all(float(entry["step"]) == 6.0 for entry in optimizer.state_dict()["state"].values())


def test_parameter_dtype_change_to_complex_is_a_clear_error():
    params = [torch.nn.Parameter(torch.randn(5))]
    optimizer = ChunkedAdamW(params)
    params[0].grad = torch.randn(5)
    optimizer.step()
    params[0].data = params[0].data.to(torch.complex64)
    params[0].grad = torch.randn(5, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"parameter 0 of param group 0 is now torch.complex64.*ChunkedAdamW supports"):
        optimizer.step()


def test_step_bumps_parameter_versions_like_torch():
    """The kernel writes the parameters in place: autograd must see it, so a
    backward through a graph that saved a parameter fails like with torch."""
    param = torch.nn.Parameter(torch.randn(5))
    optimizer = ChunkedAdamW([param])
    loss = (param * param).sum()
    param.grad = torch.randn(5)
    optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# -- writes from outside meeting syncs, exports and layout changes -------------

def _sync_trigger(trigger, params, optimizer, twins, reference):
    """Something that makes the optimizer sync or export its state, done to
    (params, optimizer) and, where torch has an equivalent, to the torch
    reference; returns the (params, optimizer) that go on training."""
    import pickle

    if trigger == "delete-another-entry":
        del optimizer.state[params[2]]
        del reference.state[twins[2]]
    elif trigger == "write-another-entry-then-state_dict":
        optimizer.state[params[2]]["step"] = optimizer.state[params[2]]["step"].clone()
        optimizer.state_dict()
    elif trigger == "another-param-to-channels_last":
        for p in (params[2], twins[2]):
            p.data = p.data.contiguous(memory_format=torch.channels_last)  # what module.to(memory_format=) does
    elif trigger == "deepcopy":
        params, optimizer = copy.deepcopy((params, optimizer))
    elif trigger == "pickle":
        params, optimizer = pickle.loads(pickle.dumps((params, optimizer)))
    elif trigger == "state_dict-into-a-fresh-optimizer":
        saved = optimizer.state_dict()
        params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        fresh = ChunkedAdamW(params, lr=1e-2, chunk_size=4096, offload=optimizer.offload)
        fresh._force_staging = optimizer._force_staging
        fresh.load_state_dict(saved)
        optimizer = fresh
    return params, optimizer


@pytest.mark.parametrize("trigger", ["delete-another-entry", "write-another-entry-then-state_dict",
                                     "another-param-to-channels_last", "deepcopy", "pickle",
                                     "state_dict-into-a-fresh-optimizer"])
@pytest.mark.parametrize("copies", ["bf16-fp32-masters", "offload-staging"])
def test_parameter_writes_survive_state_syncs_and_exports(copies, trigger):
    """Chunks that keep their own copy of the parameters (fp32 masters,
    offload): a write into a parameter between steps must reach that copy
    even when the state is synced (because of another parameter's entry),
    exported (state_dict, deepcopy, pickle) or re-chunked before the next
    step. Compared with torch.optim.AdamW on fp32 parameters fed the same
    gradients."""
    dtype = torch.bfloat16 if copies == "bf16-fp32-masters" else torch.float32
    generator = torch.Generator().manual_seed(3)
    start = [torch.randn(shape, generator=generator).to(dtype) for shape in [(13, 7), (301,), (4, 3, 3, 3)]]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    twins = [torch.nn.Parameter(t.float()) for t in start]
    optimizer = ChunkedAdamW(params, lr=1e-2, chunk_size=4096, offload=None if dtype is torch.bfloat16 else "cpu")
    optimizer._force_staging = dtype is torch.float32
    reference = torch.optim.AdamW(twins, lr=1e-2)

    def train(params, optimizer, steps):
        for _ in range(steps):
            for p, q in zip(params, twins):
                g = torch.randn(p.shape, generator=generator).to(dtype)
                p.grad, q.grad = g, g.float()
            optimizer.step()
            reference.step()

    train(params, optimizer, 3)
    with torch.no_grad():
        for p in (params[0], twins[0]):
            p.fill_(5.0)
        for p in (params[1], twins[1]):
            p.clamp_(-0.5, 0.5)
    params, optimizer = _sync_trigger(trigger, params, optimizer, twins, reference)
    train(params, optimizer, 3)
    for index, (p, q) in enumerate(zip(params, twins)):
        if dtype is torch.bfloat16:
            master = optimizer.state[p]["master_param"]
            # a deleted entry restarts from the bf16 parameter (torch's from
            # its fp32 one): the deleted parameter agrees to bf16 rounding
            restarted = index == 2 and trigger == "delete-another-entry"
            torch.testing.assert_close(master, q.detach(), **tolerance(torch.bfloat16 if restarted else torch.float32))
            assert torch.equal(p.detach(), master.to(dtype))
        else:
            assert_close(p.detach(), q.detach(), torch.float32)


def test_turning_amsgrad_on_keeps_a_parameter_write():
    """amsgrad switched on between steps re-installs the chunk's entries: a
    write into a bf16 parameter made before must still reach its master."""
    params = [torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16)) for _ in range(2)]
    optimizer = ChunkedAdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    with torch.no_grad():
        params[0].fill_(5.0)
    optimizer.param_groups[0]["amsgrad"] = True
    optimizer.step()
    # one step of lr 1e-3 from 5.0 (the old values are N(0, 1))
    torch.testing.assert_close(optimizer.state[params[0]]["master_param"], torch.full((8,), 5.0), rtol=0, atol=2e-3)


def test_parameter_storage_swap_reaches_the_master():
    """`p.data = t` (same dtype and layout) bypasses the version counter; the
    new storage address shows it, and the next step starts from t."""
    params = [torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16)) for _ in range(2)]
    optimizer = ChunkedAdamW(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    params[0].data = torch.full((8,), 5.0, dtype=torch.bfloat16)
    optimizer.step()
    torch.testing.assert_close(optimizer.state[params[0]]["master_param"], torch.full((8,), 5.0), rtol=0, atol=2e-3)


@pytest.mark.parametrize("new_tensor", ["same-layout", "channels_last", "float16"])
@pytest.mark.parametrize("export", ["state_dict", "deepcopy", "pickle"])
def test_parameter_storage_swap_reaches_exports_before_the_next_step(export, new_tensor):
    """`p.data = t` between a step and an export (state_dict, deepcopy,
    pickle): the exported master must be t, not the old master. Exports
    compare storage addresses; a t of another memory order or dtype no
    longer fits the chunk and moves the states first."""
    import pickle

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, 3, 3, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))]
    optimizer = ChunkedAdamW(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    exp_avg = optimizer.state[params[0]]["exp_avg"].clone()
    new = torch.full(params[0].shape, 5.0, dtype=torch.bfloat16)
    if new_tensor == "channels_last":
        new = new.contiguous(memory_format=torch.channels_last)
    elif new_tensor == "float16":
        new = new.half()
    params[0].data = new
    if export == "deepcopy":
        optimizer = copy.deepcopy(optimizer)
    elif export == "pickle":
        optimizer = pickle.loads(pickle.dumps(optimizer))
    saved = optimizer.state_dict()["state"][0]
    assert torch.equal(saved["master_param"], torch.full(new.shape, 5.0))
    assert torch.equal(saved["exp_avg"], exp_avg)


def test_pickled_optimizer_is_as_small_as_torch():
    """The entries are views of the chunks, and pickle writes a view's whole
    storage: the optimizer must pickle compact copies instead."""
    import pickle

    sizes = {}
    for cls in (torch.optim.AdamW, ChunkedAdamW):
        params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(100)]
        optimizer = cls(params)
        for p in params:
            p.grad = torch.randn(1000)
        optimizer.step()
        sizes[cls] = len(pickle.dumps(optimizer))
    # parameters, exp_avg and exp_avg_sq: 1.2 MB each way (80 MB as views)
    assert sizes[ChunkedAdamW] <= 1.05 * sizes[torch.optim.AdamW], sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-fp32-masters"])
def test_memory_format_change_after_steps_matches_torch(dtype):
    """model.to(memory_format=torch.channels_last) after some steps re-points
    the conv weight at a copy in another memory order: the states (and the
    fp32 master) must follow into that order, or the kernel pairs each
    element with another one's states."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(dtype)
    twin = torch.nn.Conv2d(3, 4, 3)
    with torch.no_grad():
        for p, q in zip(conv.parameters(), twin.parameters()):
            q.copy_(p)
    optimizer = ChunkedAdamW(conv.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(5)
    for step in range(6):
        if step == 3:
            conv.to(memory_format=torch.channels_last)
            twin.to(memory_format=torch.channels_last)
        for p, q in zip(conv.parameters(), twin.parameters()):
            g = torch.randn(p.shape, generator=generator).to(dtype)
            p.grad, q.grad = g, g.float()
        optimizer.step()
        reference.step()
    weight = conv.weight
    assert weight.is_contiguous(memory_format=torch.channels_last)
    state, expected = optimizer.state[weight], reference.state[twin.weight]
    assert state["exp_avg"].stride() == weight.stride()
    for key in ("exp_avg", "exp_avg_sq"):
        assert_close(state[key], expected[key], torch.float32)
    actual = state["master_param"] if dtype is torch.bfloat16 else weight
    assert_close(actual.detach(), twin.weight.detach(), torch.float32)


def _alongside_torch_adamw():
    """Three fp32 parameters under ChunkedAdamW and their copies under
    torch.optim.AdamW, and ``train(steps)`` feeding both the same gradients."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(7, 5), (13,), (4, 3, 2)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = ChunkedAdamW(params, lr=0.1)
    reference = torch.optim.AdamW(twins, lr=0.1)
    generator = torch.Generator().manual_seed(1)

    def train(steps):
        for _ in range(steps):
            for p, q in zip(params, twins):
                p.grad = torch.randn(p.shape, generator=generator)
                q.grad = p.grad.clone()
            optimizer.step()
            reference.step()

    return params, twins, optimizer, reference, train


def test_in_place_write_to_a_step_counter_takes_effect():
    """`state[p]["step"].zero_()` writes the chunk's counter through the view
    without telling the optimizer: the bias correction must still use the
    new count (the counters' version counter shows the write)."""
    params, twins, optimizer, reference, train = _alongside_torch_adamw()
    train(3)
    optimizer.state[params[1]]["step"].zero_()
    reference.state[twins[1]]["step"].zero_()
    train(2)
    for p, q in zip(params, twins):
        assert_close(p, q, torch.float32)
    assert [float(optimizer.state[p]["step"]) for p in params] == [5.0, 2.0, 5.0]


def test_entry_fetched_before_a_sync_stays_live():
    """`entry = optimizer.state[p0]`, then a sync caused by another entry:
    writes through `entry` still reach the optimizer, as with torch."""
    params, twins, optimizer, reference, train = _alongside_torch_adamw()
    train(3)
    ours, theirs = optimizer.state[params[0]], reference.state[twins[0]]
    optimizer.state[params[1]] = {}
    reference.state[twins[1]] = {}
    train(1)
    for entry, p in ((ours, params[0]), (theirs, twins[0])):
        entry["step"] = torch.tensor(0.0)
        entry["exp_avg"] = torch.zeros_like(p)
    train(2)
    for p, q in zip(params, twins):
        assert_close(p, q, torch.float32)
    assert optimizer.state[params[0]] is ours and float(ours["step"]) == 2.0


def test_entries_holding_views_of_the_chunks_can_be_reassigned():
    """`state[p] = dict(state[p])` and swapping two entries hand the
    optimizer views of its own chunks: the reset before the import must not
    zero what they show."""
    params = [torch.nn.Parameter(torch.randn(6)) for _ in range(3)]
    optimizer = ChunkedAdamW(params, lr=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(6)
        optimizer.step()
    before = [{key: value.clone() for key, value in optimizer.state[p].items()} for p in params]
    optimizer.state[params[0]] = dict(optimizer.state[params[0]])
    optimizer.state[params[1]], optimizer.state[params[2]] = optimizer.state[params[2]], optimizer.state[params[1]]
    after = optimizer.state_dict()["state"]
    for index, source in ((0, 0), (1, 2), (2, 1)):
        for key, value in before[source].items():
            assert torch.equal(after[index][key], value), (index, key)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "8bit"], ids=["fp32", "bf16", "8bit"])
def test_one_key_swapped_between_two_entries_swaps_the_values(state_dtype):
    """`s0[key], s1[key] = s1[key], s0[key]`: both values are views of the
    chunks, and importing the first write overwrites what the second one
    shows unless the optimizer copies them first."""
    params = [torch.nn.Parameter(torch.randn(300)) for _ in range(2)]
    optimizer = ChunkedAdamW(params, lr=0.01, state_dtype=state_dtype)
    params[0].grad, params[1].grad = torch.ones(300), -torch.ones(300)
    optimizer.step()
    params[1].grad = None
    params[0].grad = torch.ones(300)
    optimizer.step()  # params[0] at step 2, params[1] at step 1
    before = {index: {key: value.clone() for key, value in entry.items()}  # (views of the chunks)
              for index, entry in optimizer.state_dict()["state"].items()}
    first, second = optimizer.state[params[0]], optimizer.state[params[1]]
    keys = ["step", "exp_avg_codes", "exp_avg_absmax"] if state_dtype == "8bit" else ["step", "exp_avg"]
    for key in keys:
        first[key], second[key] = second[key], first[key]
    after = optimizer.state_dict()["state"]
    for index, other in ((0, 1), (1, 0)):
        assert torch.equal(after[index]["step"], before[other]["step"])
        assert torch.equal(after[index]["exp_avg"], before[other]["exp_avg"])
        assert torch.equal(after[index]["exp_avg_sq"], before[index]["exp_avg_sq"])


def test_state_copy_is_a_plain_defaultdict():
    """optimizer.state.copy() (and copy.copy, `|`) as torch's state gives:
    a defaultdict(dict) holding the same entries."""
    params = [torch.nn.Parameter(torch.randn(4))]
    optimizer = ChunkedAdamW(params)
    params[0].grad = torch.randn(4)
    optimizer.step()
    for copied in (optimizer.state.copy(), copy.copy(optimizer.state), optimizer.state | {}, {} | optimizer.state):
        assert type(copied) is type(torch.optim.AdamW(params).state)
        assert copied[params[0]] is optimizer.state[params[0]]
        assert copied.default_factory is dict


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

@pytest.fixture(params=backend_params("adam_step", backends=("triton",)))
def triton_device(request):
    """adam_step forced to the Triton kernel; yields the device."""
    yield from forced_backend(request, "adam_step")


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

    with required_backend("adam_step", "triton", "cpu"):
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
        kernel = effilayers.backends.kernel("adam_step", torch.device("cpu"))
        calls = []
        for step, step_grads in ((1.0, grads), (2.0, grads), (3.0, new_grads)):
            with NewStorages() as recorder:
                kernel(params, step_grads, *states, None, torch.tensor([step]), None, None, *hyper)
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
    with required_backend("adam_step", "triton", "cuda"):
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
