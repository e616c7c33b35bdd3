"""CPU offload of the chunked optimizers' states.

``offload="cpu"`` keeps states and master weights in CPU memory (pinned when
CUDA is present). For CUDA parameters each chunk's gradients are copied down
into a pinned staging buffer on a side stream, the C++ CPU kernel updates the
chunk, and the parameters are copied back up on another side stream, the
copies of one chunk overlapping the CPU work on its neighbour. For CPU
parameters the states are already on the CPU and the step is the ordinary one.
The staged pipeline has not been run on a GPU in this repository yet (no GPU
was available when it was written); the same code runs in the tests with the
streams replaced by synchronous copies.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .chunks import _Chunk

__all__ = ["_Transfers"]


class _Transfers:
    """Copies between parameter device and CPU states for offloaded chunks.
    On CUDA: side streams and events, so chunk i+1's gradients come down while
    the CPU updates chunk i, and parameters go up while the CPU works on the
    next chunk. Without CUDA every copy is synchronous and waits are no-ops."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.down = torch.cuda.Stream(device)
            self.up = torch.cuda.Stream(device)
            self.main = torch.cuda.current_stream(device)

    def copy_down(self, chunk: _Chunk, start: int, stop: int, grads: list[torch.Tensor]):
        targets = [chunk.view(chunk.grad_staging, i) for i in range(start, stop)]
        if not self.cuda:
            torch._foreach_copy_(targets, grads)
            return None
        # the gradients were produced on the main stream
        self.down.wait_stream(self.main)
        with torch.cuda.stream(self.down):
            torch._foreach_copy_(targets, grads, non_blocking=True)
            for g in grads:
                g.record_stream(self.down)
            done = torch.cuda.Event()
            done.record(self.down)
        return done

    def wait_down(self, done) -> None:
        if done is not None:
            done.synchronize()

    def copy_up(self, chunk: _Chunk, start: int, stop: int) -> None:
        source = chunk.param_staging if chunk.param_staging is not None else chunk.master
        params = [p.detach() for p in chunk.params[start:stop]]
        sources = [chunk.view(source, i) for i in range(start, stop)]
        if not self.cuda:
            torch._foreach_copy_(params, sources)
            return
        self.up.wait_stream(self.main)
        with torch.cuda.stream(self.up):
            torch._foreach_copy_(params, sources, non_blocking=True)

    def finish(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.up)

    def runs(self, chunks: list[tuple[_Chunk, list[Optional[torch.Tensor]], bool]],
             grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> Iterator[tuple]:
        """The pipeline over offloaded chunks, each given with its gradients
        and whether every parameter has one. Yields ``(chunk, start, stop,
        params, grads, grad_scale, found_inf)`` per run of parameters that
        share a step count, on the CPU (the staging ranges and CPU copies of
        the scale and flag) once that run's gradients are down; the caller
        updates it, and the generator sends the parameters up when resumed,
        while the next run's gradients are already on their way."""
        work = [(chunk, start, stop, grads[start:stop])
                for chunk, grads, complete in chunks for start, stop in chunk.runs(grads, complete)]
        if not work:
            return
        # Blocking copies: a non_blocking device-to-host copy may return before
        # the value lands, and the CPU kernel must wait for the gradients anyway.
        cpu_scale = None if grad_scale is None else grad_scale.to("cpu", torch.float32)
        cpu_found = None if found_inf is None else found_inf.to("cpu", torch.float32)
        pending = self.copy_down(*work[0])
        for position, (chunk, start, stop, _) in enumerate(work):
            done = pending
            if position + 1 < len(work):
                pending = self.copy_down(*work[position + 1])
            self.wait_down(done)
            lo, hi = chunk.offsets[start], chunk.offsets[stop]
            # with an fp32 master the kernel writes the rounded parameters to
            # the staging buffer; without one it updates the CPU copy in place
            params = chunk.param_staging if chunk.master_is_fp32 else chunk.master
            yield chunk, start, stop, [params[lo:hi]], [chunk.grad_staging[lo:hi]], cpu_scale, cpu_found
            self.copy_up(chunk, start, stop)
        self.finish()
