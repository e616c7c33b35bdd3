"""What :func:`effilayers.convert` and :func:`effilayers.revert` return: the
pairs they fused or restored, the modules they left alone (with why), and a
readable summary (``print(report)``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass(frozen=True)
class FusedPair:
    """One norm + activation pair that :func:`convert` fused."""

    norm: str  # path of the norm, now the fused module
    activation: Optional[str]  # path of the activation made a pass-through (None: it was inside the norm module)
    pattern: str  # "sequential", "resnet_block", "resnet_stem", "resnet_shortcut", "timm_block", "timm_se_tail"
    # or "norm_act"
    module: str  # "ABN", "InPlaceABN" or "InPlaceABNSync"
    before: str  # the original function, e.g. "BatchNorm2d -> relu"
    after: str  # the fused function, e.g. "InPlaceABN(leaky_relu(0.01), + residual)"
    residual: bool  # the shortcut sum of a ResNet block is inside the fused call
    function_changed: bool  # the activation differs from the original (relu -> leaky_relu)
    note: str = ""


@dataclass(frozen=True)
class RecomputedNorm:
    """A norm :func:`convert` left as it was and made its owner recompute in
    backward, with its activation and the convolution after it (timm's
    DenseNet given effilayers' memory-efficient path)."""

    norm: str  # path of the norm, unchanged
    conv: str  # path of the convolution recomputed with it
    before: str  # e.g. "BatchNormAct2d(ReLU) -> Conv2d"


@dataclass(frozen=True)
class RestoredPair:
    """One fused module that :func:`revert` turned back into plain modules."""

    norm: str
    activation: Optional[str]  # path of the activation module put back (None: inside a BatchNormAct)
    module: str  # e.g. "BatchNorm2d + ReLU", "BatchNormAct(LeakyReLU)"
    note: str = ""


@dataclass(frozen=True)
class LeftAlone:
    """A module left as it was, and why. ``path`` is "" for the root module."""

    path: str
    reason: str


class _Report:
    """What both reports share: the modules left alone and the summary's form
    (a headline with the counts, then one section per list)."""

    left_alone: list[LeftAlone]

    @property
    def left_alone_paths(self) -> list[str]:
        return [entry.path for entry in self.left_alone]

    def _summary(self, call: str, done: str, done_lines: list[str], note: str = "",
                 more: Sequence[tuple[str, list[str]]] = ()) -> str:
        """``call: N <done>, M left alone<note>``, then the section ``done``,
        the modules left alone, and the ``more`` sections."""
        left_alone = [f"{entry.path or '(root)'}: {entry.reason}" for entry in self.left_alone]
        lines = [f"{call}: {len(done_lines)} {done}, {len(left_alone)} left alone{note}"]
        for title, entries in ((done, done_lines), ("left alone", left_alone), *more):
            if entries:
                lines += [f"{title} ({len(entries)}):"] + [f"  {entry}" for entry in entries]
            else:
                lines.append(f"{title}: none")
        return "\n".join(lines)


@dataclass
class ConversionReport(_Report):
    """What :func:`convert` did: ``fused`` pairs, ``recomputed`` norms (left
    as they were, recomputed with their convolution in backward),
    ``left_alone`` norms (with the reason), ``replaced_blocks`` (paths of
    ResNet blocks swapped for effilayers blocks), ``replaced_pools`` (stem
    max pools swapped for :class:`effilayers.nn.MaxPool2d`; a pool is not a
    block, so it is listed apart) and ``memory_efficient`` (paths of timm
    DenseNet layers, blocks and transitions given effilayers' recomputing
    forward)."""

    mode: str
    activation_param: float
    fused: list[FusedPair] = field(default_factory=list)
    left_alone: list[LeftAlone] = field(default_factory=list)
    replaced_blocks: list[str] = field(default_factory=list)
    replaced_pools: list[str] = field(default_factory=list)
    recomputed: list[RecomputedNorm] = field(default_factory=list)
    memory_efficient: list[str] = field(default_factory=list)

    @property
    def fused_paths(self) -> list[str]:
        return [pair.norm for pair in self.fused]

    @property
    def function_changed(self) -> bool:
        """True when some activation was changed (relu -> leaky_relu in place)."""
        return any(pair.function_changed for pair in self.fused)

    def reason(self, path: str) -> Optional[str]:
        """Why the norm at ``path`` was left alone, or None if it was not."""
        return next((entry.reason for entry in self.left_alone if entry.path == path), None)

    def __str__(self) -> str:
        return self._summary(
            f"effilayers.convert(mode={self.mode!r}, activation_param={self.activation_param})", "fused",
            [f"{pair.norm}: {pair.before} => {pair.after} [{pair.pattern}]"
             + (" (function changed)" if pair.function_changed else "") + (f" -- {pair.note}" if pair.note else "")
             for pair in self.fused],
            note=" -- activations changed, see function_changed" if self.function_changed else "",
            more=[(title, paths) for title, paths in (
                ("recomputed in backward", [f"{entry.norm}: {entry.before}" for entry in self.recomputed]),
                ("DenseNet modules made memory-efficient", self.memory_efficient),
                ("ResNet blocks replaced", self.replaced_blocks),
                ("max pools replaced", self.replaced_pools)) if paths])


@dataclass
class RevertReport(_Report):
    """What :func:`revert` did: ``restored`` fused modules, ``left_alone`` ones (with the reason)."""

    restored: list[RestoredPair] = field(default_factory=list)
    left_alone: list[LeftAlone] = field(default_factory=list)
    fit_steps_undone: int = 0  # steps of effilayers.fit (checkpointed parts, DenseNet switches) undone first
    # timm DenseNet modules given their own class (and forward) back
    restored_classes: list[str] = field(default_factory=list)

    @property
    def restored_paths(self) -> list[str]:
        return [pair.norm for pair in self.restored]

    def __str__(self) -> str:
        return self._summary(
            "effilayers.revert", "restored",
            [f"{pair.norm}: {pair.module}" + (f" (activation at {pair.activation})" if pair.activation else "")
             + (f" -- {pair.note}" if pair.note else "") for pair in self.restored],
            more=[("timm classes given back", self.restored_classes)] if self.restored_classes else ())
