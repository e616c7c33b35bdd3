"""The row-wise cross-entropy kernel in PyTorch ops: the fallback and, on
float64 logits, the test oracle. Same arguments as the compiled kernels."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..._core.dtypes import accumulation_dtype

# The reference converts at most this many logits to float32 at a time
# (2**16 values = 256 KiB per temporary; a handful of temporaries of that size
# live at once), so its float32 working set is bounded whatever the
# vocabulary size, as the kernels' is.
REFERENCE_CHUNK_ELEMENTS = 1 << 16


def cross_entropy_rows_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],
    grad: Optional[torch.Tensor],
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Per-row losses of an ``(N, C, I)`` logits view; writes the scaled
    gradient into ``grad`` (an ``(N, C, I)`` view, possibly the logits
    themselves) when it is given.

    ``target``: ``(N * I,)`` int64, row ``n * I + i``. ``grad_scale``: a
    1-element tensor multiplying the gradient (``1 / sum(w[t])`` for a mean).
    Returns ``(N * I,)`` losses in the accumulation dtype: 0 for ignored rows,
    NaN for rows whose target is out of range. Works on chunks of at most
    ``REFERENCE_CHUNK_ELEMENTS`` logits (never fewer than one row), so the
    float32 temporaries stay small.
    """
    n_outer, classes, n_inner = logits.shape
    acc = accumulation_dtype(logits.dtype)
    loss_rows = torch.empty(n_outer * n_inner, dtype=acc, device=logits.device)
    losses = loss_rows.view(n_outer, n_inner)
    targets = target.view(n_outer, n_inner)
    eps = float(label_smoothing)
    w_all = None if weight is None else weight.to(acc).view(1, classes, 1)
    scale = grad_scale.reshape(()).to(acc)
    if classes == 0:  # nothing to read or write: ignored rows 0, the rest have no valid target
        loss_rows.copy_(torch.where(target == ignore_index, 0.0, math.nan))
        return loss_rows
    if loss_rows.numel() == 0:  # no rows ((0, C, I) or (N, C, 0)): no chunk to size
        return loss_rows
    fits = classes * n_inner <= REFERENCE_CHUNK_ELEMENTS
    inner_block = n_inner if fits else max(1, REFERENCE_CHUNK_ELEMENTS // classes)
    outer_block = max(1, REFERENCE_CHUNK_ELEMENTS // (classes * inner_block))
    for n0 in range(0, n_outer, outer_block):
        n1 = min(n0 + outer_block, n_outer)
        for i0 in range(0, n_inner, inner_block):
            i1 = min(i0 + inner_block, n_inner)
            x = logits[n0:n1, :, i0:i1].to(acc)  # (nb, C, ib): the bounded fp32 temporary
            t = targets[n0:n1, i0:i1]
            valid = t != ignore_index
            in_range = (t >= 0) & (t < classes)
            bad = valid & ~in_range
            t_safe = torch.where(valid & in_range, t, torch.zeros_like(t)).unsqueeze(1)
            row_max = x.amax(dim=1, keepdim=True)
            # A row of -inf has no finite maximum; shifting by 0 keeps exp() at 0.
            shift = torch.where(row_max == -math.inf, torch.zeros_like(row_max), row_max)
            exp = torch.exp(x - shift)
            lse = shift + torch.log(exp.sum(dim=1, keepdim=True))
            x_t = x.gather(1, t_safe)
            w_t = torch.ones_like(x_t) if w_all is None else w_all.view(-1)[t_safe]
            loss = (1.0 - eps) * w_t * (lse - x_t)
            if eps > 0.0:
                if w_all is None:
                    smooth = classes * lse - x.sum(dim=1, keepdim=True)
                    coef = torch.ones_like(w_t)
                else:
                    total_w = w_all.sum()
                    smooth = total_w * lse - (x * w_all).sum(dim=1, keepdim=True)
                    coef = (1.0 - eps) * w_t + eps / classes * total_w
                loss = loss + eps / classes * smooth
            else:
                coef = w_t
            loss = loss.squeeze(1)
            loss = torch.where(valid, loss, torch.zeros_like(loss))
            losses[n0:n1, i0:i1] = torch.where(bad, torch.full_like(loss, math.nan), loss)
            if grad is None:
                continue
            softmax = torch.exp(x - lse)
            g = coef * softmax
            if eps > 0.0:
                g = g - eps / classes * (1.0 if w_all is None else w_all)
            g.scatter_add_(1, t_safe, -(1.0 - eps) * w_t)
            g = g * scale
            g = torch.where(valid.unsqueeze(1), g, torch.zeros_like(g))
            g = torch.where(bad.unsqueeze(1), torch.full_like(g, math.nan), g)
            grad[n0:n1, :, i0:i1] = g.to(grad.dtype)
    return loss_rows


def _fold_online(stats, z, valid):
    """Folds the chunk ``z`` (accumulation dtype) into the running maximum
    ``stats[0]`` and ``stats[1] = sum exp(z - maximum)`` of the rows where
    ``valid`` (every row when None)."""
    m, s = stats[0], stats[1]
    new_m = torch.maximum(m, z.amax(1))
    if valid is not None:
        new_m = torch.where(valid, new_m, m)
    # Equal maxima (-inf included) keep s as it is, and a maximum of -inf
    # shifts by 0 (every exp is 0): exp(-inf - -inf) would be NaN.
    rescaled = torch.where(new_m == m, s, s * torch.exp(m - new_m))
    shift = torch.where(new_m == -math.inf, 0.0, new_m)
    folded = rescaled + torch.exp(z - shift[:, None]).sum(1)
    s.copy_(folded if valid is None else torch.where(valid, folded, s))
    m.copy_(new_m)


def cross_entropy_chunk_stats_reference(logits, target, weight, stats, class_offset, ignore_index, smoothing):
    """One vocabulary chunk's share of the online statistics of its rows.

    ``logits``: ``(rows, classes)``, classes ``class_offset`` to
    ``class_offset + classes`` of each row; ``weight``: None or those
    classes' weights (the accumulation dtype). ``stats``: ``(4, rows)`` in
    the accumulation dtype, updated in place: the running maximum ``m``, the
    sum ``sum exp(z - m)`` (rescaled when ``m`` grows), the target's logit
    (written by the chunk holding it) and, when ``smoothing``, ``+=
    sum_c w_c z_c`` (``w_c = 1`` without weights). Rows whose target is
    ``ignore_index`` are left as they are."""
    acc = stats.dtype
    z = logits.to(acc)
    valid = target != ignore_index
    _fold_online(stats, z, valid)
    local = target - class_offset
    here = valid & (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp(0, max(z.shape[1] - 1, 0))[:, None])[:, 0]
    stats[2].copy_(torch.where(here, picked, stats[2]))
    if smoothing:
        weighted = z.sum(1) if weight is None else z @ weight.to(acc)
        stats[3].add_(torch.where(valid, weighted, 0.0))


def cross_entropy_chunk_grad_reference(logits, target, class_term, row_terms, class_offset, ignore_index):
    """Writes one vocabulary chunk's d loss / d logits over ``logits``
    (``(rows, classes)``, classes from ``class_offset``): for row ``r``,
    ``scale * (coef * exp(z_c - lse) - class_term_c - target_coef * [c == t])``
    with ``lse, coef, target_coef, scale = row_terms[:, r]``; 0 on rows whose
    target is ``ignore_index`` (a select: 0 even where the scale is NaN)."""
    acc = row_terms.dtype
    lse, coef, target_coef, scale = row_terms[:, :, None]
    g = coef * torch.exp(logits.to(acc) - lse)
    if class_term is not None:
        g = g - class_term.to(acc)
    columns = torch.arange(logits.shape[1], device=logits.device)
    g = torch.where(columns == (target - class_offset)[:, None], g - target_coef, g)
    logits.copy_(torch.where((target != ignore_index)[:, None], g * scale, 0.0))


def _target_weights(probs, prob_weight, class_term, acc):
    """What a probability target weighs each logit's ``lse - z_c`` by:
    ``q_c = p_c * prob_weight_c + class_term_c`` (label smoothing and class
    weights folded into the two per-class vectors by the caller)."""
    q = probs.to(acc)
    if prob_weight is not None:
        q = q * prob_weight.to(acc)
    return q if class_term is None else q + class_term.to(acc)


def cross_entropy_soft_chunk_stats_reference(logits, probs, prob_weight, class_term, stats):
    """One chunk's share of the online statistics of rows with probability
    targets. ``logits`` and ``probs``: ``(rows, classes)`` (the same
    classes); ``prob_weight`` and ``class_term``: None or those classes'
    ``(classes,)`` values in the accumulation dtype. ``stats``: ``(4, rows)``
    in the accumulation dtype, updated in place: the running maximum, the
    rescaled ``sum exp(z - maximum)``, ``+= sum_c q_c z_c`` and ``+= sum_c q_c``
    (``q``: :func:`_target_weights`). A row's loss is then
    ``stats[3] * lse - stats[2]``."""
    acc = stats.dtype
    z = logits.to(acc)
    _fold_online(stats, z, None)
    q = _target_weights(probs, prob_weight, class_term, acc)
    stats[2].add_((q * z).sum(1))
    stats[3].add_(q.sum(1))


def cross_entropy_soft_chunk_grad_reference(logits, probs, prob_weight, class_term, row_terms):
    """Writes one chunk's d loss / d logits for probability targets over
    ``logits``: ``scale * (mass * exp(z_c - lse) - q_c)`` with ``lse, mass,
    scale = row_terms[:, r]`` (``(3, rows)``, the accumulation dtype; ``mass
    = sum_c q_c`` over the whole row)."""
    acc = row_terms.dtype
    lse, mass, scale = row_terms[:, :, None]
    q = _target_weights(probs, prob_weight, class_term, acc)
    logits.copy_((mass * torch.exp(logits.to(acc) - lse) - q) * scale)
