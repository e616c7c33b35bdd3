"""``python -m effilayers.bench`` end to end on CPU: the JSON report and its
ratios, --train against a float64 reference, the peer libraries, every
model builder. The small models below are what the bench tests (these and
test_bench_*.py) hand to --model as ``tests.test_bench:<builder>``."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effilayers
from effilayers import bench

from .bench_cases import by_variant, check_ratios_against_plain, run_bench

# The bench on CPU, without the peer libraries (conftest.on_cpu_without_peers).
pytestmark = pytest.mark.usefixtures("on_cpu_without_peers")


def tiny_convertible_model() -> nn.Module:
    """Imported by the bench through ``tests.test_bench:tiny_convertible_model``."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


def tiny_convertible_model_with_dropout() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 5),
    )


def tiny_model_without_norm() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def not_a_module() -> int:
    return 3


def raises_while_building() -> nn.Module:
    raise RuntimeError("boom at build")


def tiny_model_with_a_conv3d() -> nn.Module:
    return nn.Sequential(nn.Unflatten(1, (3, 1)), nn.Conv3d(3, 4, 1), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                         nn.Linear(4, 3))


def tiny_model_with_batch_statistics_in_eval() -> nn.Module:
    # No running statistics: BatchNorm1d normalises with the batch's in eval too.
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.BatchNorm1d(4, track_running_stats=False), nn.ReLU(), nn.Linear(4, 3))


# ---- end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet_report(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resnet")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setitem(sys.modules, "inplace_abn", None)
        report = run_bench(tmp_path, "--model", "resnet50", "--size", "32", "--batch", "2", "--steps", "1")
    return report, tmp_path


def test_resnet50_json_report(resnet_report):
    report, _ = resnet_report
    assert {"command", "argv", "settings", "skipped", "environment", "results"} <= set(report)
    assert "effilayers.bench" in report["command"] and "--model resnet50" in report["command"]
    assert report["settings"] == {"device": "cpu", "batch": 2, "size": 32, "tokens": None, "dtype": "float32",
                                  "channels_last": False, "steps": 1, "train": 0, "max_batch_limit": None,
                                  "max_batch_precision": None,
                                  "compile": False, "loss_noise_factor": bench.LOSS_NOISE_FACTOR,
                                  "loss_tolerance_floor": 1e-5, "spread_warning": bench.SPREAD_WARNING,
                                  "timed_in_turn": True, "clock": "wall clock",
                                  "threads": torch.get_num_threads(), "cuda_peak": None}
    # One timed step has no spread: no timing warning.
    assert report["timing_warning"] is None
    assert report["skipped"] == ["resnet50 / inplace_abn (mapillary): skipped, inplace_abn is not installed"]
    assert {"torch", "device", "ops"} <= set(report["environment"])
    results = by_variant(report)
    assert list(results) == ["plain PyTorch", "effilayers ABN", "effilayers InPlaceABN"]
    assert all(r["same_weights"] for r in results.values())
    check_ratios_against_plain(results, "plain PyTorch")
    assert results["effilayers InPlaceABN"]["activation_bytes"] < results["plain PyTorch"]["activation_bytes"]
    for result in results.values():  # no --train: nothing checked, nothing claimed
        assert result["losses"] is None and result["losses_agree"] is None and result["loss_tolerance"] is None


def test_densenet121_end_to_end_with_checkpointing_baseline(tmp_path, capsys):
    report = run_bench(tmp_path, "--model", "densenet121", "--size", "32", "--batch", "2", "--steps", "1")
    results = by_variant(report)
    assert list(results) == ["plain PyTorch", "torch.utils.checkpoint", "effilayers"]
    check_ratios_against_plain(results, "plain PyTorch")
    saved = {name: result["activation_bytes"] for name, result in results.items()}
    assert saved["effilayers"] < saved["torch.utils.checkpoint"] < saved["plain PyTorch"]
    assert all(r["same_weights"] for r in results.values())
    out = capsys.readouterr().out
    assert "densenet121" in out and "images/s" in out and "CUDA peak MiB" not in out
    # a conclusion line: the fewest bytes, which the test above found to be effilayers'
    assert "\ndensenet121: effilayers saves " in out
    # The default report is short: the checkpointing note is counted, not printed.
    assert len(out.splitlines()) < 30
    assert "1 note(s) on the variants: --verbose prints them." in out and "note: densenet121" not in out
    skipped = "densenet121 / torchvision memory_efficient: skipped, torchvision is not installed"
    assert out.count(skipped) == 1 and report["skipped"] == [skipped]


def test_module_callable_model_with_training_curves(tmp_path, capsys):
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32",
                       "--batch", "2", "--steps", "1", "--train", "3", "--verbose")
    results = by_variant(report)
    assert list(results) == ["as given", "effilayers convert(inplace)"]
    check_ratios_against_plain(results, "as given")
    for result in results.values():
        assert len(result["losses"]) == 3 and all(loss > 0 for loss in result["losses"])
    given, converted = results["as given"], results["effilayers convert(inplace)"]
    expected = abs(converted["losses"][-1] - given["losses"][-1]) / given["losses"][-1]
    assert converted["final_loss_rel_diff"] == pytest.approx(expected)
    # leaky_relu(0.01) instead of relu: checked against its own function.
    assert converted["loss_reference"] == f"float64 plain PyTorch computing {bench.LEAKY}"
    assert converted["reference_losses"] != given["reference_losses"]
    assert converted["losses_agree"] is True and given["losses_agree"] is None
    assert "training check" in capsys.readouterr().out


def test_compile_adds_compiled_rows_beside_the_eager_ones(tmp_path, capsys, monkeypatch):
    import functools

    import torch._dynamo

    # The min-cut partitioner that decides what a compiled graph keeps,
    # without inductor's code generation (most of a minute on CPU); the
    # slow test below runs inductor.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager_decomp_partition"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    args = ("--model", "tests.test_bench:tiny_convertible_model", "--size", "32", "--batch", "2", "--steps", "1")
    # Both compiled rows run nn.Sequential.forward: each must compile afresh,
    # not as a recompile of the other's frame (past the limit dynamo would
    # run it eager, silently, in a row that says compiled).
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        report = run_bench(tmp_path, *args, "--compile", "--verbose")
    # one graph per compiled row, none for the eager rows
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert report["settings"]["compile"] is True
    out = capsys.readouterr().out
    assert "eager and torch.compile" in out
    results = by_variant(report)
    eager_names = ["as given", "effilayers convert(inplace)"]
    assert list(results) == eager_names + [f"{name} (compiled)" for name in eager_names]
    check_ratios_against_plain(results, "as given")
    for name in eager_names:
        eager, compiled = results[name], results[f"{name} (compiled)"]
        # the compiled graph's own bytes: the partitioner recomputes pointwise
        # ops rather than keep their outputs, so never more than eager
        assert 0 < compiled["activation_bytes"] <= eager["activation_bytes"], name
        assert compiled["step_time_s"] > 0
    compiled_plain, converted = results["as given (compiled)"], results["effilayers convert(inplace) (compiled)"]
    ratio = converted["activation_bytes"] / compiled_plain["activation_bytes"]
    assert f"activation bytes {ratio:.2f}x" in " ".join(converted["notes"])
    assert "note: tests.test_bench:tiny_convertible_model / effilayers convert(inplace) (compiled): " in out
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_dropout_draws_the_eager_reference_masks(tmp_path):
    """With --compile --train, inductor must not draw its own dropout masks:
    the compiled curves are checked against eager float64 runs."""
    import torch._dynamo

    torch._dynamo.reset()
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model_with_dropout", "--size", "32",
                       "--batch", "4", "--steps", "1", "--train", "2", "--compile", "--check-train")
    results = by_variant(report)
    assert results["as given"]["loss_noise_floor"] < 1e-5
    assert results["effilayers convert(inplace) (compiled)"]["losses_agree"] is True
    assert results["as given (compiled)"]["losses_agree"] is True
    torch._dynamo.reset()


def test_train_check_draws_the_same_dropout_masks_in_every_curve(tmp_path):
    """Every curve, the float64 reference's included, draws one set of
    dropout masks: plain PyTorch's noise floor stays float32 rounding (it was
    the masks' difference, ~1e-1, and the tolerance 10x that)."""
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model_with_dropout", "--size", "32",
                       "--batch", "4", "--steps", "1", "--train", "3", "--check-train")
    results = by_variant(report)
    assert list(results) == ["as given", "effilayers convert(inplace)"]
    assert results["as given"]["loss_noise_floor"] < 1e-5
    assert results["effilayers convert(inplace)"]["loss_tolerance"] == pytest.approx(1e-5)
    assert results["effilayers convert(inplace)"]["losses_agree"] is True


def test_model_that_does_not_convert_has_one_variant(tmp_path):
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_model_without_norm", "--size", "32",
                       "--batch", "2", "--steps", "1")
    assert [r["variant"] for r in report["results"]] == ["as given"]
    assert any("convert(inplace) row dropped" in line and "has no BatchNorm" in line for line in report["skipped"])


# ---- --train: losses against a float64 reference within a measured tolerance --------------


TRAIN_ARGS = ("--model", "resnet18", "--size", "64", "--batch", "2", "--steps", "1", "--train", "2")


def expected_tolerances(plain: dict) -> list[float]:
    noise = [abs(a - b) / abs(b) for a, b in zip(plain["losses"], plain["reference_losses"])]
    return [max(bench.LOSS_NOISE_FACTOR * n, 1e-5) for n in itertools.accumulate(noise, max)]


def test_train_check_on_resnet18_agrees_within_the_measured_tolerance(tmp_path, capsys):
    report = run_bench(tmp_path, *TRAIN_ARGS, "--check-train")
    results = by_variant(report)
    assert list(results) == ["plain PyTorch", "effilayers ABN", "effilayers InPlaceABN"]
    plain = results["plain PyTorch"]
    tolerances = expected_tolerances(plain)
    for name, result in results.items():
        assert result["loss_tolerances"] == pytest.approx(tolerances)
        assert result["loss_tolerance"] == pytest.approx(max(tolerances))
        errors = [abs(a - b) / abs(b) for a, b in zip(result["losses"], result["reference_losses"])]
        assert result["loss_rel_errors"] == pytest.approx(errors)
        assert result["losses_agree"] is (None if name == "plain PyTorch" else True)
        assert max(errors) <= max(tolerances)
    # 64x64, batch 2 is well-conditioned for resnet18: plain float32 is
    # within 1e-4 of float64, so the tolerance is tight.
    assert plain["loss_noise_floor"] < 1e-4
    # ABN computes plain PyTorch's function, InPlaceABN leaky_relu's.
    assert results["effilayers ABN"]["reference_losses"] == plain["reference_losses"]
    assert results["effilayers InPlaceABN"]["reference_losses"] != plain["reference_losses"]
    out = capsys.readouterr()
    assert "agree (tol" in out.out and "noise floor" in out.out and "warning" not in out.err


def test_train_check_catches_a_wrong_gradient(tmp_path, monkeypatch, capsys):
    """A variant with a right forward and a 1.5x gradient: the first loss
    agrees, the second (after one update) must not."""
    real_variants = bench.variants._resnet_variants

    def with_a_broken_variant(name):
        variants, skipped = real_variants(name)

        def broken():
            model = effilayers.models.resnet18(norm_act="abn")
            for parameter in model.parameters():
                parameter.register_hook(lambda grad: grad * 1.5)
            return model

        return [variants[0], bench.Variant(name, "broken ABN", broken)], skipped

    monkeypatch.setattr(bench.variants, "_resnet_variants", with_a_broken_variant)
    report = run_bench(tmp_path, *TRAIN_ARGS, "--check-train", status=1)
    broken = by_variant(report)["broken ABN"]
    assert broken["losses_agree"] is False
    assert broken["loss_rel_errors"][0] <= broken["loss_tolerances"][0]
    assert broken["loss_rel_errors"][1] > broken["loss_tolerances"][1]
    err = capsys.readouterr().err
    assert "effilayers-bench: warning: resnet18 / broken ABN: losses differ" in err and "step 2" in err
    assert "--check-train: 1 variant(s) left the loss tolerance: resnet18 / broken ABN" in err


def test_train_check_under_autocast_names_the_autocast_dtype(tmp_path, capsys):
    """Under --dtype bfloat16 the losses are bfloat16 autocast ones: the
    check's lines and warnings must not call them float32."""
    run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32", "--batch", "2",
              "--steps", "1", "--train", "2", "--dtype", "bfloat16", "--verbose")
    captured = capsys.readouterr()
    check = captured.out[captured.out.index("training check"):]
    assert "vs plain bfloat16 autocast: max rel diff" in check
    # Where float32 appears, it is the advice to check with it.
    assert "float32" not in check + captured.err.replace("--dtype float32", "")
    ill_conditioned = bench.Result("m", bench.PLAIN, True, 1, None, [1.0], 1.0, 1.0, losses=[1.0],
                                   loss_noise_floor=2e-2, loss_tolerance=2e-1)
    (line,) = bench.loss_warnings([ill_conditioned], torch.bfloat16)
    assert "plain PyTorch's own bfloat16 autocast losses are up to 2.0e-02" in line
    assert "ill-conditioned in bfloat16 autocast" in line
    # What to do about it: more values per channel, or the float32 check.
    advice = line[line.index("For a sharper check"):]
    assert "raise --batch and --size" in advice and "--dtype float32" in advice
    assert "float32" not in line.replace(advice, "")


def test_check_train_needs_train(capsys):
    assert bench.main(["--check-train"]) == 2
    assert "--check-train needs --train" in capsys.readouterr().err


# ---- peer libraries ------------------------------------------------------------------------


def test_absent_peers_are_skipped_with_one_line_each():
    variants, skipped = bench.variants_for("resnet18")
    assert [v.name for v in variants] == ["plain PyTorch", "effilayers ABN", "effilayers InPlaceABN"]
    assert skipped == ["resnet18 / inplace_abn (mapillary): skipped, inplace_abn is not installed"]
    variants, skipped = bench.variants_for("densenet264")
    assert [v.name for v in variants] == ["plain PyTorch", "torch.utils.checkpoint", "effilayers"]
    assert skipped == ["densenet264 / torchvision memory_efficient: skipped, torchvision is not installed"]


def test_a_peer_that_fails_to_import_is_skipped_with_the_reason(tmp_path, monkeypatch):
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.delitem(sys.modules, "torchvision")
    monkeypatch.syspath_prepend(str(tmp_path))
    _, skipped = bench.variants_for("densenet121")
    assert skipped == ["densenet121 / torchvision memory_efficient: skipped, cannot import torchvision: "
                       "RuntimeError: operator torchvision::nms does not exist"]


def test_torchvision_densenet_is_used_when_it_imports(monkeypatch):
    calls = []

    def densenet121(**kwargs):
        calls.append(kwargs)
        return effilayers.models.densenet121(memory_efficient=False)

    fake = types.ModuleType("torchvision")
    fake.models = types.SimpleNamespace(densenet121=densenet121)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    variants, skipped = bench.variants_for("densenet121")
    assert skipped == []
    assert [v.name for v in variants] == ["plain PyTorch", "torch.utils.checkpoint", "torchvision memory_efficient",
                                          "effilayers"]
    variants[2].build()
    assert calls == [{"memory_efficient": True}]
    # torchvision has no densenet264: skipped, with the reason.
    _, skipped = bench.variants_for("densenet264")
    assert skipped == ["densenet264 / torchvision memory_efficient: skipped, torchvision has no densenet264"]


class FakeInPlaceABN(nn.BatchNorm2d):
    """mapillary's InPlaceABN signature and function (BatchNorm, then the
    activation), computed out of place."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 activation="leaky_relu", activation_param=0.01):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.activation, self.activation_param = activation, activation_param

    def forward(self, x):
        x = super().forward(x)
        return F.leaky_relu(x, self.activation_param) if self.activation == "leaky_relu" else x


def test_mapillary_inplace_abn_is_swapped_in_when_it_imports(monkeypatch):
    fake = types.ModuleType("inplace_abn")
    fake.InPlaceABN = FakeInPlaceABN
    monkeypatch.setitem(sys.modules, "inplace_abn", fake)
    variants, skipped = bench.variants_for("resnet18")
    assert skipped == []
    peer = variants[-1]
    assert peer.name == "inplace_abn (mapillary)" and peer.function == bench.LEAKY
    torch.manual_seed(0)
    peer_model = peer.build()
    ours = effilayers.models.resnet18(norm_act="inplace")
    assert not any(isinstance(m, effilayers.nn.ABN) for m in peer_model.modules())
    assert sum(isinstance(m, FakeInPlaceABN) for m in peer_model.modules()) == \
        sum(isinstance(m, effilayers.nn.ABN) for m in ours.modules())
    # Block-final norms and shortcut norms are identity; the sum is activated after.
    activations = {name: m.activation for name, m in peer_model.named_modules() if isinstance(m, FakeInPlaceABN)}
    assert activations["layer1.0.bn2"] == activations["layer2.0.downsample.1"] == "identity"
    assert activations["bn1"] == activations["layer1.0.bn1"] == "leaky_relu"
    ours.load_state_dict(peer_model.state_dict())  # same keys, same weights
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(peer_model(x.clone()), ours(x.clone()), rtol=1e-4, atol=1e-5)
    # The --train reference: plain PyTorch modules, scale |weight| + eps as mapillary computes it.
    reference, notes = peer.plain_equivalent(peer_model)
    assert not any(isinstance(m, (FakeInPlaceABN, effilayers.nn.ABN)) for m in reference.modules())
    assert any(isinstance(m, nn.LeakyReLU) for m in reference.modules())
    torch.testing.assert_close(reference.layer1[0].bn1.weight, peer_model.layer1[0].bn1.weight.abs() + 1e-5)
    assert notes == ["reference scale |weight| + eps, as inplace_abn computes it"]
    torch.testing.assert_close(reference(x.clone()), ours(x.clone()), rtol=1e-3, atol=1e-4)


# ---- --model: every builder ----------------------------------------------------------------


def test_every_model_builder_is_accepted():
    names = bench.builtin_models()
    assert set(names) == {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
                          "wide_resnet50_2", "densenet121", "densenet161", "densenet169", "densenet201",
                          "densenet264"}
    for name, family in names.items():
        variants, _ = bench.variants_for(name)
        expected = ["plain PyTorch", "effilayers ABN", "effilayers InPlaceABN"] if family == "resnet" else \
            ["plain PyTorch", "torch.utils.checkpoint", "effilayers"]
        assert [v.name for v in variants] == expected and all(v.model == name for v in variants)
