"""``nn.Softmax`` / ``nn.LogSoftmax`` drop-ins on effilayers' softmax ops (``effilayers.nn``).

Same constructor, state dict (none) and ``repr`` as the torch modules (they
subclass them, so ``isinstance(m, torch.nn.Softmax)`` still holds); the
forward accumulates in float32 and saves only its output for backward (see
:mod:`effilayers.ops.softmax` for numerics, layouts and autocast).

``dim=None`` keeps torch's deprecated implicit choice, warning the same way:
dim 0 for 0-, 1- and 3-dimensional input, else dim 1. Like torch's modules
these compile with ``torch.compile(fullgraph=True)``; the warning is then
issued while tracing.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .op import log_softmax, softmax

__all__ = ["Softmax", "LogSoftmax"]


# Marked constant for torch.compile: dynamo runs it while tracing (the
# warning is issued then, once per compilation, as torch.nn.Softmax's is) and
# bakes in the dim, where a warnings.warn call in the traced forward broke
# the graph. The result depends only on the arguments, which are constants.
@torch.compiler.assume_constant_result
def implicit_dim(name: str, ndim: int, stacklevel: int) -> int:
    """torch.nn.functional's legacy rule for ``dim=None`` (with its warning)."""
    warnings.warn(
        f"Implicit dimension choice for {name} has been deprecated. Change the call to include dim=X as an argument.",
        UserWarning,
        stacklevel=stacklevel,
    )
    return 0 if ndim in (0, 1, 3) else 1


class _SoftmaxForward:
    """The forward both modules share; ``_log`` picks the function."""

    _log = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        name = "log_softmax" if self._log else "softmax"
        # stacklevel 5: implicit_dim <- forward <- _call_impl <- _wrapped_call_impl <- the caller
        dim = self.dim if self.dim is not None else implicit_dim(name, input.dim(), 5)
        return (log_softmax if self._log else softmax)(input, dim)


class Softmax(_SoftmaxForward, nn.Softmax):
    """``torch.nn.Softmax(dim=None)`` with fp32 accumulation and an
    output-only autograd record."""


class LogSoftmax(_SoftmaxForward, nn.LogSoftmax):
    """``torch.nn.LogSoftmax(dim=None)`` with fp32 accumulation and an
    output-only autograd record."""

    _log = True
