"""Triton kernel for the row-wise cross-entropy (``cross_entropy_rows``).

One program per row of the ``(N, C, I)`` logits view (row ``r = n * I + i``,
its C values ``class_stride`` apart). A row of up to ``MAX_FUSED_BLOCK``
classes is loaded once into registers (``SINGLE``): its maximum, sum of
``exp``, loss and gradient all come from that one read. A longer row is read
in blocks of ``BLOCK`` classes, so any vocabulary size runs with a fixed
register footprint:

* pass 1: online maximum and rescaled sum of ``exp`` in float32 (float64 for
  float64 logits), plus ``sum_c w_c x_c`` and ``sum_c w_c`` when label
  smoothing needs them -> the row's log-sum-exp and loss;
* pass 2 (only when a gradient is wanted): reads each block again and stores
  the reduction-scaled gradient in the gradient's dtype.

``grad`` may be the logits themselves (``inplace_backward``): every element
is loaded before the same program stores over it, and rows never share
elements. The second read of a long row is the one byte count above the
roofline left in this kernel (``bytes_per_element``): a 131,072-class row
is 256 KiB in bf16, more than one program's registers can hold. Offsets
are int64 (``row * stride`` passes 2**31 for 16K x 128K logits). A target
that is neither ``ignore_index`` nor in ``[0, C)`` makes the row's loss and
gradient NaN instead of a device assert or a host check (which would
synchronise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._core import tuning
from ..._core.dtypes import accumulation_dtype
from ..._core.kernel_spec import KernelSpec
from .._row_split import SPIN, spin, split_buffers, split_count, split_piece, wait_for_pieces

# Classes per block. 4096 fp32 values over 8 warps is 16 per thread for each
# live vector (x, exp, gradient): enough loads in flight to saturate memory
# bandwidth without spilling registers. Rows shorter than that use the next
# power of two. Tests lower MAX_BLOCK to run the multi-block loop under the
# interpreter on small rows. Its registers and spills per target are what
# `python -m effilayers.info --kernels` reports. Not yet tuned on a GPU:
# 16 warps, or a larger block, are the first things to try.
MAX_BLOCK = 4096
# Longest row the rows kernel holds in registers whole (SINGLE): 32768
# float32 values over 32 warps is 32 per thread, as softmax's
# MAX_FUSED_BLOCK, so the gradient is written from the values the loss was
# computed from and each logit is read once.
MAX_FUSED_BLOCK = 32768
# Rows with a gradient longer than that: pieces of SPLIT_BLOCK classes, one
# program each (16 warps, 32 values per thread), which exchange their
# partial statistics (ops/_row_split.py) and write the gradient of what
# they hold, each logit read once. Tuned configurations without "split", and
# rows of more than MAX_SPLITS pieces, walk the row in one program.
SPLIT_BLOCK = 16384


def _block_and_warps(classes: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(classes, 1)), MAX_BLOCK)
    # One warp per 512 classes, 1 to 8: short rows need few threads, and a
    # 4096-wide block keeps 16 values per thread at 8 warps.
    warps = max(1, min(8, block // 512))
    return block, warps


def _rows_block_and_warps(classes: int) -> tuple[int, int]:
    """The rows kernel's heuristic: the whole row in one block up to
    MAX_FUSED_BLOCK (beyond 4096 classes one warp per 1024, at most 32: 32
    values per thread), else _block_and_warps' walking block."""
    whole = triton.next_power_of_2(max(classes, 1))
    if whole <= min(MAX_BLOCK, MAX_FUSED_BLOCK) or whole > MAX_FUSED_BLOCK:
        return _block_and_warps(classes)
    return whole, max(8, min(32, whole // 1024))


def _rows_launcher(write_grad: bool) -> str:
    return "rows_grad" if write_grad else "rows_loss"


def _rows_config(logits: torch.Tensor, write_grad: bool) -> dict:
    """The tuned configuration of ``cross_entropy_rows_triton`` for these
    logits (``_core/tuning.py``), else ``_block_and_warps``. Any block is
    correct: the row is walked in blocks whatever their width. (The
    vocabulary-chunk launchers below are linear_cross_entropy's and keep
    the heuristic.)"""
    classes = logits.shape[1]
    launcher = _rows_launcher(write_grad)
    found = tuning.lookup("cross_entropy", logits.device, launcher, logits.dtype, classes)
    config = found if found is not None else _rows_heuristic(classes, write_grad, logits.element_size())
    tuning.note("cross_entropy", launcher, logits.dtype, (classes,), config, found is not None)
    return config


def _rows_heuristic(classes: int, write_grad: bool, element_size: int) -> dict:
    """With a gradient, a row longer than MAX_FUSED_BLOCK is cut into
    SPLIT_BLOCK-wide pieces, one program each (``split``: each logit read
    once); the loss alone reads each logit once walking the row. Short rows
    held whole come several to a program (``ROWS``, tuning.rows_per_program),
    with a warp per 1024 values of the block as the whole rows above take."""
    block, warps = _rows_block_and_warps(classes)
    if write_grad and classes > block and split_count(classes, SPLIT_BLOCK, 1):
        return {"BLOCK": SPLIT_BLOCK, "num_warps": max(4, min(32, SPLIT_BLOCK // 1024)), "split": True}
    rows = tuning.rows_per_program(block, element_size) if classes <= block else 1
    if rows == 1:
        return {"BLOCK": block, "num_warps": warps}
    return {"BLOCK": block, "num_warps": max(warps, min(32, block * rows // 1024)), "ROWS": rows}


def _row_grid(config: dict, classes: int, rows: int, device: torch.device) -> tuple[bool, int, bool, int]:
    """(SINGLE, ROWS, PERSISTENT, programs) of the rows kernel's launch."""
    single = classes <= config["BLOCK"]
    return (single, *tuning.row_grid(config, single, rows, device))


def tuning_candidates(launcher: str, sizes: tuple[int, ...], dtype: torch.dtype) -> list[dict]:
    """What benchmarks/tune.py times for ``cross_entropy_rows_triton``: the
    heuristic and its neighbours (block halved or doubled, up to the row;
    warps halved or doubled; 1 or 2 stages where the block loops; rows per
    program halved or doubled and a persistent grid where rows are held
    whole)."""
    (classes,) = sizes
    heuristic = _rows_heuristic(classes, launcher == _rows_launcher(True), dtype.itemsize)
    block, warps = heuristic["BLOCK"], heuristic["num_warps"]
    variations = {"BLOCK": [b for b in (block // 2, block * 2) if 256 <= b <= triton.next_power_of_2(classes)],
                  "num_warps": [w for w in (warps // 2, warps * 2) if 1 <= w <= 32]}
    if heuristic.get("split"):  # the split row against the walking one
        variations["split"] = [False]
    elif block < classes:
        variations["num_stages"] = [1, 2]
    else:  # rows held whole: more or fewer of them a program, and the persistent grid
        rows = heuristic.get("ROWS", 1)
        variations["ROWS"] = [r for r in (rows // 2, rows * 2) if r >= 1]
        variations["persistent"] = [tuning.PERSISTENT_PROGRAMS]
    return tuning.around(heuristic, variations, lambda config: config["BLOCK"] * config.get("ROWS", 1))


@triton.jit
def _online_block(running_max, sum_exp, x, ACC: tl.constexpr):
    """One block of a row's online log-sum-exp: the running maximum and
    sum exp(x - maximum), rescaled by exp(old - new) as the maximum grows."""
    neg_inf = float("-inf")
    new_max = tl.maximum(running_max, tl.max(x, axis=0))
    # While the maximum is -inf every exp is 0: shift by 0 instead of
    # computing -inf - -inf.
    shift = tl.where(new_max == neg_inf, 0.0, new_max).to(ACC)
    rescale = tl.where(running_max == neg_inf, 0.0, tl.exp(running_max - shift)).to(ACC)
    return new_max, sum_exp * rescale + tl.sum(tl.exp(x - shift), axis=0)


@triton.jit
def _smoothing_block(weight_ptr, offsets, mask, x, HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr):
    """One block's sum_c w_c x_c and sum_c w_c (w_c = 1 without weights)."""
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(ACC)
    else:
        w = tl.where(mask, 1.0, 0.0).to(ACC)
    return tl.sum(w * tl.where(mask, x, 0.0), axis=0), tl.sum(w, axis=0)


@triton.jit
def _gradient_block(x, offsets, mask, weight_ptr, lse, coef, eps, classes, safe_target, w_t, valid, in_range,
                    row_scale, HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, ACC: tl.constexpr):
    """The reduction-scaled gradient of one block of a row's logits."""
    g = coef * tl.exp(x - lse)
    if SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(ACC)
            g -= eps / classes * w
        else:
            g -= eps / classes
    g = tl.where(offsets == safe_target, g - (1.0 - eps) * w_t, g)
    # Multiply, not select, for ignored rows would give 0 * inf = NaN
    # on -inf logits; select instead.
    g = tl.where(valid, g * row_scale, 0.0)
    return tl.where(valid & ~in_range, float("nan"), g)


@triton.jit
def _row_start(base_ptr, row, inner, outer_stride, inner_stride):
    """Where row ``row = n * inner + i`` of an ``(N, C, inner)`` view starts."""
    return base_ptr + (row // inner) * outer_stride + (row % inner) * inner_stride


@triton.jit
def _row_target(target_ptr, row, ignore_index, classes):
    """A row's target: whether the row counts (not ``ignore_index``),
    whether its target names a class, and a class safe to read (0 where
    it names none)."""
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < classes)
    return valid, in_range, tl.where(valid & in_range, target, 0)


@triton.jit
def _target_weight(weight_ptr, safe_target, has_target, HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr):
    """The class weight of each row's target (1 without weights)."""
    w_t = tl.full(safe_target.shape, 1.0, ACC)
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + safe_target, mask=has_target, other=0.0).to(ACC)
    return w_t


@triton.jit
def _row_loss(lse, x_t, w_t, sum_wx, sum_w, eps, classes, valid, in_range, SMOOTHING: tl.constexpr):
    """A row's loss: 0 where ignored, NaN for a bad target."""
    loss = (1.0 - eps) * w_t * (lse - x_t)
    if SMOOTHING:
        loss += eps / classes * (sum_w * lse - sum_wx)
    loss = tl.where(valid, loss, 0.0)
    return tl.where(valid & ~in_range, float("nan"), loss)


@triton.jit
def _softmax_weight(w_t, sum_w, eps, classes, SMOOTHING: tl.constexpr):
    """The weight of a row's softmax in its gradient."""
    coef = w_t
    if SMOOTHING:
        coef = (1.0 - eps) * w_t + eps / classes * sum_w
    return coef


@triton.jit
def _row_scale(scale, valid, in_range):
    """The gradient's scale of a row: 0 where ignored, NaN for a bad target."""
    row_scale = tl.where(valid, scale, 0.0)
    return tl.where(valid & ~in_range, float("nan"), row_scale)


@triton.jit
def _whole_rows(first, n_rows, logits_ptr, target_ptr, weight_ptr, grad_ptr, loss_ptr, classes, inner,
                outer_stride, class_stride, inner_stride, grad_outer_stride, grad_class_stride, grad_inner_stride,
                ignore_index, eps, scale, HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr,
                WRITE_GRAD: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Rows ``first`` to ``first + ROWS - 1`` held whole, one per line of a
    [ROWS, BLOCK] block: each logit read once, its loss and gradient from
    that read. A line past the last row reads the last row again and writes
    nothing (loads without a row mask stay 128 bits wide; softmax's
    _forward_rows says why)."""
    neg_inf = float("-inf")
    rows = first + tl.arange(0, ROWS).to(tl.int64)
    live = rows < n_rows
    read = tl.minimum(rows, n_rows - 1)
    row_ptr = _row_start(logits_ptr, read, inner, outer_stride, inner_stride)
    valid, in_range, safe_target = _row_target(target_ptr, read, ignore_index, classes)
    cols = tl.arange(0, BLOCK)[None, :]
    row_mask = cols < classes
    x = tl.load(row_ptr[:, None] + cols.to(tl.int64) * class_stride, mask=row_mask, other=neg_inf).to(ACC)
    row_max = tl.max(x, axis=1)
    # a row of -inf shifts by 0, so exp never sees -inf - -inf
    shift = tl.where(row_max == neg_inf, 0.0, row_max).to(ACC)
    sum_exp = tl.sum(tl.exp(x - shift[:, None]), axis=1)
    lse = tl.where(row_max == neg_inf, neg_inf, row_max + tl.log(sum_exp)).to(ACC)
    has_target = valid & in_range
    x_t = tl.load(row_ptr + safe_target * class_stride, mask=has_target, other=0.0).to(ACC)
    w_t = _target_weight(weight_ptr, safe_target, has_target, HAS_WEIGHT, ACC)
    sum_wx = tl.zeros([ROWS], ACC)
    sum_w = tl.zeros([ROWS], ACC)
    if SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=row_mask, other=0.0).to(ACC)
        else:
            w = tl.where(row_mask, 1.0, 0.0).to(ACC)
        sum_wx = tl.sum(w * tl.where(row_mask, x, 0.0), axis=1)
        sum_w = tl.sum(w, axis=1)
    loss = _row_loss(lse, x_t, w_t, sum_wx, sum_w, eps, classes, valid, in_range, SMOOTHING)
    coef = _softmax_weight(w_t, sum_w, eps, classes, SMOOTHING)
    tl.store(loss_ptr + rows, loss, mask=live)
    if WRITE_GRAD:
        row_scale = _row_scale(scale, valid, in_range)
        g = _gradient_block(x, cols, row_mask, weight_ptr, lse[:, None], coef[:, None], eps, classes,
                            safe_target[:, None], w_t[:, None], valid[:, None], in_range[:, None], row_scale[:, None],
                            HAS_WEIGHT, SMOOTHING, ACC)
        grad_row_ptr = _row_start(grad_ptr, rows, inner, grad_outer_stride, grad_inner_stride)
        tl.store(grad_row_ptr[:, None] + cols.to(tl.int64) * grad_class_stride, g.to(grad_ptr.dtype.element_ty),
                 mask=row_mask & live[:, None])


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr, target_ptr, weight_ptr, grad_ptr, grad_scale_ptr, loss_ptr,
    n_rows, classes, inner,
    outer_stride, class_stride, inner_stride,
    grad_outer_stride, grad_class_stride, grad_inner_stride,
    ignore_index, eps_ptr,
    HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, WRITE_GRAD: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, PERSISTENT: tl.constexpr,
):
    ACC = loss_ptr.dtype.element_ty  # the losses are in the accumulation dtype
    # label_smoothing comes from memory in the accumulation dtype: a scalar
    # argument would be rounded to float32, too coarse for float64 logits.
    eps = tl.load(eps_ptr)
    scale = tl.zeros((), ACC)
    if WRITE_GRAD:
        scale = tl.load(grad_scale_ptr).to(ACC)
    if SINGLE:
        # ROWS rows a program (row block p), or under PERSISTENT (a grid of
        # a few programs per SM) row blocks p, p + programs, ...
        if PERSISTENT:
            for first in range(tl.program_id(0).to(tl.int64) * ROWS, n_rows, tl.num_programs(0) * ROWS):
                _whole_rows(first, n_rows, logits_ptr, target_ptr, weight_ptr, grad_ptr, loss_ptr, classes, inner,
                            outer_stride, class_stride, inner_stride, grad_outer_stride, grad_class_stride,
                            grad_inner_stride, ignore_index, eps, scale, HAS_WEIGHT, SMOOTHING, WRITE_GRAD, ACC,
                            BLOCK, ROWS)
        else:
            _whole_rows(tl.program_id(0).to(tl.int64) * ROWS, n_rows, logits_ptr, target_ptr, weight_ptr, grad_ptr,
                        loss_ptr, classes, inner, outer_stride, class_stride, inner_stride, grad_outer_stride,
                        grad_class_stride, grad_inner_stride, ignore_index, eps, scale, HAS_WEIGHT, SMOOTHING,
                        WRITE_GRAD, ACC, BLOCK, ROWS)
    else:
        _walking_row(logits_ptr, target_ptr, weight_ptr, grad_ptr, loss_ptr, classes, inner, outer_stride,
                     class_stride, inner_stride, grad_outer_stride, grad_class_stride, grad_inner_stride,
                     ignore_index, eps, scale, HAS_WEIGHT, SMOOTHING, WRITE_GRAD, ACC, BLOCK)


@triton.jit
def _walking_row(logits_ptr, target_ptr, weight_ptr, grad_ptr, loss_ptr, classes, inner, outer_stride, class_stride,
                 inner_stride, grad_outer_stride, grad_class_stride, grad_inner_stride, ignore_index, eps, scale,
                 HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, WRITE_GRAD: tl.constexpr, ACC: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Row ``program_id`` walked in BLOCK-wide blocks: the online pass, then
    (for the gradient) a second read of each block."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = _row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    valid, in_range, safe_target = _row_target(target_ptr, row, ignore_index, classes)
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")

    running_max = tl.full((), neg_inf, ACC)
    sum_exp = tl.zeros((), ACC)
    sum_wx = tl.zeros((), ACC)
    sum_w = tl.zeros((), ACC)
    for start in range(0, classes, BLOCK):
        offsets = start + cols
        mask = offsets < classes
        x = tl.load(row_ptr + offsets.to(tl.int64) * class_stride, mask=mask, other=neg_inf).to(ACC)
        running_max, sum_exp = _online_block(running_max, sum_exp, x, ACC)
        if SMOOTHING:
            block_wx, block_w = _smoothing_block(weight_ptr, offsets, mask, x, HAS_WEIGHT, ACC)
            sum_wx += block_wx
            sum_w += block_w

    lse = tl.where(running_max == neg_inf, neg_inf, running_max + tl.log(sum_exp)).to(ACC)
    # Only a row with a valid target reads one: with 0 classes there is no
    # element to read (an unmasked load of "class 0" went out of bounds).
    has_target = valid & in_range
    x_t = tl.load(row_ptr + safe_target * class_stride, mask=has_target, other=0.0).to(ACC)
    w_t = _target_weight(weight_ptr, safe_target, has_target, HAS_WEIGHT, ACC)
    loss = _row_loss(lse, x_t, w_t, sum_wx, sum_w, eps, classes, valid, in_range, SMOOTHING)
    coef = _softmax_weight(w_t, sum_w, eps, classes, SMOOTHING)
    tl.store(loss_ptr + row, loss)

    if WRITE_GRAD:
        row_scale = _row_scale(scale, valid, in_range)
        grad_row_ptr = _row_start(grad_ptr, row, inner, grad_outer_stride, grad_inner_stride)
        for start in range(0, classes, BLOCK):
            offsets = start + cols
            mask = offsets < classes
            x = tl.load(row_ptr + offsets.to(tl.int64) * class_stride, mask=mask, other=0.0).to(ACC)
            g = _gradient_block(x, offsets, mask, weight_ptr, lse, coef, eps, classes, safe_target, w_t,
                                valid, in_range, row_scale, HAS_WEIGHT, SMOOTHING, ACC)
            tl.store(grad_row_ptr + offsets.to(tl.int64) * grad_class_stride,
                     g.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_split_kernel(
    logits_ptr, target_ptr, weight_ptr, grad_ptr, grad_scale_ptr, loss_ptr, work_ptr, partial_ptr,
    classes, inner,
    outer_stride, class_stride, inner_stride,
    grad_outer_stride, grad_class_stride, grad_inner_stride,
    ignore_index, eps_ptr, splits, spin,
    HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, PIECES: tl.constexpr,
):
    # The loss and gradient of rows too long for one program: one BLOCK-wide
    # piece per program (ops/_row_split.py), read once and held while the
    # row's pieces exchange (max, sum of exp, and for label smoothing
    # sum w*x and sum w); each piece then writes its gradient, piece 0 the loss.
    ACC = loss_ptr.dtype.element_ty
    row, piece = split_piece(work_ptr, splits)
    row_ptr = _row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    valid, in_range, safe_target = _row_target(target_ptr, row, ignore_index, classes)
    eps = tl.load(eps_ptr)
    neg_inf = float("-inf")
    cols = piece * BLOCK + tl.arange(0, BLOCK)
    mask = cols < classes
    x = tl.load(row_ptr + cols.to(tl.int64) * class_stride, mask=mask, other=neg_inf).to(ACC)
    piece_max, piece_sum = _online_block(tl.full((), neg_inf, ACC), tl.zeros((), ACC), x, ACC)
    partials = partial_ptr + row * 4 * splits  # maxima, sums of exp, sums of w*x, sums of w
    tl.store(partials + piece, piece_max)
    tl.store(partials + splits + piece, piece_sum)
    if SMOOTHING:
        piece_wx, piece_w = _smoothing_block(weight_ptr, cols, mask, x, HAS_WEIGHT, ACC)
        tl.store(partials + 2 * splits + piece, piece_wx)
        tl.store(partials + 3 * splits + piece, piece_w)
    pieces = tl.arange(0, PIECES)
    present = pieces < splits
    sums_wx = tl.zeros([PIECES], ACC)
    sums_w = tl.zeros([PIECES], ACC)
    if wait_for_pieces(work_ptr + 1 + row, splits, spin):
        maxima = tl.load(partials + pieces, mask=present, other=neg_inf, volatile=True)
        sums = tl.load(partials + splits + pieces, mask=present, other=0.0, volatile=True)
        if SMOOTHING:
            sums_wx = tl.load(partials + 2 * splits + pieces, mask=present, other=0.0, volatile=True)
            sums_w = tl.load(partials + 3 * splits + pieces, mask=present, other=0.0, volatile=True)
    else:
        maxima = tl.full([PIECES], neg_inf, ACC)
        sums = tl.zeros([PIECES], ACC)
        for other in range(0, splits):
            other_cols = other * BLOCK + tl.arange(0, BLOCK)
            other_mask = other_cols < classes
            other_x = tl.load(row_ptr + other_cols.to(tl.int64) * class_stride, mask=other_mask,
                              other=neg_inf).to(ACC)
            other_max, other_sum = _online_block(tl.full((), neg_inf, ACC), tl.zeros((), ACC), other_x, ACC)
            maxima = tl.where(pieces == other, other_max, maxima)
            sums = tl.where(pieces == other, other_sum, sums)
            if SMOOTHING:
                other_wx, other_w = _smoothing_block(weight_ptr, other_cols, other_mask, other_x, HAS_WEIGHT, ACC)
                sums_wx = tl.where(pieces == other, other_wx, sums_wx)
                sums_w = tl.where(pieces == other, other_w, sums_w)
        # the piece again, so its values need no registers during the loop
        x = tl.load(row_ptr + cols.to(tl.int64) * class_stride, mask=mask, other=neg_inf).to(ACC)
    running_max = tl.max(maxima, axis=0)
    shift = tl.where(running_max == neg_inf, 0.0, running_max).to(ACC)
    sum_exp = tl.sum(sums * tl.exp(maxima - shift), axis=0)
    lse = tl.where(running_max == neg_inf, neg_inf, running_max + tl.log(sum_exp)).to(ACC)
    sum_wx = tl.sum(sums_wx, axis=0)
    sum_w = tl.sum(sums_w, axis=0)
    has_target = valid & in_range
    w_t = _target_weight(weight_ptr, safe_target, has_target, HAS_WEIGHT, ACC)
    coef = _softmax_weight(w_t, sum_w, eps, classes, SMOOTHING)
    if piece == 0:
        x_t = tl.load(row_ptr + safe_target * class_stride, mask=has_target, other=0.0).to(ACC)
        tl.store(loss_ptr + row, _row_loss(lse, x_t, w_t, sum_wx, sum_w, eps, classes, valid, in_range, SMOOTHING))
    row_scale = _row_scale(tl.load(grad_scale_ptr).to(ACC), valid, in_range)
    g = _gradient_block(x, cols, mask, weight_ptr, lse, coef, eps, classes, safe_target, w_t, valid, in_range,
                        row_scale, HAS_WEIGHT, SMOOTHING, ACC)
    grad_row_ptr = _row_start(grad_ptr, row, inner, grad_outer_stride, grad_inner_stride)
    tl.store(grad_row_ptr + cols.to(tl.int64) * grad_class_stride, g.to(grad_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows_triton(logits, target, weight, grad, grad_scale, ignore_index, label_smoothing):
    """Same contract as ``effilayers.ops.cross_entropy.cross_entropy_rows_reference``."""
    n_outer, classes, n_inner = logits.shape
    acc = accumulation_dtype(logits.dtype)
    rows = n_outer * n_inner
    loss = torch.full((rows,), float("nan"), dtype=acc, device=logits.device)
    if rows == 0:
        return loss
    write_grad = grad is not None
    config = _rows_config(logits, write_grad)
    grad_arg = grad if write_grad else logits
    grad_strides = grad.stride() if write_grad else (0, 0, 0)
    eps = float(label_smoothing)
    eps_tensor = torch.full((1,), eps, dtype=acc, device=logits.device)  # a fill kernel, no host copy
    splits = split_count(classes, config["BLOCK"], rows) if write_grad and config.get("split") else 0
    if splits:
        work, partials = split_buffers(rows, splits, 4, acc, logits.device)
        _cross_entropy_split_kernel[(rows * splits,)](
            logits, target, weight if weight is not None else logits, grad, grad_scale, loss, work, partials,
            classes, n_inner,
            logits.stride(0), logits.stride(1), logits.stride(2),
            grad_strides[0], grad_strides[1], grad_strides[2],
            ignore_index, eps_tensor, splits, spin(logits.device),
            HAS_WEIGHT=weight is not None, SMOOTHING=eps > 0.0, BLOCK=config["BLOCK"],
            PIECES=triton.next_power_of_2(splits), **tuning.launch_options(config),
        )
        return loss
    single, per_program, persistent, programs = _row_grid(config, classes, rows, logits.device)
    _cross_entropy_rows_kernel[(programs,)](
        logits, target, weight if weight is not None else logits, grad_arg, grad_scale, loss,
        rows, classes, n_inner,
        logits.stride(0), logits.stride(1), logits.stride(2),
        grad_strides[0], grad_strides[1], grad_strides[2],
        ignore_index, eps_tensor,
        HAS_WEIGHT=weight is not None, SMOOTHING=eps > 0.0, WRITE_GRAD=write_grad,
        SINGLE=single, BLOCK=config["BLOCK"], ROWS=per_program, PERSISTENT=persistent,
        **tuning.launch_options(config),
    )
    return loss


# -- one vocabulary chunk of wider rows ------------------------------------------
#
# linear_cross_entropy's vocabulary chunks: a (rows, classes) view of one
# chunk's logits, classes contiguous, starting at class `class_offset`. One
# program per row, blocks of BLOCK classes as above (_block_and_warps of the
# chunk's width). Rows whose target is ignore_index are skipped by the
# statistics and get a zero gradient. The ops' declarations (op.py) and
# reference.py's cross_entropy_chunk_*_reference give the contracts.


@triton.jit
def _chunk_stats_kernel(
    logits_ptr, target_ptr, weight_ptr, stats_ptr,
    classes, row_stride, stats_stride, class_offset, ignore_index,
    HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, BLOCK: tl.constexpr,
):
    ACC = stats_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    if target != ignore_index:
        row_ptr = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK)
        neg_inf = float("-inf")
        running_max = tl.load(stats_ptr + row)
        sum_exp = tl.load(stats_ptr + stats_stride + row)
        sum_wx = tl.zeros((), ACC)
        for start in range(0, classes, BLOCK):
            offsets = start + cols
            mask = offsets < classes
            x = tl.load(row_ptr + offsets, mask=mask, other=neg_inf).to(ACC)
            running_max, sum_exp = _online_block(running_max, sum_exp, x, ACC)
            if SMOOTHING:
                sum_wx += _smoothing_block(weight_ptr, offsets, mask, x, HAS_WEIGHT, ACC)[0]
        tl.store(stats_ptr + row, running_max)
        tl.store(stats_ptr + stats_stride + row, sum_exp)
        local = target - class_offset
        here = (local >= 0) & (local < classes)
        x_t = tl.load(row_ptr + tl.where(here, local, 0), mask=here, other=0.0).to(ACC)
        tl.store(stats_ptr + 2 * stats_stride + row, x_t, mask=here)
        if SMOOTHING:
            smooth_ptr = stats_ptr + 3 * stats_stride + row
            tl.store(smooth_ptr, tl.load(smooth_ptr) + sum_wx)


@triton.jit
def _chunk_grad_kernel(
    logits_ptr, target_ptr, class_term_ptr, row_terms_ptr,
    classes, row_stride, terms_stride, class_offset, ignore_index,
    HAS_CLASS_TERM: tl.constexpr, BLOCK: tl.constexpr,
):
    ACC = row_terms_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    lse = tl.load(row_terms_ptr + row)
    coef = tl.load(row_terms_ptr + terms_stride + row)
    target_coef = tl.load(row_terms_ptr + 2 * terms_stride + row)
    scale = tl.load(row_terms_ptr + 3 * terms_stride + row)
    local = target - class_offset
    row_ptr = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    for start in range(0, classes, BLOCK):
        offsets = start + cols
        mask = offsets < classes
        x = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(ACC)
        g = coef * tl.exp(x - lse)
        if HAS_CLASS_TERM:
            g -= tl.load(class_term_ptr + offsets, mask=mask, other=0.0).to(ACC)
        g = tl.where(offsets == local, g - target_coef, g)
        # A select: an ignored row gives 0 even where its scale is NaN or its exp overflowed.
        g = tl.where(valid, g * scale, 0.0)
        tl.store(row_ptr + offsets, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _chunk_launch(kernel, logits, target, vector, per_row, class_offset, ignore_index, **constexprs):
    rows, classes = logits.shape
    if rows == 0:
        return
    block, warps = _block_and_warps(classes)
    kernel[(rows,)](logits, target, vector if vector is not None else per_row, per_row,
                    classes, logits.stride(0), per_row.stride(0), class_offset, ignore_index,
                    BLOCK=block, num_warps=warps, **constexprs)


def cross_entropy_chunk_stats_triton(logits, target, weight, stats, class_offset, ignore_index, smoothing):
    """Same contract as ``effilayers.ops.cross_entropy.cross_entropy_chunk_stats_reference``."""
    _chunk_launch(_chunk_stats_kernel, logits, target, weight, stats, class_offset, ignore_index,
                  HAS_WEIGHT=weight is not None, SMOOTHING=bool(smoothing))


def cross_entropy_chunk_grad_triton(logits, target, class_term, row_terms, class_offset, ignore_index):
    """Same contract as ``effilayers.ops.cross_entropy.cross_entropy_chunk_grad_reference``."""
    _chunk_launch(_chunk_grad_kernel, logits, target, class_term, row_terms, class_offset, ignore_index,
                  HAS_CLASS_TERM=class_term is not None)


# -- one chunk of rows with probability targets -----------------------------------
#
# The same two passes when each row's target is a probability row (probs: the
# chunk's classes, any strides, any floating dtype), each probability
# weighted as q_c = p_c * prob_weight_c + class_term_c. The statistics gain
# sum_c q_c z_c and sum_c q_c; the gradient is scale * (sum_q * softmax - q).


@triton.jit
def _soft_weights(probs_row_ptr, probs_class_stride, prob_weight_ptr, class_term_ptr, offsets, mask,
                  HAS_PROB_WEIGHT: tl.constexpr, HAS_CLASS_TERM: tl.constexpr, ACC: tl.constexpr):
    """One block's weighted probabilities q_c (0 past the row's end). A
    class stride of 1 is specialised by Triton's launcher: contiguous
    probabilities get vector loads."""
    q = tl.load(probs_row_ptr + offsets.to(tl.int64) * probs_class_stride, mask=mask, other=0.0).to(ACC)
    if HAS_PROB_WEIGHT:
        q *= tl.load(prob_weight_ptr + offsets, mask=mask, other=0.0).to(ACC)
    if HAS_CLASS_TERM:
        q += tl.load(class_term_ptr + offsets, mask=mask, other=0.0).to(ACC)
    return q


@triton.jit
def _soft_chunk_stats_kernel(
    logits_ptr, probs_ptr, prob_weight_ptr, class_term_ptr, stats_ptr,
    classes, row_stride, probs_row_stride, probs_class_stride, stats_stride,
    HAS_PROB_WEIGHT: tl.constexpr, HAS_CLASS_TERM: tl.constexpr, BLOCK: tl.constexpr,
):
    ACC = stats_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    probs_row_ptr = probs_ptr + row * probs_row_stride
    cols = tl.arange(0, BLOCK)
    running_max = tl.load(stats_ptr + row)
    sum_exp = tl.load(stats_ptr + stats_stride + row)
    sum_qz = tl.zeros((), ACC)
    sum_q = tl.zeros((), ACC)
    for start in range(0, classes, BLOCK):
        offsets = start + cols
        mask = offsets < classes
        x = tl.load(row_ptr + offsets, mask=mask, other=float("-inf")).to(ACC)
        running_max, sum_exp = _online_block(running_max, sum_exp, x, ACC)
        q = _soft_weights(probs_row_ptr, probs_class_stride, prob_weight_ptr, class_term_ptr, offsets, mask,
                          HAS_PROB_WEIGHT, HAS_CLASS_TERM, ACC)
        # Past the row's end x is -inf and q is 0: read x as 0 there, as 0 * -inf is NaN.
        sum_qz += tl.sum(q * tl.where(mask, x, 0.0), axis=0)
        sum_q += tl.sum(q, axis=0)
    tl.store(stats_ptr + row, running_max)
    tl.store(stats_ptr + stats_stride + row, sum_exp)
    tl.store(stats_ptr + 2 * stats_stride + row, tl.load(stats_ptr + 2 * stats_stride + row) + sum_qz)
    tl.store(stats_ptr + 3 * stats_stride + row, tl.load(stats_ptr + 3 * stats_stride + row) + sum_q)


@triton.jit
def _soft_chunk_grad_kernel(
    logits_ptr, probs_ptr, prob_weight_ptr, class_term_ptr, row_terms_ptr,
    classes, row_stride, probs_row_stride, probs_class_stride, terms_stride,
    HAS_PROB_WEIGHT: tl.constexpr, HAS_CLASS_TERM: tl.constexpr, BLOCK: tl.constexpr,
):
    ACC = row_terms_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(row_terms_ptr + row)
    mass = tl.load(row_terms_ptr + terms_stride + row)
    scale = tl.load(row_terms_ptr + 2 * terms_stride + row)
    row_ptr = logits_ptr + row * row_stride
    probs_row_ptr = probs_ptr + row * probs_row_stride
    cols = tl.arange(0, BLOCK)
    for start in range(0, classes, BLOCK):
        offsets = start + cols
        mask = offsets < classes
        x = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(ACC)
        q = _soft_weights(probs_row_ptr, probs_class_stride, prob_weight_ptr, class_term_ptr, offsets, mask,
                          HAS_PROB_WEIGHT, HAS_CLASS_TERM, ACC)
        g = (mass * tl.exp(x - lse) - q) * scale
        tl.store(row_ptr + offsets, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _soft_chunk_launch(kernel, logits, probs, prob_weight, class_term, per_row):
    rows, classes = logits.shape
    if rows == 0:
        return
    block, warps = _block_and_warps(classes)
    kernel[(rows,)](logits, probs, prob_weight if prob_weight is not None else per_row,
                    class_term if class_term is not None else per_row, per_row,
                    classes, logits.stride(0), probs.stride(0), probs.stride(1), per_row.stride(0),
                    HAS_PROB_WEIGHT=prob_weight is not None, HAS_CLASS_TERM=class_term is not None,
                    BLOCK=block, num_warps=warps)


def cross_entropy_soft_chunk_stats_triton(logits, probs, prob_weight, class_term, stats):
    """Same contract as ``effilayers.ops.cross_entropy.cross_entropy_soft_chunk_stats_reference``."""
    _soft_chunk_launch(_soft_chunk_stats_kernel, logits, probs, prob_weight, class_term, stats)


def cross_entropy_soft_chunk_grad_triton(logits, probs, prob_weight, class_term, row_terms):
    """Same contract as ``effilayers.ops.cross_entropy.cross_entropy_soft_chunk_grad_reference``."""
    _soft_chunk_launch(_soft_chunk_grad_kernel, logits, probs, prob_weight, class_term, row_terms)


# -- kernel report ---------------------------------------------------------------

# benchmarks/bench_cross_entropy.py's GPU shapes (rows, classes), and short
# rows held whole several to a program (compiled here, not yet a GPU bench
# shape: the bench step's budget). 1024 classes, not ImageNet's 1000:
# Triton's launcher marks a row stride as aligned only when it is a
# multiple of 16, so rows of 1000 classes load one element at a time in
# this kernel, with or without ROWS.
BENCHMARK_SHAPES = ((16384, 131072), (8192, 32000))
SHORT_ROWS_SHAPE = (65536, 1024)
REPORT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bytes_per_element(size: int, write_grad: bool, single: bool) -> tuple[float, float]:
    """(bytes this kernel moves per logit, the roofline). The loss alone
    reads each logit once; with the gradient a row held whole in registers
    (``SINGLE``) is read once and its gradient written once, as a perfect
    kernel would, while the walking path's second pass reads it again (the
    per-row target, loss and class weights are below 0.01 byte per logit at
    these sizes)."""
    if write_grad:
        return (2 if single else 3) * size, 2 * size
    return size, size


_WALKING_REREAD = ("the walking path with a gradient, which a row longer than MAX_FUSED_BLOCK takes only beyond "
                   "MAX_SPLITS pieces or under a tuned configuration without split (the benchmark rows are split): "
                   "its gradient pass reads the row again")
_PARTIALS = "a row's per-piece partials, at most MAX_SPLITS values each: not bandwidth-bound"
# Rows several to a program: what comes one value per row (which a single
# row loads or stores once, from no thread in particular) is one value per
# thread's row, below 0.01 byte per logit.
_PER_ROW = {"target_ptr": "a row's target and the logit and class weight it picks: one element per row",
            "loss_ptr": "one loss per row"}


def _arguments(dtype: torch.dtype, classes: int, has_weight: bool, write_grad: bool, rows: int = 0) -> dict:
    """The rows kernels' arguments for contiguous (rows, classes) logits seen
    as (rows, classes, 1) (``rows``: the rows kernel's n_rows; the split
    kernel has none)."""
    acc = accumulation_dtype(dtype)
    grad_strides = (classes, 1, 1) if write_grad else (0, 0, 0)
    counted = dict(n_rows=rows) if rows else {}
    return dict(logits_ptr=dtype, target_ptr=torch.int64, weight_ptr=acc if has_weight else dtype, grad_ptr=dtype,
                grad_scale_ptr=acc, loss_ptr=acc, **counted, classes=classes, inner=1, outer_stride=classes,
                class_stride=1,
                inner_stride=1, grad_outer_stride=grad_strides[0], grad_class_stride=grad_strides[1],
                grad_inner_stride=grad_strides[2], ignore_index=-100, eps_ptr=acc)


_BRANCHES = ((False, False), (True, False), (False, True), (True, True))  # (weight, smoothing)


def kernel_specialisations():
    """Every (dtype, branch) of the rows kernels at the benchmark shapes,
    with the launcher's choice (``_rows_heuristic``), and the walking
    path a tuned configuration without split would take instead."""
    for dtype in REPORT_DTYPES:
        acc = accumulation_dtype(dtype)
        size = dtype.itemsize
        seen = set()
        for rows, classes in (*BENCHMARK_SHAPES, SHORT_ROWS_SHAPE):
            for write_grad in (True, False):
                config = _rows_heuristic(classes, write_grad, size)
                block, warps = config["BLOCK"], config["num_warps"]
                if config.get("split"):
                    splits = triton.cdiv(classes, block)
                    pieces = triton.next_power_of_2(splits)
                    if ("split", block, pieces) not in seen:
                        seen.add(("split", block, pieces))
                        for has_weight, smoothing in _BRANCHES:
                            arguments = dict(_arguments(dtype, classes, has_weight, True), work_ptr=torch.int32,
                                             partial_ptr=acc, splits=splits, spin=SPIN)
                            label = (f"{str(dtype)[6:]} {rows}x{classes} BLOCK={block} split x{splits} grad"
                                     f"{' weight' if has_weight else ''}{' smoothing' if smoothing else ''}")
                            yield KernelSpec(_cross_entropy_split_kernel, arguments,
                                             dict(HAS_WEIGHT=has_weight, SMOOTHING=smoothing, BLOCK=block,
                                                  PIECES=pieces), warps, label,
                                             *bytes_per_element(size, True, True), {"partial_ptr": _PARTIALS})
                    # the walking path of a tuned configuration without split
                    config = _rows_heuristic(classes, False, size)
                    block, warps = config["BLOCK"], config["num_warps"]
                single = classes <= block
                per_program = config.get("ROWS", 1)
                # rows several to a program also as a persistent grid (the
                # sweep's candidate), so its code is checked as well
                for persistent in (False, True) if per_program > 1 else (False,):
                    if (block, warps, single, write_grad, per_program, persistent) in seen:
                        continue
                    seen.add((block, warps, single, write_grad, per_program, persistent))
                    for has_weight, smoothing in _BRANCHES:
                        label = (f"{str(dtype)[6:]} {rows}x{classes} BLOCK={block}{'' if single else ' walking'}"
                                 + (f" ROWS={per_program}" if per_program > 1 else "")
                                 + (" persistent" if persistent else "")
                                 + f"{' grad' if write_grad else ''}{' weight' if has_weight else ''}"
                                 f"{' smoothing' if smoothing else ''}")
                        reread = _WALKING_REREAD if write_grad and not single else ""
                        yield KernelSpec(_cross_entropy_rows_kernel,
                                         _arguments(dtype, classes, has_weight, write_grad, rows),
                                         dict(HAS_WEIGHT=has_weight, SMOOTHING=smoothing, WRITE_GRAD=write_grad,
                                              SINGLE=single, BLOCK=block, ROWS=per_program, PERSISTENT=persistent),
                                         warps, label, *bytes_per_element(size, write_grad, single),
                                         _PER_ROW if per_program > 1 else {}, reread=reread)
    yield from _chunk_specialisations()


# linear_cross_entropy's vocabulary chunks on a GPU: 32 tokens by the classes
# whose bf16 logits fill its 8 MiB budget (rows, classes); any chunk of 4096
# classes or more takes the same block.
CHUNK_SHAPE = (32, 131072)


def _chunk_specialisations():
    """The vocabulary-chunk kernels at CHUNK_SHAPE, every dtype and branch:
    the statistics read each logit once, the gradient reads it and writes
    its gradient over it, as a perfect kernel must (each pass reading the
    probability targets too, where there are)."""
    for dtype in REPORT_DTYPES:
        acc = accumulation_dtype(dtype)
        size = dtype.itemsize
        rows, classes = CHUNK_SHAPE
        block, warps = _block_and_warps(classes)
        common = dict(logits_ptr=dtype, target_ptr=torch.int64, classes=classes, row_stride=classes,
                      class_offset=classes, ignore_index=-100)
        name = f"{str(dtype)[6:]} {rows}x{classes} BLOCK={block}"
        for has_weight, smoothing in ((False, False), (False, True), (True, True)):
            arguments = dict(common, weight_ptr=acc, stats_ptr=acc, stats_stride=rows)
            yield KernelSpec(_chunk_stats_kernel, arguments, dict(HAS_WEIGHT=has_weight, SMOOTHING=smoothing,
                                                                  BLOCK=block), warps,
                             f"{name} stats{' weight' if has_weight else ''}{' smoothing' if smoothing else ''}",
                             size, size)
        for has_class_term in (False, True):
            arguments = dict(common, class_term_ptr=acc, row_terms_ptr=acc, terms_stride=rows)
            yield KernelSpec(_chunk_grad_kernel, arguments, dict(HAS_CLASS_TERM=has_class_term, BLOCK=block),
                             warps, f"{name} grad{' class_term' if has_class_term else ''}", 2 * size, 2 * size)
        # Probability targets, contiguous, in the logits' dtype and (bf16
        # logits under autocast, a float32 softmax as the target) in float32:
        # each pass also reads them.
        for probs_dtype in (dtype, torch.float32) if dtype == torch.bfloat16 else (dtype,):
            soft = dict(logits_ptr=dtype, probs_ptr=probs_dtype, prob_weight_ptr=acc, class_term_ptr=acc,
                        classes=classes, row_stride=classes, probs_row_stride=classes, probs_class_stride=1)
            read = size + probs_dtype.itemsize
            for weighted in (False, True):
                flags = dict(HAS_PROB_WEIGHT=weighted, HAS_CLASS_TERM=weighted, BLOCK=block)
                label = f"{name} soft {str(probs_dtype)[6:]}{' weighted' if weighted else ''}"
                yield KernelSpec(_soft_chunk_stats_kernel, dict(soft, stats_ptr=acc, stats_stride=rows), flags, warps,
                                 f"{label} stats", read, read)
                yield KernelSpec(_soft_chunk_grad_kernel, dict(soft, row_terms_ptr=acc, terms_stride=rows), flags,
                                 warps, f"{label} grad", read + size, read + size)
