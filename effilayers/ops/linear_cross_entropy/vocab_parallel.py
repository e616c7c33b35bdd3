"""linear_cross_entropy with a weight sharded over the classes: a DTensor
``weight`` (and ``bias``) with placement ``Shard(0)`` on a 1-D device mesh,
every rank holding the same ``input`` and ``target``.

Each rank computes its slice of each chunk's logits (``x W_r^T + b_r``), and
the row statistics the loss needs are reduced across the mesh's process
group: the maximum (all-reduce MAX), the rescaled sum of exponentials, the
target's logit (found on the rank that owns the class) and, with label
smoothing, ``sum_c w_c z_c`` (one all-reduce SUM of the three), so every rank
gets the global log-sum-exp and the same loss. The logits' gradient is local
(``softmax - onehot`` on the rank's classes): grad_weight and grad_bias stay
sharded like the parameters, and grad_input, a sum over all classes, is
all-reduced once after the last chunk. Three collectives per chunk.

Each chunk's logits are computed in float32 (float64 for float64 input) and
handed to the cross_entropy family's vocabulary-chunk kernels, as
``vocab_chunks.py`` does on one rank: ``cross_entropy_chunk_stats_`` folds the
rank's classes into per-row statistics (its ``class_offset`` is the rank's
first class), which are then reduced across ranks, and
``cross_entropy_chunk_grad_`` writes the logits' gradient over them in place.
Chunk-sized buffers only, never the whole logits. Served here: class-index targets, ``ignore_index``,
``label_smoothing``, ``class_weight`` (the full ``(classes,)`` vector on every
rank), ``token_weight``, reductions ``"mean"`` and ``"sum"``. Every other case
(``reduction="none"``, probability targets, autocast, other placements such
as a weight sharded over the hidden dimension, meshes of more than one
dimension) gathers the weight and bias (``full_tensor()``, whose backward
shards the gradients back) and runs the ordinary chunked op.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..._core.dtypes import accumulation_dtype
from ..cross_entropy.op import chunk_grad_op, chunk_stats_op
from .contract import OP
from .vocab_chunks import class_index_loss, new_stats, smoothing_term


def is_sharded(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def runs_vocab_parallel(weight, bias, target, reduction, autocasting: bool) -> bool:
    """Whether this module's vocabulary-parallel loss serves the call: a
    weight sharded over the classes (``Shard(0)`` on a 1-D mesh), a bias
    sharded the same way or None, class-index targets, ``"mean"``/``"sum"``,
    no autocast. Anything else gathers the parameters (the caller)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        return False
    if bias is not None and (not isinstance(bias, DTensor) or tuple(bias.placements) != (Shard(0),)
                             or bias.device_mesh != weight.device_mesh):
        return False
    return reduction != "none" and not target.is_floating_point() and not autocasting


def _class_offset(rows: int, group) -> int:
    """The first class this rank owns: the row counts of the lower ranks."""
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, torch.tensor([rows]), group=group)
    return int(sum(int(c) for c in counts[:dist.get_rank(group)]))


class _VocabParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, target, class_weight, token_weight, settings):
        ignore_index, eps, reduction, step, grad_mode, group, offset, classes = settings
        needs = tuple(bool(ctx.needs_input_grad[i] and grad_mode) for i in range(3))
        tokens, hidden = input.shape
        local_classes = weight.shape[0]
        acc = accumulation_dtype(input.dtype)
        device = input.device
        valid_all = target != ignore_index
        w_all = None if class_weight is None else class_weight.to(acc)
        per_token = valid_all.to(acc) if w_all is None else w_all[torch.where(valid_all, target, 0)] * valid_all
        if token_weight is not None:
            per_token = per_token * token_weight.to(acc)
        total = per_token.sum()
        scale = (torch.where(total == 0, math.nan, 1.0 / total) if reduction == "mean"
                 else torch.ones((), dtype=acc, device=device))
        w_local = None if w_all is None else w_all[offset:offset + local_classes]
        grad_input = torch.zeros((tokens, hidden), dtype=acc, device=device) if needs[0] else None
        grad_weight = torch.zeros((local_classes, hidden), dtype=acc, device=device) if needs[1] else None
        grad_bias = torch.zeros((local_classes,), dtype=acc, device=device) if needs[2] else None
        loss_sum = torch.zeros((), dtype=acc, device=device)
        w_acc = weight.to(acc)
        smoothing = eps > 0
        stats_kernel = chunk_stats_op
        grad_kernel = chunk_grad_op
        class_term = None
        if smoothing and any(needs):
            class_term = smoothing_term(w_local, eps, classes, acc, device, count=local_classes)
        for start in range(0, tokens, step):
            stop = min(start + step, tokens)
            x = input[start:stop].to(acc)
            z = x @ w_acc.t()
            if bias is not None:
                z += bias.to(acc)
            t = target[start:stop]
            valid = t != ignore_index
            # This rank's classes: running maximum, rescaled sum of
            # exponentials, the target's logit where this rank owns it (0
            # elsewhere) and the smoothing sum; ignored rows keep -inf, 0, 0, 0.
            stats = new_stats(stop - start, acc, device)
            stats_kernel(z, t, w_local if smoothing else None, stats, offset, ignore_index, smoothing)
            local_max = stats[0]
            row_max = local_max.clone()
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            # Equal maxima (-inf on every rank included) keep the sum: exp(-inf - -inf) would be NaN.
            stats[1] = torch.where(local_max == row_max, stats[1], stats[1] * torch.exp(local_max - row_max))
            sums = stats[1:]
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            sum_exp, z_t, sum_wz = sums
            lse = row_max + torch.log(sum_exp)
            safe_t = torch.where(valid, t, 0)
            w_t = torch.ones_like(lse) if w_all is None else w_all[safe_t]
            rows, coef = class_index_loss(lse, z_t, sum_wz, w_t, w_all, eps, classes)
            rows = torch.where(valid, rows, 0.0)
            tw = None if token_weight is None else token_weight[start:stop].to(acc)
            loss_sum += (rows if tw is None else rows * tw).sum()
            if not any(needs):
                continue
            row_scale = (scale if tw is None else scale * tw).expand(stop - start)
            grad_kernel(z, t, class_term, torch.stack((lse, coef, (1 - eps) * w_t, row_scale)), offset, ignore_index)
            if needs[0]:
                grad_input[start:stop] = z @ w_acc
            if needs[1]:
                grad_weight.addmm_(z.t(), x)
            if needs[2]:
                grad_bias += z.sum(0)
        if needs[0]:
            dist.all_reduce(grad_input, op=dist.ReduceOp.SUM, group=group)
        loss = loss_sum / total if reduction == "mean" else loss_sum
        ctx.needs = needs
        ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
        empty = input.new_empty((0,), dtype=acc)
        ctx.save_for_backward(*(empty if g is None else g for g in (grad_input, grad_weight, grad_bias)))
        return loss.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():
            raise RuntimeError(f"effilayers {OP}: double backward is not supported")
        grads = []
        for needed, saved, dtype in zip(ctx.needs, ctx.saved_tensors, ctx.dtypes):
            grads.append((saved * grad_output).to(dtype) if needed else None)
        return (*grads, None, None, None, None)


def vocab_parallel_linear_cross_entropy(input, weight, target, bias, ignore_index, label_smoothing, reduction,
                                        class_weight, token_weight, chunk_size, chunk_tokens):
    """``input`` (tokens, hidden) and ``target`` (tokens,) are the same on every
    rank; ``weight`` / ``bias`` are DTensors sharded over the classes."""
    group = weight.device_mesh.get_group()
    local_weight = weight.to_local()  # differentiable: its gradient comes back as a DTensor, sharded alike
    local_bias = None if bias is None else bias.to_local()
    classes = weight.shape[0]
    offset = _class_offset(local_weight.shape[0], group)
    acc_size = torch.empty((), dtype=accumulation_dtype(input.dtype)).element_size()
    step = chunk_tokens(input.shape[0], max(local_weight.shape[0], 1), acc_size, input.numel() * input.element_size(),
                        chunk_size)
    settings = (int(ignore_index), float(label_smoothing), reduction, step, torch.is_grad_enabled(), group, offset,
                classes)
    return _VocabParallelFunction.apply(input, local_weight, local_bias, target.reshape(-1).to(torch.int64),
                                        class_weight, token_weight, settings)
