"""InPlaceABNSync under DistributedDataParallel on two gloo ranks, against
single-process InPlaceABN on the concatenated batch (float64); the
conversion path to synchronised ABNs; SyncBatchNorm's converter raises on
an already converted model; a process-group mismatch raises."""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
from torch import nn

import effilayers
from effilayers.nn import InPlaceABN, InPlaceABNSync

from .conftest import activate_backend
from .distributed_cases import gloo, run_ranks, save
from .helpers import channel_varied

TOL = dict(rtol=1e-10, atol=1e-10)


def plain_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU(),
                        nn.Conv2d(5, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).double()
    for module in net:
        if isinstance(module, nn.BatchNorm2d):  # not the identity affine map
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return net


def batch(total):
    whole = channel_varied((total, 3, 6, 6), torch.float64, seed=3)
    grad = torch.randn(total, 4, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    return whole, grad


def steps(model, x, grad, count=2):
    outs = []
    for _ in range(count):
        out = model(x)
        out.backward(grad)
        outs.append(out.detach())
    return outs


DDP_CASES = {"3+5-SyncBatchNorm-then-convert": ([3, 5], "sync-first"),
             "0+4-SyncBatchNorm-then-convert": ([0, 4], "sync-first"),
             "3+5-convert-then-convert_sync_abn": ([3, 5], "abn-first")}


def _ddp_case(rank, group, sizes, order):
    from torch.nn.parallel import DistributedDataParallel

    model = plain_net()
    if order == "sync-first":
        # torch's converter first, then effilayers.convert fuses each
        # SyncBatchNorm + activation into an InPlaceABNSync
        report = effilayers.convert(nn.SyncBatchNorm.convert_sync_batchnorm(model, group))
    else:  # a model converted already: its InPlaceABNs become InPlaceABNSync
        report = effilayers.convert(model)
        assert InPlaceABNSync.convert_sync_abn(model, group) is model
    fused = [m for m in model.modules() if isinstance(m, InPlaceABN)]
    kinds = [type(m).__name__ for m in fused]
    groups_kept = all(m.process_group is group for m in fused)
    ddp = DistributedDataParallel(model)
    whole, grad = batch(sum(sizes))
    start = sum(sizes[:rank])
    part = whole[start:start + sizes[rank]].clone().requires_grad_()
    outs = steps(ddp, part, grad[start:start + sizes[rank]])
    return {"outs": outs, "input_grad": part.grad, "kinds": kinds, "groups_kept": groups_kept,
            "fused": len(report.fused), "param_grads": [p.grad.clone() for p in model.parameters()],
            "buffers": {k: v.clone() for k, v in model.state_dict().items()}}


def _ddp_worker(rank, world, workdir):
    import torch.distributed as dist

    # Every case in one process group: spawning two ranks costs more than a case.
    with gloo(rank, world, workdir):
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
        save(workdir, rank, {case: _ddp_case(rank, group, *DDP_CASES[case]) for case in DDP_CASES})


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    activate_backend("abn_forward", "cpp", "cpu").__exit__(None, None, None)  # built once, not by each rank
    return run_ranks(_ddp_worker, tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_sync_abn_matches_inplace_abn_on_whole_batch(ddp_results, case):
    sizes, _ = DDP_CASES[case]
    results = [rank_results[case] for rank_results in ddp_results]
    reference = plain_net()
    effilayers.convert(reference)
    assert [type(m) for m in reference.modules() if isinstance(m, InPlaceABN)] == [InPlaceABN, InPlaceABN]
    whole, grad = batch(sum(sizes))
    whole.requires_grad_()
    expected = steps(reference, whole, grad)
    for result in results:
        assert result["kinds"] == ["InPlaceABNSync", "InPlaceABNSync"] and result["fused"] == 2
        assert result["groups_kept"]
    for step in range(2):
        torch.testing.assert_close(torch.cat([r["outs"][step] for r in results]), expected[step], **TOL)
    torch.testing.assert_close(torch.cat([r["input_grad"] for r in results]), whole.grad, **TOL)
    # DDP averages the ranks' gradients; the whole batch's loss is their sum
    for rank, result in enumerate(results):
        for index, (got, p) in enumerate(zip(result["param_grads"], reference.parameters())):
            torch.testing.assert_close(got * len(results), p.grad, **TOL,
                                       msg=lambda m: f"rank {rank}, parameter {index}: {m}")
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(result["buffers"][name], value, **TOL, msg=lambda m: f"{name}: {m}")


def test_convert_sync_batchnorm_on_converted_model_raises_instead_of_dropping_the_activation():
    """ABN modules are _BatchNorm subclasses, which torch's converter rebuilds
    as plain SyncBatchNorms; the fused activation would vanish, so it raises
    naming the way that works, and the fused modules stay as they were."""
    model = plain_net()
    effilayers.convert(model)
    before = [type(m) for m in model.modules()]
    x = channel_varied((4, 3, 6, 6), torch.float64)
    expected = copy.deepcopy(model)(x.clone())
    with pytest.raises(TypeError, match=r"would replace this InPlaceABN \(5, .*drop its 'leaky_relu' activation.*"
                                        r"InPlaceABNSync\.convert_sync_abn"):
        nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert [type(m) for m in model.modules()] == before
    torch.testing.assert_close(model(x.clone()), expected, rtol=0, atol=0)
    # the way the message names: synchronised modules on the same tensors
    synced = InPlaceABNSync.convert_sync_abn(model)
    assert [type(m) for m in synced.modules() if isinstance(m, InPlaceABN)] == [InPlaceABNSync, InPlaceABNSync]
    torch.testing.assert_close(synced(x.clone()), expected, rtol=0, atol=0)  # no process group: InPlaceABN's result


def test_convert_sync_abn_shares_the_tensors_and_refuses_plain_abn():
    model = plain_net()
    effilayers.convert(model)
    before = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()}
    x = channel_varied((4, 3, 6, 6), torch.float64)
    expected = copy.deepcopy(model)(x.clone())
    InPlaceABNSync.convert_sync_abn(model)
    assert [type(m) for m in model.modules() if isinstance(m, InPlaceABN)] == [InPlaceABNSync, InPlaceABNSync]
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[name] is before[name] for name in before)
    # without a process group it computes what InPlaceABN did
    torch.testing.assert_close(model(x.clone()), expected, rtol=0, atol=0)
    assert type(InPlaceABNSync.convert_sync_abn(InPlaceABN(3))) is InPlaceABNSync
    not_in_place = plain_net()
    effilayers.convert(not_in_place, mode="abn")
    with pytest.raises(TypeError, match="'1' is an ABN \\(not in place\\), which has no synchronised form"):
        InPlaceABNSync.convert_sync_abn(not_in_place)


def _mismatch_worker(rank, world, workdir, case):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'init')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=5))
    try:
        channels = 3 if case == "channels" and rank == 0 else 4
        module = InPlaceABNSync(channels).double()
        if case == "one-rank-only" and rank == 1:
            module.eval()  # evaluation does not synchronise: rank 0 waits alone
        error = None
        try:
            module(channel_varied((2, channels, 3), torch.float64))
        except Exception as caught:  # noqa: BLE001 - what matters is that it is raised, not hung
            error = f"{type(caught).__name__}: {caught}"
        save(workdir, rank, error)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["channels", "one-rank-only"])
def test_sync_abn_process_group_mismatch_raises(tmp_path, case):
    activate_backend("abn_forward", "cpp", "cpu").__exit__(None, None, None)
    errors = run_ranks(_mismatch_worker, tmp_path, case, deadline_s=120)
    if case == "channels":  # found before the statistics' collective, on every rank
        assert all(error.startswith("ValueError") and "[3, 4]" in error for error in errors), errors
    else:  # the waiting rank times out or sees its peer leave: an error, not a hang
        assert errors[0] is not None and errors[1] is None, errors
