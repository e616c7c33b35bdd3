"""Optimizers whose state lives in flat chunks updated by fused kernels.

``ChunkedAdam`` / ``ChunkedAdamW`` replace ``torch.optim.Adam`` / ``AdamW``
with no other change; see :mod:`effilayers.optim.adam`. Imports go one way:
adam (the classes) -> functional (the core), state (the chunk store),
offload -> chunks -> effilayers.ops; functional -> effilayers.ops; sharded
(DTensor helpers) is imported by adam, state and chunks.
"""

from ..ops.adam import AdamHyperParams
from .adam import DEFAULT_CHUNK_SIZE, ChunkedAdam, ChunkedAdamW
from .functional import chunked_adam, chunked_adam_8bit

__all__ = ["ChunkedAdam", "ChunkedAdamW", "chunked_adam", "chunked_adam_8bit", "AdamHyperParams",
           "DEFAULT_CHUNK_SIZE"]
