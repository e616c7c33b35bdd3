"""Triton kernels for the softmax family (GPU; CPU tensors under ``TRITON_INTERPRET=1``).

Six kernels, all accumulating in float32 (float64 when input or output is
float64):

* ``_row_forward``: one program per row whose values are ``col_stride``
  apart (softmax over a dimension with nothing after it in memory order,
  and every row of :func:`scaled_masked_softmax_forward`). A row that fits
  in ``MAX_FUSED_BLOCK`` values is loaded once into registers, reduced and
  written: one read, one write. A longer row is split (below); where it
  is not (a tuned configuration, more than MAX_SPLITS pieces), it takes two
  passes: an online pass keeps a running maximum and a running sum per
  lane, rescaling the sum by ``exp(old_max - new_max)`` when the maximum
  grows, then one more pass re-reads the row and writes it.
* ``_tile_forward``: softmax over a dimension that has ``inner > 1``
  neighbours (``dim=1`` of NCHW, ``dim=0``): one program per block of
  ``BLOCK_I`` inner columns, reducing a ``(BLOCK_R, BLOCK_I)`` tile along its
  first axis, so the loads run along the unit-stride inner dimension.
* ``_row_forward_split`` / ``_row_backward_split``: rows longer than
  ``MAX_FUSED_BLOCK``, cut into ``SPLIT_BLOCK``-wide pieces, one program
  each, which exchange their partial (max, sum) or sum and write what they
  hold: each value read once (``ops/_row_split.py``).
* ``_row_backward`` / ``_tile_backward``: the fused gradient
  ``scale * y * (g - sum(g*y))`` or ``scale * (g - exp(y) * sum(g))``, one
  pass when the row fits a block, else a reducing pass and a writing pass.

-inf safety: a maximum of ``-inf`` (a fully masked row, or the lanes not yet
touched by the online pass) is replaced by 0 before it is subtracted, so
``exp(-inf - -inf)`` never produces NaN; a row whose sum of exponentials is 0
gives zeros (log-softmax: ``-inf``).

Addressing: every offset is formed in int64 (``program_id`` and column
indices are widened before they meet a stride), so tensors of more than
2**31 elements are addressed correctly.

The block limits are module constants read at call time; the interpreter
tests lower them to exercise the multi-block paths on small tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._core import tuning
from ..._core.dtypes import accumulation_dtype
from ..._core.kernel_spec import KernelSpec
from ..._core.layout import three_groups
from .._row_split import SPIN, spin, split_buffers, split_count, split_piece, wait_for_pieces
from .contract import output_like, wrap_dim

# Longest row held in registers in one block: 32768 fp32 values at 32 warps
# is 32 values per thread, within the register file of current GPUs without
# spilling; longer rows take the two-pass online path.
MAX_FUSED_BLOCK = 32768
# Longer rows are cut into pieces of SPLIT_BLOCK values, one program each
# (16 warps, 32 values per thread), which exchange their (max, sum) and
# normalise what they hold: each value read once (ops/_row_split.py). Rows
# of more than MAX_SPLITS pieces (1M values), and tuned configurations
# without "split", take the one-program two-pass path.
SPLIT_BLOCK = 16384
# Chunk of the online (two-pass) path: 4096 values per iteration at 4 warps
# (_row_warps) keep 32 values per thread in flight, enough to cover memory
# latency, while leaving registers for the per-lane running max and sum.
ONLINE_BLOCK = 4096
# Tiles of the inner > 1 kernels: up to 8192 values in registers per program;
# BLOCK_I up to 64 columns = 128 bytes of fp16 per tile row along the
# unit-stride inner dimension (a full cache line of 16-bit data).
MAX_TILE = 8192
MAX_TILE_COLUMNS = 64
# Before a reduced dimension too long for a MAX_TILE_COLUMNS-wide tile takes
# the two-pass path, the tile narrows down to this many columns (32 bytes
# of fp16, 64 of fp32: whole sectors, and at least one 128-bit access per
# thread and tile row), so dim=1 of 256 channels is read once.
MIN_TILE_COLUMNS = 16


def _sector(element_size: int) -> int:
    # 32 bytes (one DRAM sector) in elements: a causal row's loads end on one.
    return max(1, 32 // element_size)


def _row_warps(block: int) -> int:
    # One warp per 1K values (32 per thread), at least 4 so short rows still
    # issue wide loads, at most 32 (1024 threads, a block's maximum).
    return max(4, min(32, block // 1024))


def _tile_warps(tile: int) -> int:
    return 4 if tile <= 2048 else 8


def _partial_dtype(acc) -> torch.dtype:
    return torch.float64 if acc == tl.float64 else torch.float32


def _acc(*dtypes: torch.dtype):
    """The Triton type of ``accumulation_dtype(*dtypes)``."""
    return getattr(tl, str(accumulation_dtype(*dtypes)).split(".")[-1])


def _groups(t: torch.Tensor, dim: int):
    """``t`` as (outer, reduced, inner) around ``dim``; a 0-dim tensor as one row of one value."""
    return three_groups(t, (dim,)) if t.dim() > 0 else three_groups(t.reshape(1), (0,))


def _readable(t: torch.Tensor, dim: int):
    """``(t or a contiguous copy, its groups)``: the copy is made only when the
    dimensions around ``dim`` do not merge (the documented input-sized copy)."""
    groups = _groups(t, dim)
    if groups is None:
        t = t.contiguous()
        groups = _groups(t, dim)
    return t, groups


@triton.jit
def _tile_indices(inner, inner_blocks, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """This program's outer index, the ``BLOCK_R`` row offsets of a tile, its
    ``BLOCK_I`` inner columns and which of those exist (all int64)."""
    pid = tl.program_id(0).to(tl.int64)
    columns = (pid % inner_blocks) * BLOCK_I + tl.arange(0, BLOCK_I).to(tl.int64)
    return pid // inner_blocks, tl.arange(0, BLOCK_R).to(tl.int64), columns, columns < inner


@triton.jit
def _finite_shift(maximum):
    # A maximum of -inf (nothing but -inf seen yet) shifts by 0, so exp never sees -inf - -inf.
    return tl.where(maximum == float("-inf"), 0.0, maximum)


@triton.jit
def _softmax_in_registers(z, LOG: tl.constexpr, AXIS: tl.constexpr):
    """(Log-)softmax along ``AXIS`` of values held in registers (-inf outside the row)."""
    shift = tl.expand_dims(_finite_shift(tl.max(z, axis=AXIS)), AXIS)
    exps = tl.exp(z - shift)
    total = tl.expand_dims(tl.sum(exps, axis=AXIS), AXIS)
    safe_total = tl.where(total == 0, 1.0, total)  # no 0/0 or log(0) even in discarded lanes
    if LOG:
        result = tl.where(total == 0, float("-inf"), (z - shift) - tl.log(safe_total))
    else:
        result = tl.where(total == 0, 0.0, exps / safe_total)
    return result


@triton.jit
def _online_step(lane_max, lane_sum, z):
    """One block of the online pass: the running per-lane maximum and sum of
    exponentials, the sum rescaled by exp(old_max - new_max)."""
    new_max = tl.maximum(lane_max, z)
    # _finite_shift written out: through the nested call the tile kernel
    # compiled to more registers on sm_90, and fitted one block fewer per SM.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    return new_max, lane_sum * tl.exp(lane_max - shift) + tl.exp(z - shift)


@triton.jit
def _online_totals(lane_max, lane_sum):
    """From the online pass (along axis 0): the shift, the sum of
    exponentials, the log of that sum and its inverse (0 for an empty row)."""
    shift = _finite_shift(tl.max(lane_max, axis=0))
    total = tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0)
    safe_total = tl.where(total == 0, 1.0, total)
    return shift, total, tl.log(safe_total), tl.where(total == 0, 0.0, 1.0 / safe_total)


@triton.jit
def _online_result(z, shift, total, log_total, inverse, LOG: tl.constexpr):
    if LOG:
        result = tl.where(total == 0, float("-inf"), (z - shift) - log_total)
    else:
        result = tl.exp(z - shift) * inverse
    return result


@triton.jit
def _grad_total(g, y, LOG: tl.constexpr, AXIS: tl.constexpr):
    """sum(g) for log-softmax, sum(g * y) for softmax, along ``AXIS``."""
    if LOG:
        total = tl.sum(g, axis=AXIS)
    else:
        total = tl.sum(g * y, axis=AXIS)
    return total


@triton.jit
def _input_grad(g, y, total, scale, LOG: tl.constexpr):
    """scale * (g - exp(y) * sum(g)) for log-softmax, scale * y * (g - sum(g * y)) for softmax."""
    if LOG:
        result = (g - tl.exp(y) * total) * scale
    else:
        result = y * (g - total) * scale
    return result


@triton.jit
def _masked_scores(x_row, mask_row, cols, n_cols, x_col_stride, mask_col_stride, causal_row, scale,
                   MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr, SECTOR: tl.constexpr):
    """x * scale with the mask applied, -inf outside the row; cols is int64.

    A causal row reads x and the mask only up to its diagonal, rounded up to
    whole ``SECTOR``s (32 bytes of x, the unit memory moves): the rest of
    the row is -inf whatever it holds. The rounded bound is a multiple of
    SECTOR, so the loads stay as wide as without it."""
    inside = cols < n_cols
    read = inside
    if CAUSAL:
        read = inside & (cols < (causal_row // SECTOR + 1) * SECTOR)
    z = tl.load(x_row + cols * x_col_stride, mask=read, other=0.0).to(ACC) * scale
    if MASK_KIND == 1:  # bool: keep where True
        keep = tl.load(mask_row + cols * mask_col_stride, mask=read, other=0)
        z = tl.where(keep != 0, z, float("-inf"))
    if MASK_KIND == 2:  # floating: added after scaling
        z = z + tl.load(mask_row + cols * mask_col_stride, mask=read, other=0.0).to(ACC)
    if CAUSAL:
        z = tl.where(cols <= causal_row, z, float("-inf"))
    return tl.where(inside, z, float("-inf"))


@triton.jit
def _row_starts(row, size1, size2, x_ptr, sx0, sx1, sx2, mask_ptr, sm0, sm1, sm2, out_ptr, so0, so1, so2):
    """Where row ``row`` of the (size0, size1, size2) rows starts in x, the
    mask and the output, and its index along size2 (a causal mask's query)."""
    i2 = row % size2
    i1 = (row // size2) % size1
    i0 = row // (size2 * size1)
    return (x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2, mask_ptr + i0 * sm0 + i1 * sm1 + i2 * sm2,
            out_ptr + i0 * so0 + i1 * so1 + i2 * so2, i2)


@triton.jit
def _forward_rows(first, n_rows, x_ptr, mask_ptr, out_ptr, size1, size2,
                  sx0, sx1, sx2, sx3, sm0, sm1, sm2, sm3, so0, so1, so2, so3, n_cols, scale,
                  MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LOG: tl.constexpr, ACC: tl.constexpr,
                  SECTOR: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Rows ``first`` to ``first + ROWS - 1`` of a (size0, size1, size2,
    n_cols) view (dim 2 is the causal row), one per line of a [ROWS, BLOCK]
    block, each reduced along its line. A line past the last row reads the
    last row again and writes nothing. (A row count folded into each line's
    length, ``where(row < n_rows, n_cols, 0)``, made Triton 3.9 split every
    access into 16-bit ones; masks and-ed with the row test stay 128 bits.)"""
    rows = first + tl.arange(0, ROWS).to(tl.int64)
    read = tl.minimum(rows, n_rows - 1)
    x_rows, mask_rows, out_rows, i2 = _row_starts(read, size1, size2, x_ptr, sx0, sx1, sx2, mask_ptr, sm0, sm1, sm2,
                                                  out_ptr, so0, so1, so2)
    lanes = tl.arange(0, BLOCK).to(tl.int64)[None, :]
    z = _masked_scores(x_rows[:, None], mask_rows[:, None], lanes, n_cols, sx3, sm3, i2[:, None],
                       scale, MASK_KIND, CAUSAL, ACC, SECTOR)
    result = _softmax_in_registers(z, LOG, 1)
    out = out_rows[:, None] + lanes * so3
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=(lanes < n_cols) & (rows < n_rows)[:, None])


@triton.jit
def _row_forward(x_ptr, mask_ptr, out_ptr, n_rows, size1, size2,
                 sx0, sx1, sx2, sx3, sm0, sm1, sm2, sm3, so0, so1, so2, so3,
                 n_cols, scale,
                 MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LOG: tl.constexpr, SINGLE: tl.constexpr,
                 ACC: tl.constexpr, SECTOR: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                 PERSISTENT: tl.constexpr):
    # Rows held whole (SINGLE) come ROWS to a program: program p owns row
    # block p, or under PERSISTENT (a grid of a few programs per SM) blocks
    # p, p + programs, ... A longer row has a program of its own (ROWS 1).
    if SINGLE:
        if PERSISTENT:
            for first in range(tl.program_id(0).to(tl.int64) * ROWS, n_rows, tl.num_programs(0) * ROWS):
                _forward_rows(first, n_rows, x_ptr, mask_ptr, out_ptr, size1, size2, sx0, sx1, sx2, sx3,
                              sm0, sm1, sm2, sm3, so0, so1, so2, so3, n_cols, scale,
                              MASK_KIND, CAUSAL, LOG, ACC, SECTOR, BLOCK, ROWS)
        else:
            _forward_rows(tl.program_id(0).to(tl.int64) * ROWS, n_rows, x_ptr, mask_ptr, out_ptr, size1, size2,
                          sx0, sx1, sx2, sx3, sm0, sm1, sm2, sm3, so0, so1, so2, so3, n_cols, scale,
                          MASK_KIND, CAUSAL, LOG, ACC, SECTOR, BLOCK, ROWS)
    else:
        x_row, mask_row, out_row, i2 = _row_starts(tl.program_id(0).to(tl.int64), size1, size2, x_ptr, sx0, sx1, sx2,
                                                   mask_ptr, sm0, sm1, sm2, out_ptr, so0, so1, so2)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        lane_max = tl.full([BLOCK], float("-inf"), ACC)
        lane_sum = tl.zeros([BLOCK], ACC)
        for start in range(0, n_cols, BLOCK):
            z = _masked_scores(x_row, mask_row, start + lanes, n_cols, sx3, sm3, i2, scale, MASK_KIND, CAUSAL, ACC,
                               SECTOR)
            lane_max, lane_sum = _online_step(lane_max, lane_sum, z)
        shift, total, log_total, inverse = _online_totals(lane_max, lane_sum)
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            z = _masked_scores(x_row, mask_row, cols, n_cols, sx3, sm3, i2, scale, MASK_KIND, CAUSAL, ACC, SECTOR)
            result = _online_result(z, shift, total, log_total, inverse, LOG)
            tl.store(out_row + cols * so3, result.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _row_forward_split(x_ptr, mask_ptr, out_ptr, work_ptr, partial_ptr, size1, size2,
                       sx0, sx1, sx2, sx3, sm0, sm1, sm2, sm3, so0, so1, so2, so3,
                       n_cols, scale, splits, spin,
                       MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LOG: tl.constexpr, ACC: tl.constexpr,
                       SECTOR: tl.constexpr, BLOCK: tl.constexpr, PIECES: tl.constexpr):
    # One BLOCK-wide piece of a row per program (ops/_row_split.py), held in
    # registers from its one read to its write: the pieces' (max, sum of
    # exp) are merged as _online_totals merges lanes.
    row, piece = split_piece(work_ptr, splits)
    x_row, mask_row, out_row, i2 = _row_starts(row, size1, size2, x_ptr, sx0, sx1, sx2, mask_ptr, sm0, sm1, sm2,
                                               out_ptr, so0, so1, so2)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    cols = piece * BLOCK + lanes
    z = _masked_scores(x_row, mask_row, cols, n_cols, sx3, sm3, i2, scale, MASK_KIND, CAUSAL, ACC, SECTOR)
    piece_max = tl.max(z, axis=0)
    partials = partial_ptr + row * 2 * splits  # the row's maxima, then its sums
    tl.store(partials + piece, piece_max)
    tl.store(partials + splits + piece, tl.sum(tl.exp(z - _finite_shift(piece_max)), axis=0))
    pieces = tl.arange(0, PIECES)
    if wait_for_pieces(work_ptr + 1 + row, splits, spin):
        maxima = tl.load(partials + pieces, mask=pieces < splits, other=float("-inf"), volatile=True)
        sums = tl.load(partials + splits + pieces, mask=pieces < splits, other=0.0, volatile=True)
    else:
        maxima = tl.full([PIECES], float("-inf"), ACC)
        sums = tl.zeros([PIECES], ACC)
        for other in range(0, splits):
            other_z = _masked_scores(x_row, mask_row, other * BLOCK + lanes, n_cols, sx3, sm3, i2, scale,
                                     MASK_KIND, CAUSAL, ACC, SECTOR)
            other_max = tl.max(other_z, axis=0)
            maxima = tl.where(pieces == other, other_max, maxima)
            sums = tl.where(pieces == other, tl.sum(tl.exp(other_z - _finite_shift(other_max)), axis=0), sums)
        # the piece again, so its values need no registers during the loop
        z = _masked_scores(x_row, mask_row, cols, n_cols, sx3, sm3, i2, scale, MASK_KIND, CAUSAL, ACC, SECTOR)
    shift, total, log_total, inverse = _online_totals(maxima, sums)
    result = _online_result(z, shift, total, log_total, inverse, LOG)
    tl.store(out_row + cols * so3, result.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _tile_forward(x_ptr, out_ptr, reduced, inner, inner_blocks,
                  sxo, sxr, sxi, soo, sor, soi,
                  LOG: tl.constexpr, SINGLE: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    # Reduces along axis 0 of (BLOCK_R, BLOCK_I) tiles; the per-column
    # results broadcast back over the tile.
    outer_index, rows, columns, column_ok = _tile_indices(inner, inner_blocks, BLOCK_R, BLOCK_I)
    x_base = x_ptr + outer_index * sxo + columns[None, :] * sxi
    out_base = out_ptr + outer_index * soo + columns[None, :] * soi
    if SINGLE:
        inside = (rows[:, None] < reduced) & column_ok[None, :]
        z = tl.load(x_base + rows[:, None] * sxr, mask=inside, other=float("-inf")).to(ACC)
        result = _softmax_in_registers(z, LOG, 0)
        tl.store(out_base + rows[:, None] * sor, result.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        lane_max = tl.full([BLOCK_R, BLOCK_I], float("-inf"), ACC)
        lane_sum = tl.zeros([BLOCK_R, BLOCK_I], ACC)
        for start in range(0, reduced, BLOCK_R):
            r = start + rows
            inside = (r[:, None] < reduced) & column_ok[None, :]
            z = tl.load(x_base + r[:, None] * sxr, mask=inside, other=float("-inf")).to(ACC)
            lane_max, lane_sum = _online_step(lane_max, lane_sum, z)
        shift, total, log_total, inverse = _online_totals(lane_max, lane_sum)
        for start in range(0, reduced, BLOCK_R):
            r = start + rows
            inside = (r[:, None] < reduced) & column_ok[None, :]
            z = tl.load(x_base + r[:, None] * sxr, mask=inside, other=float("-inf")).to(ACC)
            result = _online_result(z, shift, total, log_total, inverse, LOG)
            tl.store(out_base + r[:, None] * sor, result.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _backward_rows(first, n_rows, g_ptr, y_ptr, out_ptr, sgo, sgr, syo, syr, soo, sor, n_cols, scale,
                   LOG: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """The gradient of rows ``first`` to ``first + ROWS - 1``, held whole,
    one per line of a [ROWS, BLOCK] block (a line past the last row: as
    _forward_rows)."""
    rows = first + tl.arange(0, ROWS).to(tl.int64)
    read = tl.minimum(rows, n_rows - 1)
    lanes = tl.arange(0, BLOCK).to(tl.int64)[None, :]
    inside = lanes < n_cols
    g = tl.load((g_ptr + read * sgo)[:, None] + lanes * sgr, mask=inside, other=0.0).to(ACC)
    y = tl.load((y_ptr + read * syo)[:, None] + lanes * syr, mask=inside, other=0.0).to(ACC)
    total = tl.expand_dims(_grad_total(g, y, LOG, 1), 1)
    result = _input_grad(g, y, total, scale, LOG)
    tl.store((out_ptr + rows * soo)[:, None] + lanes * sor, result.to(out_ptr.dtype.element_ty),
             mask=inside & (rows < n_rows)[:, None])


@triton.jit
def _row_backward(g_ptr, y_ptr, out_ptr, n_rows, sgo, sgr, syo, syr, soo, sor, n_cols, scale,
                  LOG: tl.constexpr, SINGLE: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr,
                  ROWS: tl.constexpr, PERSISTENT: tl.constexpr):
    # _row_forward's scheme: ROWS whole rows a program, or a persistent grid.
    if SINGLE:
        if PERSISTENT:
            for first in range(tl.program_id(0).to(tl.int64) * ROWS, n_rows, tl.num_programs(0) * ROWS):
                _backward_rows(first, n_rows, g_ptr, y_ptr, out_ptr, sgo, sgr, syo, syr, soo, sor, n_cols, scale,
                               LOG, ACC, BLOCK, ROWS)
        else:
            _backward_rows(tl.program_id(0).to(tl.int64) * ROWS, n_rows, g_ptr, y_ptr, out_ptr, sgo, sgr, syo, syr,
                           soo, sor, n_cols, scale, LOG, ACC, BLOCK, ROWS)
    else:
        pid = tl.program_id(0).to(tl.int64)
        g_row = g_ptr + pid * sgo
        y_row = y_ptr + pid * syo
        out_row = out_ptr + pid * soo
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        partial = tl.zeros([BLOCK], ACC)
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            inside = cols < n_cols
            g = tl.load(g_row + cols * sgr, mask=inside, other=0.0).to(ACC)
            if LOG:
                partial += g
            else:
                partial += g * tl.load(y_row + cols * syr, mask=inside, other=0.0).to(ACC)
        total = tl.sum(partial, axis=0)
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            inside = cols < n_cols
            g = tl.load(g_row + cols * sgr, mask=inside, other=0.0).to(ACC)
            y = tl.load(y_row + cols * syr, mask=inside, other=0.0).to(ACC)
            result = _input_grad(g, y, total, scale, LOG)
            tl.store(out_row + cols * sor, result.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _row_backward_split(g_ptr, y_ptr, out_ptr, work_ptr, partial_ptr, sgo, sgr, syo, syr, soo, sor, n_cols, scale,
                        splits, spin, LOG: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr,
                        PIECES: tl.constexpr):
    # _row_forward_split's scheme for the backward's one row reduction,
    # sum(g * y) (softmax) or sum(g) (log-softmax): g and y read once.
    row, piece = split_piece(work_ptr, splits)
    g_row = g_ptr + row * sgo
    y_row = y_ptr + row * syo
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    cols = piece * BLOCK + lanes
    inside = cols < n_cols
    g = tl.load(g_row + cols * sgr, mask=inside, other=0.0).to(ACC)
    y = tl.load(y_row + cols * syr, mask=inside, other=0.0).to(ACC)
    partials = partial_ptr + row * splits
    tl.store(partials + piece, _grad_total(g, y, LOG, 0))
    pieces = tl.arange(0, PIECES)
    if wait_for_pieces(work_ptr + 1 + row, splits, spin):
        sums = tl.load(partials + pieces, mask=pieces < splits, other=0.0, volatile=True)
    else:
        sums = tl.zeros([PIECES], ACC)
        for other in range(0, splits):
            other_cols = other * BLOCK + lanes
            other_inside = other_cols < n_cols
            other_g = tl.load(g_row + other_cols * sgr, mask=other_inside, other=0.0).to(ACC)
            other_y = tl.load(y_row + other_cols * syr, mask=other_inside, other=0.0).to(ACC)
            sums = tl.where(pieces == other, _grad_total(other_g, other_y, LOG, 0), sums)
        # the piece again, so its values need no registers during the loop
        g = tl.load(g_row + cols * sgr, mask=inside, other=0.0).to(ACC)
        y = tl.load(y_row + cols * syr, mask=inside, other=0.0).to(ACC)
    result = _input_grad(g, y, tl.sum(sums, axis=0), scale, LOG)
    tl.store(out_ptr + row * soo + cols * sor, result.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _tile_backward(g_ptr, y_ptr, out_ptr, reduced, inner, inner_blocks,
                   sgo, sgr, sgi, syo, syr, syi, soo, sor, soi, scale,
                   LOG: tl.constexpr, SINGLE: tl.constexpr, ACC: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    outer_index, rows, columns, column_ok = _tile_indices(inner, inner_blocks, BLOCK_R, BLOCK_I)
    g_base = g_ptr + outer_index * sgo + columns[None, :] * sgi
    y_base = y_ptr + outer_index * syo + columns[None, :] * syi
    out_base = out_ptr + outer_index * soo + columns[None, :] * soi
    if SINGLE:
        inside = (rows[:, None] < reduced) & column_ok[None, :]
        g = tl.load(g_base + rows[:, None] * sgr, mask=inside, other=0.0).to(ACC)
        y = tl.load(y_base + rows[:, None] * syr, mask=inside, other=0.0).to(ACC)
        total = _grad_total(g, y, LOG, 0)
        result = _input_grad(g, y, total, scale, LOG)
        tl.store(out_base + rows[:, None] * sor, result.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        partial = tl.zeros([BLOCK_R, BLOCK_I], ACC)
        for start in range(0, reduced, BLOCK_R):
            r = start + rows
            inside = (r[:, None] < reduced) & column_ok[None, :]
            g = tl.load(g_base + r[:, None] * sgr, mask=inside, other=0.0).to(ACC)
            if LOG:
                partial += g
            else:
                partial += g * tl.load(y_base + r[:, None] * syr, mask=inside, other=0.0).to(ACC)
        total = tl.sum(partial, axis=0)
        for start in range(0, reduced, BLOCK_R):
            r = start + rows
            inside = (r[:, None] < reduced) & column_ok[None, :]
            g = tl.load(g_base + r[:, None] * sgr, mask=inside, other=0.0).to(ACC)
            y = tl.load(y_base + r[:, None] * syr, mask=inside, other=0.0).to(ACC)
            result = _input_grad(g, y, total, scale, LOG)
            tl.store(out_base + r[:, None] * sor, result.to(out_ptr.dtype.element_ty), mask=inside)


# --------------------------------------------------------------------------- launch helpers


def _row_block(n_cols: int) -> tuple[int, bool]:
    """(BLOCK, whether the whole row fits in it)."""
    fused = triton.next_power_of_2(max(n_cols, 1))
    if fused <= MAX_FUSED_BLOCK:
        return fused, True
    return min(ONLINE_BLOCK, MAX_FUSED_BLOCK), False


def _tile_blocks(reduced: int, inner: int) -> tuple[int, int, bool]:
    """(BLOCK_R, BLOCK_I, single pass)."""
    block_i = min(triton.next_power_of_2(inner), MAX_TILE_COLUMNS, MAX_TILE)
    rows = triton.next_power_of_2(max(reduced, 1))
    narrow = block_i
    while rows * narrow > MAX_TILE and narrow > MIN_TILE_COLUMNS:
        narrow //= 2
    if rows * narrow <= MAX_TILE:
        return rows, narrow, True
    return max(1, MAX_TILE // block_i // 2), block_i, False


def _row_heuristic(n_cols: int, element_size: int) -> dict:
    block, single = _row_block(n_cols)
    if not single and split_count(n_cols, SPLIT_BLOCK, 1):
        return {"BLOCK": SPLIT_BLOCK, "num_warps": _row_warps(SPLIT_BLOCK), "split": True}
    rows = tuning.rows_per_program(block, element_size) if single else 1
    config = {"BLOCK": block, "num_warps": _row_warps(block * rows)}
    return dict(config, ROWS=rows) if rows > 1 else config


def _row_grid(config: dict, n_cols: int, rows: int, device: torch.device) -> tuple[bool, int, bool, int]:
    """(SINGLE, ROWS, PERSISTENT, programs) of a one-program row launch."""
    single = n_cols <= config["BLOCK"]
    return (single, *tuning.row_grid(config, single, rows, device))


def _split_count(config: dict, n_cols: int, rows: int) -> int:
    """How many programs share each row (0: none, the one-program paths): a
    configuration with ``split`` cuts rows into BLOCK-wide pieces."""
    return split_count(n_cols, config["BLOCK"], rows) if config.get("split") else 0


def _tile_heuristic(reduced: int, inner: int) -> dict:
    block_r, block_i, _ = _tile_blocks(reduced, inner)
    return {"BLOCK_R": block_r, "BLOCK_I": block_i, "num_warps": _tile_warps(block_r * block_i)}


def _tile_launcher(direction: str, reduced_stride: int) -> str:
    # A unit-stride reduced dimension (dim=1 of channels_last) is another
    # access pattern from a unit-stride inner one: tuned apart.
    return f"tile_{direction}" + ("_reduced_contiguous" if reduced_stride == 1 else "")


def _config(launcher: str, dtype: torch.dtype, device: torch.device, *sizes: int) -> dict:
    """The tuned configuration of this launch (``_core/tuning.py``), else the
    heuristic. Any configuration is correct: a row or tile column takes the
    one-block path exactly when the block covers it."""
    found = tuning.lookup("softmax", device, launcher, dtype, *sizes)
    config = found
    if found is None:
        config = _row_heuristic(*sizes, dtype.itemsize) if launcher.startswith("row") else _tile_heuristic(*sizes)
    tuning.note("softmax", launcher, dtype, sizes, config, found is not None)
    return config


def tuning_candidates(launcher: str, sizes: tuple[int, ...], dtype: torch.dtype) -> list[dict]:
    """What benchmarks/tune.py times for this launcher at these sizes: the
    heuristic and its neighbours (block halved or doubled, up to the row;
    rows per program halved or doubled and a persistent grid where the row
    is held whole; warps halved or doubled; 1 or 2 stages where the block
    loops)."""
    if launcher.startswith("row"):
        (n_cols,) = sizes
        heuristic = _row_heuristic(n_cols, dtype.itemsize)
        widest = triton.next_power_of_2(n_cols)
        loops = heuristic["BLOCK"] < n_cols and not heuristic.get("split")
        variations = {"BLOCK": [b for b in (heuristic["BLOCK"] // 2, heuristic["BLOCK"] * 2) if 256 <= b <= widest]}
        if heuristic.get("split"):  # the split row against the one-program two-pass path
            variations["split"] = [False]
        elif heuristic["BLOCK"] >= n_cols:
            rows = heuristic.get("ROWS", 1)
            variations["ROWS"] = [r for r in (rows // 2, rows * 2) if r >= 1]
            variations["persistent"] = [tuning.PERSISTENT_PROGRAMS]
        elements = lambda config: config["BLOCK"] * config.get("ROWS", 1)  # noqa: E731
    else:
        reduced, inner = sizes
        heuristic = _tile_heuristic(reduced, inner)
        loops = heuristic["BLOCK_R"] < reduced
        variations = {
            "BLOCK_R": [b for b in (heuristic["BLOCK_R"] // 2, heuristic["BLOCK_R"] * 2)
                        if 1 <= b <= triton.next_power_of_2(reduced)],
            "BLOCK_I": [b for b in (heuristic["BLOCK_I"] // 2, heuristic["BLOCK_I"] * 2)
                        if 1 <= b <= min(128, triton.next_power_of_2(inner))]}
        elements = lambda config: config["BLOCK_R"] * config["BLOCK_I"]  # noqa: E731
    variations["num_warps"] = [heuristic["num_warps"] // 2, heuristic["num_warps"] * 2]
    if loops:
        variations["num_stages"] = [1, 2]
    return tuning.around(heuristic, variations, elements)


def _launch_row_forward(x, mask, out, sizes, x_strides, mask_strides, out_strides, n_cols, scale, mask_kind,
                        causal, log, acc):
    rows = sizes[0] * sizes[1] * sizes[2]
    masked = mask_kind != 0 or causal
    config = _config("row_forward_masked" if masked else "row_forward", x.dtype, x.device, n_cols)
    splits = _split_count(config, n_cols, rows)
    if splits:
        work, partials = split_buffers(rows, splits, 2, _partial_dtype(acc), x.device)
        _row_forward_split[(rows * splits,)](
            x, mask if mask is not None else x, out, work, partials, sizes[1], sizes[2],
            *x_strides, *mask_strides, *out_strides, n_cols, scale, splits, spin(x.device),
            MASK_KIND=mask_kind, CAUSAL=causal, LOG=log, ACC=acc, SECTOR=_sector(x.element_size()),
            BLOCK=config["BLOCK"], PIECES=triton.next_power_of_2(splits), **tuning.launch_options(config),
        )
        return
    single, per_program, persistent, programs = _row_grid(config, n_cols, rows, x.device)
    _row_forward[(programs,)](
        x, mask if mask is not None else x, out, rows, sizes[1], sizes[2],
        *x_strides, *mask_strides, *out_strides, n_cols, scale,
        MASK_KIND=mask_kind, CAUSAL=causal, LOG=log, SINGLE=single, ACC=acc,
        SECTOR=_sector(x.element_size()), BLOCK=config["BLOCK"], ROWS=per_program, PERSISTENT=persistent,
        **tuning.launch_options(config),
    )


def softmax_forward(x: torch.Tensor, dim: int, log: bool, dtype) -> torch.Tensor:
    dim = wrap_dim(dim, x.dim())
    out_dtype = x.dtype if dtype is None else dtype
    out = output_like(x, dim, out_dtype)
    if x.numel() == 0:
        return out
    source, xg = _readable(x, dim)
    og = _groups(out, dim)
    acc = _acc(x.dtype, out_dtype)
    if xg.inner == 1:
        _launch_row_forward(source, None, out, (xg.outer, 1, 1), (xg.outer_stride, 0, 0, xg.reduced_stride),
                            (0, 0, 0, 0), (og.outer_stride, 0, 0, og.reduced_stride), xg.reduced, 1.0, 0, False,
                            log, acc)
        return out
    config = _config(_tile_launcher("forward", xg.reduced_stride), x.dtype, x.device, xg.reduced, xg.inner)
    inner_blocks = triton.cdiv(xg.inner, config["BLOCK_I"])
    _tile_forward[(xg.outer * inner_blocks,)](
        source, out, xg.reduced, xg.inner, inner_blocks,
        xg.outer_stride, xg.reduced_stride, xg.inner_stride, og.outer_stride, og.reduced_stride, og.inner_stride,
        LOG=log, SINGLE=xg.reduced <= config["BLOCK_R"], ACC=acc, BLOCK_R=config["BLOCK_R"],
        BLOCK_I=config["BLOCK_I"], **tuning.launch_options(config),
    )
    return out


def softmax_backward(grad: torch.Tensor, output: torch.Tensor, dim: int, log: bool, scale: float,
                     input_dtype: torch.dtype) -> torch.Tensor:
    dim = wrap_dim(dim, output.dim())
    out = output_like(output, dim, input_dtype)
    if output.numel() == 0:
        return out
    y, yg = _readable(output, dim)
    g, gg = _readable(grad, dim)
    og = _groups(out, dim)
    acc = _acc(grad.dtype, output.dtype, input_dtype)
    if yg.inner == 1:
        config = _config("row_backward", output.dtype, output.device, yg.reduced)
        splits = _split_count(config, yg.reduced, yg.outer)
        if splits:
            work, partials = split_buffers(yg.outer, splits, 1, _partial_dtype(acc), output.device)
            _row_backward_split[(yg.outer * splits,)](
                g, y, out, work, partials, gg.outer_stride, gg.reduced_stride, yg.outer_stride, yg.reduced_stride,
                og.outer_stride, og.reduced_stride, yg.reduced, float(scale), splits, spin(output.device),
                LOG=log, ACC=acc, BLOCK=config["BLOCK"], PIECES=triton.next_power_of_2(splits),
                **tuning.launch_options(config),
            )
            return out
        single, per_program, persistent, programs = _row_grid(config, yg.reduced, yg.outer, output.device)
        _row_backward[(programs,)](
            g, y, out, yg.outer, gg.outer_stride, gg.reduced_stride, yg.outer_stride, yg.reduced_stride,
            og.outer_stride, og.reduced_stride, yg.reduced, float(scale),
            LOG=log, SINGLE=single, ACC=acc, BLOCK=config["BLOCK"], ROWS=per_program, PERSISTENT=persistent,
            **tuning.launch_options(config),
        )
        return out
    config = _config(_tile_launcher("backward", yg.reduced_stride), output.dtype, output.device, yg.reduced,
                     yg.inner)
    inner_blocks = triton.cdiv(yg.inner, config["BLOCK_I"])
    _tile_backward[(yg.outer * inner_blocks,)](
        g, y, out, yg.reduced, yg.inner, inner_blocks,
        gg.outer_stride, gg.reduced_stride, gg.inner_stride, yg.outer_stride, yg.reduced_stride, yg.inner_stride,
        og.outer_stride, og.reduced_stride, og.inner_stride, float(scale),
        LOG=log, SINGLE=yg.reduced <= config["BLOCK_R"], ACC=acc, BLOCK_R=config["BLOCK_R"],
        BLOCK_I=config["BLOCK_I"], **tuning.launch_options(config),
    )
    return out


def _broadcast_strides(mask: torch.Tensor, shape) -> list[int]:
    """The mask's strides as seen from ``shape`` (0 where it broadcasts)."""
    strides = [0] * len(shape)
    offset = len(shape) - mask.dim()
    for d in range(mask.dim()):
        strides[offset + d] = 0 if mask.shape[d] == 1 else mask.stride(d)
    return strides


def _four_dims(shape, stride_lists):
    """Collapse ``shape`` (>= 2 dims; the last two kept) to 4 dims, merging
    leading dims where every tensor's strides nest; None if they do not."""
    leading = [(shape[d], [s[d] for s in stride_lists]) for d in range(len(shape) - 2) if shape[d] != 1]
    merged = []
    for size, strides in leading:
        if merged:
            prev_size, prev_strides = merged[-1]
            if all(p == s * size for p, s in zip(prev_strides, strides)):
                merged[-1] = (prev_size * size, strides)
                continue
        merged.append((size, strides))
    if len(merged) > 2:
        return None
    while len(merged) < 2:
        merged.insert(0, (1, [0] * len(stride_lists)))
    tail = [(shape[d], [s[d] for s in stride_lists]) for d in (len(shape) - 2, len(shape) - 1)]
    dims = merged + tail
    sizes = [size for size, _ in dims]
    return sizes, [[strides[t] for _, strides in dims] for t in range(len(stride_lists))]


def scaled_masked_softmax_forward(x: torch.Tensor, mask, scale: float, causal: bool) -> torch.Tensor:
    out = output_like(x, x.dim() - 1, x.dtype)
    if x.numel() == 0:
        return out
    mask_kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    mask_arg = None
    if mask is not None:
        mask_arg = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    shape = list(x.shape) if x.dim() >= 2 else [1] + list(x.shape)
    view_x = x if x.dim() >= 2 else x.unsqueeze(0)
    view_out = out if x.dim() >= 2 else out.unsqueeze(0)
    mask_strides = _broadcast_strides(mask, shape) if mask is not None else [0] * len(shape)
    collapsed = _four_dims(shape, [list(view_x.stride()), mask_strides, list(view_out.stride())])
    target = view_out
    if collapsed is None:
        # More than two leading dims that do not merge: read a contiguous x
        # and a materialised mask, write a contiguous result (documented copy).
        view_x = view_x.contiguous()
        if mask_arg is not None:
            mask_arg = mask_arg.expand(shape).contiguous()
            mask_strides = list(mask_arg.stride())
        target = torch.empty(shape, dtype=x.dtype, device=x.device)
        collapsed = _four_dims(shape, [list(view_x.stride()), mask_strides, list(target.stride())])
    sizes, (x_strides, m_strides, o_strides) = collapsed
    _launch_row_forward(view_x, mask_arg, target, sizes[:3], x_strides, m_strides, o_strides, sizes[3], scale,
                        mask_kind, causal, False, _acc(x.dtype))
    if target is not view_out:
        view_out.copy_(target)
    return out


__all__ = ["softmax_forward", "softmax_backward", "scaled_masked_softmax_forward", "MAX_FUSED_BLOCK",
           "ONLINE_BLOCK", "MAX_TILE"]



# --------------------------------------------------------------------------- kernel report

# Row lengths of benchmarks/bench_softmax.py's GPU cases (4096 x 32768 and the
# 2**27-element sweep), its NCHW dim=1 case and its causal attention rows.
BENCHMARK_ROWS = (1024, 4096, 16384, 32768, 65536, 262144)
BENCHMARK_TILE = (64, 256, 64 * 64)  # (outer, reduced, inner) of 64x256x64x64, dim=1
BENCHMARK_ATTENTION = (16, 32, 1024, 1024)
REPORT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _reread(what: str, values: int, size: int) -> str:
    """Why the two-pass path reads its input twice."""
    return (f"a {what} of {values} values ({values * size // 1024} KiB) is more than one program holds in registers "
            f"(MAX_FUSED_BLOCK = {MAX_FUSED_BLOCK}, MAX_TILE = {MAX_TILE}), so the two-pass path reads it again; "
            f"reading it once needs the row split over programs that exchange (max, sum)")


def causal_fraction(length: int, size: int) -> float:
    """The share of a causal (length x length) score matrix that is read:
    row i up to its diagonal, rounded up to a whole 32-byte sector (what a
    perfect kernel reads too: memory moves whole sectors)."""
    sector = _sector(size)
    return sum(min(length, (i // sector + 1) * sector) for i in range(length)) / (length * length)


def bytes_per_element(direction: str, size: int, single: bool, log: bool) -> tuple[float, float]:
    """(bytes this kernel moves per input element, the roofline). Forward
    reads x and writes y; backward reads g and y and writes dx. A row that
    does not fit one block is read twice (the online pass, then the writing
    pass); the backward's first pass of softmax reads y too."""
    if direction == "forward":
        return (2 if single else 3) * size, 2 * size
    if single:
        return 3 * size, 3 * size
    return (4 if log else 5) * size, 3 * size


_ONLINE_REREAD = ("the one-program two-pass path, which a row takes only beyond MAX_SPLITS pieces or under a tuned "
                  "configuration without split (the benchmark rows are split): its second pass reads the row again")
_PARTIALS = "a row's per-piece partials, at most MAX_SPLITS values: not bandwidth-bound"


def _split_specs(dtype: torch.dtype, n_cols: int, seen: set):
    """The split kernels for rows of ``n_cols`` (``_row_heuristic``): each
    value read once, its result written once, as a perfect kernel must."""
    config = _row_heuristic(n_cols, dtype.itemsize)
    block, warps = config["BLOCK"], config["num_warps"]
    splits = triton.cdiv(n_cols, block)
    pieces = triton.next_power_of_2(splits)
    if ("split", block, pieces) in seen:
        return
    seen.add(("split", block, pieces))
    size, acc = dtype.itemsize, _acc(dtype)
    partial = torch.float64 if dtype == torch.float64 else torch.float32
    for log in (False, True):
        label = f"{str(dtype)[6:]} cols={n_cols} BLOCK={block} split x{splits}" + (" log" if log else "")
        forward = dict(x_ptr=dtype, mask_ptr=dtype, out_ptr=dtype, work_ptr=torch.int32, partial_ptr=partial,
                       size1=1, size2=1, sx0=n_cols, sx1=0, sx2=0, sx3=1, sm0=0, sm1=0, sm2=0, sm3=0, so0=n_cols,
                       so1=0, so2=0, so3=1, n_cols=n_cols, scale=1.0, splits=splits, spin=SPIN)
        yield KernelSpec(_row_forward_split, forward,
                         dict(MASK_KIND=0, CAUSAL=False, LOG=log, ACC=acc, SECTOR=_sector(size), BLOCK=block,
                              PIECES=pieces), warps, label, *bytes_per_element("forward", size, True, log),
                         {"partial_ptr": _PARTIALS})
        backward = dict(g_ptr=dtype, y_ptr=dtype, out_ptr=dtype, work_ptr=torch.int32, partial_ptr=partial,
                        sgo=n_cols, sgr=1, syo=n_cols, syr=1, soo=n_cols, sor=1, n_cols=n_cols, scale=1.0,
                        splits=splits, spin=SPIN)
        yield KernelSpec(_row_backward_split, backward, dict(LOG=log, ACC=acc, BLOCK=block, PIECES=pieces), warps,
                         label, *bytes_per_element("backward", size, True, log), {"partial_ptr": _PARTIALS})


def _row_specs(dtype: torch.dtype, n_cols: int, block: int, single: bool, per_program: int, persistent: bool):
    """The one-program row kernels at rows of ``n_cols``, forward and
    backward, softmax and log-softmax, over the bench's 2**27 values."""
    size, acc = dtype.itemsize, _acc(dtype)
    rows = 2**27 // n_cols
    warps = _row_warps(block * per_program)
    shape = f"cols={n_cols} BLOCK={block}" + (f" ROWS={per_program}" if per_program > 1 else "") + \
        (" persistent" if persistent else "") + ("" if single else " online")
    reread = "" if single else _ONLINE_REREAD
    flags = dict(SINGLE=single, ACC=acc, BLOCK=block, ROWS=per_program, PERSISTENT=persistent)
    for log in (False, True):
        config = f"{str(dtype)[6:]} {shape}" + (" log" if log else "")
        # a contiguous (rows, n_cols) tensor, as the launcher passes it
        forward = dict(x_ptr=dtype, mask_ptr=dtype, out_ptr=dtype, n_rows=rows, size1=1, size2=1, sx0=n_cols,
                       sx1=0, sx2=0, sx3=1, sm0=0, sm1=0, sm2=0, sm3=0, so0=n_cols, so1=0, so2=0, so3=1,
                       n_cols=n_cols, scale=1.0)
        yield KernelSpec(_row_forward, forward, dict(MASK_KIND=0, CAUSAL=False, LOG=log, SECTOR=_sector(size),
                                                     **flags),
                         warps, config, *bytes_per_element("forward", size, single, log), reread=reread)
        backward = dict(g_ptr=dtype, y_ptr=dtype, out_ptr=dtype, n_rows=rows, sgo=n_cols, sgr=1, syo=n_cols, syr=1,
                        soo=n_cols, sor=1, n_cols=n_cols, scale=1.0)
        yield KernelSpec(_row_backward, backward, dict(LOG=log, **flags), warps, config,
                         *bytes_per_element("backward", size, single, log), reread=reread)


def kernel_specialisations():
    """Every (kernel, dtype, configuration) the launchers pick at the
    benchmark shapes, through the launchers' own block and warp choices
    (``_row_block``, ``_row_warps``, ``_tile_blocks``, ``_tile_warps``)."""
    for dtype in REPORT_DTYPES:
        size = dtype.itemsize
        acc = _acc(dtype)
        seen = set()
        for n_cols in BENCHMARK_ROWS:
            block, single = _row_block(n_cols)
            if _row_heuristic(n_cols, size).get("split"):
                yield from _split_specs(dtype, n_cols, seen)
                # what a tuned configuration without "split" runs at this row
                n_cols, single = ONLINE_BLOCK * 16, False
                block = _row_block(n_cols)[0]
            per_program = _row_heuristic(n_cols, size).get("ROWS", 1) if single else 1
            # rows held whole several to a program also as a persistent grid
            # (the sweep's candidate), so its code is checked as well
            for persistent in (False, True) if per_program > 1 else (False,):
                if (block, single, per_program, persistent) in seen:
                    continue
                seen.add((block, single, per_program, persistent))
                yield from _row_specs(dtype, n_cols, block, single, per_program, persistent)
        outer, reduced, inner = BENCHMARK_TILE
        block_r, block_i, single = _tile_blocks(reduced, inner)
        inner_blocks = triton.cdiv(inner, block_i)
        warps = _tile_warps(block_r * block_i)
        for log in (False, True):
            config = f"{str(dtype)[6:]} dim=1 of 64x256x64x64 BLOCK={block_r}x{block_i}" + (" log" if log else "")
            strides = dict(reduced=reduced, inner=inner, inner_blocks=inner_blocks)
            forward = dict(x_ptr=dtype, out_ptr=dtype, **strides, sxo=reduced * inner, sxr=inner, sxi=1,
                           soo=reduced * inner, sor=inner, soi=1)
            reread = "" if single else _reread("reduced dimension", reduced, size)
            yield KernelSpec(_tile_forward, forward, dict(LOG=log, SINGLE=single, ACC=acc, BLOCK_R=block_r,
                                                          BLOCK_I=block_i), warps, config,
                             *bytes_per_element("forward", size, single, log), reread=reread)
            backward = dict(g_ptr=dtype, y_ptr=dtype, out_ptr=dtype, **strides, sgo=reduced * inner, sgr=inner,
                            sgi=1, syo=reduced * inner, syr=inner, syi=1, soo=reduced * inner, sor=inner, soi=1,
                            scale=1.0)
            yield KernelSpec(_tile_backward, backward, dict(LOG=log, SINGLE=single, ACC=acc, BLOCK_R=block_r,
                                                            BLOCK_I=block_i), warps, config,
                             *bytes_per_element("backward", size, single, log), reread=reread)
        # scaled_masked_softmax, causal, with a (L, L) bool mask broadcast over
        # batch and heads. Each row reads x and the mask up to its diagonal
        # (whole sectors: causal_fraction) and writes the whole row, as a
        # perfect kernel must; the 1 MiB mask stays in L2, so it comes from
        # memory once for all batch x heads copies (its bytes per element
        # are that share).
        batch, heads, length, _ = BENCHMARK_ATTENTION
        block, single = _row_block(length)
        per_program = _row_heuristic(length, size).get("ROWS", 1) if single else 1
        warps = _row_warps(block * per_program)
        masked = dict(x_ptr=dtype, mask_ptr=torch.uint8, out_ptr=dtype, n_rows=batch * heads * length, size1=heads,
                      size2=length,
                      sx0=heads * length * length, sx1=length * length, sx2=length, sx3=1, sm0=0, sm1=0, sm2=length,
                      sm3=1, so0=heads * length * length, so1=length * length, so2=length, so3=1, n_cols=length,
                      scale=length ** -0.5)
        read = causal_fraction(length, size)
        mask_once = causal_fraction(length, 1) / (batch * heads)
        moved = read * size + size + mask_once
        roofline = read * size + size + mask_once
        if not single:
            moved += read * size
        # a thread's share of one row's one-byte mask values
        mask_bytes = block * per_program // (32 * warps)
        narrow = {} if mask_bytes >= 16 else {
            "mask_ptr": f"{mask_bytes} mask bytes per thread ({per_program}x{block} over {warps} warps): one "
                        f"{8 * mask_bytes}-bit load is the whole share"}
        if size == 4 and not narrow:
            # what the report reads in the PTX: x's 128-bit loads in pairs
            narrow = {"mask_ptr": "Triton lays a float32 row out in runs of 8 values a thread (two 128-bit loads "
                                  "of x), so the mask of a run is one 64-bit load"}
        yield KernelSpec(_row_forward, masked, dict(MASK_KIND=1, CAUSAL=True, LOG=False, SINGLE=single, ACC=acc,
                                                    SECTOR=_sector(size), BLOCK=block, ROWS=per_program,
                                                    PERSISTENT=False), warps,
                         f"{str(dtype)[6:]} causal+bool mask {'x'.join(map(str, BENCHMARK_ATTENTION))}"
                         + (f" ROWS={per_program}" if per_program > 1 else ""),
                         moved, roofline, narrow, reread="" if single else _reread("row", length, size))
