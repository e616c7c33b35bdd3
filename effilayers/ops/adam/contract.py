"""What ``effilayers::adam_step_`` and ``effilayers::adam_step_8bit_`` take,
checked in one place.

One call updates a run of parameters whose optimizer states sit back to back
in flat buffers (``effilayers.optim`` keeps them in fixed-size chunks)::

    adam_step_(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master,
               step, grad_scale, found_inf, hyper=AdamHyperParams(...))

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
* ``hyper``: the :class:`AdamHyperParams` record. The custom ops' schemas
  and every kernel (C++, Triton, reference) take its fields as their last
  arguments, scalars in the record's order: :func:`op_schema` writes them
  from the record, and the caller of the op unpacks it there, once
  (``*hyper.values``); nothing below the op rebuilds it.

8-bit block-quantized states (``adam_step_8bit_``) take ``exp_avg`` as int8
codes and ``exp_avg_sq`` (and ``max_exp_avg_sq``) as uint8 codes, each
followed by its float32 absmax scales, one per block of ``QUANT_BLOCK`` =
256 elements::

    adam_step_8bit_(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                    max_exp_avg_sq, max_exp_avg_sq_absmax, master, step, grad_scale, found_inf, hyper=...)

Layout: every parameter's states start on a block boundary, so a block never
holds two parameters (and never straddles a chunk): parameter ``t`` owns
``padded_numel(numel_t) = ceil(numel_t / 256) * 256`` state elements, and the
code buffers (and ``master``, if given) are ``sum(padded_numel)`` long, the
scale buffers ``sum(padded_numel) / 256``. Padding codes are zero and stay
zero. Parameters are fp16, bf16 or fp32 (float64 parameters keep float64
states in the optimizer and never come here). The codes themselves are
described in :mod:`effilayers.ops.adam.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..._core.layout import is_dense, same_layout

__all__ = ["AdamHyperParams", "PARAM_DTYPES", "STATE_DTYPES", "QUANT_PARAM_DTYPES", "QUANT_BLOCK", "EXP_AVG_LEVELS",
           "EXP_AVG_SQ_LEVELS", "padded_numel", "op_schema", "check_adam_arguments",
           "check_adam_8bit_arguments", "check_hyperparameters"]

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STATE_DTYPES = (torch.float32, torch.bfloat16)
QUANT_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

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


@dataclass(frozen=True)
class AdamHyperParams:
    """The scalar settings of one Adam/AdamW update, in the order the ops'
    schemas take them. Values are stored as Python floats and bools (a
    tensor ``lr`` is read once, here)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool
    maximize: bool

    def __post_init__(self) -> None:
        for name, kind in _FIELDS:
            object.__setattr__(self, name, kind(getattr(self, name)))
        # A plain tuple for ``op(..., found_inf, *hyper.values)``: Dynamo of
        # torch 2.11 cannot unpack a frozen dataclass, but reads a tuple
        # attribute of one as constants.
        object.__setattr__(self, "values", tuple(getattr(self, name) for name, _ in _FIELDS))

    def __iter__(self):
        """The values in schema order (``values``)."""
        return iter(self.values)


# (name, type) of each field; the annotations are strings ("float", "bool")
_FIELDS = tuple((f.name, {"float": float, "bool": bool}[f.type]) for f in fields(AdamHyperParams))


class OpSchema(NamedTuple):
    schema: str
    mutates: tuple[str, ...]


def op_schema(states: Sequence[str], amsgrad_states: Sequence[str]) -> OpSchema:
    """The torch.library schema of an Adam step op whose flat state buffers
    are ``states`` (and, optional, ``amsgrad_states``), and the arguments it
    writes: ``(params, grads, *states, *amsgrad_states, master, step,
    grad_scale, found_inf, *AdamHyperParams fields) -> ()``, with the alias
    annotations torch.library.infer_schema would write."""
    arguments = [("Tensor[]", "params", True), ("Tensor[]", "grads", False),
                 *(("Tensor", name, True) for name in states),
                 *(("Tensor?", name, True) for name in amsgrad_states),
                 ("Tensor?", "master", True), ("Tensor", "step", False), ("Tensor?", "grad_scale", False),
                 ("Tensor?", "found_inf", False),
                 *((kind.__name__, name, False) for name, kind in _FIELDS)]
    text = [f"{kind.replace('Tensor', f'Tensor(a{index}!)') if written else kind} {name}"
            for index, (kind, name, written) in enumerate(arguments)]
    return OpSchema(f"({', '.join(text)}) -> ()", tuple(name for _, name, written in arguments if written))


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(dtype).replace("torch.", "") for dtype in dtypes]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def _check_params(op: str, params, grads, dtypes: Sequence[torch.dtype], span: Callable[[int], int],
                  hint: str = "") -> int:
    """params and grads pair up in dtype, shape and strides; returns the
    number of state elements they own (the sum of ``span(numel)``)."""
    if len(params) != len(grads):
        raise ValueError(f"{op}: {len(params)} params but {len(grads)} grads")
    if not params:
        raise ValueError(f"{op}: params must not be empty")
    dtype = params[0].dtype
    if dtype not in dtypes:
        raise TypeError(f"{op}: params must be {_dtype_names(dtypes)}, got {dtype}{hint}")
    total = 0
    for index, (p, g) in enumerate(zip(params, grads)):
        if p.dtype != dtype or g.dtype != dtype:
            raise TypeError(f"{op}: params[{index}] / grads[{index}] must all have dtype {dtype}, "
                            f"got {p.dtype} / {g.dtype}")
        if p.shape != g.shape:
            raise ValueError(f"{op}: grads[{index}] has shape {tuple(g.shape)}, param {tuple(p.shape)}")
        if not (is_dense(p) and same_layout(p, g)):
            raise ValueError(f"{op}: params[{index}] must be dense (contiguous or a permutation of it, "
                             f"like channels_last) and grads[{index}] must have its strides; got strides "
                             f"{p.stride()} and {g.stride()}")
        total += span(p.numel())
    return total


def _check_master_and_step(op: str, master: Optional[torch.Tensor], step: torch.Tensor, total: int,
                           layout: str = "") -> None:
    if master is not None:
        if master.dtype != torch.float32 or master.dim() != 1 or master.numel() != total:
            raise ValueError(f"{op}: master must be a 1-D float32 tensor of {total} elements{layout}")
    if step.numel() != 1 or step.dtype != torch.float32:
        raise ValueError(f"{op}: step must be a 1-element float32 tensor")


def check_adam_arguments(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step) -> None:
    """The checks every backend of adam_step_ relies on (the C++ kernel repeats them)."""
    op = "adam_step_"
    total = _check_params(op, params, grads, PARAM_DTYPES, int)
    state_dtype = exp_avg.dtype
    allowed = (torch.float64,) if params[0].dtype == torch.float64 else STATE_DTYPES
    for name, state in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("max_exp_avg_sq", max_exp_avg_sq)):
        if state is None:
            continue
        if state.dim() != 1 or state.numel() != total or not state.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous 1-D tensor of {total} elements, "
                             f"got shape {tuple(state.shape)}")
        if state.dtype != state_dtype or state_dtype not in allowed:
            raise TypeError(f"{op}: {name} must have dtype in {allowed} (and all states the same), "
                            f"got {state.dtype}")
    _check_master_and_step(op, master, step, total)


def check_adam_8bit_arguments(params, grads, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                              max_exp_avg_sq, max_exp_avg_sq_absmax, master, step) -> None:
    """The checks every backend of adam_step_8bit_ relies on (the C++ kernel repeats them)."""
    op = "adam_step_8bit_"
    total = _check_params(op, params, grads, QUANT_PARAM_DTYPES, padded_numel,
                          hint=" (float64 parameters keep float64 states)")
    if (max_exp_avg_sq is None) != (max_exp_avg_sq_absmax is None):
        raise ValueError(f"{op}: max_exp_avg_sq and max_exp_avg_sq_absmax go together (amsgrad)")
    for name, codes, absmax, code_dtype in (
            ("exp_avg", exp_avg, exp_avg_absmax, torch.int8),
            ("exp_avg_sq", exp_avg_sq, exp_avg_sq_absmax, torch.uint8),
            ("max_exp_avg_sq", max_exp_avg_sq, max_exp_avg_sq_absmax, torch.uint8)):
        if codes is None:
            continue
        if codes.dtype != code_dtype or codes.dim() != 1 or codes.numel() != total or not codes.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous 1-D {code_dtype} tensor of {total} "
                             f"elements (each parameter padded to a multiple of {QUANT_BLOCK}), got "
                             f"{codes.dtype} of shape {tuple(codes.shape)}")
        if (absmax.dtype != torch.float32 or absmax.dim() != 1 or absmax.numel() != total // QUANT_BLOCK
                or not absmax.is_contiguous()):
            raise ValueError(f"{op}: {name}_absmax must be a contiguous 1-D float32 tensor of "
                             f"{total // QUANT_BLOCK} elements (one per block of {QUANT_BLOCK}), got "
                             f"{absmax.dtype} of shape {tuple(absmax.shape)}")
    _check_master_and_step(op, master, step, total, layout=" (the padded layout of the states)")


def check_hyperparameters(name: str, lr, betas, eps, weight_decay) -> None:
    """The optimizer's settings as torch.optim.Adam/AdamW check them (with
    their messages' substance), once per param group."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{name}: lr as a Tensor must have one element, got {lr.numel()}")
        lr = float(lr)
    if not isinstance(lr, (int, float)) or not 0.0 <= lr:
        raise ValueError(f"{name}: lr must be a float >= 0, got {lr!r}")
    if not 0.0 <= eps:
        raise ValueError(f"{name}: eps must be >= 0, got {eps!r}")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}") from None
    if isinstance(beta1, torch.Tensor) != isinstance(beta2, torch.Tensor):
        # torch.optim.Adam/AdamW refuse the mix with this message (torch 2.13).
        raise ValueError(f"{name}: betas must be either both floats or both Tensors, got "
                         f"({type(beta1).__name__}, {type(beta2).__name__})")
    for index, beta in enumerate((beta1, beta2)):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"{name}: betas[{index}] must be in [0, 1), got {beta!r}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay!r}")
