"""What a family declares for ``python -m effilayers.info --selftest``.

Each op family's ``ops/<family>/selftest.py`` holds ``CASES`` (one
:class:`Case` per registered op: the small inputs its kernels run on) and,
where its computation carries more error than :data:`TOLERANCES` allows,
``TIERS`` (named tolerance tables, each with its reason) and ``SCALED`` (the
tiers whose atol is relative to the tensor's largest value). The runner,
``effilayers/_selftest.py``, finds them; no list names the families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

# (rtol, atol) per result dtype, for results computed from the same (already
# rounded) inputs as a float64 reference: the dtype's rounding plus float32
# accumulation. tests/accuracy.py starts its default tier from this table.
TOLERANCES = {f64: (1e-10, 1e-12), f32: (1e-5, 1e-6), f16: (1e-3, 1e-3), bf16: (1e-2, 1e-2)}

# Rows longer than one Triton program holds (softmax's and cross-entropy's
# MAX_FUSED_BLOCK): on a GPU they are split over three programs, the last
# piece partial.
LONG_ROW = 40000


@dataclass(frozen=True)
class Case:
    """Small inputs of one op: ``make(device, dtype, generator)`` returns the
    argument tuples to call the kernel with (one per path worth running:
    a row kernel and a tile kernel, one parameter and several). ``tier``
    names a tolerance table: ``"default"`` (:data:`TOLERANCES`) or one of
    its family's ``TIERS``. ``tf32(dtype)``, where given, says whether the
    op's Triton kernels on a GPU round float32 inputs to TF32 at the present
    settings; the rows then take the tier ``<tier>_tf32``."""

    make: Callable[[torch.device, torch.dtype, torch.Generator], list[tuple]]
    dtypes: tuple = (f32, f16)
    tier: str = "default"
    float64_oracle: bool = True
    tf32: Optional[Callable[[torch.dtype], bool]] = None


def randn(shape, generator, dtype, device, scale=1.0, offset=0.0) -> torch.Tensor:
    """Random values of varied magnitude (never all zero)."""
    values = torch.randn(shape, generator=generator, dtype=f64) * scale + offset
    return values.to(dtype).to(device)


def positive(shape, generator, device, low=0.5, high=2.0) -> torch.Tensor:
    """float32 values in [low, high): scales, variances, weights."""
    return (torch.rand(shape, generator=generator, dtype=f64) * (high - low) + low).to(f32).to(device)
