"""``CrossEntropyLoss``, the ``torch.nn.CrossEntropyLoss`` drop-in (exported as
``effilayers.nn.CrossEntropyLoss``).

It subclasses ``torch.nn.CrossEntropyLoss``: same constructor arguments (the
legacy ``size_average``/``reduce`` pair is mapped to ``reduction`` by torch's
own code, with its deprecation warning), the same attributes, ``weight``
buffer and state dict (they load into each other), the same ``repr``, and
``isinstance(m, torch.nn.CrossEntropyLoss)`` holds. It adds
``inplace_backward`` (shown in ``repr`` only when True): see
:func:`effilayers.functional.cross_entropy` for what that destroys and what
it saves.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .contract import check_options
from .op import cross_entropy

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """Cross-entropy against class indices that saves one logits-sized
    gradient in the logits' dtype (none with ``inplace_backward=True``) and
    never makes a float32 copy of the logits.

    ``forward(input, target)``: ``input`` ``(N, C)``, ``(N, C, d1, ...)`` or
    ``(C,)``; ``target`` the class indices without the class dimension, or
    class probabilities of the input's shape (torch's formula and memory;
    see :func:`effilayers.functional.cross_entropy`).
    """

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "inplace_backward"]
    inplace_backward: bool

    def __init__(self, weight: Optional[torch.Tensor] = None, size_average=None, ignore_index: int = -100,
                 reduce=None, reduction: str = "mean", label_smoothing: float = 0.0,
                 inplace_backward: bool = False) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        # torch checks these only at the first forward; a drop-in can say so at construction.
        check_options("CrossEntropyLoss", self.reduction, label_smoothing, inplace_backward)
        self.inplace_backward = inplace_backward

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                             label_smoothing=self.label_smoothing, reduction=self.reduction,
                             inplace_backward=self.inplace_backward)

    def extra_repr(self) -> str:
        # torch's CrossEntropyLoss prints no arguments: the same here, plus the one addition when set.
        return "inplace_backward=True" if self.inplace_backward else ""
