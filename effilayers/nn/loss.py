"""Loss modules: drop-ins for ``torch.nn`` losses.

``CrossEntropyLoss`` takes ``torch.nn.CrossEntropyLoss``'s arguments (the
legacy ``size_average``/``reduce`` pair is mapped to ``reduction`` the way
torch maps it, with its deprecation warning) and registers ``weight`` as a
buffer under the same name, so state dicts move between the two unchanged.
It adds ``inplace_backward``: see :func:`effilayers.functional.cross_entropy`
for what that destroys and what it saves.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.modules.loss import _WeightedLoss

from ..ops.cross_entropy import cross_entropy

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(_WeightedLoss):
    """Cross-entropy against class indices that saves one logits-sized
    gradient in the logits' dtype (none with ``inplace_backward=True``) and
    never makes a float32 copy of the logits.

    ``forward(input, target)``: ``input`` ``(N, C)``, ``(N, C, d1, ...)`` or
    ``(C,)``; ``target`` the class indices without the class dimension.
    Probability targets are not supported.
    """

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "inplace_backward"]
    ignore_index: int
    label_smoothing: float
    inplace_backward: bool

    def __init__(self, weight: Optional[torch.Tensor] = None, size_average=None, ignore_index: int = -100,
                 reduce=None, reduction: str = "mean", label_smoothing: float = 0.0,
                 inplace_backward: bool = False) -> None:
        super().__init__(weight, size_average, reduce, reduction)
        if self.reduction not in ("mean", "sum", "none"):
            raise ValueError(f"CrossEntropyLoss: reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
                or not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
        self.ignore_index = ignore_index
        self.label_smoothing = float(label_smoothing)
        self.inplace_backward = bool(inplace_backward)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                             label_smoothing=self.label_smoothing, reduction=self.reduction,
                             inplace_backward=self.inplace_backward)

    def extra_repr(self) -> str:
        parts = [f"reduction={self.reduction!r}"]
        if self.ignore_index != -100:
            parts.append(f"ignore_index={self.ignore_index}")
        if self.label_smoothing:
            parts.append(f"label_smoothing={self.label_smoothing}")
        if self.inplace_backward:
            parts.append("inplace_backward=True")
        return ", ".join(parts)
