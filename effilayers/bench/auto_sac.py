"""``--budget``'s ``torch auto-SAC`` row: torch's integer-programming choice
of which modules to checkpoint, and how much of each
(``torch.distributed._tools``: ``SACEstimator``, ``sac_milp``,
``get_optimal_checkpointing_policy_per_module``), applied to the plain model.

How torch means it to run (its own tests do this): every estimate runs
under ``FakeTensorMode`` on a fake copy of the model, so nothing is
computed: ``MemTracker`` records each module's memory over two training
steps, ``RuntimeEstimator`` and ``SACEstimator`` each op's time and bytes
(``operator-level-cost-model``, a roofline of the device), and
``aggregate_stats`` / ``parse_module_info`` turn them into the module graph
that ``sac_milp`` solves under a memory budget in GiB. Its answer is a
fraction of activation memory to discard per module; for each such module
``get_optimal_checkpointing_policy_per_module`` picks, op by op in forward
order, which outputs to keep. The row runs those modules under torch's
selective checkpoint (``create_selective_checkpoint_contexts``) with a
policy that answers each op with that choice.

The budget given to ``sac_milp``: its own baseline peak
(``get_peak_memory_runtime_baseline``: parameters, gradients and
activations) less ``1 - fraction`` of the activations the whole model keeps
after its forward (MemTracker's, at the root module), so that the same
fraction of activations as fit's is asked for; the row's bytes are then
measured by effilayers' meter as every other row's.

Where it cannot run the row is dropped with the reason: ``sac_ilp`` needs
``pulp`` and the trade-off curves ``pwlf`` (``pip install pulp pwlf``, in
``effilayers[bench]``), and torch's estimators model or time ops on a CUDA
device (the cost model asserts ``torch.cuda.is_available()``, the benchmark
mode times with CUDA events): on a machine without CUDA the estimate fails,
and the row's line quotes torch's error.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from .measure import _logits

__all__ = ["AutoSACPlan", "plan_auto_sac", "apply_auto_sac", "OpPolicy"]

# Ops torch's SACEstimator leaves out of a module's op list beside those the
# selective checkpoint never asks its policy about (SAC_IGNORED_OPS): the
# policy answers them without moving along the list.
_ESTIMATOR_SKIPS = ("lift_fresh", "clone", "_record_function_exit")


@dataclass
class AutoSACPlan:
    """sac_milp's answer for one model: per module path (in the model's
    names), the fraction of its activations discarded and, per op of its
    forward in order, the op's name and whether its output is kept (1) or
    recomputed (0); with what the ILP was given and predicted."""

    modules: dict[str, tuple[float, list[str], list[int]]]
    budget_gib: float
    baseline_peak: int
    activations: int
    predicted_peak: int
    recompute_ms: float

    def describe(self) -> str:
        chosen = ", ".join(f"{path} discards {ratio:.2f}" for path, (ratio, _, _) in self.modules.items()) \
            or "no module checkpointed"
        return (f"torch.distributed._tools.sac_milp given {self.budget_gib:.4g} GiB (its baseline peak "
                f"{self.baseline_peak} bytes less the share of the {self.activations} activation bytes to drop; "
                f"roofline estimates under FakeTensorMode): {chosen}; predicted peak {self.predicted_peak} bytes, "
                f"{self.recompute_ms:.3g} ms recomputed")


def _imports() -> Any:
    """The torch.distributed._tools modules auto-SAC needs, or an ImportError
    naming what to install."""
    try:
        import pulp  # noqa: F401 - sac_ilp's solver
    except ImportError:
        raise ImportError("torch's auto-SAC (torch.distributed._tools.sac_ilp) needs pulp: pip install pulp "
                          "(or pip install 'effilayers[bench]')") from None
    try:
        import pwlf  # noqa: F401 - SACEstimator's trade-off curves
    except ImportError:
        raise ImportError("torch's auto-SAC (SACEstimator.pwlf_sac_tradeoff_curve) needs pwlf: pip install pwlf "
                          "(or pip install 'effilayers[bench]')") from None
    from torch.distributed._tools import ilp_utils, mem_tracker, runtime_estimator, sac_estimator, sac_ilp

    return ilp_utils, mem_tracker, runtime_estimator, sac_estimator, sac_ilp


def _loss(model: nn.Module, example: torch.Tensor) -> torch.Tensor:
    # What the estimate needs is the modules' forward and backward, not the bench's loss.
    return _logits(model(example)).float().square().mean()


def plan_auto_sac(build: Callable[[], nn.Module], example: torch.Tensor, fraction: float) -> AutoSACPlan:
    """sac_milp's plan for ``build()`` (built on the example's device, in
    training mode) on ``example``, asking for
    ``fraction`` of its activations (see the module docstring). Raises
    ImportError (a package missing) or what torch's estimators raise (on a
    machine without CUDA: an AssertionError of the roofline estimate)."""
    ilp_utils, mem_tracker, runtime_estimator, sac_estimator, sac_ilp = _imports()
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = "operator-level-cost-model"
    # Built there: a fake module's parameters cannot be moved by Module.to.
    with FakeTensorMode() as fake_mode, torch.device(example.device):
        model = build().train()
        images = fake_mode.from_tensor(example)
        tracker = mem_tracker.MemTracker()
        tracker.track_external(model)
        last = None
        with tracker:
            # Twice: the first step allocates the gradients, the second is recorded.
            for step in range(2):
                _loss(model, images).backward()
                if step == 1:
                    last = tracker.get_tracker_snapshot("current")
                model.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
        for stats in tracker.memory_tracking.values():
            # A module whose inputs need no gradient gets no post-backward hook (torch's own tests patch it so).
            if mem_tracker._ModState.POST_BW not in stats.snapshots:
                stats.snapshots[mem_tracker._ModState.POST_BW] = [copy.deepcopy(last)]
        runtimes = runtime_estimator.RuntimeEstimator()
        with runtimes(estimate_mode_type=mode):
            _loss(model, images).backward()
        model.zero_grad()
        sac = sac_estimator.SACEstimator()
        with sac(estimate_mode_type=mode):
            loss = _loss(model, images)
        loss.backward()
        info = ilp_utils.aggregate_stats(model, tracker, runtimes, sac, example.device)
    graph = ilp_utils.parse_module_info(info)
    peak, _ = ilp_utils.get_peak_memory_runtime_baseline(graph)
    activations = graph.nodes[0]["act_total"]
    budget_gib = (peak - (1.0 - fraction) * activations) / 2**30
    ratios, recompute_ms, predicted_peak = sac_ilp.sac_milp(graph, memory_budget=budget_gib)
    if predicted_peak == -1:
        raise ValueError(f"torch's sac_milp found no plan within {budget_gib:.4g} GiB (its baseline peak {peak} "
                         f"bytes, {activations} of them activations)")
    root = graph.nodes[0]["fqn"]
    modules = {}
    for fqn, ratio in ratios.items():
        stats = sac.sac_mod_stats[fqn]
        keep = sac_ilp.get_optimal_checkpointing_policy_per_module(stats, memory_budget=1.0 - ratio)
        if not keep:
            raise ValueError(f"torch's get_optimal_checkpointing_policy_per_module found no op policy for {fqn}")
        path = fqn[len(root) + 1:] if fqn.startswith(root + ".") else fqn
        modules[path] = (ratio, list(stats.func_names), keep)
    return AutoSACPlan(modules, budget_gib, peak, activations, predicted_peak, recompute_ms)


class OpPolicy:
    """A selective-checkpoint policy replaying one module's op choices: the
    n-th op of its forward (and of its recomputation) is kept when
    ``keep[n]``; an op whose name is not the n-th estimated one, or past the
    list, is recomputed (always correct, only less saved), and counted in
    ``mismatched``."""

    def __init__(self, names: list[str], keep: list[int]) -> None:
        self.names, self.keep = names, keep
        self.position = {False: 0, True: 0}
        self.mismatched = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        name = op._overloadpacket.__name__
        if name in _ESTIMATOR_SKIPS:
            return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        index = self.position[ctx.is_recompute]
        self.position[ctx.is_recompute] += 1
        if index >= len(self.names) or self.names[index] != name:
            self.mismatched += 1
            return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE if self.keep[index] else \
            torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _selective_forward(forward: Callable, names: list[str], keep: list[int], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)

    def contexts() -> Any:
        return torch_checkpoint.create_selective_checkpoint_contexts(OpPolicy(names, keep))

    return torch_checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def apply_auto_sac(model: nn.Module, plan: Optional[AutoSACPlan]) -> nn.Module:
    """``model`` (in place) with each module of ``plan`` run under torch's
    selective checkpoint with its op choices, by a forward set on the
    instance (state-dict keys stay)."""
    for path, (_, names, keep) in (plan.modules if plan else {}).items():
        module = model.get_submodule(path)
        module.forward = functools.partial(_selective_forward, module.forward, names, keep)
    return model
