"""What the ResNet and DenseNet builders share: argument checks, torchvision's
weight arguments, and the modules a ``norm_act`` choice puts after a
convolution (norm, activation slot, ImageNet stem)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ..nn.pooling import MaxPool2d
from ..ops.abn.module import FusedActivation, fused_norm

# The leaky_relu slope of norm_act="inplace": ReLU is not invertible.
INPLACE_SLOPE = 0.01


def _prefixed(owner: Optional[str], message: str) -> str:
    return f"{owner}: {message}" if owner else message


def check_norm_act(norm_act: Any, allowed: Sequence[str], owner: Optional[str] = None) -> str:
    if not isinstance(norm_act, str) or norm_act not in allowed:
        raise ValueError(_prefixed(owner, f"norm_act must be one of {', '.join(map(repr, allowed))}, "
                                          f"got {norm_act!r}"))
    return norm_act


def positive_int(value: Any, name: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{owner}: {name} must be positive, got {value}")
    return value


def check_bool(value: Any, name: str, owner: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__}")
    return value


def drop_weight_arguments(kwargs: dict, family: str) -> dict:
    """``kwargs`` without torchvision's weight arguments. The no-weights call
    generic code makes (``weights=None``, ``pretrained=False``, any
    ``progress``, which only concerns a download) is accepted and ignored:
    nothing is downloaded. Asking for weights raises, with how to load them."""
    kwargs = dict(kwargs)
    kwargs.pop("progress", None)
    for name, no_weights in (("weights", None), ("pretrained", False)):
        if name in kwargs:
            value = kwargs.pop(name)
            if value is not no_weights:
                raise TypeError(
                    f"effilayers {family} ship no weights: {name} must be {no_weights}, got {value!r}. Build the "
                    "torchvision model with its weights and load them: "
                    "model.load_state_dict(torchvision_model.state_dict())"
                )
    return kwargs


def fix_arguments(kwargs: dict, model: str, **fixed: Any) -> dict:
    """``kwargs`` with the arguments a named variant defines; a different
    value would build another network under the same name. A tuple value
    also accepts any sequence of the same items."""
    for name, value in fixed.items():
        given = kwargs.get(name, value)
        if (tuple(given) if isinstance(value, tuple) and isinstance(given, Sequence) else given) != value:
            raise ValueError(f"this model fixes {name}={value}, got {name}={given!r}; "
                             f"use {model}(...) directly for other values")
    return dict(kwargs, **fixed)


def activated_norm(channels: int, norm_act: str) -> nn.Module:
    """The norm after a convolution that is followed by an activation:
    BatchNorm2d ("plain"), or a fused module that applies the activation
    itself ("abn": relu; "inplace": leaky_relu(INPLACE_SLOPE), in place)."""
    if norm_act == "plain":
        return nn.BatchNorm2d(channels)
    if norm_act == "abn":
        return fused_norm(channels, activation="relu", activation_param=0.0, in_place=False)
    return fused_norm(channels, activation="leaky_relu", activation_param=INPLACE_SLOPE, in_place=True)


def activation_slot(norm_act: str, norm_name: str) -> nn.Module:
    """The activation slot after the :func:`activated_norm` named ``norm_name``. A fused
    model keeps a pass-through there, so its forward is the same in every
    mode and effilayers.revert knows where the activation goes."""
    return nn.ReLU(inplace=True) if norm_act == "plain" else FusedActivation(norm_name)


def imagenet_stem(channels: int, norm_act: str, norm_name: str) -> list[nn.Module]:
    """The 7x7 stride-2 convolution, its norm, activation slot and 3x3
    stride-2 max pool. In place mode the pool recomputes its argmax in
    backward instead of keeping int64 indices (twice the fp32 map they index)."""
    pool = MaxPool2d if norm_act == "inplace" else nn.MaxPool2d
    return [nn.Conv2d(3, channels, kernel_size=7, stride=2, padding=3, bias=False), activated_norm(channels, norm_act),
            activation_slot(norm_act, norm_name), pool(kernel_size=3, stride=2, padding=1)]
