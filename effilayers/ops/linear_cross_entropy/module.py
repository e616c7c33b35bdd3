"""``LinearCrossEntropyLoss``: a language-model head's projection and
cross-entropy as a module (exported as ``effilayers.nn.LinearCrossEntropyLoss``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .contract import check_options as check_linear_options
from .op import linear_cross_entropy

__all__ = ["LinearCrossEntropyLoss"]


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
