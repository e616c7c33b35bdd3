"""linear_cross_entropy's surface: argument errors, the
nn.LinearCrossEntropyLoss module, the custom ops (opcheck, torch.compile),
autocast, a weight tied to the input embedding, what autograd saves, and the
peak memory of a step measured in a fresh process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from effilayers import memory
from effilayers._core import registry
from effilayers.functional import linear_cross_entropy
from effilayers.nn import LinearCrossEntropyLoss
from effilayers.ops.linear_cross_entropy.op import _linear_cross_entropy_backward, _linear_cross_entropy_forward

from .accuracy import assert_close
from .linear_cross_entropy_cases import assert_same, fused, make_positive, make_problem, unfused
from .readme_blocks import claimed_block

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# Bad input: each error names its argument
# --------------------------------------------------------------------------


def _call(**changes):
    x, w, b, target = make_problem((2, 3), 4, 5, torch.float32)
    arguments = dict(input=x, weight=w, target=target, bias=b)
    arguments.update(changes)
    return linear_cross_entropy(**arguments)


BAD_ARGUMENTS = [
    (dict(input=[1.0]), TypeError, "input must be a torch.Tensor"),
    (dict(input=torch.ones(2, 3, 4, dtype=torch.int64)), TypeError, "input must be float16"),
    (dict(input=torch.tensor(1.0)), ValueError, "input must have shape"),
    (dict(weight=torch.ones(5)), ValueError, r"weight must have shape \(classes, hidden\)"),
    (dict(weight=torch.ones(5, 6)), ValueError, "weight has 6 input features"),
    (dict(weight=torch.ones(0, 4), bias=None), ValueError, "weight must have at least one class"),
    (dict(weight=torch.ones(5, 4, dtype=torch.float64)), TypeError, "weight has dtype torch.float64 but input"),
    (dict(bias=torch.ones(4)), ValueError, r"bias must have shape \(5,\)"),
    (dict(bias=torch.ones(5, dtype=torch.float16)), TypeError, "bias has dtype torch.float16"),
    (dict(target=torch.zeros(2, 4, dtype=torch.int64)), ValueError, r"target must have shape \(2, 3\)"),
    (dict(target=torch.zeros(2, 3, dtype=torch.int16)), TypeError, "target must hold class indices"),
    (dict(target=torch.zeros(2, 3, 4)), ValueError, r"target \(class probabilities\) must have shape \(2, 3, 5\)"),
    (dict(class_weight=torch.ones(4)), ValueError, r"class_weight must have shape \(5,\)"),
    (dict(class_weight=torch.ones(5, dtype=torch.int64)), TypeError, "class_weight must be a floating-point"),
    (dict(class_weight=torch.ones(5, requires_grad=True)), ValueError, "class_weight requires grad"),
    (dict(token_weight=torch.ones(6)), ValueError, r"token_weight must have shape \(2, 3\)"),
    (dict(token_weight=torch.ones(2, 3, requires_grad=True)), ValueError, "token_weight requires grad"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be a float in \[0, 1\]"),
    (dict(ignore_index=1.0), TypeError, "ignore_index must be an int"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(target=torch.tensor([[0, 1, 5], [0, 0, 0]])), IndexError, "target 5 is out of bounds for 5 classes"),
    (dict(target=torch.tensor([[0, 1, -1], [0, 0, 0]])), IndexError, "target -1 is out of bounds"),
]


@pytest.mark.parametrize("changes, error, message", BAD_ARGUMENTS, ids=[m for _, _, m in BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument(changes, error, message):
    with pytest.raises(error, match=f"linear_cross_entropy: {message}"):
        _call(**changes)


def test_ignore_index_is_not_out_of_range():
    target = torch.tensor([[0, 1, 7], [0, 7, 4]])
    loss = _call(target=target, ignore_index=7)
    x, w, b, _ = make_problem((2, 3), 4, 5, torch.float32)
    assert_close(loss, F.cross_entropy(F.linear(x, w, b).reshape(6, 5), target.reshape(6), ignore_index=7),
                 torch.float32)


def test_double_backward_is_refused():
    x, w, b, target = make_problem((3,), 4, 5, torch.float64)
    x.requires_grad_()
    loss = linear_cross_entropy(x, w, target, b)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_retain_graph_backward_twice_gives_the_same_gradients():
    x, w, b, target = make_problem((6,), 4, 5, torch.float64)
    w.requires_grad_()
    loss = linear_cross_entropy(x, w, target, b, chunk_size=4)
    (first,) = torch.autograd.grad(loss, w, retain_graph=True)
    (second,) = torch.autograd.grad(loss, w)
    _, (_, expected, _) = unfused(x, w, b, target)
    assert_close(first, expected, torch.float64)
    assert_close(second, expected, torch.float64)


def test_frozen_weight_and_no_grad():
    x, w, b, target = make_problem((6,), 4, 5, torch.float64)
    x.requires_grad_()
    linear_cross_entropy(x, w, target, b).backward()
    assert w.grad is None and x.grad is not None
    _, (expected, _, _) = unfused(x, w, b, target)
    assert_close(x.grad, expected, torch.float64)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, target, b)
    assert not loss.requires_grad
    assert_close(loss, unfused(x, w, b, target)[0], torch.float64)


# --------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------


def test_module_matches_functional_and_keeps_class_weight():
    x, w, b, target = make_problem((2, 5), 6, 7, torch.float64, ignore_every=3)
    class_weight = make_positive(7)
    token_weight = make_positive((2, 5), seed=3)
    criterion = LinearCrossEntropyLoss(class_weight=class_weight, label_smoothing=0.1, reduction="sum",
                                       chunk_size=3)
    assert set(criterion.state_dict()) == {"class_weight"}
    assert "label_smoothing=0.1" in repr(criterion)
    loss = criterion(x, w, target, b, token_weight=token_weight)
    expected = linear_cross_entropy(x, w, target, b, class_weight=class_weight, token_weight=token_weight,
                                    label_smoothing=0.1, reduction="sum")
    assert_close(loss, expected, torch.float64)


@pytest.mark.parametrize("options, message", [
    (dict(reduction="avg"), "LinearCrossEntropyLoss: reduction"),
    (dict(label_smoothing=-0.1), "LinearCrossEntropyLoss: label_smoothing"),
    (dict(chunk_size=-3), "LinearCrossEntropyLoss: chunk_size"),
])
def test_module_checks_options_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        LinearCrossEntropyLoss(**options)


# --------------------------------------------------------------------------
# Fits PyTorch: opcheck, torch.compile, autocast, tied weights
# --------------------------------------------------------------------------


def test_opcheck():
    x, w, b, target = make_problem((7,), 4, 5, torch.float32, ignore_every=3)
    token_weight = make_positive((7,), dtype=torch.float32)
    for reduction in ("mean", "sum", "none"):
        torch.library.opcheck(_linear_cross_entropy_forward,
                              (x, w, target, b, None, token_weight, -100, 0.1, reduction, 3, True, True, True,
                               torch.float32, 0.0, torch.float32, False))
    torch.library.opcheck(_linear_cross_entropy_forward,
                          (x.bfloat16(), w.bfloat16(), target, None, None, None, -100, 0.0, "mean", None, True,
                           False, False, torch.bfloat16, 0.0, torch.bfloat16, False))
    no_terms = torch.empty(0)  # the chunked path's backward (CPU) recomputes the chunks
    for reduction, grad_output in (("none", torch.ones(7)), ("mean", torch.tensor(2.0)), ("sum", torch.tensor(0.5))):
        torch.library.opcheck(_linear_cross_entropy_backward,
                              (grad_output, x, w, target, b, None, token_weight, no_terms, -100, 0.0, reduction, 2,
                               True, True, True, torch.float32, 0.0, False))


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph_matches_eager_with_ignored_rows(reduction, monkeypatch):
    # Liger PR#1338: a compiled fused loss counted ignored rows differently from eager.
    torch._dynamo.reset()
    # Compiled first, with no backend resolved yet: the trace must not resolve the registry itself (its lock).
    monkeypatch.setattr(registry._state, "choices", {})
    x, w, b, target = make_problem((3, 5), 8, 33, torch.float32, ignore_every=4)
    token_weight = make_positive((3, 5), dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    # Without chunk_size the trace decides between the fused and the chunked path.
    plain = torch.compile(lambda x, w: linear_cross_entropy(x, w, target), fullgraph=True, backend="aot_eager")
    plain(*leaves[:2]).backward()

    def step(x, w, b, target, token_weight):
        loss = linear_cross_entropy(x, w, target, b, label_smoothing=0.1, reduction=reduction,
                                    token_weight=token_weight, chunk_size=4)
        return loss if reduction == "mean" else loss.sum()

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (compiled, step):
        for leaf in leaves:
            leaf.grad = None
        loss = fn(*leaves, target, token_weight)
        loss.backward()
        results.append([loss.detach()] + [leaf.grad.clone() for leaf in leaves])
    for actual, expected in zip(results[0], results[1]):
        assert_close(actual, expected, torch.float32)
    reference = F.cross_entropy(F.linear(x, w, b).reshape(15, 33), target.reshape(15), label_smoothing=0.1,
                                reduction="none") * token_weight.reshape(15)
    if reduction == "mean":
        reference = reference.sum() / (token_weight.reshape(15) * (target.reshape(15) != -100)).sum()
    else:
        reference = reference.sum()
    assert_close(results[1][0], reference, torch.float32)


def test_autocast_follows_linear_then_cross_entropy():
    # torch.autocast runs F.linear in bf16 and F.cross_entropy in float32:
    # the loss is float32, the gradients come back in the parameters' dtype.
    x, w, b, target = make_problem((2, 9), 16, 40, torch.float32, ignore_every=5)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(*leaves[:2], target, leaves[2], chunk_size=5)
        torch_loss = F.cross_entropy(F.linear(x, w, b).reshape(-1, 40), target.reshape(-1))
    assert loss.dtype == torch_loss.dtype == torch.float32
    loss.backward()
    assert [leaf.grad.dtype for leaf in leaves] == [torch.float32] * 3
    # The same computation from the bf16-rounded values, in float64.
    rounded = [t.bfloat16() for t in (x, w, b)]
    exp_loss, exp_grads = unfused(*rounded, target)
    assert_close(loss.double(), exp_loss, torch.bfloat16)
    for got, want in zip([leaf.grad for leaf in leaves], exp_grads):
        assert_close(got.double(), want, torch.bfloat16, "linear_cross_entropy")
    # Outside autocast, a float32 weight with a bf16 input is a dtype error.
    with pytest.raises(TypeError, match="weight has dtype torch.float32 but input has torch.bfloat16"):
        linear_cross_entropy(x.bfloat16(), w, target)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_weight_tied_to_input_embedding(reduction):
    # The head's weight is the embedding's: its gradient is the sum of both
    # uses, accumulated by autograd into the one parameter.
    generator = torch.Generator().manual_seed(4)
    vocab, hidden = 23, 6
    tokens = torch.randint(0, vocab, (3, 7), generator=generator)
    target = torch.randint(0, vocab, (3, 7), generator=generator)
    target[0, 2] = -100
    weight0 = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
    mixer0 = torch.randn(hidden, hidden, generator=generator, dtype=torch.float64) / 3
    grad_output = make_positive((3, 7)) if reduction == "none" else None

    def run(loss_fn):
        weight = weight0.clone().requires_grad_()
        mixer = mixer0.clone().requires_grad_()
        hidden_states = torch.tanh(F.embedding(tokens, weight) @ mixer)
        loss = loss_fn(hidden_states, weight)
        loss.backward(torch.ones_like(loss) if grad_output is None else grad_output)
        return weight.grad, mixer.grad

    ours = run(lambda h, w: linear_cross_entropy(h, w, target, reduction=reduction, chunk_size=4))
    theirs = run(lambda h, w: F.cross_entropy(F.linear(h, w).reshape(-1, vocab), target.reshape(-1),
                                              reduction=reduction).reshape(() if reduction == "mean" else (3, 7)))
    for got, want in zip(ours, theirs):
        assert_close(got, want, torch.float64)


# --------------------------------------------------------------------------
# Memory: what autograd saves, and a step's peak in a fresh process
# --------------------------------------------------------------------------


def _saved_bytes(tokens, classes, hidden, reduction):
    x, w, b, target = make_problem((tokens,), hidden, classes, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    with memory.track_activations(exclude=[w, b]) as meter:
        loss = linear_cross_entropy(x, w, target, b, reduction=reduction)
    saved = meter.bytes
    loss.sum().backward()  # the saved tensors serve a real backward
    return saved


def test_saved_bytes_do_not_grow_with_tokens_times_classes():
    # mean/sum: grad_input (tokens x hidden, input dtype) + float32 grad_weight and grad_bias.
    tokens, classes, hidden = 64, 1000, 8
    saved = _saved_bytes(tokens, classes, hidden, "mean")
    assert saved == tokens * hidden * 4 + classes * hidden * 4 + classes * 4
    logits_bytes = tokens * classes * 4
    assert saved < logits_bytes / 3
    # 4x the classes adds weight-sized bytes; 4x the tokens adds input-sized bytes.
    assert _saved_bytes(tokens, 4 * classes, hidden, "mean") - saved == 3 * classes * (hidden + 1) * 4
    assert _saved_bytes(4 * tokens, classes, hidden, "mean") - saved == 3 * tokens * hidden * 4
    # none: the input and the target (the parameters excluded), whatever the vocabulary.
    none = _saved_bytes(tokens, classes, hidden, "none")
    assert none == tokens * hidden * 4 + tokens * 8
    assert _saved_bytes(tokens, 4 * classes, hidden, "none") == none


_PEAK_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from effilayers.functional import linear_cross_entropy
from tests.conftest import peak_rss_growth

tokens, hidden, classes = 4096, 128, 32768
generator = torch.Generator().manual_seed(0)
x = torch.randn(tokens, hidden, generator=generator).requires_grad_()
w = (torch.randn(classes, hidden, generator=generator) * 0.05).requires_grad_()
target = torch.randint(0, classes, (tokens,), generator=generator)
# Warm up on separate small tensors: loads the C++ library and torch's kernels.
small = torch.randn(8, hidden, requires_grad=True)
linear_cross_entropy(small, torch.randn(100, hidden, requires_grad=True), target[:8] % 100).backward()

# The method sees a known allocation: 64 MiB written (and freed).
known = peak_rss_growth(lambda: torch.ones(16 << 20).sum())

def step():
    linear_cross_entropy(x, w, target, reduction=sys.argv[2]).sum().backward()

growth = peak_rss_growth(step)
print(json.dumps(dict(growth=growth, known=known, logits=tokens * classes * 4)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_peak_memory_of_a_step_in_a_fresh_process(reduction):
    # CPU, 4096 tokens, hidden 128, 32768 classes in float32 (512 MiB of
    # logits): the growth of the process's peak resident set (VmHWM, reset
    # through /proc/self/clear_refs, tests/conftest.peak_rss_growth) over
    # forward + backward, gradients included, is at most 0.2x the logits.
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(ROOT), reduction], capture_output=True,
                            text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["known"] >= 60 << 20, measured
    assert measured["growth"] <= 0.2 * measured["logits"], measured


def test_docs_cpu_table_is_generated_from_the_committed_results():
    # Measures nothing: the docs' CPU table is what
    # `python -m benchmarks.bench_linear_cross_entropy --table-from <json>` makes of the results file it names,
    # taken at issue 32's shape with one thread, and effilayers' rows keep issue 32's time target.
    from benchmarks import bench_linear_cross_entropy as bench

    section = bench.page_section((ROOT / bench.TABLE_PAGE).read_text())
    named = re.search(r"from `(benchmarks/results/linear_cross_entropy-cpu-table-[0-9-]+\.json)`", section)
    assert named, "the docs' CPU table names no results file"
    report = json.loads((ROOT / named.group(1)).read_text())
    assert section.strip() == bench.render_table(report, named.group(1)).strip()

    tokens, hidden, classes = bench.TABLE_SHAPE
    assert report["shape"] == dict(tokens=tokens, hidden=hidden, classes=classes) and report["threads"] == 1
    assert "float32" in report["dtypes"]
    rows = {(row["dtype"], row["variant"]): row for row in report["rows"]}
    assert set(rows) == {(dtype, variant) for dtype in report["dtypes"] for variant in bench.TABLE_LABELS}
    for dtype in report["dtypes"]:
        ours, torch_chunked = rows[dtype, "effilayers"], rows[dtype, bench.BASELINE]
        # at most 0.7x the time of torch's chunked F.linear_cross_entropy
        assert ours["cpu_s"] <= 0.7 * torch_chunked["cpu_s"], (dtype, ours["cpu_s"], torch_chunked["cpu_s"])
        # and a peak growth of at most 0.1x the fp32 logits (the gradients alone are 0.07x at this shape)
        assert ours["growth"] <= 0.1 * ours["logits_fp32_bytes"], (dtype, ours["growth"])


def test_docs_example_runs_and_matches_torch():
    code = claimed_block("docs/guide/linear-cross-entropy.md", "# Linear + cross-entropy without the logits", 0,
                         "tests/test_linear_cross_entropy_api.py::test_docs_example_runs_and_matches_torch")
    namespace: dict = {}
    exec(compile(code, "docs/guide/linear-cross-entropy.md", "exec"), namespace)
    h, labels, lm_head = namespace["h"], namespace["labels"], namespace["lm_head"]
    expected = F.cross_entropy(lm_head(h).flatten(0, 1), labels.flatten())
    assert_close(namespace["loss"].detach(), expected.detach(), torch.float32)
    assert namespace["per_token"].shape == labels.shape
    assert namespace["lm_head"].weight.grad is not None


def test_fake_cuda_autocast_dtypes_follow_torch():
    # Shapes and dtypes only (fake CUDA tensors): the loss is float32 under
    # CUDA autocast, as F.linear + F.cross_entropy's is, for every input dtype
    # autocast casts; float64 stays float64 (autocast leaves it alone).
    from .conftest import fake_cuda_autocast

    with fake_cuda_autocast(torch.bfloat16):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            x = torch.empty(6, 8, dtype=dtype, device="cuda")
            w = torch.empty(11, 8, dtype=dtype, device="cuda")
            target = torch.zeros(6, dtype=torch.int64, device="cuda")
            for reduction in ("mean", "none"):
                expected = F.cross_entropy(F.linear(x, w), target, reduction=reduction)
                loss = linear_cross_entropy(x, w, target, reduction=reduction)
                assert loss.dtype == expected.dtype and loss.shape == expected.shape, (dtype, reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_float64_and_peak_stays_small(dtype):
    # The GPU path: cuBLAS matmuls, the Triton row kernel in place, and (bf16)
    # cuBLAS's GEMM with a float32 output for the weight gradient.
    x, w, b, target = make_problem((301,), 64, 50257, dtype, "cuda", ignore_every=7)
    actual = fused(x, w, b, target, label_smoothing=0.05, chunk_size=64)
    expected = unfused(x, w, b, target, label_smoothing=0.05)  # torch's cross_entropy has no chunk_size
    assert_same(actual, expected, dtype, grad_tier="linear_cross_entropy")
    # Peak over forward + backward at 4096 x 128 x 32768: at most 0.2x the fp32 logits.
    x, w, b, target = make_problem((4096,), 128, 32768, dtype, "cuda")
    leaves = [t.requires_grad_() for t in (x, w, b)]
    with memory.track_cuda_peak() as meter:
        linear_cross_entropy(leaves[0], leaves[1], target, leaves[2]).backward()
    assert meter.step_bytes <= 0.2 * 4096 * 32768 * 4, meter.step_bytes
