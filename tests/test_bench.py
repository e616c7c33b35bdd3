"""``python -m effilayers.bench`` end to end on CPU at tiny sizes, the
training-loss check, peer-library detection, and the max-batch search
against a simulated memory limit."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effilayers
from effilayers import bench

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB,
                                      reason="matplotlib is not installed (pip install 'effilayers[bench]')")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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


@pytest.fixture(autouse=True)
def on_cpu_without_peers(monkeypatch):
    # The bench picks CUDA when it can; these tests pin down the CPU
    # behaviour, with the peer libraries absent unless a test injects one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("torchvision", "inplace_abn"):
        monkeypatch.setitem(sys.modules, name, None)


def run_bench(tmp_path, *args: str, plot: bool = False, status: int = 0) -> dict:
    json_path = tmp_path / "bench.json"
    argv = [*args, "--json", str(json_path)]
    if plot:
        argv += ["--plot", str(tmp_path / "bench.png")]
    assert bench.main(argv) == status
    return json.loads(json_path.read_text())


def by_variant(report: dict) -> dict:
    return {result["variant"]: result for result in report["results"]}


def check_ratios_against_plain(results: dict, plain_name: str, batch: int = 2) -> None:
    plain = results[plain_name]
    for result in results.values():
        assert result["cuda_peak_bytes"] is None and result["ratios"]["cuda_peak_bytes"] is None
        assert result["ratios"]["activation_bytes"] == pytest.approx(
            result["activation_bytes"] / plain["activation_bytes"])
        assert result["ratios"]["step_time"] == pytest.approx(result["step_time_s"] / plain["step_time_s"])
        assert result["images_per_s"] == pytest.approx(batch / result["step_time_s"])
        assert len(result["step_times_s"]) == 1


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
    assert report["settings"] == {"device": "cpu", "batch": 2, "size": 32, "dtype": "float32",
                                  "channels_last": False, "steps": 1, "train": 0, "max_batch_limit": None,
                                  "compile": False, "loss_noise_factor": bench.LOSS_NOISE_FACTOR,
                                  "loss_tolerance_floor": 1e-5}
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
    assert "densenet121" in out and "n/a" in out and "images/s" in out
    skipped = "densenet121 / torchvision memory_efficient: skipped, torchvision is not installed"
    assert out.count(skipped) == 1 and report["skipped"] == [skipped]


def test_module_callable_model_with_training_curves(tmp_path, capsys):
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32",
                       "--batch", "2", "--steps", "1", "--train", "3")
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


def test_compile_times_compiled_modules_and_counts_eager_activations(tmp_path, capsys):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    args = ("--model", "tests.test_bench:tiny_convertible_model", "--size", "32", "--batch", "2", "--steps", "1")
    # Both variants run nn.Sequential.forward: each must compile afresh, not
    # as a recompile of the other's frame (past the limit dynamo would run
    # it eager, silently, in a row that says compiled).
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        compiled = run_bench(tmp_path, *args, "--compile")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # one per variant at least
    assert compiled["settings"]["compile"] is True
    assert "torch.compile" in capsys.readouterr().out
    eager = run_bench(tmp_path, *args)
    assert eager["settings"]["compile"] is False
    for variant, result in by_variant(compiled).items():
        assert result["activation_bytes"] == by_variant(eager)[variant]["activation_bytes"]
        assert result["step_time_s"] > 0
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
    assert results["effilayers convert(inplace)"]["losses_agree"] is True
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
              "--steps", "1", "--train", "2", "--dtype", "bfloat16")
    captured = capsys.readouterr()
    check = captured.out[captured.out.index("training check"):]
    assert "vs plain bfloat16 autocast: max rel diff" in check
    assert "float32" not in check + captured.err
    ill_conditioned = bench.Result("m", bench.PLAIN, True, 1, None, [1.0], 1.0, 1.0, losses=[1.0],
                                   loss_noise_floor=2e-2, loss_tolerance=2e-1)
    (line,) = bench.loss_warnings([ill_conditioned], torch.bfloat16)
    assert "plain PyTorch's own bfloat16 autocast losses are up to 2.0e-02" in line
    assert "ill-conditioned in bfloat16 autocast" in line and "float32" not in line


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


# ---- the max-batch search ------------------------------------------------------------------


def simulated_memory(fits_up_to: int):
    calls = []

    def try_step(batch: int) -> bool:
        calls.append(batch)
        return batch <= fits_up_to

    return try_step, calls


@pytest.mark.parametrize("start", [1, 2, 3, 32, 100])
@pytest.mark.parametrize("fits_up_to", [0, 1, 2, 5, 31, 32, 33, 100, 777])
def test_find_max_batch_finds_the_simulated_limit(start, fits_up_to):
    search_limit = 1000
    try_step, calls = simulated_memory(fits_up_to)
    assert bench.find_max_batch(try_step, start, search_limit) == fits_up_to
    assert max(calls) <= search_limit
    assert len(calls) == len(set(calls)), "tried a batch twice"
    assert len(calls) <= bench.max_tries(start, search_limit)


@pytest.mark.parametrize("search_limit", [1, 7, 64, 100])
def test_find_max_batch_never_exceeds_its_limit(search_limit):
    try_step, calls = simulated_memory(10**6)
    assert bench.find_max_batch(try_step, 3, search_limit) == search_limit
    assert max(calls) <= search_limit


def test_find_max_batch_rejects_nonpositive_arguments():
    with pytest.raises(ValueError, match="start and limit must be >= 1"):
        bench.find_max_batch(lambda batch: True, 0, 10)


@pytest.mark.parametrize("error, out_of_memory", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                  "non-contiguous input."), False),  # search_max_batch decides (below)
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"), False),
    (ValueError("out of memory"), False),
])
def test_is_out_of_memory(error, out_of_memory):
    assert bench.is_out_of_memory(error) is out_of_memory


def test_search_max_batch_lets_other_errors_through():
    def step(batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        bench.search_max_batch(step, lambda: None, 2, 64)


def test_search_max_batch_takes_cudnn_not_supported_as_too_large_only_after_a_batch_trained():
    not_supported = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a " \
                    "non-contiguous input."

    def step(batch):
        if batch > 20:
            raise RuntimeError(not_supported)

    assert bench.search_max_batch(step, lambda: None, 2, 64) == 20

    def never(batch):
        raise RuntimeError(not_supported)

    # Unsupported at the first batch tried: a configuration problem, not a size.
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        bench.search_max_batch(never, lambda: None, 2, 64)


def test_search_max_batch_takes_batch_norms_one_value_error_as_not_training():
    def step(batch):
        if batch == 1:
            raise ValueError("Expected more than 1 value per channel when training, got input size [1, 8, 1, 1]")
        if batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert bench.search_max_batch(step, lambda: None, 4, 64) == 2

    def only_batch_norm(batch):
        raise ValueError("Expected more than 1 value per channel when training, got input size [1, 8, 1, 1]")

    assert bench.search_max_batch(only_batch_norm, lambda: None, 1, 64) == 0

    def other_value_error(batch):
        raise ValueError("a different problem")

    with pytest.raises(ValueError, match="different problem"):
        bench.search_max_batch(other_value_error, lambda: None, 2, 64)


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
def test_search_max_batch_takes_effilayers_one_value_errors_as_not_training(name):
    model, shape, message = _one_value_models()[name]
    with pytest.raises(ValueError, match=message):  # effilayers' own error, not torch's
        model(torch.randn(1, *shape))

    def step(batch):
        if batch >= 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        model(torch.randn(batch, *shape)).sum().backward()

    assert bench.search_max_batch(step, lambda: None, 2, 8) == 0


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
    monkeypatch.setattr(bench.measure, "_empty_cache", count_empty_cache)
    monkeypatch.setattr(bench.cli, "_progress", lambda total: bars.append(RecordingBar(total)) or bars[-1])
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32",
                       "--batch", "2", "--steps", "1", "--max-batch", "--max-batch-limit", "64")
    results = by_variant(report)
    assert {name: r["max_batch"] for name, r in results.items()} == limits
    assert results["effilayers convert(inplace)"]["ratios"]["max_batch"] == pytest.approx(30 / 12)
    assert state["tries"] >= 4  # both variants ran out of memory, each more than once
    assert report["settings"]["max_batch_limit"] == 64
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
    assert plain_row.count("OOM") == 4
    assert bars[0].count == bars[0].total
    # and the README's headline script renders such a report
    import benchmarks.headline as headline

    assert "| OOM | OOM | OOM | OOM |" in headline.table(report, "x.json")


def test_max_batch_on_cpu_exits_2_with_a_message(capsys):
    assert bench.main(["--max-batch"]) == 2
    assert "--max-batch needs CUDA" in capsys.readouterr().err


# ---- timing --------------------------------------------------------------------------------


class FakeEvent:
    recorded = []

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        FakeEvent.recorded.append(self)

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 250.0  # milliseconds


def test_time_call_uses_cuda_events_on_cuda_and_the_clock_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.recorded = []
    assert bench.time_call(lambda: calls.append(1), torch.device("cuda")) == pytest.approx(0.25)
    assert len(FakeEvent.recorded) == 2 and calls == [1]
    FakeEvent.recorded = []
    seconds = bench.time_call(lambda: calls.append(2), torch.device("cpu"))
    assert FakeEvent.recorded == [] and calls == [1, 2] and 0 <= seconds < 0.25


# ---- the plot ------------------------------------------------------------------------------


def fake_result(variant: str, activation: int, step: float, peak=None, max_batch=None, losses=None) -> bench.Result:
    return bench.Result("resnet50", variant, True, activation, peak, [step], step, 2 / step, max_batch=max_batch,
                        losses=losses)


def with_ratios(results):
    plain = results[0]
    for r in results:
        r.ratios = {"activation_bytes": r.activation_bytes / plain.activation_bytes,
                    "step_time": r.step_time_s / plain.step_time_s,
                    "cuda_peak_bytes": None if r.cuda_peak_bytes is None else r.cuda_peak_bytes / plain.cuda_peak_bytes,
                    "max_batch": None if r.max_batch is None else r.max_batch / plain.max_batch}
    return results


@needs_matplotlib
def test_plot_has_a_panel_per_measurement_with_ratio_labels(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    results = with_ratios([
        fake_result("plain PyTorch", 4 * 2**20, 0.1, peak=8 * 2**20, max_batch=100, losses=[3.0, 2.9]),
        fake_result("effilayers InPlaceABN", 2 * 2**20, 0.12, peak=5 * 2**20, max_batch=250, losses=[3.0, 2.9]),
    ])
    results[1].loss_rel_errors, results[0].loss_tolerances = [1e-7, 2e-7], [1e-5, 1e-5]
    figure = bench.plot(results, str(tmp_path / "plot.png"), pyplot)
    try:
        titles = [axis.get_title() for axis in figure.axes]
        assert titles == ["activation MiB (one forward)", "median step time, ms", "CUDA peak MiB (one step)",
                          "largest batch that trains", "training loss (same weights and data)",
                          "|loss - float64 reference| / reference"]
        for axis in figure.axes[:4]:
            assert len(axis.patches) == 2
        labels = {title: [text.get_text() for text in axis.texts] for title, axis in zip(titles, figure.axes)}
        assert labels["largest batch that trains"] == ["1.00x", "2.50x"]
        assert labels["activation MiB (one forward)"] == ["1.00x", "0.50x"]
        assert [bar.get_height() for bar in figure.axes[3].patches] == [100, 250]
        assert len(figure.axes[4].lines) == 2
    finally:
        pyplot.close(figure)
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG_SIGNATURE

    figure = bench.plot(with_ratios([fake_result("plain PyTorch", 1, 0.1), fake_result("effilayers", 1, 0.2)]),
                        str(tmp_path / "small.png"), pyplot)
    assert [axis.get_title() for axis in figure.axes] == ["activation MiB (one forward)", "median step time, ms"]
    pyplot.close(figure)


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("model, message", [
    ("resnet9000", "expected one of resnet18, resnet34, resnet50, resnet101, resnet152, resnext50_32x4d, "
                   "wide_resnet50_2, densenet121, densenet161, densenet169, densenet201, densenet264 "
                   "or 'module:callable'"),
    ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
    ("tests.test_bench:no_such_function", "has no attribute 'no_such_function'"),
    ("tests.test_bench:not_a_module", "expected an nn.Module"),
    ("tests.test_bench:raises_while_building",
     "--model 'tests.test_bench:raises_while_building': building the model raised RuntimeError: boom at build"),
])
def test_bad_model_exits_2_with_a_message(model, message, capsys):
    assert bench.main(["--model", model, "--size", "32", "--steps", "1"]) == 2
    assert message in capsys.readouterr().err


def test_a_model_normalising_with_batch_statistics_in_eval_is_probed_with_two_images(tmp_path, capsys):
    """The class-count probe (eval mode) used one image, which such a norm
    refuses whatever --batch was."""
    model = "tests.test_bench:tiny_model_with_batch_statistics_in_eval"
    report = run_bench(tmp_path, "--model", model, "--size", "32", "--batch", "4", "--steps", "1")
    assert report["results"][0]["variant"] == "as given"
    assert all(r["activation_bytes"] > 0 for r in report["results"])
    assert bench.main(["--model", model, "--size", "32", "--batch", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "the model failed on a (1, 3, 32, 32) image batch" in err and "use a larger --batch" in err


def test_channels_last_with_5d_weights_exits_2_with_a_message(capsys):
    argv = ["--model", "tests.test_bench:tiny_model_with_a_conv3d", "--size", "32", "--steps", "1"]
    assert bench.main([*argv, "--channels-last"]) == 2
    err = capsys.readouterr().err
    assert "effilayers-bench: error: --channels-last: the model has 5-D weights (1.weight)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float16"], "float16 needs CUDA"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--size", "16"], "--size must be >= 32, got 16"),
    (["--max-batch-limit", "64"], "--max-batch-limit needs --max-batch"),
])
def test_bad_settings_exit_2(argv, message, capsys):
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_states_the_size_minimum():
    assert "height and width, >= 32" in " ".join(bench.cli._parser().format_help().split())


def output_path_cases():
    yield pytest.param(["--json", "{tmp}/no/such/dir/out.json"], "does not exist", id="json-missing-dir")
    yield pytest.param(["--json", "{tmp}"], "is a directory", id="json-is-a-directory")
    yield pytest.param(["--plot", "{tmp}/missing/plot.png"], "does not exist", id="plot-missing-dir")
    if HAVE_MATPLOTLIB:
        yield pytest.param(["--plot", "{tmp}/plot.xyz"], "the file name must end in one of", id="plot-format")


@pytest.mark.parametrize("argv, message", list(output_path_cases()))
def test_unwritable_outputs_fail_before_the_benchmark(argv, message, tmp_path, capsys):
    assert bench.main([arg.format(tmp=tmp_path) for arg in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"effilayers-bench: error: {argv[0]} ") and message in captured.err
    assert captured.out == ""  # nothing was benchmarked


def test_both_kinds_of_error_share_one_prefix(capsys):
    with pytest.raises(SystemExit) as exited:
        bench.main(["--dtype", "int8"])
    assert exited.value.code == 2
    assert "effilayers-bench: error: argument --dtype: invalid choice" in capsys.readouterr().err
    assert bench.main(["--batch", "0"]) == 2
    assert capsys.readouterr().err.startswith("effilayers-bench: error: --batch")


def test_readme_headline_is_generated_from_the_committed_results(monkeypatch):
    """The README's headline table is exactly what benchmarks/headline.py makes
    of the results files it names: nobody edits the numbers by hand."""
    import re
    from pathlib import Path

    from benchmarks import headline

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    assert readme.count(headline.START) == 1 and readme.count(headline.END) == 1
    section = readme.split(headline.START)[1].split(headline.END)[0]
    sources = re.findall(r"^`(benchmarks/results/[^`]+\.json)`:", section, flags=re.MULTILINE)
    assert sources, "the headline section names no results file"
    monkeypatch.chdir(root)
    for source in sources:
        report = json.loads(Path(source).read_text())
        assert {"command", "settings", "environment", "results"} <= set(report)
    assert section.strip() == headline.render(sources).strip()


def test_gpu_session_script_commands_are_valid():
    """benchmarks/gpu_session.sh is what a session with a GPU runs; it can
    only run there, so check here that every command it would run names
    files that exist and options the bench command and pytest accept."""
    import shlex
    import subprocess

    from effilayers.bench.cli import _parser

    root = Path(__file__).resolve().parents[1]
    listing = subprocess.run(["bash", str(root / "benchmarks" / "gpu_session.sh"), "--list"],
                             capture_output=True, text=True, check=True).stdout
    commands = [line for line in listing.splitlines() if line and not line.startswith("#")]
    assert len(commands) >= 8, listing
    for command in commands:
        words = shlex.split(command)
        assert words[:3] in (["python3", "-m", "pytest"], ["python3", "-m", "effilayers.bench"]), command
        if words[2] == "effilayers.bench":
            arguments = _parser().parse_args(words[3:])
            assert arguments.device == "cuda" and arguments.json, command
        else:
            paths = [w for w in words[3:] if w.startswith(("tests", "benchmarks/"))]
            assert paths and all((root / path).exists() for path in paths), command
    bad = subprocess.run(["bash", str(root / "benchmarks" / "gpu_session.sh"), "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "part must be one of" in bad.stderr
