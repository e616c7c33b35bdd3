"""The memory-efficient DenseNet against the plain one (outputs, gradients,
running statistics, dropout, checkpointing), and the other reasons to call
its modules: hooks, tracing, torch.func, convolutions the Function does not
implement."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from .densenet_cases import assert_models_agree, efficient_and_naive, run_forward_backward

# No TF32 here unless a test asks (conftest.full_float32 says why).
pytestmark = pytest.mark.usefixtures("full_float32")


@pytest.mark.parametrize("small_inputs", [True, False], ids=["cifar-stem", "imagenet-stem"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gradients_match_the_plain_model_float64(small_inputs, training):
    efficient, naive = efficient_and_naive(small_inputs=small_inputs)
    efficient.train(training)
    naive.train(training)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    assert_models_agree(efficient, naive, x, rtol=1e-9, atol=1e-10)


def test_gradients_match_the_plain_model_float32():
    efficient, naive = efficient_and_naive(dtype=torch.float32, growth_rate=6, block_config=(3, 4),
                                           num_init_features=12)
    x = torch.randn(4, 3, 32, 32)
    assert_models_agree(efficient, naive, x, rtol=1e-4, atol=1e-5)


def test_fp16_model_is_as_accurate_as_the_naive_fp16_model():
    """fp16 on CPU against the naive model in float64. Both fp16 models are
    far from float64 here (relative L2 error: output ~1e-3, all parameter
    gradients together ~0.5 %, input gradient 5-13 %: BatchNorm's backward
    over few values per channel, layer after layer), so the bound is
    relative to the naive fp16 model's own error. Measured, seeds 0-3: the
    memory-efficient model's error is 0.52x to 1.12x the naive one's."""
    options = dict(growth_rate=4, block_config=(2, 3), num_init_features=8, bn_size=2, num_classes=5,
                   small_inputs=True)
    efficient, naive = efficient_and_naive(**options)
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = run_forward_backward(naive, x)

    def errors(model):
        out, grad_x, grads = run_forward_backward(copy.deepcopy(model).half(), x.half())
        assert out.dtype == grad_x.dtype == torch.float16
        got = [out, grad_x, torch.cat([grads[k].flatten() for k in grads])]
        want = [expected[0], expected[1], torch.cat([expected[2][k].flatten() for k in grads])]
        return [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want)]

    efficient_errors, naive_errors = errors(efficient), errors(naive)
    for name, ours, theirs in zip(["output", "input gradient", "parameter gradients"], efficient_errors,
                                  naive_errors):
        assert ours <= 2 * theirs, (name, ours, theirs)


def test_dropout_is_identical_under_recomputation():
    # Dropout follows conv2, outside the recomputed bottleneck: one mask per
    # forward, drawn in the same order in both models.
    efficient, naive = efficient_and_naive(drop_rate=0.3, small_inputs=True)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    assert_models_agree(efficient, naive, x, rtol=1e-9, atol=1e-10, seed=7)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_running_statistics_match_after_three_training_steps(momentum):
    efficient, naive = efficient_and_naive(small_inputs=True)
    for model in (efficient, naive):
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.momentum = momentum
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (efficient, naive)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 3, 16, 16, generator=gen, dtype=torch.float64)
        for model, optimizer in zip((efficient, naive), optimizers):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    buffers_e, buffers_n = dict(efficient.named_buffers()), dict(naive.named_buffers())
    assert buffers_e.keys() == buffers_n.keys()
    for name in buffers_e:
        if name.endswith("num_batches_tracked"):
            assert int(buffers_e[name]) == int(buffers_n[name]) == 3, name
        else:
            assert buffers_e[name].dtype == torch.float64
            torch.testing.assert_close(buffers_e[name], buffers_n[name], rtol=1e-9, atol=1e-11, msg=name)


def test_checkpointing_updates_running_statistics_twice_and_recomputation_once():
    """The README's claim: a bottleneck under torch.utils.checkpoint (the
    construction effilayers-bench and bench_densenet.py time, as torchvision
    builds it) runs norm1's training forward again in backward, so its
    num_batches_tracked counts 2 per step and its running statistics move
    twice; the recomputing Function updates them once, as the naive model
    does."""
    from effilayers.bench import checkpointed_densenet as checkpointed

    efficient, naive = efficient_and_naive(small_inputs=True)
    checkpointing = checkpointed(copy.deepcopy(naive))
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    for model in (efficient, naive, checkpointing):
        model.train()(x).square().mean().backward()
    norms = {name: dict(model.named_buffers()) for name, model in
             [("efficient", efficient), ("naive", naive), ("checkpointing", checkpointing)]}
    norm1_counters = [k for k in norms["naive"] if k.endswith("norm1.num_batches_tracked")]
    assert len(norm1_counters) == 5
    for key in norm1_counters:
        assert int(norms["naive"][key]) == int(norms["efficient"][key]) == 1, key
        assert int(norms["checkpointing"][key]) == 2, key
        mean = key.replace("num_batches_tracked", "running_mean")
        torch.testing.assert_close(norms["efficient"][mean], norms["naive"][mean], rtol=1e-9, atol=1e-12)
        assert not torch.allclose(norms["checkpointing"][mean], norms["naive"][mean], rtol=1e-3, atol=1e-6), mean


# ---- hooks and other reasons to call the modules ------------------------------------------------


def _count_bottlenecks(monkeypatch):
    """A list that grows by one per call of the recomputing Function."""
    from effilayers.models import densenet as densenet_module

    calls = []
    original = densenet_module.norm_relu_conv

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(densenet_module, "norm_relu_conv", counting)
    return calls


HOOKED = ["features.denseblock1.denselayer2.norm1", "features.denseblock1.denselayer2.relu1",
          "features.denseblock1.denselayer2.conv1", "features.denseblock2.denselayer1.norm2",
          "features.denseblock2.denselayer1.relu2", "features.denseblock2.denselayer1.conv2",
          "features.transition1.norm", "features.transition1.relu", "features.transition1.conv"]


def test_module_hooks_fire_as_in_the_naive_model(monkeypatch, fresh_warnings):
    """A norm -> relu -> conv whose modules carry hooks is computed by
    calling them (once per forward, as the naive model does); the other
    steps still recompute. Outputs and gradients stay the naive model's."""
    efficient, naive = efficient_and_naive(small_inputs=True)
    fired = {}
    for name, model in (("efficient", efficient), ("naive", naive)):
        fired[name] = []
        for path in HOOKED:
            module = model.get_submodule(path)
            module.register_forward_pre_hook(lambda m, args, path=path, log=fired[name]: log.append(("pre", path)))
            module.register_forward_hook(lambda m, args, out, path=path, log=fired[name]: log.append(("post", path)))
        model.get_submodule(HOOKED[-1]).register_full_backward_hook(
            lambda m, grad_in, grad_out, log=fired[name]: log.append(("backward", HOOKED[-1])))
    calls = _count_bottlenecks(monkeypatch)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="memory_efficient=True calls the modules.*hooks"):
        assert_models_agree(efficient, naive, x, rtol=1e-9, atol=1e-10)
    assert fired["efficient"] == fired["naive"]
    assert len(fired["naive"]) == 2 * len(HOOKED) + 1
    # 5 layers x 2 steps + 1 transition, less the three hooked steps.
    assert len(calls) == 11 - 3


def test_global_module_hooks_fire_as_in_the_naive_model(fresh_warnings):
    efficient, naive = efficient_and_naive(small_inputs=True)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    seen = {}
    for name, model in (("efficient", efficient), ("naive", naive)):
        seen[name] = []
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out, log=seen[name]: log.append(type(m).__name__))
        try:
            with pytest.warns(UserWarning, match="hooks") if name == "efficient" else contextlib.nullcontext():
                model(x)
        finally:
            handle.remove()
    assert seen["efficient"] == seen["naive"]
    assert seen["naive"].count("Conv2d") == 1 + 2 * 5 + 1


@pytest.mark.parametrize("change", ["reflect", "replicate", "dilated", "bias"])
def test_convolutions_the_function_does_not_implement_take_the_module_path(monkeypatch, fresh_warnings, change):
    """padding_mode other than "zeros" was computed with zero padding; other
    conv settings the recomputing Function lacks raised mid-forward. Both
    now call the module (for that step only), like the naive model."""
    efficient, naive = efficient_and_naive(small_inputs=True)
    for model in (efficient, naive):
        conv = model.features.denseblock2.denselayer2.conv2
        if change == "dilated":
            conv.dilation, conv.padding = (2, 2), (2, 2)  # same output size
        elif change == "bias":
            conv.bias = nn.Parameter(torch.linspace(-1, 1, conv.out_channels, dtype=torch.float64))
        else:
            conv.padding_mode = change
    calls = _count_bottlenecks(monkeypatch)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="calls the modules.*convolution it does not implement"):
        assert_models_agree(efficient, naive, x, rtol=1e-9, atol=1e-10)
    assert len(calls) == 11 - 1


def test_sync_batch_norm_takes_the_module_path_with_a_warning(monkeypatch, fresh_warnings):
    """SyncBatchNorm's statistics span processes, which the recomputing
    Function does not compute: its steps call the modules, saying so."""
    efficient, naive = (nn.SyncBatchNorm.convert_sync_batchnorm(m) for m in efficient_and_naive(small_inputs=True))
    calls = _count_bottlenecks(monkeypatch)
    with pytest.warns(UserWarning, match="calls the modules.*SyncBatchNorm"):
        assert_models_agree(efficient, naive, torch.randn(2, 3, 8, 8, dtype=torch.float64), rtol=1e-9, atol=1e-10)
    assert not calls


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_jit_trace_records_the_plain_models_graph(fresh_warnings):
    """Tracing went through the block buffer's Tensor.set_ and failed
    ("unordered_map::at"); traced, the model is the naive one."""
    efficient, naive = (m.eval() for m in efficient_and_naive(dtype=torch.float32, small_inputs=True))
    with pytest.warns(UserWarning, match="under torch.jit.trace"):
        traced = torch.jit.trace(efficient, torch.randn(2, 3, 16, 16))
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(traced(x), naive(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("memory_efficient", [True, False])
def test_fx_symbolic_trace_gives_the_naive_graph(fresh_warnings, memory_efficient):
    """torch.fx.symbolic_trace (what torchvision's create_feature_extractor
    uses) failed on DenseBlock's branch on x.dim(), in both modes. The
    GraphModule calls the modules and trains like the naive model."""
    efficient, naive = efficient_and_naive(small_inputs=True)
    model = efficient if memory_efficient else naive
    with pytest.warns(UserWarning, match="torch.fx symbolic tracing") if memory_efficient \
            else contextlib.nullcontext():
        graph = torch.fx.symbolic_trace(model)
    assert sum(node.op == "call_module" and "conv" in str(node.target) for node in graph.graph.nodes) == 12
    assert_models_agree(graph, copy.deepcopy(naive), torch.randn(2, 3, 8, 8, dtype=torch.float64), rtol=1e-9,
                        atol=1e-10)


def test_torch_func_grad_and_vmap_compute_the_naive_gradients(fresh_warnings):
    """torch.func transforms need setup_context-style autograd Functions;
    under them the layers call their modules."""
    from torch.func import functional_call, grad, vmap

    gradients = []
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    for model in efficient_and_naive(small_inputs=True):
        model.eval()
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = dict(model.named_buffers())

        def loss(params, x):
            return functional_call(model, (params, buffers), (x,)).square().sum()

        with pytest.warns(UserWarning, match="torch.func") if model.memory_efficient else contextlib.nullcontext():
            gradients.append((grad(loss)(params, x), vmap(grad(loss), in_dims=(None, 0))(params, x[:, None])))
    for got, expected in zip(gradients[0], gradients[1]):
        assert got.keys() == expected.keys()
        for name in got:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.filterwarnings("ignore:effilayers DenseNet")
def test_pruned_convolutions_train_like_the_naive_model():
    """torch.nn.utils.prune recomputes ``weight`` from ``weight_orig`` in a
    forward pre-hook; reading ``conv.weight`` directly used the last step's
    (freed) graph and raised in the second backward."""
    from torch.nn.utils import prune

    efficient, naive = efficient_and_naive(small_inputs=True)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    results = []
    for model in (efficient, naive):
        for path in ("features.denseblock1.denselayer1.conv1", "features.denseblock2.denselayer2.conv2",
                     "features.transition1.conv"):
            prune.l1_unstructured(model.get_submodule(path), "weight", amount=0.5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        conv = model.features.denseblock1.denselayer1.conv1
        results.append((model(x).detach(), conv.weight_orig.grad.clone(), conv.weight.detach().clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forward_without_autograd_matches_the_naive_model(mode, training):
    """Inference tensors have no version counter: the block buffer must not
    watch its output there (it raised "Inference tensors do not track version
    counter"). Training mode still updates the running statistics once."""
    efficient, naive = efficient_and_naive(small_inputs=True)
    efficient.train(training)
    naive.train(training)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context():
        out_e, out_n = efficient(x), naive(x)
    torch.testing.assert_close(out_e, out_n, rtol=1e-9, atol=1e-10)
    for (name, a), b in zip(efficient.named_buffers(), naive.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
