"""Triton kernels (the GPU implementation of ops that have no CUDA kernel).

Each module here imports ``triton`` at import time, so import them lazily:
``effilayers.ops.<family>`` registers a small wrapper that imports
``effilayers.kernels.<family>`` on first call. The package itself imports
without triton installed. Under ``TRITON_INTERPRET=1`` (set before triton is
imported) the same kernels run on CPU tensors; that is how CI tests them.
"""
