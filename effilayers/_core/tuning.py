"""Launch configurations measured on a GPU, read by the Triton launchers.

A family may ship ``ops/<family>/tuned_<arch>.json``, one table per GPU
architecture, named by compute capability (``sm90`` for 9.0: H100 and H200).
The architecture, not the device name, because what a configuration is
tuned against (register file, shared memory, SM count, what the compiler
emits) is fixed by it; chips of one architecture differ mostly in memory
bandwidth, which moves every candidate alike. Each entry records the device
it was measured on.

A table is written by ``python3 benchmarks/tune.py merge WINNERS.json`` from
what ``benchmarks/tune.py sweep`` measured on a GPU, and read once per
(family, architecture) on the first lookup. A launcher asks for its key
(:func:`shape_key`: the launcher, the dtype, each size rounded up to a power
of two) and falls back to its own heuristic on a miss, a CPU tensor (the
interpreter) or an architecture without a table. Nothing is timed at run
time: a first call never pays for a sweep.

Table layout (``entries`` keyed by :func:`shape_key`)::

    {"arch": "sm90", "entries": {"row_forward bfloat16 32768":
        {"config": {"BLOCK": 4096, "num_warps": 8}, "us": 101.2, "heuristic_us": 118.0,
         "device": "NVIDIA H200", "date": "...", "triton": "3.6.0"}}}
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from pathlib import Path
from typing import Optional

import torch

_OPS = Path(__file__).resolve().parent.parent / "ops"
_tables: dict[tuple[str, str], dict] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


# Under TRITON_INTERPRET=1 the kernels run on CPU tensors: the interpreter
# is a device of its own, with no table shipped, which tests and the sweep's
# --tiny install to see a table honoured without a GPU.
_INTERPRETER = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else None


def arch(device: torch.device) -> Optional[str]:
    """'sm90' for a CUDA device of compute capability 9.0, 'interpreter' for
    CPU tensors under TRITON_INTERPRET=1; None elsewhere (no table)."""
    if device.type != "cuda":
        return _INTERPRETER
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


# What a persistent grid (programs per SM) counts on the interpreter, which
# has no SMs: few, so a test's persistent launch loops over more row blocks
# than it has programs.
INTERPRETER_MULTIPROCESSORS = 2


@functools.lru_cache(maxsize=None)
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The device's SM count (INTERPRETER_MULTIPROCESSORS for CPU tensors)."""
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def table_path(family: str, arch_name: str, ops: Optional[Path] = None) -> Path:
    return (ops or _OPS) / family / f"tuned_{arch_name}.json"


def _load(family: str, arch_name: str) -> dict:
    path = table_path(family, arch_name)
    if not path.exists():
        return {}
    return {key: entry["config"] for key, entry in json.loads(path.read_text())["entries"].items()}


def table(family: str, arch_name: str) -> dict:
    """``{key: config}`` of one family on one architecture ({} without a table)."""
    found = _tables.get((family, arch_name))
    if found is None:
        with _lock:
            found = _tables.setdefault((family, arch_name), _load(family, arch_name))
    return found


def shape_key(launcher: str, dtype: torch.dtype, *sizes: int) -> str:
    """'row_forward bfloat16 32768': sizes rounded up to a power of two, so
    one entry serves the shapes whose blocks the heuristics would size alike."""
    rounded = (1 << max(int(size) - 1, 0).bit_length() for size in sizes)
    return f"{launcher} {str(dtype).removeprefix('torch.')} {'x'.join(map(str, rounded))}"


class Probed(Exception):
    """Raised by :func:`lookup` inside :func:`probe`: what the launch asked for."""

    def __init__(self, family: str, launcher: str, dtype: torch.dtype, sizes: tuple[int, ...]):
        super().__init__(family, launcher, dtype, sizes)
        self.family, self.launcher, self.dtype, self.sizes = family, launcher, dtype, sizes
        self.key = shape_key(launcher, dtype, *sizes)


_probing = False


def probe(launch) -> Probed:
    """What ``launch()`` looks up, without launching anything: the launch
    stops at its lookup (so meta tensors of any size will do). For
    benchmarks/tune.py, which takes its keys from the launchers themselves."""
    global _probing
    with _lock:
        _probing = True
        try:
            launch()
        except Probed as request:
            return request
        finally:
            _probing = False
    raise RuntimeError("the launch looked nothing up")


def lookup(family: str, device: torch.device, launcher: str, dtype: torch.dtype, *sizes: int) -> Optional[dict]:
    """The tuned configuration for this launch, or None (use the heuristic)."""
    if _probing:
        raise Probed(family, launcher, dtype, sizes)
    arch_name = arch(device)
    if arch_name is None:
        return None
    entries = table(family, arch_name)
    # The key is only formatted when there is a table to look in.
    return entries.get(shape_key(launcher, dtype, *sizes)) if entries else None


_recorded: Optional[list] = None


def note(family: str, launcher: str, dtype: torch.dtype, sizes: tuple, config: dict, tuned: bool) -> None:
    """A launcher's choice, kept while :func:`recording` (else nothing: one
    test of a global per launch)."""
    if _recorded is not None:
        _recorded.append({"family": family, "key": shape_key(launcher, dtype, *sizes), "config": dict(config),
                          "source": "tuned" if tuned else "heuristic"})


@contextlib.contextmanager
def recording():
    """Yields a list that gathers every configuration the launchers choose
    inside (family, table key, config, "tuned" or "heuristic"): what a
    benchmark row records, so a later run tells which path it timed."""
    global _recorded
    previous, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = previous


def install(family: str, arch_name: str, entries: dict) -> None:
    """Replace the loaded table (the sweep times candidates through the very
    lookup a committed table takes)."""
    with _lock:
        _tables[(family, arch_name)] = dict(entries)


def clear() -> None:
    """Forget the loaded tables; the next lookup reads the files again."""
    with _lock:
        _tables.clear()


# Candidates a sweep times keep at most this many values of a block per
# thread (per live vector): the launchers' heuristics stay within it, and
# beyond it ptxas spills, which no sweep minute should be spent finding out.
MAX_VALUES_PER_THREAD = 32
WARPS = (1, 2, 4, 8, 16, 32)


def plausible(block_elements: int, num_warps: int) -> bool:
    """Whether a block of this many values over this many warps is worth
    timing: every thread has at least one value and at most
    MAX_VALUES_PER_THREAD, and the block is at most 1024 threads."""
    threads = 32 * num_warps
    return num_warps in WARPS and threads <= block_elements <= MAX_VALUES_PER_THREAD * threads


def launch_options(config: dict) -> dict:
    """The keyword arguments of a launch that are Triton's, not the kernel's."""
    return {name: config[name] for name in ("num_warps", "num_stages") if name in config}


def around(heuristic: dict, variations: dict, elements) -> list[dict]:
    """The heuristic, then each configuration one knob away from it (every
    value in ``variations[knob]``), and each such one with its warps scaled
    to keep the values per thread, kept when :func:`plausible`
    (``elements(config)`` is its block's values): a sweep short enough for
    a few minutes of GPU, centred on what runs today."""
    found = [dict(heuristic)]
    for knob, values in variations.items():
        for value in values:
            config = dict(heuristic, **{knob: value})
            warps = config["num_warps"]
            rescaled = warps * elements(config) // max(elements(heuristic), 1)
            for candidate in (config, dict(config, num_warps=rescaled)):
                if candidate not in found and plausible(elements(candidate), candidate["num_warps"]):
                    found.append(candidate)
    return found


# Rows of at most SHORT_ROW values (the short rows: 2K) come several
# to a program of the row kernels (softmax, cross-entropy), a [ROWS, BLOCK]
# block reduced along each line, until a program reads PROGRAM_BYTES: 1024
# bf16 values (2 KiB) are 4 warps' worth of 128-bit loads, one load each,
# too little work per program to cover its start and its reductions'
# latency; 8 such rows are 16 KiB over 8 warps, a row per warp, so each
# row's reduction stays inside its warp. At most MAX_ROWS_BLOCK values (32
# per thread at 8 warps, as the longest single rows hold).
SHORT_ROW = 2048
PROGRAM_BYTES = 16384
MAX_ROWS_BLOCK = 8192
# A persistent grid (a configuration's "persistent": programs per SM) loops
# each program over row blocks p, p + programs, ...; the value the sweep
# tries. Not the heuristic's choice: Triton does not pipeline the loop
# (softmax's persistent _row_forward, bf16 rows of 1024, compiled for sm_90
# with num_stages 1 to 4 by Triton 3.6 and 3.9: the same plain ld.global
# each time, no cp.async, no more shared memory), so a program's next
# block is not fetched during its reductions, and without that the grid
# saves only block launches, which the GPU overlaps with running blocks;
# the loop also costs registers (the kernel report's persistent rows).
PERSISTENT_PROGRAMS = 4


def rows_per_program(block: int, element_size: int) -> int:
    """How many whole rows of ``block`` values one program takes (the
    heuristic's ROWS)."""
    if block > SHORT_ROW:
        return 1
    wanted = 1 << (max(1, -(-PROGRAM_BYTES // (block * element_size))) - 1).bit_length()
    return max(1, min(wanted, MAX_ROWS_BLOCK // block))


def row_grid(config: dict, single: bool, rows: int, device: torch.device) -> tuple[int, bool, int]:
    """(ROWS, PERSISTENT, programs) of a row kernel's launch: ROWS only
    where a row is held whole (and no more than there are rows); a
    persistent grid (``persistent``: programs per SM) only where there are
    more row blocks than its programs."""
    per_program = min(config.get("ROWS", 1), 1 << max(rows - 1, 0).bit_length()) if single else 1
    blocks = -(-rows // per_program)
    programs = multiprocessors(device) * config.get("persistent", 0)
    persistent = single and 0 < programs < blocks
    return per_program, persistent, programs if persistent else blocks
