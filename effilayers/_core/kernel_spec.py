"""What a Triton launcher would compile, written down without a GPU.

Every ``ops/<family>/triton.py`` has a ``kernel_specialisations()`` that
yields one :class:`KernelSpec` per (kernel, dtype, configuration) its
launchers can pick at the benchmark shapes, built with the same block-size
and warp helpers the launchers call. ``python -m effilayers.info --kernels``
(``effilayers/_kernel_report.py``) compiles each spec for sm_90 and sm_80 and
checks registers, spills and access widths.

Arguments are given as the launcher would pass them: a ``torch.dtype`` for a
tensor (a fresh allocation, so 16-byte aligned), a Python int, float or bool
for a scalar. :func:`specialise` turns them into Triton's signature with
the launcher's own rule (ints equal to 1 become constants, pointers and ints
divisible by 16 carry that fact), so the compiled code is what the GPU runs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class KernelSpec(NamedTuple):
    """One compilation of one kernel, as a launcher would request it.

    ``bytes_per_element`` is what this kernel moves per element of the
    family's unit (its modeled traffic), ``roofline_bytes`` what a perfect
    kernel of the family must move. ``narrow`` maps an argument name (or
    ``"*"``, the whole kernel) to the reason its per-thread global accesses
    cannot be 128 bits wide; every other per-thread access must be.
    ``reread`` says why this kernel moves more than ``roofline_bytes``."""
    kernel: Any
    arguments: dict
    constexprs: dict
    num_warps: int
    config: str
    bytes_per_element: float
    roofline_bytes: float
    narrow: dict = {}
    num_stages: Optional[int] = None  # None: Triton's default, as the launchers leave it
    # The capabilities (90, 80) whose launchers pick this spec; None: every one.
    # A tile table chosen per architecture compiles only for its own.
    targets: Optional[tuple] = None
    # Why a memory-bound kernel moves more bytes than its roofline (the
    # report fails such a row without one, or with a "pending:" one).
    reread: str = ""

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__


def _launcher_view(value: Any) -> tuple[str, Any]:
    """(Triton type, specialisation) of one argument, from Triton's own
    launcher rule (``native_specialize_impl``, in Triton 3.6 and 3.9 alike):
    a small CPU tensor stands for a fresh allocation of that dtype."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    if isinstance(value, torch.dtype):
        value = torch.empty(16, dtype=value)
    kind, fact = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
    return kind, fact


def specialise(spec: KernelSpec) -> tuple[dict, dict, list]:
    """(signature, constexprs, divisible) of ``spec`` in argument order:
    ``signature`` maps every argument name to its Triton type ("constexpr"
    for constants, which the launcher makes of None and the integer 1),
    ``divisible`` lists the names the launcher marks as multiples of 16
    (aligned pointers, integers divisible by 16)."""
    names = spec.kernel.arg_names
    missing = [n for n in names if n not in spec.arguments and n not in spec.constexprs]
    extra = [n for n in (*spec.arguments, *spec.constexprs) if n not in names]
    unexplained = [n for n in spec.narrow if n != "*" and n not in names]
    if missing or extra or unexplained:
        raise ValueError(f"{spec.name}: arguments missing {missing}, unknown {extra}, narrow reasons for "
                         f"unknown arguments {unexplained}")
    signature, constexprs, divisible = {}, {}, []
    for name in names:
        if name in spec.constexprs:
            signature[name], constexprs[name] = "constexpr", spec.constexprs[name]
            continue
        kind, fact = _launcher_view(spec.arguments[name])
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = fact
        elif fact == "D":
            divisible.append(name)
    return signature, constexprs, divisible
