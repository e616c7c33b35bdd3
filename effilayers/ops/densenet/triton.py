"""Triton kernels of the DenseNet bottleneck ``conv1x1(relu(batch_norm(cat(features))))``.

A 1x1 convolution is a GEMM: ``out[m, o] = sum_k y[m, k] * W[o, k]`` over the
pixels ``m`` (N*H*W rows) and the input channels ``k``. Here ``y`` is never
written anywhere: it is ``relu((x - mean) * scale + bias)`` of the
concatenated input ``x``, and the K loop of every GEMM below walks the list of
feature maps directly ("virtual concatenation"), normalising and rectifying
each tile as it is loaded. ``scale`` is ``weight * invstd``.

The list of maps arrives as a table, one int64 row per map:
``(data pointer, channels, first channel in the concatenation, stride of n,
stride of c, stride of h*w)``. Any layout whose h and w merge into one stride
works, so NCHW and channels_last maps are read in place; the K loop runs over
a second table of (map, first channel) tiles built on the host. Maps that
lie next to each other in one buffer (a dense block's block buffer) share a
row, and recent tables stay on the device (``_tables``).

Not supported: CUDA graph capture. A table the cache does not hold is
copied from the host during the call, which a capturing stream does not
allow, and a graph captured on cached tables would go on reading them after
the cache let them go.

Kernels:

``_forward``        out = y @ W^T, written in the layout of the first map.
``_grad_input``     dy = dout @ W per (pixel block, channel tile), through the
                    ReLU mask (recomputed); per-block partial sums of
                    dz and dz * x_hat (BatchNorm's reductions) go to a small
                    buffer reduced on the host (deterministic, no atomics);
                    dz is written into the gradient of the concatenation
                    (the output that autograd splits among the maps) for
                    float32 maps, into a float32 scratch buffer for fp16/bf16
                    ones, or, with running statistics, the finished
                    dx = dz * scale goes straight to the gradient.
``_finish_grad_input``  dx = scale * (dz - mean(dz) - x_hat * mean(dz * x_hat))
                    from dz (batch statistics only). The subtraction cancels
                    on small elements, so dz is not rounded to fp16/bf16
                    first: measured in fp16, the largest error relative to
                    |dx| + 1e-3 max |dx| is 4.8e-4 with the scratch buffer
                    and was 1.6e-2 without (tests/test_densenet_ops.py). The
                    scratch costs 4 bytes per value of one layer's
                    concatenation, for the duration of the call.
``_grad_weight``    dW = dout^T @ y with y recomputed per tile, split over
                    ranges of pixels (partial sums added on the host).

Accumulation is float32 throughout; ``tl.dot`` takes the maps' dtype (fp16,
bf16, or fp32 as TF32 when torch allows TF32 convolutions, as cuDNN would).
Block sizes: 64 pixels x 64 output channels x 32 input channels keeps the
three tiles of a float32 dot (8 KB + 8 KB + 16 KB accumulator) in registers
of 4 warps in the backward kernels; the forward takes 32 pixels x 128 output
channels (the same accumulator), so DenseNet's 128-channel bottleneck reads
each input tile once; ``_grad_weight`` without TF32 takes 32 pixels in one
stage (``_grad_weight_tiles``, under the register cap). A
block's maps form one row, so only the last K tile of a layer is partly
padding. Maps passed as separate tensors (not in a block buffer) pad each
map to a multiple of 32 channels: at growth rate 12 most of each tile. The
sizes are untuned: no GPU was available when this was written, so no
block size was measured.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..._core.cache import TableCache
from ..._core.kernel_spec import KernelSpec
from . import reference
from .contract import in_layout, is_pointwise, layout_of

TABLE_COLUMNS = 6
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4
# The forward's tile: one program covers up to 128 output channels
# (DenseNet's bottleneck width, 4 x the growth rate), so each input tile is
# loaded once from memory instead of once per 64-channel tile of the output
# (its roofline: read x once, write the output once). 32 pixels keep the
# accumulator at the 64 x 64 tile's size, 32 float32 values per thread.
FORWARD_BLOCK_M = 32
FORWARD_BLOCK_N = 128


def _grad_weight_tiles(dtype: torch.dtype, allow_tf32: bool) -> tuple[int, Optional[int]]:
    """(BLOCK_M, num_stages) of ``_grad_weight``. A float32 dot without TF32
    runs on the FMA units, and with 64-pixel tiles in Triton's default
    pipeline it compiled to the 255-register cap on sm_80 and sm_90; 32
    pixels in one stage compile to about half of that."""
    if dtype == torch.float32 and not allow_tf32:
        return 32, 1
    return BLOCK_M, None


def _forward_stages(dtype: torch.dtype, allow_tf32: bool) -> Optional[int]:
    """num_stages of ``_forward``: one for the FMA-unit float32 dot, which
    in Triton 3.9's default pipeline compiled to the 255-register cap on
    sm_80 (127-128 registers in one stage); Triton's default otherwise."""
    return 1 if dtype == torch.float32 and not allow_tf32 else None


def _stages(stages: Optional[int]) -> dict:
    return {} if stages is None else {"num_stages": stages}


@triton.jit
def _tile_of_map(table, tiles, t, offs_m, M, HW, dtype_ptr, BLOCK_K: tl.constexpr, VECTOR: tl.constexpr):
    """Pointers, mask and channel numbers of K tile ``t`` for the rows offs_m.

    ``VECTOR`` > 1 is the aligned specialisation, chosen by the launcher
    only when every row of the table has a 16-byte aligned pointer, unit
    pixel stride and n and c strides that are multiples of ``VECTOR``
    elements (16 bytes; ``_vector_width``): values read from the table are
    opaque to Triton, and these hints are what let it load ``VECTOR``
    neighbouring pixels of a map with one 128-bit access."""
    f = tl.load(tiles + 2 * t)
    k_start = tl.load(tiles + 2 * t + 1)
    row = table + f * 6
    base = tl.load(row).to(dtype_ptr.dtype)
    channels = tl.load(row + 1)
    first = tl.load(row + 2)
    stride_n = tl.load(row + 3)
    stride_c = tl.load(row + 4)
    stride_hw = tl.load(row + 5)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    mask_k = offs_k < channels
    n = offs_m // HW
    hw = offs_m % HW
    if VECTOR > 1:
        base = tl.multiple_of(base, 16)
        stride_n = tl.multiple_of(stride_n, VECTOR)
        stride_c = tl.multiple_of(stride_c, VECTOR)
        pixel = n * stride_n + hw
    else:
        pixel = n * stride_n + hw * stride_hw
    offsets = pixel[:, None] + offs_k[None, :].to(tl.int64) * stride_c
    mask = (offs_m < M)[:, None] & mask_k[None, :]
    return base, offsets, mask, first + offs_k, mask_k


@triton.jit
def _gradient_offsets(offs_m, HW, channel, stride_n, stride_c, stride_hw):
    """Offsets of a tile in an (N, K, H, W) gradient buffer (``channel``
    counts in the concatenation)."""
    n = offs_m // HW
    hw = offs_m % HW
    return (n * stride_n + hw * stride_hw)[:, None] + channel[None, :].to(tl.int64) * stride_c


@triton.jit
def _activated(x, channel, mask_k, mean, scale, bias):
    """relu((x - mean) * scale + bias) in float32, zero in padding channels."""
    mu = tl.load(mean + channel, mask=mask_k, other=0.0)
    s = tl.load(scale + channel, mask=mask_k, other=0.0)
    b = tl.load(bias + channel, mask=mask_k, other=0.0)
    z = (x.to(tl.float32) - mu[None, :]) * s[None, :] + b[None, :]
    return tl.maximum(z, 0.0)


@triton.jit
def _forward(table, tiles, num_tiles, mean, scale, bias, weight, out,
             M, HW, K, C_OUT, out_stride_n, out_stride_c, out_stride_hw,
             ALLOW_TF32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             VECTOR: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < C_OUT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(num_tiles):
        base, offsets, mask, channel, mask_k = _tile_of_map(table, tiles, t, offs_m, M, HW, weight, BLOCK_K, VECTOR)
        x = tl.load(base + offsets, mask=mask, other=0.0)
        y = _activated(x, channel, mask_k, mean, scale, bias).to(weight.dtype.element_ty)
        w = tl.load(weight + offs_n[None, :].to(tl.int64) * K + channel[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if ALLOW_TF32:
            acc += tl.dot(y, w)
        else:
            acc += tl.dot(y, w, input_precision="ieee")
    n = offs_m // HW
    hw = offs_m % HW
    destination = out + (n * out_stride_n + hw * out_stride_hw)[:, None] + offs_n[None, :].to(tl.int64) * out_stride_c
    tl.store(destination, acc.to(out.dtype.element_ty), mask=(offs_m < M)[:, None] & mask_n[None, :])


@triton.jit
def _grad_input(table, tiles, mean, invstd, scale, bias, weight, grad_out, partial_dz, partial_dz_xhat, grad,
                M, HW, K, C_OUT, go_stride_n, go_stride_c, go_stride_hw, g_stride_n, g_stride_c, g_stride_hw,
                BATCH_STATS: tl.constexpr, ALLOW_TF32: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VECTOR: tl.constexpr):
    pid_m = tl.program_id(0)
    t = tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    base, offsets, mask, channel, mask_k = _tile_of_map(table, tiles, t, offs_m, M, HW, weight, BLOCK_K, VECTOR)
    n = offs_m // HW
    hw = offs_m % HW
    row_offsets = n * go_stride_n + hw * go_stride_hw
    # dy = dout @ W over every output channel.
    grad_y = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for o_start in range(0, C_OUT, BLOCK_N):
        offs_o = o_start + tl.arange(0, BLOCK_N)
        mask_o = offs_o < C_OUT
        g = tl.load(grad_out + row_offsets[:, None] + offs_o[None, :].to(tl.int64) * go_stride_c,
                    mask=mask_m[:, None] & mask_o[None, :], other=0.0)
        w = tl.load(weight + offs_o[:, None].to(tl.int64) * K + channel[None, :],
                    mask=mask_o[:, None] & mask_k[None, :], other=0.0)
        if ALLOW_TF32:
            grad_y += tl.dot(g, w)
        else:
            grad_y += tl.dot(g, w, input_precision="ieee")
    # Through the ReLU (recomputed: its output is positive exactly where it passed).
    x = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
    y = _activated(x, channel, mask_k, mean, scale, bias)
    grad_z = tl.where(y > 0.0, grad_y, 0.0)
    mu = tl.load(mean + channel, mask=mask_k, other=0.0)
    inv = tl.load(invstd + channel, mask=mask_k, other=0.0)
    x_hat = (x - mu[None, :]) * inv[None, :]
    partial_offsets = pid_m.to(tl.int64) * K + channel
    tl.store(partial_dz + partial_offsets, tl.sum(grad_z, axis=0), mask=mask_k)
    tl.store(partial_dz_xhat + partial_offsets, tl.sum(grad_z * x_hat, axis=0), mask=mask_k)
    grad_offsets = _gradient_offsets(offs_m, HW, channel, g_stride_n, g_stride_c, g_stride_hw)
    if BATCH_STATS:
        # dz, for _finish_grad_input: ``grad`` is a float32 scratch buffer
        # unless the maps are float32 (rounding dz to fp16/bf16 before
        # dz - mean(dz) - x_hat * mean(dz * x_hat) cancels would cost up to
        # ~30x the final rounding's error on small elements).
        tl.store(grad + grad_offsets, grad_z.to(grad.dtype.element_ty), mask=mask)
    else:
        s = tl.load(scale + channel, mask=mask_k, other=0.0)
        tl.store(grad + grad_offsets, (grad_z * s[None, :]).to(grad.dtype.element_ty), mask=mask)


@triton.jit
def _finish_grad_input(table, tiles, mean, invstd, scale, mean_dz, mean_dz_xhat, grad_z_buffer, grad, M, HW,
                       g_stride_n, g_stride_c, g_stride_hw, dtype_ptr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       VECTOR: tl.constexpr):
    """dx from dz; ``grad_z_buffer`` and ``grad`` have the same strides and
    may be one tensor (each element is read, then written, by one program)."""
    pid_m = tl.program_id(0)
    t = tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    base, offsets, mask, channel, mask_k = _tile_of_map(table, tiles, t, offs_m, M, HW, dtype_ptr, BLOCK_K, VECTOR)
    grad_offsets = _gradient_offsets(offs_m, HW, channel, g_stride_n, g_stride_c, g_stride_hw)
    x = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
    grad_z = tl.load(grad_z_buffer + grad_offsets, mask=mask, other=0.0).to(tl.float32)
    mu = tl.load(mean + channel, mask=mask_k, other=0.0)
    inv = tl.load(invstd + channel, mask=mask_k, other=0.0)
    s = tl.load(scale + channel, mask=mask_k, other=0.0)
    a = tl.load(mean_dz + channel, mask=mask_k, other=0.0)
    b = tl.load(mean_dz_xhat + channel, mask=mask_k, other=0.0)
    x_hat = (x - mu[None, :]) * inv[None, :]
    grad_x = s[None, :] * (grad_z - a[None, :] - x_hat * b[None, :])
    tl.store(grad + grad_offsets, grad_x.to(grad.dtype.element_ty), mask=mask)


@triton.jit
def _grad_weight(table, tiles, mean, scale, bias, grad_out, partial_grad_weight, dtype_ptr,
                 M, HW, K, C_OUT, go_stride_n, go_stride_c, go_stride_hw, ROWS_PER_SPLIT,
                 ALLOW_TF32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 VECTOR: tl.constexpr):
    pid_o = tl.program_id(0)
    t = tl.program_id(1)
    split = tl.program_id(2)
    offs_o = pid_o * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_o = offs_o < C_OUT
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    channel = tl.zeros((BLOCK_K,), dtype=tl.int64)
    mask_k = channel < 0
    # Split-K over the pixels: DenseNet's dW is a small (C_out x K) matrix
    # reduced over N*H*W rows, so (C_out tiles x K tiles) programs alone
    # would leave most of the GPU idle. Each split writes its own partial
    # sum; the host adds them (deterministic, no atomics).
    m_first = split.to(tl.int64) * ROWS_PER_SPLIT
    m_last = tl.minimum(m_first + ROWS_PER_SPLIT, M)
    for m_start in range(m_first, m_last, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M).to(tl.int64)
        mask_m = offs_m < m_last
        base, offsets, mask, channel, mask_k = _tile_of_map(table, tiles, t, offs_m, m_last, HW, dtype_ptr, BLOCK_K,
                                                            VECTOR)
        x = tl.load(base + offsets, mask=mask, other=0.0)
        # Rows past M must not contribute relu(bias): zero them.
        y = tl.where(mask_m[:, None], _activated(x, channel, mask_k, mean, scale, bias), 0.0)
        n = offs_m // HW
        hw = offs_m % HW
        g = tl.load(grad_out + (n * go_stride_n + hw * go_stride_hw)[None, :]
                    + offs_o[:, None].to(tl.int64) * go_stride_c, mask=mask_o[:, None] & mask_m[None, :], other=0.0)
        if ALLOW_TF32:
            acc += tl.dot(g, y.to(dtype_ptr.dtype.element_ty))
        else:
            acc += tl.dot(g, y.to(dtype_ptr.dtype.element_ty), input_precision="ieee")
    destination = partial_grad_weight + split.to(tl.int64) * C_OUT * K
    tl.store(destination + offs_o[:, None].to(tl.int64) * K + channel[None, :], acc,
             mask=mask_o[:, None] & mask_k[None, :])


# ---- host side ------------------------------------------------------------------------------------


def _readable(feature: torch.Tensor) -> torch.Tensor:
    """The map itself when its h and w merge into one stride (NCHW and
    channels_last both do), else a contiguous copy."""
    _, _, _, width = feature.shape
    stride_n, stride_c, stride_h, stride_w = feature.stride()
    if stride_h == width * stride_w or feature.shape[2] == 1:
        return feature
    return feature.contiguous()


def _pixel_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(stride of n, stride of c, stride of the merged h*w index)."""
    return t.stride(0), t.stride(1), t.stride(3)


def _rows(features: Sequence[torch.Tensor]) -> list[tuple[int, int, int, int, int, int]]:
    """The map table's rows, one per run of maps that lie next to each other
    in one buffer with the same strides (a dense block's maps are channel
    slices of its block buffer, so a whole block is one row): the K loop
    then walks full BLOCK_K tiles across map boundaries instead of padding
    every map to a multiple of BLOCK_K (a growth rate of 12 filled 12/32 of
    each tile)."""
    rows: list[list[int]] = []
    first = 0
    for feature in features:
        strides = _pixel_strides(feature)
        channels = feature.shape[1]
        if rows:
            pointer, run_channels, _, *run_strides = rows[-1]
            follows = feature.data_ptr() == pointer + run_channels * strides[1] * feature.element_size()
            if follows and tuple(run_strides) == strides:
                rows[-1][1] += channels
                first += channels
                continue
        rows.append([feature.data_ptr(), channels, first, *strides])
        first += channels
    return [tuple(row) for row in rows]


# Device copies of recent tables, keyed by everything they hold (pointers,
# channels, strides) plus device and stream, so an entry is correct for any
# call that finds it: in a training loop the caching allocator hands the
# block buffers the same addresses step after step, and the two host-to-device
# copies per call (each a pageable copy the host waits for) happen only on
# the first step. The stream is part of the key so that a table is only ever
# read on the stream it was allocated on (the allocator's reuse after
# eviction is ordered on that stream).
_TABLES = TableCache(entries=256)


def _vector_width(rows: Sequence[tuple[int, ...]], element_size: int) -> int:
    """Elements in 16 bytes when every map in ``rows`` can be read 16 bytes
    at a time along its pixels (the ``VECTOR`` of the kernels' aligned
    specialisation: pointer 16-byte aligned, pixel stride 1, n and c strides
    multiples of 16 bytes), else 1 (the general kernels: per-element loads).
    NCHW maps qualify when H*W is a multiple of 16 / element_size; channels_last
    maps (pixel stride = channels) and offset views never do."""
    vector = 16 // element_size
    for pointer, _, _, stride_n, stride_c, stride_hw in rows:
        if pointer % 16 or stride_hw != 1 or stride_n % vector or stride_c % vector:
            return 1
    return vector


def _tables(features: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(map table, tile table, number of tiles, ``_vector_width``) on the maps' device."""
    rows = _rows(features)
    device = features[0].device
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0

    def build() -> tuple[torch.Tensor, torch.Tensor, int]:
        tiles = [(index, start) for index, row in enumerate(rows) for start in range(0, row[1], BLOCK_K)]
        table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        tile_table = torch.tensor(tiles, dtype=torch.int64).to(device, non_blocking=True)
        return table, tile_table, len(tiles)

    return (*_TABLES.get((device, stream, BLOCK_K, tuple(rows)), build),
            _vector_width(rows, features[0].element_size()))


def _pixel_splits(device: torch.device, rows: int, programs: int, block_m: int = BLOCK_M) -> tuple[int, int]:
    """(splits, rows per split) of dW's reduction over the pixels: enough
    programs for about four per multiprocessor on a GPU (two under the
    interpreter, so the tests exercise the partial sums), never more than
    one split per block of rows."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 2 * programs
    return _split_rows(rows, programs, target, block_m)


def _split_rows(rows: int, programs: int, target: int, block_m: int = BLOCK_M) -> tuple[int, int]:
    """(splits, rows per split, a multiple of ``block_m``) for about
    ``target`` programs in all."""
    splits = max(1, min(triton.cdiv(rows, block_m), triton.cdiv(target, programs)))
    rows_per_split = triton.cdiv(triton.cdiv(rows, splits), block_m) * block_m
    return triton.cdiv(rows, rows_per_split), rows_per_split


def _allow_tf32(dtype: torch.dtype) -> bool:
    """Whether a float32 GEMM may round its inputs to TF32: exactly when
    PyTorch's cuDNN convolutions may (these kernels stand in for a 1x1
    convolution, and the naive model's convolutions follow the same flag).

    With ``torch.backends.cudnn.conv.fp32_precision`` (torch >= 2.9) the
    setting is resolved as ATen resolves it for convolutions: the conv value,
    else cuDNN's, else the generic one, ``"none"`` deferring to the next.
    The legacy ``torch.backends.cudnn.allow_tf32`` is read only on older
    torch: reading it raises once conv and rnn were given different values
    through the new API."""
    if dtype != torch.float32:
        return False
    cudnn = torch.backends.cudnn
    conv = getattr(cudnn, "conv", None)
    if conv is None or not hasattr(conv, "fp32_precision"):
        return bool(cudnn.allow_tf32)
    for precision in (conv.fp32_precision, cudnn.fp32_precision, torch.backends.fp32_precision):
        if precision != "none":
            return precision == "tf32"
    return False


def _output_like(first: torch.Tensor, channels: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An (N, channels, H, W) output in the layout every backend and the fake
    kernels give (``contract.layout_of``); the maps' dtype unless ``dtype``
    is given."""
    n, _, h, w = first.shape
    return torch.empty((n, channels, h, w), device=first.device, dtype=dtype or first.dtype,
                       memory_format=layout_of(first))


def _launch_setup(features, invstd, weight, conv_weight):
    """What both launchers derive from their arguments: BatchNorm's scale,
    the maps in layouts the kernels read, the pixel geometry and the 1x1
    weight as a (C_out, K) matrix."""
    scale = invstd * weight
    features = [_readable(f) for f in features]
    first = features[0]
    batch, _, height, width = first.shape
    matrix = conv_weight.reshape(conv_weight.shape[0], -1).contiguous()
    c_out, k = matrix.shape
    return scale, features, first, batch * height * width, height * width, width, matrix, c_out, k


def bottleneck_forward(features: Sequence[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor,
                       weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
    """``conv1x1(relu((cat(features) - mean) * invstd * weight + bias), conv_weight)``;
    the per-channel vectors float32 (K,), conv_weight (C_out, K, 1, 1) in the maps' dtype."""
    scale, features, first, total, hw, width, matrix, c_out, k = _launch_setup(features, invstd, weight, conv_weight)
    out = _output_like(first, c_out)
    if total == 0 or c_out == 0:
        return out
    table, tiles, num_tiles, vector = _tables(features)
    grid = (triton.cdiv(total, FORWARD_BLOCK_M), triton.cdiv(c_out, FORWARD_BLOCK_N))
    allow_tf32 = _allow_tf32(first.dtype)
    _forward[grid](table, tiles, num_tiles, mean, scale, bias, matrix, out, total, hw, k, c_out,
                   *_pixel_strides(out), ALLOW_TF32=allow_tf32,
                   BLOCK_M=FORWARD_BLOCK_M, BLOCK_N=FORWARD_BLOCK_N, BLOCK_K=BLOCK_K, VECTOR=vector,
                   num_warps=NUM_WARPS, **_stages(_forward_stages(first.dtype, allow_tf32)))
    return out


def bottleneck_backward(grad_out: torch.Tensor, features: Sequence[torch.Tensor], mean: torch.Tensor,
                        invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor,
                        batch_stats: bool, need_input: bool, need_conv: bool):
    """Gradients of :func:`bottleneck_forward` with BatchNorm's backward fused.

    Returns ``(grad_input, sum_dz, sum_dz_xhat, grad_conv)``: ``grad_input``
    is the gradient of the concatenation, (N, K, H, W), None unless
    ``need_input``; ``sum_dz`` is the gradient of BatchNorm's bias,
    ``sum_dz_xhat`` that of its weight; ``grad_conv`` None unless
    ``need_conv``. With ``batch_stats`` the statistics are the batch's own
    (their dependence on the input is part of dx); else they are constants.
    """
    scale, features, first, total, hw, width, matrix, c_out, k = _launch_setup(features, invstd, weight, conv_weight)
    grad_out = grad_out if grad_out.stride(2) == width * grad_out.stride(3) else grad_out.contiguous()
    table, tiles, num_tiles, vector = _tables(features)
    allow_tf32 = _allow_tf32(first.dtype)
    go_strides = _pixel_strides(grad_out)
    grad_input: Optional[torch.Tensor] = None
    sum_dz = torch.zeros(k, device=first.device, dtype=torch.float32)
    sum_dz_xhat = torch.zeros_like(sum_dz)
    if need_input and total > 0:
        # One buffer for every map's gradient (the caller splits it), in
        # the layout of the first map.
        grad_input = _output_like(first, k)
        # dz before BatchNorm's reductions are subtracted: in grad_input
        # itself for float32 maps, else in a float32 scratch buffer (one
        # layer's concatenation at 4 bytes a value, for this call only).
        grad_z = grad_input if not batch_stats or first.dtype == torch.float32 \
            else _output_like(first, k, torch.float32)
        grad_strides = _pixel_strides(grad_input)
        assert _pixel_strides(grad_z) == grad_strides
        blocks = triton.cdiv(total, BLOCK_M)
        partial_dz = torch.zeros((blocks, k), device=first.device, dtype=torch.float32)
        partial_dz_xhat = torch.zeros_like(partial_dz)
        _grad_input[(blocks, num_tiles)](
            table, tiles, mean, invstd, scale, bias, matrix, grad_out, partial_dz, partial_dz_xhat, grad_z,
            total, hw, k, c_out, *go_strides, *grad_strides, BATCH_STATS=batch_stats, ALLOW_TF32=allow_tf32,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, VECTOR=vector, num_warps=NUM_WARPS)
        sum_dz = partial_dz.sum(0)
        sum_dz_xhat = partial_dz_xhat.sum(0)
        if batch_stats:
            _finish_grad_input[(blocks, num_tiles)](
                table, tiles, mean, invstd, scale, sum_dz / total, sum_dz_xhat / total, grad_z, grad_input, total,
                hw, *grad_strides, matrix, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, VECTOR=vector, num_warps=NUM_WARPS)
    elif need_input:
        grad_input = _output_like(first, k).zero_()
    grad_conv = None
    if need_conv:
        if total > 0 and c_out > 0:
            output_tiles = triton.cdiv(c_out, BLOCK_N)
            block_m, stages = _grad_weight_tiles(first.dtype, allow_tf32)
            splits, rows_per_split = _pixel_splits(first.device, total, output_tiles * num_tiles, block_m)
            partial = torch.zeros((splits, c_out, k), device=first.device, dtype=torch.float32)
            _grad_weight[(output_tiles, num_tiles, splits)](
                table, tiles, mean, scale, bias, grad_out, partial, matrix, total, hw, k, c_out, *go_strides,
                rows_per_split, ALLOW_TF32=allow_tf32, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                VECTOR=vector, num_warps=NUM_WARPS, **_stages(stages))
            grad_weight = partial.sum(0)
        else:
            grad_weight = torch.zeros((c_out, k), device=first.device, dtype=torch.float32)
        grad_conv = grad_weight.to(conv_weight.dtype).view_as(conv_weight)
    return grad_input, sum_dz, sum_dz_xhat, grad_conv


def forward(features, mean, invstd, weight, bias, conv_weight, padding):
    """The registered Triton kernel of ``effilayers::dense_bottleneck_forward``."""
    if features[0].dtype == torch.float64 or not is_pointwise(conv_weight, padding):
        # tl.dot has no float64 here, and the virtual-concatenation GEMM is a
        # 1x1 convolution: PyTorch ops serve double precision and the 3x3.
        return reference.forward(features, mean, invstd, weight, bias, conv_weight, padding)
    return bottleneck_forward(features, mean, invstd, weight, bias, conv_weight)


def backward(grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats, need_input, need_conv,
             padding):
    """The registered Triton kernel of ``effilayers::dense_bottleneck_backward``."""
    if features[0].dtype == torch.float64 or not is_pointwise(conv_weight, padding):
        return reference.backward(grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats,
                                  need_input, need_conv, padding)
    grad_input, grad_bias, grad_weight, grad_conv = bottleneck_backward(
        grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats, need_input, need_conv)
    grad_conv = in_layout(grad_conv, conv_weight) if need_conv else reference.nothing(mean)
    if not need_input:
        return reference.nothing(mean), reference.nothing(mean), reference.nothing(mean), grad_conv
    return grad_input, grad_bias, grad_weight, grad_conv


# ---- kernel report ----------------------------------------------------------------------------------

# The first dense layer of DenseNet-121's first block in benchmarks/bench_densenet.py's
# step (batch 64 at 224x224: 56x56 maps, 64 input channels, 128 = 4 x 32
# bottleneck channels), NCHW; the kernels themselves take any size.
BENCHMARK_LAYER = dict(batch=64, channels=64, height=56, width=56, out_channels=128)
REPORT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Why the rows' per-thread accesses may be narrower than 128 bits. The
# general kernels read maps whose pointers and strides come from the table at
# run time with no guarantee (channels_last, offset views, H*W not a multiple
# of 16 bytes), so each map element is its own access. The aligned
# specialisation reads the map tiles (and writes the gradient) 128 bits at a
# time; what stays narrow is indexed by the table's channel numbers, which
# start wherever the previous maps end (any channel count, so no alignment
# to promise): BatchNorm's per-channel vectors, the weight columns and the
# per-channel partial sums are gathers at run-time channel offsets.
_GENERAL_NARROW = "maps not 16-byte aligned or pixel stride != 1 (channels_last, offset views): per-element loads"
_CHANNEL_GATHER = "per-channel gather at the map table's channel numbers (maps start at any channel)"
_ALIGNED_NARROW = {name: _CHANNEL_GATHER for name in (
    "mean", "invstd", "scale", "bias", "mean_dz", "mean_dz_xhat", "weight", "partial_dz", "partial_dz_xhat",
    "partial_grad_weight")}
# With TF32 on sm_90, _grad_input's dout tile (pixels x output channels) is
# the A operand of a wgmma whose reduction runs over output channels. wgmma
# takes tf32 operands only K-major (the transposed forms exist for 16-bit
# types alone), while NCHW dout is contiguous along pixels, the M side: each
# thread's copy into the K-major staging buffer steps along channels, H*W
# elements apart, one 4-byte element at a time. fp16/bf16 (transposable) and
# fp32 without TF32 (no tensor cores) load the same tile 128 bits at a time.
# Loading the tile pixel-major and transposing it with tl.trans compiles to
# the same 4-byte loads (Triton 3.9, sm_90): Triton stages the operand
# K-major either way.
_TF32_DOUT = ("tf32 wgmma operand: tf32 takes K-major operands only, and dout's K (output channels) is strided "
              "in NCHW; 128-bit in fp16/bf16 and without TF32")


def _narrow_reasons(vector: int, arguments: dict, tf32_dout: bool = False) -> dict:
    """The ``narrow`` map of one report row (``KernelSpec``)."""
    if vector == 1:
        return {"*": _GENERAL_NARROW}
    reasons = {name: reason for name, reason in _ALIGNED_NARROW.items() if name in arguments}
    return {**reasons, "grad_out": _TF32_DOUT} if tf32_dout else reasons


def bytes_per_element(size: int, c_out: int, kernel: str) -> tuple[float, float]:
    """(bytes per element of the concatenated input, the roofline). The
    forward reads the input once per FORWARD_BLOCK_N tile of output channels and
    writes c_out / K outputs per input element (counted against K = c_out,
    the ratio of DenseNet's wider layers is lower); the backward kernels
    read the input and dout and write dx; a perfect bottleneck reads x once
    and writes its output once per pass."""
    tiles = triton.cdiv(c_out, FORWARD_BLOCK_N)
    if kernel == "forward":
        return (tiles + 1) * size, 2 * size
    if kernel == "grad_weight":
        return 2 * size, 2 * size
    return 3 * size, 3 * size


def kernel_specialisations():
    """The four kernels in each dtype (float32 with and without TF32) for
    the benchmark's first dense layer, with the block sizes and warps the
    launchers use, each in both specialisations: aligned NCHW maps
    (``VECTOR`` = 16 bytes) and the general kernels."""
    for dtype in REPORT_DTYPES:
        for vector in (16 // dtype.itemsize, 1):
            yield from _report_specs(dtype, vector)


def _report_specs(dtype: torch.dtype, vector: int):
    """The rows of one dtype in one specialisation (``VECTOR``)."""
    layer = BENCHMARK_LAYER
    hw = layer["height"] * layer["width"]
    m, k, c_out = layer["batch"] * hw, layer["channels"], layer["out_channels"]
    blocks = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, VECTOR=vector)
    kind = "aligned" if vector > 1 else "general"
    size = dtype.itemsize
    for allow_tf32 in ((False, True) if dtype == torch.float32 else (False,)):
        label = f"{str(dtype)[6:]}{' tf32' if allow_tf32 else ''} {layer['batch']}x{k}x{layer['height']}x" \
                f"{layer['width']} -> {c_out} {kind}"
        vectors = dict(mean=torch.float32, scale=torch.float32, bias=torch.float32)
        out_strides = dict(out_stride_n=c_out * hw, out_stride_c=hw, out_stride_hw=1)
        forward = dict(table=torch.int64, tiles=torch.int64, num_tiles=triton.cdiv(k, BLOCK_K), **vectors,
                       weight=dtype, out=dtype, M=m, HW=hw, K=k, C_OUT=c_out, **out_strides)
        forward_blocks = dict(blocks, BLOCK_M=FORWARD_BLOCK_M, BLOCK_N=FORWARD_BLOCK_N)
        yield KernelSpec(_forward, forward, dict(ALLOW_TF32=allow_tf32, **forward_blocks), NUM_WARPS, label,
                         *bytes_per_element(size, c_out, "forward"), _narrow_reasons(vector, forward),
                         _forward_stages(dtype, allow_tf32))
        go = dict(go_stride_n=c_out * hw, go_stride_c=hw, go_stride_hw=1)
        grad = dict(g_stride_n=k * hw, g_stride_c=hw, g_stride_hw=1)
        for batch_stats in (True, False):
            # dz goes to a float32 scratch buffer for 16-bit maps with batch statistics
            grad_dtype = torch.float32 if batch_stats else dtype
            arguments = dict(table=torch.int64, tiles=torch.int64, **vectors, invstd=torch.float32, weight=dtype,
                             grad_out=dtype, partial_dz=torch.float32, partial_dz_xhat=torch.float32,
                             grad=grad_dtype, M=m, HW=hw, K=k, C_OUT=c_out, **go, **grad)
            yield KernelSpec(_grad_input, arguments, dict(BATCH_STATS=batch_stats, ALLOW_TF32=allow_tf32,
                                                          **blocks), NUM_WARPS,
                             label + (" batch stats" if batch_stats else " running stats"),
                             *bytes_per_element(size, c_out, "grad_input"),
                             _narrow_reasons(vector, arguments, tf32_dout=allow_tf32))
        finish = dict(table=torch.int64, tiles=torch.int64, mean=torch.float32, invstd=torch.float32,
                      scale=torch.float32, mean_dz=torch.float32, mean_dz_xhat=torch.float32,
                      grad_z_buffer=torch.float32, grad=dtype, M=m, HW=hw, **grad, dtype_ptr=dtype)
        if not allow_tf32:
            yield KernelSpec(_finish_grad_input, finish, dict(BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, VECTOR=vector),
                             NUM_WARPS,
                             f"{str(dtype)[6:]} {layer['batch']}x{k}x{layer['height']}x{layer['width']} {kind}",
                             *bytes_per_element(size, c_out, "finish"), _narrow_reasons(vector, finish))
        # _pixel_splits on an H100 (132 SMs)
        block_m, stages = _grad_weight_tiles(dtype, allow_tf32)
        _, rows_per_split = _split_rows(m, triton.cdiv(c_out, BLOCK_N) * triton.cdiv(k, BLOCK_K), 4 * 132, block_m)
        weight_grad = dict(table=torch.int64, tiles=torch.int64, mean=torch.float32, scale=torch.float32,
                           bias=torch.float32, grad_out=dtype, partial_grad_weight=torch.float32,
                           dtype_ptr=dtype, M=m, HW=hw, K=k, C_OUT=c_out, **go, ROWS_PER_SPLIT=rows_per_split)
        yield KernelSpec(_grad_weight, weight_grad, dict(ALLOW_TF32=allow_tf32, **dict(blocks, BLOCK_M=block_m)),
                         NUM_WARPS, label, *bytes_per_element(size, c_out, "grad_weight"),
                         _narrow_reasons(vector, weight_grad), stages)
