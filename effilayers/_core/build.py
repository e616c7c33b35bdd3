"""Build and load the compiled kernels in ``csrc/``.

Two shared libraries, one per device, so each can be present or absent on its
own: ``effilayers_cpu`` (csrc/cpu, always attempted) and ``effilayers_cuda``
(csrc/cuda, only where torch itself was built with CUDA). Neither has a Python
binding: they register their kernels with ``TORCH_LIBRARY`` under the
``effilayers_cpu`` / ``effilayers_cuda`` namespaces and are loaded with
``torch.ops.load_library``. A third, ``effilayers_emulated`` (kind
``"emulated"``, tests only), is the CUDA library built for the CPU over the
SIMT emulator in csrc/emulation (ARCHITECTURE.md).

Where a library comes from, in order:
1. a copy built ahead of time by ``EFFILAYERS_BUILD_EXT=1 pip install
   --no-build-isolation .`` (sits next to this file);
2. the first-use build with ``torch.utils.cpp_extension.load`` and ninja,
   cached under ``$EFFILAYERS_CACHE_DIR`` (default ``~/.cache/effilayers``) in
   a directory named by a hash of the sources, flags and torch version, so a
   changed source rebuilds and an unchanged one loads in milliseconds.

Concurrent builds (pytest-xdist, several ranks of one job) serialise on an
``fcntl`` lock in the cache directory; the kernel drops the lock if the
holder dies, so a killed build never leaves the next one waiting forever.

setup.py imports this file by path, so it must not import the package or
torch at module level.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sys
from pathlib import Path

# The package directory (this file sits in effilayers/_core/).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
KINDS = ("cpu", "cuda")
# Built only for tests, never loaded by the registry: the CUDA kernels of
# csrc/cuda compiled as C++ over the SIMT emulator (csrc/emulation), with
# their bindings, as ops of ``effilayers_emulated`` on CPU tensors.
TEST_KINDS = ("emulated",)


class ExtensionUnavailable(RuntimeError):
    """The compiled library for a device could not be built or loaded."""


def csrc_dir() -> Path:
    """The C++/CUDA sources: the repository's csrc/ in a source checkout or
    editable install, else the copy shipped inside the wheel."""
    for candidate in (PACKAGE_DIR.parent / "csrc", PACKAGE_DIR / "csrc"):
        if (candidate / "common").is_dir():
            return candidate
    raise ExtensionUnavailable(
        f"no csrc/ directory next to {PACKAGE_DIR}; reinstall effilayers from a source tree or wheel"
    )


def library_name(kind: str) -> str:
    return f"effilayers_{kind}"


def sources(kind: str, root: Path | None = None) -> list[str]:
    root = csrc_dir() if root is None else root
    if kind == "cpu":
        patterns = ["cpu/*.cpp"]
    elif kind == "cuda":
        # The .cu files hold kernels and need only CUDA headers; the .cpp
        # files next to them bind those kernels to torch.
        patterns = ["cuda/*.cu", "cuda/*.cpp"]
    elif kind == "emulated":
        # emulation/*_kernels.cpp include the .cu files themselves (a .cu
        # source would go to nvcc); the bindings are the CUDA library's own.
        patterns = ["emulation/*.cpp", "cuda/*.cpp"]
    else:
        raise ValueError(f"kind must be one of {KINDS + TEST_KINDS}, got {kind!r}")
    files: list[str] = []
    for pattern in patterns:
        files.extend(sorted(glob.glob(str(root / pattern))))
    return files


def _cpu_isa_flags() -> list[str]:
    import torch

    # Match the vector ISA torch itself dispatches to on this machine. A
    # library built here is for this machine (it is cached per machine, and
    # the ahead-of-time build is documented as such).
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return ["-mavx2", "-mfma", "-mf16c"]
    return []


OPT_LEVEL_VAR = "EFFILAYERS_OPT_LEVEL"


def _host_optimisation() -> str:
    """The C++ compiler's -O level for the libraries' host code: 3 (their
    kernels' speed depends on it: -O2 made some bf16 kernels 2-3x slower),
    or what ``EFFILAYERS_OPT_LEVEL`` says, for a build whose speed does
    not matter (CI's torch 2.11 environment, which checks API compatibility:
    abn.cpp compiles about 2.5x faster at -O1)."""
    level = os.environ.get(OPT_LEVEL_VAR, "3").strip()
    if level not in ("0", "1", "2", "3"):
        raise ValueError(f"{OPT_LEVEL_VAR} must be 0, 1, 2 or 3 (the C++ compiler's -O level), got {level!r}")
    return f"-O{level}"


def cflags(kind: str) -> list[str]:
    if kind == "emulated":
        # -O1: the emulated kernels run small test shapes, and the many
        # instantiations of abn.cu compile much faster than at -O3.
        return ["-O1", "-DNDEBUG", "-DEFFILAYERS_SIMT_EMULATION"]
    flags = [_host_optimisation(), "-fopenmp", "-DNDEBUG"]
    if kind == "cpu":
        flags += _cpu_isa_flags()
    return flags


def include_paths(kind: str) -> list[str]:
    paths = [str(csrc_dir())]
    if kind == "emulated":
        # Its cuda_runtime.h, cuda_fp16.h and cuda_bf16.h stand in for the toolkit's.
        paths.append(str(csrc_dir() / "emulation" / "include"))
    return paths


def ldflags(kind: str) -> list[str]:
    # torch ships libgomp.so.1; linking -fopenmp makes our parallel loops run
    # on that same OpenMP runtime (same soname), so torch.set_num_threads
    # governs them too.
    return ["-fopenmp"] if kind == "cpu" else []


def cuda_cflags() -> list[str]:
    # No --use_fast_math: the statistics kernels rely on IEEE division and
    # denormals; a kernel that wants fast intrinsics spells them out.
    return ["-O3", "-lineinfo"]


def _fingerprint(kind: str, files: list[str], python_version: bool = True) -> str:
    """The build's identity: sources, headers, flags and torch's version,
    and by default Python's (the cache key). The libraries have no Python
    binding, so a copy shipped to a machine with another Python
    (``export_library``) is checked without it."""
    import torch

    digest = hashlib.sha256()
    pinned = (torch.__version__, sys.version) if python_version else (torch.__version__,)
    for item in (*pinned, kind, *cflags(kind), *ldflags(kind), *cuda_cflags()):
        digest.update(item.encode())
    root = csrc_dir()
    # Headers are not in the source list but change the build all the same.
    headers = sorted(glob.glob(str(root / "**" / "*.h"), recursive=True))
    headers += sorted(glob.glob(str(root / "**" / "*.cuh"), recursive=True))
    if kind == "emulated":  # included by emulation/*_kernels.cpp
        headers += sorted(glob.glob(str(root / "cuda" / "*.cu")))
    for path in [*files, *headers]:
        digest.update(os.path.relpath(path, root).encode())
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    configured = os.environ.get("EFFILAYERS_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "effilayers"


def _prebuilt(kind: str) -> Path | None:
    import importlib.machinery

    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = PACKAGE_DIR / f"_{library_name(kind)}{suffix}"
        if candidate.exists():
            return candidate
    return None


def _check_toolchain(kind: str) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise ExtensionUnavailable(f"no C++ compiler found (looked for {compiler!r}; set CXX to choose one)")
    if not cpp_extension.is_ninja_available():
        raise ExtensionUnavailable("ninja is not installed (pip install ninja)")
    if kind == "cuda" and shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        raise ExtensionUnavailable("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")


def build_and_load(kind: str) -> str:
    """Load the library for ``kind``, building it first if needed.

    Returns where it came from (for ``effilayers.info``). Raises
    ExtensionUnavailable with the reason when it cannot be had.
    """
    import torch

    if kind not in KINDS + TEST_KINDS:
        raise ValueError(f"kind must be one of {KINDS + TEST_KINDS}, got {kind!r}")
    if kind == "cuda" and torch.version.cuda is None:
        raise ExtensionUnavailable(f"this torch ({torch.__version__}) was built without CUDA")

    prebuilt = _prebuilt(kind)
    if prebuilt is not None:
        torch.ops.load_library(str(prebuilt))
        return f"prebuilt {prebuilt.name}"

    files = sources(kind)
    if not files:
        raise ExtensionUnavailable(f"no sources for {kind} under {csrc_dir()}")
    build_dir = cache_root() / f"{library_name(kind)}-{_fingerprint(kind, files)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    built = build_dir / f"{library_name(kind)}.so"

    import fcntl

    with open(build_dir / "effilayers-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # The directory name fingerprints sources, flags and torch, so a
            # finished library there is the one we would build: load it
            # without asking for a compiler. Checked under the lock, so never
            # a half-written one.
            if built.exists():
                try:
                    torch.ops.load_library(str(built))
                    return f"cached in {build_dir}"
                except OSError:
                    # Left by a build killed while linking; ninja would take
                    # it for up to date, so remove it and rebuild.
                    built.unlink()
            _check_toolchain(kind)
            _seed_from_previous_build(kind, build_dir)
            # A first call that seems to hang for a minute needs a reason.
            # How long depends on the cores free for it: ninja compiles one
            # source per core, and the largest source alone takes a minute.
            print(f"effilayers: compiling the {kind} kernels into {build_dir} (once per source and torch version; "
                  f"1-2 minutes on {os.cpu_count()} idle cores, several on a busy machine)", file=sys.stderr,
                  flush=True)
            _jit_build(kind, files, build_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return f"built in {build_dir}"


def export_library(kind: str, directory: str | os.PathLike) -> Path:
    """Build (or load) the library for ``kind`` here and copy it into
    ``directory`` with a stamp of what it was built from, for a machine whose
    time is too short to build it (a lent GPU): ``import_library`` there
    takes it only if the stamp still matches that checkout and torch."""
    build_and_load(kind)
    files = sources(kind)
    built = cache_root() / f"{library_name(kind)}-{_fingerprint(kind, files)}" / f"{library_name(kind)}.so"
    if not built.exists():
        raise ExtensionUnavailable(f"{library_name(kind)} was loaded from a prebuilt copy, not built into the cache")
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, target / built.name)
    (target / f"{library_name(kind)}.stamp").write_text(_fingerprint(kind, files, python_version=False) + "\n")
    return target / built.name


def import_library(kind: str, directory: str | os.PathLike) -> str:
    """Place a library exported by ``export_library`` into this machine's
    build cache, where ``build_and_load`` finds it, if its stamp matches the
    sources, flags and torch version here. Returns what happened, in words;
    a mismatch leaves the cache alone, so the library is built as usual."""
    source = Path(directory) / f"{library_name(kind)}.so"
    stamp = Path(directory) / f"{library_name(kind)}.stamp"
    if not source.exists() or not stamp.exists():
        return f"no prebuilt {library_name(kind)} in {directory}"
    files = sources(kind)
    expected = _fingerprint(kind, files, python_version=False)
    shipped = stamp.read_text().strip()
    if shipped != expected:
        return f"prebuilt {library_name(kind)} is stale (stamp {shipped}, these sources and torch {expected}): building"
    build_dir = cache_root() / f"{library_name(kind)}-{_fingerprint(kind, files)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, build_dir / source.name)
    return f"prebuilt {library_name(kind)} matches (stamp {expected}): placed in {build_dir}"


def _seed_from_previous_build(kind: str, build_dir: Path) -> None:
    """Start a new build directory from the newest finished one, so ninja
    recompiles only the translation units whose sources or headers changed.

    Object files, ninja's log (command hashes) and its dependency database
    keep their timestamps, so ninja's usual rule applies: an object older
    than any of its inputs, or built by a different command, is rebuilt.
    While someone edits one kernel file this turns a full rebuild of the
    library (about a minute on 2 cores) into that one file's compile."""
    if (build_dir / "build.ninja").exists():
        return
    # Builds from this source tree first: ninja compares whole command lines,
    # and those name the csrc/ directory (several checkouts share one cache).
    include_flag = f"-I{csrc_dir()} "
    finished = []
    for sibling in build_dir.parent.glob(f"{library_name(kind)}-*"):
        library = sibling / f"{library_name(kind)}.so"
        recipe = sibling / "build.ninja"
        if sibling != build_dir and library.exists() and recipe.exists():
            same_tree = include_flag in recipe.read_text(errors="replace")
            finished.append((same_tree, library.stat().st_mtime, sibling))
    if not finished:
        return
    _, built_at, newest = max(finished)
    for path in newest.glob("*.o"):
        # Only objects the finished link used: one newer than the library
        # may be half-written by a build running there now.
        if path.stat().st_mtime <= built_at:
            shutil.copy2(path, build_dir / path.name)
    # ninja writes its log just after linking. An entry whose object was not
    # copied only makes ninja rebuild that object.
    for name in (".ninja_log", ".ninja_deps"):
        if (newest / name).exists():
            shutil.copy2(newest / name, build_dir / name)


def _jit_build(kind: str, files: list[str], build_dir: Path) -> None:
    from torch.utils import cpp_extension

    # torch's own build baton is a plain file that a killed build leaves
    # behind; holding our lock proves nobody is using it.
    stale_baton = build_dir / "lock"
    if stale_baton.exists():
        stale_baton.unlink()
    verbose = os.environ.get("EFFILAYERS_VERBOSE_BUILD", "0") == "1"
    try:
        cpp_extension.load(
            name=library_name(kind),
            sources=files,
            extra_cflags=cflags(kind),
            extra_ldflags=ldflags(kind),
            extra_cuda_cflags=cuda_cflags() if kind == "cuda" else None,
            extra_include_paths=include_paths(kind),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as error:  # compiler errors arrive as RuntimeError or CalledProcessError
        detail = str(error)
        if len(detail) > 2000:
            detail = detail[:1000] + "\n...\n" + detail[-1000:]
        hint = "" if verbose else " (set EFFILAYERS_VERBOSE_BUILD=1 to see the full compiler output)"
        raise ExtensionUnavailable(f"building {library_name(kind)} failed: {detail}{hint}") from error
