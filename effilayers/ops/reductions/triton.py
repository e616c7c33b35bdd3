"""Triton kernel for ``effilayers::reduce`` (sum, mean, var, std, 2-norm).

``reduce_op_triton`` is the op's kernel: it views the input as (outer,
reduced, inner) (``contract.as_three``) and hands the view and a contiguous
(outer, inner) output to ``reduce_triton``, the launcher. A program owns one outer index and a tile of
``BLOCK_I`` adjacent inner indices (``BLOCK_I == 1`` when the reduced values
of one output are what is contiguous) and walks its share of the reduced
range in ``[BLOCK_R, BLOCK_I]`` tiles, accumulating in float32 per column.

Overflow: for bf16/fp32 input (``SCALED``) every tile is multiplied by 2^-k,
k the exponent of the column's largest magnitude in that tile (exact: a
power of two), and the running result carries its own exponent E (it means
``acc * 2^E``, or ``2^2E`` for squares and M2). When a tile raises E the
running values are rescaled by 2^(E_old - E_new). Scaled values are below 2,
so sums, squares and M2 stay far from float32's limit in a single pass over
the data. fp16 input cannot overflow float32 sums of squares, so it skips
the scaling (``SCALED=False``) and E stays 0.

var/std: a two-pass mean/M2 inside each tile (the tile is in registers), tiles
merged with Chan's formula, so a large mean keeps the variance's digits.

Few outputs and a long reduced range (a full reduction of a large tensor):
the range is split across programs (about 4 per SM), each writing a partial
(value, M2, exponent); the partials are combined in float64 with PyTorch ops
on the device (Chan's formula and the exponents), which also forms the final
result (division by n, sqrt) before its one rounding to the output dtype.
All offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._core import tuning
from ..._core.dtypes import accumulation_dtype
from ..._core.kernel_spec import KernelSpec
from .contract import run_three

# One tile holds at most 4096 values: 16 KiB of float32 spread over 4 warps
# (32 values per thread), enough loads in flight to keep a memory-bound loop
# fed without spilling registers. Tests lower it to cover the multi-tile paths.
TILE_ELEMENTS = 4096
# Up to 64 adjacent outputs per program: 64 contiguous fp16/bf16 values are
# 128 bytes, one full cache line per reduced row when the inner stride is 1.
MAX_BLOCK_I = 64
NUM_WARPS = 4
# Split the reduced range while the grid has fewer programs than this
# (about 4 per SM on an H100's 132 SMs); tests lower it.
TARGET_PROGRAMS = 528

# Contiguous rows shorter than this are reduced 64 rows per program.
SHORT_ROW = 64
# Neither softmax's rows per program nor its persistent grid is added here.
# This kernel already takes several outputs a program (BLOCK_I adjacent
# outputs; 64 short rows through _tile_view) and sizes its grid itself when
# outputs are few (the split, about TARGET_PROGRAMS); at the benchmark shape
# a row is 16384 values, 32 KiB of bf16 a program, past the 16 KiB that
# tuning.rows_per_program aims at. A persistent loop would not overlap a
# program's next tile with its reductions: Triton keeps plain loads in such
# loops (tuning.PERSISTENT_PROGRAMS says how that was seen). Rows of 64 to
# 2K values still get a program each: no benchmark shape has them yet.

_PARTIAL = {"sum": 0, "mean": 0, "norm": 1, "var": 2, "std": 2}


@triton.jit
def _pow2(d):
    # 2^d for an int32 d <= 127, exactly, built from its exponent bits; below
    # 2^-126 it is 0 (what is scaled by it is below float32's resolution of
    # the running result).
    bits = (tl.maximum(d, -126) + 127) << 23
    return tl.where(d < -126, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _reduce_kernel(x_ptr, a_ptr, b_ptr, e_ptr, reduced, inner, stride_o, stride_r, stride_i, rows_per_split, splits,
                   PARTIAL: tl.constexpr, SCALED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    ACC = a_ptr.dtype.element_ty  # the partials are in the accumulation dtype
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    i_blocks = tl.cdiv(inner, BLOCK_I)
    o = pid // i_blocks
    cols = (pid % i_blocks) * BLOCK_I + tl.arange(0, BLOCK_I).to(tl.int64)
    col_mask = cols < inner
    r_begin = split * rows_per_split
    r_end = tl.minimum(r_begin + rows_per_split, reduced)
    base = x_ptr + o * stride_o + cols[None, :] * stride_i

    acc = tl.zeros([BLOCK_I], dtype=ACC)  # sum, sum of squares or mean
    m2 = tl.zeros([BLOCK_I], dtype=ACC)
    count = tl.zeros([BLOCK_I], dtype=ACC)
    exponent = tl.full([BLOCK_I], -126, dtype=tl.int32)
    for r0 in range(r_begin, r_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (rows[:, None] < r_end) & col_mask[None, :]
        v = tl.load(base + rows[:, None] * stride_r, mask=mask, other=0.0).to(ACC)
        if SCALED:
            largest = tl.max(tl.abs(v), axis=0)
            k = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2) of normal values
            k = tl.minimum(tl.maximum(k, -126), 126)
            new_exponent = tl.maximum(exponent, k)
            v = v * _pow2(-k)[None, :]
            to_new = _pow2(k - new_exponent)  # tile units -> running units (<= 1)
            rescale = _pow2(exponent - new_exponent)  # old running units -> new ones (<= 1)
            exponent = new_exponent
        if PARTIAL == 0:
            tile = tl.sum(v, axis=0)
            if SCALED:
                acc = acc * rescale + tile * to_new
            else:
                acc += tile
        elif PARTIAL == 1:
            tile = tl.sum(v * v, axis=0)
            if SCALED:
                acc = acc * (rescale * rescale) + tile * (to_new * to_new)
            else:
                acc += tile
        else:
            n = tl.sum(mask.to(ACC), axis=0)
            safe_n = tl.maximum(n, 1.0)
            # Shifted by the tile's first row, then centred again (corrected
            # two-pass): constant data gives M2 exactly 0 however large it is,
            # and the mean's rounding does not leak into M2.
            first = tl.sum(tl.where(rows[:, None] == r0, v, 0.0), axis=0)
            tile_mean = first + tl.sum(tl.where(mask, v - first[None, :], 0.0), axis=0) / safe_n
            centered = tl.where(mask, v - tile_mean[None, :], 0.0)
            centered_sum = tl.sum(centered, axis=0)
            tile_m2 = tl.maximum(tl.sum(centered * centered, axis=0) - centered_sum * centered_sum / safe_n, 0.0)
            if SCALED:
                acc = acc * rescale
                m2 = m2 * (rescale * rescale)
                tile_mean = tile_mean * to_new
                tile_m2 = tile_m2 * (to_new * to_new)
            total = count + n
            safe_total = tl.maximum(total, 1.0)
            delta = tile_mean - acc
            acc = acc + delta * (n / safe_total)
            m2 = m2 + tile_m2 + delta * delta * (count * n / safe_total)
            count = total
    out_index = (o * inner + cols) * splits + split
    tl.store(a_ptr + out_index, acc, mask=col_mask)
    if PARTIAL == 2:
        tl.store(b_ptr + out_index, m2, mask=col_mask)
    if SCALED:
        tl.store(e_ptr + out_index, exponent, mask=col_mask)


def _heuristic(outer: int, reduced: int, inner: int) -> dict:
    block_i = 1 if inner == 1 else min(MAX_BLOCK_I, triton.next_power_of_2(inner))
    block_r = max(1, min(TILE_ELEMENTS // block_i, triton.next_power_of_2(max(reduced, 1))))
    programs = outer * triton.cdiv(inner, block_i)
    splits = 1
    if programs < TARGET_PROGRAMS and reduced > 2 * block_r:
        splits = min(triton.cdiv(reduced, block_r), triton.cdiv(TARGET_PROGRAMS, programs))
    return {"BLOCK_R": block_r, "BLOCK_I": block_i, "splits": splits, "num_warps": NUM_WARPS}


def _launcher(partial: int) -> str:
    return f"reduce_{('sum', 'norm', 'var')[partial]}"


def _config(outer: int, reduced: int, inner: int, partial: int = 0, dtype: torch.dtype = torch.float32,
            device: torch.device = torch.device("cpu")):
    """(BLOCK_R, BLOCK_I, splits, rows_per_split, launch options): the tuned
    configuration of this launch (``_core/tuning.py``), else the heuristic.
    Any configuration is correct: the split count is what ``splits`` rows
    per split, rounded to whole tiles, come to."""
    found = tuning.lookup("reductions", device, _launcher(partial), dtype, outer, reduced, inner)
    config = found if found is not None else _heuristic(outer, reduced, inner)
    tuning.note("reductions", _launcher(partial), dtype, (outer, reduced, inner), config, found is not None)
    block_r = config["BLOCK_R"]
    rows_per_split = triton.cdiv(triton.cdiv(reduced, config["splits"]), block_r) * block_r
    splits = triton.cdiv(reduced, rows_per_split)
    return block_r, config["BLOCK_I"], splits, rows_per_split, tuning.launch_options(config)


def tuning_candidates(launcher: str, sizes: tuple[int, ...], dtype: torch.dtype) -> list[dict]:
    """What benchmarks/tune.py times for ``reduce_triton`` at these (outer,
    reduced, inner) sizes (as the kernel walks them, ``_tile_view``): the
    heuristic and its neighbours (tile rows and columns, warps, and the
    split count where the range is split, each halved or doubled; 1 or 2
    stages)."""
    outer, reduced, inner = sizes
    heuristic = _heuristic(outer, reduced, inner)
    variations = {
        "BLOCK_R": [b for b in (heuristic["BLOCK_R"] // 2, heuristic["BLOCK_R"] * 2)
                    if 1 <= b <= triton.next_power_of_2(reduced)],
        "BLOCK_I": [b for b in (heuristic["BLOCK_I"] // 2, heuristic["BLOCK_I"] * 2)
                    if inner > 1 and 1 <= b <= min(2 * MAX_BLOCK_I, triton.next_power_of_2(inner))],
        "num_warps": [NUM_WARPS // 2, NUM_WARPS * 2],
        "num_stages": [1, 2],
    }
    if heuristic["splits"] > 1:
        variations["splits"] = [heuristic["splits"] // 2, heuristic["splits"] * 2]
    return tuning.around(heuristic, variations, lambda config: config["BLOCK_R"] * config["BLOCK_I"])


def _tile_view(outer: int, reduced: int, inner: int, strides) -> tuple[int, int, tuple[int, int, int]]:
    """(outer, inner, strides) as the kernel walks them."""
    stride_o, stride_r, stride_i = strides
    if inner == 1 and outer > 1 and (stride_r != 1 or reduced < SHORT_ROW):
        # Make the outer index the tile's columns: adjacent outputs sit next
        # to each other along it (a transposed matrix), or the rows are so
        # short that one program per row would idle most of its lanes (a
        # tile of 64 short contiguous rows is one contiguous chunk).
        # Output order is unchanged.
        return 1, outer, (0, stride_r, stride_o)
    return outer, inner, (stride_o, stride_r, stride_i)


def reduce_op_triton(x: torch.Tensor, dims: list[int], kind: str, correction: float, keepdim: bool,
                     dtype) -> torch.Tensor:
    """``effilayers::reduce`` on this backend."""
    return run_three(reduce_triton, x, dims, kind, correction, keepdim, dtype)


def reduce_triton(x: torch.Tensor, out: torch.Tensor, kind: str, correction: float) -> None:
    """The (outer, reduced, inner) view ``x`` reduced over dim 1 into ``out``."""
    outer, reduced, inner = x.shape
    if out.numel() == 0:
        return
    outer, inner, (stride_o, stride_r, stride_i) = _tile_view(outer, reduced, inner, x.stride())
    partial = _PARTIAL[kind]
    if reduced == 0:
        wide = torch.zeros(out.shape, dtype=torch.float64, device=x.device)
        out.copy_(_finish(kind, wide, wide, 0, correction))
        return
    block_r, block_i, splits, rows_per_split, options = _config(outer, reduced, inner, partial, x.dtype, x.device)
    outputs = outer * inner
    # float64 input accumulates in float64 (no scaling: not part of the
    # fp16/bf16 contract); everything else in float32.
    acc = accumulation_dtype(x.dtype)
    a = torch.empty(outputs * splits, dtype=acc, device=x.device)
    b = torch.empty_like(a) if partial == 2 else a
    scaled = x.dtype in (torch.bfloat16, torch.float32)
    e = torch.empty(outputs * splits, dtype=torch.int32, device=x.device) if scaled else a
    grid = (outer * triton.cdiv(inner, block_i), splits)
    _reduce_kernel[grid](x, a, b, e, reduced, inner, stride_o, stride_r, stride_i, rows_per_split, splits,
                         PARTIAL=partial, SCALED=scaled, BLOCK_R=block_r, BLOCK_I=block_i, **options)
    shape = (outputs, splits)
    power = e.view(shape).to(torch.float64) if scaled else torch.zeros(shape, dtype=torch.float64, device=x.device)
    value = a.view(shape).to(torch.float64)
    scale = 2 if partial == 1 else 1
    value = torch.ldexp(value, scale * power)
    m2 = torch.ldexp(b.view(shape).to(torch.float64), 2 * power) if partial == 2 else torch.zeros_like(value)
    counts = torch.clamp(reduced - torch.arange(splits, device=x.device, dtype=torch.float64) * rows_per_split,
                         max=rows_per_split)
    if partial == 2:
        # Chan's formula over the splits, in float64.
        mean = (value * counts).sum(1) / reduced
        m2 = m2.sum(1) + (counts * (value - mean[:, None]) ** 2).sum(1)
        value = mean
    else:
        value = value.sum(1)
        m2 = torch.zeros_like(value)
    out.copy_(_finish(kind, value, m2, reduced, correction).view(out.shape))


def _finish(kind: str, value: torch.Tensor, m2: torch.Tensor, count: int, correction: float) -> torch.Tensor:
    """The result in float64 from the combined sum / sum of squares / mean, M2."""
    if kind == "sum":
        return value
    if kind == "mean":
        return value / count if count > 0 else torch.full_like(value, float("nan"))
    if kind == "norm":
        return value.sqrt()
    if count == 0:
        return torch.full_like(value, float("nan"))
    var = m2 / max(0, count - correction)
    return var if kind == "var" else var.sqrt()


# -- kernel report ---------------------------------------------------------------

# benchmarks/bench_reductions.py's GPU shape, reduced along rows, columns and all
BENCHMARK_SHAPE = (16384, 16384)
REPORT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# one float32 per output column and split: at most BLOCK_I (64) values over
# NUM_WARPS * 32 threads, so under 16 bytes per thread
_PARTIALS_NARROW = "one partial per output and split, under 16 bytes per thread (not bandwidth-bound)"


def bytes_per_element(size: int) -> tuple[float, float]:
    """(bytes this kernel moves per input element, the roofline): every
    element is read once; the partials written are one per output and
    split, under 0.01 byte per element at the benchmark shape."""
    return size, size


def kernel_specialisations():
    """sum (partial 0), norm (1) and var (2) of each dtype along each
    benchmark dimension, with the launcher's view (``_tile_view``) and tile
    and split choice (``_config``)."""
    rows, cols = BENCHMARK_SHAPE
    # (outer, reduced, inner) and strides of a contiguous (rows, cols) tensor
    views = {"rows": ((rows, cols, 1), (cols, 1, 1)), "columns": ((1, rows, cols), (rows * cols, cols, 1)),
             "all": ((1, rows * cols, 1), (rows * cols, 1, 1))}
    for dtype in REPORT_DTYPES:
        acc = accumulation_dtype(dtype)
        size = dtype.itemsize
        scaled = dtype in (torch.bfloat16, torch.float32)
        for dim_name, ((outer, reduced, inner), strides) in views.items():
            outer, inner, (stride_o, stride_r, stride_i) = _tile_view(outer, reduced, inner, strides)
            block_r, block_i, splits, rows_per_split, _ = _config(outer, reduced, inner)
            for kind, partial in (("sum", 0), ("norm", 1), ("var", 2)):
                arguments = dict(x_ptr=dtype, a_ptr=acc, b_ptr=acc, e_ptr=torch.int32 if scaled else acc,
                                 reduced=reduced, inner=inner, stride_o=stride_o, stride_r=stride_r, stride_i=stride_i,
                                 rows_per_split=rows_per_split, splits=splits)
                yield KernelSpec(_reduce_kernel, arguments, dict(PARTIAL=partial, SCALED=scaled, BLOCK_R=block_r,
                                                                 BLOCK_I=block_i), NUM_WARPS,
                                 f"{str(dtype)[6:]} {kind} {dim_name} of {rows}x{cols} BLOCK={block_r}x{block_i} "
                                 f"splits={splits}", *bytes_per_element(size),
                                 {name: _PARTIALS_NARROW for name in ("a_ptr", "b_ptr", "e_ptr")})
