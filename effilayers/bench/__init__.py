"""``python -m effilayers.bench`` / ``effilayers-bench``: what effilayers
saves on a model (see :mod:`effilayers.bench.cli`).

Modules, each importing only those after it: ``cli`` (arguments, the run,
exit status), ``budget`` (the ``--budget`` rows), ``report`` (table, ``--json``, ``--plot``), ``measure``
(timing, activation and CUDA peak bytes, ``--max-batch``, the ``--train``
loss check), ``variants`` (what is measured per model). This package
re-exports their public names; patch a name in the module that uses it.
"""

# --max-batch is effilayers.find_max_batch; its helpers stay reachable here.
from ..max_batch import find_max_batch, is_out_of_memory, max_tries
from .cli import main
from .measure import LOSS_NOISE_FACTOR, LOSS_TOLERANCE_FLOOR, SEED, SPREAD_WARNING, Result, Setup, time_call
from .report import (
    agreement,
    conclusion,
    format_losses,
    format_table,
    gradient_cell,
    loss_warnings,
    measured_cells,
    plot,
    precision_name,
    timing_warning,
)
from .variants import (
    AS_GIVEN,
    LEAKY,
    PLAIN,
    BenchError,
    CheckpointedDenseLayer,
    Variant,
    builtin_models,
    checkpointed_densenet,
    peer_inplace_abn_resnet,
    torchvision_densenet,
    variants_for,
)

__all__ = ["find_max_batch", "is_out_of_memory", "builtin_models", "plot", "main",
           "max_tries", "time_call", "Setup", "Result", "SEED", "LOSS_NOISE_FACTOR", "LOSS_TOLERANCE_FLOOR",
           "measured_cells", "agreement", "gradient_cell", "format_table", "conclusion", "format_losses",
           "loss_warnings", "precision_name",
           "BenchError", "Variant", "PLAIN", "AS_GIVEN", "LEAKY", "variants_for", "peer_inplace_abn_resnet",
           "CheckpointedDenseLayer", "checkpointed_densenet", "torchvision_densenet",
           "SPREAD_WARNING", "timing_warning"]
