"""Triton kernels of the fused path: logits computed tile by tile on the
tensor cores and reduced where they are made, never written to memory.

The classes-index loss needs per token only its log-sum-exp, its target's
logit and (with label smoothing) ``sum_c w_c z_c``; its gradient over the
logits is a function of the logit and those per-token terms. So:

* ``_stats_kernel``: a program owns ``BLOCK_M`` tokens and a range of
  classes (its split); per tile of ``BLOCK_N`` classes it forms
  ``z = x W^T (+ b)`` over the hidden size in ``BLOCK_K`` steps (fp32
  accumulation), rounds ``z`` to the compute dtype as ``F.linear`` returns it,
  and folds the tile into the tokens' running (maximum, sum of exp), target
  logit and smoothing sum. Only those 4 numbers per token and split are
  written; :func:`class_index_stats` merges the splits. Splitting the
  classes keeps the chip full when there are few token tiles.
* ``_grad_kernel``: a program owns one (tokens, classes) tile; it forms the
  tile's logits again, their gradient ``scale * (coef * softmax - target's
  and smoothing's share)`` (the cross_entropy family's chunk-gradient
  formula), rounded to the compute dtype as the chunked path stores it, and
  adds ``g W`` into grad_input's float32 sum and ``g^T x`` into grad_weight's,
  over the hidden size in ``BLOCK_K`` steps, with atomic adds: tiles of the
  same tokens (classes) meet in the same rows of grad_input (grad_weight).

Atomic float adds make the summation order vary from run to run, so under
``torch.use_deterministic_algorithms(True)`` the op runs the chunked path
instead (see ``op._fused_kernels``).

The costs against the unfused pair: one more GEMM's worth of FLOPs (the
backward forms the logits again) and atomic traffic in place of the logits'
round trips through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._core.dtypes import accumulation_dtype
from ..._core.kernel_spec import KernelSpec

# Tile shapes per compute dtype, (BLOCK_M tokens, BLOCK_N classes, BLOCK_K
# hidden, warps), the largest whose registers stay clear of the 255 cap on
# sm_80 and sm_90 (`python -m effilayers.info --kernels` shows them). The
# statistics pass holds one logits tile; the gradient pass holds it, its
# gradient and the two products' tiles, so its tiles are smaller. K=64 is
# four 16-deep MMA steps of fp16/bf16 per load; fp32 (TF32 or IEEE) takes
# half or a quarter of that for the same registers. float64 has no
# tensor-core path worth the registers: small tiles. Tests shrink them all
# (to 16, tl.dot's minimum) to run many tiles under the interpreter. Not
# tuned on a GPU yet.
STATS_TILES = {
    torch.float16: (64, 128, 64, 8),
    torch.bfloat16: (64, 128, 64, 8),
    torch.float32: (64, 64, 32, 8),
    torch.float64: (32, 64, 16, 4),
}
GRAD_TILES = {
    torch.float16: (64, 64, 64, 8),
    torch.bfloat16: (64, 64, 64, 8),
    torch.float32: (64, 64, 16, 8),
    torch.float64: (32, 64, 16, 4),
}
# Programs to aim for in the statistics pass: two waves of an H100/H200's
# 132 SMs. Fewer token tiles than that split the classes.
TARGET_PROGRAMS = 264


@triton.jit
def _logits_tile(x_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, hidden, x_stride, w_stride,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, ACC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``x[rows] W[cols]^T + b[cols]`` in ``ACC``, rounded to the compute dtype
    as F.linear's output is, then widened back."""
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * w_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        a = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < hidden), other=0.0)
        b = tl.load(w_cols + k[:, None], mask=col_mask[None, :] & (k[:, None] < hidden), other=0.0)
        if WIDEN:  # the interpreter's bf16 dot is wrong; fp32 products of bf16 values are exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    return acc.to(x_ptr.dtype.element_ty).to(ACC)


@triton.jit
def _stats_kernel(
    x_ptr, w_ptr, b_ptr, target_ptr, class_weight_ptr, stats_ptr,
    tokens, classes, hidden, classes_per_split, x_stride, w_stride, stats_stride,
    HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, PRECISION: tl.constexpr,
    WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
                         HAS_BIAS, PRECISION, WIDEN, ACC, BLOCK_M, BLOCK_N, BLOCK_K)
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
    x_ptr, w_ptr, b_ptr, target_ptr, class_term_ptr, row_terms_ptr, grad_x_ptr, grad_w_ptr, grad_b_ptr,
    tokens, classes, hidden, x_stride, w_stride, terms_stride, ignore_index, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_CLASS_TERM: tl.constexpr, GRAD_X: tl.constexpr, GRAD_W: tl.constexpr,
    GRAD_B: tl.constexpr, FILTER: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    ACC = row_terms_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < tokens
    col_mask = cols < classes
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
    valid = row_mask & (target != ignore_index)
    z = _logits_tile(x_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, hidden, x_stride, w_stride,
                     HAS_BIAS, PRECISION, WIDEN, ACC, BLOCK_M, BLOCK_N, BLOCK_K)
    lse = tl.load(row_terms_ptr + rows, mask=row_mask, other=0.0)
    coef = tl.load(row_terms_ptr + terms_stride + rows, mask=row_mask, other=0.0)
    target_coef = tl.load(row_terms_ptr + 2 * terms_stride + rows, mask=row_mask, other=0.0)
    scale = tl.load(row_terms_ptr + 3 * terms_stride + rows, mask=row_mask, other=0.0)
    g = coef[:, None] * tl.exp(z - lse[:, None])
    if HAS_CLASS_TERM:
        g -= tl.load(class_term_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    g = tl.where(cols[None, :] == target[:, None], g - target_coef[:, None], g)
    live = valid[:, None] & col_mask[None, :]
    # A tile of ignored tokens only (padding, prompts) adds nothing: skip its products and atomics.
    keep = tl.sum(valid.to(tl.int32), axis=0) > 0
    if FILTER:
        # filter_eps (opt-in): so does a tile whose every gradient, before
        # the reduction's scale, is under it (a NaN gradient is kept; an
        # out-of-range target's NaN, which comes with the scale, is not).
        largest = tl.max(tl.max(tl.where(live, tl.abs(g), 0.0), axis=1), axis=0)
        keep = keep & ((largest >= filter_eps) | (largest != largest))
    if keep:
        _add_tile_gradient(x_ptr, w_ptr, g, live, scale, rows, cols, row_mask, col_mask, hidden, x_stride,
                           w_stride, grad_x_ptr, grad_w_ptr, grad_b_ptr, GRAD_X, GRAD_W, GRAD_B, PRECISION, WIDEN,
                           ACC, BLOCK_K)


@triton.jit
def _add_tile_gradient(x_ptr, w_ptr, g, live, scale, rows, cols, row_mask, col_mask, hidden, x_stride, w_stride,
                       grad_x_ptr, grad_w_ptr, grad_b_ptr, GRAD_X: tl.constexpr, GRAD_W: tl.constexpr,
                       GRAD_B: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, ACC: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Adds the tile's share of each gradient: ``g`` (the logits' gradient
    before the scale) scaled per row, rounded to the compute dtype, then
    ``g W`` into grad_x and ``g^T x`` into grad_w over the hidden size.
    The adds are relaxed: nothing in the kernel reads the sums, so they need
    no ordering (``red`` instructions, not ``atom`` waiting on its result)."""
    DTYPE = x_ptr.dtype.element_ty
    # A select: an ignored row gives 0 even where its scale is NaN or its exp overflowed.
    g = tl.where(live, g * scale[:, None], 0.0)
    # The logits' gradient in the compute dtype, as the chunked path stores it
    # (and as the tensor cores read it).
    g_low = g.to(DTYPE)
    if GRAD_B:
        tl.atomic_add(grad_b_ptr + cols, tl.sum(g_low.to(ACC), axis=0), mask=col_mask, sem="relaxed")
    if WIDEN:
        g_low = g_low.to(tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        k_mask = k < hidden
        if GRAD_X:
            w_tile = tl.load(w_ptr + cols.to(tl.int64)[:, None] * w_stride + k[None, :],
                             mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            if WIDEN:
                w_tile = w_tile.to(tl.float32)
            part = tl.dot(g_low, w_tile, input_precision=PRECISION, out_dtype=ACC)
            tl.atomic_add(grad_x_ptr + rows.to(tl.int64)[:, None] * hidden + k[None, :], part,
                          mask=row_mask[:, None] & k_mask[None, :], sem="relaxed")
        if GRAD_W:
            x_tile = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + k[None, :],
                             mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if WIDEN:
                x_tile = x_tile.to(tl.float32)
            part = tl.dot(tl.trans(g_low), x_tile, input_precision=PRECISION, out_dtype=ACC)
            tl.atomic_add(grad_w_ptr + cols.to(tl.int64)[:, None] * hidden + k[None, :], part,
                          mask=col_mask[:, None] & k_mask[None, :], sem="relaxed")


def _precision(dtype: torch.dtype) -> str:
    """TF32 for float32 exactly when torch's own float32 matmuls may use it."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _widen(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.bfloat16 and device.type == "cpu"  # the interpreter


def _common(x, w, b, tiles):
    block_m, block_n, block_k, warps = tiles[x.dtype]
    return dict(HAS_BIAS=b is not None, PRECISION=_precision(x.dtype), WIDEN=_widen(x.dtype, x.device),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)


def class_index_splits(tokens: int, classes: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(splits, classes per split) of the statistics pass: enough programs
    for ``TARGET_PROGRAMS`` when the token tiles alone are fewer, each split
    a whole number of class tiles."""
    token_tiles = max(1, triton.cdiv(tokens, block_m))
    wanted = max(1, min(triton.cdiv(classes, block_n), triton.cdiv(TARGET_PROGRAMS, token_tiles)))
    per_split = triton.cdiv(triton.cdiv(classes, wanted), block_n) * block_n
    return triton.cdiv(classes, per_split), per_split


def class_index_stats(x, w, b, target, class_weight, smoothing: bool) -> torch.Tensor:
    """The (4, tokens) statistics of ``vocab_chunks``' chunk-stats kernels
    after every class: running maximum, sum of exp relative to it, the
    target's logit and ``sum_c w_c z_c`` (0 without smoothing), in the
    accumulation dtype. ``x``: (tokens, hidden) in the compute dtype,
    unit stride along hidden; ``w``: (classes, hidden), the same; ``target``:
    int64, contiguous."""
    tokens, hidden = x.shape
    classes = w.shape[0]
    acc = accumulation_dtype(x.dtype)
    options = _common(x, w, b, STATS_TILES)
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


def class_index_grads(x, w, b, target, class_term, row_terms, ignore_index: int, grad_input, grad_weight,
                      grad_bias, filter_eps: float = 0.0) -> None:
    """Adds the gradient of the loss rows into ``grad_input`` (tokens, hidden),
    ``grad_weight`` (classes, hidden) and ``grad_bias`` (classes,), each in the
    accumulation dtype, contiguous, or None when not wanted. ``row_terms``:
    (4, tokens) log-sum-exp, softmax coefficient, target coefficient and
    scale, as ``cross_entropy_chunk_grad_`` reads them; ``class_term``:
    (classes,) or None; ``filter_eps``: see ``linear_cross_entropy``."""
    tokens, hidden = x.shape
    classes = w.shape[0]
    if tokens == 0 or all(g is None for g in (grad_input, grad_weight, grad_bias)):
        return
    options = _common(x, w, b, GRAD_TILES)
    anything = row_terms  # a valid pointer for the arguments a constexpr switches off
    _grad_kernel[(triton.cdiv(tokens, options["BLOCK_M"]), triton.cdiv(classes, options["BLOCK_N"]))](
        x, w, b if b is not None else x, target, class_term if class_term is not None else anything, row_terms,
        grad_input if grad_input is not None else anything, grad_weight if grad_weight is not None else anything,
        grad_bias if grad_bias is not None else anything,
        tokens, classes, hidden, x.stride(0), w.stride(0), row_terms.stride(0), ignore_index, filter_eps,
        FILTER=filter_eps > 0, HAS_CLASS_TERM=class_term is not None, GRAD_X=grad_input is not None,
        GRAD_W=grad_weight is not None, GRAD_B=grad_bias is not None, **options)


# -- what the launchers compile, for `python -m effilayers.info --kernels` ----------------

# The GPU benchmark shapes (benchmarks/bench_linear_cross_entropy.py):
# Gemma-2-2B's head and Llama-3-8B's, 8192 tokens each.
BENCH_SHAPES = ((8192, 2304, 256000), (8192, 4096, 128256))


def _own(reasons: dict, kernel) -> dict:
    return {name: reason for name, reason in reasons.items() if name in kernel.arg_names}


def kernel_specialisations():
    """One spec per kernel, dtype and option set the launchers use at the
    benchmark shapes: bf16 (fp16 compiles to the same code with the other
    MMA type) and fp32; float64, which no benchmark runs, is left out. The
    second shape specialises exactly as the first (every size a multiple of
    16), so only the first is compiled.
    Traffic per logit: the x and W tiles each program reads (x once per
    class tile, W once per token tile; three times over the hidden size in
    the gradient pass), against the inputs read once."""
    # Per-thread accesses that are one value per row or column of a tile:
    # nothing to widen (the GEMM operands, x and W, are checked for 128 bits).
    per_row = "one value per token of the tile"
    per_column = "one value per class of the tile"
    narrow = {"target_ptr": per_row, "stats_ptr": per_row, "row_terms_ptr": per_row, "b_ptr": per_column,
              "class_weight_ptr": per_column, "class_term_ptr": per_column}
    for dtype in (torch.bfloat16, torch.float32):
        acc = accumulation_dtype(dtype)
        size = dtype.itemsize
        for tokens, hidden, classes in BENCH_SHAPES[:1]:
            common = dict(x_ptr=dtype, w_ptr=dtype, b_ptr=dtype, target_ptr=torch.int64, tokens=tokens,
                          classes=classes, hidden=hidden, x_stride=hidden, w_stride=hidden)
            shape = f"{tokens}x{hidden}x{classes} {str(dtype)[6:]}"
            roofline = size * hidden * (1 / classes + 1 / tokens)
            for name, tiles in (("stats", STATS_TILES), ("grad", GRAD_TILES)):
                block_m, block_n, block_k, warps = tiles[dtype]
                moved = size * hidden * (1 / block_n + 1 / block_m)
                flags = dict(PRECISION="ieee", WIDEN=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
                for has_bias in (False, True):
                    config = f"{shape} {name}{' bias' if has_bias else ''}"
                    if name == "stats":
                        yield KernelSpec(_stats_kernel,
                                         dict(common, class_weight_ptr=acc, stats_ptr=acc, stats_stride=tokens,
                                              classes_per_split=class_index_splits(tokens, classes, block_m,
                                                                                   block_n)[1]),
                                         dict(flags, HAS_BIAS=has_bias, HAS_WEIGHT=False, SMOOTHING=False), warps,
                                         config, moved, roofline, _own(narrow, _stats_kernel))
                    else:
                        yield KernelSpec(_grad_kernel,
                                         dict(common, class_term_ptr=acc, row_terms_ptr=acc, grad_x_ptr=acc,
                                              grad_w_ptr=acc, grad_b_ptr=acc, terms_stride=tokens, ignore_index=-100,
                                              filter_eps=0.0),
                                         dict(flags, HAS_BIAS=has_bias, HAS_CLASS_TERM=False, FILTER=False, GRAD_X=True,
                                              GRAD_W=True, GRAD_B=has_bias), warps, config, 3 * moved,
                                         3 * roofline, _own(narrow, _grad_kernel))
