"""Swap BatchNorm + activation pairs in an existing model for fused ABNs, and back.

``convert(model, mode)`` rewrites a model in place and returns a
:class:`ConversionReport`; ``revert(model)`` undoes it for export and
returns a :class:`RevertReport`. Parameters and buffers are moved, not
copied: the converted model holds the very same ``Parameter`` objects (an
optimizer built before converting keeps working) and produces the same state
dict, key for key.

What is recognised (anything else is left alone and reported, with why):

* **nn.Sequential chains**: a ``BatchNorm{1,2,3}d`` directly followed by a
  supported activation module (``ReLU``, ``LeakyReLU``, ``ELU``, ``SiLU``,
  ``GELU`` (either approximation), ``Hardswish``, ``Mish``, ``ReLU6``,
  ``Sigmoid``, ``Tanh``, by exact type; timm's own ``GELU``, ``GELUTanh``,
  ``Sigmoid`` and ``Tanh`` too) in a plain ``nn.Sequential`` (the data
  flow of a Sequential is its order, so the pair is certain). The norm
  becomes the fused module and the activation slot a pass-through
  :class:`FusedActivation`, so indices, and with them the state-dict keys of
  later children, do not move.
* **torchvision-style ResNet blocks**: a module named ``BasicBlock``
  (children exactly conv1, bn1, relu, conv2, bn2 [, downsample]) or
  ``Bottleneck`` (conv1, bn1, conv2, bn2, conv3, bn3, relu [, downsample]),
  whose shared ``relu`` runs after each norm, the last one after the
  shortcut sum. The block is replaced by an
  :class:`effilayers.models.resnet.BasicBlock` / ``Bottleneck`` holding the
  same convolutions and shortcut, whose last norm computes
  ``act(bn(x) + identity)`` in one call (``abn(x, residual=identity)``).
  Recognition is by class name and children, so a block with those names but
  a different forward would be misread; keep such blocks under other names.
  In place, the norm ending a projection shortcut (``downsample``) becomes
  an identity ``InPlaceABN`` over its 1x1 convolution's output: the fused
  sum keeps the shortcut anyway, so the convolution output is not kept twice.
* **the torchvision ResNet stem**: in a module named ``ResNet`` with
  children conv1, bn1, relu, maxpool, layer1-4, avgpool, fc, ``relu`` runs
  exactly once, right after ``bn1``, so ``bn1`` is fused and ``relu`` made a
  pass-through. In place, ``maxpool`` becomes :class:`effilayers.nn.MaxPool2d`
  (same function, no int64 indices kept for backward).
* **timm's ResNet family** (``timm.models.resnet``: resnet*, resnext*,
  seresnet*, the "d" variants): the stem's ``bn1``/``act1`` and each block's
  ``bn1``/``act1`` (and ``bn2``/``act2`` in a Bottleneck) are fused where
  nothing but an Identity ``drop_block`` runs between them; the last norm
  takes the shortcut sum and ``act2``/``act3`` when neither ``se`` nor
  ``drop_path`` reads its output first. That tail needs another forward, so
  the block's class becomes a run-time subclass of its own timm class
  (``timm_blocks.fused_class``: same children and state dict, still an
  instance of timm's class; it pickles and deep-copies) that ``revert``
  turns back. timm is never imported: classes are recognised by module path
  and children.
  With squeeze-excitation (seresnet*), SE reads the last norm's output
  before the sum, so the sum and activation stay in timm's forward; but
  SE's multiply keeps that output for backward anyway, so in place the norm
  becomes an identity ``InPlaceABN`` written over its convolution's output
  (keeping only its output, not BatchNorm's input as well). Only for timm's
  own SE modules, which return a new tensor and write nothing into their
  input, after a convolution without hooks; ``mode="abn"`` leaves it plain.
* **timm's DenseNet** (``timm.models.densenet``): in both modes, each dense
  layer, transition and block gets the forward of effilayers'
  memory-efficient DenseNet (:mod:`effilayers.models.densenet`: the
  concatenation, norm and ReLU recomputed in backward, each block's maps in
  one buffer, their batch statistics computed once) by a class swap
  (``timm_densenet``: a run-time subclass of timm's class, which ``revert``
  turns back). Its norms stay timm's ``BatchNormAct2d`` modules, untouched,
  and are listed in the report's ``recomputed``; the function is exactly
  timm's. Only the stem's and the final norm are fused.
* **timm's BatchNormAct2d** (a ``BatchNorm2d`` subclass that applies its own
  ``drop`` (Identity) and ``act``): replaced by a fused module with its
  activation, in place where its input is known to be a fresh convolution
  output (after a convolution in a Sequential, DenseLayer's ``norm2``,
  ConvNormAct's ``bn``), else an ``ABN`` (DenseLayer's ``norm1`` reads the
  concatenated features): the norms of a DenseNet's layers that keep timm's
  forward (a hooked or non-ReLU ``norm1``, say). ``revert`` gives timm's
  class back.
* **timm's freeze helpers**: in a model built from timm's classes, each
  norm fused where a ``BatchNorm2d`` / ``SyncBatchNorm`` / ``BatchNormAct2d``
  was is also an instance of timm's ``BatchNormAct2d``
  (``timm_blocks.norm_act_class``: a run-time subclass of its effilayers
  class and timm's; same forward, state dict and children), whose ``act``
  says what it applies in its place: the fused activation, or Identity for
  a block's last norm, whose activation the block applies after the sum.
  So ``timm.layers.freeze_batch_norm_2d`` / ``timm.utils.freeze`` turn it
  into a ``FrozenBatchNormAct2d`` computing the same function, and the
  fused blocks run timm's own tail (norm, sum, activation) once their last
  norm is frozen. ``revert`` after freezing leaves the frozen norms (and the
  pass-throughs beside them, reported) and reverts the rest, blocks
  included. In models without timm classes (torchvision's included) the fused modules
  are not ``BatchNorm2d``s and timm's helpers leave them alone. As after
  ``revert``, a frozen copy of an InPlaceABN uses its weight itself, not
  the ±1e-3 it clamps tiny weights to.

An activation module object may be shared by several slots (one ``ReLU``
reused along a Sequential, say): only the slot is replaced, so its other
uses still run it.

Modes:

``"abn"``      :class:`effilayers.nn.ABN` with the original activation:
               exactly the original function (relu stays relu, a leaky_relu
               keeps its slope, elu its alpha).
``"inplace"``  :class:`effilayers.nn.InPlaceABN` (``InPlaceABNSync`` for a
               ``SyncBatchNorm``): only the output is kept for backward. It
               needs an invertible activation, so **ReLU becomes
               leaky_relu(activation_param)** (default 0.01) -- a different
               function, reported as ``function_changed``; leaky_relu with a
               positive slope and elu are kept as they are. The activations
               that cannot be inverted (SiLU, GELU, Hardswish, Mish, ReLU6,
               Sigmoid, Tanh) get an exact ``ABN``: it keeps only the
               norm's input and per-channel statistics (not the norm output
               that BatchNorm + activation keeps), and the report says so
               in the pair's note. Writing over the
               norm's input is only safe when nothing else uses it, so a pair
               is converted in place only where that input is known to be a
               fresh convolution or linear output (the previous module of a
               Sequential, or inside a recognised block or stem). Elsewhere
               (first in a Sequential, after a pooling, a BatchNormAct2d
               whose input is unknown) it gets an ``ABN`` with its original
               activation: fused, exact, not in place, and the report says so.

Also ``InPlaceABN`` uses ``sign(w) * max(|w|, 1e-3)`` as its scale; channels
with a smaller weight (``zero_init_residual``) are counted in the report.

Modules with hooks or parametrizations, modules registered at more than one
place, and uninitialised lazy modules are never replaced; nor is a norm or
block that is the root module itself, which cannot be swapped in place (wrap
it, for example ``nn.Sequential(block)``; a ResNet at the root is fine, only
its children change).

``revert`` gives back the original BatchNorm classes and activation modules
(the activation the fused module computes, so LeakyReLU after
``mode="inplace"``). A converted torchvision block stays an effilayers block,
in plain form: same children, state dict and function, not the torchvision
class.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..models import resnet
from ..nn.pooling import MaxPool2d
from ..ops.abn.module import ABN, PLAIN_TYPE_ATTR, FusedActivation, InPlaceABN
from . import timm_blocks, timm_densenet
from .patterns import (
    SUPPORTED_ACTIVATIONS,
    Activation,
    BatchNormAct,
    Slots,
    activation_blocker,
    activation_module,
    activation_of,
    activation_of_fused,
    clamp_note,
    clamped_channels,
    fresh_output,
    fuse_norm,
    has_hooks,
    in_module_order,
    in_place_activation,
    is_batchnorm,
    is_plain_sequential,
    is_resnet,
    is_resnet_block,
    is_timm_norm_act,
    join_path,
    replace_blocker,
    swap_pool,
    unfuse_norm,
)
from .report import ConversionReport, FusedPair, LeftAlone, RecomputedNorm, RestoredPair, RevertReport

__all__ = [
    "MODES",
    "convert",
    "revert",
    "ConversionReport",
    "RevertReport",
    "FusedPair",
    "RecomputedNorm",
    "RestoredPair",
    "LeftAlone",
    "FusedActivation",
    "BatchNormAct",
]

MODES = ("abn", "inplace")

# What effilayers.fit leaves on a model it changed: a list of callables that
# undo its steps, last first. Defined here so that revert runs them without
# importing fit (which sits above convert).
FIT_UNDO_ATTR = "_effilayers_fit_undo"


# ---- convert --------------------------------------------------------------------------------


class _Converter:
    def __init__(self, root: nn.Module, mode: str, activation_param: float) -> None:
        self.root = root
        self.mode = mode
        self.slope = activation_param
        self.slots = Slots(root)
        self.report = ConversionReport(mode, activation_param)
        self.visited: set[int] = set()
        self.reported: set[int] = set()
        # timm's BatchNormAct2d when the model is built from timm's classes
        self.timm_norm_act = timm_blocks.timm_norm_act(root)

    # -- decisions shared by every pattern

    def plan(self, norm: nn.Module, activation: Activation, input_fresh: bool, why_not_fresh: str):
        """(fused activation, in place?, note) or a str: why not to fuse."""
        if self.mode == "abn":
            if isinstance(norm, nn.SyncBatchNorm):
                return ("SyncBatchNorm: there is no synchronised non-in-place ABN; use mode='inplace' "
                        "(InPlaceABNSync)")
            return activation, False, ""
        fused_activation = in_place_activation(activation, self.slope)
        if not fused_activation.invertible:
            # SiLU, GELU, ...: no inverse, so no in-place form; ABN keeps the
            # norm's input only (the norm output BatchNorm + act keeps is dropped).
            if isinstance(norm, nn.SyncBatchNorm):
                return (f"SyncBatchNorm followed by {activation.name}, which is not invertible (no in-place form), "
                        "and there is no synchronised non-in-place ABN")
            return activation, False, (f"ABN, not in place: {activation.name} is not invertible; exact, it keeps "
                                       "only the norm's input and statistics")
        if input_fresh:
            return fused_activation, True, ""
        if isinstance(norm, nn.SyncBatchNorm):
            return (f"SyncBatchNorm whose input cannot be overwritten ({why_not_fresh}), and there is no "
                    "synchronised non-in-place ABN")
        return activation, False, f"ABN, not in place: {why_not_fresh}; activation kept"

    def fuse(self, norm, activation, input_fresh, why_not_fresh, residual=False):
        """The fused module and the report fields, or a str: why not."""
        decision = self.plan(norm, activation, input_fresh, why_not_fresh)
        if isinstance(decision, str):
            return decision
        fused_activation, in_place, note = decision
        try:
            fused = fuse_norm(norm, fused_activation, in_place)
        except (ValueError, TypeError) as error:  # e.g. a momentum ABN does not accept
            return f"cannot be represented as an ABN: {error}"
        note = "; ".join(part for part in (note, clamp_note(fused) if in_place else "") if part)
        after = f"{type(fused).__name__}({fused_activation.describe()}" + (", + residual)" if residual else ")")
        details = {
            "module": type(fused).__name__,
            "before": f"{type(norm).__name__} {'+ residual ' if residual else ''}-> {activation.describe()}",
            "after": after,
            "residual": residual,
            "function_changed": fused_activation != activation,
            "note": note,
        }
        return fused, details

    def timm_form(self, fused: ABN, act_in_block: bool = False) -> None:
        """In a timm model, a fused norm that replaced a BatchNorm2d (or a
        SyncBatchNorm, which timm's freeze treats alike) becomes a
        BatchNormAct2d too, so timm's freeze helpers find it
        (timm_blocks.norm_act_class)."""
        plain = getattr(fused, PLAIN_TYPE_ATTR, None)
        if self.timm_norm_act is not None and isinstance(plain, type) and issubclass(
                plain, (nn.BatchNorm2d, nn.SyncBatchNorm)):
            timm_blocks.to_norm_act(fused, self.timm_norm_act, act_in_block)

    def leave(self, module: nn.Module, path: str, reason: str) -> None:
        if id(module) not in self.reported:
            self.reported.add(id(module))
            self.report.left_alone.append(LeftAlone(path, reason))

    # -- the walk

    def run(self) -> ConversionReport:
        root = self.root
        cannot = ("cannot be replaced in place, being the root module; wrap it, e.g. "
                  "convert(nn.Sequential(model))")
        if is_batchnorm(root) or is_timm_norm_act(root):
            self.leave(root, "", f"the norm {cannot}")
        elif is_resnet_block(root):
            for name, child in root._modules.items():
                if is_batchnorm(child):
                    self.leave(child, name, f"in a ResNet block that {cannot}")
        self.visit(root, "")
        report = self.report
        report.fused = in_module_order(root, report.fused, lambda pair: pair.norm)
        report.left_alone = in_module_order(root, report.left_alone, lambda entry: entry.path)
        report.recomputed = in_module_order(root, report.recomputed, lambda entry: entry.norm)
        report.memory_efficient = in_module_order(root, report.memory_efficient, lambda path: path)
        return report

    def visit(self, parent: nn.Module, prefix: str) -> None:
        if id(parent) in self.visited:
            return
        self.visited.add(id(parent))
        reasons: dict[str, str] = {}
        recomputed: set[str] = set()
        if timm_densenet.kind_of(parent) in ("layer", "transition"):
            recomputed = self.dense_module(parent, prefix)
        elif is_plain_sequential(parent):
            reasons = self.sequential(parent, prefix)
        elif is_resnet(parent):
            reasons = self.resnet_stem(parent, prefix)
        elif timm_blocks.is_resnet(parent):
            reasons = self.resnet_stem(parent, prefix, act_name="act1")
        elif timm_blocks.block_kind(parent):
            reasons = self.timm_block(parent, prefix)
        previous = None
        for name, child in list(parent._modules.items()):
            if child is None or name in recomputed:
                continue
            before, previous = previous, child
            path = join_path(prefix, name)
            if is_resnet_block(child):
                child = self.resnet_block(parent, name, child, path)
            elif is_timm_norm_act(child):
                if not is_plain_sequential(parent):
                    before = timm_blocks.previous_of_norm_act(parent, name)
                self.norm_act(parent, name, child, path, before)
                continue
            elif is_batchnorm(child):
                self.leave(child, path, reasons.get(name) or (
                    f"inside {type(parent).__name__}, whose forward decides what follows it: only nn.Sequential "
                    "chains and recognised ResNet blocks / stems are converted"))
                continue
            elif isinstance(child, _BatchNorm) and not isinstance(child, ABN):
                self.leave(child, path, f"{type(child).__name__} overrides BatchNorm's forward, so what it computes "
                                        "is not known to be BatchNorm")
            self.visit(child, path)
        if timm_densenet.kind_of(parent) == "block" and timm_densenet.why_not(parent) is None:
            # after its layers: the block's forward hands them the shared
            # statistics, which only the swapped layers take
            if timm_densenet.plain_class(parent) is None:
                timm_densenet.swap(parent)
            self.report.memory_efficient.append(prefix)

    def dense_module(self, module: nn.Module, prefix: str) -> set[str]:
        """A timm DenseNet layer or transition gets effilayers' recomputing
        forward where its first step can take it (timm_densenet); returns the
        names of the norms it now recomputes, which stay as they are. Exact,
        so in both modes: in place, ``norm2`` would keep the same bytes."""
        if timm_densenet.why_not(module) is not None:
            return set()  # its norms are fused one by one
        if timm_densenet.plain_class(module) is None:
            timm_densenet.swap(module)
        self.report.memory_efficient.append(prefix)
        names = set()
        for norm_name, conv_name in timm_densenet.recomputed_norms(module):
            norm, conv = module._modules[norm_name], module._modules[conv_name]
            self.report.recomputed.append(RecomputedNorm(
                join_path(prefix, norm_name), join_path(prefix, conv_name),
                f"{type(norm).__name__}({type(norm.act).__name__}) -> {type(conv).__name__}"))
            names.add(norm_name)
        return names

    def record(self, norm_path, activation_path, pattern, details) -> None:
        self.report.fused.append(FusedPair(norm_path, activation_path, pattern, **details))

    def sequential(self, sequential: nn.Sequential, prefix: str) -> dict[str, str]:
        items = [(name, module) for name, module in sequential._modules.items() if module is not None]
        reasons = {}
        for index, (name, norm) in enumerate(items):
            if not is_batchnorm(norm):
                continue
            if index + 1 == len(items):
                reasons[name] = ("last module of its nn.Sequential: what follows it is decided outside, "
                                 "so it is not known to be an activation")
                continue
            act_name, act_module = items[index + 1]
            activation = activation_of(act_module)
            if activation is None:
                reasons[name] = (f"followed by {type(act_module).__name__}, not a supported activation "
                                 f"({SUPPORTED_ACTIVATIONS})")
                continue
            blocker = replace_blocker(norm, self.slots, "the norm") or activation_blocker(act_module)
            if blocker:
                reasons[name] = blocker
                continue
            previous = items[index - 1][1] if index > 0 else None
            why_not = ("first module of its nn.Sequential, so its input comes from outside and may be used "
                       "again" if previous is None else
                       f"its input comes from {type(previous).__name__}, not known to be a fresh tensor")
            outcome = self.fuse(norm, activation, fresh_output(previous), why_not)
            if isinstance(outcome, str):
                reasons[name] = outcome
                continue
            fused, details = outcome
            sequential._modules[name] = fused
            sequential._modules[act_name] = _placeholder(name, act_module, fused)
            self.timm_form(fused)
            self.record(join_path(prefix, name), join_path(prefix, act_name), "sequential", details)
        return reasons

    def resnet_stem(self, model: nn.Module, prefix: str, act_name: str = "relu") -> dict[str, str]:
        norm, act_module = model._modules["bn1"], model._modules[act_name]
        if not is_batchnorm(norm):
            return {}
        activation = activation_of(act_module)
        if activation is None:
            return {"bn1": f"the stem activation is {type(act_module).__name__}, not a supported activation "
                           f"({SUPPORTED_ACTIVATIONS})"}
        blocker = replace_blocker(norm, self.slots, "the norm") or activation_blocker(act_module)
        if blocker:
            return {"bn1": blocker}
        outcome = self.fuse(norm, activation, fresh_output(model._modules["conv1"]),
                            "conv1 has hooks that may keep its output")
        if isinstance(outcome, str):
            return {"bn1": outcome}
        fused, details = outcome
        model._modules["bn1"] = fused
        model._modules[act_name] = _placeholder("bn1", act_module, fused)
        self.timm_form(fused)
        self.record(join_path(prefix, "bn1"), join_path(prefix, act_name), "resnet_stem", details)
        pool = model._modules["maxpool"]
        if (isinstance(fused, InPlaceABN) and type(pool) is nn.MaxPool2d and not pool.return_indices
                and not has_hooks(pool)):
            # The stem output is kept by the fused norm already; a pool that
            # recomputes its argmax keeps nothing more (no int64 indices).
            model._modules["maxpool"] = swap_pool(pool, MaxPool2d)
            self.report.replaced_pools.append(join_path(prefix, "maxpool"))
        return {}

    def resnet_block(self, parent: nn.Module, name: str, block: nn.Module, path: str) -> nn.Module:
        """Replaces ``block`` in ``parent`` with a fused effilayers block;
        returns what is in the slot afterwards."""
        kind = is_resnet_block(block)
        norm_names = ("bn1", "bn2") if kind == "basic" else ("bn1", "bn2", "bn3")
        act_module = block._modules["relu"]
        activation = activation_of(act_module)
        problem = replace_blocker(block, self.slots, "the block")
        if activation is None:
            problem = (f"the block's activation is {type(act_module).__name__}, not a supported activation "
                       f"({SUPPORTED_ACTIVATIONS})")
        problem = problem or activation_blocker(act_module)
        for norm_name in norm_names:
            norm = block._modules[norm_name]
            if problem:
                break
            if not is_batchnorm(norm):
                problem = f"{norm_name} is {type(norm).__name__}, not a BatchNorm"
            else:
                problem = replace_blocker(norm, self.slots, norm_name)
        planned = {}
        for norm_name in norm_names:
            if problem:
                break
            conv = block._modules["conv" + norm_name[-1]]
            residual = norm_name == norm_names[-1]
            outcome = self.fuse(block._modules[norm_name], activation, fresh_output(conv),
                                f"conv{norm_name[-1]} has hooks that may keep its output", residual=residual)
            if isinstance(outcome, str):
                problem = f"{norm_name}: {outcome}"
            else:
                planned[norm_name] = outcome
        if problem:
            for norm_name in norm_names:
                if is_batchnorm(block._modules[norm_name]):
                    self.leave(block._modules[norm_name], join_path(path, norm_name),
                               f"in a {type(block).__name__} left alone: {problem}")
            return block
        modules = dict(block._modules)
        modules.pop("relu")
        modules.update({norm_name: fused for norm_name, (fused, _) in planned.items()})
        block_type = resnet.BasicBlock if kind == "basic" else resnet.Bottleneck
        replacement = block_type._from_modules(modules, stride=getattr(block, "stride", 1), training=block.training)
        parent._modules[name] = replacement
        self.report.replaced_blocks.append(path)
        for norm_name, (_, details) in planned.items():
            self.record(join_path(path, norm_name), join_path(path, "relu"), "resnet_block", details)
        shortcut = modules.get("downsample")
        if shortcut is not None and is_plain_sequential(shortcut) and len(shortcut):
            self.shortcut_norm(shortcut, join_path(path, "downsample"),
                               in_place=all(isinstance(fused, InPlaceABN) for fused, _ in planned.values()))
        return replacement

    def shortcut_norm(self, shortcut: nn.Sequential, path: str, in_place: bool) -> None:
        """The norm ending a projection shortcut. Only the block's fused sum
        follows it, and that sum keeps the shortcut for backward anyway, so
        in place an identity InPlaceABN over the convolution output saves
        keeping that output a second time (as BatchNorm's input)."""
        names = list(shortcut._modules)
        last_name, last = names[-1], shortcut._modules[names[-1]]
        if not is_batchnorm(last):
            return
        norm_path = join_path(path, last_name)
        previous = shortcut._modules[names[-2]] if len(names) > 1 else None
        problem = None
        if not in_place:
            problem = ("norm of the block's shortcut, with no activation after it: plain BatchNorm computes it "
                       "exactly (mode='abn' or a block fused out of place)")
        elif not fresh_output(previous):
            problem = "norm of the block's shortcut whose input may be kept elsewhere: left a plain BatchNorm"
        else:
            problem = replace_blocker(last, self.slots, "the norm")
        if problem:
            self.leave(last, norm_path, problem)
            return
        identity = Activation("identity", 0.0)
        try:
            fused = fuse_norm(last, identity, in_place=True)
        except (ValueError, TypeError) as error:
            self.leave(last, norm_path, f"cannot be represented as an ABN: {error}")
            return
        shortcut._modules[last_name] = fused
        self.timm_form(fused)
        self.record(norm_path, None, "resnet_shortcut", {
            "module": type(fused).__name__, "before": f"{type(last).__name__}", "after": "InPlaceABN(identity)",
            "residual": False, "function_changed": False, "note": clamp_note(fused)})

    def norm_act(self, parent: nn.Module, name: str, module: nn.Module, path: str,
                 previous: Optional[nn.Module]) -> None:
        """timm's BatchNormAct2d: in place where the module feeding it is known
        (the previous module of a Sequential, DenseLayer's conv1, ConvNormAct's
        conv) and returns a fresh tensor."""
        act_module = module._modules["act"]
        activation = activation_of(act_module)
        problem = replace_blocker(module, self.slots, "the module")
        if type(act_module) is nn.Identity:
            problem = ("its act is Identity: nothing to fuse (an identity ABN would keep the same input BatchNorm "
                       "keeps)")
        elif activation is None:
            problem = f"its act is {type(act_module).__name__}, not a supported activation ({SUPPORTED_ACTIVATIONS})"
        if not problem:
            why_not = ("its input comes from outside its parent's known forward, so it may be used again"
                       if previous is None else
                       f"its input comes from {type(previous).__name__}, not known to be a fresh tensor")
            outcome = self.fuse(module, activation, fresh_output(previous), why_not)
            if isinstance(outcome, str):
                problem = outcome
        if problem:
            self.leave(module, path, f"{type(module).__name__}: {problem}")
            return
        fused, details = outcome
        # Its activation lives inside, as it did: revert gives back timm's
        # class itself, or a BatchNormAct for another class of that shape.
        setattr(fused, PLAIN_TYPE_ATTR, type(module) if type(module).__module__.startswith("timm.") else BatchNormAct)
        parent._modules[name] = fused
        self.timm_form(fused)
        self.record(path, None, "norm_act", details)

    def timm_block(self, block: nn.Module, prefix: str) -> dict[str, str]:
        """The pairs of a timm ResNet block, each fused where it can be; the
        residual tail also changes the block's forward (timm_blocks.fused_class).
        Returns why each norm left alone was."""
        kind = timm_blocks.block_kind(block)
        reasons = {}
        for norm_name, act_name, between in timm_blocks.inner_pairs(kind):
            reason = self.block_pair(block, prefix, "conv" + norm_name[-1], norm_name, act_name, between, False)
            if reason:
                reasons[norm_name] = reason
        conv_name, norm_name, act_name = timm_blocks.tail(kind)
        if getattr(block, "se", None) is not None:
            reason = self.se_tail(block, prefix, conv_name, norm_name)
            if reason:
                reasons[norm_name] = reason
            return reasons
        reason = next((f"its output goes through {child} ({type(getattr(block, child)).__name__}) before the "
                       "shortcut sum, so the sum and activation cannot be fused into it"
                       for child in ("drop_path",) if getattr(block, child, None) is not None), None)
        reason = reason or self.block_pair(block, prefix, conv_name, norm_name, act_name, None, True)
        if reason:
            reasons[norm_name] = reason
            return reasons
        block.__class__ = timm_blocks.fused_class(type(block))
        shortcut = getattr(block, "downsample", None)
        if isinstance(shortcut, nn.Module) and is_plain_sequential(shortcut) and len(shortcut):
            self.shortcut_norm(shortcut, join_path(prefix, "downsample"),
                               in_place=isinstance(block._modules[norm_name], InPlaceABN))
        return reasons

    def se_tail(self, block: nn.Module, prefix: str, conv_name: str, norm_name: str) -> Optional[str]:
        """The last norm of a timm block with squeeze-excitation; returns why
        it was left alone, or None. SE reads the norm's output before the
        shortcut sum, so the sum and activation stay in timm's forward; but
        SE's multiply keeps that output for backward anyway, so in place an
        identity InPlaceABN written over the convolution's output (keeping
        only its output) drops the input BatchNorm keeps."""
        se, norm = block.se, block._modules[norm_name]
        unfused = (f"its output goes through se ({type(se).__name__}) before the shortcut sum, so the sum and "
                   "activation cannot be fused into it")
        if self.mode != "inplace":
            return (f"{unfused}; mode='abn' leaves it a BatchNorm: only an in-place identity norm (keeping its "
                    "output, which SE keeps too, instead of its input) would save memory here")
        if not timm_blocks.is_plain_se(se):
            return (f"{unfused}, and {type(se).__name__} is not one of timm's squeeze-excitation modules (whose "
                    "output is a new tensor), so the norm's output might be changed in place before backward")
        if not fresh_output(block._modules[conv_name]):
            return f"{unfused}, and {conv_name} has hooks that may keep its output, which an in-place norm overwrites"
        blocker = replace_blocker(norm, self.slots, "the norm")
        if blocker:
            return blocker
        try:
            fused = fuse_norm(norm, Activation("identity", 0.0), in_place=True)
        except (ValueError, TypeError) as error:
            return f"cannot be represented as an ABN: {error}"
        block._modules[norm_name] = fused
        self.timm_form(fused)
        self.record(join_path(prefix, norm_name), None, "timm_se_tail", {
            "module": type(fused).__name__, "before": f"{type(norm).__name__} -> {type(se).__name__}",
            "after": "InPlaceABN(identity)", "residual": False, "function_changed": False,
            "note": clamp_note(fused)})
        return None

    def block_pair(self, block, prefix, conv_name, norm_name, act_name, between, residual) -> Optional[str]:
        """Fuses ``block.<norm_name>`` with ``block.<act_name>``; returns why not, or None."""
        norm, act_module = block._modules[norm_name], block._modules[act_name]
        if not is_batchnorm(norm):
            return f"{norm_name} is {type(norm).__name__}, not a BatchNorm"
        activation = activation_of(act_module)
        if activation is None:
            return (f"followed by {act_name} ({type(act_module).__name__}), not a supported activation "
                    f"({SUPPORTED_ACTIVATIONS})")
        if between is not None and type(block._modules[between]) is not nn.Identity:
            return (f"{between} ({type(block._modules[between]).__name__}) runs between it and {act_name}, so "
                    "the two cannot be fused")
        blocker = replace_blocker(norm, self.slots, "the norm") or activation_blocker(act_module)
        if blocker:
            return blocker
        outcome = self.fuse(norm, activation, fresh_output(block._modules[conv_name]),
                            f"{conv_name} has hooks that may keep its output", residual=residual)
        if isinstance(outcome, str):
            return outcome
        fused, details = outcome
        block._modules[norm_name] = fused
        block._modules[act_name] = _placeholder(norm_name, act_module, fused)
        self.timm_form(fused, act_in_block=residual)
        self.record(join_path(prefix, norm_name), join_path(prefix, act_name), "timm_block", details)
        return None


def _placeholder(norm_name: str, act_module: nn.Module, fused: ABN) -> FusedActivation:
    return FusedActivation(norm_name, getattr(act_module, "inplace", True), fused.activation, fused.activation_param)


def _check_arguments(model, mode, activation_param) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"convert: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if isinstance(activation_param, bool) or not isinstance(activation_param, (int, float)):
        raise TypeError(f"convert: activation_param must be a float, got {type(activation_param).__name__}")
    if not (math.isfinite(activation_param) and activation_param > 0):
        raise ValueError("convert: activation_param (the leaky_relu slope that replaces relu in place) must be a "
                         f"finite float > 0, got {activation_param}")


def convert(model: nn.Module, mode: str = "inplace", *, activation_param: float = 0.01) -> ConversionReport:
    """Fuse BatchNorm + activation pairs of ``model`` into effilayers ABNs, in place.

    Args:
        model: any ``nn.Module``; modified in place (``copy.deepcopy`` it
            first to keep the original).
        mode: ``"inplace"`` (InPlaceABN: least memory; ReLU becomes
            leaky_relu(``activation_param``)) or ``"abn"`` (ABN: exactly the
            original function). See the module docstring.
        activation_param: the leaky_relu slope that replaces ReLU in place
            (> 0). Unused by ``mode="abn"``.

    Returns:
        A :class:`ConversionReport`: every fused pair with its path and
        whether its function changed, and every BatchNorm left alone with the
        reason. ``print(report)`` gives a summary.

    Synchronised across a process group: convert the BatchNorms first,
    ``convert(nn.SyncBatchNorm.convert_sync_batchnorm(model, group))``; each
    SyncBatchNorm + activation becomes an ``InPlaceABNSync`` on ``group``.
    ``convert_sync_batchnorm`` applied after ``convert`` raises a TypeError
    on the first fused module, as the plain SyncBatchNorm it would build
    drops the activation; use
    ``effilayers.nn.InPlaceABNSync.convert_sync_abn(model, group)`` there.
    """
    _check_arguments(model, mode, activation_param)
    return _Converter(model, mode, float(activation_param)).run()


# ---- revert ---------------------------------------------------------------------------------


def _plain_description(norm: nn.Module, act: nn.Module) -> str:
    return f"{type(norm).__name__} + {type(act).__name__}" if getattr(norm, "act", None) is not act else (
        f"{type(norm).__name__}({type(norm.act).__name__})")


def _revert_note(fused: ABN) -> str:
    clamped = clamped_channels(fused) if isinstance(fused, InPlaceABN) else 0
    if clamped:
        return (f"{clamped} channel(s) with |weight| < {fused.weight_eps:g}: InPlaceABN used ±{fused.weight_eps:g}, "
                "the plain norm uses the weight itself")
    return ""


class _Reverter:
    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.slots = Slots(root)
        self.report = RevertReport()
        self.visited: set[int] = set()

    def run(self) -> RevertReport:
        if isinstance(self.root, ABN):
            self.report.left_alone.append(LeftAlone("", "the root module itself cannot be replaced in place; "
                                                        "wrap it, e.g. revert(nn.Sequential(model))"))
            return self.report
        self.visit(self.root, "")
        report = self.report
        report.restored = in_module_order(self.root, report.restored, lambda pair: pair.norm)
        report.left_alone = in_module_order(self.root, report.left_alone, lambda entry: entry.path)
        report.restored_classes = in_module_order(self.root, report.restored_classes, lambda path: path)
        return report

    def blocked(self, module: nn.Module, path: str) -> bool:
        problem = replace_blocker(module, self.slots, "the module")
        if problem:
            self.report.left_alone.append(LeftAlone(path, problem))
        return bool(problem)

    def visit(self, parent: nn.Module, prefix: str) -> None:
        if id(parent) in self.visited:
            return
        self.visited.add(id(parent))
        kept: set[str] = set()
        if isinstance(parent, resnet._ResidualBlock):
            kept = self.resnet_block(parent, prefix)
        placeholders = {module.fused_into: name for name, module in parent._modules.items()
                        if isinstance(module, FusedActivation)}
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = join_path(prefix, name)
            if type(child) is MaxPool2d:  # same function; torch's pool exports everywhere
                parent._modules[name] = swap_pool(child, nn.MaxPool2d)
                continue
            if isinstance(child, ABN):
                if name not in kept and not self.blocked(child, path):
                    self.restore(parent, name, child, path, placeholders.get(name), prefix)
                continue
            self.visit(child, path)
        if timm_blocks.plain_class(parent) is not None:
            self.timm_block(parent, prefix)
        if timm_densenet.restore(parent):
            self.report.restored_classes.append(prefix)
        for name, module in parent._modules.items():
            norm = parent._modules.get(getattr(module, "fused_into", None))
            if isinstance(module, FusedActivation) and norm is not None and not isinstance(norm, ABN):
                self.report.left_alone.append(LeftAlone(join_path(prefix, name), (
                    f"pass-through for {module.fused_into}, which is now a {type(norm).__name__} (frozen or "
                    "replaced after convert) and applies the activation itself, as timm's frozen norms do")))

    def restore(self, parent, name, fused, path, placeholder_name, prefix) -> None:
        activation = activation_of_fused(fused)
        note = _revert_note(fused)
        if placeholder_name is not None:
            placeholder = parent._modules[placeholder_name]
            # An unknown original class gives a BatchNormAct with an Identity
            # act: a rank-agnostic plain norm.
            plain = unfuse_norm(fused)
            act = activation_module(activation, placeholder.inplace)
            parent._modules[name] = plain
            parent._modules[placeholder_name] = act
            self.report.restored.append(RestoredPair(path, join_path(prefix, placeholder_name),
                                                     _plain_description(plain, act), note))
            return
        if activation.name == "identity" and getattr(fused, PLAIN_TYPE_ATTR, None) is not None:
            # A norm with nothing after it (a shortcut's): its own class again.
            plain = unfuse_norm(fused)
            parent._modules[name] = plain
            self.report.restored.append(RestoredPair(path, None, type(plain).__name__, note))
            return
        plain = unfuse_norm(fused, act=activation_module(activation, inplace=True))
        parent._modules[name] = plain
        self.report.restored.append(RestoredPair(path, None, _plain_description(plain, plain.act), note))

    def timm_block(self, block: nn.Module, path: str) -> None:
        """timm's own block class again, once its last norm is plain (the
        fused forward passes that norm the shortcut)."""
        _, norm_name, act_name = timm_blocks.tail(timm_blocks.block_kind(block))
        norm, slot = block._modules[norm_name], block._modules[act_name]
        if isinstance(norm, ABN):
            self.report.left_alone.append(LeftAlone(path, f"a timm block whose {norm_name} stays fused keeps its "
                                                          "fused forward"))
            return
        if isinstance(slot, FusedActivation):
            # The norm was swapped after convert (frozen by timm): it applies
            # no activation, timm's forward runs act after the sum.
            activation = timm_blocks.slot_activation(slot)
            if activation is None:
                self.report.left_alone.append(LeftAlone(path, f"a timm block whose {norm_name} is a "
                                                              f"{type(norm).__name__} and whose {act_name} has no "
                                                              "recorded activation keeps its fused forward"))
                return
            act = activation_module(activation, slot.inplace)
            block._modules[act_name] = act
            self.report.restored.append(RestoredPair(join_path(path, norm_name), join_path(path, act_name),
                                                     f"{type(norm).__name__} + {type(act).__name__}",
                                                     f"{norm_name} stays a {type(norm).__name__}"))
        block.__class__ = timm_blocks.plain_class(block)

    def resnet_block(self, block, path) -> set[str]:
        """Turns a fused effilayers block plain, in place; returns the names
        of norms it left fused (the caller must not restore them singly)."""
        norms = {name: block._modules.get(name) for name in block._CHILDREN if name.startswith("bn")}
        if not any(isinstance(norm, ABN) for norm in norms.values()):
            return set()
        activations = {activation_of_fused(norm) for norm in norms.values() if isinstance(norm, ABN)}
        problem = None
        if not all(isinstance(norm, ABN) for norm in norms.values()):
            problem = "only some of its norms are fused"
        elif len(activations) != 1:
            problem = "its norms use different activations, and the plain block has one relu module"
        else:
            problem = next((replace_blocker(norm, self.slots, name) for name, norm in norms.items()
                            if replace_blocker(norm, self.slots, name)), None)
        if problem:
            for name, norm in norms.items():
                if isinstance(norm, ABN):
                    self.report.left_alone.append(LeftAlone(join_path(path, name), f"in a block left alone: {problem}"))
            return set(norms)
        (activation,) = activations
        relu = activation_module(activation, inplace=True)  # torchvision's blocks use an in-place ReLU
        modules = dict(block._modules)
        for name, norm in norms.items():
            modules[name] = unfuse_norm(norm, plain_type=nn.BatchNorm2d)
            self.report.restored.append(RestoredPair(join_path(path, name), join_path(path, "relu"),
                                                     f"BatchNorm2d + {type(relu).__name__}", _revert_note(norm)))
        modules["relu"] = relu
        block._set_children(modules)
        return set()


def revert(model: nn.Module) -> RevertReport:
    """Turn the fused modules of ``model`` back into plain ones, in place, for export.

    * a norm whose activation slot :func:`convert` (or a fused effilayers
      ResNet) left as a :class:`FusedActivation` becomes its original
      BatchNorm class again, and the slot an activation module;
    * an effilayers ResNet block with fused norms becomes the same block in
      plain form (``BatchNorm2d`` norms, one ``relu`` module);
    * any other ABN becomes a :class:`BatchNormAct` (BatchNorm then its
      activation module).

    The activation put back is the one the fused module computes --
    ``LeakyReLU(0.01)`` after ``convert(mode="inplace")``, not the ReLU it
    replaced -- so outputs do not change. Tensors are moved, not copied: the
    state dict stays the same, key for key.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"revert: model must be a torch.nn.Module, got {type(model).__name__}")
    fit_steps = model.__dict__.pop(FIT_UNDO_ATTR, None) or []
    for undo in reversed(fit_steps):
        undo()
    report = _Reverter(model).run()
    report.fit_steps_undone = len(fit_steps)
    return report

