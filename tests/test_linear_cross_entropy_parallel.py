"""linear_cross_entropy with a DTensor weight: sharded over the vocabulary
(Shard(0), the vocabulary-parallel loss) or over the hidden dimension
(Shard(1), gathered), two gloo processes give the loss and the gradients
(input, the weight and bias shards) of the whole computation in float64."""

from __future__ import annotations

import pytest
import torch

from .accuracy import assert_close
from .distributed_cases import gloo, run_ranks, save
from .linear_cross_entropy_cases import make_positive, make_problem, unfused

CLASSES = 13  # 7 + 6 over two ranks: uneven shards


def _case(reduction_seed=0):
    x, w, b, target = make_problem((3, 5), 6, CLASSES, torch.float64, ignore_every=4, seed=reduction_seed)
    target.view(-1)[1] = 0
    target.view(-1)[2] = CLASSES - 1  # a class of each rank
    return x, w, b, target, make_positive(CLASSES, seed=6), make_positive((3, 5), seed=7)


def _worker(rank, world, workdir, options):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from effilayers.functional import linear_cross_entropy

    with gloo(rank, world, workdir):
        mesh = init_device_mesh("cpu", (world,))
        x, w, b, target, class_weight, token_weight = _case()
        x.requires_grad_()
        options = dict(options)
        over_hidden = options.pop("placement") == "hidden"
        weight = distribute_tensor(w, mesh, [Shard(1) if over_hidden else Shard(0)]).requires_grad_()
        bias = distribute_tensor(b, mesh, [Replicate() if over_hidden else Shard(0)]).requires_grad_()
        loss = linear_cross_entropy(x, weight, target, bias, class_weight=class_weight, token_weight=token_weight,
                                    chunk_size=4, **options)
        loss.backward()
        save(workdir, rank, {"loss": loss.detach(), "grad_input": x.grad, "grad_weight": weight.grad.full_tensor(),
                             "grad_bias": bias.grad.full_tensor(), "local_rows": weight.grad.to_local().shape[0]})


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(reduction="mean", label_smoothing=0.1, placement="vocab"),
                                     dict(reduction="sum", placement="vocab"),
                                     dict(reduction="mean", label_smoothing=0.1, placement="hidden")],
                         ids=["mean-smoothed", "sum", "hidden-sharded-gathered"])
def test_two_gloo_ranks_match_the_whole_computation(tmp_path, options):
    results = run_ranks(_worker, tmp_path, options)
    options = dict(options)
    over_hidden = options.pop("placement") == "hidden"
    assert [r["local_rows"] for r in results] == ([CLASSES, CLASSES] if over_hidden else [7, 6])
    x, w, b, target, class_weight, token_weight = _case()
    # The whole computation with token weights: the float64 formula, checked
    # against torch in tests/test_linear_cross_entropy.py.
    from effilayers.ops.linear_cross_entropy import linear_cross_entropy_reference

    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    expected = linear_cross_entropy_reference(*leaves[:2], target, leaves[2], class_weight=class_weight,
                                              token_weight=token_weight, **options)
    expected_grads = torch.autograd.grad(expected, leaves)
    for result in results:
        assert_close(result["loss"], expected.detach(), torch.float64)
        for name, want in zip(("grad_input", "grad_weight", "grad_bias"), expected_grads):
            assert_close(result[name], want, torch.float64, msg=lambda m, n=name: f"{n}: {m}")


def test_one_rank_and_unsupported_sharded_options(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from effilayers.functional import linear_cross_entropy

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x, w, b, target, _, _ = _case()
        sharded = distribute_tensor(w, mesh, [Shard(0)])
        # What the vocabulary-parallel loss does not serve gathers the weight:
        # the same loss as the whole computation, not an error.
        gathered = [(dict(weight=sharded, reduction="none"), dict(reduction="none")),
                    (dict(weight=distribute_tensor(w, mesh, [Replicate()])), {}),
                    (dict(weight=sharded, bias=b), dict(bias=b))]
        for given, expected in gathered:
            loss = linear_cross_entropy(x, given["weight"], target, given.get("bias"),
                                        reduction=given.get("reduction", "mean"))
            assert_close(loss, unfused(x, w, expected.get("bias"), target,
                                       reduction=expected.get("reduction", "mean"))[0], torch.float64)
        # One rank holding every class: the same as the unsharded op.
        loss = linear_cross_entropy(x, sharded, target, label_smoothing=0.2)
        assert_close(loss, unfused(x, w, None, target, label_smoothing=0.2)[0], torch.float64)
    finally:
        dist.destroy_process_group()
