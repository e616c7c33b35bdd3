"""effilayers.fit on models whose blocks are not children of an nn.Sequential:
units found in any container (ModuleList, ModuleDict, repeated block
classes), checkpointed in place by a class swap (HF GPT-2 and Llama,
nn.TransformerEncoder, a model calling its blocks with keywords only);
budgets met and monotone; outputs, gradients and the KV cache equal the
plain model's with dropout active; the unit keeps its state-dict keys,
hooks, pickling; dry runs; errors and notes that say why."""

import copy
import gc
import importlib
import io
import json
import weakref

import pytest
import torch
import transformers  # in the test extra; not importorskip: CI must run these
from torch import nn

import effilayers
from effilayers import memory, models

fit_module = importlib.import_module("effilayers.fit")


def _gpt2():
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)  # dropout 0.1 in embeddings, attention, blocks
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      attention_dropout=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def _encoder():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True), 4,
                                 enable_nested_tensor=False)


def _token_inputs():
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding: the mask changes row 1's outputs
    return {"input_ids": ids, "attention_mask": mask, "use_cache": True}


def _encoder_inputs():
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 8:] = True
    return {"src": torch.randn(2, 12, 64), "src_key_padding_mask": padding}


MODELS = {"gpt2": (_gpt2, _token_inputs), "llama": (_llama, _token_inputs),
          "transformer_encoder": (_encoder, _encoder_inputs)}


def _output(result):
    return result if isinstance(result, torch.Tensor) else result.logits


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)))


class _Block(nn.Module):
    """Called with keywords only, returns a dict; holds a repeated class of its own."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _Inner(), _Inner()
        self.drop = nn.Dropout(0.2)

    def forward(self, *, x, scale):
        hidden = self.drop(self.second(self.first(x)))
        return {"out": x + scale * hidden, "aux": hidden.square().mean()}


class _Net(nn.Module):
    """Blocks held as plain attributes and in a ModuleDict, no nn.Sequential, no ModuleList."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Block(), _Block()
        self.heads = nn.ModuleDict({"main": nn.Linear(8, 3)})
        self.stem = nn.Linear(8, 8)

    def forward(self, x):
        x = self.stem(x)
        first = self.a(x=x, scale=0.5)
        second = self.b(x=first["out"], scale=2.0)
        return self.heads["main"](second["out"]) + second["aux"] + first["aux"]


def test_units_are_found_whatever_container_holds_them():
    def units(model):
        return [(part.path, part.unit) for part in fit_module._checkpoint_parts(model)]

    assert units(_gpt2()) == [(f"transformer.h.{i}", True) for i in range(4)]
    assert units(_llama()) == [(f"model.layers.{i}", True) for i in range(4)]
    assert units(_encoder()) == [(f"layers.{i}", True) for i in range(4)]
    # repeated blocks held as attributes, outermost only (not their _Inner), and ModuleDict members;
    # a single leaf (stem) is not a unit
    assert units(_Net()) == [("a", True), ("b", True), ("heads.main", True)]
    # a CNN's parts stay its outermost nn.Sequential modules, as before units
    resnet = models.resnet18(num_classes=10)
    assert units(resnet) == [(path, False) for path, _ in fit_module._sequential_parts(resnet)]
    assert [path for path, _ in fit_module._sequential_parts(resnet)] == [f"layer{i}" for i in range(1, 5)]


def _fit_budgets(build, make_inputs):
    torch.manual_seed(0)
    base = build().train()
    inputs = make_inputs()
    plain = memory.activation_bytes(base, **inputs)
    previous, reached = plain, []
    for tenths in range(10, 2, -1):
        model = copy.deepcopy(base)
        report = effilayers.fit(model, inputs, tenths / 10)
        measured = memory.activation_bytes(model, **inputs)
        assert measured == report.measured_bytes <= report.budget_bytes == int(tenths / 10 * plain), tenths
        assert measured <= previous, (tenths, measured, previous)
        previous = measured
        reached.append(measured / plain)
    return reached


@pytest.mark.parametrize("name", sorted(MODELS))
def test_budgets_down_to_0_3_are_met_and_bytes_never_grow_as_the_budget_shrinks(name):
    reached = _fit_budgets(*MODELS[name])
    assert reached[0] == 1.0 and reached[-1] <= 0.3


# 0.3: some units recomputed whole, the others selective; GPT-2 at 0.6: selective alone suffices.
@pytest.mark.parametrize("name, budget", [("gpt2", 0.6), ("gpt2", 0.3), ("llama", 0.3), ("transformer_encoder", 0.3)])
def test_fitted_model_computes_the_plain_outputs_gradients_and_cache_with_dropout_active(name, budget):
    build, make_inputs = MODELS[name]
    torch.manual_seed(0)
    plain = build().train()
    fitted = copy.deepcopy(plain)
    inputs = make_inputs()
    classes = [type(module) for module in fitted.modules()]
    keys = list(fitted.state_dict())
    report = effilayers.fit(fitted, inputs, budget)
    kinds = {step.kind for step in report.steps}
    assert kinds == ({"selective"} if budget > 0.5 else {"selective", "checkpoint"})
    modes = [unit.mode for unit in report.units]
    assert "selective" in modes and ("full" in modes) == (budget < 0.5)
    swapped = [module for module in fitted.modules() if type(module).__name__.startswith("Checkpointed")]
    # one swapped unit per unit the plan changed, each still an instance of its own class
    assert len(swapped) == len({step.target for step in report.steps}) == len(modes) - modes.count("keep")
    assert all(type(unit).__mro__[1] in classes and type(unit).__name__ == "Checkpointed"
               + type(unit).__mro__[1].__name__ for unit in swapped)
    assert list(fitted.state_dict()) == keys

    def step(model, seed, **overrides):
        torch.manual_seed(seed)
        result = model(**{**inputs, **overrides})
        out = _output(result)
        (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
        return result

    expected, got = step(plain, 1), step(fitted, 1)
    torch.testing.assert_close(_output(got), _output(expected))
    for (key, parameter), reference in zip(fitted.named_parameters(), plain.parameters()):
        torch.testing.assert_close(parameter.grad, reference.grad, msg=key)
    if name != "transformer_encoder":
        for layer, reference in zip(got.cache.layers, expected.cache.layers):
            torch.testing.assert_close(layer.keys, reference.keys)
            torch.testing.assert_close(layer.values, reference.values)
    # the comparison means something: dropout draws differ from seed to seed, and the mask matters
    other_seed = _output(step(copy.deepcopy(plain), 2))
    assert not torch.allclose(other_seed, _output(expected))
    unmasked = {"attention_mask": None} if name != "transformer_encoder" else {"src_key_padding_mask": None}
    assert not torch.allclose(_output(step(copy.deepcopy(plain), 1, **unmasked)), _output(expected))
    undone = effilayers.revert(fitted)
    assert undone.fit_steps_undone == len(report.steps)
    assert [type(module) for module in fitted.modules()] == classes


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_forward_without_backward_frees_the_cache_and_graph_of_fitted_units(name):
    # A unit writes its keys into the KV cache it is given; a checkpoint that
    # held the cache would keep the unit's graph alive through autograd's C++
    # nodes, which the collector cannot free: fit's own measuring forwards,
    # and any forward a user runs with gradients on and no backward, leaked.
    build, make_inputs = MODELS[name]
    torch.manual_seed(0)
    model = build().train()
    inputs = make_inputs()

    def with_history() -> dict:
        # Other tests of this process may leave tensors of their own: compare ids.
        gc.collect()
        return {id(t): t for t in gc.get_objects() if type(t) is torch.Tensor and t.grad_fn is not None}

    before = with_history()
    report = effilayers.fit(model, inputs, 0.3)
    assert {"selective", "full"} <= {unit.mode for unit in report.units}
    assert [t for key, t in with_history().items() if key not in before] == []
    before.clear()
    result = model(**inputs)
    keys = [weakref.ref(layer.keys) for layer in result.past_key_values.layers]
    del result
    gc.collect()
    assert keys and [ref() for ref in keys] == [None] * len(keys)


@pytest.mark.parametrize("name", ["gpt2", "transformer_encoder"])
def test_torch_checkpoint_reaches_fit_bytes_on_the_units_fit_finds(name):
    """The bench's "torch checkpoint (to fit's bytes)" row on a ModuleList of
    blocks: torch's own checkpoint around whole units, fit's first, then more
    in fit's order, until the plain model keeps no more than fit's bytes;
    its gradients are plain's with dropout drawing."""
    from effilayers.bench import budget

    build, make_inputs = MODELS[name]
    torch.manual_seed(0)
    plain = build().train()
    inputs = make_inputs()
    if name == "gpt2":
        # torch's checkpoint would write HF's KV cache again when it recomputes (fit copies it).
        inputs["use_cache"] = False
    fitted = copy.deepcopy(plain)
    report = effilayers.fit(fitted, inputs, 0.3)
    fit_whole = [unit.target for unit in report.units if unit.mode == "full"]
    assert fit_whole and "selective" in {unit.mode for unit in report.units}
    keys = list(plain.state_dict())
    first = {path: [(0, 1)] for path in fit_whole}
    segments, reached = fit_module.checkpoint_runs_to(plain, inputs, report.measured_bytes, first,
                                                      unit=budget._torch_checkpoint_unit)
    # fit's whole units first, then more: fit's selective units keep less than torch's checkpoint can without
    # recomputing a block whole
    assert set(fit_whole) < set(segments) and all(runs == [(0, 1)] for runs in segments.values())
    assert reached <= report.measured_bytes
    # left as it was
    assert not any("forward" in module.__dict__ for module in plain.modules())
    assert memory.activation_bytes(plain, **inputs) == report.before_bytes
    # fit's own class swap by default: the same walk
    assert fit_module.checkpoint_runs_to(plain, inputs, report.measured_bytes, first) == (segments, reached)
    torched = budget._with_torch_runs(copy.deepcopy(plain), segments)
    assert list(torched.state_dict()) == keys
    assert sum("forward" in module.__dict__ for module in torched.modules()) == len(segments)
    assert memory.activation_bytes(torched, **inputs) == reached

    def step(model):
        torch.manual_seed(1)
        out = _output(model(**inputs))
        (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
        return out

    torch.testing.assert_close(step(torched), step(plain))
    for (key, parameter), reference in zip(torched.named_parameters(), plain.parameters()):
        torch.testing.assert_close(parameter.grad, reference.grad, msg=key)
    with pytest.raises(ValueError, match=r"\] = \[\(0, 2\)\] has a run outside its 1 member.*\[\(0, 1\)\] for a unit"):
        fit_module.checkpoint_runs_to(plain, inputs, 1, {fit_whole[0]: [(0, 2)]})


def test_torch_checkpoint_rows_take_repeated_blocks_and_module_dict_members():
    """Both torch-checkpoint rows of the bench on blocks held as attributes and
    in a ModuleDict, called with keywords only and returning dicts."""
    from effilayers.bench import budget

    torch.manual_seed(0)
    plain = _Net().train()
    x = torch.randn(4, 8)
    before = memory.activation_bytes(plain, x)
    segments, reached = fit_module.checkpoint_runs_to(plain, x, 1, unit=budget._torch_checkpoint_unit)
    assert set(segments) <= {"a", "b", "heads.main"} and {"a", "b"} <= set(segments) and reached < before
    every, blocks = budget.checkpoint_every_block(copy.deepcopy(plain))
    assert blocks == ["a", "b", "heads.main"]
    for model in (budget._with_torch_runs(copy.deepcopy(plain), segments), every):
        assert memory.activation_bytes(model, x) < before
        grads = []
        for candidate in (plain, model):
            candidate.zero_grad(set_to_none=True)
            torch.manual_seed(3)  # dropout drawing: replayed by torch's checkpoint
            candidate(x).square().sum().backward()
            grads.append([parameter.grad for parameter in candidate.parameters()])
        for got, expected in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, expected)


def test_keyword_only_units_with_dict_outputs_and_revert():
    torch.manual_seed(0)
    plain = _Net().train()
    fitted = copy.deepcopy(plain)
    x = torch.randn(4, 8)
    report = effilayers.fit(fitted, x, 0.7)
    assert {step.target for step in report.steps} <= {"a", "b"} and report.steps
    for model in (plain, fitted):
        torch.manual_seed(3)
        model(x.clone().requires_grad_()).square().sum().backward()
    for (key, parameter), reference in zip(fitted.named_parameters(), plain.parameters()):
        torch.testing.assert_close(parameter.grad, reference.grad, msg=key)
    # the recomputation leaves the running statistics where the forward put them
    for (key, buffer), reference in zip(fitted.named_buffers(), plain.buffers()):
        torch.testing.assert_close(buffer, reference, msg=key)


def test_a_unit_keeps_its_hooks_and_class_pickles_and_reverts():
    torch.manual_seed(0)
    model = _encoder()
    x = torch.randn(2, 6, 64)
    calls = []
    hook = model.layers[0].register_forward_hook(lambda module, args, output: calls.append(type(module).__name__))
    effilayers.fit(model, x, 0.3)
    assert calls  # fit's measuring forwards ran it too
    calls.clear()
    layer = model.layers[0]
    assert type(layer).__name__ == "CheckpointedTransformerEncoderLayer"
    assert isinstance(layer, nn.TransformerEncoderLayer)
    model(x).sum().backward()
    # the hook ran once: the checkpoint is inside forward, so the recomputation does not call it again
    assert calls == ["CheckpointedTransformerEncoderLayer"]
    hook.remove()  # a lambda does not pickle
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.layers[0]) is type(layer)
    twin = copy.deepcopy(model)
    effilayers.revert(twin)
    assert type(twin.layers[0]) is nn.TransformerEncoderLayer and type(model.layers[0]) is type(layer)
    effilayers.revert(loaded)
    assert all(type(module) is nn.TransformerEncoderLayer for module in loaded.layers)


def test_dry_run_leaves_the_model_alone_and_its_plan_depends_on_shapes_only():
    torch.manual_seed(0)
    model = _gpt2().train()
    inputs = _token_inputs()
    classes = [type(module) for module in model.modules()]
    state = copy.deepcopy(model.state_dict())
    torch.manual_seed(5)
    before = model(**inputs).logits
    report = effilayers.fit(model, inputs, 0.5, dry_run=True)
    assert report.steps and report.extra_compute > 0 and report.predicted_bytes <= report.budget_bytes
    assert [type(module) for module in model.modules()] == classes
    assert fit_module.UNDO_ATTR not in model.__dict__
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    torch.manual_seed(5)
    torch.testing.assert_close(model(**inputs).logits, before, rtol=0, atol=0)

    def plan(report):
        return [(step.kind, step.target, step.detail, step.predicted_bytes, step.extra_compute)
                for step in report.steps]

    other = {**inputs, "input_ids": torch.randint(0, 100, (2, 12))}
    assert plan(effilayers.fit(model, other, 0.5, dry_run=True)) == plan(report)
    assert plan(effilayers.fit(model, inputs, 0.5)) == plan(report)


class _Linears(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_errors_and_notes_say_why_fit_cannot_help():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"(?s)smallest reachable figure.*no BatchNorm \+ activation "
                                         r"pair to convert.*no unit to checkpoint"):
        effilayers.fit(nn.Linear(8, 8), x, 0.5)
    # checkpointing a lone Linear keeps its input: all it saves
    with pytest.raises(ValueError, match=r"no run of the units found \(layers.0, layers.1, layers.2\) saves bytes"):
        effilayers.fit(_Linears(), x, 0.5)
    report = effilayers.fit(_Linears(), x, 1.0)
    assert not report.steps and any(note.startswith("nothing to do") for note in report.notes)
    # BatchNorm + PReLU: the pair is there, its activation is not one convert fuses; say what convert says
    prelu = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.PReLU(), nn.Conv2d(8, 4, 3, padding=1))
    images = torch.randn(2, 3, 6, 6)
    reason = effilayers.convert(copy.deepcopy(prelu), "inplace").reason("1")
    assert "PReLU" in reason
    with pytest.raises(ValueError) as raised:
        effilayers.fit(prelu, images, 1)
    assert reason in str(raised.value)
    assert "no BatchNorm + activation pair" not in str(raised.value)
    # BatchNorm + SiLU: convert fuses it as an exact ABN, and fit takes that step (no ReLU made leaky)
    silu = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 4, 3, padding=1))
    report = effilayers.fit(silu, images, 0.8)
    assert [step.kind for step in report.steps] == ["inplace_abn"]
    assert not any("pair" in note for note in report.notes)
    assert type(silu[1]) is effilayers.nn.ABN and silu[1].activation == "silu"
    with pytest.raises(TypeError, match="example_input"):
        effilayers.fit(_Linears(), {0: x}, 0.5)
    with pytest.raises(TypeError, match="dry_run"):
        effilayers.fit(_Linears(), x, 0.5, dry_run="yes")


@pytest.mark.slow
def test_compiled_fitted_encoder_matches_the_compiled_plain_one():
    torch.manual_seed(0)
    plain = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
                                  enable_nested_tensor=False)
    fitted = copy.deepcopy(plain)
    x = torch.randn(2, 6, 32)
    effilayers.fit(fitted, x, 0.6)
    assert any(type(module).__name__.startswith("Checkpointed") for module in fitted.modules())
    for model in (plain, fitted):
        # aot_eager: dynamo and AOT autograd, where checkpoint is traced, without inductor's compile time
        torch.compile(model, backend="aot_eager", fullgraph=True)(x).square().sum().backward()
    for (key, parameter), reference in zip(fitted.named_parameters(), plain.parameters()):
        torch.testing.assert_close(parameter.grad, reference.grad, msg=key)


def test_fsdp2_fully_shard_of_the_fitted_blocks_trains_as_the_plain_sharded_model():
    from torch import distributed
    from torch.distributed.fsdp import fully_shard

    # One process: enough for fully_shard's class swap and hooks around the unit's checkpoint.
    distributed.init_process_group("gloo", store=distributed.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True), 3,
                                      enable_nested_tensor=False)
        fitted = copy.deepcopy(plain)
        x = torch.randn(2, 6, 32)
        report = effilayers.fit(fitted, x, 0.4)
        for model in (plain, fitted):
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        assert type(fitted.layers[0]).__name__ == "FSDPCheckpointedTransformerEncoderLayer"
        # the three blocks selective, then one of them recomputed whole
        assert [step.kind for step in report.steps] == ["selective"] * 3 + ["checkpoint"]
        for model in (plain, fitted):
            torch.manual_seed(1)
            model(x).square().sum().backward()
        for (key, parameter), reference in zip(fitted.named_parameters(), plain.parameters()):
            torch.testing.assert_close(parameter.grad.full_tensor(), reference.grad.full_tensor(), msg=key)
        # revert cannot take FSDP's class back off: the unit runs its plain forward from then on
        effilayers.revert(fitted)
        assert type(fitted.layers[0]).__name__ == "FSDPCheckpointedTransformerEncoderLayer"
        assert fitted.layers[0].__dict__[fit_module._UNIT_OFF_ATTR]
    finally:
        distributed.destroy_process_group()


def test_the_budget_step_times_script_times_the_eager_rows_and_projects_the_protocol(tmp_path, capsys):
    from benchmarks import budget_step_times

    threads = torch.get_num_threads()
    try:
        assert budget_step_times.main(["--model", "benchmarks.transformer_models:gpt2_tiny", "--tokens", "8",
                                       "--steps", "2", "--runs", "3", "--json", str(tmp_path / "t.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "t.json").read_text())
    assert list(result["rows"]) == ["as given", "fit(0.35)", "torch checkpoint (to fit's bytes)",
                                    "torch checkpoint (every block)"]
    assert all(len(row["steps_s"]) == 2 and min(row["steps_s"]) > 0 for row in result["rows"].values())
    medians = [sum(row["steps_s"]) / 2 for row in result["rows"].values()]
    # three runs of the planning and five rows of 100 steps and 2 + 1/3 more each (compile's counted as plain's)
    expected = 3 * (result["planning_cpu_s"] + (100 + 2 + 1 / 3) * (sum(medians) + medians[0]))
    assert result["projected_cpu_s"] == pytest.approx(expected)
    assert "minutes of one core" in capsys.readouterr().out


def test_the_bench_runs_a_hugging_face_language_model_with_tokens(tmp_path):
    """``python -m effilayers.bench --tokens``: token ids in, the output's
    ``.logits``, next-token cross-entropy (here, not in test_bench_budget.py,
    whose fixture hides torchvision, which transformers imports)."""
    from .bench_cases import run_bench

    report = run_bench(tmp_path, "--model", "benchmarks.transformer_models:gpt2_tiny", "--tokens", "8", "--steps",
                       "1", "--device", "cpu")
    (result,) = report["results"]
    assert result["variant"] == "as given" and result["activation_bytes"] > 0
    assert report["settings"]["tokens"] == 8
