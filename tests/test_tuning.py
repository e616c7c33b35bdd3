"""Tuned launch configurations (``effilayers/_core/tuning.py``) and their
sweep (``benchmarks/tune.py``), on the CPU under TRITON_INTERPRET=1: a
merged table entry is what the launcher launches with, a shape without one
gets the heuristic, the sweep keeps to its budget and takes the fastest
candidate, and every candidate it would time on a GPU runs correctly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from benchmarks import tune
from effilayers._core import tuning
from effilayers.ops.cross_entropy import triton as cross_entropy_kernels
from effilayers.ops.reductions import triton as reductions_kernels
from effilayers.ops.softmax import triton as softmax_kernels

from .helpers import LaunchSpy

pytestmark = pytest.mark.skipif(tuning.arch(torch.device("cpu")) is None,
                                reason="launches Triton kernels on the CPU: needs TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def forget_tables():
    tuning.clear()
    yield
    tuning.clear()



def _softmax(columns):
    x = torch.randn(3, columns) * 3
    return (lambda: softmax_kernels.softmax_forward(x, -1, False, None)), torch.softmax(x.double(), -1)


def _cross_entropy(classes):
    logits, target = torch.randn(3, classes, 1) * 3, torch.tensor([0, classes - 1, 5])
    scale = torch.ones(1)
    return ((lambda: cross_entropy_kernels.cross_entropy_rows_triton(logits, target, None, None, scale, -100, 0.0)),
            F.cross_entropy(logits.double()[..., 0], target, reduction="none"))


def _sum(columns):
    x, out = torch.randn(3, columns, 1) * 3 + 1, torch.full((3, 1), float("nan"))
    return (lambda: reductions_kernels.reduce_triton(x, out, "sum", 0.0) or out), x.double().sum(1)


# family: (kernel module, kernel name, launch, a tuned shape, an untuned one, the table's config)
CASES = {
    "softmax": (softmax_kernels, "_row_forward", _softmax, 700, 3000, {"BLOCK": 1024, "ROWS": 2, "num_warps": 2}),
    "cross_entropy": (cross_entropy_kernels, "_cross_entropy_rows_kernel", _cross_entropy, 700, 3000,
                      {"BLOCK": 128, "num_warps": 1, "num_stages": 1}),
    "reductions": (reductions_kernels, "_reduce_kernel", _sum, 700, 3000,
                   {"BLOCK_R": 64, "BLOCK_I": 1, "splits": 4, "num_warps": 2}),
}


@pytest.mark.parametrize("family", CASES)
def test_a_merged_entry_is_launched_and_a_missing_one_falls_back(family, tmp_path, monkeypatch):
    module, kernel, make, tuned, untuned, config = CASES[family]
    launch, expected = make(tuned)
    key = tuning.probe(launch).key
    # A sweep's output: one complete entry, one cut short (not merged); the
    # table already holds another key, which the merge keeps.
    table = tuning.table_path(family, "interpreter", tmp_path)
    table.parent.mkdir()
    table.write_text(json.dumps({"arch": "interpreter", "entries": {"kept 1": {"config": {"BLOCK": 1}}}}))
    timed = dict(us=1.0, heuristic_us=2.0, timings=[])
    winners = {"arch": "interpreter", "device": "CPU", "date": "2026-12-01", "torch": "x", "triton": "y",
               "entries": {family: {key: dict(timed, complete=True, config=config),
                                    "cut short": dict(timed, complete=False, config=config)}}}
    (tmp_path / "winners.json").write_text(json.dumps(winners))
    assert tune.main(["merge", str(tmp_path / "winners.json"), "--ops", str(tmp_path)]) == 0
    assert set(json.loads(table.read_text())["entries"]) == {"kept 1", key}

    monkeypatch.setattr(tuning, "_OPS", tmp_path)
    spy = LaunchSpy(getattr(module, kernel))
    monkeypatch.setattr(module, kernel, spy)
    result = launch()
    torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-6)
    grid, launched = spy.launches[-1]
    assert {name: launched[name] for name in config if name != "splits"} == \
        {name: value for name, value in config.items() if name != "splits"}
    if "splits" in config:  # 700 rows in splits of 192 (whole tiles of 64)
        assert grid[1] == config["splits"]

    launch, expected = make(untuned)
    torch.testing.assert_close(launch().double(), expected, rtol=1e-5, atol=1e-6)
    grid, launched = spy.launches[-1]
    request = tuning.probe(launch)
    heuristic = module.tuning_candidates(request.launcher, request.sizes, request.dtype)[0]
    assert launched["num_warps"] == heuristic["num_warps"] and "num_stages" not in launched
    assert all(launched[name] == value for name, value in heuristic.items() if name.isupper())


def test_shape_keys_round_sizes_up_to_powers_of_two():
    assert tuning.shape_key("row_forward", torch.bfloat16, 32000) == "row_forward bfloat16 32768"
    assert tuning.shape_key("reduce_sum", torch.float16, 1, 16384, 100) == "reduce_sum float16 1x16384x128"
    assert tuning.lookup("softmax", torch.device("cpu"), "row_forward", torch.float32, 700) is None  # no table


def test_the_sweep_keeps_its_budget_and_takes_the_fastest(monkeypatch):
    """time_key on a clock that moves 1 s per timing: the fastest candidate
    wins; a deadline that falls inside a key leaves it incomplete (and the
    merge leaves it out)."""
    clock = [0.0]
    seconds = {1024: 3e-6, 2048: 1e-6, 4096: 2e-6}

    def timed(fn, device, rep_ms):
        clock[0] += 1.0
        return seconds[tuning.table("softmax", "sm90")["k"]["BLOCK"]]

    monkeypatch.setattr(tune, "device_median_seconds", timed)
    monkeypatch.setattr(tune.time, "monotonic", lambda: clock[0])
    case = tune.Case("softmax", "fake", lambda device, tiny: (lambda: None))
    key = tune.Key("softmax", "k", case, [{"BLOCK": 1024}, {"BLOCK": 2048}, {"BLOCK": 4096}])
    entry = tune.time_key(key, "sm90", deadline=100.0)
    assert entry["complete"] and entry["config"] == {"BLOCK": 2048}
    assert entry["us"] == pytest.approx(1.0) and entry["heuristic_us"] == pytest.approx(3.0)
    clock[0] = 0.0
    entry = tune.time_key(key, "sm90", deadline=tune.RESERVE + 1.5)  # room for two candidates
    assert not entry["complete"] and len(entry["timings"]) == 2 and entry["config"] == {"BLOCK": 2048}


def test_every_candidate_of_the_sweep_runs_correctly(tmp_path, capsys):
    """The dry run lists every key of the benchmark shapes with its
    candidates, each within the register rule, and --tiny runs each one
    (less warps and stages, which the interpreter ignores) at a small shape
    of its launcher against the heuristic's result."""
    assert tune.main(["sweep", "--dry-run"]) == 0
    listed = capsys.readouterr().out
    keys = tune.keys(list(tune.FAMILIES))
    assert {key.family for key in keys} == set(tune.FAMILIES)
    assert f"{len(keys)} keys, {sum(len(k.candidates) for k in keys)} candidates" in listed
    assert sum(len(k.candidates) for k in keys) >= 4 * len(keys)  # the heuristic is not alone
    for key in keys:
        assert all(tuning.plausible(c.get("BLOCK") or c["BLOCK_R"] * c["BLOCK_I"], c["num_warps"])
                   for c in key.candidates), key

    out = tmp_path / "tiny.json"
    assert tune.main(["sweep", "--tiny", "--out", str(out)]) == 0, capsys.readouterr().out
    rows = json.loads(out.read_text())["tiny"]
    assert all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]
    ran = {(row["family"], row["tiny_key"], _blocks(row["config"])) for row in rows}
    for key in keys:
        tiny_key = tuning.probe(key.case.make("cpu", True)).key
        assert {(key.family, tiny_key, _blocks(c)) for c in key.candidates} <= ran, key


def _blocks(config: dict) -> str:
    return json.dumps({name: value for name, value in config.items() if name.isupper() or name == "splits"},
                      sort_keys=True)


def test_bench_rows_record_the_configuration_that_ran():
    """What benchmarks/conftest.launch_configs puts in a bench row: each
    distinct configuration the launchers chose, heuristic or from a table,
    rows per program included, and nothing outside the recording."""
    from benchmarks.conftest import launch_configs

    x = torch.randn(6, 40)
    launch = lambda: softmax_kernels.softmax_forward(x, -1, False, None)  # noqa: E731
    key = tuning.probe(launch).key
    heuristic = softmax_kernels._row_heuristic(40, 4)
    assert heuristic.get("ROWS", 1) > 1  # short rows come several to a program
    twice = launch_configs(lambda: (launch(), launch()))
    assert twice == [{"family": "softmax", "key": key, "config": heuristic, "source": "heuristic"}]
    tuning.install("softmax", "interpreter", {key: {"BLOCK": 64, "num_warps": 2, "persistent": 1}})
    assert launch_configs(launch) == [{"family": "softmax", "key": key, "source": "tuned",
                                       "config": {"BLOCK": 64, "num_warps": 2, "persistent": 1}}]
    with tuning.recording() as outer:
        cross_entropy_kernels.cross_entropy_rows_triton(torch.randn(3, 40, 1), torch.tensor([0, 1, 2]), None, None,
                                                        torch.ones(1), -100, 0.0)
    assert [(r["family"], r["source"]) for r in outer] == [("cross_entropy", "heuristic")]
    launch()
    assert tuning._recorded is None
