"""ChunkedAdam / ChunkedAdamW steps against torch.optim.Adam / AdamW:
100-step trajectories on every backend, param groups and their edits,
low-precision states and parameters, GradScaler, chunking, argument errors.
"""

from __future__ import annotations

import copy

import pytest
import torch

import effilayers
from effilayers.optim import ChunkedAdam, ChunkedAdamW

from .accuracy import TRAJECTORY_BOUNDS, assert_close, tolerance
from .optim_cases import assert_same_params, make_net, train_steps, trajectory_tolerance

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
    expected, actual = make_net().to(device), make_net().to(device)
    train_steps(expected, torch_class(expected.parameters(), **kwargs), steps, **train)
    # chunk_size 300: the net is split over several chunks, one parameter larger than a chunk
    train_steps(actual, our_class(actual.parameters(), chunk_size=300, **kwargs), steps, **train)
    assert_same_params(actual, expected, **trajectory_tolerance(backend))


def test_param_groups_and_scheduler_match_torch(adam_device):
    backend, device = adam_device
    steps = 100 if backend != "triton" or device.type == "cuda" else 12

    def groups(model):
        return [dict(params=model.body.parameters(), lr=3e-3, betas=(0.8, 0.99), weight_decay=0.2),
                dict(params=model.head.parameters(), eps=1e-6, amsgrad=True),
                dict(params=model.spare.parameters(), maximize=False, weight_decay=0.0)]

    expected, actual = make_net().to(device), make_net().to(device)
    for model, cls in ((expected, torch.optim.AdamW), (actual, ChunkedAdamW)):
        optimizer = cls(groups(model), lr=1e-2, **({} if cls is torch.optim.AdamW else {"chunk_size": 64}))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[3e-2, 1e-2, 5e-3], total_steps=steps)
        train_steps(model, optimizer, steps, scheduler=scheduler, spare_every=2)
    assert_same_params(actual, expected, **trajectory_tolerance(backend))


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
    expected, actual = make_net(), make_net()
    train_steps(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2), 100)
    optimizer = ChunkedAdamW(actual.parameters(), lr=1e-2, state_dtype=torch.bfloat16)
    train_steps(actual, optimizer, 100)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in optimizer.state.values())
    bounds = TRAJECTORY_BOUNDS[torch.bfloat16]
    assert_same_params(actual, expected, rtol=0, atol=bounds["atol"])
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


def test_skipped_parameters_keep_their_own_step_counts():
    model = make_net()
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, 7, spare_every=3)  # spare gets gradients at steps 0, 3, 6
    state = optimizer.state_dict()["state"]
    steps = [float(entry["step"]) for entry in state.values()]
    assert steps == [7.0] * 6 + [3.0, 3.0]


# -- AMP ----------------------------------------------------------------------

def test_grad_scaler_overflow_step_changes_nothing_and_later_steps_match_torch():
    torch_model, our_model = make_net(), make_net()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    our_opt = ChunkedAdamW(our_model.parameters(), lr=1e-2, chunk_size=300)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    train_steps(our_model, our_opt, 2)
    train_steps(torch_model, torch_opt, 2)
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
    assert_same_params(our_model, torch_model, **tolerance(torch.float32))


@pytest.mark.parametrize("options", [{}, dict(state_dtype="8bit"), dict(offload="cpu", staged=True)],
                         ids=["fp32", "8bit", "offload-staged"])
def test_found_inf_above_one_skips_without_lowering_step_counts(options):
    """GradScaler sums found_inf over devices, so a skipped step may hand the
    optimizer found_inf = 2: nothing may change, step counts included."""
    options = dict(options)
    staged = options.pop("staged", False)
    model = make_net()
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, chunk_size=300, **options)
    optimizer._force_staging = staged
    train_steps(model, optimizer, 3)
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


# -- chunks ---------------------------------------------------------------------

def test_chunks_follow_first_use_and_size():
    model = make_net()
    optimizer = ChunkedAdamW(model.parameters(), chunk_size=300)
    train_steps(model, optimizer, 1)  # spare gets no gradient in the first step
    layout = optimizer.chunk_layout()
    sizes = [p.numel() for p in list(model.parameters())[:6]]
    assert sum(entry["numel"] for entry in layout) == sum(sizes)
    assert all(entry["numel"] <= 300 or entry["params"] == 1 for entry in layout)
    train_steps(model, optimizer, 1, spare_every=1)
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
        ChunkedAdamW(make_net().parameters(), **kwargs)


@pytest.mark.parametrize("betas", [(torch.tensor(0.9), 0.999), (0.9, torch.tensor(0.999))], ids=["tensor-float",
                                                                                               "float-tensor"])
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam, ChunkedAdamW, ChunkedAdam])
def test_betas_mixing_float_and_tensor_raise_torchs_error(optimizer, betas):
    # torch 2.13: ValueError "betas must be either both floats or both Tensors"
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        optimizer(make_net().parameters(), betas=betas)
    if optimizer in (ChunkedAdamW, ChunkedAdam):
        # torch checks only the defaults; a param group's betas are checked here too
        model = make_net()
        with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
            optimizer([dict(params=model.head.parameters(), betas=betas)])


def test_betas_as_two_tensors_step_like_floats():
    torch.manual_seed(0)
    results = []
    for betas in ((0.8, 0.99), (torch.tensor(0.8), torch.tensor(0.99))):
        model = make_net(spare=False)
        optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, betas=betas)
        train_steps(model, optimizer, 2)
        results.append([p.detach().clone() for p in model.parameters()])
    initial = [p.detach() for p in make_net(spare=False).parameters()]
    for tensor_betas, float_betas, start in zip(results[1], results[0], initial):
        torch.testing.assert_close(tensor_betas, float_betas)  # float32 betas: rounding apart
        assert not torch.equal(float_betas, start)


def test_invalid_group_hyperparameters_are_named():
    model = make_net()
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
    tol = trajectory_tolerance(backend)
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


@pytest.mark.gpu
def test_cuda_trajectory_matches_torch_fused():
    expected, actual = make_net().cuda(), make_net().cuda()
    train_steps(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2, fused=True), 100)
    train_steps(actual, ChunkedAdamW(actual.parameters(), lr=1e-2, chunk_size=300), 100)
    assert_same_params(actual, expected, **tolerance(torch.float32, "adam_trajectory_triton"))


def test_optimizer_is_exported():
    assert effilayers.optim.ChunkedAdamW is ChunkedAdamW
    assert "adam_step_" in effilayers.backends.registered_ops()


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
