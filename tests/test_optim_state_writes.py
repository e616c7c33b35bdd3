"""ChunkedAdam(W) state and parameters written from outside the optimizer
between steps (entries assigned, deleted or swapped, parameters written,
re-typed, moved or re-laid out), also when the state is synced or exported
before the next step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from effilayers.optim import ChunkedAdamW

from .accuracy import assert_close, tolerance
from .optim_cases import assert_same_params, make_net, train_steps


def test_direct_assignment_into_state_reaches_the_chunks():
    """`optimizer.state[p] = entry`, `del optimizer.state[p]` and writes into an
    entry take effect at the next step, as with torch.optim.AdamW."""
    torch_model, our_model = make_net(), make_net()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    our_opt = ChunkedAdamW(our_model.parameters(), lr=1e-2, chunk_size=300)
    train_steps(torch_model, torch_opt, 3)
    train_steps(our_model, our_opt, 1)  # chunks exist; their states are about to be replaced
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
    train_steps(torch_model, torch_opt, 4, seed=3)
    train_steps(our_model, our_opt, 4, seed=3)
    assert_same_params(our_model, torch_model, **tolerance(torch.float32))
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
    model = make_net()
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, chunk_size=300)
    train_steps(model, optimizer, 3)
    saved = copy.deepcopy(optimizer.state_dict())
    model.cuda()
    twin = copy.deepcopy(model)
    twin_opt = ChunkedAdamW(twin.parameters(), lr=1e-2, chunk_size=300)
    twin_opt.load_state_dict(saved)
    train_steps(model, optimizer, 3, seed=8)
    train_steps(twin, twin_opt, 3, seed=8)
    assert_same_params(model, twin, rtol=0, atol=0)
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
