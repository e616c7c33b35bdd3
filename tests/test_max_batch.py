"""effilayers.find_max_batch as a library call: what it releases between
tries, what it reports, its arguments, and the docs examples of it and of
effilayers.checkpoint. The search itself (against simulated memory limits)
and the bench's use of it are in tests/test_bench_max_batch.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import effilayers
from effilayers import bench
from effilayers.max_batch import MaxBatch, find_max_batch, release_memory

from .readme_blocks import claimed_block, section_blocks


def test_one_implementation_for_the_library_and_the_bench():
    assert effilayers.find_max_batch is find_max_batch is bench.find_max_batch
    assert effilayers.MaxBatch is MaxBatch


def _training_step(model, fits_up_to, log):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        # Whatever the last try left is gone before the next one starts.
        log.append((batch, [p.grad is None for p in model.parameters()]))
        model(torch.randn(batch, 4)).square().mean().backward()  # gradients exist, as after a failed backward
        if batch > fits_up_to:
            raise torch.OutOfMemoryError(f"CUDA out of memory at batch {batch} (simulated)")
        optimizer.step()

    return step


@pytest.mark.parametrize("as_parameters", [False, True])
def test_gradients_are_released_between_tries_and_tries_reported(as_parameters):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    log, reported = [], []
    release = model.parameters() if as_parameters else model  # a generator: read once, used every try
    found = find_max_batch(_training_step(model, 11, log), 2, 64, model=release, device="cpu",
                           on_try=lambda batch, fits: reported.append((batch, fits)))
    assert found == MaxBatch(batch=11, peak_bytes=None, tries=len(log))
    assert [batch for batch, _ in log] == [batch for batch, _ in reported] == [2, 4, 8, 16, 12, 10, 11]
    assert [fits for _, fits in reported] == [True, True, True, False, False, True, True]
    assert all(all(released) for _, released in log)
    assert all(p.grad is None for p in model.parameters())


def test_without_model_the_gradients_stay():
    """The release is what clears them: without ``model`` the step's own
    gradients accumulate from one try to the next."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    log = []
    find_max_batch(_training_step(model, 3, log), 2, 8, device="cpu")
    assert not any(all(released) for _, released in log[1:])


def test_release_memory_drops_gradients_of_a_module_or_tensors():
    model = nn.Linear(3, 2)
    model(torch.randn(5, 3)).sum().backward()
    weight = model.weight
    release_memory([weight])
    assert weight.grad is None and model.bias.grad is not None
    release_memory(model, "cpu")
    assert model.bias.grad is None
    with pytest.raises(TypeError, match="release_memory: model must be None, an nn.Module or an iterable"):
        release_memory(3)


def test_bad_arguments():
    step = lambda batch: None  # noqa: E731
    with pytest.raises(TypeError, match="find_max_batch: step_fn must be callable, got int"):
        find_max_batch(3, 1)
    with pytest.raises(TypeError, match="find_max_batch: start must be an int, got float"):
        find_max_batch(step, 2.0)
    with pytest.raises(TypeError, match="find_max_batch: limit must be an int, got bool"):
        find_max_batch(step, 2, True)
    with pytest.raises(ValueError, match="start and limit must be >= 1, got start=2, limit=0"):
        find_max_batch(step, 2, 0)
    with pytest.raises(TypeError, match="find_max_batch: model must be None, an nn.Module or an iterable of "
                                        "tensors; it holds a str"):
        find_max_batch(step, 2, 4, model=["weight"])
    with pytest.raises(TypeError, match="find_max_batch: on_try must be callable or None, got str"):
        find_max_batch(step, 2, 4, on_try="print")
    with pytest.raises(TypeError, match="device must be None, an int, a str or a torch.device, got float"):
        find_max_batch(step, 2, 4, device=0.5)


@pytest.mark.gpu
def test_peak_bytes_of_the_batch_found_on_cuda():
    mib = 2**20

    def step(batch):
        if batch > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        block = torch.empty(batch * mib, dtype=torch.uint8, device="cuda")
        block.fill_(1)

    found = find_max_batch(step, 4, 256)
    assert found.batch == 40
    assert 40 * mib <= found.peak_bytes - torch.cuda.memory_allocated() < 48 * mib


def test_docs_examples_run(capsys):
    """The guide page on checkpointing, find_max_batch and fit: each example
    runs and prints what its comments say."""
    page, test = "docs/guide/checkpoint-fit.md", "tests/test_max_batch.py::test_docs_examples_run"
    sections = ("## Checkpointing with BatchNorm", "## The largest batch that fits",
                "## A model within an activation budget")
    assert [len(section_blocks(page, section)) for section in sections] == [1, 1, 1]
    blocks = [claimed_block(page, section, 0, test) for section in sections]
    exec(compile(blocks[0], "docs checkpoint example", "exec"), {})
    counter, ratio = capsys.readouterr().out.split()
    assert counter == "1" and float(ratio) <= 0.3
    exec(compile(blocks[1], "docs find_max_batch example", "exec"), {})
    batch, peak, tries = capsys.readouterr().out.split()
    if not torch.cuda.is_available():
        assert (batch, peak, tries) == ("256", "None", "6")
    exec(compile(blocks[2], "docs fit example", "exec"), {})
    assert capsys.readouterr().out.splitlines()[-1] == "True"  # the budget is met
