"""Packaging glue for the optional ahead-of-time build of csrc/.

A plain ``pip install .`` builds nothing: the kernels compile on first use
(see effilayers/_core/build.py). ``EFFILAYERS_BUILD_EXT=1 pip install
--no-build-isolation .`` compiles them now, against the torch already
installed, into libraries that effilayers loads instead. The build uses the
same sources and flags as the first-use build, so it targets the CPU of the
machine it runs on.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _build_config():
    # Load effilayers/_core/build.py by path: importing the package would import torch.
    spec = importlib.util.spec_from_file_location("_effilayers_build", ROOT / "effilayers" / "_core" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extensions():
    if os.environ.get("EFFILAYERS_BUILD_EXT", "0") != "1":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError as error:
        raise SystemExit(
            "EFFILAYERS_BUILD_EXT=1 builds against the torch you have installed: install torch first, "
            "then run pip with --no-build-isolation so it can see it"
        ) from error
    config = _build_config()
    csrc = ROOT / "csrc"
    relative = lambda paths: [os.path.relpath(p, ROOT) for p in paths]  # noqa: E731
    modules = [
        CppExtension(
            name=f"effilayers._{config.library_name('cpu')}",
            sources=relative(config.sources("cpu", csrc)),
            include_dirs=[str(csrc)],
            extra_compile_args={"cxx": config.cflags("cpu")},
            extra_link_args=config.ldflags("cpu"),
        )
    ]
    if torch.version.cuda is not None and os.environ.get("EFFILAYERS_BUILD_CUDA", "1") == "1":
        modules.append(
            CUDAExtension(
                name=f"effilayers._{config.library_name('cuda')}",
                sources=relative(config.sources("cuda", csrc)),
                include_dirs=[str(csrc)],
                extra_compile_args={"cxx": config.cflags("cuda"), "nvcc": config.cuda_cflags()},
            )
        )
    return {"ext_modules": modules, "cmdclass": {"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)}}


# Every package under effilayers/, found; csrc/ joins them as effilayers.csrc
# (a package mapped from another directory cannot be found by a search).
PACKAGES = find_packages(include=["effilayers", "effilayers.*"]) + ["effilayers.csrc"]

setup(packages=PACKAGES, package_dir={"effilayers.csrc": "csrc"}, include_package_data=False, **_extensions())
