"""The self-test's inputs for the cross_entropy ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

import torch

from ..._core.selftest import LONG_ROW, Case, f32, positive, randn


def _cross_entropy(device, dtype, g):
    logits = randn((4, 11, 3), g, dtype, device, 3.0)
    target = torch.randint(0, 11, (12,), generator=g).to(device)
    target[5] = -100  # an ignored row
    weight = positive((11,), g, device)
    long_logits = randn((3, LONG_ROW, 1), g, dtype, device, 3.0)
    long_target = torch.tensor([5, LONG_ROW - 1, -100], device=device)
    return [(logits, target, weight, torch.empty_like(logits), torch.tensor([0.125], device=device), -100, 0.1),
            (long_logits, long_target, positive((LONG_ROW,), g, device), torch.empty_like(long_logits),
             torch.tensor([0.5], device=device), -100, 0.1)]


def _chunk_rows(device, dtype, g):
    """A (rows, classes) vocabulary chunk at class 4, classes contiguous and
    rows a gap apart, with its targets: in the chunk, ignored, elsewhere."""
    chunk = randn((5, 13), g, dtype, device, 3.0)[:, :11]
    target = torch.tensor([6, -100, 14, 1, 4], device=device)
    return chunk, target


def _cross_entropy_chunk_stats(device, dtype, g):
    chunk, target = _chunk_rows(device, dtype, g)
    stats = torch.stack([randn((5,), g, f32, device), positive((5,), g, device), torch.zeros(5, device=device),
                         randn((5,), g, f32, device)])
    return [(chunk, target, positive((11,), g, device), stats, 4, -100, True),
            (chunk, target, None, stats, 4, -100, False)]


def _cross_entropy_chunk_grad(device, dtype, g):
    chunk, target = _chunk_rows(device, dtype, g)
    lse = torch.logsumexp(chunk.float(), 1) + 0.5
    row_terms = torch.stack([lse, positive((5,), g, device), positive((5,), g, device), positive((5,), g, device)])
    return [(chunk, target, positive((11,), g, device, 0.001, 0.01), row_terms, 4, -100),
            (chunk, target, None, row_terms, 4, -100)]


def _soft_chunk(device, dtype, g):
    """A chunk as _chunk_rows gives, probability rows over its classes (a
    gap between rows too) in the logits' dtype and in float32, and the two
    per-class vectors."""
    chunk, _ = _chunk_rows(device, dtype, g)
    probs = torch.softmax(randn((5, 12), g, f32, device, 2.0), 1)[:, :11]
    prob_weight, class_term = positive((11,), g, device), positive((11,), g, device, 0.001, 0.01)
    return chunk, (probs.to(dtype), probs), prob_weight, class_term


def _cross_entropy_soft_chunk_stats(device, dtype, g):
    chunk, probs, prob_weight, class_term = _soft_chunk(device, dtype, g)
    stats = torch.stack([randn((5,), g, f32, device), positive((5,), g, device), randn((5,), g, f32, device),
                         positive((5,), g, device)])
    return [(chunk, probs[0], prob_weight, class_term, stats), (chunk, probs[1], None, None, stats)]


def _cross_entropy_soft_chunk_grad(device, dtype, g):
    chunk, probs, prob_weight, class_term = _soft_chunk(device, dtype, g)
    lse = torch.logsumexp(chunk.float(), 1) + 0.5
    row_terms = torch.stack([lse, positive((5,), g, device), positive((5,), g, device)])
    return [(chunk, probs[0], prob_weight, class_term, row_terms), (chunk, probs[1], None, None, row_terms)]


CASES = {
    "cross_entropy": Case(_cross_entropy),
    "cross_entropy_chunk_stats_": Case(_cross_entropy_chunk_stats),
    "cross_entropy_chunk_grad_": Case(_cross_entropy_chunk_grad),
    "cross_entropy_soft_chunk_stats_": Case(_cross_entropy_soft_chunk_stats),
    "cross_entropy_soft_chunk_grad_": Case(_cross_entropy_soft_chunk_grad),
}
