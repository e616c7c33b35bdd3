"""Rows split over several Triton programs that exchange partial results
(softmax and cross-entropy rows too long for one program's registers).

A launch of ``rows * splits`` programs: each draws a ticket at its start
(:func:`split_piece`), which names its row and piece, so that every program
with a lower ticket has started; the pieces of one row are then running at
once whenever the GPU holds ``splits`` programs, an order the launch order
alone does not promise. A piece reads its values once and keeps them in
registers, stores its partials, counts itself in and polls, at most
``spin`` times, until every piece of its row has done so
(:func:`wait_for_pieces`); then each merges the row's partials and writes
its results from the values it holds. A piece whose wait ran out computes
the missing partials from the input itself, a second read of those pieces
that gives the same values, so the result does not depend on which way it
went. The Triton interpreter runs one program at a time: there a piece
cannot wait (``spin`` 0), and every piece but a row's last takes that way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Polls of the other pieces' arrival before a piece reads their values itself.
SPIN = 1 << 14
# Pieces a row at most: 64 programs of up to 512 threads run at once on any
# A100 or H100, so a row's pieces meet.
MAX_SPLITS = 64


@triton.jit
def split_piece(work_ptr, splits):
    """(row, piece) of this program, from a ticket drawn at its start."""
    ticket = tl.atomic_add(work_ptr, 1).to(tl.int64)
    return ticket // splits, ticket % splits


@triton.jit
def wait_for_pieces(arrivals_ptr, splits, spin):
    """Counts this piece in and polls, at most ``spin`` times, until every
    piece of the row has published its partials; whether they all did.

    The barriers make the one thread's release and acquire speak for the
    whole program: the partials may have been stored by other threads than
    the one that counts in, and the row's partials are read by all of them."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel") + 1
    polls = 0
    while (arrived < splits) & (polls < spin):
        arrived = tl.atomic_add(arrivals_ptr, 0, sem="acquire")
        polls += 1
    tl.debug_barrier()
    return arrived >= splits


def split_count(n_cols: int, block: int, rows: int) -> int:
    """Pieces per row of BLOCK-wide pieces, 0 where the tickets of every
    piece would not fit an int32 or a row would need more than MAX_SPLITS."""
    splits = triton.cdiv(n_cols, block)
    return splits if splits <= MAX_SPLITS and rows * splits < 2**31 else 0


def split_buffers(rows: int, splits: int, partials_per_piece: int, dtype: torch.dtype, device: torch.device):
    """The ticket counter and per-row arrival counts (zeroed: one fill
    kernel), and the uninitialised partials, of one launch."""
    work = torch.zeros(1 + rows, dtype=torch.int32, device=device)
    return work, torch.empty(rows * splits * partials_per_piece, dtype=dtype, device=device)


def spin(device: torch.device) -> int:
    # Under the interpreter one program runs at a time: a piece waiting for
    # the next one would wait forever, so it does not wait.
    return SPIN if device.type == "cuda" else 0
