"""effilayers.memory against hand-counted cases."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from effilayers import memory


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_linear_keeps_exactly_its_input():
    linear = nn.Linear(16, 4)
    x = torch.randn(8, 16)
    assert memory.activation_bytes(linear, x) == nbytes(x)


def test_linear_with_input_grad_still_keeps_only_its_input():
    # Needing grad w.r.t. x makes addmm save weight.t(), a view of a parameter.
    linear = nn.Linear(16, 4)
    x = torch.randn(8, 16, requires_grad=True)
    assert memory.activation_bytes(linear, x) == nbytes(x)


def test_parameters_are_not_counted_even_without_a_module():
    weight = nn.Parameter(torch.randn(8, 16))
    x = torch.randn(8, 16)
    # mul saves both operands; the Parameter is left out.
    assert memory.activation_bytes(lambda t: t * weight, x) == nbytes(x)


def test_views_of_parameters_are_not_counted_without_a_module():
    # Needing grad w.r.t. x makes the Linear save weight.t(): a view of the
    # parameter, not an nn.Parameter, with the parameter's 4 MiB storage.
    linear = nn.Linear(1024, 1024, bias=False)
    x = torch.randn(2, 1024, requires_grad=True)
    with memory.track_activations() as meter:
        out = linear(x)
    assert meter.bytes == nbytes(x)
    assert [s.nbytes for s in meter.storages()] == [nbytes(x)]
    del out


def test_a_detached_alias_of_a_saved_parameter_is_not_counted():
    weight = nn.Parameter(torch.randn(8, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with memory.track_activations() as meter:
        # Each mul saves both operands: x and the parameter, then the product
        # and an alias of the parameter that is not a view (same storage).
        product = x * weight
        out = product * weight.detach().requires_grad_()
    assert meter.bytes == nbytes(x) + nbytes(product)
    del out, product


def test_inplace_op_shares_storage_and_counts_once():
    w1 = nn.Parameter(torch.randn(16, 32))
    w2 = nn.Parameter(torch.randn(32, 4))
    x = torch.randn(8, 16)

    def forward(t):
        hidden = t @ w1  # saves t
        hidden.relu_()  # saves its result: hidden's storage
        return hidden @ w2  # saves hidden again

    hidden_bytes = 8 * 32 * 4
    assert memory.activation_bytes(forward, x) == nbytes(x) + hidden_bytes


def test_same_tensor_saved_twice_counts_once():
    x = torch.randn(10, 10, requires_grad=True)
    assert memory.activation_bytes(lambda t: t * t, x) == nbytes(x)


def test_views_share_their_base_storage():
    # Saving two halves of one tensor counts the whole storage once.
    x = torch.randn(4, 10)
    w = nn.Parameter(torch.randn(5, 3))
    assert memory.activation_bytes(lambda t: t[:, :5] @ w + t[:, 5:] @ w, x) == nbytes(x)


def test_excluded_tensors_and_modules():
    linear = nn.Linear(6, 6)
    x = torch.randn(3, 6)
    assert memory.activation_bytes(lambda t: linear(t), x, exclude=[x, linear]) == 0
    assert memory.activation_bytes(lambda t: linear(t), x, exclude=x) == 0


def test_conv_bn_relu_hand_count():
    block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(2, 3, 10, 10)
    conv_out = 2 * 8 * 10 * 10 * 4
    # conv keeps x; BN keeps its input (conv_out) and two per-channel
    # vectors (saved mean and invstd); ReLU keeps its output.
    expected = nbytes(x) + conv_out + 2 * 8 * 4 + conv_out
    assert memory.activation_bytes(block, x) == expected


def test_context_manager_matches_function_and_reports_storages():
    block = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    x = torch.randn(4, 5)
    with memory.track_activations(exclude=block) as meter:
        out = block(x)
    assert meter.bytes == memory.activation_bytes(block, x)
    storages = meter.storages()
    assert sum(s.nbytes for s in storages) == meter.bytes
    assert [s.nbytes for s in storages] == sorted((s.nbytes for s in storages), reverse=True)
    assert meter.largest(1)[0].nbytes == max(s.nbytes for s in storages)
    del out


def test_graph_dropped_inside_the_block_stops_counting():
    x = torch.randn(100, 100, requires_grad=True)
    with memory.track_activations() as meter:
        kept = x.exp()  # exp saves its output
        dropped = (x + 1).sin()  # sin saves its input
        del dropped
        gc.collect()
    assert meter.bytes == nbytes(kept)


def test_meter_does_not_keep_memory_alive():
    refs = []

    def forward(t):
        hidden = t.exp()
        refs.append(weakref.ref(hidden))
        return hidden.sin()

    memory.activation_bytes(forward, torch.randn(50, 50, requires_grad=True))
    gc.collect()
    assert refs[0]() is None


def test_no_grad_inside_is_zero():
    linear = nn.Linear(4, 4)
    with torch.no_grad():
        # activation_bytes turns grad on: measuring what training keeps.
        assert memory.activation_bytes(linear, torch.randn(2, 4)) == 8 * 4


def test_argument_errors():
    with pytest.raises(TypeError, match="fn must be callable"):
        memory.activation_bytes(42)
    with pytest.raises(TypeError, match="exclude: expected nn.Module"):
        memory.activation_bytes(lambda t: t * 2, torch.randn(2), exclude=["weight"])
    with pytest.raises(TypeError, match="fn must be callable"):
        memory.cuda_peak_bytes("step")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_peak_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        memory.cuda_peak_bytes(lambda: None)
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        memory.track_cuda_peak()


@pytest.mark.gpu
def test_cuda_peak_counts_a_temporary():
    resident = torch.empty(1 << 20, device="cuda")  # 4 MiB before the step
    size = 64 << 20

    def step():
        temporary = torch.empty(size // 4, device="cuda")
        temporary.fill_(1)
        del temporary

    with memory.track_cuda_peak() as meter:
        step()
    assert meter.baseline_bytes >= nbytes(resident)
    assert meter.step_bytes >= size
    assert memory.cuda_peak_bytes(step) >= size
    with pytest.raises(ValueError, match="must be a CUDA device"):
        memory.track_cuda_peak("cpu")
    del resident


def test_backward_works_through_the_meter():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(5, 7), nn.Sigmoid(), nn.Linear(7, 2))
    x = torch.randn(4, 5, requires_grad=True)
    block(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    with memory.track_activations(exclude=block) as meter:
        out = block(x)
    assert meter.bytes > 0
    out.pow(2).sum().backward()
    for got, want in zip([p.grad for p in block.parameters()] + [x.grad], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_meter_keeps_autograd_inplace_check():
    x = torch.randn(5, 5, requires_grad=True)
    with memory.track_activations() as meter:
        hidden = (x * 2).sigmoid()  # sigmoid saves its output
        hidden.mul_(3)  # ...which is then overwritten
    assert meter.bytes == 5 * 5 * 4
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        hidden.sum().backward()


def test_a_saved_slice_counts_its_span_not_the_whole_storage():
    # The user's report: a batch sliced out of a large dataset tensor.
    big = torch.randn(10000, 512)
    batch = big[:32]
    assert memory.activation_bytes(nn.Linear(512, 8), batch) == nbytes(batch)
    with memory.track_activations() as meter:
        out = nn.Linear(512, 8)(batch)
    [saved] = meter.storages()
    assert (saved.span_bytes, saved.nbytes, saved.storage_bytes) == (nbytes(batch), nbytes(batch), nbytes(big))
    assert meter.storage_bytes == nbytes(big)
    del out


def test_spans_of_views_of_one_storage_are_merged():
    x = torch.randn(20, 16)
    w = nn.Parameter(torch.randn(16, 3))
    row = 16 * 4
    # Rows 2..9 and 6..13 overlap on 6..9: together they span rows 2..13.
    assert memory.activation_bytes(lambda t: t[2:10] @ w + t[6:14] @ w, x) == 12 * row
    # Rows 0..3 and 10..12 leave a gap that does not count.
    assert memory.activation_bytes(lambda t: (t[0:4] @ w).sum() + (t[10:13] @ w).sum(), x) == 7 * row


def test_a_strided_view_spans_from_its_first_to_its_last_element():
    x = torch.randn(8, 16)
    w = nn.Parameter(torch.randn(1, 3))
    column = x[:, 3:4]  # elements 3, 19, ..., 115 of the storage
    assert memory.activation_bytes(lambda t: t @ w, column) == (7 * 16 + 1) * 4
    transposed = x[1:3].t()  # rows 1 and 2, whatever the order
    square = nn.Parameter(torch.randn(2, 3))
    assert memory.activation_bytes(lambda t: t @ square, transposed) == 2 * 16 * 4


def test_peak_bytes_survive_backward_inside_the_block():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(32, 512)
    forward_bytes = memory.activation_bytes(model, x)
    assert forward_bytes > 0
    with memory.track_activations(exclude=model) as meter:
        loss = model(x).sum()
        assert meter.bytes == meter.peak_bytes == forward_bytes
        loss.backward()
        # backward freed every saved tensor
        assert meter.bytes == 0 and meter.storages() == []
    assert meter.bytes == 0
    assert meter.peak_bytes == forward_bytes


def test_peak_is_the_largest_moment_not_the_sum_of_steps():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    small, large = torch.randn(4, 64), torch.randn(16, 64)
    with memory.track_activations(exclude=model) as meter:
        for x in (small, large, small):
            model(x).sum().backward()
    assert meter.bytes == 0
    assert meter.peak_bytes == memory.activation_bytes(model, large)


def test_peak_keeps_a_graph_dropped_inside_the_block():
    x = torch.randn(100, 100, requires_grad=True)
    with memory.track_activations() as meter:
        dropped = (x + 1).sin()  # saves its input: 40 kB
        wide = torch.cat([x, x]).exp()  # saves its output: 80 kB
        del dropped, wide
        kept = x.exp()
    assert meter.bytes == nbytes(kept)
    assert meter.peak_bytes == nbytes(x) + 2 * nbytes(x)
    del kept


def test_a_parameter_alias_saved_before_its_parameter_stops_counting():
    weight = nn.Parameter(torch.randn(8, 16))
    x = torch.randn(8, 16)
    with memory.track_activations() as meter:
        alias = weight.detach().requires_grad_()
        out = (x * alias) * weight  # saves x and the alias, then the product and weight
    assert meter.bytes == nbytes(x) * 2
    assert [s.saved_by for s in meter.storages()] == [1, 1]
    del out


def test_peak_bytes_under_torch_compile_match_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 64)
    eager = memory.activation_bytes(model, x)
    compiled = torch.compile(model, fullgraph=True)
    with memory.track_activations(exclude=model) as meter:
        loss = compiled(x).sum()
        assert meter.bytes == eager
        loss.backward()
    assert (meter.bytes, meter.peak_bytes) == (0, eager)


class _SavesWeightCopy(torch.autograd.Function):
    """Saves its input and a channels_last copy of the weight, as inductor's
    convolutions do under torch.compile on CPU."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight.contiguous(memory_format=torch.channels_last))
        return x * weight.sum()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight.sum(), (grad * x).sum().expand_as(weight)


def test_a_saved_copy_of_an_excluded_weight_does_not_count():
    conv = nn.Conv2d(8, 16, 3)
    x = torch.randn(2, 4)
    with memory.track_activations(exclude=conv) as meter:
        out = _SavesWeightCopy.apply(x, conv.weight)
    assert meter.bytes == nbytes(x)
    # without exclude the copy is a tensor like any other
    with memory.track_activations() as meter:
        out = _SavesWeightCopy.apply(x, conv.weight)
    assert meter.bytes == nbytes(x) + nbytes(conv.weight)
    # a saved tensor of the weight's shape with other values is an activation
    other = torch.randn_like(conv.weight).requires_grad_()
    with memory.track_activations(exclude=conv) as meter:
        out = _SavesWeightCopy.apply(x, other)
    assert meter.bytes == nbytes(x) + nbytes(other)
    del out


def test_compiled_convolutions_count_activations_not_weight_copies():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    eager = memory.activation_bytes(model, x)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).sum().backward()
    with memory.track_activations(exclude=model) as meter:
        loss = compiled(x).sum()
        shapes = [s.shape for s in meter.storages()]
        loss.backward()
    weight_shapes = [tuple(p.shape) for p in model.parameters() if p.dim() >= 2]
    assert not [shape for shape in shapes if tuple(shape) in weight_shapes], shapes
    # the partitioner recomputes BatchNorm + ReLU rather than keep their outputs
    assert 0 < meter.peak_bytes <= eager
