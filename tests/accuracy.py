"""How close a result must be to its reference, in one place.

``TOLERANCES["default"]`` is the table every comparison starts from: results
computed from the same (already rounded) inputs against a float64 reference,
fp32 ~1e-5, fp16 ~1e-3 relative, bf16 ~1e-2. The other tiers exist because a
test asks for more (an elementwise update is one rounding away from exact),
or because its computation carries more error for a stated reason (a long
sum, a GEMM, a comparison with PyTorch's own rounding instead of float64).
A tier never serves to make a failing test pass: its reason is written next
to it, and a tighter bound is always welcome.

An entry is ``(rtol, atol)``; ``scaled`` tiers give atol in units of the
largest |expected| of the tensor (errors that come from rounding the inputs
of a sum scale with its largest terms, not with each element).
"""

from __future__ import annotations

import torch

from effilayers._selftest import TIERS as PACKAGE_TIERS, TOLERANCES as PACKAGE_TOLERANCES

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

TOLERANCES = {
    # (the package's own table: python -m effilayers.info --selftest holds kernels to it)
    "default": dict(PACKAGE_TOLERANCES),
    # One elementwise update (an Adam step) from the same inputs: the error
    # is the output's rounding, and the updates (~1e-2) are far above atol.
    "elementwise": {f64: (1e-12, 1e-14), f32: (1e-5, 1e-7), f16: (1e-3, 1e-5), bf16: (1e-2, 1e-5)},
    # Adam's moments after one step; bf16 moments are small (|m| ~0.1,
    # v ~0.01), so the bf16 atol is below the parameters'.
    "adam_state": {f32: (1e-5, 1e-7), bf16: (1e-2, 1e-6)},
    # 100-step trajectories under the Triton kernel: it derives the bias
    # corrections from the step counter in float32 on the device (no host
    # sync), which moves them by ~1e-7 relative.
    "adam_trajectory_triton": {f32: (1e-5, 2e-5)},
    # 8-bit states against the reference's: a code one step off (a value on
    # a rounding boundary, the kernels' float32 arithmetic differing in the
    # last bit) moves that element's fp32 update by up to ~1e-6.
    "adam_8bit_param": {f32: (1e-5, 1e-6), f16: (1e-3, 1e-5), bf16: (1e-2, 1e-5)},
    # The same, for the Triton kernel on chunks of several parameters: on
    # these inputs one fp32 element of 5356 ends 8e-6 from the reference
    # (float32 rounding differences; the gather-based kernel it replaced
    # gave the same result bit for bit); the updates are ~1e-2.
    "adam_8bit_multi_param": {f32: (1e-5, 2e-5), f16: (1e-3, 2e-5), bf16: (1e-2, 2e-5)},
    # Reductions (sum, mean, var, std, norm) against float64: the absolute
    # part equals the relative one, for results that cancel to near zero
    # while their terms are not.
    "reduction": dict(PACKAGE_TIERS["reduction"]),
    # Batch statistics are accumulated and returned in float32 whatever the
    # input dtype (float64 stays float64): one float32 bound for all three,
    # relative only (tests/test_stats.py adds a floor for means near zero).
    "batch_stats": {f64: (1e-12, 0.0), f32: (2e-5, 0.0), f16: (2e-5, 0.0), bf16: (2e-5, 0.0)},
    # ABN / InPlaceABN against torch's BatchNorm + activation run in the
    # same dtype (not float64): both sides carry their own rounding (torch
    # rounds the normalized value to fp16/bf16 before the activation, the
    # fused kernel rounds once, and the two compute the statistics apart).
    "vs_torch_batch_norm": {f64: (1e-10, 1e-10), f32: (1e-4, 1e-4), f16: (1e-2, 1e-2), bf16: (8e-2, 8e-2)},
    # softmax: the output rounding (fp16 2^-11, bf16 2^-8) plus fp32 sums;
    # atol is two units of the dtype's smallest subnormal: outputs in the
    # subnormal range are computed, not flushed to 0 (the C++ exp is within
    # one unit of the correctly rounded float there, measured over every 4th
    # float in [-110, 44]), and the division by the sum adds one rounding
    # (test_subnormal_outputs holds it).
    "softmax": {f64: (1e-12, 2**-1073), f32: (1e-5, 2**-148), f16: (1e-3, 2**-23), bf16: (8e-3, 2**-132)},
    # log-softmax values are sums of terms up to |x - max|: the absolute
    # error scales with them.
    "log_softmax": {f64: (1e-12, 1e-10), f32: (1e-5, 2e-5), f16: (1e-3, 2e-3), bf16: (8e-3, 2e-2)},
    # softmax gradients, relative to the largest gradient of the tensor, so
    # tiny entries do not demand more digits than the float32 sums carry.
    "softmax_grad": {f64: (1e-10, 1e-10), f32: (2e-5, 2e-5), f16: (2e-3, 2e-3), bf16: (2e-2, 2e-2)},
    # The DenseNet bottleneck's 1x1 ops (a GEMM over the channels after
    # BatchNorm + ReLU) against float64: fp32 sums in another order. In
    # fp16/bf16 the error comes from rounding the GEMMs' inputs (y, dy) and
    # the outputs, so it scales with a tensor's largest values: measured on
    # tests/test_densenet_ops.py's cases (6 seeds x 2 layouts x 2 statistics;
    # reference, cpp, Triton under the interpreter in fp16) at most 0.96 of
    # (2e-3, 3e-4) in fp16 and 0.81 of (1.6e-2, 2e-3) in bf16; the bounds
    # leave ~2.5x.
    "densenet_gemm": dict(PACKAGE_TIERS["gemm"]),
    # The same GEMMs in TF32 (a GPU with the cuDNN TF32 flag on), which
    # rounds each GEMM input to 10 mantissa bits. Measured by emulating it on
    # CPU for the same cases (float64 GEMMs over inputs rounded as the
    # interpreter's _round_f32_to_tf32 rounds, 5 seeds): max |error| / max
    # |expected| per output 3.5e-4 (out) to 5.7e-4 (grad_bias); the bound
    # leaves ~7x.
    "densenet_gemm_tf32": dict(PACKAGE_TIERS["gemm_tf32"]),
    # Two float64 models (tests/equivalence.py: convert/revert, the model
    # builders), relative to each tensor's largest entry: the small ResNets
    # normalise some channels over only a few values (batch 2 at 1x1 in the
    # last stage), where rounding differences of 1e-16 grow to ~1e-11 in
    # the gradients. A wrong activation or parameter shows as ~1e-2.
    "float64_model": {f64: (0.0, 1e-9)},
    # linear_cross_entropy's gradients against float64 F.linear +
    # F.cross_entropy from the same rounded input, weight and bias, relative
    # to each gradient's largest entry (GEMM outputs, like densenet_gemm).
    # The logits are rounded to fp16/bf16 as F.linear rounds them, and the
    # logits' gradient once more by the row kernel. Measured on
    # tests/test_linear_cross_entropy.py's cases (37-512 tokens, 300-50257
    # classes, chunks of 1 to all tokens): at most 1.8e-3 (fp16) and 1.35e-2
    # (bf16; torch's own unfused bf16 is as far); 1.3e-6 in fp32.
    "linear_cross_entropy": {f32: (1e-5, 1e-5), f16: (1e-3, 4e-3), bf16: (1e-2, 3e-2)},
}
SCALED = {"densenet_gemm": (f16, bf16), "densenet_gemm_tf32": (f32,), "float64_model": (f64,),
          "linear_cross_entropy": (f32, f16, bf16)}

# Optimizer trajectories with compressed states against torch.optim.AdamW
# with fp32 states, 100 steps of lr 1e-2 on tests/optim_cases.py's net:
# the largest |param - torch| and the relative L2 error per tensor.
#   bf16 states (8 bits of mantissa): measured 1.7e-3 on parameters up to
#   0.52, 0.6 %; the bounds are ~3x that (documented in docs/guide/optim.md).
#   8-bit states, measured on the reference and C++ paths (adamw / amsgrad):
#   6.4e-3 / 8.8e-3, <= 3.0 % / 2.8 %; the bounds are ~2.3x that
#   (docs/guide/optim.md, "8-bit states", quotes the measurement).
TRAJECTORY_BOUNDS = {bf16: dict(atol=5e-3, rel_l2=0.02), "8bit": dict(atol=2e-2, rel_l2=0.07)}


def tolerance(dtype: torch.dtype, tier: str = "default", scale: float | None = None) -> dict:
    """``dict(rtol=, atol=)`` for results in ``dtype``; a scaled tier needs
    ``scale``, the largest |expected| its atol is relative to."""
    try:
        rtol, atol = TOLERANCES[tier][dtype]
    except KeyError:
        raise KeyError(f"no tolerance for {dtype} in tier {tier!r} (tests/accuracy.py)") from None
    if dtype in SCALED.get(tier, ()):
        if scale is None:
            raise ValueError(f"tier {tier!r} scales atol for {dtype}: pass scale (the largest |expected|)")
        atol *= scale
    return dict(rtol=rtol, atol=atol)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tier: str = "default",
                 **kwargs) -> None:
    """torch.testing.assert_close at the tolerance of ``tier`` for results in
    ``dtype`` (a scaled tier takes its scale from ``expected``); other
    keyword arguments (msg, equal_nan, check_dtype, ...) pass through."""
    scale = expected.abs().max().item() if dtype in SCALED.get(tier, ()) else None
    torch.testing.assert_close(actual, expected, **tolerance(dtype, tier, scale), **kwargs)
