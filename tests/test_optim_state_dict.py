"""ChunkedAdam(W) state dicts in torch's layout (to and from
torch.optim.AdamW, across chunk sizes and state dtypes), their hooks,
ZeroRedundancyOptimizer, deepcopy and pickle.
"""

from __future__ import annotations

import copy

import pytest
import torch

from effilayers.optim import ChunkedAdamW

from .accuracy import assert_close, tolerance
from .conftest import activate_backend
from .distributed_cases import gloo, run_ranks, save
from .optim_cases import assert_same_params, make_net, train_steps

# -- state dicts ----------------------------------------------------------------

def test_state_dict_has_torch_layout_and_loads_into_torch_and_back():
    torch_model, our_model = make_net(), make_net()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, amsgrad=True)
    our_opt = ChunkedAdamW(our_model.parameters(), lr=1e-2, amsgrad=True, chunk_size=200)
    train_steps(torch_model, torch_opt, 10, spare_every=3)
    train_steps(our_model, our_opt, 10, spare_every=3)
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
    train_steps(next_torch_model, next_torch_opt, 10, spare_every=3, seed=5)
    train_steps(next_our_model, next_our_opt, 10, spare_every=3, seed=5)
    train_steps(torch_model, torch_opt, 10, spare_every=3, seed=5)
    assert_same_params(next_torch_model, torch_model, rtol=1e-4, atol=1e-5)
    assert_same_params(next_our_model, torch_model, **tolerance(torch.float32))


def test_state_dict_round_trip_across_chunk_sizes_and_bf16_dtype_kept():
    model = make_net()
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16, chunk_size=100)
    train_steps(model, optimizer, 5, spare_every=2)
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
    train_steps(model, optimizer, 5, spare_every=2, seed=9)
    train_steps(twin, loaded, 5, spare_every=2, seed=9)
    assert_same_params(twin, model, rtol=0, atol=0)

    # an fp32 torch checkpoint loaded with bf16 states is rounded to bf16
    fp32_model = make_net()
    fp32_opt = torch.optim.AdamW(fp32_model.parameters(), lr=1e-2)
    train_steps(fp32_model, fp32_opt, 3)
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


# -- ZeroRedundancyOptimizer ----------------------------------------------------

def _zero_worker(rank, world, workdir):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    with gloo(rank, world, workdir):
        runs = {}
        for name, optimizer_class, kwargs in (("ours", ChunkedAdamW, dict(chunk_size=300)),
                                              ("torch", torch.optim.AdamW, {})):
            model = make_net()
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=1e-2,
                                                **kwargs)
            generator = torch.Generator().manual_seed(1)
            trajectory = []
            for step in range(10):
                x, y = torch.randn(16, 7, generator=generator), torch.randn(16, 5, generator=generator)
                optimizer.zero_grad()
                # same data on both ranks: no all-reduce needed; the spare head every third step
                torch.nn.functional.mse_loss(model(x, step % 3 == 0), y).backward()
                optimizer.step()
                trajectory.append([p.detach().clone() for p in model.parameters()])
            optimizer.consolidate_state_dict(to=0)
            runs[name] = {"trajectory": trajectory, "state": optimizer.state_dict() if rank == 0 else None}
        save(workdir, rank, runs)


@pytest.mark.slow
def test_zero_redundancy_optimizer_two_gloo_processes(tmp_path):
    """ZeroRedundancyOptimizer(optimizer_class=ChunkedAdamW) follows
    optimizer_class=torch.optim.AdamW step by step on both ranks, and its
    consolidated state has torch's entries."""
    activate_backend("adam_step_", "cpp", "cpu").__exit__(None, None, None)  # build once, before the workers
    results = run_ranks(_zero_worker, tmp_path)
    for rank, result in enumerate(results):
        for step, (ours, theirs) in enumerate(zip(result["ours"]["trajectory"], result["torch"]["trajectory"])):
            for index, (p, q) in enumerate(zip(ours, theirs)):
                assert_close(p, q, torch.float32, msg=lambda m: f"rank {rank}, step {step}, param {index}: {m}")
    ours, theirs = results[0]["ours"]["state"], results[0]["torch"]["state"]
    assert sorted(ours["state"]) == sorted(theirs["state"]) == list(range(8))
    for number, entry in theirs["state"].items():
        assert sorted(ours["state"][number]) == sorted(entry)
        assert float(ours["state"][number]["step"]) == float(entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(ours["state"][number][key], entry[key], torch.float32)


def _zero_run(optimizer_class, model, steps, seed, state_dict=None, **kwargs):
    """ZeroRedundancyOptimizer(optimizer_class) on one gloo rank: optionally
    load `state_dict`, train `steps`, return the consolidated state dict."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=1e-2, **kwargs)
    if state_dict is not None:
        optimizer.load_state_dict(state_dict)
    train_steps(model, optimizer, steps, seed=seed)
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
        model = make_net()
        saved = _zero_run(optimizer_class, model, 4, seed=1, **kwargs)
        resumed = copy.deepcopy(model)
        resumed_state = _zero_run(optimizer_class, resumed, 4, seed=2, state_dict=copy.deepcopy(saved), **kwargs)
        _zero_run(optimizer_class, model, 4, seed=2, state_dict=copy.deepcopy(saved), **kwargs)
    finally:
        dist.destroy_process_group()
    expected = make_net()
    reference = torch.optim.AdamW(expected.parameters(), lr=1e-2)
    train_steps(expected, reference, 4, seed=1)
    train_steps(expected, reference, 4, seed=2)
    assert_same_params(resumed, expected, **tolerance(torch.float32))
    assert_same_params(model, expected, **tolerance(torch.float32))
    assert all(float(entry["step"]) == 8.0 for entry in resumed_state["state"].values())


# -- copies of the optimizer ----------------------------------------------------

@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("options", [dict(amsgrad=True), dict(state_dtype=torch.bfloat16), dict(state_dtype="8bit"),
                                     dict(param_dtype=torch.bfloat16)],
                         ids=["fp32-amsgrad", "bf16-states", "8bit-states", "bf16-params-fp32-masters"])
def test_deepcopied_or_pickled_optimizer_continues_identically(how, options):
    import io

    options = dict(options)
    model = make_net(options.pop("param_dtype", torch.float32))
    optimizer = ChunkedAdamW(model.parameters(), lr=1e-2, chunk_size=300, **options)
    train_steps(model, optimizer, 4, spare_every=3)
    if how == "deepcopy":
        twin_model, twin_opt = copy.deepcopy((model, optimizer))
    else:
        buffer = io.BytesIO()
        torch.save((model, optimizer), buffer)
        buffer.seek(0)
        twin_model, twin_opt = torch.load(buffer, weights_only=False)
    assert twin_opt.param_groups[0]["params"][0] is next(twin_model.parameters())
    train_steps(model, optimizer, 4, spare_every=3, seed=6)
    train_steps(twin_model, twin_opt, 4, spare_every=3, seed=6)
    assert_same_params(twin_model, model, rtol=0, atol=0)
    ours, theirs = twin_opt.state_dict()["state"], optimizer.state_dict()["state"]
    for index, entry in theirs.items():
        for key, value in entry.items():
            assert torch.equal(ours[index][key], value), (index, key)


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
