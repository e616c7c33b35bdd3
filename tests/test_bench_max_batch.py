"""The max-batch search (effilayers.find_max_batch, which the bench's
--max-batch runs): the bisection against a simulated memory limit, which
errors count as "too large" or "cannot train", and the report of variants
that run out of memory."""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effilayers
from effilayers import bench

from .bench_cases import HAVE_MATPLOTLIB, by_variant, run_bench

# The bench on CPU, without the peer libraries (conftest.on_cpu_without_peers).
pytestmark = pytest.mark.usefixtures("on_cpu_without_peers")


# ---- the max-batch search ------------------------------------------------------------------


def simulated_memory(fits_up_to: int):
    """A training step that runs out of memory above ``fits_up_to``, as CUDA
    reports it, and the list of batches it was called with."""
    calls = []

    def step(batch: int) -> None:
        calls.append(batch)
        if batch > fits_up_to:
            raise torch.OutOfMemoryError(f"CUDA out of memory at batch {batch} (simulated)")

    return step, calls


@pytest.fixture
def collections(monkeypatch):
    """find_max_batch's garbage collections, counted instead of run: a
    simulated step leaves nothing to collect, and a full collection of the
    test process's heap costs far more than the search it follows."""
    calls = []
    monkeypatch.setattr(effilayers.max_batch.gc, "collect", lambda *args: calls.append(args) or 0)
    return calls


@pytest.mark.parametrize("start", [1, 2, 3, 32, 100])
@pytest.mark.parametrize("fits_up_to", [0, 1, 2, 5, 31, 32, 33, 100, 777])
def test_find_max_batch_finds_the_simulated_limit(start, fits_up_to, collections):
    search_limit = 1000
    step, calls = simulated_memory(fits_up_to)
    found = bench.find_max_batch(step, start, search_limit)
    assert found.batch == fits_up_to
    assert found.tries == len(calls)
    assert len(collections) == len(calls), "memory is released after every try"
    assert found.peak_bytes is None  # no CUDA step measured
    assert max(calls) <= search_limit
    assert len(calls) == len(set(calls)), "tried a batch twice"
    assert len(calls) <= bench.max_tries(start, search_limit)


@pytest.mark.parametrize("search_limit", [1, 7, 64, 100])
def test_find_max_batch_never_exceeds_its_limit(search_limit, collections):
    step, calls = simulated_memory(10**6)
    assert bench.find_max_batch(step, 3, search_limit).batch == search_limit
    assert max(calls) <= search_limit


def test_find_max_batch_rejects_nonpositive_arguments():
    with pytest.raises(ValueError, match="start and limit must be >= 1"):
        bench.find_max_batch(lambda batch: None, 0, 10)


@pytest.mark.parametrize("fits_up_to", [1000, 1537, 2900, 4095])
def test_find_max_batch_with_a_precision_stops_within_it_in_fewer_tries(fits_up_to, collections):
    exact_step, exact_calls = simulated_memory(fits_up_to)
    coarse_step, coarse_calls = simulated_memory(fits_up_to)
    assert bench.find_max_batch(exact_step, 32, 4096).batch == fits_up_to
    found = bench.find_max_batch(coarse_step, 32, 4096, precision=0.02)
    # a batch that fits, and one at most 2% above it that does not
    assert found.batch <= fits_up_to < found.batch * 1.02 + 1
    assert min(call for call in coarse_calls if call > fits_up_to) <= found.batch * 1.02 + 1
    assert len(coarse_calls) < len(exact_calls) and len(coarse_calls) == len(set(coarse_calls))


@pytest.mark.parametrize("precision, error", [(-0.1, ValueError), (1.0, ValueError), (float("nan"), ValueError),
                                              ("0.02", TypeError), (True, TypeError)])
def test_find_max_batch_refuses_a_precision_outside_0_to_1(precision, error):
    with pytest.raises(error, match="precision must be"):
        bench.find_max_batch(lambda batch: None, 2, 10, precision=precision)


@pytest.mark.parametrize("error, out_of_memory", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                  "non-contiguous input."), False),  # find_max_batch decides (below)
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"), False),
    (ValueError("out of memory"), False),
])
def test_is_out_of_memory(error, out_of_memory):
    assert bench.is_out_of_memory(error) is out_of_memory


def test_find_max_batch_lets_other_errors_through():
    def step(batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        bench.find_max_batch(step, 2, 64)


def test_find_max_batch_takes_cudnn_not_supported_as_too_large_only_after_a_batch_trained():
    not_supported = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a " \
                    "non-contiguous input."

    def step(batch):
        if batch > 20:
            raise RuntimeError(not_supported)

    assert bench.find_max_batch(step, 2, 64).batch == 20

    def never(batch):
        raise RuntimeError(not_supported)

    # Unsupported at the first batch tried: a configuration problem, not a size.
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        bench.find_max_batch(never, 2, 64)


def test_find_max_batch_takes_batch_norms_one_value_error_as_not_training():
    def step(batch):
        if batch == 1:
            raise ValueError("Expected more than 1 value per channel when training, got input size [1, 8, 1, 1]")
        if batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert bench.find_max_batch(step, 4, 64).batch == 2

    def only_batch_norm(batch):
        raise ValueError("Expected more than 1 value per channel when training, got input size [1, 8, 1, 1]")

    assert bench.find_max_batch(only_batch_norm, 1, 64).batch == 0

    def other_value_error(batch):
        raise ValueError("a different problem")

    with pytest.raises(ValueError, match="different problem"):
        bench.find_max_batch(other_value_error, 2, 64)


def _one_value_models():
    """effilayers modules whose training forward raises their own "one value
    per channel" error at batch 1 (not torch's BatchNorm's)."""
    torch.manual_seed(0)
    densenet = effilayers.models.DenseNet(growth_rate=4, block_config=(1,), num_init_features=8, bn_size=2,
                                          num_classes=3, small_inputs=True)
    return {"abn": (effilayers.nn.ABN(8), (8, 1, 1), "^abn: expected more than 1 value per channel"),
            "inplace_abn": (nn.Sequential(nn.Conv2d(8, 8, 1), effilayers.nn.InPlaceABN(8)), (8, 1, 1),
                            "^inplace_abn: expected more than 1 value per channel"),
            "densenet": (densenet, (3, 1, 1), "^bottleneck: expected more than 1 value per channel")}


@pytest.mark.parametrize("name", ["abn", "inplace_abn", "densenet"])
def test_find_max_batch_takes_effilayers_one_value_errors_as_not_training(name):
    model, shape, message = _one_value_models()[name]
    with pytest.raises(ValueError, match=message):  # effilayers' own error, not torch's
        model(torch.randn(1, *shape))

    def step(batch):
        if batch >= 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        model(torch.randn(batch, *shape)).sum().backward()

    assert bench.find_max_batch(step, 2, 8).batch == 0


def test_a_densenet_batch_the_bottleneck_cannot_train_exits_2_with_advice(capsys):
    # DenseNet-121 at 32x32 reaches its last block at 1x1, where the
    # memory-efficient bottleneck (not BatchNorm2d) refuses batch 1.
    assert bench.main(["--model", "effilayers.models:densenet121", "--batch", "1", "--size", "32",
                       "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "effilayers-bench: error: batch 1 at 32x32 leaves BatchNorm one value per channel" in err
    assert "(bottleneck: expected more than 1 value per channel" in err


def test_a_batch_batch_norm_cannot_train_exits_2_with_advice(capsys):
    # ResNet-18 at 32x32 reaches layer4 at 1x1: batch 1 leaves one value per channel.
    assert bench.main(["--model", "resnet18", "--batch", "1", "--size", "32", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "effilayers-bench: error: batch 1 at 32x32 leaves BatchNorm one value per channel" in err
    assert "use a larger --batch or --size" in err


class RecordingBar:
    def __init__(self, total):
        self.total, self.count = total, 0

    def update(self, n=1):
        self.count += n

    def set_description(self, text):
        pass

    def close(self):
        pass


def test_max_batch_end_to_end_against_a_simulated_memory_limit(tmp_path, monkeypatch, capsys):
    """The real search wrapper and driver on CPU tensors: the training step
    runs out of memory (both ways CUDA reports it) above a per-variant
    limit, after its backward has left gradients behind."""
    limits = {"as given": 12, "effilayers convert(inplace)": 30}
    real_step = bench.measure._train_step
    state = {"raised": None, "tries": 0, "empty_cache": 0}
    # Fresh exceptions: a raised one holds the frames of its traceback.
    kinds = itertools.cycle([lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
                             lambda: RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")])

    def step_with_a_memory_limit(model, optimizer, setup, images, labels):
        # Everything the previous try held is released before the next one.
        assert all(p.grad is None for p in model.parameters()), "gradients of the last try still held"
        if state["raised"] is not None:
            assert state["raised"]() is None, "the images of the try that ran out of memory are still alive"
            assert state["empty_cache"] >= 1
            state["raised"] = None
        # every size repeats the samples of the first batch (--batch 2), drawn once
        assert torch.equal(images[2:4], images[:2][:images.shape[0] - 2])
        assert torch.equal(labels[2:4], labels[:2][:labels.shape[0] - 2])
        converted = any(isinstance(m, effilayers.nn.ABN) for m in model.modules())
        limit = limits["effilayers convert(inplace)" if converted else "as given"]
        if images.shape[0] <= limit:
            return real_step(model, optimizer, setup, images, labels)
        state["tries"] += 1
        F.cross_entropy(model(images), labels).backward()  # gradients now exist
        state["raised"], state["empty_cache"] = weakref.ref(images), 0
        raise next(kinds)()

    def count_empty_cache(device):
        state["empty_cache"] += 1

    bars = []
    monkeypatch.setattr(bench.cli, "MAX_BATCH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(bench.measure, "_train_step", step_with_a_memory_limit)
    monkeypatch.setattr(effilayers.max_batch, "_empty_cache", count_empty_cache)
    monkeypatch.setattr(bench.cli, "_progress", lambda total: bars.append(RecordingBar(total)) or bars[-1])
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32",
                       "--batch", "2", "--steps", "1", "--max-batch", "--max-batch-limit", "64")
    results = by_variant(report)
    assert {name: r["max_batch"] for name, r in results.items()} == limits
    assert results["effilayers convert(inplace)"]["ratios"]["max_batch"] == pytest.approx(30 / 12)
    assert state["tries"] >= 4  # both variants ran out of memory, each more than once
    assert report["settings"]["max_batch_limit"] == 64 and report["settings"]["max_batch_precision"] == 0.02
    table = capsys.readouterr().out
    assert "max batch" in table and "2.50x" in table
    assert bars[0].count == bars[0].total  # every try counted, and the estimate filled up


def test_a_variant_out_of_memory_at_the_batch_is_reported_and_the_others_measured(tmp_path, monkeypatch, capsys):
    """Plain PyTorch running out of memory at a batch the memory-efficient
    variant trains is a result (the comparison users run the bench for),
    not a crash; --max-batch then still searches for its largest batch."""
    real_step = bench.measure._train_step

    def plain_runs_out_of_memory(model, optimizer, setup, images, labels):
        converted = any(isinstance(m, effilayers.nn.ABN) for m in model.modules())
        if not converted and images.shape[0] > 2:
            F.cross_entropy(model(images), labels).backward()  # gradients left behind, as on a GPU
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real_step(model, optimizer, setup, images, labels)

    bars = []
    monkeypatch.setattr(bench.cli, "MAX_BATCH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(bench.measure, "_train_step", plain_runs_out_of_memory)
    monkeypatch.setattr(bench.cli, "_progress", lambda total: bars.append(RecordingBar(total)) or bars[-1])
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32",
                       "--batch", "4", "--steps", "1", "--train", "2", "--max-batch", "--max-batch-limit", "16",
                       plot=HAVE_MATPLOTLIB)
    results = by_variant(report)
    plain, converted = results["as given"], results["effilayers convert(inplace)"]
    assert plain["out_of_memory"] is True
    assert plain["step_time_s"] is None and plain["activation_bytes"] is None and plain["losses"] is None
    assert plain["max_batch"] == 2
    assert any("out of memory at batch 4" in note for note in plain["notes"])
    assert converted["out_of_memory"] is False and converted["step_time_s"] > 0
    assert converted["max_batch"] == 16 and converted["losses"] is not None
    # nothing to compare with: no ratios to plain and no loss check
    assert converted["ratios"]["step_time"] is None and converted["ratios"]["max_batch"] == pytest.approx(8.0)
    assert converted["losses_agree"] is None
    assert any("plain PyTorch did not train" in note for note in converted["notes"])
    out = capsys.readouterr().out
    plain_row = next(line for line in out.splitlines() if line.startswith("tests.test_bench") and "as given" in line)
    # activation, step ms, its min-max, images/s (no CUDA peak column: the run is on CPU)
    assert plain_row.count("OOM") == 4
    assert bars[0].count == bars[0].total
    # and the README's headline script renders such a report
    import benchmarks.headline as headline

    assert "| OOM | OOM | OOM | OOM |" in headline.table(report, "x.json")


def test_max_batch_on_cpu_exits_2_with_a_message(capsys):
    assert bench.main(["--max-batch"]) == 2
    assert "--max-batch needs CUDA" in capsys.readouterr().err
