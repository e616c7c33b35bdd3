"""effilayers.checkpoint: torch's non-reentrant checkpoint with running
statistics updated once per forward and in-place layers at a segment's
start; float64 against the plain (un-checkpointed) model."""

from __future__ import annotations

import copy
import functools
import gc
import math

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import effilayers
from effilayers import memory
from effilayers.checkpoint import (
    checkpoint,
    checkpoint_sequential,
    lean_segment_ok,
    recompute_in_backward,
    sqrt_segments,
)
from effilayers.models.densenet import DenseLayer

from .helpers import OutputSpy

DTYPE = torch.float64


def _norm(kind: str, channels: int) -> nn.Module:
    return {"batchnorm": lambda: nn.BatchNorm2d(channels),
            "cumulative": lambda: nn.BatchNorm2d(channels, momentum=None),
            "syncbatchnorm": lambda: nn.SyncBatchNorm(channels),
            "instancenorm": lambda: nn.InstanceNorm2d(channels, affine=True, track_running_stats=True),
            "abn": lambda: effilayers.nn.ABN(channels),
            "inplace_abn": lambda: effilayers.nn.InPlaceABN(channels),
            "inplace_abn_sync": lambda: effilayers.nn.InPlaceABNSync(channels)}[kind]()


NORMS = ["batchnorm", "cumulative", "syncbatchnorm", "instancenorm", "abn", "inplace_abn", "inplace_abn_sync"]


def conv_norm_relu(kind: str, blocks: int, channels: int = 4, dropout: float = 0.0) -> nn.Sequential:
    """``blocks`` x (Conv, norm, ReLU[, Dropout]); the ABN norms carry their activation."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), _norm(kind, channels)]
        if kind not in ("abn", "inplace_abn", "inplace_abn_sync"):
            layers.append(nn.ReLU())
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers).to(DTYPE)


def train(model: nn.Module, forward, steps: int = 3, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``steps`` SGD steps of ``forward(model, x)``; the parameter gradients of each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    gradients = []
    for step in range(steps):
        x = torch.randn(3, 4, 5, 5, dtype=DTYPE, generator=generator) * (1 + step)
        torch.manual_seed(100 + step)  # the same dropout masks in every model
        optimizer.zero_grad(set_to_none=True)
        forward(model, x).square().mean().backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    return gradients


def assert_buffers_equal(model: nn.Module, reference: nn.Module) -> None:
    buffers, expected = dict(model.named_buffers()), dict(reference.named_buffers())
    assert buffers.keys() == expected.keys() and buffers
    for name, value in expected.items():
        torch.testing.assert_close(buffers[name], value, rtol=1e-12, atol=1e-14, msg=name)


def assert_gradients_equal(gradients, expected) -> None:
    for step, (got, want) in enumerate(zip(gradients, expected, strict=True)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12,
                                       msg=lambda text: f"step {step}, {name}: {text}")


def plain_forward(model, x):
    return model(x)


@pytest.mark.parametrize("kind, segments", [(kind, "sqrt") for kind in NORMS] + [("batchnorm", 2), ("cumulative", 5)])
def test_checkpoint_sequential_matches_the_plain_model(kind, segments):
    torch.manual_seed(0)
    plain = conv_norm_relu(kind, blocks=6)
    checkpointed = copy.deepcopy(plain)
    expected = train(plain, plain_forward)
    gradients = train(checkpointed, lambda model, x: checkpoint_sequential(model, segments, x))
    assert_gradients_equal(gradients, expected)
    assert_buffers_equal(checkpointed, plain)
    if kind == "instancenorm":  # InstanceNorm counts no batches
        assert all(not torch.equal(norm.running_mean, torch.zeros(4, dtype=DTYPE)) for norm in plain[1::3])
    else:
        counters = [value for name, value in plain.named_buffers() if name.endswith("num_batches_tracked")]
        assert len(counters) == 6 and all(int(value) == 3 for value in counters)


@pytest.mark.parametrize("kind", ["batchnorm", "cumulative", "abn"])
def test_torchs_checkpoint_sequential_updates_running_statistics_twice(kind):
    """What effilayers.checkpoint corrects: torch's recomputation runs every
    checkpointed norm's training forward again."""
    torch.manual_seed(0)
    plain = conv_norm_relu(kind, blocks=6)
    torchs = copy.deepcopy(plain)
    train(plain, plain_forward)
    train(torchs, lambda model, x: torch_checkpoint.checkpoint_sequential(model, 3, x, use_reentrant=False))
    counters = [int(value) for name, value in torchs.named_buffers() if name.endswith("num_batches_tracked")]
    # the first two segments (blocks 0-3) are checkpointed, the last is not
    assert counters == [6, 6, 6, 6, 3, 3]
    if kind != "cumulative":  # a cumulative average of each batch twice is the same average
        first = dict(plain.named_buffers())["1.running_mean"]
        assert not torch.allclose(dict(torchs.named_buffers())["1.running_mean"], first, rtol=1e-6, atol=1e-9)


def test_dropout_gives_the_plain_models_gradients():
    torch.manual_seed(0)
    plain = conv_norm_relu("batchnorm", blocks=6, dropout=0.3)
    checkpointed, unreplayed = copy.deepcopy(plain), copy.deepcopy(plain)
    expected = train(plain, plain_forward)
    gradients = train(checkpointed, lambda model, x: checkpoint_sequential(model, "sqrt", x))
    assert_gradients_equal(gradients, expected)
    assert_buffers_equal(checkpointed, plain)
    # The replayed draws are what makes them equal: without them the
    # recomputation draws other masks.
    other = train(unreplayed, lambda model, x: checkpoint_sequential(model, "sqrt", x, preserve_rng_state=False))
    with pytest.raises(AssertionError):
        assert_gradients_equal(other, expected)


@pytest.mark.parametrize("first", ["inplace_abn", "inplace_relu"])
def test_an_in_place_layer_at_a_segments_start(first):
    """The segment's first layer writes over its input: torch's checkpoint
    fails in backward; here the recomputation starts from the intact input."""
    torch.manual_seed(0)
    head = nn.Conv2d(4, 4, 1).to(DTYPE)
    opening = effilayers.nn.InPlaceABN(4).to(DTYPE) if first == "inplace_abn" else nn.ReLU(inplace=True)
    segment = nn.Sequential(opening, nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                            nn.Conv2d(4, 4, 1), effilayers.nn.InPlaceABN(4)).to(DTYPE)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)

    def run(checkpointing, head, segment):
        features = head(x)
        before = features.detach().clone()
        out = checkpointing(segment, features)
        torch.testing.assert_close(features.detach(), before, rtol=0, atol=0)  # the caller's tensor kept
        out.square().mean().backward()
        return out.detach()

    reference_head, reference_segment = copy.deepcopy(head), copy.deepcopy(segment)
    features = reference_head(x)
    expected = reference_segment(features)
    expected.square().mean().backward()
    out = run(checkpoint, head, segment)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-14)
    for name, parameter in head.named_parameters():
        torch.testing.assert_close(parameter.grad, dict(reference_head.named_parameters())[name].grad,
                                   rtol=1e-10, atol=1e-12)
    for name, parameter in segment.named_parameters():
        torch.testing.assert_close(parameter.grad, dict(reference_segment.named_parameters())[name].grad,
                                   rtol=1e-10, atol=1e-12)
    assert_buffers_equal(segment, reference_segment)
    # torch's own checkpoint cannot run this segment
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch_head = copy.deepcopy(reference_head)
        torch_checkpoint.checkpoint(copy.deepcopy(reference_segment), torch_head(x),
                                    use_reentrant=False).sum().backward()


def test_in_place_abn_at_every_segments_start():
    """checkpoint_sequential over blocks that start with InPlaceABN."""
    torch.manual_seed(0)
    layers = []
    for _ in range(5):
        layers += [effilayers.nn.InPlaceABN(4), nn.Conv2d(4, 4, 3, padding=1)]
    plain = nn.Sequential(nn.Conv2d(4, 4, 1), *layers).to(DTYPE)
    checkpointed = copy.deepcopy(plain)
    expected = train(plain, plain_forward)
    # functions: the head conv, then pairs; segments of 1 start at every other InPlaceABN
    gradients = train(checkpointed, lambda model, x: checkpoint_sequential(model, 11, x))
    assert_gradients_equal(gradients, expected)
    assert_buffers_equal(checkpointed, plain)


def _model_and_calls():
    torch.manual_seed(0)
    block = conv_norm_relu("batchnorm", blocks=2)
    return block, {
        "module": lambda model, x: checkpoint(model, x),
        "bound method": lambda model, x: checkpoint(model.forward, x),
        "closure": lambda model, x: checkpoint(lambda t: model(t) * 2, x),
        "partial": lambda model, x: checkpoint(functools.partial(nn.Sequential.__call__, model), x),
        "module argument": lambda model, x: checkpoint(lambda m, t: m(t), model, x),
        "list in a closure": lambda model, x: checkpoint(lambda t: [model][0](t), x),
    }


@pytest.mark.parametrize("how", list(_model_and_calls()[1]))
@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpoint_finds_the_norms_its_function_reaches(how, early_stop):
    block, calls = _model_and_calls()
    reference = copy.deepcopy(block)
    factor = 2 if how == "closure" else 1
    expected = train(reference, lambda model, x: model(x) * factor)
    call = calls[how]
    gradients = train(block, lambda model, x: _with_early_stop(early_stop, call, model, x))
    assert_gradients_equal(gradients, expected)
    assert_buffers_equal(block, reference)


def _with_early_stop(early_stop, call, model, x):
    with torch_checkpoint.set_checkpoint_early_stop(early_stop):
        return call(model, x)


GLOBAL_BLOCK = None


def test_checkpoint_finds_a_module_a_lambda_reads_as_a_global():
    global GLOBAL_BLOCK
    torch.manual_seed(0)
    GLOBAL_BLOCK = conv_norm_relu("batchnorm", blocks=2)
    reference = copy.deepcopy(GLOBAL_BLOCK)
    try:
        expected = train(reference, plain_forward)
        gradients = train(GLOBAL_BLOCK, lambda model, x: checkpoint(lambda t: GLOBAL_BLOCK(t), x))
        assert_gradients_equal(gradients, expected)
        assert_buffers_equal(GLOBAL_BLOCK, reference)
    finally:
        GLOBAL_BLOCK = None


def test_retain_graph_recomputes_twice_and_still_updates_once():
    torch.manual_seed(0)
    block = conv_norm_relu("batchnorm", blocks=2)
    reference = copy.deepcopy(block)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)
    expected = reference(x).square().mean()
    loss = checkpoint(block, x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    expected.backward(retain_graph=True)
    expected.backward()
    assert_buffers_equal(block, reference)
    for (name, parameter), reference_parameter in zip(block.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, reference_parameter.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("memory_efficient", [True, False])
def test_a_densenet_layers_norms_update_once(memory_efficient):
    """The bottleneck's norm1, which the memory-efficient path updates
    through its own op, not by calling the module."""
    torch.manual_seed(0)
    layer = DenseLayer(6, 4, 2, 0.0, memory_efficient=memory_efficient).to(DTYPE)
    reference = copy.deepcopy(layer)
    features = [torch.randn(3, 3, 5, 5, dtype=DTYPE) for _ in range(2)]
    reference(features).square().mean().backward()
    checkpoint(lambda *maps: layer(list(maps)), *features).square().mean().backward()
    assert int(layer.norm1.num_batches_tracked) == 1
    assert_buffers_equal(layer, reference)
    for (name, parameter), reference_parameter in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, reference_parameter.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_eval_mode_and_no_grad_leave_running_statistics_alone():
    torch.manual_seed(0)
    block = conv_norm_relu("batchnorm", blocks=2)
    before = copy.deepcopy(block)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE, requires_grad=True)
    checkpoint_sequential(block.eval(), 2, x).sum().backward()
    assert_buffers_equal(block, before)
    with torch.no_grad():
        checkpoint_sequential(block.train(), 2, x)
    reference = copy.deepcopy(before).train()
    with torch.no_grad():
        reference(x)
    assert_buffers_equal(block, reference)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8, 9, 10, 63, 64, 65, 1000])
def test_sqrt_segments_is_the_ceiling_of_the_square_root(count):
    assert sqrt_segments(count) == math.ceil(math.sqrt(count))


def test_sqrt_segments_split_as_torch_splits():
    """64 functions: 8 segments of 8, the first 7 checkpointed (their
    recomputation shows as a second call of their modules in backward)."""
    calls = [0] * 64

    def counter(index):
        def function(x):
            calls[index] += 1
            return x.sin() + 1  # sin saves its input: a recomputation needs it

        return function

    functions = [counter(i) for i in range(64)]
    x = torch.randn(3, dtype=DTYPE, requires_grad=True)
    checkpoint_sequential(functions, "sqrt", x).sum().backward()
    assert calls == [2] * 56 + [1] * 8
    expected = x.detach().clone().requires_grad_()
    value = expected
    for function in functions:
        value = function(value)
    value.sum().backward()
    torch.testing.assert_close(x.grad, expected.grad, rtol=1e-12, atol=1e-14)


def test_sqrt_segments_keep_under_a_third_of_the_activation_bytes():
    """64 Conv-BN-ReLU blocks: ceil(sqrt(64)) = 8 segments keep the inputs of 7
    and the last segment's activations; the meter counts what autograd keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
                            for _ in range(64)])
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    plain = memory.activation_bytes(model, x)
    checkpointed = memory.activation_bytes(lambda t: checkpoint_sequential(model, "sqrt", t), x, exclude=model)
    assert plain > 0 and checkpointed > 0
    assert checkpointed <= 0.3 * plain, (checkpointed, plain)
    # the meter sees the checkpoints: the inputs of the 7 checkpointed segments at least
    assert checkpointed >= 7 * x.numel() * x.element_size()


@pytest.mark.parametrize("sequential", [False, True])
def test_compiled_checkpoint_updates_running_statistics_once(sequential):
    """Under torch.compile the recomputation is AOTAutograd's (aot_eager:
    its partitioner without code generation); the buffers move once."""
    torch.manual_seed(0)
    block = conv_norm_relu("batchnorm", blocks=3)
    reference = copy.deepcopy(block)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE, requires_grad=True)
    if sequential:
        compiled = torch.compile(lambda t: checkpoint_sequential(block, "sqrt", t), backend="aot_eager", fullgraph=True)
    else:
        compiled = torch.compile(lambda t: checkpoint(block, t), backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().mean().backward()
    expected = reference(x)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)
    assert_buffers_equal(block, reference)
    for (name, parameter), reference_parameter in zip(block.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, reference_parameter.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_only_the_input_is_kept_the_copy_is_not():
    """A checkpointed block keeps exactly its input for backward; the copy
    the function receives is not saved."""
    torch.manual_seed(0)
    block = conv_norm_relu("batchnorm", blocks=3)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE, requires_grad=True)
    assert memory.activation_bytes(lambda t: checkpoint(block, t), x, exclude=block) == x.numel() * x.element_size()
    assert memory.activation_bytes(block, x) > 3 * x.numel() * x.element_size()


class CountingContext:
    def __init__(self):
        self.entered = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc_info):
        return False


def test_a_callers_context_fn_runs_beside_the_bookkeeping():
    torch.manual_seed(0)
    block = conv_norm_relu("batchnorm", blocks=2)
    reference = copy.deepcopy(block)
    forward_context, recompute_context = CountingContext(), CountingContext()
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)
    scale = torch.tensor(1.5, dtype=DTYPE)
    out = checkpoint(lambda t, factor: block(t) * factor, x, factor=scale,
                     context_fn=lambda: (forward_context, recompute_context))
    out.square().mean().backward()
    (reference(x) * scale).square().mean().backward()
    assert (forward_context.entered, recompute_context.entered) == (1, 1)
    assert_buffers_equal(block, reference)
    for (name, parameter), reference_parameter in zip(block.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, reference_parameter.grad, rtol=1e-10, atol=1e-12, msg=name)


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("segments, error, message", [
    (0, ValueError, "segments must be a positive int or 'sqrt', got 0"),
    (-2, ValueError, "segments must be a positive int or 'sqrt', got -2"),
    (2.0, TypeError, "segments must be a positive int or 'sqrt', got float"),
    (True, TypeError, "segments must be a positive int or 'sqrt', got bool"),
    ("half", ValueError, "segments must be a positive int or 'sqrt', got 'half'"),
    (5, ValueError, "segments=5 is more than the 4 functions"),
])
def test_bad_segments(segments, error, message):
    model = conv_norm_relu("batchnorm", blocks=1).append(nn.Identity())
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)
    with pytest.raises(error, match=message):
        checkpoint_sequential(model, segments, x)


def test_more_segments_than_functions_is_a_value_error_in_torch_too():
    model = conv_norm_relu("batchnorm", blocks=1)
    with pytest.raises(ValueError):
        torch_checkpoint.checkpoint_sequential(model, len(model) + 1, torch.randn(3, 4, 5, 5, dtype=DTYPE),
                                               use_reentrant=False)


def test_bad_arguments():
    model = conv_norm_relu("batchnorm", blocks=1)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)
    with pytest.raises(ValueError, match="checkpoint: use_reentrant=True is not supported"):
        checkpoint(model, x, use_reentrant=True)
    with pytest.raises(ValueError, match="checkpoint_sequential: use_reentrant=True is not supported"):
        checkpoint_sequential(model, 2, x, use_reentrant=True)
    with pytest.raises(TypeError, match="use_reentrant must be None or False, got 'no'"):
        checkpoint(model, x, use_reentrant="no")
    with pytest.raises(TypeError, match="checkpoint: function must be callable, got int"):
        checkpoint(3, x)
    with pytest.raises(TypeError, match="functions must be an nn.Sequential or a list or tuple of callables"):
        checkpoint_sequential(nn.Linear(2, 2), 1, x)
    with pytest.raises(TypeError, match=r"functions\[1\] is not callable \(int\)"):
        checkpoint_sequential([model, 3], 1, x)
    with pytest.raises(ValueError, match="functions is empty"):
        checkpoint_sequential([], 1, x)
    with pytest.raises(ValueError, match="unexpected keyword arguments: bogus"):
        checkpoint_sequential(model, 2, x, bogus=1)
    with pytest.raises(ValueError, match="debug=True cannot be combined"):
        checkpoint(model, x, debug=True)


# recompute_in_backward: the lean segment fit runs (forward without a graph,
# recomputation with gradients in backward).

def lean_forward(segments: int):
    """``forward(model, x)`` running ``model`` (an nn.Sequential) as ``segments`` lean segments."""
    def forward(model, x):
        children = list(model)
        size = -(-len(children) // segments)
        for start in range(0, len(children), size):
            x = recompute_in_backward(children[start:start + size], x)
        return x

    return forward


@pytest.mark.parametrize("kind", ["batchnorm", "cumulative", "abn", "inplace_abn"])
def test_lean_segments_match_the_plain_model(kind):
    torch.manual_seed(0)
    model = conv_norm_relu(kind, 4, dropout=0.25)
    reference = copy.deepcopy(model)
    assert lean_segment_ok(list(model)[:4], torch.randn(3, 4, 5, 5, dtype=DTYPE))
    assert_gradients_equal(train(model, lean_forward(3)), train(reference, plain_forward))
    assert_buffers_equal(model, reference)


def _input_and_parameter_gradients(model, x, forward):
    x = x.clone().requires_grad_()
    out = forward(model, x)
    weights = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    return torch.autograd.grad((out * weights).sum(), [x, *model.parameters()])


def test_lean_segment_answers_autograd_grad_and_leaves_dot_grad_alone():
    torch.manual_seed(0)
    model = conv_norm_relu("batchnorm", 2)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)
    got = _input_and_parameter_gradients(model, x, lean_forward(1))
    want = _input_and_parameter_gradients(reference, x, plain_forward)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())
    assert_buffers_equal(model, reference)


def test_lean_segment_of_an_input_without_gradients_and_frozen_parameters():
    torch.manual_seed(0)
    model = conv_norm_relu("batchnorm", 2)
    model[0].weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)  # the images: no gradient wanted
    lean_forward(1)(model, x).square().mean().backward()
    reference(x).square().mean().backward()
    assert model[0].weight.grad is None
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    for p in model.parameters():
        p.requires_grad_(False)
    assert not lean_forward(1)(model, x).requires_grad


@pytest.mark.parametrize("first", ["relu_inplace", "inplace_abn"])
def test_lean_segment_starting_with_an_in_place_layer(first):
    torch.manual_seed(0)
    head = nn.ReLU(inplace=True) if first == "relu_inplace" else effilayers.nn.InPlaceABN(4).to(DTYPE)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1).to(DTYPE), head,
                          nn.Conv2d(4, 4, 3, padding=1).to(DTYPE), nn.BatchNorm2d(4).to(DTYPE))
    reference = copy.deepcopy(model)

    def forward(model, x):
        # the segment starts at the in-place layer, whose input is a non-leaf
        return recompute_in_backward(list(model)[1:], model[0](x))

    assert_gradients_equal(train(model, forward), train(reference, plain_forward))
    assert_buffers_equal(model, reference)


def test_lean_segment_with_retain_graph_recomputes_twice_and_updates_once():
    torch.manual_seed(0)
    model = conv_norm_relu("batchnorm", 2)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)
    for m, forward in ((model, lean_forward(1)), (reference, plain_forward)):
        loss = forward(m, x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert_buffers_equal(model, reference)


def test_lean_segment_second_derivatives():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Softplus()).to(DTYPE)
    x = torch.randn(4, 5, dtype=DTYPE)

    def second(forward):
        leaf = x.clone().requires_grad_()
        (first,) = torch.autograd.grad(forward(model, leaf).square().sum(), leaf, create_graph=True)
        return torch.autograd.grad(first.square().sum(), [leaf, *model.parameters()])

    for got, want in zip(second(lean_forward(2)), second(plain_forward), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_lean_segment_replays_cpu_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).float()
    x = torch.randn(6, 8)

    def gradients(forward):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(model, x.clone().requires_grad_())
        assert out.dtype == torch.bfloat16
        return torch.autograd.grad(out.float().square().sum(), list(model.parameters()))

    # the recomputation casts as the forward did: the same bf16 products, bit for bit
    for got, want in zip(gradients(lean_forward(1)), gradients(plain_forward), strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_lean_segment_keeps_only_its_input():
    torch.manual_seed(0)
    model = conv_norm_relu("batchnorm", 3)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE, requires_grad=True)
    pre = model[0]
    with memory.track_activations(exclude=model) as meter:
        middle = pre(x)
        out = recompute_in_backward(list(model)[1:], middle)
    storages = meter.storages()
    # the conv before the segment saves x; the segment saves its input only
    assert {s.key for s in storages} == {memory.storage_key(x), memory.storage_key(middle)}
    assert meter.bytes == 2 * x.numel() * x.element_size()
    out.sum().backward()
    assert meter.bytes == 0


class _ReadsAnOutsideWeight(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.reads = [weight]  # not a parameter of this module

    def forward(self, x):
        return x * self.reads[0]


def test_lean_segment_ok_refuses_what_it_cannot_differentiate_and_the_probe_leaves_no_trace():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, 5, dtype=DTYPE)
    outside = nn.Parameter(torch.randn(4, 1, 1, dtype=DTYPE))
    norm = nn.BatchNorm2d(4).to(DTYPE)
    modules = [norm, nn.Dropout(0.5), _ReadsAnOutsideWeight(outside)]
    state = torch.get_rng_state()
    assert not lean_segment_ok(modules, x)
    assert torch.equal(torch.get_rng_state(), state)
    assert norm.num_batches_tracked.item() == 0 and torch.equal(norm.running_mean, torch.zeros(4, dtype=DTYPE))
    with memory.track_activations() as meter:
        assert lean_segment_ok(modules[:2], x)
    assert meter.peak_bytes == 0

    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    assert not lean_segment_ok([Pair()], x)
    assert not lean_segment_ok([norm], [x])
    # a frozen outside tensor would get no gradient once unfrozen; one made
    # from the run's own parameter outside it has a graph of its own
    assert not lean_segment_ok([_ReadsAnOutsideWeight(torch.randn(4, 1, 1, dtype=DTYPE))], x)
    scale = nn.Conv2d(4, 4, 1).to(DTYPE)
    assert not lean_segment_ok([scale, _ReadsAnOutsideWeight(scale.weight.sum() * 2)], x)
    assert lean_segment_ok([scale, nn.ReLU(inplace=True), norm], x)


def test_the_probe_frees_its_graph():
    # A probe that saved the ReLU's output itself leaked every probed
    # segment's activations for good (a cycle through autograd's C++ nodes).
    spy = OutputSpy()
    assert lean_segment_ok([nn.Conv2d(4, 4, 1).to(DTYPE), spy], torch.randn(3, 4, 5, 5, dtype=DTYPE))
    gc.collect()
    assert spy.outputs and spy.alive() == 0


def test_fit_falls_back_to_checkpoint_where_the_probe_refuses():
    outside = nn.Parameter(torch.randn(8, 1, 1, dtype=DTYPE))

    def build():
        torch.manual_seed(0)
        layers = [nn.Conv2d(3, 8, 3, padding=1, bias=False)]
        for _ in range(4):
            layers += [nn.BatchNorm2d(8), _ReadsAnOutsideWeight(outside), nn.Conv2d(8, 8, 3, padding=1, bias=False)]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten()).to(DTYPE)

    model, reference = build(), build()
    x = torch.randn(2, 3, 8, 8, dtype=DTYPE)
    effilayers.fit(model, x, 0.5)
    assert model._fit_segments and model._fit_lean and not any(model._fit_lean.values())
    model(x).square().sum().backward()
    got = outside.grad.clone()
    outside.grad = None
    reference(x).square().sum().backward()
    torch.testing.assert_close(got, outside.grad, rtol=1e-10, atol=1e-12)


def _segment_against_plain(build, loss, segment=lambda modules, x: recompute_in_backward(modules, x)):
    """``loss(run, modules, x)`` on fresh modules from ``build``, with the modules run plainly and as a lean
    segment; returns both runs' (parameter gradients, input gradient)."""
    results = []
    for run in (lambda modules, x: functools.reduce(lambda value, module: module(value), modules, x), segment):
        torch.manual_seed(0)
        modules = build()
        x = torch.randn(6, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss(run, modules, x)
        results.append(([p.grad for m in modules for p in m.parameters()], x.grad))
    return results


def _assert_same(results):
    (grads, input_grad), (want, want_input) = results
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(input_grad, want_input, rtol=1e-10, atol=1e-12)


def test_lean_segment_hands_hooked_modules_to_the_checkpoint():
    # a forward hook keeps an inner output for a second loss; a hook on a
    # parameter must run once: both run through the non-reentrant checkpoint
    def build():
        modules = [nn.Linear(4, 4).to(DTYPE), nn.Tanh(), nn.Linear(4, 4).to(DTYPE)]
        modules[1].register_forward_hook(lambda module, args, output: features.append(output))
        modules[2].weight.register_hook(lambda grad: calls.append(1) or grad * 2)
        return modules

    def loss(run, modules, x):
        (run(modules, x).sum() + features[-1].square().sum()).backward()

    features, calls = [], []
    _assert_same(_segment_against_plain(build, loss))
    assert len(calls) == 2  # once per run


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_lean_segment_double_backward_through_a_norm_and_a_parameter_used_before_it():
    def build():
        return [nn.Linear(4, 6).to(DTYPE), nn.BatchNorm1d(6).to(DTYPE), nn.Tanh(), nn.Linear(6, 4).to(DTYPE)]

    def loss(run, modules, x):
        before = modules[3](modules[2](modules[1](modules[0](x))))  # the same modules ahead of the segment
        run(modules, before).square().sum().backward(create_graph=True)
        x.grad.square().sum().backward()

    _assert_same(_segment_against_plain(build, loss))


def _through_checkpoint(modules, x):
    return checkpoint(lambda value: functools.reduce(lambda out, module: module(out), modules, value), x)


@pytest.mark.parametrize("segment", [recompute_in_backward, _through_checkpoint], ids=["lean", "checkpoint"])
def test_segment_sharing_a_norm_with_the_code_around_it_and_ending_in_a_view(segment):
    def build():
        return [nn.Linear(4, 4).to(DTYPE), nn.BatchNorm1d(4).to(DTYPE), nn.Flatten(0)]

    def loss(run, modules, x):
        outside = modules[1](x)  # the norm's buffers are saved by this graph too
        out = run(modules, outside)
        nn.ReLU(inplace=True)(out).sum().backward()  # in place on the segment's output, a view

    _assert_same(_segment_against_plain(build, loss, segment))
