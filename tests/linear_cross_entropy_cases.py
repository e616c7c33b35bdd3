"""What the linear_cross_entropy test files share: a random problem, the
unfused torch computation in float64, ours, and their comparison."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from effilayers.functional import linear_cross_entropy

from .accuracy import assert_close


class LargestTemporary(TorchDispatchMode):
    """The bytes of the largest tensor any op allocates while active, leaving
    out tensors of the ``left_out`` shapes (e.g. weight-shaped gradient
    accumulators, which grow with the vocabulary whatever the chunks), and
    everything while ``paused`` is set (under the interpreter, the tests'
    guard bands copy a Triton launch's arguments with torch ops). ``peak``:
    the most bytes of the storages allocated while active that were alive at
    once (each storage counted until it is freed), the CPU stand-in for
    ``max_memory_allocated`` above what was held before."""

    def __init__(self, left_out=()):
        super().__init__()
        self.left_out, self.largest, self.paused = set(left_out), 0, False
        self.live = self.peak = 0
        self._counted = set()

    def _count(self, storage):
        key = storage.data_ptr()
        if key in self._counted or storage.nbytes() == 0:
            return
        self._counted.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, storage.nbytes())

    def _release(self, key, nbytes):
        self._counted.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        # A view (a slice of the caller's targets) or an out= result allocates nothing.
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._count(t.untyped_storage())
                if tuple(t.shape) not in self.left_out:
                    self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def make_problem(batch_shape, hidden, classes, dtype, device="cpu", seed=0, bias=True, ignore_every=0,
                 ignore_index=-100):
    """(input, weight, bias, target): input of varied magnitudes, logits of
    order 1-10, class-index targets with every ``ignore_every``-th ignored."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch_shape, hidden, generator=generator, dtype=torch.float64) * 1.5 + 0.25
    w = torch.randn(classes, hidden, generator=generator, dtype=torch.float64) / hidden ** 0.5 * 2.0
    b = torch.randn(classes, generator=generator, dtype=torch.float64) if bias else None
    target = torch.randint(0, classes, batch_shape, generator=generator)
    if ignore_every:
        target.view(-1)[::ignore_every] = ignore_index
    cast = lambda t: None if t is None else t.to(dtype=dtype, device=device)  # noqa: E731
    return cast(x), cast(w), cast(b), target.to(device)


def grad_output_for(loss_shape, reduction, device, dtype=torch.float64):
    """A varied, mixed-sign grad_output for reduction="none" (None for the reduced losses)."""
    return make_positive(loss_shape, device, seed=9, dtype=dtype) - 0.6 if reduction == "none" else None


def make_positive(shape, device="cpu", seed=5, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=generator, dtype=torch.float64) + 0.25).to(dtype=dtype, device=device)


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def _grads(loss, tensors, grad_output):
    wanted = [t for t in tensors if t is not None]
    grads = iter(torch.autograd.grad(loss, wanted, grad_output))
    return [None if t is None else next(grads) for t in tensors]


def unfused(x, w, b, target, grad_output=None, *, class_weight=None, **kwargs):
    """torch's F.linear + F.cross_entropy in float64 from the same (rounded)
    values: (loss, [grad_input, grad_weight, grad_bias])."""
    x, w, b = _leaves(*(None if t is None else t.double() for t in (x, w, b)))
    if target.is_floating_point():
        target = target.double()
    logits = F.linear(x, w, b)
    classes = w.shape[0]
    loss = F.cross_entropy(logits.reshape(-1, classes),
                           target.reshape(-1, classes) if target.is_floating_point() else target.reshape(-1),
                           weight=None if class_weight is None else class_weight.double(), **kwargs)
    if kwargs.get("reduction") == "none":
        loss = loss.reshape(x.shape[:-1])
    grad_output = torch.ones_like(loss) if grad_output is None else grad_output.double()
    return loss.detach(), _grads(loss, (x, w, b), grad_output)


def fused(x, w, b, target, grad_output=None, **kwargs):
    """Ours: (loss, [grad_input, grad_weight, grad_bias])."""
    x, w, b = _leaves(x, w, b)
    loss = linear_cross_entropy(x, w, target, b, **kwargs)
    grad_output = torch.ones_like(loss) if grad_output is None else grad_output
    return loss.detach(), _grads(loss, (x, w, b), grad_output)


def assert_same(actual, expected, dtype, tier="default", grad_tier=None):
    """Loss at ``tier``, gradients at ``grad_tier`` (default: ``tier``); the
    dtypes of ours are those of the inputs (checked by the caller)."""
    (loss, grads), (exp_loss, exp_grads) = actual, expected
    assert loss.shape == exp_loss.shape
    assert_close(loss.double(), exp_loss, dtype, equal_nan=True)
    for got, want, name in zip(grads, exp_grads, ("input", "weight", "bias")):
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.shape == want.shape, name
            assert_close(got.double(), want, dtype, grad_tier or tier, msg=lambda m, n=name: f"grad {n}: {m}")
