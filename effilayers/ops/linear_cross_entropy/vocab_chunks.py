"""One chunk of tokens against a vocabulary too wide to hold whole: the
classes are walked in chunks twice.

First pass: each vocabulary chunk's logits ``x W_v^T + b_v`` (in the compute
dtype, as ``F.linear`` rounds them), widened to the accumulation dtype, feed
an online log-sum-exp (a running maximum ``m`` and a running sum
``s = sum exp(z - m)``, rescaled by ``exp(m_old - m_new)`` when the maximum
grows) and the sums the loss needs: the target's logit and, with label
smoothing, ``sum_c w_c z_c`` (class indices), or ``sum_c q_c`` and
``sum_c q_c z_c`` (probability targets ``q``, smoothed and class-weighted).
Second pass (when a gradient is wanted): each chunk's logits are recomputed
and its slice of d loss / d logits, ``coef * softmax - (the target's and the
smoothing's share)``, is formed in the accumulation dtype and added into
grad_input (a float32 sum over the vocabulary chunks, cast once per token
chunk), grad_weight and grad_bias (the caller's float32 accumulators).

No row kernel takes an external log-sum-exp, so both passes are torch ops on
chunk-sized tensors (as ``vocab_parallel.py`` does across ranks).
"""

from __future__ import annotations

import torch

# Bytes a vocabulary chunk holds per logit beyond the compute-dtype logits:
# its float32 copy and two float32 temporaries (exp / the gradient).
VOCAB_TEMPORARIES = 3


def accumulate_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b with the product kept in ``out``'s dtype (never rounded to
    fp16/bf16). On CPU, which has no mixed-dtype GEMM, ``a`` arrives already in
    ``out``'s dtype and ``b`` is widened."""
    if a.dtype == out.dtype:
        out.addmm_(a, b.to(out.dtype))
    else:
        # cuBLAS's fp16/bf16 GEMM with a float32 output.
        out.add_(torch.mm(a, b, out_dtype=out.dtype))


def _logits(x, w, b, start, stop, acc):
    z = torch.mm(x, w[start:stop].t()) if b is None else torch.addmm(b[start:stop], x, w[start:stop].t())
    return z.to(acc)


def _smoothed(probs, start, stop, class_weight, eps, classes, acc):
    """The probability targets' slice as torch weighs them: smoothed, then class-weighted."""
    q = probs[:, start:stop].to(acc)
    if eps > 0:
        q = q * (1.0 - eps) + eps / classes
    return q if class_weight is None else q * class_weight[start:stop]


def vocab_chunked_rows(x, w, b, target, class_weight, ignore_index, eps, grad_scale, row_scale, needs, step, acc,
                       grad_input, grad_weight, grad_bias):
    """Loss rows (accumulation dtype) of one token chunk ``x`` (compute
    dtype), walking the classes ``step`` at a time. When a gradient is wanted,
    writes ``grad_input`` (this chunk's rows, any dtype) and adds into
    ``grad_weight`` / ``grad_bias`` (accumulation dtype), the logits'
    gradient scaled by ``grad_scale`` (1 element) and ``row_scale`` (per row or
    None). ``acc``: the accumulation dtype (``accumulation_dtype`` of the
    compute dtype); ``class_weight``: None or in it."""
    rows_n, classes = x.shape[0], w.shape[0]
    device = x.device
    soft = target.is_floating_point()
    m = torch.full((rows_n,), -torch.inf, dtype=acc, device=device)
    s = torch.zeros(rows_n, dtype=acc, device=device)
    linear = torch.zeros(rows_n, dtype=acc, device=device)  # z_t, or sum_c q_c z_c
    smooth = torch.zeros(rows_n, dtype=acc, device=device)  # sum_c w_c z_c, or sum_c q_c
    if not soft:
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        # On GPU nothing checked the range (a host check would synchronise):
        # such a row's loss and gradient are NaN, as the row kernels make them.
        out_of_range = valid & ((safe < 0) | (safe >= classes))
        safe = safe.clamp(0, classes - 1)
    for start in range(0, classes, step):
        stop = min(start + step, classes)
        z = _logits(x, w, b, start, stop, acc)
        new_m = torch.maximum(m, z.amax(1))
        # Equal maxima (-inf included) keep s as it is, where exp(-inf - -inf) would be NaN.
        s = torch.where(new_m == m, s, s * torch.exp(m - new_m)) + torch.exp(z - new_m[:, None]).sum(1)
        m = new_m
        if soft:
            q = _smoothed(target, start, stop, class_weight, eps, classes, acc)
            smooth += q.sum(1)
            linear += (q * z).sum(1)
            continue
        here = valid & ~out_of_range & (safe >= start) & (safe < stop)
        linear += torch.where(here, z.gather(1, (safe - start).clamp(0, stop - start - 1)[:, None])[:, 0], 0.0)
        if eps > 0:
            smooth += z.sum(1) if class_weight is None else z @ class_weight[start:stop]
    lse = m + torch.log(s)
    if soft:
        rows = smooth * lse - linear
    else:
        w_t = torch.ones_like(lse) if class_weight is None else class_weight[safe]
        rows = (1.0 - eps) * w_t * (lse - linear)
        if eps > 0:
            sum_w = float(classes) if class_weight is None else class_weight.sum()
            rows = rows + eps / classes * (sum_w * lse - smooth)
            coef = (1.0 - eps) * w_t + eps / classes * sum_w
        else:
            coef = w_t
        rows = torch.where(valid, torch.where(out_of_range, torch.nan, rows), 0.0)
    if not any(needs):
        return rows
    scale = grad_scale if row_scale is None else grad_scale * row_scale
    scale = scale.expand(rows_n)
    if not soft:
        scale = torch.where(out_of_range, torch.nan, scale)
    scale = scale[:, None]
    gi = torch.zeros((rows_n, x.shape[1]), dtype=acc, device=device) if needs[0] else None
    wide_x = x.to(acc) if needs[1] and device.type != "cuda" else x
    for start in range(0, classes, step):
        stop = min(start + step, classes)
        z = _logits(x, w, b, start, stop, acc)
        softmax = torch.exp(z - lse[:, None])
        if soft:
            g = softmax * smooth[:, None] - _smoothed(target, start, stop, class_weight, eps, classes, acc)
            g = g * scale
        else:
            g = softmax * coef[:, None]
            if eps > 0:
                g -= eps / classes * (1.0 if class_weight is None else class_weight[start:stop])
            here = valid & ~out_of_range & (safe >= start) & (safe < stop)
            g.scatter_add_(1, (safe - start).clamp(0, stop - start - 1)[:, None],
                           torch.where(here, -(1.0 - eps) * w_t, 0.0)[:, None])
            # A select, not a product: an ignored row gives 0 even where the scale is NaN or inf.
            g = torch.where(valid[:, None], g * scale, 0.0)
        if device.type == "cuda" and x.dtype != acc:
            g = g.to(x.dtype)  # the GEMMs read fp16/bf16 and write float32
        if needs[0]:
            accumulate_product(gi, g, w[start:stop])
        if needs[1]:
            accumulate_product(grad_weight[start:stop], g.t(), wide_x)
        if needs[2]:
            grad_bias[start:stop] += g.sum(0, dtype=acc)
    if needs[0]:
        grad_input.copy_(gi)
    return rows
