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
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import backends

__all__ = ["adam_step_", "adam_step_reference", "PARAM_DTYPES", "STATE_DTYPES"]

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
    backends.kernel("adam_step", exp_avg.device)(
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


backends.register(
    backends.OpKernels(name="adam_step", reference=adam_step_reference, cpp="adam_step_", triton=_triton_kernel)
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
