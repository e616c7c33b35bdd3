"""Loss modules: drop-ins for ``torch.nn`` losses.

``CrossEntropyLoss`` subclasses ``torch.nn.CrossEntropyLoss``: same
constructor arguments (the legacy ``size_average``/``reduce`` pair is mapped
to ``reduction`` by torch's own code, with its deprecation warning), the same
attributes, ``weight`` buffer and state dict (they load into each other), the
same ``repr``, and ``isinstance(m, torch.nn.CrossEntropyLoss)`` holds. It
adds ``inplace_backward`` (shown in ``repr`` only when True): see
:func:`effilayers.functional.cross_entropy` for what that destroys and what
it saves.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.cross_entropy import cross_entropy
from ..ops.cross_entropy.contract import check_options
from ..ops.linear_cross_entropy import linear_cross_entropy
from ..ops.linear_cross_entropy.contract import check_options as check_linear_options

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss"]


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


class LinearCrossEntropyLoss(nn.Module):
    """A language-model head's projection and cross-entropy in one, without
    the whole logits: ``forward(input, weight, target, bias=None,
    token_weight=None)`` returns
    :func:`effilayers.functional.linear_cross_entropy` with the options
    given here (``class_weight`` is kept as a buffer, like
    ``CrossEntropyLoss.weight``). The projection's parameters stay in the
    model (``lm_head.weight``, possibly tied to the input embedding), so the
    loss holds none::

        criterion = LinearCrossEntropyLoss(ignore_index=-100)
        loss = criterion(hidden_states, model.lm_head.weight, labels)
    """

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "chunk_size", "filter_eps"]

    def __init__(self, class_weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, chunk_size: Optional[int] = None,
                 filter_eps: float = 0.0) -> None:
        super().__init__()
        check_linear_options("LinearCrossEntropyLoss", reduction, label_smoothing, ignore_index, chunk_size,
                             filter_eps)
        self.register_buffer("class_weight", class_weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.chunk_size = chunk_size
        self.filter_eps = filter_eps

    def forward(self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None, token_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear_cross_entropy(input, weight, target, bias, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, reduction=self.reduction,
                                    class_weight=self.class_weight, token_weight=token_weight,
                                    chunk_size=self.chunk_size, filter_eps=self.filter_eps)

    def extra_repr(self) -> str:
        filtered = f", filter_eps={self.filter_eps}" if self.filter_eps else ""
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, chunk_size={self.chunk_size}{filtered}")
