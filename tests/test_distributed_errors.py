"""Bad input to ChunkedAdamW with DTensor parameters: a param group mixing
DTensors and plain tensors, or DTensors of two meshes, fails at
construction / add_param_group naming the parameter; a plain gradient of a
DTensor parameter and a state of the wrong shape fail at the step / load.
A one-rank gloo group in this process is enough."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

from effilayers.optim import ChunkedAdamW


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def dtensor_param(shape, mesh=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = mesh or init_device_mesh("cpu", (1,))
    return nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [Shard(0)] * mesh.ndim))


def test_mixed_dtensor_and_plain_tensor_in_one_group_names_the_parameter(one_rank):
    sharded, plain = dtensor_param((4, 3)), nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"parameter 1 \('head.bias'\) of param group 0 is a plain torch.Tensor "
                                         r"but parameter 0 \('body.weight'\) of param group 0 is a DTensor"):
        ChunkedAdamW([("body.weight", sharded), ("head.bias", plain)])
    optimizer = ChunkedAdamW([sharded])
    with pytest.raises(ValueError, match="parameter 1 of param group 1 is a DTensor but parameter 0"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.randn(2)), dtensor_param((2,))]})
    ChunkedAdamW([{"params": [sharded]}, {"params": [plain]}])  # separate groups are fine


def test_dtensors_of_two_meshes_in_one_group_name_the_parameter(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    first = dtensor_param((4, 3))
    second = dtensor_param((4, 3), init_device_mesh("cpu", (1, 1)))
    with pytest.raises(ValueError, match="parameter 1 of param group 0 is on device mesh .* but parameter 0 of "
                                         "param group 0 is on"):
        ChunkedAdamW([first, second])


def test_plain_gradient_of_a_dtensor_parameter_is_a_type_error(one_rank):
    p = dtensor_param((4, 3))
    optimizer = ChunkedAdamW([p])
    p.grad = torch.ones(4, 3)
    with pytest.raises(TypeError, match="DTensor parameter has a plain torch.Tensor gradient"):
        optimizer.step()


def test_one_rank_dtensor_step_and_state_load(one_rank):
    """On one rank a DTensor parameter steps like the plain tensor it holds
    (fp32, to rounding), its state entries are DTensors, and a full plain
    tensor of the wrong shape is refused on load."""
    p = dtensor_param((4, 3))
    q = nn.Parameter(p.full_tensor().clone())
    ours, theirs = ChunkedAdamW([p], lr=0.1), torch.optim.AdamW([q], lr=0.1)
    for step in range(3):
        grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        p.grad = _like(p, grad)
        q.grad = grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-7)
    assert type(ours.state[p]["exp_avg"]).__name__ == "DTensor"
    saved = ours.state_dict()
    saved["state"][0]["exp_avg"] = torch.zeros(5, 3)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of a DTensor parameter of shape \(4, 3\)"):
        ours.load_state_dict(saved)


def _like(param, value):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, param.device_mesh, param.placements)


@pytest.mark.parametrize("options,param_dtype,keys", [
    (dict(), torch.bfloat16, ["exp_avg", "exp_avg_sq", "master_param", "step"]),
    (dict(state_dtype="8bit", amsgrad=True), torch.float32, ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]),
], ids=["bf16-params-fp32-master", "8bit-amsgrad"])
def test_dtensor_state_dict_entries_round_trip(one_rank, options, param_dtype, keys):
    """fp32 masters and decoded 8-bit states of DTensor parameters export as
    DTensors placed like the parameter, and load back to the same values."""
    p = nn.Parameter(dtensor_param((4, 300)).detach().to(param_dtype))
    optimizer = ChunkedAdamW([p], lr=0.1, **options)
    p.grad = _like(p, torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).to(param_dtype))
    optimizer.step()
    saved = optimizer.state_dict()
    entry = saved["state"][0]
    assert sorted(entry) == keys
    for key in keys[:-1]:
        assert type(entry[key]).__name__ == "DTensor" and entry[key].placements == p.placements, key
    assert type(entry["step"]) is torch.Tensor and float(entry["step"]) == 1.0
    expected = {key: entry[key].full_tensor().clone() for key in keys[:-1]}
    optimizer.load_state_dict(saved)
    again = optimizer.state_dict()["state"][0]
    for key, value in expected.items():
        torch.testing.assert_close(again[key].full_tensor(), value, rtol=0, atol=0, msg=key)
