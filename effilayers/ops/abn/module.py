"""Activated BatchNorm modules (``effilayers.nn``): drop-ins for ``BatchNorm{1,2,3}d`` + activation.

``ABN``            act(BN(x)) fused, not in place; any activation, relu and the
                   smooth ones (silu, gelu, ...) included. It keeps only
                   the input and per-channel statistics for backward.
``InPlaceABN``     the same written over its input, keeping only the output
                   for backward; invertible activations only.
``InPlaceABNSync`` InPlaceABN with statistics over a ``torch.distributed``
                   process group.

Each takes ``forward(x, residual=None)``; with a residual they compute
``act(BN(x) + residual)`` (the end of a ResNet block) in one kernel.
Constructor arguments and state dicts match ``torch.nn.BatchNorm2d``
(``weight``, ``bias``, ``running_mean``, ``running_var``,
``num_batches_tracked``), so BatchNorm checkpoints load unchanged.

They are ``torch.nn.modules.batchnorm._BatchNorm`` subclasses, so code that
finds BatchNorms that way (``if isinstance(m, _BatchNorm): m.eval()`` to
freeze statistics, ``torch.func.replace_all_batch_norm_modules_``, FSDP's
full-precision norms) finds them too. They are not ``BatchNorm2d``s: code
that swaps every ``BatchNorm2d`` for another plain norm (torchvision-style
``FrozenBatchNorm2d`` helpers, timm's ``freeze_batch_norm_2d``) would drop
the activation, and leaves them alone. The exception is a norm that
:func:`effilayers.convert` fuses in a model built from timm's classes: it
becomes a run-time subclass of its class here and of timm's
``BatchNormAct2d`` (``convert/timm_blocks.py``), whose ``act`` and ``drop``
describe what it computes in its place, so timm's freeze helpers turn it
into a ``FrozenBatchNormAct2d`` with the same function. torch's own
``SyncBatchNorm.convert_sync_batchnorm`` takes every ``_BatchNorm``; on a
fused module it raises a TypeError pointing to
:meth:`InPlaceABNSync.convert_sync_abn` instead of dropping the activation.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .contract import (
    DEFAULT_WEIGHT_EPS,
    check_activation,
    check_eps,
    check_flag,
    check_in_place,
    check_input,
    check_momentum,
    check_weight_eps,
)
from .op import activated_batch_norm

# What effilayers.nn exports; FusedActivation, fused_norm and the *_ATTR
# names are for effilayers.convert and effilayers.models.
__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync"]

# Where a fused module remembers the BatchNorm class it replaced, for revert.
PLAIN_TYPE_ATTR = "_effilayers_plain_type"
# On a run-time subclass of a fused class (convert's timm form): the fused
# class it extends, and a function giving the same form over another one.
BASE_TYPE_ATTR = "_effilayers_base_type"
WITH_BASE_ATTR = "_effilayers_with_base"


def _base_type(module: nn.Module) -> type:
    return getattr(type(module), BASE_TYPE_ATTR, type(module))


# torch's converter builds a plain SyncBatchNorm from every _BatchNorm; its
# one read of the module after that is ``hasattr(module, "qconfig")``, which
# is where a fused module can still stop it (see ABN.qconfig).
_TORCH_SYNC_CONVERTER = nn.SyncBatchNorm.convert_sync_batchnorm.__func__.__code__


class ABN(_BatchNorm):
    """BatchNorm followed by an activation, in one fused kernel, not in place.

    Args mirror ``torch.nn.BatchNorm2d`` (``num_features``, ``eps``,
    ``momentum`` (None: cumulative average), ``affine``,
    ``track_running_stats``, ``device``, ``dtype`` and the keyword-only
    ``bias``: ``bias=False`` with ``affine=True`` keeps a weight and no
    bias, ``self.bias`` is None and the state dict has no ``bias``, as
    BatchNorm2d(..., bias=False)), plus ``activation``
    (``"leaky_relu"``, ``"elu"``, ``"relu"``, ``"identity"``, ``"silu"``,
    ``"gelu"``, ``"gelu_tanh"`` (GELU(approximate='tanh')), ``"hardswish"``,
    ``"mish"``, ``"relu6"``, ``"sigmoid"`` or ``"tanh"``) and
    ``activation_param`` (leaky_relu's negative slope or elu's alpha; the
    others take none). Backward recomputes the normalised input and the
    activation's derivative from the saved input and the per-channel mean
    and invstd, so BatchNorm + activation's saved norm output is not kept.
    Inputs of rank 2 to 5, any layout, float16/bfloat16/float32/float64;
    parameters and statistics stay in their own (float32) dtype.
    """

    _inplace = False
    # TorchScript would compile the property below; it is for eager callers.
    __jit_unused_properties__ = ["qconfig"]

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, activation: str = "leaky_relu", activation_param: float = 0.01,
                 device=None, dtype=None, *, bias: bool = True) -> None:
        # _NormBase.__init__ is skipped: it knows no bias=False and checks
        # nothing; the same attributes, parameters and buffers are made here.
        nn.Module.__init__(self)
        name = type(self).__name__
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
            raise ValueError(f"{name}: num_features must be a positive int, got {num_features!r}")
        check_eps(eps, name)
        check_momentum(momentum, name)
        check_activation(activation, activation_param, inplace=self._inplace, where=name)
        check_flag(bias, "bias", name)
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = float(eps)
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.activation = activation
        self.activation_param = float(activation_param)
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, **factory))
            if bias:
                self.bias = nn.Parameter(torch.zeros(num_features, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory))
            self.register_buffer("running_var", torch.ones(num_features, **factory))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints from before num_batches_tracked existed, as BatchNorm allows.
        key = prefix + "num_batches_tracked"
        if self.track_running_stats and key not in state_dict:
            state_dict[key] = torch.tensor(0, dtype=torch.long)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        check_input(input, None, type(self).__name__, self.num_features)

    @property
    def qconfig(self):
        """Absent, as on other modules, unless set (quantization tooling sets
        it); but torch's ``convert_sync_batchnorm`` reading it raises, since
        the plain SyncBatchNorm it is building would drop the activation."""
        if sys._getframe(1).f_code is _TORCH_SYNC_CONVERTER:
            raise TypeError(
                f"torch.nn.SyncBatchNorm.convert_sync_batchnorm would replace this {type(self).__name__} "
                f"({self.extra_repr()}) with a plain SyncBatchNorm and drop its {self.activation!r} activation. "
                "Use effilayers.nn.InPlaceABNSync.convert_sync_abn(model, process_group) on a converted model, "
                "or make the BatchNorms SyncBatchNorm before effilayers.convert(model)")
        if "_effilayers_qconfig" in self.__dict__:
            return self.__dict__["_effilayers_qconfig"]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute 'qconfig'")

    @qconfig.setter
    def qconfig(self, value) -> None:
        self.__dict__["_effilayers_qconfig"] = value

    def _group(self):
        return None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        where = type(self).__name__
        check_input(x, residual, where, self.num_features)
        if self._inplace:
            check_in_place(x, residual, where)
        # BatchNorm's rules: batch statistics while training or when there
        # are no running statistics; running statistics read in eval, and
        # updated in training only while track_running_stats is on.
        running_mean, running_var = self.running_mean, self.running_var
        has_running = running_mean is not None or running_var is not None
        if has_running and self.training and not self.track_running_stats:
            running_mean = running_var = None
        tracked = self.num_batches_tracked if self.training and self.track_running_stats else None
        return activated_batch_norm(x, self.weight, self.bias, residual, running_mean, running_var, tracked,
                                    self.training or not has_running, self.momentum, self.eps, self.activation,
                                    self.activation_param, self._weight_eps(), self._group(), self._inplace)

    def _weight_eps(self) -> float:
        return 0.0

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}, activation={self.activation!r}, "
                f"activation_param={self.activation_param}" + (", bias=False" if self.affine and self.bias is None
                                                               else ""))


class InPlaceABN(ABN):
    """In-place activated BatchNorm: overwrites its input with
    ``act(BN(x) [+ residual])`` and keeps only that output for backward.

    Same arguments as :class:`ABN`, plus ``weight_eps``: the scale used is
    ``sign(weight) * max(|weight|, weight_eps)`` so it can be divided by in
    backward; weights at least that large are used unchanged. ``activation``
    must be invertible: ``"leaky_relu"`` (slope > 0, default 0.01), ``"elu"``
    or ``"identity"``; ``"relu"`` raises (use :class:`ABN`).

    The input must not be needed afterwards: it is overwritten, and autograd
    raises if something that saved it later needs it. A leaf tensor that
    requires grad (a model input) cannot be overwritten and raises.

    The weight gradient passes straight through the clamp, so a weight that
    starts at zero (``zero_init_residual``) still trains. Backward rebuilds
    ``x_hat = (act^-1(z) - bias) / s``, which magnifies the rounding of the
    stored output by ``1 / |s|``: in float16/bfloat16, channels whose
    ``|weight|`` is tiny next to ``|bias|`` get noisy gradients. Use
    :class:`ABN` for such layers, or a larger ``weight_eps``.
    """

    _inplace = True

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, activation: str = "leaky_relu", activation_param: float = 0.01,
                 weight_eps: float = DEFAULT_WEIGHT_EPS, device=None, dtype=None, *, bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, activation, activation_param,
                         device=device, dtype=dtype, bias=bias)
        check_weight_eps(weight_eps, type(self).__name__)
        self.weight_eps = float(weight_eps)

    def _weight_eps(self) -> float:
        return self.weight_eps

    def extra_repr(self) -> str:
        return super().extra_repr() + f", weight_eps={self.weight_eps}"


class InPlaceABNSync(InPlaceABN):
    """:class:`InPlaceABN` whose batch statistics (and the matching gradient
    sums) are computed over every rank of ``process_group`` (default: the
    world) through ``torch.distributed``, on any backend. Ranks may hold
    different batch sizes, including zero. Without an initialised process
    group it behaves like :class:`InPlaceABN`.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, activation: str = "leaky_relu", activation_param: float = 0.01,
                 weight_eps: float = DEFAULT_WEIGHT_EPS, process_group=None, device=None, dtype=None, *,
                 bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, activation, activation_param,
                         weight_eps, device=device, dtype=dtype, bias=bias)
        self.process_group = process_group
        # ids of the groups whose ranks were seen to agree on num_features
        self._agreed: set[int] = set()

    @classmethod
    def convert_sync_abn(cls, module: nn.Module, process_group=None) -> nn.Module:
        """``nn.SyncBatchNorm.convert_sync_batchnorm`` for fused modules: every
        :class:`InPlaceABN` in ``module`` becomes an :class:`InPlaceABNSync` on
        ``process_group`` holding the same parameters and buffers (nothing is
        copied; an optimizer built before keeps working). Returns ``module``,
        or the new module when ``module`` itself is an InPlaceABN. A
        non-in-place :class:`ABN` has no synchronised form: TypeError naming
        it. torch's own converter cannot do this: it would build plain
        SyncBatchNorms, so on fused modules it raises (ABN.qconfig)."""
        for path, child in module.named_modules():
            if isinstance(child, ABN) and not isinstance(child, InPlaceABN):
                raise TypeError(f"InPlaceABNSync.convert_sync_abn: {path or 'the module'!r} is an ABN (not in place), "
                                "which has no synchronised form; convert with effilayers.convert(model, "
                                "mode='inplace'), or make the BatchNorms SyncBatchNorm before effilayers.convert")
        if _base_type(module) is InPlaceABN:
            return cls._synced(module, process_group)
        for parent in list(module.modules()):
            for name, child in list(parent._modules.items()):
                if _base_type(child) is InPlaceABN:
                    parent._modules[name] = cls._synced(child, process_group)
        return module

    @classmethod
    def _synced(cls, module: InPlaceABN, process_group) -> "InPlaceABNSync":
        # convert's timm form of an InPlaceABN gives the timm form of cls
        with_base = getattr(type(module), WITH_BASE_ATTR, None)
        kind = with_base(cls) if with_base is not None else cls
        synced = kind(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      module.activation, module.activation_param, module.weight_eps, process_group=process_group,
                      device="meta")
        # the same tensor objects, in the same slots: nothing moves
        synced._parameters.update(module._parameters)
        synced._buffers.update(module._buffers)
        # and the bookkeeping convert left on it (PLAIN_TYPE_ATTR, ...)
        synced.__dict__.update({key: value for key, value in module.__dict__.items()
                                if key.startswith("_effilayers_")})
        synced.train(module.training)
        return synced

    def _group(self):
        # Like SyncBatchNorm: only training synchronises, so evaluation on one
        # rank (or uneven numbers of eval batches) never waits for the others.
        if not self.training or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else torch.distributed.group.WORLD
        # (setdefault: a module pickled before this attribute existed)
        if id(group) not in self.__dict__.setdefault("_agreed", set()) and not torch.compiler.is_compiling():
            self._check_peers(group)
        return group

    def _check_peers(self, group) -> None:
        """Once per process group: every rank's module has the same number of
        channels. The statistics' all_gather with buffers of different sizes
        aborts the process (gloo) or hangs (NCCL) instead of raising, so the
        sizes are compared first, in one small collective."""
        import torch.distributed as dist

        device = self.running_mean.device if self.running_mean is not None else (
            self.weight.device if self.weight is not None else torch.device("cpu"))
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.tensor([self.num_features], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        counts = [int(count) for count in every]
        if len(set(counts)) > 1:
            raise ValueError(f"InPlaceABNSync: the ranks of its process_group have different num_features "
                             f"(by rank: {counts}); every rank must run the same model, or give this module a "
                             "process_group of the ranks that share it")
        self._agreed.add(id(group))


class FusedActivation(nn.Identity):
    """Pass-through standing where an activation module was, now that the
    norm ``fused_into`` (a sibling's name) applies it. :func:`effilayers.revert` puts an
    activation module back here; ``inplace`` is the original's flag.
    ``activation`` / ``activation_param`` (as ABN spells them; None when not
    recorded) name what the fused norm applies for this slot, which
    :func:`effilayers.convert` records so that the slot can be given its
    activation back when that norm is no longer a fused module (frozen by
    timm's ``freeze_batch_norm_2d``)."""

    def __init__(self, fused_into: str, inplace: bool = True, activation: Optional[str] = None,
                 activation_param: float = 0.0) -> None:
        super().__init__()
        if activation is not None:
            check_activation(activation, activation_param, inplace=False, where="FusedActivation")
        self.fused_into = fused_into
        self.inplace = inplace
        self.activation = activation
        self.activation_param = float(activation_param)

    def extra_repr(self) -> str:
        return f"fused_into={self.fused_into!r}"


def fused_norm(num_features: int, *, activation: str, activation_param: float, in_place: bool, eps: float = 1e-5,
               momentum: Optional[float] = 0.1, affine: bool = True, track_running_stats: bool = True,
               plain_type: type = nn.BatchNorm2d, process_group=None, sync: bool = False, device=None,
               dtype=None) -> ABN:
    """An ABN / InPlaceABN / InPlaceABNSync that remembers ``plain_type``,
    the BatchNorm class :func:`effilayers.revert` turns it back into."""
    if sync:
        module = InPlaceABNSync(num_features, eps, momentum, affine, track_running_stats, activation,
                                activation_param, process_group=process_group, device=device, dtype=dtype)
    elif in_place:
        module = InPlaceABN(num_features, eps, momentum, affine, track_running_stats, activation, activation_param,
                            device=device, dtype=dtype)
    else:
        module = ABN(num_features, eps, momentum, affine, track_running_stats, activation, activation_param,
                     device=device, dtype=dtype)
    setattr(module, PLAIN_TYPE_ATTR, plain_type)
    return module
