"""Triton GPU kernels (also run on CPU tensors under ``TRITON_INTERPRET=1``).

Each module is imported lazily by its op in ``effilayers/ops/`` so that
importing effilayers does not need Triton.
"""
