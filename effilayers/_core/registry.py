"""Which implementation of each op runs on each device, and why.

Every effilayers op has a pure-PyTorch ``reference`` implementation and, per
device, at most one compiled one:

========== ============ ==================================================
backend    device       what it is
========== ============ ==================================================
cpp        cpu          C++ kernels in csrc/cpu (library ``effilayers_cpu``)
cuda       cuda         CUDA kernels in csrc/cuda (library ``effilayers_cuda``)
triton     cuda         Triton kernels in effilayers/ops/<family>/triton.py; on CPU
                        tensors when ``TRITON_INTERPRET=1`` (that is how CI
                        runs them)
reference  any          pure PyTorch; always there, slower, more memory
========== ============ ==================================================

Ops declared with :func:`declare` (the converted families; ARCHITECTURE.md
lists them) exist once, as ``torch.ops.effilayers.<op>``, and torch's
dispatcher picks their kernel: the compiled libraries register theirs on the
CPU / CUDA keys (``TORCH_LIBRARY_IMPL(effilayers, ...)``); this registry
registers the Triton or reference kernel on a key where that is the choice,
and, for a forced preference, the forced kernel for the duration. It decides,
it does not dispatch. The other ops still have their compiled kernels in the
``effilayers_cpu`` / ``effilayers_cuda`` namespaces, which :func:`dispatch`
calls directly in eager mode.

By default an op uses its compiled kernel for the device and falls back to the
reference, with one warning, when that kernel cannot be built. The environment
variable ``EFFILAYERS_BACKEND`` (read at import) or :func:`use_backend` (for
tests and benchmarks) replaces that choice with a comma-separated preference
list, for example ``reference``, ``cpp`` or ``triton,reference``. A forced
list is strict: an op that has none of the listed backends for a device, or
whose listed backends cannot be built, raises instead of quietly running
something else.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

import torch

from . import build

BACKENDS = ("reference", "cpp", "cuda", "triton")
_DEFAULT_ORDER = {"cpu": ("cpp", "reference"), "cuda": ("cuda", "triton", "reference")}
_COMPILED_KIND = {"cpp": "cpu", "cuda": "cuda"}
ENV_VAR = "EFFILAYERS_BACKEND"


def parse_preference(value: Optional[str]) -> Optional[tuple[str, ...]]:
    """``"triton, reference"`` -> ``("triton", "reference")``; empty -> None."""
    if value is None or not value.strip():
        return None
    names = tuple(part.strip().lower() for part in value.split(",") if part.strip())
    unknown = [name for name in names if name not in BACKENDS]
    if unknown:
        raise ValueError(
            f"{ENV_VAR} / use_backend: unknown backend {unknown[0]!r}; allowed: {', '.join(BACKENDS)} "
            "(comma-separated, in order of preference)"
        )
    return names


@dataclass
class OpKernels:
    """What one op provides. Compiled kernels are named by their op: the
    library registers them on the declared op itself (:func:`declare`), or,
    for ops not declared yet, in the ``effilayers_cpu`` / ``effilayers_cuda``
    namespaces; or they are given as a Python
    callable that composes compiled kernels of that library (it is available
    exactly when the library is). Triton kernels take the same arguments as
    the reference and are named ``"module:function"``: the module imports
    triton, so it is imported only when that backend is first chosen, and
    it never imports the op that names it."""

    name: str
    reference: Callable
    cpp: Optional[Union[str, Callable]] = None
    cuda: Optional[Union[str, Callable]] = None
    triton: Optional[Union[str, Callable]] = None

    def provides(self, backend: str) -> bool:
        return backend == "reference" or getattr(self, backend) is not None


@dataclass
class Choice:
    backend: str
    reason: str
    kernel: Optional[Callable] = field(default=None, repr=False)
    error: Optional[str] = None


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.ops: dict[str, OpKernels] = {}
        self.preference = parse_preference(os.environ.get(ENV_VAR))
        self.preference_source = ENV_VAR
        self.choices: dict[tuple[str, str], Choice] = {}
        # kind -> None (loaded) or the reason it is unavailable; absent = not tried
        self.libraries: dict[str, Optional[str]] = {}
        self.library_origin: dict[str, str] = {}
        self.warned: set[str] = set()
        # Ops declared in the ``effilayers`` namespace by :func:`declare`:
        # the dispatcher routes their calls, these libraries only say where.
        self.declared: dict[str, torch._ops.OpOverload] = {}
        # A declared op's argument checks, run before the Python kernels
        # registered on its keys (the compiled kernels check for themselves).
        self.checks: dict[str, Callable] = {}
        # Python kernels registered on a device's dispatch key for declared
        # ops: what the first call chose where no compiled kernel registers
        # itself (Triton, the reference), or, under a forced preference,
        # what that preference chose. Destroyed and rebuilt whenever the
        # preference changes.
        self.registered: Optional[torch.library.Library] = None
        # A preference read from the environment, not applied yet: the
        # first call of a declared op applies it (resolving it at import
        # could start a build).
        self.pending = self.preference is not None
        self.applying = False
        # (op, device type) -> whether the op's C++ autograd kernel serves
        # eager calls there (:func:`compiled_autograd`).
        self.compiled_autograd: dict[tuple[str, str], bool] = {}


_state = _State()


def register(kernels: OpKernels) -> None:
    with _state.lock:
        if kernels.name in _state.ops:
            raise RuntimeError(f"effilayers op {kernels.name!r} registered twice")
        _state.ops[kernels.name] = kernels


def registered_ops() -> list[str]:
    return sorted(_state.ops)


def op_kernels(op_name: str) -> OpKernels:
    """What ``op_name`` declares: its reference and compiled backends."""
    try:
        return _state.ops[op_name]
    except KeyError:
        raise KeyError(f"unknown effilayers op {op_name!r}; registered: {registered_ops()}") from None


def _triton_status(device_type: str) -> Optional[str]:
    """None when Triton kernels can run on this device type, else why not."""
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            return "Triton runs on CPU tensors only under TRITON_INTERPRET=1"
    elif not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'effilayers[triton]')"
    return None


def _library_status(kind: str) -> Optional[str]:
    """Load the compiled library for ``kind`` once; None when loaded."""
    with _state.lock:
        if kind not in _state.libraries:
            try:
                _state.library_origin[kind] = build.build_and_load(kind)
                _state.libraries[kind] = None
                if _state.registered is not None and not _state.applying:
                    # The library's kernels now sit above the forced ones
                    # on their keys (the last registration wins): put those back on top.
                    _apply_preference()
            except build.ExtensionUnavailable as error:
                _state.libraries[kind] = str(error)
            except Exception as error:  # noqa: BLE001 - an unwritable cache, a stale .so: fall back, say why
                _state.libraries[kind] = f"{type(error).__name__}: {error}"
        return _state.libraries[kind]


def _availability(op: OpKernels, backend: str, device_type: str) -> Optional[str]:
    """None when ``op`` can run ``backend`` on ``device_type``, else why not."""
    if not op.provides(backend):
        return f"{op.name} has no {backend} kernel"
    if backend == "reference":
        return None
    if backend == "triton":
        return _triton_status(device_type)
    kind = _COMPILED_KIND[backend]
    if kind != device_type:
        return f"{backend} kernels run on {kind} tensors, not {device_type}"
    if kind == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    why_not = _library_status(kind)
    if why_not is None and op.name in _state.declared and isinstance(getattr(op, backend), str) \
            and not torch._C._dispatch_has_kernel_for_dispatch_key(f"effilayers::{op.name}", _DISPATCH_KEY[kind]):
        return f"the {build.library_name(kind)} library loaded registers no {_DISPATCH_KEY[kind]} kernel for it"
    return why_not


def _compiled_kernel(op: OpKernels, backend: str) -> Callable:
    implementation = getattr(op, backend)
    if callable(implementation):
        return implementation
    if op.name in _state.declared:
        # The library registered its kernel on the op's device key: the op
        # itself reaches it, one dispatcher hop.
        return _state.declared[op.name]
    namespace = f"effilayers_{_COMPILED_KIND[backend]}"
    return getattr(getattr(torch.ops, namespace), getattr(op, backend)).default


def _triton_kernel(spec: Union[str, Callable]) -> Callable:
    if callable(spec):
        return spec
    module_name, _, function = spec.partition(":")
    return getattr(importlib.import_module(module_name), function)


def _accelerated_kernels(op: OpKernels, device_type: str) -> list[str]:
    """The non-reference backends ``op`` provides for ``device_type``."""
    return [b for b in _DEFAULT_ORDER.get(device_type, ()) if b != "reference" and op.provides(b)]


def _resolve(op: OpKernels, device_type: str) -> Choice:
    forced = _state.preference
    order = forced if forced is not None else _DEFAULT_ORDER.get(device_type, ("reference",))
    rejected: list[str] = []
    for backend in order:
        why_not = _availability(op, backend, device_type)
        if why_not is not None:
            rejected.append(f"{backend}: {why_not}")
            continue
        if backend == "reference":
            kernel = op.reference
        elif backend == "triton":
            kernel = _triton_kernel(op.triton)
        else:
            kernel = _compiled_kernel(op, backend)
        if forced is not None:
            reason = f"forced by {_state.preference_source}={','.join(forced)}"
        elif backend == "reference" and not _accelerated_kernels(op, device_type):
            # Not a fallback: PyTorch ops are this op's implementation on
            # this device (e.g. the DenseNet bottleneck on CPU).
            reason = f"the PyTorch implementation is this op's {device_type} path"
        elif rejected:
            reason = "fallback; " + "; ".join(rejected)
        else:
            reason = "compiled kernel" if backend != "reference" else "only implementation"
        return Choice(backend, reason, kernel)
    detail = "; ".join(rejected)
    return Choice(
        "none",
        detail,
        None,
        error=(
            f"effilayers.{op.name}: no usable backend on {device_type} for "
            f"{_state.preference_source}={','.join(order)} ({detail})"
        ),
    )


def choice(op_name: str, device_type: str) -> Choice:
    """The backend ``op_name`` uses on ``device_type`` (resolving it, and
    building a compiled library, the first time)."""
    key = (op_name, device_type)
    cached = _state.choices.get(key)
    if cached is not None:
        return cached
    with _state.lock:
        if key not in _state.choices:
            op = _state.ops.get(op_name)
            if op is None:
                raise KeyError(f"unknown effilayers op {op_name!r}; registered: {registered_ops()}")
            resolved = _resolve(op, device_type)
            if _state.preference is None and resolved.backend == "reference" and _accelerated_kernels(op, device_type):
                _warn_fallback(device_type, resolved.reason)
            _state.choices[key] = resolved
        return _state.choices[key]


def _warn_fallback(device_type: str, reason: str) -> None:
    # One warning per device for the whole process, not one per op or call.
    if device_type in _state.warned:
        return
    _state.warned.add(device_type)
    warnings.warn(
        f"effilayers: compiled {device_type} kernels are unavailable, using the pure-PyTorch reference "
        f"implementation (slower, uses more memory). Reason: {reason}. "
        f"Run `python -m effilayers.info` for details.",
        RuntimeWarning,
        stacklevel=4,
    )


def kernel(op_name: str, device: torch.device) -> Callable:
    """The callable that runs ``op_name`` on ``device``; raises when none can."""
    resolved = choice(op_name, device.type)
    if resolved.kernel is None:
        raise RuntimeError(resolved.error)
    return resolved.kernel


def op(op_name: str):
    """The declared op ``effilayers::<op_name>`` (its default overload)."""
    return _state.declared[op_name]


def runs_eagerly(like: torch.Tensor) -> bool:
    """Whether a call on ``like`` may take an eager-only path (a composition
    with no fake kernel, a kernel called below autograd): a plain tensor,
    outside torch.compile/export, with autograd not recording. Anything else
    (tracing, tensor subclasses such as DTensor, ``create_graph=True``) must
    go through the traceable ops."""
    return type(like) is torch.Tensor and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def eager(op_name: str, like: torch.Tensor) -> Optional[Callable]:
    """The declared op ``op_name`` where its caller may take it on ``like``
    (see :func:`runs_eagerly`; for the eager-only ops, which have no fake
    kernel), else None, where the caller composes the traceable ops."""
    return _state.declared[op_name] if runs_eagerly(like) else None


# --------------------------------------------------------------------------- declared ops

_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}

# The one declaration of every op converted to it: the C++ libraries add
# their kernels to these ops with TORCH_LIBRARY_IMPL(effilayers, CPU/CUDA, m)
# and declare nothing themselves.
_LIBRARY = torch.library.Library("effilayers", "DEF")


def _device_type(args) -> str:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
            return arg[0].device.type
    raise RuntimeError("effilayers: an op was called without a tensor argument")


def _checked(op_name: str, implementation: Callable) -> Callable:
    """``implementation`` behind the op's argument checks, if it declared any."""
    check = _state.checks.get(op_name)
    if check is None:
        return implementation

    def checked(*args):
        check(*args)
        return implementation(*args)

    return checked


def _register_python_kernel(op_name: str, device_type: str, implementation: Callable) -> None:
    if _state.registered is None:
        _state.registered = torch.library.Library("effilayers", "IMPL")
    with warnings.catch_warnings():
        # Over a compiled kernel on the same key, torch warns once that it is
        # overridden: that is what a forced preference means here.
        warnings.simplefilter("ignore")
        _state.registered.impl(op_name, _checked(op_name, implementation), _DISPATCH_KEY[device_type])


def _failing(message: str) -> Callable:
    def fail(*args):
        raise RuntimeError(message)

    return fail


def _apply_preference() -> None:
    """Put on each declared op's CPU and CUDA keys what the current
    preference chose: nothing in automatic mode (the compiled kernels
    register themselves, the first call registers the rest); under a
    forced one, the chosen Python kernel, or one that raises why nothing
    can run, except where the choice is the compiled kernel."""
    with _state.lock:
        if _state.registered is not None:
            _state.registered._destroy()
            _state.registered = None
        if _state.preference is None:
            return
        # Resolve everything first: a resolution may load a library, whose
        # kernels would land above Python kernels registered before it.
        _state.applying = True
        try:
            plan = [(name, device_type, choice(name, device_type))
                    for name in sorted(_state.declared) for device_type in _DISPATCH_KEY]
        finally:
            _state.applying = False
        for name, device_type, resolved in plan:
            if resolved.kernel is None:
                _register_python_kernel(name, device_type, _failing(resolved.error))
            elif not _is_library_kernel(name, resolved.backend):
                _register_python_kernel(name, device_type, resolved.kernel)


def _is_library_kernel(op_name: str, backend: str) -> bool:
    return backend in _COMPILED_KIND and isinstance(getattr(_state.ops[op_name], backend), str)


def _first_call(op_name: str, op, args):
    """What a declared op runs on a device key with no kernel of its own yet
    (its CompositeExplicitAutograd kernel): resolve the choice once, which
    loads (or builds) the compiled library, whose kernel then takes the key;
    a Python choice (Triton, the reference) is registered on the key itself.
    Either way later calls never come here."""
    with _state.lock:
        if _state.pending:
            _state.pending = False
            _apply_preference()
            return op(*args)
    device_type = _device_type(args)
    resolved = choice(op_name, device_type)
    if resolved.kernel is None:
        raise RuntimeError(resolved.error)
    if _is_library_kernel(op_name, resolved.backend):
        return op(*args)
    if device_type in _DISPATCH_KEY:
        with _state.lock:
            _register_python_kernel(op_name, device_type, resolved.kernel)
    return _checked(op_name, resolved.kernel)(*args)


def declare(name: str, schema: str, fake: Optional[Callable] = None, *, check: Optional[Callable] = None,
            composition: Optional[Callable] = None, tags=()):
    """Declare the op ``effilayers::<name>`` from its schema (``"(Tensor x,
    ...) -> Tensor"``), once: ``fake`` is its shape function for
    torch.compile and torch.export; its kernels come from the compiled
    libraries (registered on the CPU / CUDA keys from C++) or from this
    registry (:func:`register` names them), chosen on its first call on a
    device. ``check``, given the op's arguments, raises on what its
    kernels cannot take: it runs before the Python kernels (Triton, the
    reference) when the op calls them, as the compiled kernels check for
    themselves; :func:`kernel` returns them unchecked, for callers that
    checked already. Returns the op's overload; its autograd, if any, is
    registered on it with ``torch.library.register_autograd``.

    ``composition``: the op is a Python composition of other ops (a chunk
    loop over the kernels, say), the same on every device, so there is no
    backend to choose: it is the op's one kernel. Declaring it keeps a
    traced graph to one node with ``fake``'s shapes, instead of the
    composition unrolled."""
    if check is not None:
        _state.checks[name] = check
    _LIBRARY.define(name + schema, tags=tags)
    if fake is not None:
        torch.library.register_fake(f"effilayers::{name}", fake, lib=_LIBRARY)
    op = getattr(torch.ops.effilayers, name).default
    if composition is not None:
        _LIBRARY.impl(name, composition, "CompositeExplicitAutograd")
        return op

    def first_call(*args):
        return _first_call(name, op, args)

    _LIBRARY.impl(name, first_call, "CompositeExplicitAutograd")
    with _state.lock:
        _state.declared[name] = op
    return op


def declare_autograd(name: str, schema: str):
    """Declare ``effilayers::<name>``, an op whose kernels, autograd
    included, come from the compiled libraries alone: each registers them on
    its device's Autograd key and plain key (the latter for inference mode).
    It has no fake kernel and no Python kernel; callers take it only where
    :func:`compiled_autograd` says it serves, and otherwise run the Python
    autograd Function that does the same traceably. Returns the op's overload."""
    _LIBRARY.define(name + schema)
    return getattr(torch.ops.effilayers, name).default


def eager_call(like: torch.Tensor) -> bool:
    """An eager call on a plain tensor, outside torch.compile/export and
    functorch's transforms: one that may take a path no tracer or tensor
    subclass sees (a Python Function over the ops, a C++ autograd kernel)."""
    return type(like) is torch.Tensor and not torch.compiler.is_compiling() \
        and not torch._C._are_functorch_transforms_active()


def compiled_autograd(op_name: str, like: torch.Tensor) -> bool:
    """Whether an eager call on ``like`` may take ``op_name``'s C++ autograd
    kernel (:func:`declare_autograd`): an :func:`eager_call`, on a device whose
    compiled library is loaded (this loads it, as an op's first call would)
    and registers the kernel, under a preference that allows that library.
    A forced ``reference`` (or ``triton``) preference keeps the Python
    Function, whose path those tests then cover."""
    if not eager_call(like):
        return False
    key = (op_name, like.device.type)
    served = _state.compiled_autograd.get(key)
    if served is None:
        with _state.lock:
            served = _state.compiled_autograd[key] = _serves_compiled_autograd(op_name, like.device.type)
    return served


def _serves_compiled_autograd(op_name: str, device_type: str) -> bool:
    backend = next((name for name, kind in _COMPILED_KIND.items() if kind == device_type), None)
    if backend is None or (_state.preference is not None and backend not in _state.preference):
        return False
    return _library_status(device_type) is None and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"effilayers::{op_name}", "Autograd" + _DISPATCH_KEY[device_type])


def current_preference() -> Optional[tuple[str, ...]]:
    return _state.preference


@contextlib.contextmanager
def use_backend(preference: Optional[str]) -> Iterator[None]:
    """Force a backend preference inside a ``with`` block (tests, benchmarks).

    For ops declared with :func:`declare`, the chosen kernels are registered
    on their device's dispatch key for the block (none where the choice is
    the compiled kernel the library registers itself) and removed after it.

    ``use_backend("reference")``, ``use_backend("cpp")``,
    ``use_backend("triton,reference")``; ``None`` restores the automatic choice.
    Not meant for use while other threads run effilayers ops.
    """
    parsed = parse_preference(preference)
    with _state.lock:
        saved = (_state.preference, _state.preference_source, dict(_state.choices))
        _state.preference = parsed
        _state.preference_source = "use_backend"
        _state.choices.clear()
        _state.compiled_autograd.clear()
        _state.pending = False
        _apply_preference()
    try:
        yield
    finally:
        with _state.lock:
            _state.preference, _state.preference_source, choices = saved
            _state.choices.clear()
            _state.choices.update(choices)
            _state.compiled_autograd.clear()
            _apply_preference()


def library_report() -> dict[str, str]:
    """Where each compiled library came from, or why it is missing."""
    report = {}
    for kind in build.KINDS:
        if kind not in _state.libraries:
            if kind == "cuda" and torch.version.cuda is None:
                report[kind] = f"not applicable: torch {torch.__version__} has no CUDA"
            elif kind == "cuda" and not torch.cuda.is_available():
                report[kind] = "not loaded: no CUDA device"
            else:
                report[kind] = "not loaded yet (builds on first use)"
        elif _state.libraries[kind] is None:
            report[kind] = f"loaded ({_state.library_origin[kind]})"
        else:
            report[kind] = f"unavailable: {_state.libraries[kind]}"
    return report
