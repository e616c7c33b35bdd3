"""Op-level recomputation and activation offload in effilayers.fit: the
selective checkpoint keeps matmul and attention outputs and recomputes the
rest, its cache counted by the meter; the planner chooses keep, selective or
whole per unit, and says why; dropout replays exactly; saved tensors offload
to host memory (CPU: the stream-free path; CUDA: ``gpu`` tests) and come back
one block ahead of backward."""

import copy
import gc
import importlib
import itertools

import pytest
import torch
import transformers  # in the test extra, as in test_fit_units
from torch import nn

import effilayers
from effilayers import memory
from effilayers.checkpoint import KeepExpensive, checkpoint, keep_expensive, offload_saved_tensors, selective_contexts

from .helpers import OutputSpy

fit_module = importlib.import_module("effilayers.fit")


def _gpt2(layers=3):
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)  # dropout 0.1 in attention and blocks
    return transformers.GPT2LMHeadModel(config)


def _encoder(layers=3, dropout=0.1):
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True), layers,
                                 enable_nested_tensor=False)


def _gpt2_inputs():
    return {"input_ids": torch.randint(0, 64, (2, 8)), "use_cache": False}


def _grads(model):
    return [parameter.grad.clone() for parameter in model.parameters()]


def _train_step(model, seed, **inputs):
    torch.manual_seed(seed)
    out = model(**inputs)
    out = out if isinstance(out, torch.Tensor) else out.logits
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    return out


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 48), nn.Linear(48, 16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.down(torch.relu(self.up(x))))


def test_selective_keeps_the_matmul_outputs_the_meter_counts_them_and_dropout_replays():
    torch.manual_seed(0)
    block = _MLP().train()
    reference = copy.deepcopy(block)
    x = torch.randn(6, 16, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_()
    policy = KeepExpensive()
    torch.manual_seed(5)
    with memory.track_activations(exclude=block) as meter:
        out = checkpoint(block, x, context_fn=lambda: selective_contexts(policy))
        kept = meter.bytes
    # what survives the forward: the checkpoint's input and the two addmm outputs torch's cache holds
    assert kept == (6 * 16 + 6 * 48 + 6 * 16) * 4
    assert policy.kept_outputs == 2 and policy.recomputed_elements > 0
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    assert meter.bytes == 0 and meter.peak_bytes == kept
    # the plain block's draws: checkpoint replays the random state, and no kept op drew
    torch.manual_seed(5)
    expected = reference(reference_x)
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=0, atol=0)
    for got, want in zip(_grads(block), _grads(reference)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_policy_recomputes_attention_that_draws_dropout_and_keeps_it_without():
    policy = torch.utils.checkpoint.CheckpointPolicy
    context = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)
    q = torch.randn(1, 2, 4, 8)
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert keep_expensive(context, attention, q, q, q, 0.0) == policy.MUST_SAVE
    assert keep_expensive(context, attention, q, q, q, 0.1) == policy.PREFER_RECOMPUTE
    assert keep_expensive(context, attention, q, q, q, dropout_p=0.1) == policy.PREFER_RECOMPUTE
    assert keep_expensive(context, torch.ops.aten.mm.default, q[0, 0], q[0, 0].t()) == policy.MUST_SAVE
    for op in (torch.ops.aten.native_dropout.default, torch.ops.aten.gelu.default,
               torch.ops.aten.native_layer_norm.default):
        assert keep_expensive(context, op, q) == policy.PREFER_RECOMPUTE
    # the counting policy charges attention recomputed for its dropout its two matrix products
    counting = KeepExpensive()
    counting(context, attention, q, q, q, 0.1)
    counting(context, attention, q, q, q, 0.0)
    counting(context, torch.ops.aten.gelu.default, q)
    counting(context, torch.ops.aten.view.default, q, [-1])
    assert (counting.recomputed_flops, counting.recomputed_elements, counting.kept_outputs, counting.ops) == (
        4 * q.numel() * 4, q.numel(), 1, 4)


@pytest.mark.parametrize("seconds, selective", [((1.0, 1.0), True), ((3.0, 1.0), False)])
def test_on_cuda_the_host_time_of_selective_units_counts(monkeypatch, seconds, selective):
    # The CUDA branch of the plan, on CPU: the forward's times given instead
    # of measured, first with every unit selective, then plain. Where the
    # dispatch mode costs the forward nothing, the plan is the CPU's; where it
    # triples the forward, every unit is recomputed whole.
    times = itertools.cycle(seconds)  # each plan times the selective forward, then the plain one
    monkeypatch.setattr(fit_module, "_cuda_device", lambda call: torch.device("cpu"))
    monkeypatch.setattr(fit_module, "_forward_seconds", lambda model, call, device: next(times))
    torch.manual_seed(0)
    base = _gpt2().train()
    inputs = _gpt2_inputs()
    expected = effilayers.fit(copy.deepcopy(base), inputs, 0.9, dry_run=True)
    model = copy.deepcopy(base)
    report = effilayers.fit(model, inputs, 0.9)
    assert report.measured_bytes <= report.budget_bytes
    modes = [unit.mode for unit in report.units]
    assert ("selective" in modes) == selective
    if selective:
        assert modes == [unit.mode for unit in expected.units]
    else:
        assert "full" in modes
        assert all("host time of its" in unit.why for unit in report.units if unit.mode == "full")
    expected_logits, got = _train_step(base, 3, **inputs), _train_step(model, 3, **inputs)
    torch.testing.assert_close(got, expected_logits, rtol=0, atol=0)
    for got_grad, want in zip(_grads(model), _grads(base)):
        torch.testing.assert_close(got_grad, want)


def test_budgets_choose_selective_first_and_whole_only_where_selective_cannot_reach():
    torch.manual_seed(0)
    base = _gpt2().train()
    inputs = _gpt2_inputs()
    plain = memory.activation_bytes(base, **inputs)
    previous, chosen, reports = plain, {}, {}
    for budget in (0.9, 0.4, 0.3):
        model = copy.deepcopy(base)
        report = reports[budget] = effilayers.fit(model, inputs, budget)
        measured = memory.activation_bytes(model, **inputs)
        assert measured == report.measured_bytes <= report.budget_bytes <= previous
        previous = measured
        modes = chosen[budget] = [unit.mode for unit in report.units]
        assert [unit.target for unit in report.units] == [f"transformer.h.{i}" for i in range(3)]
        # selective steps come first, then whole recomputation
        kinds = [step.kind for step in report.steps]
        assert kinds == sorted(kinds, key=["selective", "checkpoint"].index)
        assert len(model.__dict__[fit_module.UNDO_ATTR]) == len(report.steps)
        for unit in report.units:
            if unit.mode == "selective":
                assert "matmul/attention outputs" in unit.why
            if unit.mode == "full":
                assert unit.why.startswith("selective left")  # it was selective first, and that was not enough
            if unit.mode == "keep":
                assert unit.why.startswith("kept: the budget was met")
        text = str(report)
        assert all(f"unit {unit.target}: {modes[index]}" in text for index, unit in enumerate(report.units))
    assert chosen[0.9] == ["selective", "keep", "keep"]
    assert chosen[0.4] == ["selective"] * 3  # selective alone suffices: nothing recomputed whole
    assert chosen[0.3] == ["full", "selective", "selective"]
    selective = [step for step in reports[0.3].steps if step.kind == "selective"]
    whole = [step for step in reports[0.3].steps if step.kind == "checkpoint"]
    # recomputing a block whole costs its matmuls: more than the elementwise work selective repeats
    assert min(step.extra_compute for step in whole) > 5 * max(step.extra_compute for step in selective) > 0
    # the plan is a function of the shapes: a dry run on other token ids plans the same, and leaves the model alone
    dry = effilayers.fit(base, {**inputs, "input_ids": torch.randint(0, 64, (2, 8))}, 0.3, dry_run=True)
    assert dry.units == reports[0.3].units and dry.steps == reports[0.3].steps
    assert not any(type(module).__name__.startswith("Checkpointed") for module in base.modules())


class _WideBlock(nn.Module):
    """Two cheap ops between two matmuls: selective keeps the matmul outputs, drops GELU's and the norm's."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(16, 48), nn.LayerNorm(48), nn.Linear(48, 16)

    def forward(self, x):
        return x + self.down(self.norm(nn.functional.gelu(self.up(x))))


class _Blocks(nn.Module):
    """Blocks in a ModuleDict, one of them never called."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({name: _WideBlock() for name in ("a", "b", "unused")})

    def forward(self, x):
        return self.blocks["b"](self.blocks["a"](x))


def test_selective_units_say_so_skip_an_unused_one_and_refuse_a_second_backward():
    torch.manual_seed(0)
    model = _Blocks().train()
    x = torch.randn(6, 16)
    report = effilayers.fit(model, x, 0.5)
    assert [(unit.target, unit.mode) for unit in report.units] == [
        ("blocks.a", "selective"), ("blocks.b", "selective"), ("blocks.unused", "keep")]
    assert "saves nothing here" in report.units[2].why
    assert any("retain_graph=True" in note for note in report.notes)
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def _step_layer_by_layer(model, x, offload):
    """One training step over ``model.layers``, each layer under
    ``offload_saved_tensors(**offload)`` unless ``offload`` is None: the
    output, the meter's (device, host) bytes after the forward, the meter."""
    torch.manual_seed(1)
    with memory.track_activations(exclude=model) as meter:
        hidden = x
        for layer in model.layers:
            if offload is None:
                hidden = layer(hidden)
            else:
                with offload_saved_tensors(**offload):
                    hidden = layer(hidden)
        counted = meter.bytes, meter.offloaded_bytes
    (hidden * torch.linspace(-1, 1, hidden.numel(), device=x.device).view_as(hidden)).sum().backward()
    return hidden, counted, meter


def test_offload_moves_saved_tensors_to_host_and_fetches_one_block_ahead_on_the_stream_free_path():
    torch.manual_seed(0)
    plain = _encoder(layers=3).train()
    offloaded = copy.deepcopy(plain)
    x = torch.randn(2, 6, 32)
    log = []
    expected, (plain_bytes, none), _ = _step_layer_by_layer(plain, x, None)
    got, (device_bytes, host_bytes), meter = _step_layer_by_layer(offloaded, x, dict(min_bytes=256, log=log))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for (key, parameter), reference in zip(offloaded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(parameter.grad, reference.grad, rtol=0, atol=0, msg=key)
    assert none == 0
    offloads = [entry for entry in log if entry[0] == "offload"]
    assert [entry[1] for entry in offloads] == [0, 1, 2] and all(entry[2] > 0 for entry in offloads)
    # the host copies are counted as host bytes; what stays (tensors under 256 bytes) as device bytes
    assert host_bytes == sum(entry[3] for entry in offloads)
    assert 0 < device_bytes < plain_bytes / 10
    assert meter.offloaded_bytes == 0 and meter.peak_offloaded_bytes == host_bytes
    # backward: the last block is fetched when first used, and each block fetches the one before it
    backward = [entry for entry in log if entry[0] != "offload"]
    assert backward == [("fetch", 2), ("fetch", 1), ("use", 2), ("fetch", 0), ("use", 1), ("use", 0)]


def test_an_offloaded_forward_dropped_without_backward_frees_its_copies_and_is_never_fetched():
    layers = _encoder(layers=2).layers
    x = torch.randn(2, 6, 32)
    log = []
    with memory.track_activations() as meter:
        hidden = x
        for layer in layers:
            with offload_saved_tensors(log=log):
                hidden = layer(hidden)
        assert meter.offloaded_bytes > 0
        del hidden
        assert meter.offloaded_bytes == 0  # freed with the graph, no garbage collection needed
    log.clear()
    hidden = x
    for layer in layers:
        with offload_saved_tensors(log=log):
            hidden = layer(hidden)
    hidden.sum().backward()
    # the new forward's groups count from 0 again: none links to the dropped ones
    assert [entry[:2] for entry in log] == [("offload", 0), ("offload", 1), ("fetch", 1), ("fetch", 0), ("use", 1),
                                            ("use", 0)]


def test_offload_keeps_parameters_and_small_tensors_and_checks_min_bytes():
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    log = []
    with memory.track_activations() as meter, offload_saved_tensors(min_bytes=1 << 20, log=log):
        out = layer(x)
    assert log == [("offload", 0, 0, 0)] and meter.offloaded_bytes == 0 and meter.bytes == x.numel() * 4
    out.sum().backward()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_bytes must be an int >= 0"):
            offload_saved_tensors(min_bytes=bad)


def test_a_small_tensor_offload_keeps_is_freed_with_its_graph():
    spy = OutputSpy()
    with offload_saved_tensors(min_bytes=1 << 20):
        output = spy(torch.randn(4, 8, requires_grad=True))
    del output
    gc.collect()
    assert spy.outputs and spy.alive() == 0


def test_offload_hides_compares_transfer_with_compute():
    # 1 GB/s host link, 1 TFLOP/s: 1 MB takes 1 ms, as long as 1 GFLOP
    assert fit_module.offload_hides(10**6, 10**9, 1e12, 1e9)
    assert not fit_module.offload_hides(10**6 + 1, 10**9, 1e12, 1e9)


@pytest.mark.parametrize("bandwidth, offloaded", [(1e30, 2), (1.0, 0)])
def test_the_plan_offloads_the_units_whose_compute_hides_the_copy(monkeypatch, bandwidth, offloaded):
    # The CUDA branch of the plan, on CPU: rates given instead of measured, the stream-free copies.
    monkeypatch.setattr(fit_module, "_offload_available", lambda call: True)
    monkeypatch.setattr(fit_module, "_device_rates", lambda model, call, flops: (1e12, bandwidth))
    torch.manual_seed(0)
    plain = _encoder(layers=3).train()
    fitted = copy.deepcopy(plain)
    x = torch.randn(2, 6, 32)
    report = effilayers.fit(fitted, x, 0.3, offload=True)
    modes = [unit.mode for unit in report.units]
    # the last block is never offloaded: its backward comes first, with nothing to hide its copies back
    assert modes.count("offload") == offloaded and modes[-1] != "offload"
    assert [step.kind for step in report.steps][:offloaded] == ["offload"] * offloaded
    assert all("GB/s" in unit.why for unit in report.units if unit.mode == "offload")
    # the units whose copy no compute hides are named, with both times
    unhidden = [note for note in report.notes if note.startswith("offload: ")]
    assert len(unhidden) == (offloaded == 0)
    assert offloaded or ("2 unit(s) not offloaded" in unhidden[0] and "layers.0 (" in unhidden[0])
    with memory.track_activations(exclude=fitted) as meter:
        out = fitted(x)
        assert meter.bytes == report.measured_bytes <= report.budget_bytes
        assert (meter.offloaded_bytes > 0) == (offloaded > 0)
        del out
    expected, got = _train_step(plain, 3, src=x), _train_step(fitted, 3, src=x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for (key, parameter), reference in zip(fitted.named_parameters(), plain.parameters()):
        torch.testing.assert_close(parameter.grad, reference.grad, rtol=0, atol=0, msg=key)
    effilayers.revert(fitted)
    assert all(type(layer) is nn.TransformerEncoderLayer for layer in fitted.layers)


def test_offload_is_refused_as_a_non_bool_and_noted_on_cpu():
    model = _encoder(layers=2)
    x = torch.randn(2, 6, 32)
    with pytest.raises(TypeError, match="offload must be a bool"):
        effilayers.fit(model, x, 0.5, offload="yes")
    report = effilayers.fit(model, x, 0.5, offload=True, dry_run=True)
    assert "offload" not in {unit.mode for unit in report.units}
    assert any(note.startswith("offload not offered: on CPU") for note in report.notes)


# On CUDA the gradients are compared at float32's default tolerances: attention's backward may
# accumulate with atomics, so two plain runs need not agree to the bit either.
@pytest.mark.gpu
def test_offload_on_cuda_overlaps_on_a_side_stream_and_gives_the_plain_gradients():
    torch.manual_seed(0)
    device = torch.device("cuda")
    plain = _encoder(layers=4).to(device).train()
    offloaded = copy.deepcopy(plain)
    x = torch.randn(8, 128, 32, device=device)
    log = []
    expected, (plain_bytes, _), _ = _step_layer_by_layer(plain, x, None)
    got, (device_bytes, host_bytes), _ = _step_layer_by_layer(offloaded, x, dict(log=log))
    torch.cuda.synchronize()
    torch.testing.assert_close(got, expected)
    for (key, parameter), reference in zip(offloaded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(parameter.grad, reference.grad, msg=key)
    assert device_bytes < plain_bytes / 10 and host_bytes > plain_bytes / 2
    assert [entry for entry in log if entry[0] != "offload"][:3] == [("fetch", 3), ("fetch", 2), ("use", 3)]
    # the copies ran on the side stream, not the compute stream
    assert x.device in importlib.import_module("effilayers.checkpoint")._SIDE_STREAMS
    assert torch.cuda.memory_allocated() < 1 << 30  # nothing offloaded was left behind on the device


@pytest.mark.gpu
def test_fit_with_offload_on_cuda_meets_the_budget_in_device_bytes_with_the_plain_gradients():
    torch.manual_seed(0)
    device = torch.device("cuda")
    plain = _encoder(layers=4).to(device).train()
    fitted = copy.deepcopy(plain)
    x = torch.randn(8, 256, 32, device=device)
    report = effilayers.fit(fitted, x, 0.3, offload=True)
    modes = [unit.mode for unit in report.units]
    assert report.measured_bytes <= report.budget_bytes and modes[-1] != "offload"
    with memory.track_activations(exclude=fitted) as meter:
        out = fitted(x)
        assert meter.bytes == report.measured_bytes
        # whether a unit's copy is hidden depends on the measured rates; what was offloaded is host bytes
        assert (meter.offloaded_bytes > 0) == ("offload" in modes)
        del out
    expected, got = _train_step(plain, 3, src=x), _train_step(fitted, 3, src=x)
    torch.testing.assert_close(got, expected)
    for (key, parameter), reference in zip(fitted.named_parameters(), plain.parameters()):
        torch.testing.assert_close(parameter.grad, reference.grad, msg=key)
