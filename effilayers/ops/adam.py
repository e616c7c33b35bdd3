"""The fused Adam/AdamW update of one chunk: ``effilayers::adam_step_``.

One call updates a run of parameters whose optimizer states sit back to back
in flat buffers (``effilayers.optim`` keeps them in fixed-size chunks)::

    adam_step_(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master,
               step, grad_scale, found_inf,
               lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize)

* ``params`` / ``grads``: lists of dense tensors of one dtype (float16,
  bfloat16, float32, float64): contiguous, or any permutation of it such as
  channels_last; each grad has its param's dtype, shape and strides.
* ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` for amsgrad): 1-D,
  ``sum(p.numel())`` long, float32 or bfloat16 (float64 for float64 params);
  element ``k`` belongs to the ``k``-th value of the params laid end to end
  *in memory order* (for a channels_last param, its channels_last order).
* ``master``: optional float32 copy of the params, same flat layout. When
  given, the update is applied to ``master`` and ``params`` receive its
  rounded value (fp16/bf16 training with fp32 master weights).
* ``step``: a 1-element float32 tensor holding the step number *of this
  update* (the caller increments it first); the bias corrections are derived
  from it inside the kernel, so an LR schedule or a skipped step needs no
  host synchronisation.
* ``grad_scale`` / ``found_inf``: optional 1-element float32 tensors from
  ``torch.amp.GradScaler``. Gradients are divided by ``grad_scale``; when
  ``found_inf`` is non-zero nothing is written at all.

The math is torch.optim.Adam's (single-tensor path), in float32 (float64 for
float64 params)::

    g = grad / grad_scale;  g = -g if maximize
    decoupled: p *= 1 - lr * weight_decay      else: g += weight_decay * p
    m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
    v_hat = max(v_max, v) (amsgrad) else v
    p -= lr / (1 - beta1^step) * m / (sqrt(v_hat) / sqrt(1 - beta2^step) + eps)

States stored in bfloat16 are read, updated in float32 and rounded to nearest
even when written.

8-bit block-quantized states: ``effilayers::adam_step_8bit_``
-------------------------------------------------------------
The same update with ``exp_avg`` stored as int8 codes and ``exp_avg_sq`` (and
``max_exp_avg_sq``) as uint8 codes, one float32 absmax scale per block of
``QUANT_BLOCK`` = 256 elements::

    adam_step_8bit_(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                    max_exp_avg_sq, max_exp_avg_sq_absmax, master, step, grad_scale, found_inf,
                    lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize)

Layout: every parameter's states start on a block boundary, so a block never
holds two parameters (and never straddles a chunk): parameter ``t`` owns
``padded_numel(numel_t) = ceil(numel_t / 256) * 256`` state elements, and the
code buffers (and ``master``, if given) are ``sum(padded_numel)`` long, the
scale buffers ``sum(padded_numel) / 256``. Padding codes are zero and stay
zero. Parameters are fp16, bf16 or fp32 (float64 parameters keep float64
states in the optimizer and never come here).

The code is companded, not linear (``a`` is the block's absmax)::

    exp_avg:    m = sign(q) * (|q| / 127)^2 * a      q in [-127, 127]  (int8)
    exp_avg_sq: v = (q / 255)^4 * a                  q in [0, 255]     (uint8)

and a value is encoded by rounding ``127 * sqrt(|m| / a)`` (resp.
``255 * (v / a)^(1/4)``) to nearest (``floor(x + 0.5)``). Why: the update is
``m / sqrt(v)``, and within a block ``v`` spans several decades. A linear
8-bit code rounds every ``v`` below ``a / 510`` to zero, the denominator
collapses to ``eps`` and the update explodes (measured: a 3-layer MLP with
lr 1e-2 diverges to NaN with linear codes). The 4th-power code keeps values
down to ``~1.5e-11 * a`` with a relative step of ``4 / q`` (1.6 % at the top
of the block); in addition a non-zero ``v`` never encodes to 0 (it keeps code
1, ``2.4e-10 * a``), so quantization can over-estimate but never zero the
denominator. ``m`` only multiplies, so its small values may round to 0; the
square-law code spends its levels on the large ones (relative step ``2 / q``).
Both codes cost two multiplies to decode and one or two square roots to
encode: no lookup table, cheap to vectorise on CPU and GPU.

Each kernel decodes a block into float32, runs the update above, takes a
fresh absmax of the new ``m`` / ``v`` per block and re-encodes. With
``found_inf`` non-zero nothing is written (codes and scales included).
A NaN (a NaN gradient without a GradScaler) makes its block's absmax NaN and
its codes 0 on every backend, so the whole block decodes to NaN: the
divergence stays visible in the states instead of being encoded as a finite
value (with float32 states only the element itself would be NaN).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._core import registry

__all__ = ["adam_step_", "adam_step_reference", "adam_step_8bit_", "adam_step_8bit_reference", "PARAM_DTYPES",
           "STATE_DTYPES", "QUANT_BLOCK", "padded_numel", "quantize_exp_avg", "quantize_exp_avg_sq",
           "dequantize_exp_avg", "dequantize_exp_avg_sq"]

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def compute_dtype(param_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` fills one block of memory without gaps or overlaps
    (contiguous, channels_last or any other permutation of contiguous)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same strides wherever a dimension has more than one element."""
    return all(size == 1 or sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


def memory_flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as a 1-D view."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step) -> None:
    """The checks every backend relies on (the C++ kernel repeats them)."""
    if len(params) != len(grads):
        raise ValueError(f"adam_step_: {len(params)} params but {len(grads)} grads")
    if not params:
        raise ValueError("adam_step_: params must not be empty")
    dtype = params[0].dtype
    if dtype not in PARAM_DTYPES:
        raise TypeError(f"adam_step_: params must be float16, bfloat16, float32 or float64, got {dtype}")
    total = 0
    for index, (p, g) in enumerate(zip(params, grads)):
        if p.dtype != dtype or g.dtype != dtype:
            raise TypeError(f"adam_step_: params[{index}] / grads[{index}] must all have dtype {dtype}, "
                            f"got {p.dtype} / {g.dtype}")
        if p.shape != g.shape:
            raise ValueError(f"adam_step_: grads[{index}] has shape {tuple(g.shape)}, param {tuple(p.shape)}")
        if not (is_dense(p) and same_layout(p, g)):
            raise ValueError(f"adam_step_: params[{index}] must be dense (contiguous or a permutation of it, "
                             f"like channels_last) and grads[{index}] must have its strides; got strides "
                             f"{p.stride()} and {g.stride()}")
        total += p.numel()
    state_dtype = exp_avg.dtype
    allowed = (torch.float64,) if dtype == torch.float64 else STATE_DTYPES
    for name, state in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("max_exp_avg_sq", max_exp_avg_sq)):
        if state is None:
            continue
        if state.dim() != 1 or state.numel() != total or not state.is_contiguous():
            raise ValueError(f"adam_step_: {name} must be a contiguous 1-D tensor of {total} elements, "
                             f"got shape {tuple(state.shape)}")
        if state.dtype != state_dtype or state_dtype not in allowed:
            raise TypeError(f"adam_step_: {name} must have dtype in {allowed} (and all states the same), "
                            f"got {state.dtype}")
    if master is not None:
        if master.dtype != torch.float32 or master.dim() != 1 or master.numel() != total:
            raise ValueError(f"adam_step_: master must be a 1-D float32 tensor of {total} elements")
    if step.numel() != 1 or step.dtype != torch.float32:
        raise ValueError("adam_step_: step must be a 1-element float32 tensor")


def adam_step_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    master: Optional[torch.Tensor],
    step: torch.Tensor,
    grad_scale: Optional[torch.Tensor],
    found_inf: Optional[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """Pure PyTorch on flat copies: the test oracle and the fallback. A
    skipped (``found_inf``) step is a ``torch.where`` on the results, not a
    host-side branch, so this path does not synchronise either."""
    check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step)
    acc = compute_dtype(params[0].dtype)
    flat_grad = torch.cat([memory_flat(g) for g in grads]).to(acc)
    old_param = master if master is not None else torch.cat([memory_flat(p) for p in params])
    param = old_param.to(acc)
    if grad_scale is not None:
        flat_grad = flat_grad / grad_scale.to(acc)
    if maximize:
        flat_grad = -flat_grad
    # step-derived factors, computed in float64 like torch's Python floats
    step64 = step.reshape(()).to(torch.float64)
    bias_correction1 = 1 - beta1 ** step64
    bias_correction2_sqrt = (1 - beta2 ** step64).sqrt()
    step_size = (lr / bias_correction1).to(acc)
    if weight_decay != 0:
        if decoupled_weight_decay:
            param = param * torch.tensor(1 - lr * weight_decay, dtype=torch.float64).to(acc)
        else:
            flat_grad = flat_grad + torch.tensor(weight_decay, dtype=torch.float64).to(acc) * param
    m = exp_avg.to(acc).lerp(flat_grad, 1 - beta1)
    v = exp_avg_sq.to(acc) * beta2 + (1 - beta2) * (flat_grad * flat_grad)
    v_hat = v
    new_max = None
    if max_exp_avg_sq is not None:
        new_max = torch.maximum(max_exp_avg_sq.to(acc), v)
        v_hat = new_max
    denom = v_hat.sqrt() / bias_correction2_sqrt.to(acc) + eps
    param = param - step_size * (m / denom)

    skip = None if found_inf is None else found_inf.reshape(()) != 0

    def commit(target: torch.Tensor, value: torch.Tensor) -> None:
        value = value.to(target.dtype)
        if skip is not None:
            value = torch.where(skip, target, value)
        target.copy_(value)

    commit(exp_avg, m)
    commit(exp_avg_sq, v)
    if new_max is not None:
        commit(max_exp_avg_sq, new_max)
    if master is not None:
        new_master = torch.where(skip, master, param.to(master.dtype)) if skip is not None else param.to(master.dtype)
        master.copy_(new_master)
        rounded = new_master
    else:
        flat_params = torch.cat([memory_flat(p) for p in params])
        rounded = param.to(params[0].dtype)
        if skip is not None:
            rounded = torch.where(skip, flat_params, rounded)
    pieces = torch.split(rounded.to(params[0].dtype), [p.numel() for p in params])
    torch._foreach_copy_([memory_flat(p) for p in params], list(pieces))


@torch.library.custom_op(
    "effilayers::adam_step_", mutates_args=("params", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
)
def _adam_step_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    master: Optional[torch.Tensor],
    step: torch.Tensor,
    grad_scale: Optional[torch.Tensor],
    found_inf: Optional[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    registry.kernel("adam_step", exp_avg.device)(
        params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale, found_inf,
        lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize,
    )


@_adam_step_op.register_fake
def _(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale, found_inf,
      lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize):
    return None


def _triton_kernel(*args):
    from ..kernels.adam import adam_step_triton

    return adam_step_triton(*args)


registry.register(
    registry.OpKernels(name="adam_step", reference=adam_step_reference, cpp="adam_step_", triton=_triton_kernel)
)


def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    master: Optional[torch.Tensor],
    step: torch.Tensor,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """One fused Adam/AdamW update of a run of parameters (see the module
    docstring). Mutates ``params``, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq`` and ``master`` in place."""
    check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step)
    _adam_step_op(list(params), list(grads), exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, grad_scale,
                  found_inf, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                  bool(decoupled_weight_decay), bool(maximize))


# -- 8-bit block-quantized states -------------------------------------------------

# Elements per absmax scale. Smaller blocks track local magnitudes better and
# cost more scale bytes: 256 adds 4 / 256 = 0.016 bytes per state element.
# (Dettmers et al. 2021 use 2048 with a dynamic code; with a per-parameter
# block boundary a smaller block also wastes less padding.)
QUANT_BLOCK = 256
EXP_AVG_LEVELS = 127
EXP_AVG_SQ_LEVELS = 255


def padded_numel(numel: int) -> int:
    """State elements a parameter of ``numel`` elements owns in the 8-bit layout."""
    return -(-numel // QUANT_BLOCK) * QUANT_BLOCK


def dequantize_exp_avg(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """int8 codes + per-block absmax -> float32 ``sign(q) * (|q|/127)^2 * absmax``."""
    t = codes.to(torch.float32).abs() / EXP_AVG_LEVELS
    magnitude = ((t * t).view(-1, QUANT_BLOCK) * absmax.view(-1, 1)).view(-1)
    return torch.where(codes < 0, -magnitude, magnitude)


def dequantize_exp_avg_sq(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """uint8 codes + per-block absmax -> float32 ``(q/255)^4 * absmax``."""
    t = codes.to(torch.float32) / EXP_AVG_SQ_LEVELS
    t2 = t * t
    return ((t2 * t2).view(-1, QUANT_BLOCK) * absmax.view(-1, 1)).view(-1)


def _block_ratio(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = values.view(-1, QUANT_BLOCK).abs()
    absmax = blocks.amax(dim=1)
    scale = absmax.view(-1, 1)
    ratio = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks))
    return ratio, absmax


def quantize_exp_avg(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (length a multiple of QUANT_BLOCK) -> (int8 codes, float32 absmax per block)."""
    ratio, absmax = _block_ratio(values.to(torch.float32))
    q = torch.floor(ratio.sqrt() * EXP_AVG_LEVELS + 0.5).clamp_(max=EXP_AVG_LEVELS).view(-1)
    return torch.where(values < 0, -q, q).to(torch.int8), absmax


def quantize_exp_avg_sq(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 >= 0 (length a multiple of QUANT_BLOCK) -> (uint8 codes, float32 absmax per block).
    A non-zero value keeps at least code 1 (see the module docstring)."""
    ratio, absmax = _block_ratio(values.to(torch.float32))
    q = torch.floor(ratio.sqrt().sqrt() * EXP_AVG_SQ_LEVELS + 0.5).clamp_(max=EXP_AVG_SQ_LEVELS).view(-1)
    q = torch.where((q == 0) & (values.view(-1) > 0), torch.ones_like(q), q)
    return q.to(torch.uint8), absmax


def check_adam_8bit_arguments(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                              max_exp_avg_sq, max_exp_avg_sq_absmax, master, step) -> None:
    """The checks every backend of adam_step_8bit_ relies on (the C++ kernel repeats them)."""
    if len(params) != len(grads):
        raise ValueError(f"adam_step_8bit_: {len(params)} params but {len(grads)} grads")
    if not params:
        raise ValueError("adam_step_8bit_: params must not be empty")
    dtype = params[0].dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"adam_step_8bit_: params must be float16, bfloat16 or float32, got {dtype} "
                        "(float64 parameters keep float64 states)")
    total = 0
    for index, (p, g) in enumerate(zip(params, grads)):
        if p.dtype != dtype or g.dtype != dtype:
            raise TypeError(f"adam_step_8bit_: params[{index}] / grads[{index}] must all have dtype {dtype}, "
                            f"got {p.dtype} / {g.dtype}")
        if p.shape != g.shape:
            raise ValueError(f"adam_step_8bit_: grads[{index}] has shape {tuple(g.shape)}, param {tuple(p.shape)}")
        if not (is_dense(p) and same_layout(p, g)):
            raise ValueError(f"adam_step_8bit_: params[{index}] must be dense (contiguous or a permutation of it, "
                             f"like channels_last) and grads[{index}] must have its strides")
        total += padded_numel(p.numel())
    if (max_exp_avg_sq is None) != (max_exp_avg_sq_absmax is None):
        raise ValueError("adam_step_8bit_: max_exp_avg_sq and max_exp_avg_sq_absmax go together (amsgrad)")
    for name, codes, absmax, code_dtype in (
            ("exp_avg", exp_avg, exp_avg_absmax, torch.int8),
            ("exp_avg_sq", exp_avg_sq, exp_avg_sq_absmax, torch.uint8),
            ("max_exp_avg_sq", max_exp_avg_sq, max_exp_avg_sq_absmax, torch.uint8)):
        if codes is None:
            continue
        if codes.dtype != code_dtype or codes.dim() != 1 or codes.numel() != total or not codes.is_contiguous():
            raise ValueError(f"adam_step_8bit_: {name} must be a contiguous 1-D {code_dtype} tensor of {total} "
                             f"elements (each parameter padded to a multiple of {QUANT_BLOCK}), got "
                             f"{codes.dtype} of shape {tuple(codes.shape)}")
        if (absmax.dtype != torch.float32 or absmax.dim() != 1 or absmax.numel() != total // QUANT_BLOCK
                or not absmax.is_contiguous()):
            raise ValueError(f"adam_step_8bit_: {name}_absmax must be a contiguous 1-D float32 tensor of "
                             f"{total // QUANT_BLOCK} elements (one per block of {QUANT_BLOCK}), got "
                             f"{absmax.dtype} of shape {tuple(absmax.shape)}")
    if master is not None:
        if master.dtype != torch.float32 or master.dim() != 1 or master.numel() != total:
            raise ValueError(f"adam_step_8bit_: master must be a 1-D float32 tensor of {total} elements "
                             "(the padded layout of the states)")
    if step.numel() != 1 or step.dtype != torch.float32:
        raise ValueError("adam_step_8bit_: step must be a 1-element float32 tensor")


def gather_padded(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements in memory order, each padded with zeros to a
    multiple of QUANT_BLOCK, end to end (a view when nothing needs padding)."""
    if len(tensors) == 1 and tensors[0].numel() % QUANT_BLOCK == 0:
        return memory_flat(tensors[0])
    flat = torch.zeros(sum(padded_numel(t.numel()) for t in tensors), dtype=tensors[0].dtype,
                       device=tensors[0].device)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(memory_flat(t))
        offset += padded_numel(t.numel())
    return flat


def scatter_padded(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of gather_padded (nothing to do when it returned a view)."""
    if len(tensors) == 1 and tensors[0].numel() % QUANT_BLOCK == 0:
        return
    offset, targets, pieces = 0, [], []
    for t in tensors:
        targets.append(memory_flat(t))
        pieces.append(flat[offset:offset + t.numel()])
        offset += padded_numel(t.numel())
    torch._foreach_copy_(targets, pieces)


def adam_step_8bit_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    max_exp_avg_sq_absmax: Optional[torch.Tensor],
    master: Optional[torch.Tensor],
    step: torch.Tensor,
    grad_scale: Optional[torch.Tensor],
    found_inf: Optional[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """Pure PyTorch: decode, the float32 reference update on the padded flat
    layout, re-encode. The test oracle and the fallback."""
    check_adam_8bit_arguments(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                              max_exp_avg_sq, max_exp_avg_sq_absmax, master, step)
    flat_params = gather_padded(params)
    flat_grads = gather_padded(grads)
    m = dequantize_exp_avg(exp_avg, exp_avg_absmax)
    v = dequantize_exp_avg_sq(exp_avg_sq, exp_avg_sq_absmax)
    v_max = None if max_exp_avg_sq is None else dequantize_exp_avg_sq(max_exp_avg_sq, max_exp_avg_sq_absmax)
    # padding: zero grads, params and states stay zero through the update
    adam_step_reference([flat_params], [flat_grads], m, v, v_max, master, step, grad_scale, found_inf,
                        lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize)
    skip = None if found_inf is None else found_inf.reshape(()) != 0
    encoded = [(exp_avg, exp_avg_absmax, quantize_exp_avg(m)), (exp_avg_sq, exp_avg_sq_absmax, quantize_exp_avg_sq(v))]
    if v_max is not None:
        encoded.append((max_exp_avg_sq, max_exp_avg_sq_absmax, quantize_exp_avg_sq(v_max)))
    for codes, absmax, (new_codes, new_absmax) in encoded:
        if skip is not None:
            new_codes = torch.where(skip, codes, new_codes)
            new_absmax = torch.where(skip, absmax, new_absmax)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)
    scatter_padded(flat_params, params)


@torch.library.custom_op(
    "effilayers::adam_step_8bit_",
    mutates_args=("params", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax", "max_exp_avg_sq",
                  "max_exp_avg_sq_absmax", "master"),
)
def _adam_step_8bit_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    max_exp_avg_sq_absmax: Optional[torch.Tensor],
    master: Optional[torch.Tensor],
    step: torch.Tensor,
    grad_scale: Optional[torch.Tensor],
    found_inf: Optional[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    registry.kernel("adam_step_8bit", exp_avg.device)(
        params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq,
        max_exp_avg_sq_absmax, master, step, grad_scale, found_inf,
        lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize,
    )


@_adam_step_8bit_op.register_fake
def _(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, max_exp_avg_sq, max_exp_avg_sq_absmax,
      master, step, grad_scale, found_inf, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize):
    return None


def _triton_kernel_8bit(*args):
    from ..kernels.adam import adam_step_8bit_triton

    return adam_step_8bit_triton(*args)


registry.register(
    registry.OpKernels(name="adam_step_8bit", reference=adam_step_8bit_reference, cpp="adam_step_8bit_",
                       triton=_triton_kernel_8bit)
)


def adam_step_8bit_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    max_exp_avg_sq_absmax: Optional[torch.Tensor],
    master: Optional[torch.Tensor],
    step: torch.Tensor,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """One fused Adam/AdamW update with 8-bit block-quantized states (see the
    module docstring). Mutates params, codes, scales and master in place."""
    check_adam_8bit_arguments(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                              max_exp_avg_sq, max_exp_avg_sq_absmax, master, step)
    _adam_step_8bit_op(list(params), list(grads), exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                       max_exp_avg_sq, max_exp_avg_sq_absmax, master, step, grad_scale, found_inf, float(lr),
                       float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled_weight_decay),
                       bool(maximize))
