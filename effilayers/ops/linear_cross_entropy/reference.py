"""The unfused computation, written as the documented formula: the float64
oracle of the tests (differentiable with torch's autograd). It materialises
the whole ``(tokens, classes)`` logits, so it is never a fallback; the fused
op's fallback is the cross_entropy family's reference row kernel, reached
through the registry like its compiled kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(input, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                                   reduction="mean", class_weight=None, token_weight=None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, weight, bias), target, ...)`` with
    per-token weights ``s``, taking ``linear_cross_entropy``'s arguments
    (names and defaults) less its chunking ones::

        none: s_i * l_i        sum: sum_i s_i * l_i        mean: sum_i s_i * l_i / sum_i s_i * d_i

    where ``l_i`` is torch's unreduced loss of token ``i`` (class weights and
    label smoothing included) and ``d_i`` is what torch's mean divides by per
    token: ``class_weight[t_i]`` (1 without class weights) for class indices,
    0 for ignored tokens, and 1 for probability targets."""
    classes = weight.shape[0]
    logits = F.linear(input, weight, bias).reshape(-1, classes)
    soft = target.is_floating_point()
    rows_target = target.reshape(-1, classes) if soft else target.reshape(-1).long()
    rows = F.cross_entropy(logits, rows_target, weight=class_weight, ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction="none")
    if soft:
        divisor = torch.ones_like(rows)
    else:
        valid = rows_target != ignore_index
        safe = torch.where(valid, rows_target, 0)
        per_class = torch.ones_like(rows) if class_weight is None else class_weight.to(rows.dtype)[safe]
        divisor = torch.where(valid, per_class, 0.0)
    if token_weight is not None:
        scale = token_weight.reshape(-1).to(rows.dtype)
        rows = rows * scale
        divisor = divisor * scale
    if reduction == "none":
        return rows.reshape(input.shape[:-1])
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / divisor.sum()


# The fused path's two passes, whole: the oracle of their Triton kernels
# (ops/linear_cross_entropy/triton.py has the contracts) in the self-test.


def _logits_in_accumulation(x, w, b, acc):
    """F.linear's logits (rounded to the compute dtype as it returns them), widened."""
    return F.linear(x, w, b).to(acc)


def class_index_stats_reference(x, w, b, target, class_weight, smoothing):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = _logits_in_accumulation(x, w, b, acc)
    running_max = z.max(1).values
    sum_exp = torch.exp(z - running_max[:, None]).sum(1)
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == target[:, None]
    target_logit = torch.where(hit, z, 0.0).sum(1)
    smooth = torch.zeros_like(running_max)
    if smoothing:
        smooth = (z * (1.0 if class_weight is None else class_weight.to(acc))[None]).sum(1)
    return torch.stack((running_max, sum_exp, target_logit, smooth))


def class_index_grads_reference(x, w, b, target, class_term, row_terms, ignore_index, class_start, out):
    acc = row_terms.dtype
    stop = class_start + out.shape[1]
    z = _logits_in_accumulation(x, w[class_start:stop], None if b is None else b[class_start:stop], acc)
    lse, coef, target_coef, scale = row_terms
    g = coef[:, None] * torch.exp(z - lse[:, None])
    if class_term is not None:
        g = g - class_term[class_start:stop].to(acc)[None]
    hit = torch.arange(class_start, stop, device=z.device)[None, :] == target[:, None]
    g = torch.where(hit, g - target_coef[:, None], g)
    out.copy_(torch.where((target != ignore_index)[:, None], g * scale[:, None], 0.0))
