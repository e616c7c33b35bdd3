"""Which variants ``effilayers-bench`` measures for a ``--model``: plain
PyTorch, effilayers' ABN and InPlaceABN ResNets and memory-efficient
DenseNet, the torch.utils.checkpoint, torchvision ``memory_efficient`` and
mapillary ``inplace_abn`` baselines, and ``module:callable`` models as given
and converted.

The bottom of the bench package: measure, report and cli import it, it
imports none of them.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import models
from ..convert import convert, revert
from ..models.densenet import DenseLayer
from ..models.resnet import INPLACE_SLOPE, _ResidualBlock
from ..ops.abn.module import ABN

__all__ = ["BenchError", "Variant", "compiled_twin", "PLAIN", "AS_GIVEN", "LEAKY", "builtin_models", "variants_for",
           "peer_inplace_abn_resnet", "CheckpointedDenseLayer", "checkpointed_densenet", "torchvision_densenet"]

PLAIN = "plain PyTorch"
AS_GIVEN = "as given"
LEAKY = "leaky_relu(0.01)"


class BenchError(Exception):
    """A problem with the user's request: reported as one line, exit status 2."""


@dataclass
class Variant:
    model: str
    name: str
    build: Callable[[], nn.Module]
    # Loads the reference model's weights, so every variant starts from the
    # same point; False for a variant built from the same seed instead.
    load_reference: bool = True
    # The function the variant computes when it is not plain PyTorch's (e.g.
    # "leaky_relu(0.01)"), and how to express it with plain PyTorch modules
    # (given a copy of the initialised variant; returns the module and notes):
    # the float64 reference of the --train check.
    function: Optional[str] = None
    plain_equivalent: Optional[Callable[[nn.Module], tuple[nn.Module, list[str]]]] = None
    note: Optional[str] = None
    # The module build() returns runs torch.compile itself: its activation
    # bytes are counted after the warm-up step that compiled it.
    compiled: bool = False
    # The bench runs the module under torch.compile (--compile's row beside
    # the eager one of the same variant); counted after compiling, as above.
    under_compile: bool = False
    # --budget: one training step's parameter gradients, dropout drawing, are
    # compared with the first variant's (plain, which checks too): whether
    # the row's recomputation replays the forward's random draws.
    check_gradients: bool = False


def compiled_twin(variant: Variant) -> Variant:
    """``variant`` again, run under torch.compile by the bench: its --compile row."""
    return dataclasses.replace(variant, name=f"{variant.name} (compiled)", under_compile=True)


def _reverted(model: nn.Module) -> tuple[nn.Module, list[str]]:
    report = revert(model)
    return model, [f"{pair.norm}: {pair.note}" for pair in report.restored if pair.note]


def builtin_models() -> dict[str, str]:
    """The model builders of :mod:`effilayers.models`, name -> family ("resnet" or "densenet")."""
    names = {name: "resnet" for name in models.resnet.__all__ if name[0].islower()}
    names.update({name: "densenet" for name in models.densenet.__all__ if name[0].islower()})
    return names


def _import_peer(module_name: str) -> tuple[Optional[ModuleType], str]:
    """(the module, "") or (None, why it cannot be used)."""
    try:
        return importlib.import_module(module_name), ""
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name == module_name:
            return None, f"{module_name} is not installed"
        return None, f"cannot import {module_name}: {error}"
    except Exception as error:  # noqa: BLE001 - e.g. a CUDA torchvision on a CPU torch fails loading its ops
        return None, f"cannot import {module_name}: {type(error).__name__}: {error}"


class _SeparateSumMixin:
    """An effilayers ResNet block whose norms are another library's in-place
    ABN modules, which cannot take the shortcut into their call: every norm
    applies its own activation except the last, whose sum with the shortcut
    is activated afterwards (mapillary's own residual blocks do the same)."""

    def _activated(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def _activated_sum(self, norm: nn.Module, x: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        # Out of place: the norm keeps its output for backward.
        return F.leaky_relu(norm(x) + identity, INPLACE_SLOPE, inplace=True)


_SEPARATE_SUM_BLOCKS: dict[type, type] = {}


def peer_inplace_abn_resnet(builder: Callable[..., nn.Module], peer_module: ModuleType) -> nn.Module:
    """``builder(norm_act="inplace")`` with every effilayers ABN replaced by
    ``peer_module.InPlaceABN`` (mapillary's ``inplace_abn``; same arguments,
    same state-dict keys): the same network, function and weights."""
    model = builder(norm_act="inplace")
    block_final = set()
    for block in model.modules():
        if isinstance(block, _ResidualBlock):
            block_final.add(id(block.norms()[-1]))
            kind = type(block)
            if kind not in _SEPARATE_SUM_BLOCKS:
                _SEPARATE_SUM_BLOCKS[kind] = type(f"SeparateSum{kind.__name__}", (_SeparateSumMixin, kind), {})
            block.__class__ = _SEPARATE_SUM_BLOCKS[kind]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, ABN):
                continue
            activation = "identity" if id(child) in block_final else child.activation
            replacement = peer_module.InPlaceABN(child.num_features, eps=child.eps, momentum=child.momentum,
                                                 affine=child.affine, track_running_stats=child.track_running_stats,
                                                 activation=activation, activation_param=child.activation_param)
            replacement.load_state_dict(child.state_dict())
            setattr(parent, name, replacement)
    return model


def _peer_inplace_abn_reference(builder: Callable[..., nn.Module],
                                peer_module: ModuleType) -> Callable[[nn.Module], tuple[nn.Module, list]]:
    def plain_equivalent(peer_model: nn.Module) -> tuple[nn.Module, list[str]]:
        model = builder(norm_act="inplace")
        state = peer_model.state_dict()
        # mapillary scales by |weight| + eps: start the reference there, so
        # both follow the same trajectory while the weights stay positive.
        for name, module in peer_model.named_modules():
            if isinstance(module, peer_module.InPlaceABN) and module.weight is not None:
                state[f"{name}.weight"] = module.weight.detach().abs() + module.eps
        model.load_state_dict(state)
        model, notes = _reverted(model)
        return model, notes + ["reference scale |weight| + eps, as inplace_abn computes it"]

    return plain_equivalent


def _resnet_variants(name: str) -> tuple[list[Variant], list[str]]:
    builder = getattr(models, name)
    variants = [
        Variant(name, PLAIN, lambda: builder(norm_act="plain")),
        Variant(name, "effilayers ABN", lambda: builder(norm_act="abn")),
        Variant(name, "effilayers InPlaceABN", lambda: builder(norm_act="inplace"), function=LEAKY,
                plain_equivalent=_reverted),
    ]
    peer, why_not = _import_peer("inplace_abn")
    if peer is None:
        return variants, [f"{name} / inplace_abn (mapillary): skipped, {why_not}"]
    variants.append(Variant(name, "inplace_abn (mapillary)", lambda: peer_inplace_abn_resnet(builder, peer),
                            function=LEAKY, plain_equivalent=_peer_inplace_abn_reference(builder, peer)))
    return variants, []


class CheckpointedDenseLayer(DenseLayer):
    """A dense layer whose bottleneck ``cat -> norm1 -> relu1 -> conv1``
    runs under ``torch.utils.checkpoint`` (torchvision's recipe), with the
    same modules and state-dict keys."""

    def forward(self, features, batch_statistics=None):
        features = [features] if isinstance(features, torch.Tensor) else list(features)

        def bottleneck(*maps):
            return self.conv1(self.relu1(self.norm1(torch.cat(maps, 1))))

        out = checkpoint(bottleneck, *features, use_reentrant=False)
        out = self.conv2(self.relu2(self.norm2(out)))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        return out


def checkpointed_densenet(model: nn.Module) -> nn.Module:
    """``model`` (an effilayers DenseNet built with ``memory_efficient=False``)
    with every dense layer's bottleneck under activation checkpointing, in
    place: the standard way to save memory in PyTorch. The recomputed forward
    updates norm1's running statistics a second time per step."""
    for module in model.modules():
        if isinstance(module, DenseLayer):
            module.__class__ = CheckpointedDenseLayer
    return model


def torchvision_densenet(name: str) -> tuple[Optional[Callable[[], nn.Module]], str]:
    """(a builder of torchvision's ``name(memory_efficient=True)``, "") or (None, why not)."""
    torchvision, why_not = _import_peer("torchvision")
    if torchvision is None:
        return None, why_not
    builder = getattr(getattr(torchvision, "models", None), name, None)
    if builder is None:
        return None, f"torchvision has no {name}"
    return (lambda: builder(memory_efficient=True)), ""


def _densenet_variants(name: str) -> tuple[list[Variant], list[str]]:
    builder = getattr(models, name)
    variants = [
        Variant(name, PLAIN, lambda: builder(memory_efficient=False)),
        Variant(name, "torch.utils.checkpoint", lambda: checkpointed_densenet(builder(memory_efficient=False)),
                note="checkpointed bottlenecks update norm1's running statistics twice per step"),
    ]
    skipped = []
    torchvision_builder, why_not = torchvision_densenet(name)
    if torchvision_builder is None:
        skipped.append(f"{name} / torchvision memory_efficient: skipped, {why_not}")
    else:
        variants.append(Variant(name, "torchvision memory_efficient", torchvision_builder))
    variants.append(Variant(name, "effilayers", lambda: builder(memory_efficient=True)))
    return variants, skipped


def _import_callable(spec: str) -> Callable[[], Any]:
    module_name, _, attribute_path = spec.partition(":")
    if not module_name or not attribute_path:
        raise BenchError(f"--model {spec!r}: expected one of {', '.join(builtin_models())} or 'module:callable'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # an import can fail with anything the module raises
        raise BenchError(f"--model {spec!r}: cannot import {module_name!r}: {type(error).__name__}: {error}") from error
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise BenchError(f"--model {spec!r}: {module_name!r} has no attribute {attribute_path!r}")
        target = getattr(target, attribute)
    if not callable(target):
        raise BenchError(f"--model {spec!r}: {attribute_path!r} is not callable")
    return target


def _custom_variants(spec: str) -> tuple[list[Variant], list[str]]:
    factory = _import_callable(spec)

    def build_given() -> nn.Module:
        try:
            model = factory()
        except Exception as error:  # the user's builder may raise anything; say so in one line, as for imports
            raise BenchError(f"--model {spec!r}: building the model raised {type(error).__name__}: {error}") from error
        if not isinstance(model, nn.Module):
            raise BenchError(f"--model {spec!r}: returned {type(model).__name__}, expected an nn.Module")
        return model

    # Decide now whether the conversion variant exists, so the table never
    # lists a variant that is identical to the model as given.
    probe = build_given()
    try:
        report = convert(copy.deepcopy(probe), mode="inplace")
        converts, function_changed = bool(report.fused), report.function_changed
        first = report.left_alone[0] if report.left_alone else None
        why_not = "it fused no BatchNorm + activation pair" + (
            f": {len(report.left_alone)} norm(s) left alone, the first ({first.path or 'the model'}) because "
            f"{first.reason}" if first else ": the model has no BatchNorm")
    except (TypeError, ValueError, RuntimeError) as error:
        converts = function_changed = False
        why_not = f"convert raised {type(error).__name__}: {error}"
    del probe
    skipped = [] if converts else [f"{spec}: effilayers convert(inplace) row dropped: {why_not}"]
    variants = [Variant(spec, AS_GIVEN, build_given)]
    if converts:
        def build_converted() -> nn.Module:
            model = build_given()
            convert(model, mode="inplace")
            return model

        # Converting keeps the module tree's weights but may rename keys, so
        # build it from the same seed instead of loading a state dict.
        variants.append(Variant(spec, "effilayers convert(inplace)", build_converted, load_reference=False,
                                function=LEAKY if function_changed else None,
                                plain_equivalent=_reverted if function_changed else None))
    return variants, skipped


def variants_for(spec: str) -> tuple[list[Variant], list[str]]:
    """The variants of ``--model spec`` and one line per peer variant skipped."""
    family = builtin_models().get(spec)
    if family == "resnet":
        return _resnet_variants(spec)
    if family == "densenet":
        return _densenet_variants(spec)
    return _custom_variants(spec)

