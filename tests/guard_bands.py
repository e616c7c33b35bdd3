"""Guard bands around every Triton kernel launch under ``TRITON_INTERPRET=1``.

The interpreter reads and writes memory through raw addresses with no bounds
check, so a wrong mask passes silently: a store one element past the end
lands in whatever lies there, a load past the end reads it. :func:`install`
wraps the interpreter's launch (``InterpretedFunction.run``) so that each
launch runs on relocated copies of the memory it may touch:

* every tensor argument, and every region a kernel reaches through an
  address table (:data:`ADDRESS_TABLES`: Adam's parameter table, the
  DenseNet map table), is copied with the same strides into a larger buffer;
  overlapping regions (an in-place op's input and output, a stand-in passed
  twice) share one buffer, at the same distances as in the original;
* the guard bands before and after each region, and the gaps between the
  elements of a strided view, hold NaN (integers: their maximum; bool:
  0xA5), so an out-of-bounds load reads NaN and makes the test's comparison
  fail;
* after the launch, any changed byte outside the arguments' elements raises
  :class:`GuardBandViolation` naming the kernel, the argument and where (so
  an out-of-bounds store fails the test that made it), and the bytes the
  kernel changed are copied back to the original memory.

Regions spanning more than :data:`DENSE_LIMIT` bytes (the tests' rows 2**30
elements apart) are relocated sparsely: their elements and guard bands are
written, the gaps between them are left unmapped pages and not checked.

A kernel that reads raw addresses from an int64 tensor without an
:data:`ADDRESS_TABLES` entry is refused (values above 2**40 are taken for
addresses), so a new kernel of that kind cannot run unguarded.
:data:`GUARDED` counts guarded launches per kernel (``module.function``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Larger spans are relocated sparsely (see the module docstring).
DENSE_LIMIT = 16 * 2**20
# Guard band on each side: as long as the region (a mask off by one block or
# one row lands inside), between 4 KiB and 1 MiB.
MIN_BAND, MAX_BAND = 4096, 2**20
# An int64 value this large in a kernel's tensor argument is an address:
# user-space heap addresses on x86-64 and aarch64 Linux lie far above it, and
# no test tensor has 2**40 elements.
ADDRESS_FLOOR = 2**40
ALIGN = 64

GUARDED: collections.Counter = collections.Counter()
RAW_REGIONS: collections.Counter = collections.Counter()
SPARSE: collections.Counter = collections.Counter()


class GuardBandViolation(AssertionError):
    """A kernel wrote outside the elements of its arguments."""


class UnguardableLaunch(AssertionError):
    """A launch the guard cannot relocate (raw addresses without a decoder)."""


@dataclass
class Region:
    """Memory a launch may touch: ``shape``/``strides`` elements of ``dtype``
    from ``address``; ``name`` says which argument (for messages)."""

    name: str
    address: int
    dtype: torch.dtype
    shape: tuple
    strides: tuple

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def extent(self) -> tuple[int, int]:
        """[first byte, one past the last byte)."""
        last = sum((size - 1) * stride for size, stride in zip(self.shape, self.strides))
        return self.address, self.address + (last + 1) * self.itemsize

    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def _bytes_at(address: int, length: int) -> torch.Tensor:
    """A uint8 tensor over ``length`` bytes of existing memory (not copied)."""
    return torch.frombuffer((ctypes.c_ubyte * length).from_address(address), dtype=torch.uint8)


def _typed(buffer: torch.Tensor, byte_offset: int, region: Region, narrow: bool = False) -> torch.Tensor:
    """``region``'s view placed ``byte_offset`` bytes into uint8 ``buffer``;
    ``narrow``: dims of stride 0 cut to one element (each memory location
    once, so the view can be copied into)."""
    shape = _narrowed(region) if narrow else region.shape
    return torch.empty(0, dtype=region.dtype).set_(
        buffer.untyped_storage(), byte_offset // region.itemsize, shape, region.strides)


def _narrowed(region: Region) -> tuple:
    return tuple(1 if stride == 0 else size for size, stride in zip(region.shape, region.strides))


def _byte_view(buffer: torch.Tensor, byte_offset: int, region: Region) -> torch.Tensor:
    """Every byte of ``region``'s elements in uint8 ``buffer`` (stride-0 dims cut to one element)."""
    item = region.itemsize
    return buffer.as_strided(_narrowed(region) + (item,), tuple(s * item for s in region.strides) + (1,),
                             byte_offset)


_NAN_BITS = {torch.float16: (torch.int16, 0x7E00), torch.bfloat16: (torch.int16, 0x7FC0),
             torch.float32: (torch.int32, 0x7FC00000), torch.float64: (torch.int64, 0x7FF8000000000000)}


def _pattern(dtype: torch.dtype, tag: int) -> torch.Tensor:
    """ALIGN bytes of the sentinel for ``dtype``: a quiet NaN whose payload
    is ``tag`` (a store that copies one band's NaN into another band still
    changes its bytes), the maximum of an integer type, 0xA5 for bool."""
    template = torch.empty(ALIGN, dtype=torch.uint8)
    if dtype in _NAN_BITS:
        integer, bits = _NAN_BITS[dtype]
        template.view(integer).fill_(bits | (tag & 0x3F))
    elif dtype == torch.bool:
        template.fill_(0xA5)
    elif not dtype.is_floating_point and not dtype.is_complex:
        template.view(dtype).fill_(torch.iinfo(dtype).max)
    else:
        template.view(dtype).fill_(float("nan"))
    return template


def _fill(buffer: torch.Tensor, start: int, stop: int, template: torch.Tensor) -> None:
    """The sentinel over bytes [start, stop), both multiples of ALIGN."""
    if stop > start:
        buffer[start:stop].view(-1, ALIGN).copy_(template.expand((stop - start) // ALIGN, ALIGN))


@contextlib.contextmanager
def _no_allocation_fill():
    # A sparse buffer must stay unmapped, even inside a test that has
    # torch fill new allocations with NaN (conftest.poison_cpp_allocations).
    import torch.utils.deterministic as deterministic

    saved, deterministic.fill_uninitialized_memory = deterministic.fill_uninitialized_memory, False
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = saved


class _Group:
    """Overlapping regions relocated into one guarded buffer."""

    def __init__(self, regions: list[Region], tag: int):
        self.regions = regions
        self.low = min(r.extent()[0] for r in regions)
        self.high = max(r.extent()[1] for r in regions)
        self.base = self.low - self.low % ALIGN  # the copy keeps the address modulo ALIGN
        span = -(-(self.high - self.base) // ALIGN) * ALIGN
        self.dense = span <= DENSE_LIMIT
        band = min(max(span, MIN_BAND), MAX_BAND) if self.dense else 16 * MIN_BAND
        self.band = -(-band // ALIGN) * ALIGN
        self.span = span
        primary = next((r.dtype for r in regions if r.dtype.is_floating_point), regions[0].dtype)
        self.template = _pattern(primary, tag)
        with _no_allocation_fill():
            self.buffer = torch.empty(self.band + span + self.band, dtype=torch.uint8)
        self.original = _bytes_at(self.base, span)

    def offset(self, address: int) -> int:
        """Where ``address`` lies in the guarded buffer."""
        return self.band + address - self.base

    def address(self, address: int) -> int:
        return self.buffer.data_ptr() + self.offset(address)

    def prepare(self) -> None:
        total = self.buffer.numel()
        if self.dense:
            _fill(self.buffer, 0, total, self.template)
            self.covered = torch.zeros(total, dtype=torch.bool)
            for region in self.regions:
                _byte_view(self.covered, self.offset(region.address), region).fill_(True)
        else:
            # the bands, and the ALIGN bytes on either side of them that the region starts or ends in
            _fill(self.buffer, 0, self.band + ALIGN, self.template)
            _fill(self.buffer, self.band + self.span - ALIGN, total, self.template)
        self.copies = []
        for region in self.regions:
            source = _typed(self.original, region.address - self.base, region, narrow=True)
            target = _typed(self.buffer, self.offset(region.address), region, narrow=True)
            target.copy_(source)
            if not self.dense:
                written = _byte_view(self.buffer, self.offset(region.address), region)
                self.copies.append((source, target, written, written.clone()))
        if self.dense:
            self.snapshot = self.buffer.clone()
        else:
            ends = (self.offset(self.low), self.offset(self.high))
            self.checked = [(0, ends[0]), (ends[1], total)]
            self.snapshot = [self.buffer[a:b].clone() for a, b in self.checked]

    def check_and_restore(self, kernel: str) -> None:
        if self.dense:
            changed = self.buffer != self.snapshot
            stray = changed & ~self.covered
            if bool(stray.any()):
                raise GuardBandViolation(f"{kernel} wrote {int(stray.sum())} byte(s) outside its arguments' "
                                         f"elements: {self._where(int(stray.nonzero()[0, 0]))}")
            # Only the bytes the kernel changed go back (inputs stay untouched).
            window = slice(self.band, self.band + self.span)
            written = changed[window]
            if bool(written.any()):
                self.original[written] = self.buffer[window][written]
            return
        for (a, b), before in zip(self.checked, self.snapshot):
            stray = self.buffer[a:b] != before
            if bool(stray.any()):
                raise GuardBandViolation(f"{kernel} wrote into a guard band: "
                                         f"{self._where(a + int(stray.nonzero()[0, 0]))}")
        for source, target, written, before in self.copies:
            if not torch.equal(written, before):
                source.copy_(target)

    def _where(self, position: int) -> str:
        """Which argument a stray byte lies next to, in that argument's elements."""
        described = []
        for region in self.regions:
            first = self.offset(region.address)
            last = first + region.extent()[1] - region.extent()[0]
            if position < first:
                where = f"{-(-(first - position) // region.itemsize)} element(s) before the start"
            elif position >= last:
                where = f"{(position - last) // region.itemsize + 1} element(s) past the end"
            else:
                where = "in a gap between its elements (stride)"
            described.append(f"{where} of {region.name} {tuple(region.shape)} strides {tuple(region.strides)}")
        return "; ".join(described)


def _groups(regions: list[Region]) -> list[_Group]:
    """Regions whose byte ranges overlap go into one buffer."""
    ordered = sorted((r for r in regions if r.numel() > 0), key=lambda r: r.extent()[0])
    merged: list[list[Region]] = []
    end = None
    for region in ordered:
        low, high = region.extent()
        if merged and low < end:
            merged[-1].append(region)
            end = max(end, high)
        else:
            merged.append([region])
            end = high
    return [_Group(members, tag) for tag, members in enumerate(merged, start=1)]


def _tensor_region(name: str, t: torch.Tensor) -> Region:
    if any(stride < 0 for stride in t.stride()):
        raise UnguardableLaunch(f"{name}: negative strides")
    return Region(name, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


# ---------------------------------------------------------------- address tables

# kernel (module.function) -> decoder(arguments by name) -> (regions, table
# names, rewrite); rewrite(address map) gives the tables with relocated
# addresses, by argument name.
Decoder = Callable[[dict], tuple[list[Region], tuple[str, ...], Callable[[Callable[[int], int]], dict]]]
ADDRESS_TABLES: dict[str, Decoder] = {}


def decoder(*kernels: str):
    def register(fn: Decoder) -> Decoder:
        for name in kernels:
            ADDRESS_TABLES[name] = fn
        return fn
    return register


def _rewritten(table: torch.Tensor, columns: tuple[int, ...]) -> Callable:
    def rewrite(relocate: Callable[[int], int]) -> torch.Tensor:
        copy = table.clone()
        for column in columns:
            copy[:, column] = torch.tensor([relocate(a) for a in table[:, column].tolist()], dtype=torch.int64)
        return copy
    return rewrite


@decoder("effilayers.ops.adam.triton._adam_kernel", "effilayers.ops.adam.triton._adam_8bit_kernel")
def _adam_parameter_table(args: dict):
    """Rows (parameter address, gradient address, numel, first state
    element); a one-parameter chunk (SINGLE) has no table."""
    if args["SINGLE"]:
        return [], (), lambda relocate: {}
    table = args["parameter_table"]
    regions = []
    for row, (param, grad, numel, _) in enumerate(table.tolist()):
        regions.append(Region(f"parameter_table[{row}] parameter", param, args["first_param"].dtype, (numel,), (1,)))
        regions.append(Region(f"parameter_table[{row}] gradient", grad, args["first_grad"].dtype, (numel,), (1,)))
    rewrite = _rewritten(table, (0, 1))
    return regions, ("parameter_table",), lambda relocate: {"parameter_table": rewrite(relocate)}


@decoder(*(f"effilayers.ops.densenet.triton.{k}" for k in ("_forward", "_grad_input", "_finish_grad_input",
                                                           "_grad_weight")))
def _densenet_map_table(args: dict):
    """Rows (address, channels, first channel, stride of n, of c, of h*w);
    the maps have ``weight``'s dtype (``dtype_ptr``'s where there is no weight)."""
    table = args["table"]
    dtype = (args["weight"] if "weight" in args else args["dtype_ptr"]).dtype
    pixels, hw = int(args["M"]), int(args["HW"])
    regions = [Region(f"table[{row}] map", address, dtype, (pixels // hw, channels, hw), (sn, sc, shw))
               for row, (address, channels, _, sn, sc, shw) in enumerate(table.tolist())]
    rewrite = _rewritten(table, (0,))
    return regions, ("table",), lambda relocate: {"table": rewrite(relocate)}


# ---------------------------------------------------------------- the launch wrapper

def _kernel_name(function) -> str:
    return f"{function.fn.__module__}.{function.fn.__name__}"


def _check_no_raw_addresses(kernel: str, args: dict, tables: tuple[str, ...]) -> None:
    for name, value in args.items():
        if (isinstance(value, torch.Tensor) and name not in tables and value.dtype == torch.int64
                and 0 < value.numel() <= 2**20 and int(value.abs().max()) >= ADDRESS_FLOOR):
            raise UnguardableLaunch(
                f"{kernel}: argument {name} holds what look like addresses; the guard cannot relocate memory it "
                f"does not know: describe the table in tests/guard_bands.py ADDRESS_TABLES")


def guarded_run(original: Callable, function, *args, grid, warmup, **kwargs):
    """``InterpretedFunction.run`` on relocated, guarded copies of the memory
    the launch may touch (module docstring)."""
    if warmup:
        return original(function, *args, grid=grid, warmup=warmup, **kwargs)
    # The guard's own tensor work is hidden from dispatch modes: tests that
    # record what a kernel allocates (helpers.NewStorages) see the kernel's.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        groups, new_args, new_kwargs, kernel, raw = _relocated(function, args, kwargs)
    result = original(function, *new_args, grid=grid, warmup=warmup, **new_kwargs)
    with _disable_current_modes():
        for group in groups:
            group.check_and_restore(kernel)
    GUARDED[kernel] += 1
    RAW_REGIONS[kernel] += len(raw)
    SPARSE[kernel] += sum(not g.dense for g in groups)
    return result


def _relocated(function, args, kwargs):
    """(groups, arguments, keyword arguments, kernel name, regions from address tables)."""
    kernel = _kernel_name(function)
    names = list(inspect.signature(function.fn).parameters)
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    decode = ADDRESS_TABLES.get(kernel)
    raw, tables, rewrite = decode(bound) if decode is not None else ([], (), lambda relocate: {})
    _check_no_raw_addresses(kernel, bound, tables)
    regions = list(raw)
    for name, value in bound.items():
        if isinstance(value, torch.Tensor) and name not in tables:
            if value.device.type != "cpu":
                raise UnguardableLaunch(f"{kernel}: {name} is on {value.device}; the guard runs on CPU tensors")
            regions.append(_tensor_region(name, value))
    groups = _groups(regions)
    for group in groups:
        group.prepare()

    empty = {region.address for region in raw if region.numel() == 0}

    def relocate(address: int) -> int:
        for group in groups:
            if group.low <= address < group.high:
                return group.address(address)
        if address in empty:
            return address  # nothing of it is read
        raise UnguardableLaunch(f"{kernel}: address {address:#x} is in no relocated region")

    replaced = {}
    for name, value in bound.items():
        if isinstance(value, torch.Tensor) and name not in tables and value.numel() > 0:
            group = next(g for g in groups if g.low <= value.data_ptr() < g.high)
            replaced[name] = _typed(group.buffer, group.offset(value.data_ptr()), _tensor_region(name, value))
    replaced.update(rewrite(relocate))
    new_args = [replaced.get(name, value) for name, value in zip(names, args)]
    new_kwargs = {k: replaced.get(k, v) for k, v in kwargs.items()}
    return groups, new_args, new_kwargs, kernel, raw


def install() -> Optional[Callable[[], None]]:
    """Wrap the interpreter's launch; returns the function that undoes it
    (None when the guard is already installed)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    if getattr(original, "_guard_bands", False):
        return None

    @functools.wraps(original)
    def run(self, *args, grid, warmup, **kwargs):
        return guarded_run(original, self, *args, grid=grid, warmup=warmup, **kwargs)

    run._guard_bands = True
    run._unguarded = original
    InterpretedFunction.run = run

    def uninstall() -> None:
        InterpretedFunction.run = original

    return uninstall


@contextlib.contextmanager
def unguarded():
    """The interpreter as it is, inside the block (to show what the guard catches)."""
    from triton.runtime.interpreter import InterpretedFunction

    current = InterpretedFunction.run
    InterpretedFunction.run = getattr(current, "_unguarded", current)
    try:
        yield
    finally:
        InterpretedFunction.run = current


def package_kernels() -> list[str]:
    """Every Triton kernel the package launches (``module.function``): the
    ``@triton.jit`` functions of ``effilayers/ops/*/triton.py`` that no
    other code calls as a function (those are device helpers)."""
    from triton.runtime.jit import KernelInterface

    import effilayers.ops

    kernels = []
    for info in pkgutil.iter_modules(effilayers.ops.__path__):
        if not info.ispkg:
            continue
        try:
            module = importlib.import_module(f"effilayers.ops.{info.name}.triton")
        except ModuleNotFoundError as error:
            if error.name == f"effilayers.ops.{info.name}.triton":
                continue
            raise
        source = inspect.getsource(module)
        for name, value in vars(module).items():
            if isinstance(value, KernelInterface) and value.fn.__module__ == module.__name__:
                if not re.search(rf"(?<!def )\b{name}\(", source):
                    kernels.append(f"{module.__name__}.{name}")
    return sorted(kernels)
