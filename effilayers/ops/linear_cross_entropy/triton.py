"""Triton kernels of the fused path: logits computed tile by tile on the
tensor cores and reduced or turned into their gradient where they are made.

The classes-index loss needs per token only its log-sum-exp, its target's
logit and (with label smoothing) ``sum_c w_c z_c``; its gradient over the
logits is a function of the logit and those per-token terms. So:

* ``_stats_kernel`` (forward): a program owns ``BLOCK_M`` tokens and a
  range of classes (its split); per tile of ``BLOCK_N`` classes it forms
  ``z = x W^T (+ b)`` over the hidden size in ``BLOCK_K`` steps (fp32
  accumulation), rounds ``z`` to the compute dtype as ``F.linear`` returns it,
  and folds the tile into the tokens' running (maximum, sum of exp), target
  logit and smoothing sum. Only those 4 numbers per token and split are
  written; :func:`class_index_stats` merges the splits. Splitting the
  classes keeps the chip full when there are few token tiles. The logits
  are never written.
* ``_grad_kernel`` (backward, once per chunk of classes): a program owns
  one (tokens, classes) tile of the chunk; it forms the tile's logits again
  and writes their gradient ``scale * (coef * softmax - target's and
  smoothing's share)`` (the cross_entropy family's chunk-gradient formula)
  into the chunk's buffer G in the compute dtype, every scale applied in
  float32 before that one rounding. The op then runs two cuBLAS GEMMs per
  chunk (``op._fused_gradients``): ``grad_weight[chunk] = G^T x``, written
  once into the gradient, and ``grad_input += G W[chunk]``, summed in float32.
  Its programs walk the tiles in grouped order (``GROUP_M`` token tiles
  across the chunk's class tiles), so W's tiles are reused from L2.

No atomics: the results do not depend on the order programs run in, and
the path runs under ``torch.use_deterministic_algorithms(True)``. The
costs against the unfused pair: one more GEMM's worth of FLOPs (the
backward forms the logits again), and G's round trip through memory, a
tokens x chunk buffer instead of the logits' tokens x classes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._core.dtypes import accumulation_dtype
from ..._core.kernel_spec import KernelSpec
from .vocab_chunks import gradient_chunk

# GEMMs, bound by their arithmetic: the kernel report gives their bytes per
# element without holding them to a roofline.
COMPUTE_BOUND = True

# Tile shapes per compute dtype, (BLOCK_M tokens, BLOCK_N classes, BLOCK_K
# hidden, warps), per architecture: the largest whose registers stay clear
# of the 255 cap (`python -m effilayers.info --kernels` compiles each table
# for its own target and shows them). Both passes hold one logits tile (the
# gradient pass its gradient in place of it), accumulated over the hidden
# size. Hopper (sm_90, and later) takes 128x128 tiles: its larger register
# file per warpgroup MMA keeps them clear, and each x and W tile loaded
# serves twice the products of a 64-wide one. Ampere (sm_80) keeps the
# smaller tiles that compile without spills there. K=64 is four 16-deep MMA
# steps of fp16/bf16 per load; fp32 (TF32 or IEEE) takes half of that for
# the same registers, and on sm_90 half the classes (a 128x128 float32
# tile compiles at the 255-register cap, no headroom). float64 has no tensor-core path worth the registers:
# small tiles. Tests shrink them all (to 16, tl.dot's minimum) to run many
# tiles under the interpreter. Not tuned on a GPU yet.
STATS_TILES = {
    torch.float16: (64, 128, 64, 8),
    torch.bfloat16: (64, 128, 64, 8),
    torch.float32: (64, 64, 32, 8),
    torch.float64: (32, 64, 16, 4),
}
GRAD_TILES = {
    torch.float16: (64, 128, 64, 8),
    torch.bfloat16: (64, 128, 64, 8),
    torch.float32: (64, 64, 32, 8),
    torch.float64: (32, 64, 16, 4),
}
STATS_TILES_SM90 = {
    torch.float16: (128, 128, 64, 8),
    torch.bfloat16: (128, 128, 64, 8),
    torch.float32: (128, 64, 32, 8),
    torch.float64: (32, 64, 16, 4),
}
GRAD_TILES_SM90 = dict(STATS_TILES_SM90)
# Token tiles that walk the class tiles of a gradient chunk together (the
# grouped program order of the gradient pass).
GROUP_M = 8
# Programs to aim for in the statistics pass: two waves of an H100/H200's
# 132 SMs. Fewer token tiles than that split the classes.
TARGET_PROGRAMS = 264


@triton.jit
def _logits_tile(x_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, hidden, x_stride, w_stride,
                 HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                 ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``x[rows] W[cols]^T + b[cols]`` in ``ACC``, rounded to the compute
    dtype ``DTYPE`` as F.linear's output is, then widened back. x, W and b
    may be stored wider than ``DTYPE`` (float32 parameters under autocast):
    each tile is rounded to it as it is loaded, as autocast's cast would
    round the whole tensor, so no cast copy is made."""
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * w_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        a = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < hidden), other=0.0).to(DTYPE)
        b = tl.load(w_cols + k[:, None], mask=col_mask[None, :] & (k[:, None] < hidden), other=0.0).to(DTYPE)
        if WIDEN:  # the interpreter's bf16 dot is wrong; fp32 products of bf16 values are exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(DTYPE).to(ACC)[None, :]
    return acc.to(DTYPE).to(ACC)


@triton.jit
def _stats_kernel(
    x_ptr, w_ptr, b_ptr, target_ptr, class_weight_ptr, stats_ptr,
    tokens, classes, hidden, classes_per_split, x_stride, w_stride, stats_stride,
    HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    ACC = stats_ptr.dtype.element_ty
    neg_inf = float("-inf")
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < tokens
    target = tl.load(target_ptr + rows, mask=row_mask, other=-1)
    running_max = tl.full((BLOCK_M,), neg_inf, ACC)
    sum_exp = tl.zeros((BLOCK_M,), ACC)
    target_logit = tl.zeros((BLOCK_M,), ACC)
    smooth = tl.zeros((BLOCK_M,), ACC)
    begin = split * classes_per_split
    end = tl.minimum(begin + classes_per_split, classes)
    for n0 in range(begin, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < end
        z = _logits_tile(x_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, hidden, x_stride, w_stride,
                         HAS_BIAS, DTYPE, PRECISION, WIDEN, ACC, BLOCK_M, BLOCK_N, BLOCK_K)
        z = tl.where(col_mask[None, :], z, neg_inf)
        new_max = tl.maximum(running_max, tl.max(z, axis=1))
        # While a maximum is -inf every exp is 0: shift by 0, not by -inf.
        shift = tl.where(new_max == neg_inf, 0.0, new_max).to(ACC)
        rescale = tl.where(running_max == neg_inf, 0.0, tl.exp(running_max - shift)).to(ACC)
        sum_exp = sum_exp * rescale + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        running_max = new_max
        hit = (cols[None, :] == target[:, None]) & col_mask[None, :]  # a target past `end` is not the -inf fill
        target_logit += tl.sum(tl.where(hit, z, 0.0), axis=1)
        if SMOOTHING:
            if HAS_WEIGHT:
                w_c = tl.load(class_weight_ptr + cols, mask=col_mask, other=0.0).to(ACC)
            else:
                w_c = tl.where(col_mask, 1.0, 0.0).to(ACC)
            smooth += tl.sum(tl.where(col_mask[None, :], z, 0.0) * w_c[None, :], axis=1)
    out = stats_ptr + split.to(tl.int64) * 4 * stats_stride + rows
    tl.store(out, running_max, mask=row_mask)
    tl.store(out + stats_stride, sum_exp, mask=row_mask)
    tl.store(out + 2 * stats_stride, target_logit, mask=row_mask)
    tl.store(out + 3 * stats_stride, smooth, mask=row_mask)


@triton.jit
def _grad_kernel(
    x_ptr, w_ptr, b_ptr, target_ptr, class_term_ptr, row_terms_ptr, g_ptr,
    tokens, hidden, class_start, width, x_stride, w_stride, g_stride, terms_stride, ignore_index, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_CLASS_TERM: tl.constexpr, FILTER: tl.constexpr, DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, WIDEN: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    ACC = row_terms_ptr.dtype.element_ty
    # Grouped program order: GROUP_M token tiles walk the chunk's class tiles
    # together, so the W tiles they share are still in L2 for the group.
    pid = tl.program_id(0)
    token_tiles = tl.cdiv(tokens, BLOCK_M)
    class_tiles = tl.cdiv(width, BLOCK_N)
    per_group = GROUP_M * class_tiles
    first = (pid // per_group) * GROUP_M
    group_size = tl.minimum(token_tiles - first, GROUP_M)
    tile_m = first + (pid % per_group) % group_size
    tile_n = (pid % per_group) // group_size
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    local = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = class_start + local
    row_mask = rows < tokens
    col_mask = local < width
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
    valid = row_mask & (target != ignore_index)
    z = _logits_tile(x_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, hidden, x_stride, w_stride,
                     HAS_BIAS, DTYPE, PRECISION, WIDEN, ACC, BLOCK_M, BLOCK_N, BLOCK_K)
    lse = tl.load(row_terms_ptr + rows, mask=row_mask, other=0.0)
    coef = tl.load(row_terms_ptr + terms_stride + rows, mask=row_mask, other=0.0)
    target_coef = tl.load(row_terms_ptr + 2 * terms_stride + rows, mask=row_mask, other=0.0)
    scale = tl.load(row_terms_ptr + 3 * terms_stride + rows, mask=row_mask, other=0.0)
    g = coef[:, None] * tl.exp(z - lse[:, None])
    if HAS_CLASS_TERM:
        g -= tl.load(class_term_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    g = tl.where(cols[None, :] == target[:, None], g - target_coef[:, None], g)
    live = valid[:, None] & col_mask[None, :]
    if FILTER:
        # filter_eps (opt-in): a tile whose every gradient, before the
        # reduction's scale, is under it gives zeros (a NaN gradient is kept;
        # an out-of-range target's NaN, which comes with the scale, is not).
        largest = tl.max(tl.max(tl.where(live, tl.abs(g), 0.0), axis=1), axis=0)
        g = tl.where((largest >= filter_eps) | (largest != largest), g, 0.0)
    # Every scale (the mean's, the token weight, grad_output, a loss
    # scaler's) is applied in float32 before the one rounding to the compute
    # dtype, as torch rounds the logits' gradient: a small gradient of fp16
    # scaled up by a GradScaler does not underflow first. A select: an
    # ignored row gives 0 even where its scale is NaN or its exp overflowed.
    g = tl.where(live, g * scale[:, None], 0.0)
    out = g_ptr + rows.to(tl.int64)[:, None] * g_stride + local[None, :]
    tl.store(out, g.to(g_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    """TF32 for float32 exactly when torch's own float32 matmuls may use it."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _widen(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.bfloat16 and device.type == "cpu"  # the interpreter


def _tiles(kind: str, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """The ``kind`` ("stats" or "grad") tiles of ``dtype`` for ``device``'s architecture."""
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    table = {("stats", False): STATS_TILES, ("grad", False): GRAD_TILES,
             ("stats", True): STATS_TILES_SM90, ("grad", True): GRAD_TILES_SM90}[kind, hopper]
    return table[dtype]


def _common(x, w, b, dtype, kind):
    """The launch options shared by both passes, ``dtype`` being the compute
    dtype (x, W and b may be stored wider, under autocast)."""
    block_m, block_n, block_k, warps = _tiles(kind, dtype, x.device)
    return dict(HAS_BIAS=b is not None, DTYPE=_TL_DTYPES[dtype], PRECISION=_precision(dtype),
                WIDEN=_widen(dtype, x.device), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
              torch.float64: tl.float64}


def class_index_splits(tokens: int, classes: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(splits, classes per split) of the statistics pass: enough programs
    for ``TARGET_PROGRAMS`` when the token tiles alone are fewer, each split
    a whole number of class tiles."""
    token_tiles = max(1, triton.cdiv(tokens, block_m))
    wanted = max(1, min(triton.cdiv(classes, block_n), triton.cdiv(TARGET_PROGRAMS, token_tiles)))
    per_split = triton.cdiv(triton.cdiv(classes, wanted), block_n) * block_n
    return triton.cdiv(classes, per_split), per_split


def class_index_stats(x, w, b, target, class_weight, smoothing: bool, dtype=None) -> torch.Tensor:
    """The (4, tokens) statistics of ``vocab_chunks``' chunk-stats kernels
    after every class: running maximum, sum of exp relative to it, the
    target's logit and ``sum_c w_c z_c`` (0 without smoothing), in the
    accumulation dtype. ``x``: (tokens, hidden), unit stride along hidden;
    ``w``: (classes, hidden), the same; ``dtype``: the compute dtype the
    logits are formed in (default ``x``'s; x, W and b are read in their own
    dtypes and rounded to it tile by tile); ``target``: int64, contiguous."""
    tokens, hidden = x.shape
    classes = w.shape[0]
    dtype = x.dtype if dtype is None else dtype
    acc = accumulation_dtype(dtype)
    options = _common(x, w, b, dtype, "stats")
    splits, per_split = class_index_splits(tokens, classes, options["BLOCK_M"], options["BLOCK_N"])
    partial = torch.empty((splits, 4, tokens), dtype=acc, device=x.device)
    if tokens:
        _stats_kernel[(triton.cdiv(tokens, options["BLOCK_M"]), splits)](
            x, w, b if b is not None else x, target, class_weight if class_weight is not None else x, partial,
            tokens, classes, hidden, per_split, x.stride(0), w.stride(0), tokens,
            HAS_WEIGHT=class_weight is not None, SMOOTHING=bool(smoothing), **options)
    if splits == 1:
        return partial[0]
    # Merge the splits' online log-sum-exps: rescale each sum to the common maximum.
    maxima = partial[:, 0]
    running_max = maxima.max(0).values
    shift = torch.where(running_max == float("-inf"), 0.0, running_max)
    sum_exp = (partial[:, 1] * torch.exp(maxima - shift)).sum(0)
    return torch.stack((running_max, sum_exp, partial[:, 2].sum(0), partial[:, 3].sum(0)))


def class_index_grads(x, w, b, target, class_term, row_terms, ignore_index: int, class_start: int, out,
                      filter_eps: float = 0.0) -> None:
    """Writes d loss / d logits of the classes ``class_start`` to
    ``class_start + out.shape[1]`` into ``out`` (tokens, that many classes;
    unit stride along the classes), in ``out``'s dtype, the compute dtype
    the logits are formed in: ``scale * (coef * softmax - target's and
    smoothing's share)``, 0 on ignored rows, rounded once after every scale.
    ``row_terms``: (4, tokens) log-sum-exp, softmax coefficient, target
    coefficient and scale (accumulation dtype), as
    ``cross_entropy_chunk_grad_`` reads them; ``class_term``: (classes,) or
    None; ``filter_eps``: see ``linear_cross_entropy``. x, W and b as
    :func:`class_index_stats` reads them."""
    tokens, hidden = x.shape
    width = out.shape[1]
    if tokens == 0 or width == 0:
        return
    options = _common(x, w, b, out.dtype, "grad")
    tiles = triton.cdiv(tokens, options["BLOCK_M"]) * triton.cdiv(width, options["BLOCK_N"])
    _grad_kernel[(tiles,)](
        x, w, b if b is not None else x, target, class_term if class_term is not None else row_terms, row_terms,
        out, tokens, hidden, class_start, width, x.stride(0), w.stride(0), out.stride(0), row_terms.stride(0),
        ignore_index, filter_eps, FILTER=filter_eps > 0, HAS_CLASS_TERM=class_term is not None, GROUP_M=GROUP_M,
        **options)


# -- what the launchers compile, for `python -m effilayers.info --kernels` ----------------

# The GPU benchmark shapes (benchmarks/bench_linear_cross_entropy.py):
# Gemma-2-2B's head and Llama-3-8B's, 8192 tokens each.
BENCH_SHAPES = ((8192, 2304, 256000), (8192, 4096, 128256))


def _own(reasons: dict, kernel) -> dict:
    return {name: reason for name, reason in reasons.items() if name in kernel.arg_names}


def kernel_specialisations():
    """One spec per kernel, architecture, dtype and option set the launchers
    use at the benchmark shapes: each architecture's tile table compiled for
    its own target only (sm_90's 128x128 tiles are not what an sm_80 runs);
    bf16 (fp16 compiles to the same code with the other MMA type) and fp32;
    float64, which no benchmark runs, is left out. The second shape
    specialises exactly as the first (every size a multiple of 16), so only
    the first is compiled; the gradient pass at the class chunk
    ``gradient_chunk`` gives it.
    Traffic per logit: the x and W tiles each program reads (x once per
    class tile, W once per token tile; twice in all in the gradient pass,
    which forms the logits again), against the inputs read once."""
    # Per-thread accesses that are one value per row or column of a tile:
    # nothing to widen (the GEMM operands, x and W, are checked for 128 bits).
    per_row = "one value per token of the tile"
    per_column = "one value per class of the tile"
    narrow = {"target_ptr": per_row, "stats_ptr": per_row, "row_terms_ptr": per_row, "b_ptr": per_column,
              "class_weight_ptr": per_column, "class_term_ptr": per_column}
    tables = ((90, STATS_TILES_SM90, GRAD_TILES_SM90), (80, STATS_TILES, GRAD_TILES))
    for target, stats_tiles, grad_tiles in tables:
        for dtype in (torch.bfloat16, torch.float32):
            acc = accumulation_dtype(dtype)
            size = dtype.itemsize
            for tokens, hidden, classes in BENCH_SHAPES[:1]:
                common = dict(x_ptr=dtype, w_ptr=dtype, b_ptr=dtype, target_ptr=torch.int64, tokens=tokens,
                              hidden=hidden, x_stride=hidden, w_stride=hidden)
                shape = f"{tokens}x{hidden}x{classes} {str(dtype)[6:]}"
                roofline = size * hidden * (1 / classes + 1 / tokens)
                for name, tiles in (("stats", stats_tiles), ("grad", grad_tiles)):
                    block_m, block_n, block_k, warps = tiles[dtype]
                    moved = size * hidden * (1 / block_n + 1 / block_m)
                    flags = dict(DTYPE=_TL_DTYPES[dtype], PRECISION="ieee", WIDEN=False, BLOCK_M=block_m,
                                 BLOCK_N=block_n, BLOCK_K=block_k)
                    for has_bias in (False, True):
                        config = f"{shape} {name}{' bias' if has_bias else ''} sm_{target} tiles"
                        if name == "stats":
                            yield KernelSpec(_stats_kernel,
                                             dict(common, classes=classes, class_weight_ptr=acc, stats_ptr=acc,
                                                  stats_stride=tokens,
                                                  classes_per_split=class_index_splits(tokens, classes, block_m,
                                                                                       block_n)[1]),
                                             dict(flags, HAS_BIAS=has_bias, HAS_WEIGHT=False, SMOOTHING=False), warps,
                                             config, moved, roofline, _own(narrow, _stats_kernel), targets=(target,))
                        else:
                            width = gradient_chunk(tokens, classes, size, tokens * hidden * size)
                            yield KernelSpec(_grad_kernel,
                                             dict(common, class_term_ptr=acc, row_terms_ptr=acc, g_ptr=dtype,
                                                  class_start=width, width=width, g_stride=width,
                                                  terms_stride=tokens, ignore_index=-100, filter_eps=0.0),
                                             dict(flags, HAS_BIAS=has_bias, HAS_CLASS_TERM=False, FILTER=False,
                                                  GROUP_M=GROUP_M), warps, config, moved, roofline,
                                             _own(narrow, _grad_kernel), targets=(target,))
