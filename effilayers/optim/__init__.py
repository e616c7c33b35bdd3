"""Optimizers whose state lives in flat chunks updated by fused kernels.

``ChunkedAdam`` / ``ChunkedAdamW`` replace ``torch.optim.Adam`` / ``AdamW``
with no other change; see :mod:`effilayers.optim.adam`.
"""

from .adam import DEFAULT_CHUNK_SIZE, ChunkedAdam, ChunkedAdamW, chunked_adam

__all__ = ["ChunkedAdam", "ChunkedAdamW", "chunked_adam", "DEFAULT_CHUNK_SIZE"]
