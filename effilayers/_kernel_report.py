"""``python -m effilayers.info --kernels [--json]``: every GPU kernel of the
package compiled for Hopper (sm_90) and Ampere (sm_80) on a machine without a
GPU, with what the compiler made of it.

* Triton: every specialisation the launchers can pick at the benchmark
  shapes (``kernel_specialisations()`` next to each launcher, in
  ``ops/<family>/triton.py``), compiled by ``triton.compile`` for a named GPU
  target (the whole pipeline down to ptxas runs without a device).
* CUDA: every ``__global__`` kernel of ``csrc/cuda/*.cu`` (each template
  instantiation the dispatch code launches), compiled with ``nvcc -cubin``
  and ``nvcc -ptx``.

One row per kernel x target x dtype/configuration: registers, spill stores
and loads (bytes), shared memory, the widths of the global loads and stores
in the PTX, and the bytes the kernel moves per element against the family's
roofline (what a perfect kernel must move). The exit status is non-zero on a
compile failure, on any spill, on a kernel at the 255-register cap, on a
row of a memory-bound family (every family whose ``triton.py`` does not
declare ``COMPUTE_BOUND = True``; every CUDA kernel) that moves more bytes per
element than its roofline without a reason in its spec (``reread``; one
marked "pending:" fails too), and on a per-thread global access narrower
than 128 bits in a kernel whose layout allows 128-bit accesses (a row that
may be narrower says why; a reason marked "pending:", one that concedes the
layout would allow 128 bits, fails the row too).

A global access is per-thread when its address depends on the thread index
(a data flow through the PTX from ``%tid``): the loads of a row's target or
of a table entry, the same address for every thread, may be narrow. The flow
does not follow values through memory: a value loaded back from shared
memory depends on that load's address instead (the thread index, mostly), so
the reading errs towards calling an access per-thread, and towards naming
fewer arguments for it, which can fail a row but not pass a narrow one.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Union

from ._core.families import OPS, family_names
from ._core.kernel_spec import KernelSpec, specialise

TARGETS = (90, 80)
# The families with Triton kernels, found on disk: each one's triton.py
# declares kernel_specialisations(), which must cover its launched kernels.
TRITON_FAMILIES = tuple(family for family in family_names() if (OPS / family / "triton.py").is_file())
WIDE = 128
REGISTER_CAP = 255  # per thread on sm_80 and sm_90: one more live value and ptxas spills


# -- PTX: global accesses and their widths -------------------------------------------------

class Access(NamedTuple):
    opcode: str  # "ld.global.v4.b32", ...
    op: str  # "ld", "st" or "red" (an atomic add or reduction)
    bits: int
    per_thread: bool  # the address depends on the thread index
    params: frozenset  # kernel parameters the address derives from


_REGISTER = re.compile(r"%[A-Za-z_][\w]*(?:\.[xyz])?")
_PARAM = re.compile(r"_param_(\d+)")
_WIDTH = re.compile(r"\.(?:b|u|s|f)(\d+)\b")
_VECTOR = re.compile(r"\.v(\d)\b")
_THREAD = ("%tid", "%laneid", "%warpid")
_NO_DESTINATION = ("st.", "bra", "bar.", "ret", "exit", "red.", "cp.async", "fence", "membar", "trap", "prefetch")


def _operands(text: str) -> list[str]:
    """Top-level comma-separated operands ({...} and [...] kept whole)."""
    parts, depth, current = [], 0, []
    for char in text:
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if current and "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _instructions(body: str) -> list[tuple[str, list[str]]]:
    result = []
    body = re.sub(r"//[^\n]*", "", body)
    header = re.search(r"\.entry[^{]*\{", body)  # the parameter list, up to the function's brace
    body = body[header.end():] if header else body
    body = re.sub(r"^\s*[\w$]+:", "", body, flags=re.MULTILINE)  # labels
    body = re.sub(r"^\s*\.(?:loc|file|section|pragma)\b[^\n]*", "", body, flags=re.MULTILINE)  # no ';' after these
    for statement in body.split(";"):
        statement = statement.strip().lstrip("{}").strip()
        if not statement or statement.startswith("."):
            continue
        if statement.startswith("@"):
            statement = statement.split(None, 1)[1] if " " in statement else ""
        pieces = statement.split(None, 1)
        if not pieces:
            continue
        result.append((pieces[0], _operands(pieces[1]) if len(pieces) > 1 else []))
    return result


def global_accesses(body: str) -> list[Access]:
    """The global loads and stores of one PTX function (cp.async copies from
    global memory count as loads), each with whether its address depends on
    the thread index and which ``_param_<i>`` it derives from."""
    instructions = _instructions(body)
    taint: dict[str, frozenset] = {}

    def sources(operands: list[str]) -> frozenset:
        found: set = set()
        for operand in operands:
            for index in _PARAM.findall(operand):
                found.add(int(index))
            for register in _REGISTER.findall(operand):
                if register.startswith(_THREAD):
                    found.add("tid")
                found |= taint.get(register, frozenset())
        return frozenset(found)

    changed = True
    while changed:  # to a fixed point: loops carry values backwards
        changed = False
        for opcode, operands in instructions:
            if not operands or opcode.startswith(_NO_DESTINATION):
                continue
            value = sources(operands[1:])
            for register in _REGISTER.findall(operands[0]):
                if not value <= taint.get(register, frozenset()):
                    taint[register] = taint.get(register, frozenset()) | value
                    changed = True

    accesses = []
    for opcode, operands in instructions:
        if opcode.startswith("cp.async") and ".global" in opcode and not opcode.startswith("cp.async.bulk"):
            address, size = operands[1], operands[2]
            accesses.append(Access(opcode, "ld", 8 * int(size, 0), *_address_facts(sources([address]))))
        elif opcode.startswith(("ld.global", "st.global", "red.global", "atom.global")):
            address = next(operand for operand in operands if operand.startswith("["))
            bits = int(_WIDTH.search(opcode).group(1)) * int((_VECTOR.search(opcode) or [None, 1])[1])
            op = opcode[:2] if opcode[:2] in ("ld", "st") else "red"
            accesses.append(Access(opcode, op, bits, *_address_facts(sources([address]))))
    return accesses


def _address_facts(found: frozenset) -> tuple[bool, frozenset]:
    return "tid" in found, frozenset(item for item in found if item != "tid")


def _widths(accesses: list[Access], op: str) -> dict[int, int]:
    return dict(sorted(Counter(a.bits for a in accesses if a.op == op).items(), reverse=True))


def _narrow(accesses: list[Access], exempt: set) -> list[Access]:
    # Loads and stores: an atomic reduction's width is the hardware's (a v4 f32 red at most), not the layout's.
    return [a for a in accesses if a.op in ("ld", "st") and a.per_thread and a.bits < WIDE
            and not (a.params & exempt)]


# -- Triton ---------------------------------------------------------------------------------

def _tool(name: str) -> str:
    """A CUDA tool bundled with Triton (the one its compiler uses)."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else (shutil.which(name) or name)


def compile_triton(spec: KernelSpec, capability: int) -> dict[str, Any]:
    """``spec`` through ``triton.compile`` for ``sm_<capability>``: the PTX, the
    cubin and Triton's shared memory. The one place that knows Triton's
    compile API (the same in Triton 3.6 and 3.9: ASTSource with a signature
    of type strings, constexprs by name, divisibility attributes by argument
    index; ``metadata.shared``, ``asm["ptx"]``, ``asm["cubin"]``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, divisible = specialise(spec)
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(spec.kernel, signature, constexprs=constexprs, attrs=attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton 3.9's notice about its fp-fusion default
        options = dict(num_warps=spec.num_warps)
        if spec.num_stages is not None:
            options["num_stages"] = spec.num_stages
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    parameters = [name for name in names if signature[name] != "constexpr"]
    return {"ptx": compiled.asm["ptx"], "cubin": compiled.asm["cubin"], "shared": int(compiled.metadata.shared),
            "parameters": parameters, "pointers": {name for name in parameters if signature[name].startswith("*")}}


def _cubin_resources(cubin: bytes, ptx: str, capability: int) -> dict[str, int]:
    """Registers, static shared and local memory from the cubin (cuobjdump);
    when it uses local memory, the spill bytes from ptxas -v on the same PTX
    (with Triton's own ptxas; a log without them counts all local memory as
    spilled)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "kernel.cubin"
        path.write_bytes(cubin)
        dump = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True,
                              text=True, check=True).stdout
        found = re.search(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", dump)
        registers, static_shared, local = (int(v) for v in found.groups())
        spill_stores = spill_loads = 0
        if local:
            (Path(scratch) / "kernel.ptx").write_text(ptx)
            arch = f"sm_{capability}a" if capability == 90 else f"sm_{capability}"
            log = subprocess.run([_tool("ptxas"), "-v", f"--gpu-name={arch}",
                                  str(Path(scratch) / "kernel.ptx"), "-o", str(Path(scratch) / "out.cubin")],
                                 capture_output=True, text=True).stderr
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            spill_stores, spill_loads = (int(v) for v in spills.groups()) if spills else (local, local)
    return {"registers": registers, "static_shared": static_shared, "local": local, "spill_stores": spill_stores,
            "spill_loads": spill_loads}


@functools.lru_cache(maxsize=None)  # a worker process compiles many rows of one family
def _family_specs(family: str) -> list[KernelSpec]:
    module = importlib.import_module(f"effilayers.ops.{family}.triton")
    return list(module.kernel_specialisations())


def triton_row(family: str, index: int, capability: int) -> dict[str, Any]:
    """The report row of the ``index``-th spec of ``family`` (by index, so a
    worker process can rebuild the spec it is given)."""
    return spec_row(family, _family_specs(family)[index], capability)


def spec_row(family: str, spec: KernelSpec, capability: int) -> dict[str, Any]:
    """The report row of one spec compiled for ``sm_<capability>``."""
    row = {"kind": "triton", "family": family, "kernel": spec.name, "target": f"sm_{capability}",
           "config": spec.config, "num_warps": spec.num_warps, "bytes_per_element": spec.bytes_per_element,
           "roofline_bytes": spec.roofline_bytes, "narrow_reason": "; ".join(f"{k}: {v}" if k != "*" else v
                                                                            for k, v in spec.narrow.items()),
           "reread_reason": spec.reread}
    try:
        compiled = compile_triton(spec, capability)
    except Exception as error:  # noqa: BLE001 - a failed compile is a row, not a crash
        row["error"] = f"{type(error).__name__}: {str(error).strip()[-2000:]}"
        return row
    resources = _cubin_resources(compiled["cubin"], compiled["ptx"], capability)
    row.update(resources, shared=compiled["shared"] + resources.pop("static_shared"))
    accesses = global_accesses(compiled["ptx"])
    parameters = compiled["parameters"]
    row["loads"], row["stores"] = _widths(accesses, "ld"), _widths(accesses, "st")
    row["atomics"] = _widths(accesses, "red")  # atomic adds into global memory (red.global)
    narrow = [] if "*" in spec.narrow else \
        _narrow(accesses, {parameters.index(name) for name in spec.narrow if name in parameters})
    # named by the pointer arguments their addresses derive from
    row["narrow_per_thread"] = [
        f"{a.op}{a.bits}:" + ",".join(parameters[p] for p in sorted(a.params)
                                      if p < len(parameters) and parameters[p] in compiled["pointers"])
        for a in narrow]
    return row


# -- which Triton kernels the package launches ------------------------------------------------

def _jit_type():
    """The classes ``@triton.jit`` makes: JITFunction, or the interpreter's
    stand-in under TRITON_INTERPRET=1 (so the walk works in either mode)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return (JITFunction, InterpretedFunction)


def package_jit_functions() -> dict[str, Any]:
    """Every ``@triton.jit`` function defined in the package, by
    ``module:name``."""
    import effilayers

    found = {}
    for info in pkgutil.walk_packages(effilayers.__path__, "effilayers."):
        if info.name.endswith("__main__"):  # importing one runs it
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, _jit_type()) and value.fn.__module__ == module.__name__:
                found[f"{module.__name__}:{name}"] = value
    return found


def launched_kernels() -> dict[str, Any]:
    """The jit functions no other jit function calls: the kernels launchers
    launch (the others are helpers they inline)."""
    functions = package_jit_functions()
    called = set()
    for key, function in functions.items():
        module = sys.modules[function.fn.__module__]
        tree = ast.parse(textwrap.dedent(inspect.getsource(function.fn)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                target = getattr(module, node.func.id, None)
                if isinstance(target, _jit_type()):
                    called.add(f"{target.fn.__module__}:{target.fn.__name__}")
    return {key: f for key, f in functions.items() if key not in called}


# -- CUDA -------------------------------------------------------------------------------------

def cuda_home() -> Optional[Path]:
    """CUDA_HOME, else the toolkit of the nvcc on PATH (as .ci/run finds it)."""
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    home = Path(os.path.realpath(nvcc)).parent.parent
    if not (home / "include" / "cuda_runtime.h").exists():
        candidates = sorted(Path("/usr/local").glob("cuda*/include/cuda_runtime.h"))
        home = candidates[0].parent.parent if candidates else home
    return home


# Bytes per element of the CUDA kernels, in elements of the tensor dtype
# (kernel's own traffic, roofline): ABN's forward reads x and writes y; the
# element backward reads dy and the saved tensor, writes dx; the reductions
# read two tensors (abn) or one (stats) and write per-channel partials.
CUDA_MODELS = {
    "forward_kernel": (2, 2), "elemt_kernel": (3, 3),
    "reduce_partial_channels_first": (2, 2),
    "reduce_partial_channels_last": (2, 2), "partial_channels_first": (1, 1), "partial_channels_last": (1, 1),
    "fold_channels": (0, 0), "reduce_merge": (0, 0), "merge_chunks": (0, 0),
}
# Why a CUDA kernel's per-thread accesses are not 128 bits wide.
CUDA_NARROW = {
    "fold_channels": "per-channel constants, C values (not bandwidth-bound)",
    "reduce_merge": "per-channel partials, chunks x C values (not bandwidth-bound)",
    "merge_chunks": "per-channel partials, chunks x C values (not bandwidth-bound)",
    "partial_channels_last": "one channel per thread: a warp reads 32 adjacent channels of a row (coalesced, "
                             "one element each)",
    "reduce_partial_channels_last": "one channel per thread: a warp reads 32 adjacent channels of a row "
                                    "(coalesced, one element each)",
}
# Kernels templated on their vector width (the first template argument):
# 16 bytes per access, or 1 element in the scalar fallback, whose rows carry
# this reason; the vector rows must be 128 bits wide.
CUDA_SCALAR_FALLBACK = {
    "forward_kernel": "scalar fallback of the element loops (width 1), for tensors not 16-byte aligned or S "
                      "(C in channels_last) not a multiple of 16 bytes",
    "elemt_kernel": "scalar fallback of the element loops (width 1), for tensors not 16-byte aligned or S "
                    "(C in channels_last) not a multiple of 16 bytes",
    "partial_channels_first": "scalar fallback of the plane chunks (width 1), for tensors not 16-byte aligned or S "
                              "not a multiple of 16 bytes",
    "reduce_partial_channels_first": "scalar fallback of the plane chunks (width 1), for tensors not 16-byte "
                                     "aligned or S not a multiple of 16 bytes",
}
# Parameters of a CUDA kernel whose per-thread loads may be narrow: the
# vector element loops read per-channel constants (ChannelPtrs, the means of
# the backward) one value per element, from C-sized cached arrays.
CUDA_CHANNEL_PARAMS = {"forward_kernel": {4}, "elemt_kernel": {6, 7, 8}}
_SCALAR_BYTES = {"__half": 2, "__nv_bfloat16": 2, "float": 4, "double": 8}
# csrc/common/activation.h's enum order (kActivationNames)
_ACTIVATIONS = ("identity", "leaky_relu", "elu", "relu", "silu", "gelu", "gelu_tanh", "hardswish", "mish", "relu6",
                "sigmoid", "tanh")


def _demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {name: name for name in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {name: name for name in names}


def _ptx_functions(ptx: str) -> dict[str, str]:
    pieces = re.split(r"(?:\.visible\s+|\.weak\s+)?\.entry\s+", ptx)
    return {re.match(r"[\w$]+", piece).group(0): ".entry " + piece for piece in pieces[1:]}


def _compile_cuda(flags: list[str], csrc: Path, source: Path) -> Union[tuple[str, str], str]:
    """(ptxas -v log, PTX) of one .cu file, or the compiler's error. Kept in
    the build cache under a hash of the command, the toolkit and every
    CUDA source and header: CI runs the report three times (two test
    environments and the GPU-code step) on the same sources, and nvcc of
    the ABN kernels takes minutes."""
    from ._core import build

    digest = hashlib.sha256("\0".join(flags[:-1]).encode())
    nvcc = Path(flags[0])
    digest.update(f"{nvcc.resolve()} {nvcc.stat().st_mtime_ns}".encode())
    for path in sorted([*csrc.glob("cuda/*"), *csrc.glob("common/*")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    cached = build.cache_root() / "kernel-report" / f"{source.stem}-{flags[1].split('=')[1]}-{digest.hexdigest()[:16]}"
    if (cached / "ptx").is_file() and (cached / "ptxas.log").is_file():
        return (cached / "ptxas.log").read_text(), (cached / "ptx").read_text()
    with tempfile.TemporaryDirectory() as scratch:
        # One compile gives both: --keep leaves the PTX that ptxas assembled
        # (a second nvcc run for -ptx would repeat the front end).
        cubin = subprocess.run([*flags, "-cubin", "-Xptxas", "-v", "--keep", "--keep-dir", scratch,
                                "-o", f"{scratch}/k.cubin"], capture_output=True, text=True)
        kept = sorted(Path(scratch).glob("*.ptx"))
        if cubin.returncode or len(kept) != 1:
            return cubin.stderr[-2000:] or f"nvcc left {len(kept)} PTX files, expected one"
        ptx_text = kept[0].read_text()
    try:
        # Written whole under a temporary name, then renamed: a concurrent
        # report never reads half a file.
        cached.mkdir(parents=True, exist_ok=True)
        for name, text in (("ptxas.log", cubin.stderr), ("ptx", ptx_text)):
            partial = cached / f"{name}.{os.getpid()}"
            partial.write_text(text)
            partial.replace(cached / name)
    except OSError:  # an unwritable cache costs the next run a compile, nothing else
        pass
    return cubin.stderr, ptx_text


def cuda_rows(capability: int) -> list[dict[str, Any]]:
    from ._core import build

    home = cuda_home()
    nvcc = (home / "bin" / "nvcc") if home is not None else None
    if nvcc is None or not nvcc.exists():
        return [{"kind": "cuda", "family": "csrc/cuda", "kernel": "*", "target": f"sm_{capability}", "config": "",
                 "error": "nvcc not found: set CUDA_HOME or put nvcc on PATH"}]
    csrc = build.csrc_dir()
    rows = []
    for source in sorted((csrc / "cuda").glob("*.cu")):
        flags = [str(nvcc), f"-arch=sm_{capability}", "-std=c++17", f"-I{csrc}", *build.cuda_cflags(), str(source)]
        compiled = _compile_cuda(flags, csrc, source)
        if isinstance(compiled, str):
            rows.append({"kind": "cuda", "family": source.name, "kernel": "*", "target": f"sm_{capability}",
                         "config": "", "error": compiled})
            continue
        ptxas_log, ptx_text = compiled
        functions = _ptx_functions(ptx_text)
        usage = _ptxas_usage(ptxas_log)
        readable = _demangle(list(usage))
        for mangled, resources in usage.items():
            full = readable[mangled]
            base = re.search(r"(\w+)<", full) or re.search(r"(\w+)\(", full)
            kernel = base.group(1) if base else full
            template = re.search(r"<(.*)>\(", full)
            config = template.group(1) if template else ""
            scalar = next((t for t in re.split(r",\s*", config) if t in _SCALAR_BYTES), None)
            # the reductions are templated <acc_t> only; their traffic is per-channel
            size = _SCALAR_BYTES.get(scalar or "", 0)
            moved, roofline = CUDA_MODELS.get(kernel, (0, 0))
            accesses = global_accesses(functions.get(mangled, ""))
            reason = CUDA_NARROW.get(kernel, "")
            if kernel in CUDA_SCALAR_FALLBACK and config.split(",")[0].strip() == "1":
                reason = CUDA_SCALAR_FALLBACK[kernel]
            config = re.sub(r"\(effilayers::Activation\)(\d)", lambda m: _ACTIVATIONS[int(m.group(1))], config)
            row = {"kind": "cuda", "family": source.name, "kernel": kernel, "target": f"sm_{capability}",
                   "config": config.replace("true", "from output").replace("false", "from input"),
                   "num_warps": None, "bytes_per_element": moved * size, "roofline_bytes": roofline * size,
                   "narrow_reason": reason, **resources,
                   "loads": _widths(accesses, "ld"), "stores": _widths(accesses, "st")}
            exempt = CUDA_CHANNEL_PARAMS.get(kernel, set())
            row["narrow_per_thread"] = [] if reason else [f"{a.op}{a.bits}" for a in _narrow(accesses, exempt)]
            rows.append(row)
    return rows


def _ptxas_usage(log: str) -> dict[str, dict[str, int]]:
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            current = entry.group(1)
            usage[current] = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "shared": 0, "local": 0}
            continue
        if current is None:
            continue
        spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spills:
            usage[current]["local"], usage[current]["spill_stores"], usage[current]["spill_loads"] = (
                int(v) for v in spills.groups())
        used = re.search(r"Used (\d+) registers", line)
        if used:
            usage[current]["registers"] = int(used.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            usage[current]["shared"] = int(smem.group(1)) if smem else 0
    return usage


# -- the report --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def compute_bound(family: str) -> bool:
    """Whether ``family`` declares its Triton kernels bound by arithmetic
    (``COMPUTE_BOUND = True`` in its ``triton.py``: linear_cross_entropy's
    GEMMs), so that their bytes are reported, not held to the roofline.
    Every other family is memory-bound, a new one included."""
    if not (OPS / family / "triton.py").is_file():
        return False
    return bool(getattr(importlib.import_module(f"effilayers.ops.{family}.triton"), "COMPUTE_BOUND", False))


def memory_bound(row: dict[str, Any]) -> bool:
    """Whether the row's kernel is held to its roofline in bytes: a row
    that moves more bytes per element fails unless its spec says why
    (``KernelSpec.reread``). A CUDA row's family is its source file
    (``stats.cu``); every CUDA kernel is memory-bound."""
    family = row.get("family", "")
    return family.endswith(".cu") or not compute_bound(family)


def above_roofline(row: dict[str, Any]) -> bool:
    return memory_bound(row) and row.get("bytes_per_element", 0) > row.get("roofline_bytes", 0)


def problems(row: dict[str, Any]) -> list[str]:
    """Why a row fails the report (empty: it passes)."""
    if "error" in row:
        return ["compile failed"]
    found = []
    if row["spill_stores"] or row["spill_loads"]:
        found.append(f"spills {row['spill_stores']}/{row['spill_loads']} bytes")
    if row.get("registers", 0) >= REGISTER_CAP:
        found.append(f"at the {REGISTER_CAP}-register cap")
    reread = row.get("reread_reason", "")
    if above_roofline(row) and (not reread or "pending:" in reread):
        found.append(f"moves {row['bytes_per_element']:g} bytes per element, above its roofline of "
                     f"{row['roofline_bytes']:g}" + (f" ({reread})" if reread else ""))
    pending = [reason for reason in row.get("narrow_reason", "").split("; ") if "pending:" in reason]
    if pending:  # a reason that admits the layout allows 128 bits does not excuse the row
        found.append("narrower than the layout allows (" + "; ".join(pending) + ")")
    if row["narrow_per_thread"]:
        found.append(f"{len(row['narrow_per_thread'])} per-thread accesses under 128 bits where the layout "
                     f"allows 128 ({', '.join(sorted(set(row['narrow_per_thread'])))})")
    return found


def _settings(spec: KernelSpec) -> tuple[tuple, frozenset]:
    """(pointer dtypes, settings) of one spec as the compiler sees it: the
    Triton types of its pointer arguments, and every other thing a compile
    is specialised on (constexpr values, scalar argument types, the
    arguments marked divisible by 16, num_warps, num_stages)."""
    signature, constexprs, divisible = specialise(spec)
    dtypes = tuple(sorted({kind for kind in signature.values() if kind.startswith("*")}))
    settings = {("constexpr", name, repr(value)) for name, value in constexprs.items()}
    settings |= {("argument", name, kind) for name, kind in signature.items()
                 if kind != "constexpr" and not kind.startswith("*")}
    settings |= {("divisible", name) for name in divisible}
    settings |= {("num_warps", spec.num_warps), ("num_stages", spec.num_stages)}
    return dtypes, frozenset(settings)


def pairwise(specs: list[KernelSpec]) -> list[int]:
    """Indices of a subset of ``specs`` in which, per kernel, every setting
    (``_settings``) appears with every pointer-dtype combination it appears
    with in the whole list: the rows that bring the most missing pairs,
    first index on a tie, until none is missing. What it leaves out is the
    interaction of two settings besides the dtype (a tile size with a
    layout flag, say), which the full sweep compiles."""
    by_kernel: dict[str, list[tuple[int, frozenset]]] = {}
    for index, spec in enumerate(specs):
        dtypes, settings = _settings(spec)
        pairs = frozenset((dtypes, setting) for setting in settings) | {(dtypes, None)}
        by_kernel.setdefault(spec.name, []).append((index, pairs))
    chosen = []
    for rows in by_kernel.values():
        missing = set().union(*(pairs for _, pairs in rows))
        while missing:
            index, pairs = max(rows, key=lambda row: (len(row[1] & missing), -row[0]))
            missing -= pairs
            chosen.append(index)
    return sorted(chosen)


def collect(jobs: int = 0, families: Optional[tuple[str, ...]] = None, cuda: bool = True,
            targets: tuple[int, ...] = TARGETS, pairwise_only: bool = False) -> list[dict[str, Any]]:
    """Every row of the report, for ``targets`` (compute capabilities);
    with ``pairwise_only``, of the Triton specs only those ``pairwise``
    picks per family and target. ``jobs`` processes compile in parallel
    (0: the CPU count, at most 8)."""
    unknown = set(targets) - set(TARGETS)
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty selection of {TARGETS}, got {targets}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the kernel report compiles real GPU code: run it without TRITON_INTERPRET=1")
    work = []
    for family in families or TRITON_FAMILIES:
        for capability in targets:
            indices = [index for index, spec in enumerate(_family_specs(family))
                       if spec.targets is None or capability in spec.targets]
            if pairwise_only:
                indices = [indices[i] for i in pairwise([_family_specs(family)[index] for index in indices])]
            work.extend((family, index, capability) for index in indices)
    workers = jobs or min(8, os.cpu_count() or 1)
    cuda_targets = targets if cuda else ()
    if workers > 1:
        import multiprocessing

        # spawned, not forked: the parent may hold Triton or CUDA state
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            cuda_parts = [pool.submit(cuda_rows, capability) for capability in cuda_targets]
            rows = list(pool.map(triton_row, *zip(*work))) if work else []
            for part in cuda_parts:
                rows.extend(part.result())
    else:
        rows = [triton_row(*job) for job in work]
        for capability in cuda_targets:
            rows.extend(cuda_rows(capability))
    for row in rows:
        row["problems"] = problems(row)
    return rows


def _width_text(widths: dict) -> str:
    return " ".join(f"{bits}x{count}" for bits, count in widths.items()) or "-"


def format_report(rows: list[dict[str, Any]]) -> str:
    header = ("kernel", "target", "config", "regs", "spill st/ld", "smem", "loads (bits x n)", "stores",
              "B/elem (roofline)", "status")
    table, reasons, rereads = [header], {}, {}
    for row in rows:
        name = f"{row['family']}:{row['kernel']}"
        if "error" in row:
            table.append((name, row["target"], row["config"], "-", "-", "-", "-", "-", "-",
                          "COMPILE FAILED: " + (row["error"].strip().splitlines() or [""])[-1][:200]))
            continue
        status = "; ".join(row["problems"]) if row["problems"] else "ok"
        if not row["problems"] and row.get("narrow_reason"):
            note = reasons.setdefault(row["narrow_reason"], len(reasons) + 1)
            status = f"ok, narrow [{note}]"
        if not row["problems"] and above_roofline(row):
            note = rereads.setdefault(row["reread_reason"], len(rereads) + 1)
            status += f", above roofline <{note}>"
        table.append((name, row["target"], row["config"], str(row["registers"]),
                      f"{row['spill_stores']}/{row['spill_loads']}", str(row["shared"]), _width_text(row["loads"]),
                      _width_text(row["stores"]), f"{row['bytes_per_element']:g} ({row['roofline_bytes']:g})",
                      status))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1] for r in table]
    lines.append("")
    lines.append("per-thread accesses under 128 bits, allowed because:")
    lines.extend(f"  [{number}] {reason}" for reason, number in reasons.items())
    if rereads:
        lines.append("")
        lines.append("memory-bound rows above their roofline in bytes, because:")
        lines.extend(f"  <{number}> {reason}" for reason, number in rereads.items())
    lines.append("")
    lines.append(summary(rows))
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    compiled = [r for r in rows if "error" not in r]
    kernels = {(r["family"], r["kernel"]) for r in rows}
    failing = [r for r in rows if r["problems"]]
    most = max(compiled, key=lambda r: r["registers"], default=None)
    most_where = f" ({most['family']}:{most['kernel']} {most['target']} {most['config']})" if most else ""
    pending = sum(1 for r in compiled if "pending:" in r.get("narrow_reason", ""))
    above = [r for r in compiled if above_roofline(r)]
    excused = sum(1 for r in above if r.get("reread_reason") and "pending:" not in r["reread_reason"])
    return (f"{len(rows)} rows, {len(kernels)} kernels, {len(rows) - len(compiled)} compile failures, "
            f"{pending} rows narrower than the layout allows (pending), "
            f"{len(above)} memory-bound rows above their roofline in bytes ({excused} with a reason), "
            f"{sum(1 for r in compiled if r['spill_stores'] or r['spill_loads'])} with spills, "
            f"{sum(1 for r in compiled if r['registers'] >= REGISTER_CAP)} at the {REGISTER_CAP}-register cap, "
            f"max registers {most['registers'] if most else '-'}"
            f"{most_where}; "
            f"{len(failing)} rows failing")


def main(json_output: bool = False, jobs: int = 0, targets: tuple[int, ...] = TARGETS,
         pairwise_only: bool = False) -> int:
    """Prints the report; 1 when a row fails it, 2 when it cannot run here."""
    try:
        rows = collect(jobs=jobs, targets=targets, pairwise_only=pairwise_only)
    except RuntimeError as error:
        print(f"python -m effilayers.info --kernels: {error}", file=sys.stderr)
        return 2
    if json_output:
        print(json.dumps({"rows": rows, "summary": summary(rows)}, indent=1))
    else:
        print(format_report(rows))
    return 1 if any(row["problems"] for row in rows) else 0


def iter_specs() -> Iterator[tuple[str, KernelSpec]]:
    for family in TRITON_FAMILIES:
        for spec in _family_specs(family):
            yield family, spec
