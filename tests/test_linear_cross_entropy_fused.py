"""The fused Triton path of linear_cross_entropy (``ops/linear_cross_entropy/
triton.py``), under the interpreter on CPU and on a GPU: values and
gradients against float64 F.linear + F.cross_entropy with token and class
counts that do not divide the tiles, one class tile and many, one class
split and many, ignored and all-ignored rows, label smoothing, class and
token weights, every reduction; gradcheck; fp32/fp16/bf16 within the
stated bound; no tensor of tokens x classes is ever created; and the cases
that run the chunked path instead (an explicit chunk_size, probability
targets); and the fused path under deterministic algorithms."""

from __future__ import annotations

import pytest
import torch

from effilayers import memory
from effilayers.functional import linear_cross_entropy
from effilayers.ops.linear_cross_entropy import op as lce_op, triton as kernels, vocab_chunks

from .accuracy import assert_close
from .conftest import backend_params, forced_backend
from .linear_cross_entropy_cases import (
    LargestTemporary,
    assert_same,
    fused,
    grad_output_for,
    make_positive,
    make_problem,
    unfused,
)

REDUCTIONS = ["mean", "sum", "none"]
SMALL_TILE = (16, 16, 16, 4)  # tl.dot's smallest operand: many tiles at test sizes


@pytest.fixture(params=backend_params("linear_cross_entropy_stats", backends=["triton"]))
def fused_device(request, monkeypatch):
    """The fused path on one device (the Triton interpreter, or CUDA), with
    16-wide tiles and at most 4 programs per statistics pass, so small
    problems run many tiles and split their classes."""
    for table in (kernels.STATS_TILES, kernels.GRAD_TILES, kernels.STATS_TILES_SM90, kernels.GRAD_TILES_SM90):
        monkeypatch.setitem(table, torch.float16, SMALL_TILE)
        monkeypatch.setitem(table, torch.bfloat16, SMALL_TILE)
        monkeypatch.setitem(table, torch.float32, SMALL_TILE)
        monkeypatch.setitem(table, torch.float64, SMALL_TILE)
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 4)
    # Gradient chunks of 32 classes (two tiles wide) at test sizes: many chunks, the last short.
    monkeypatch.setattr(vocab_chunks, "GRADIENT_CHUNK_BYTES", 1)
    monkeypatch.setattr(vocab_chunks, "GRADIENT_CHUNK_ALIGN", 32)
    yield from forced_backend(request, "linear_cross_entropy_stats")


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times each fused pass ran: the kernels the op finds, counted.
    (Wrapping what the op looks up, not the registry's cached choices, which
    outlive the test's forced backend.)"""
    calls = {"stats": 0, "grads": 0}
    find = lce_op._fused_kernels

    def counted(device):
        found = find(device)
        if found is None:
            return None

        def count(key, kernel):
            def run(*args, **kwargs):
                calls[key] += 1
                return kernel(*args, **kwargs)
            return run

        return count("stats", found[0]), count("grads", found[1])

    monkeypatch.setattr(lce_op, "_fused_kernels", counted)
    return calls


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("class_weighted", [False, True], ids=["unweighted", "class_weighted"])
def test_matches_torch_float64(fused_device, kernel_calls, reduction, label_smoothing, class_weighted):
    # 37 tokens (3 tiles, the last short), 45 classes (3 class tiles over 3 splits), hidden 20 (2 K steps).
    x, w, b, target = make_problem((37,), 20, 45, torch.float64, fused_device, ignore_every=4)
    class_weight = make_positive(45, fused_device) if class_weighted else None
    grad_output = grad_output_for((37,), reduction, fused_device)
    options = dict(label_smoothing=label_smoothing, reduction=reduction)
    expected = unfused(x, w, b, target, grad_output, class_weight=class_weight, **options)
    actual = fused(x, w, b, target, grad_output, class_weight=class_weight, **options)
    assert_same(actual, expected, torch.float64)
    # One statistics pass for every reduction (backward reads its terms), one gradient launch per 32-class chunk.
    assert kernel_calls["stats"] == 1 and kernel_calls["grads"] == 2


@pytest.mark.parametrize("tokens, classes", [(1, 1), (5, 16), (16, 17), (33, 160)])
def test_shapes_around_the_tiles(fused_device, kernel_calls, tokens, classes):
    # One class, one exact tile, one class past it, and ten class tiles (more than the splits).
    x, w, b, target = make_problem((tokens,), 18, classes, torch.float64, fused_device, ignore_every=3)
    assert_same(fused(x, w, b, target), unfused(x, w, b, target), torch.float64)
    assert kernel_calls["grads"] == -(-classes // 32)


def test_without_bias_custom_ignore_index_and_token_weights(fused_device):
    x, w, _, target = make_problem((2, 11), 7, 30, torch.float64, fused_device, bias=False, ignore_every=3,
                                   ignore_index=2)
    token_weight = make_positive((2, 11), fused_device, seed=8)
    actual = fused(x, w, None, target, ignore_index=2, token_weight=token_weight, reduction="sum")
    # "sum" with token weights: sum_i s_i * l_i, whose gradient is torch's unreduced loss's with grad_output s.
    rows, grads = unfused(x, w, None, target, token_weight, ignore_index=2, reduction="none")
    assert_same(actual, ((rows * token_weight).sum(), grads), torch.float64)


def test_all_ignored_rows(fused_device):
    x, w, b, target = make_problem((20,), 6, 19, torch.float64, fused_device)
    target[:16] = -100  # the first token tile is all ignored
    assert_same(fused(x, w, b, target), unfused(x, w, b, target), torch.float64)
    target[:] = -100  # every row: mean is 0 / 0, as torch's
    loss, grads = fused(x, w, b, target, reduction="sum")
    assert loss.item() == 0 and all(bool((g == 0).all()) for g in grads)
    assert torch.isnan(fused(x, w, b, target)[0])


def test_no_tokens(fused_device):
    x, w, b, target = make_problem((0,), 6, 19, torch.float64, fused_device)
    for reduction in REDUCTIONS:
        assert_same(fused(x, w, b, target, reduction=reduction), unfused(x, w, b, target, reduction=reduction),
                    torch.float64)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck(fused_device, reduction):
    # 19 tokens, 21 classes: two tiles each way. Fast mode (random directions)
    # keeps the interpreter's launches few; the float64 tests above hold
    # every gradient element.
    x, w, b, target = make_problem((19,), 5, 21, torch.float64, fused_device, ignore_every=3)
    class_weight = make_positive(21, fused_device)

    def fn(x, w, b):
        return linear_cross_entropy(x, w, target, b, label_smoothing=0.1, reduction=reduction,
                                    class_weight=class_weight)

    leaves = tuple(t.clone().requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision_within_stated_bound(fused_device, kernel_calls, monkeypatch, dtype, reduction):
    # Fewer launches (the interpreter's cost): 128-class chunks, grad_input summed for every token at once.
    monkeypatch.setattr(vocab_chunks, "GRADIENT_CHUNK_ALIGN", 128)
    monkeypatch.setattr(lce_op, "INPUT_SUM_SHARE", 1.0)
    x, w, b, target = make_problem((37,), 24, 300, dtype, fused_device, ignore_every=5)
    grad_output = grad_output_for((37,), reduction, fused_device, dtype)
    options = dict(label_smoothing=0.05, reduction=reduction)
    loss, grads = actual = fused(x, w, b, target, grad_output, **options)
    assert loss.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert_same(actual, unfused(x, w, b, target, grad_output, **options), dtype, grad_tier="linear_cross_entropy")
    assert kernel_calls["grads"] == 3


def _pause_during_launches(meter, monkeypatch):
    """``meter`` counts nothing inside the fused kernels' launches (a GPU
    launch makes no tensor)."""
    for kernel in (kernels._stats_kernel, kernels._grad_kernel):
        run = type(kernel).run

        def paused(jit, *args, _run=run, **kwargs):
            meter.paused = True
            try:
                return _run(jit, *args, **kwargs)
            finally:
                meter.paused = False

        monkeypatch.setattr(type(kernel), "run", paused)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_tensor_of_tokens_by_classes(fused_device, monkeypatch, reduction):
    # 64 tokens x 200 classes = 12800 logits; the largest other tensor is the
    # weight (200 x 8) or its gradient (the gradient pass's buffer is 64
    # tokens x 16 classes). The chunked path would make a 64 x 200 chunk (it
    # fits its budget whole).
    monkeypatch.setattr(vocab_chunks, "GRADIENT_CHUNK_ALIGN", 16)
    tokens, hidden, classes = 64, 8, 200
    x, w, b, target = make_problem((tokens,), hidden, classes, torch.float32, fused_device)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    meter = LargestTemporary()
    _pause_during_launches(meter, monkeypatch)
    with meter:
        loss = linear_cross_entropy(x, w, target, b, reduction=reduction)
        loss.backward(torch.ones_like(loss))
    assert meter.largest == classes * hidden * 4 < tokens * classes * 4
    with LargestTemporary() as meter:
        linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=tokens)
    assert meter.largest >= tokens * classes * 4  # the meter sees a chunk of logits where one exists


@pytest.mark.parametrize("case", ["chunk_size", "probabilities"])
def test_cases_that_run_the_chunked_path(fused_device, kernel_calls, case):
    x, w, b, target = make_problem((9,), 6, 20, torch.float64, fused_device)
    options = {}
    if case == "chunk_size":
        options["chunk_size"] = 4
    elif case == "probabilities":
        target = torch.softmax(make_positive((9, 20), fused_device, seed=3) * 4, dim=-1)
    actual = fused(x, w, b, target, **options)
    assert_same(actual, unfused(x, w, b, target), torch.float64)
    assert kernel_calls == {"stats": 0, "grads": 0}


def test_deterministic_algorithms_run_the_fused_path(fused_device, kernel_calls):
    # No atomics: the fused path stays under use_deterministic_algorithms(True), and repeats itself bit for bit.
    x, w, b, target = make_problem((21,), 6, 40, torch.float32, fused_device, ignore_every=4)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = fused(x, w, b, target), fused(x, w, b, target)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert kernel_calls == {"stats": 2, "grads": 4}
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    assert_same(first, unfused(x, w, b, target), torch.float32)


def test_split_merge_equals_one_split(fused_device, monkeypatch):
    # The same statistics whether the classes run in one program range or
    # many: the merge of the splits' online log-sum-exps is exact.
    x, w, b, target = make_problem((40,), 9, 150, torch.float64, fused_device)
    assert kernels.class_index_splits(40, 150, *kernels.STATS_TILES[torch.float64][:2])[0] == 2
    many = kernels.class_index_stats(x, w, b, target, None, False)
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 1)
    assert kernels.class_index_splits(40, 150, *kernels.STATS_TILES[torch.float64][:2])[0] == 1
    one = kernels.class_index_stats(x, w, b, target, None, False)
    torch.testing.assert_close(many, one, rtol=1e-12, atol=1e-12)
    logits = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(one[0] + one[1].log(), torch.logsumexp(logits, 1), rtol=1e-12, atol=1e-12)


def test_filter_eps_skips_tiles_of_small_gradients(fused_device):
    # Peaked logits: W = 10 I and x near the one-hot of its target give the
    # target a logit of 10 and the others about 0 (softmax ~5e-5), so the
    # tiles of classes 16-63, which hold no target, have gradients near 0.
    tokens, classes = 32, 64
    generator = torch.Generator().manual_seed(3)
    target = torch.randint(0, 16, (tokens,), generator=generator)
    x = torch.nn.functional.one_hot(target, classes).double() + 0.05 * torch.randn(tokens, classes, generator=generator,
                                                                                  dtype=torch.float64)
    w = 10 * torch.eye(classes, dtype=torch.float64) + 0.01 * torch.randn(classes, classes, generator=generator,
                                                                         dtype=torch.float64)
    x, w, target = x.to(fused_device), w.to(fused_device), target.to(fused_device)
    b = torch.zeros(classes, dtype=torch.float64, device=fused_device)
    exact_loss, (exact_input, exact_weight, exact_bias) = fused(x, w, b, target)
    loss, (grad_input, grad_weight, grad_bias) = fused(x, w, b, target, filter_eps=1e-3)
    assert torch.equal(loss, exact_loss)  # the forward pass is never filtered
    skipped = (grad_weight[16:] == 0).all(dim=1)
    assert skipped.any() and (exact_weight[16:][skipped] != 0).all()  # tiles were skipped ...
    # ... and each skipped logit's gradient was under 1e-3 / tokens (the mean's scale).
    for got, want, other in ((grad_input, exact_input, w), (grad_weight, exact_weight, x)):
        bound = 1e-3 / tokens * other.abs().sum(0).max()
        assert (got - want).abs().max() <= bound
    assert (grad_bias - exact_bias).abs().max() <= 1e-3


@pytest.mark.parametrize("value", [-0.1, 1.0, True, "0.1"])
def test_filter_eps_must_be_a_fraction(value):
    x, w, b, target = make_problem((4,), 3, 5, torch.float64)
    with pytest.raises(ValueError, match="filter_eps must be a float in"):
        linear_cross_entropy(x, w, target, b, filter_eps=value)


def test_filter_eps_is_refused_where_the_chunked_path_runs(fused_device):
    x, w, b, target = make_problem((4,), 3, 5, torch.float64, fused_device)
    with pytest.raises(ValueError, match="filter_eps=0.01 applies to the fused Triton path"):
        linear_cross_entropy(x, w, target, b, filter_eps=0.01, chunk_size=2)
    probabilities = torch.softmax(make_positive((4, 5), fused_device), -1)
    with pytest.raises(ValueError, match="applies to the fused Triton path"):
        linear_cross_entropy(x, w, probabilities, b, filter_eps=0.01)


def test_strided_operands(fused_device):
    # A bias every other element of a larger tensor, a transposed weight's
    # transpose, rows of the input a gap apart (views of leaves, so the op
    # sees the strides): the kernels are given unit strides.
    x, w, b, target = make_problem((21,), 12, 40, torch.float64, fused_device, ignore_every=4)
    big_b = torch.zeros(80, dtype=torch.float64, device=fused_device)
    big_b[::2] = b
    big_x = torch.zeros(21, 20, dtype=torch.float64, device=fused_device)
    big_x[:, :12] = x
    w_t = w.t().contiguous()
    leaves = [t.requires_grad_() for t in (big_x, w_t, big_b)]
    strided_x, strided_w, strided_b = big_x[:, :12], w_t.t(), big_b[::2]
    assert strided_b.stride() == (2,) and strided_w.stride() == (1, 40) and strided_x.stride() == (20, 1)
    loss = linear_cross_entropy(strided_x, strided_w, target, strided_b)
    grads = torch.autograd.grad(loss, leaves)
    actual = (loss.detach(), [grads[0][:, :12], grads[1].t(), grads[2][::2]])
    assert_same(actual, unfused(x, w, b, target), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_peak_within_a_tenth_above_the_gradients(fused_device, monkeypatch, dtype):
    # The bench's lower bound: the gradients' own bytes (input, weight, bias),
    # which a step must hold. Above them the fused path keeps one 64-class
    # buffer of the logits' gradient, grad_input's float32 sum (bf16) and
    # per-token terms: within a tenth of the bound, which the logits and
    # their gradient alone (what the unfused pair holds) would break, as
    # would a float32 sum of grad_weight.
    monkeypatch.setattr(vocab_chunks, "GRADIENT_CHUNK_ALIGN", 64)
    tokens, hidden, classes = 16, 128, 512
    x, w, b, target = make_problem((tokens,), hidden, classes, dtype, fused_device, ignore_every=5)
    leaves = [t.requires_grad_() for t in (x, w, b)]
    lower_bound = sum(t.numel() * t.element_size() for t in leaves)
    assert 2 * tokens * classes * dtype.itemsize > 0.1 * lower_bound
    meter = LargestTemporary()
    _pause_during_launches(meter, monkeypatch)
    if fused_device.type == "cpu":
        # CPU has no GEMM of fp16/bf16 operands into float32 (CUDA's
        # addmm/mm out_dtype): there the products widen a chunk's operands,
        # temporaries a GPU does not make, which the meter leaves out.
        for name in ("_add_product", "_write_product"):
            monkeypatch.setattr(lce_op, name, _paused(meter, getattr(lce_op, name)))
    with meter:
        loss = linear_cross_entropy(x, w, target, b)
        grads = torch.autograd.grad(loss, leaves)
    assert meter.peak <= 1.1 * lower_bound, (meter.peak, lower_bound)
    assert_same((loss.detach(), grads), unfused(x, w, b, target), dtype, grad_tier="linear_cross_entropy")


def _paused(meter, function):
    def run(*args, **kwargs):
        meter.paused = True
        try:
            return function(*args, **kwargs)
        finally:
            meter.paused = False
    return run


@pytest.mark.parametrize("path", ["fused", "chunked"])
def test_fp16_small_gradients_survive_a_loss_scale(fused_device, path):
    # A loss scaler's factor (2^14 here) reaches the logits' gradient before
    # it is rounded to fp16, as in torch: softmax values of ~8e-7 over the
    # mean's 64 tokens are ~1.3e-8 unscaled, under half fp16's smallest
    # subnormal (6e-8), and ~2e-4 scaled. Rounded before the scale, the
    # gradients of the classes no token targets came out 0.
    tokens, classes = 64, 24
    generator = torch.Generator().manual_seed(2)
    target = torch.randint(0, 8, (tokens,), generator=generator)
    x = (14 * torch.nn.functional.one_hot(target, classes)).to(torch.float16).to(fused_device)
    w = torch.eye(classes, dtype=torch.float16, device=fused_device)
    target = target.to(fused_device)
    options = dict(chunk_size=16) if path == "chunked" else {}
    scale = torch.tensor(2.0 ** 14, dtype=torch.float16, device=fused_device)
    _, (grad_input, grad_weight, _) = fused(x, w, None, target, scale, **options)
    _, (exp_input, exp_weight, _) = unfused(x, w, None, target, scale)
    # Classes 8-23 are no token's target: grad_input[:, 8:] holds their
    # softmax gradients; grad_weight[8:, :8] their sums over the tokens.
    for got, want in ((grad_input[:, 8:], exp_input[:, 8:]), (grad_weight[8:, :8], exp_weight[8:, :8])):
        assert (got != 0).all()
        torch.testing.assert_close(got.double(), want, rtol=4e-3, atol=0)


def test_autocast_reads_the_float32_weight_without_a_copy(fused_device, monkeypatch):
    # Under autocast the kernels round each tile of the float32 x, W and b to
    # bf16 as they load it: the forward allocates nothing of the weight's
    # size, and values and gradients are those of the bf16-rounded inputs.
    x, w, b, target = make_problem((2, 9), 16, 40, torch.float32, fused_device, ignore_every=5)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    meter = LargestTemporary()
    _pause_during_launches(meter, monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with meter:
            loss = linear_cross_entropy(*leaves[:2], target, leaves[2])
    assert loss.dtype == torch.float32
    assert meter.largest < w.numel() * 2
    grads = torch.autograd.grad(loss, leaves)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    exp_loss, exp_grads = unfused(*[t.bfloat16() for t in (x, w, b)], target)
    assert_close(loss.double(), exp_loss, torch.bfloat16)
    for got, want in zip(grads, exp_grads):
        assert_close(got.double(), want, torch.bfloat16, "linear_cross_entropy")


def test_grad_input_summed_a_block_of_tokens_at_a_time(fused_device, monkeypatch):
    # Where grad_input's float32 sum would outgrow its share of the
    # gradients, blocks of tokens (here 19 and 18: not whole tiles) are
    # summed one at a time: the same sums, in the same order, so the same bits.
    x, w, b, target = make_problem((37,), 16, 40, torch.bfloat16, fused_device, ignore_every=5)
    whole = fused(x, w, b, target, label_smoothing=0.1)
    sum_bytes = 37 * 16 * 4
    gradient_bytes = (37 * 16 + 40 * 16 + 40) * 2
    monkeypatch.setattr(lce_op, "INPUT_SUM_SHARE", sum_bytes / 2 / gradient_bytes)
    blocked = fused(x, w, b, target, label_smoothing=0.1)
    assert torch.equal(whole[0], blocked[0]) and all(torch.equal(a, b) for a, b in zip(whole[1], blocked[1]))
    # grad_input alone (a frozen head): each block walks the classes for its own tokens only.
    x_leaf = x.clone().requires_grad_()
    loss = linear_cross_entropy(x_leaf, w, target, b, label_smoothing=0.1)
    assert torch.equal(torch.autograd.grad(loss, x_leaf)[0], whole[1][0])


def test_opcheck_of_the_fused_ops(fused_device):
    # The custom ops on the fused path (fake kernels, schema, autograd
    # registration): the forward returns the per-token terms backward reads.
    from effilayers.ops.linear_cross_entropy.op import _linear_cross_entropy_backward, _linear_cross_entropy_forward

    x, w, b, target = make_problem((7,), 4, 5, torch.float32, fused_device, ignore_every=3)
    arguments = (x, w, target, b, None, None, -100, 0.1, "mean", None, False, False, False, torch.float32, 0.0,
                 torch.float32, True)
    torch.library.opcheck(_linear_cross_entropy_forward, arguments)
    terms = _linear_cross_entropy_forward(*arguments)[4]
    assert terms.shape == (3, 7)
    torch.library.opcheck(_linear_cross_entropy_backward,
                          (torch.tensor(2.0, device=fused_device), x, w, target, b, None, None, terms, -100, 0.1,
                           "mean", None, True, True, True, torch.float32, 0.0, True))


@pytest.mark.gpu
def test_cuda_peak_within_a_tenth_above_the_gradients():
    # The issue's target on the device, at half Gemma-2's head (4096 tokens,
    # hidden 2304, 128000 classes, bf16): max_memory_allocated over forward
    # + backward, above what was held before, within 1.1x the gradients.
    # A step of the same shapes first: Triton's compilation and the GEMMs'
    # workspaces, which stay allocated for the process, are not the step's
    # memory (a smaller warm-up left a cuBLAS workspace to the measured step:
    # gpu-session-h200-2026-11-30.md); `kept` says what stays allocated.
    x, w, b, target = make_problem((4096,), 2304, 128000, torch.bfloat16, "cuda")
    leaves = [t.requires_grad_() for t in (x, w, b)]
    lower_bound = sum(t.numel() * t.element_size() for t in leaves)
    before = torch.cuda.memory_allocated()
    torch.autograd.grad(linear_cross_entropy(x, w, target, b), leaves)
    kept = torch.cuda.memory_allocated() - before
    with memory.track_cuda_peak() as meter:
        grads = torch.autograd.grad(linear_cross_entropy(x, w, target, b), leaves)
    assert meter.step_bytes <= 1.1 * lower_bound, (meter.step_bytes, lower_bound, kept)
    del grads
