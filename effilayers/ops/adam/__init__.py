"""The fused Adam/AdamW update of a chunk of parameters: ``effilayers::adam_step_``
and, on 8-bit block-quantized states, ``effilayers::adam_step_8bit_``.

contract.py: the arguments, the :class:`AdamHyperParams` record and the checks;
reference.py: the math, the 8-bit codes and the pure-PyTorch kernels;
triton.py: the Triton kernels (imported on first use); op.py: the declared ops
and ``call``, the one way into them.
"""

from .contract import (
    PARAM_DTYPES,
    QUANT_BLOCK,
    STATE_DTYPES,
    AdamHyperParams,
    check_adam_8bit_arguments,
    check_adam_arguments,
    padded_numel,
)
from .op import adam_step_, adam_step_8bit_
from .reference import (
    adam_step_8bit_reference,
    adam_step_reference,
    dequantize_exp_avg,
    dequantize_exp_avg_sq,
    gather_padded,
    quantize_exp_avg,
    quantize_exp_avg_sq,
    scatter_padded,
)

__all__ = ["adam_step_", "adam_step_reference", "adam_step_8bit_", "adam_step_8bit_reference", "AdamHyperParams",
           "PARAM_DTYPES", "STATE_DTYPES", "QUANT_BLOCK", "padded_numel", "quantize_exp_avg", "quantize_exp_avg_sq",
           "dequantize_exp_avg", "dequantize_exp_avg_sq", "gather_padded", "scatter_padded", "check_adam_arguments",
           "check_adam_8bit_arguments"]
