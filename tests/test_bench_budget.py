"""``effilayers-bench --budget``: fit, torch's checkpoint_sequential and
torch.compile under an activation memory budget, side by side."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import re

import pytest
import torch
from torch import nn

from effilayers import bench, memory
from effilayers.bench import budget
from effilayers.fit import parse_budget

from .bench_cases import by_variant, check_ratios_against_plain, run_bench

pytestmark = pytest.mark.usefixtures("on_cpu_without_peers")

MODEL = "tests.test_bench_budget:tiny_deep_model"
# torch's auto-SAC solves with pulp and fits its trade-off curves with pwlf (effilayers[bench]).
AUTO_SAC_PACKAGES = all(importlib.util.find_spec(name) is not None for name in ("pulp", "pwlf"))


def _auto_sac_dropped_because(report: dict) -> str:
    return next(line for line in report["skipped"] if f"{budget.AUTO_SAC}: dropped" in line)


def _no_auto_sac(monkeypatch) -> None:
    """Where the auto-SAC row is not the point: its estimate fails at once."""
    def unavailable(*args, **kwargs):
        raise ImportError("not estimated in this test")

    monkeypatch.setattr(budget, "plan_auto_sac", unavailable)


def _rows_of_tiny_model(budget_value, **options):
    """budget_variants on MODEL's plain row, on the CPU, outside the bench."""
    from effilayers.bench.variants import variants_for

    variants, _ = variants_for(MODEL)
    return budget.budget_variants(variants[:1], budget_value, example=lambda: torch.randn(2, 3, 16, 16),
                                  prepare=lambda model: model.train(), autocast=contextlib.nullcontext, **options)


def tiny_deep_model() -> nn.Module:
    """Imported by the bench: one nn.Sequential deep enough for fit to checkpoint."""
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1, bias=False)]
    for _ in range(3):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def test_budget_rows_sit_beside_plain_with_bytes_and_ratios(tmp_path, monkeypatch):
    import functools

    import torch._dynamo

    # The partitioner that reads activation_memory_budget (min-cut) without
    # inductor's code generation, which would take most of a minute on CPU.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager_decomp_partition"))

    report = run_bench(tmp_path, "--model", MODEL, "--size", "32", "--steps", "1", "--budget", "0.5")
    results = by_variant(report)
    fitted = results["fit(0.5)"]
    torch_checkpoint = results["checkpoint_sequential (fit's parts)"]
    compiled = results["torch.compile budget 0.5"]
    torch_runs = results["torch checkpoint (to fit's bytes)"]
    every_block = results[budget.EVERY_BLOCK]
    plain = results["as given"]
    check_ratios_against_plain(results, "as given")
    for row in (fitted, torch_checkpoint, compiled, torch_runs, every_block):
        assert row["activation_bytes"] > 0 and row["step_time_s"] > 0 and row["ratios"]["step_time"] > 0
    assert fitted["activation_bytes"] <= 0.5 * plain["activation_bytes"]
    # fit checkpointed children of the model (its only nn.Sequential): torch's
    # row runs the whole of it in ceil(sqrt(13)) = 4 segments
    assert "the model in 4 segments" in " ".join(torch_checkpoint["notes"])
    assert torch_checkpoint["activation_bytes"] < plain["activation_bytes"]
    # torch's checkpoint over fit's runs, and more of fit's plan where needed,
    # until the plain model keeps no more than fit's: the like-for-like peer
    assert torch_runs["activation_bytes"] <= fitted["activation_bytes"]
    assert "reaches" in " ".join(torch_runs["notes"])
    # every child its own checkpoint, each keeping its input: here the children are single layers, so
    # a norm keeps the convolution's output and the activation the norm's, which plain autograd never
    # saves both of; more than the plain model keeps, and more than fit's plan
    assert "around every block of the plain model: 0, 1, 2, 3, ... (13 in all)" in " ".join(every_block["notes"])
    assert every_block["activation_bytes"] > plain["activation_bytes"] > fitted["activation_bytes"]
    # counted on the compiled module after it compiled: the partitioner's
    # choice under the budget, never more than eager keeps
    assert compiled["activation_bytes"] <= plain["activation_bytes"]
    # no random op here: every row's recomputation gives plain's gradients
    assert plain["gradients_match"] is None
    for row in (plain, fitted, torch_checkpoint, compiled, torch_runs, every_block):
        assert row["gradient_dtype"] == "float64"
    for row in (fitted, torch_checkpoint, compiled, torch_runs, every_block):
        assert row["gradients_match"] is True and row["gradient_max_rel_diff"] <= 1e-7
    # torch's auto-SAC estimates on a CUDA device only: here its row says why it is missing, in torch's words
    assert budget.AUTO_SAC not in results
    dropped = _auto_sac_dropped_because(report)
    if not AUTO_SAC_PACKAGES:
        assert "pip install" in dropped
    elif not torch.cuda.is_available():
        assert "Roofline estimation needs to access CUDA capabilities" in dropped
        assert "this machine has none" in dropped
    torch._dynamo.reset()


def test_a_budget_below_reach_drops_fit_with_the_smallest_figure(tmp_path, monkeypatch, capsys):
    # Compiling is not the point here: the row's module runs eager.
    monkeypatch.setattr(budget, "compile_under_budget", lambda model, fraction: model)
    _no_auto_sac(monkeypatch)
    report = run_bench(tmp_path, "--model", MODEL, "--size", "32", "--steps", "1", "--budget", "0.05")
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "fit(0.05): dropped" in line)
    assert "smallest reachable figure" in line
    names = set(by_variant(report))
    assert "fit(0.05)" not in names
    assert {"checkpoint_sequential (sqrt(n) segments; fit dropped)", "torch.compile budget 0.05"} <= names
    assert "torch checkpoint (to fit's bytes)" not in names  # no fit bytes to reach
    assert any("fit(0.05): dropped" in line for line in report["skipped"])


def test_a_budget_in_bytes_fits_to_those_bytes_and_compiles_at_their_fraction(tmp_path, monkeypatch):
    fractions = []
    monkeypatch.setattr(budget, "compile_under_budget", lambda model, fraction: fractions.append(fraction) or model)
    _no_auto_sac(monkeypatch)
    plain_bytes = memory.activation_bytes(tiny_deep_model(), torch.randn(2, 3, 32, 32))
    kib = plain_bytes // 2 // 2**10
    report = run_bench(tmp_path, "--model", MODEL, "--size", "32", "--steps", "1", "--budget", f"{kib}KiB")
    results = by_variant(report)
    plain = results["as given"]
    assert plain["activation_bytes"] == plain_bytes
    assert results[f"fit({kib} KiB)"]["activation_bytes"] <= kib * 2**10
    # torch.compile takes a fraction: the bytes over the plain model's
    (fraction,) = fractions
    assert fraction == pytest.approx(kib * 2**10 / plain_bytes)
    assert f"torch.compile budget {fraction:.3g}" in results


@pytest.mark.parametrize("text, expected", [
    ("0.35", 0.35), ("1", 1.0),  # a number in (0, 1]: a fraction
    ("123456", 123456), ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1e6", 10**6),
])
def test_budget_takes_what_fit_takes(text, expected):
    value = budget.budget_argument(text)
    assert value == expected and type(value) is type(expected)
    if isinstance(expected, int):  # sizes are read by fit's own parser
        assert value == parse_budget(text, 0)


@pytest.mark.parametrize("text, message", [
    ("0", "budget must be a positive size, got '0'"),
    ("1.5", "'1.5' is neither a fraction in (0, 1] of the plain model's activation bytes nor a whole number"),
    ("nan", "'nan' is neither a fraction"),
    ("half", "budget 'half' is not a size; write e.g. '2GiB'"),
    ("2XB", "budget '2XB' is not a size"),
    ("-1", "budget '-1' is not a size"),
])
def test_bad_budget_forms_are_argparse_errors_naming_the_argument(text, message, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.main(["--budget", text])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"effilayers-bench: error: argument --budget: {message}" in err and "Traceback" not in err


def test_a_budget_with_compile_exits_2(capsys):
    assert bench.main(["--budget", "0.5", "--compile"]) == 2
    assert "run it without --compile" in capsys.readouterr().err


@pytest.mark.parametrize("arguments", [["--offload"], ["--offload", "--budget", "0.5", "--device", "cpu"]])
def test_offload_without_a_cuda_budget_exits_2(capsys, arguments):
    assert bench.main(arguments) == 2
    assert "--offload goes with --budget on --device cuda" in capsys.readouterr().err


def test_offload_reaches_fit_and_names_the_row(monkeypatch):
    _no_auto_sac(monkeypatch)
    asked = []
    real_fit = budget.fit
    monkeypatch.setattr(budget, "fit", lambda *args, **kwargs: asked.append(kwargs) or real_fit(*args, **kwargs))
    # Not the point here, and it measures the plain model under torch's checkpoint, run by run.
    monkeypatch.setattr(budget, "_torch_checkpoint_row", lambda plain, *args: plain)
    rows, _ = _rows_of_tiny_model(0.5, offload=True)
    assert asked == [{"offload": True}]
    assert rows[0].name == "fit(0.5, offload)"


def test_budget_rows_runs_only_the_rows_asked_for(tmp_path, monkeypatch):
    # Were they built, these would fail the run: the rows not asked for are not.
    monkeypatch.setattr(budget, "plan_auto_sac", None)
    monkeypatch.setattr(budget, "_torch_checkpoint_row", None)
    monkeypatch.setattr(budget, "compile_under_budget", None)
    report = run_bench(tmp_path, "--model", MODEL, "--size", "32", "--steps", "1", "--budget", "0.5",
                       "--budget-rows", "fit, checkpoint-every-block")
    # The model's own rows stay (convert: it has BatchNorm + ReLU); of --budget's, only those asked for.
    assert [result["variant"] for result in report["results"]] == [
        "as given", "effilayers convert(inplace)", "fit(0.5)", budget.EVERY_BLOCK]
    # No line says a row was dropped: the others were not asked for.
    assert not any(budget.AUTO_SAC in line or "checkpoint_sequential" in line for line in report["skipped"])
    results = by_variant(report)
    assert results["fit(0.5)"]["ratios"]["activation_bytes"] <= 0.5
    assert results[budget.EVERY_BLOCK]["gradients_match"] is True


class _StemModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.body = tiny_deep_model()[1:-3]  # its norms and convolutions, 8 channels in and out
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.body(self.pool(self.relu(self.bn1(self.conv1(x))))).mean((2, 3)))


def tiny_stem_model() -> nn.Module:
    """Imported by the bench: a stem called module by module from forward (a chain fit can checkpoint)."""
    return _StemModel()


def test_the_fit_row_names_the_chain_it_checkpointed_and_the_torch_row_says_it_has_none(tmp_path):
    report = run_bench(tmp_path, "--model", "tests.test_bench_budget:tiny_stem_model", "--size", "32", "--steps",
                       "1", "--budget", "0.45", "--budget-rows", "fit,checkpoint-to-fit")
    results = by_variant(report)
    fitted, torch_row = results["fit(0.45)"], results[budget.TORCH_CHECKPOINT]
    assert fitted["gradients_match"] is True and torch_row["gradients_match"] is True
    assert re.search(r"fit steps: checkpoint the model[,;].*; (conv1|bn1|relu|pool)(\.\.(bn1|relu|pool))? "
                     r"checkpointed (as one segment|alone)", fitted["notes"][0]), fitted["notes"]
    assert "has no counterpart here" in " ".join(torch_row["notes"])


def test_budget_rows_without_the_fit_row_still_plans_for_the_torch_rows(monkeypatch):
    planned = []
    real_fit = budget.fit
    monkeypatch.setattr(budget, "fit", lambda *args, **kwargs: planned.append(True) or real_fit(*args, **kwargs))
    rows, lines = _rows_of_tiny_model(0.5, only=frozenset({"checkpoint-sequential"}))
    assert planned == [True] and lines == []
    assert [row.name for row in rows] == ["checkpoint_sequential (fit's parts)"]


def test_below_reach_a_torch_row_asked_for_says_why_it_is_dropped(monkeypatch):
    rows, lines = _rows_of_tiny_model(0.05, only=frozenset({"checkpoint-to-fit"}))
    # The fit row was not asked for: no line of its own, the reason in the torch row's.
    assert rows == [] and len(lines) == 1
    assert lines[0].startswith(f"{MODEL} / {budget.TORCH_CHECKPOINT}: dropped, fit has no plan to follow: ")
    assert "smallest reachable figure" in lines[0]


def test_budget_rows_without_a_budget_exits_2(capsys):
    assert bench.main(["--budget-rows", "fit"]) == 2
    assert "--budget-rows chooses among --budget's rows; give --budget too" in capsys.readouterr().err


@pytest.mark.parametrize("text, shown", [("fit,every-block", "'every-block'"), ("", "''"), ("fit,", "''")])
def test_an_unknown_budget_row_is_an_argparse_error_listing_the_rows(capsys, text, shown):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--budget", "0.5", "--budget-rows", text])
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    rows = ", ".join(budget.BUDGET_ROWS)
    assert f"argument --budget-rows: {shown}: not a --budget row; the rows are {rows}" in err


def test_help_documents_budget(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--budget BUDGET" in out and "activation_memory_budget" in out and "checkpoint_sequential" in out
    assert "torch checkpoint (every block)" in out
    assert "2GiB" in out and "0.35" in out


def test_compile_under_budget_sets_the_budget_only_while_the_model_runs():
    import torch._functorch.config as functorch_config

    seen = []

    def compiler(forward):
        def run(*args):
            seen.append(functorch_config.activation_memory_budget)
            return forward(*args)
        return run

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    expected = model(x)
    before = functorch_config.activation_memory_budget
    compiled = budget.compile_under_budget(model, 0.25, compiler)
    assert compiled is model and set(model.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(model(x), expected)
    assert seen == [0.25] and 0.25 != before
    assert functorch_config.activation_memory_budget == before


class TinyLanguageModel(nn.Module):
    """Token ids -> next-token logits, its blocks in an nn.ModuleList looped
    over in forward, as most transformers keep them."""

    def __init__(self, vocabulary: int = 40, width: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.1, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocabulary)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny_language_model() -> nn.Module:
    """Imported by the bench (--tokens)."""
    return TinyLanguageModel()


def test_a_language_model_gets_fit_and_every_block_checkpointed(tmp_path, monkeypatch, capsys):
    """--tokens: token ids in, next-token cross-entropy; the blocks of a
    ModuleList are what fit checkpoints and what the every-block row wraps.
    With dropout drawing, fit's and torch's checkpoints replay the forward's
    masks and their gradients are plain's; torch.compile's budget draws new
    ones when it recomputes (pytorch#190758), and its row says so. torch's
    auto-SAC runs its whole pipeline (estimates, ILP, per-op policy) with a
    stand-in for its roofline, which needs a CUDA device: each op's time
    from its output's size."""
    import functools

    import torch._dynamo

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager_decomp_partition"))
    if AUTO_SAC_PACKAGES:
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator

        def output_sized(cls, func, args, kwargs):
            output = func(*args, **(kwargs or {}))
            return output, 1e-6 * sum(value.numel() for value in torch.utils._pytree.tree_leaves(output)
                                      if isinstance(value, torch.Tensor))

        monkeypatch.setattr(RuntimeEstimator, "_roofline_estimate", classmethod(output_sized))
    report = run_bench(tmp_path, "--model", "tests.test_bench_budget:tiny_language_model", "--tokens", "12",
                       "--steps", "1", "--budget", "0.6")
    assert report["settings"]["tokens"] == 12
    results = by_variant(report)
    check_ratios_against_plain(results, "as given")
    plain, fitted, every = results["as given"], results["fit(0.6)"], results[budget.EVERY_BLOCK]
    assert fitted["activation_bytes"] <= 0.6 * plain["activation_bytes"]
    assert every["activation_bytes"] < plain["activation_bytes"]
    assert "blocks.0, blocks.1, blocks.2" in " ".join(every["notes"])
    # the fit row says what each unit became and why, as the report does
    assert all(f"; unit blocks.{index}: selective, keeps its" in " ".join(fitted["notes"]) for index in range(3))
    # torch's checkpoint around whole blocks of the ModuleList, in fit's order, until fit's bytes: fit made
    # its blocks selective, which torch's checkpoint has no counterpart of
    torch_runs = results[budget.TORCH_CHECKPOINT]
    notes = " ".join(torch_runs["notes"])
    assert torch_runs["activation_bytes"] <= fitted["activation_bytes"] and "reaches" in notes
    assert "what fit recomputes whole (nothing)" in notes and "of the 3 units whole (blocks." in notes
    assert "selective units have no counterpart" in notes and "BatchNorm" not in notes
    compiled = results["torch.compile budget 0.6"]
    assert fitted["gradients_match"] is True and every["gradients_match"] is True
    assert torch_runs["gradients_match"] is True
    # the same kernels, same masks
    assert fitted["gradient_max_rel_diff"] == every["gradient_max_rel_diff"] == torch_runs["gradient_max_rel_diff"] == 0
    assert compiled["gradients_match"] is False and compiled["gradient_max_rel_diff"] > 0.1
    assert "gradients differ from plain PyTorch's" in " ".join(compiled["notes"])
    table = capsys.readouterr().out
    assert "grads = plain" in table
    lines = {name: next(line for line in table.splitlines() if f"  {name}  " in line)
             for name in ("as given", "fit(0.6)", "torch.compile budget 0.6")}
    assert lines["as given"].rstrip().endswith("reference") and lines["fit(0.6)"].rstrip().endswith("yes")
    assert f"no ({compiled['gradient_max_rel_diff']:.1e})" in lines["torch.compile budget 0.6"]
    if not AUTO_SAC_PACKAGES:
        assert "pip install" in _auto_sac_dropped_because(report)
    else:
        auto_sac = results[budget.AUTO_SAC]
        # the ILP's modules selective, their dropout replayed by torch's checkpoint
        assert "sac_milp given" in " ".join(auto_sac["notes"]) and "discards" in " ".join(auto_sac["notes"])
        assert auto_sac["activation_bytes"] < plain["activation_bytes"]
        assert auto_sac["gradients_match"] is True
    torch._dynamo.reset()


def test_the_auto_sac_policy_keeps_the_planned_ops_and_recomputes_what_it_does_not_know():
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from effilayers.bench.auto_sac import OpPolicy

    aten = torch.ops.aten
    policy = OpPolicy(["mm", "relu", "mm"], [1, 0, 1])
    forward, recompute = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    assert policy(forward, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert policy(forward, aten.clone.default) == CheckpointPolicy.PREFER_RECOMPUTE  # not in the estimate's list
    assert policy(forward, aten.relu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    # the recomputation walks the list from its start
    assert policy(recompute, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    # not the op the estimate saw there: recomputed, counted
    assert policy(forward, aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE and policy.mismatched == 1
    assert policy(forward, aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE and policy.mismatched == 2


def test_compare_gradients_names_the_worst_parameter_and_a_missing_one():
    from effilayers.bench.measure import GRADIENT_TOLERANCE, compare_gradients

    reference = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([4.0])}
    assert compare_gradients(dict(reference), reference, torch.float32) == (True, 0.0, "a")
    close = {"a": reference["a"] + 1e-5, "b": reference["b"]}
    match, worst, where = compare_gradients(close, reference, torch.float32)
    assert match and worst == pytest.approx(1e-5 / 2, rel=1e-2) and where == "a"
    far = {"a": reference["a"], "b": torch.tensor([3.0])}
    assert compare_gradients(far, reference, torch.float32) == (False, 0.25, "b")
    # bfloat16 autocast rounds more: the same difference within its tolerance
    assert 0.25 > GRADIENT_TOLERANCE[torch.bfloat16]
    assert compare_gradients({"a": reference["a"]}, reference, torch.float32) == (False, float("inf"), "b")


class _NormSummedElsewhere(nn.BatchNorm2d):
    """BatchNorm2d's training function, its sums in another order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(0, 2, 3), keepdim=True)
        variance = (x - mean).square().mean(dim=(0, 2, 3), keepdim=True)
        return (x - mean) * torch.rsqrt(variance + self.eps) * self.weight[:, None, None] + self.bias[:, None, None]


def _deep_norm_stack(norm: type[nn.BatchNorm2d], depth: int = 30) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1, bias=False)]
    for _ in range(depth):
        layers += [norm(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def test_on_a_gpu_the_gradient_check_steps_in_float32_without_tf32():
    from effilayers.bench import measure

    model = nn.Linear(3, 2)
    for device, dtype, expected in (("cuda", torch.bfloat16, torch.float32), ("cuda", torch.float32, torch.float32),
                                    ("cpu", torch.bfloat16, torch.float64)):
        setup = measure.Setup(torch.device(device), batch=2, size=4, dtype=dtype, channels_last=False, steps=1,
                              train_steps=0)
        assert measure.gradient_check_dtype(model, setup) == expected
    # a half model keeps the bench's dtype
    setup = measure.Setup(torch.device("cuda"), batch=2, size=4, dtype=torch.float16, channels_last=False, steps=1,
                          train_steps=0)
    assert measure.gradient_check_dtype(nn.Linear(3, 2).half(), setup) == torch.float16
    # TF32 allowed by the user's settings: off inside, theirs again after, cuDNN's others untouched
    settings = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    before = [setting.fp32_precision for setting in settings]
    cudnn = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    try:
        for setting in settings:
            setting.fp32_precision = "tf32"
        with measure._exact_float32():
            assert [setting.fp32_precision for setting in settings] == ["ieee", "ieee"]
            assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == cudnn
        assert [setting.fp32_precision for setting in settings] == ["tf32", "tf32"]
    finally:
        for setting, value in zip(settings, before):
            setting.fp32_precision = value


def test_the_gradient_check_steps_in_float64_on_cpu_and_leaves_the_timed_model_as_it_was():
    """Thirty BatchNorms at batch 2 amplify float32 rounding: a row that
    sums in another order is thousands of times further from plain in
    float32 than in float64, where the check runs on CPU. The models go back
    to float32, their parameters and running statistics unchanged."""
    from effilayers.bench import measure
    from effilayers.bench.variants import Variant

    setup = measure.Setup(torch.device("cpu"), batch=2, size=4, dtype=torch.float32, channels_last=False, steps=1,
                          train_steps=0)
    torch.manual_seed(0)
    plain = _deep_norm_stack(nn.BatchNorm2d).train()
    row = _deep_norm_stack(_NormSummedElsewhere).train()
    row.load_state_dict(plain.state_dict())
    before = {name: tensor.clone() for name, tensor in row.state_dict().items()}
    assert measure.gradient_check_dtype(row, setup) == torch.float64
    # what a float32 check would compare
    difference32 = measure.compare_gradients(measure.step_gradients(row, row, setup, 5),
                                             measure.step_gradients(plain, plain, setup, 5), torch.float32)[1]

    def session(model: nn.Module, name: str) -> measure._Session:
        return measure._Session(Variant("stack", name, lambda: model, check_gradients=True), model, model, [], True,
                                None, None, None)

    reference: dict[str, torch.Tensor] = {}
    plain_session, row_session = session(plain, "plain"), session(row, "summed elsewhere")
    measure._check_gradients(plain_session, setup, 5, True, reference)
    assert all(gradient.dtype == torch.float64 for gradient in reference.values())
    measure._check_gradients(row_session, setup, 5, False, reference)
    assert row_session.gradients_match is True
    assert row_session.gradient_dtype == plain_session.gradient_dtype == "float64"
    assert row_session.gradient_max_rel_diff < 1e-3 * difference32
    assert row_session.gradient_max_rel_diff <= measure.GRADIENT_TOLERANCE[torch.float64]
    for name, tensor in row.state_dict().items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    assert all(parameter.grad is None for parameter in row.parameters())


def test_checkpoint_every_block_keeps_keys_outputs_and_gradients():
    torch.manual_seed(0)
    plain = TinyLanguageModel().double()
    wrapped, blocks = budget.checkpoint_every_block(TinyLanguageModel().double())
    wrapped.load_state_dict(plain.state_dict())
    assert blocks == ["blocks.0", "blocks.1", "blocks.2"]
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 40, (2, 7))
    outputs = []
    for model in (plain, wrapped):
        torch.manual_seed(1)  # dropout on: the checkpoint replays the same masks in recomputation
        loss = model(ids).square().mean()
        loss.backward()
        outputs.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(outputs[0][0], outputs[1][0])
    for a, b in zip(outputs[0][1], outputs[1][1]):
        torch.testing.assert_close(a, b)
    assert memory.activation_bytes(wrapped, ids) < memory.activation_bytes(plain, ids)


def test_checkpoint_every_block_leaves_in_place_children_alone():
    # A DenseNet's stem: checkpointed alone, the in-place ReLU would write
    # over the input its checkpoint keeps, and backward would refuse it.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                          nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()), nn.Flatten()).double()
    wrapped, blocks = budget.checkpoint_every_block(copy.deepcopy(plain))
    assert blocks == ["0", "1", "3", "4", "5"]
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    gradients = []
    for model in (plain, wrapped):
        model(x).square().sum().backward()
        gradients.append([p.grad for p in model.parameters()])
    for a, b in zip(*gradients):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("args, message", [
    (("--tokens", "8"), "--tokens needs --model module:callable"),
    (("--tokens", "8", "--model", "resnet50"), "resnet50 take images"),
    (("--tokens", "8", "--model", "m:f", "--size", "64"), "--size and --channels-last are for images"),
    (("--tokens", "0", "--model", "tests.test_bench_budget:tiny_language_model"), "--tokens must be >= 1"),
])
def test_tokens_refuses_what_it_cannot_run(args, message, capsys):
    assert bench.main([*args, "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_an_image_bench_of_a_language_model_says_to_give_tokens(capsys):
    assert bench.main(["--model", "tests.test_bench_budget:tiny_language_model", "--device", "cpu", "--steps",
                       "1"]) == 2
    assert "needs --tokens T" in capsys.readouterr().err



def test_the_headline_table_of_a_budget_run_shows_tokens_and_the_gradient_check():
    from benchmarks import headline

    def result(variant, match, worst):
        return {"model": "m:lm", "variant": variant, "activation_bytes": 2**20, "cuda_peak_bytes": None,
                "step_time_s": 0.5, "step_time_min_s": 0.25, "step_time_max_s": 0.75, "images_per_s": 4.0,
                "ratios": {}, "gradients_match": match, "gradient_max_rel_diff": worst}

    report = {"command": "python -m effilayers.bench --tokens 8", "environment": {"device": "cpu"},
              "settings": {"device": "cpu", "batch": 2, "size": 64, "tokens": 8, "dtype": "float32", "steps": 3},
              "results": [result("as given", None, None), result("fit(0.35)", True, 0.0),
                          result("torch.compile budget 0.35", False, 0.93)]}
    lines = headline.table(report, "r.json").splitlines()
    assert "batch 2, 8 tokens, float32" in lines[0] and "64×64" not in lines[0]
    assert lines[2].endswith("| step ms | step ms min–max | sequences/s | grads = plain |")
    # the spread of the timed steps beside their median: the time ratios are read against it
    assert all("| 500.0 | 250.0–750.0 | 4.0 |" in line for line in lines[4:])
    assert [line.rsplit("|", 2)[1].strip() for line in lines[4:]] == ["reference", "yes", "no (9.3e-01)"]
