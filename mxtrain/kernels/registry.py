"""The one kernel registry: which implementation runs an operation, and why the others do not.

Each implementation is registered for an (operation, backend) with a ``supports(call)`` that returns None
(it takes the call) or a sentence saying why not. A call walks the backends in the preference order of its
device (CUDA tensors: ``cuda`` -> ``triton`` -> ``reference``; other devices: ``reference``), or from a
forced backend (``MXTRAIN_BACKEND`` / ``backend=``) on, and runs the first implementation that takes it.
Implementations never call each other: the walk here is the only list of fallbacks. A decision is cached
per call key (devices, dtypes, shapes, strides, alignment, scalar arguments; never values) and per
:mod:`mxtrain.config` settings. :func:`explain` says which implementation runs and why the others do not.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable

import torch

from mxtrain import config

__all__ = ["Kernel", "Operation", "KernelUnavailable", "KernelDeclined", "BACKENDS", "ORDER", "define", "undefine", "register", "unregister",
           "kernels", "chain", "select", "run", "run_from", "explain", "broken", "preferred_backend", "walks",
           "set_kernel_loader"]

BACKENDS = ("auto", "reference", "triton", "cuda")
# the walk, fastest first; a CUDA tensor starts at "cuda", any other device at "reference" unless a backend
# is forced (Triton runs on the CPU only under TRITON_INTERPRET=1, for tests)
ORDER = ("cuda", "triton", "reference")
_AUTO = {"cuda": ORDER}
_MAX_CACHED = 4096


class KernelDeclined(RuntimeError):
    """Raised by an implementation that refuses one call its ``supports()`` let through: the walk goes on to
    the next implementation for this call only (the kernel stays in use for every other call)."""


class KernelUnavailable(RuntimeError):
    """Raised by an implementation that finds at run time that it cannot run on this device (a library
    without the kernel): the registry remembers it for the device and the walk goes on. Once per device,
    never on the hot path."""


@dataclasses.dataclass(frozen=True, eq=False)
class Kernel:
    """One implementation of an operation: ``fn(call)`` runs it, ``supports(call)`` (None: takes every call)
    says why it does not take a call. ``supports`` may read only what the operation's key holds.
    ``traceable``: ``fn`` is made of torch operations only (no kernel launch of its own, no host read), so
    under ``torch.compile`` its entry point may trace it into the graph instead of calling it through its
    registered op (the compiled step then calls those operations directly: no Python on the host per call)."""

    op: str
    backend: str
    name: str
    fn: Callable[[Any], Any]
    supports: Callable[[Any], "str | None"] | None = None
    traceable: bool = False

    def __repr__(self) -> str:
        return f"<kernel {self.op}:{self.backend}:{self.name}>"


@dataclasses.dataclass(frozen=True)
class Operation:
    """How an operation walks: ``key(call)`` is its cache key (None: supports() runs on every call);
    ``make_call(**arguments)`` builds a call for :func:`explain`; ``backend_policy`` ``"walk"`` (a forced
    backend starts the walk there) or ``"reference_only"`` (only ``reference`` changes it: the GEMMs) or
    ``"ignore"``; ``strict_cuda``: a forced ``"cuda"`` needs a CUDA C++ kernel of this operation (else it
    means Triton's)."""

    name: str
    make_call: Callable[..., Any]
    key: Callable[[Any], Hashable] | None = None
    backend_policy: str = "walk"
    strict_cuda: bool = False


_OPS: dict[str, Operation] = {}
_KERNELS: dict[str, list[Kernel]] = {}
_BROKEN: dict[tuple[Kernel, Any], str] = {}  # (kernel, device) -> why it failed there at run time
_CHAINS: dict = {}
_DECISIONS: dict = {}
_generation = 0
_LOADER: Callable[[], None] | None = None


def _changed() -> None:
    global _generation
    _generation += 1
    _CHAINS.clear()
    _DECISIONS.clear()


def set_kernel_loader(loader: Callable[[], None]) -> None:
    """Install the function that imports the kernel modules on first use (``mxtrain/kernels/__init__.py``)."""
    global _LOADER
    _LOADER = loader


def _load() -> None:
    if _LOADER is not None:
        if torch.compiler.is_compiling():
            _load_untraced()
        else:
            _LOADER()


@torch.compiler.assume_constant_result
def _load_untraced() -> bool:
    """The loader run as it is, not traced (its imports register kernels: side effects torch.compile refuses
    inside a module's autograd function)."""
    _LOADER()
    return True


def define(op: Operation) -> None:
    """Declare an operation (its entry point in :mod:`mxtrain.kernels.dispatch` does)."""
    _OPS[op.name] = op
    _KERNELS.setdefault(op.name, [])
    _changed()


def undefine(op: str) -> None:
    """Remove an operation and its implementations (tests define throwaway ones)."""
    _OPS.pop(op, None)
    _KERNELS.pop(op, None)
    _BROKEN.clear()
    _changed()


def register(op: str, backend: str, fn: Callable[[Any], Any], *, supports: Callable | None = None,
             name: str | None = None, first: bool = False, traceable: bool = False) -> Kernel:
    """Register ``fn`` as the ``name`` implementation of ``op`` on ``backend`` (replacing one of that name).

    Within a backend, kernels are tried in registration order (``first``: before the others). ``traceable``:
    see :class:`Kernel`."""
    if backend not in ORDER:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(ORDER)}")
    kernel = Kernel(op, backend, name or backend, fn, supports, traceable)
    table = [k for k in _KERNELS.setdefault(op, []) if not (k.backend == backend and k.name == kernel.name)]
    table.insert(0 if first else len(table), kernel)
    table.sort(key=lambda k: ORDER.index(k.backend))  # stable: registration order within a backend
    _KERNELS[op] = table
    _changed()
    return kernel


def unregister(op: str, backend: str, name: str | None = None) -> None:
    """Remove the ``name`` (default: every) implementation of ``op`` on ``backend``."""
    _KERNELS[op] = [k for k in _KERNELS.get(op, []) if not (k.backend == backend and name in (None, k.name))]
    _changed()


def kernels(op: str) -> tuple[Kernel, ...]:
    """Every registered implementation of ``op``, in walk order."""
    _load()
    return tuple(_KERNELS.get(op, ()))


def _operation(op: str) -> Operation:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown kernel operation {op!r}; known: {', '.join(sorted(_OPS))}") from None


def _backends(op: Operation, device: torch.device, backend: str | None, start: str | None) -> tuple[str, ...]:
    """The backends a call walks, in order (``start``: from that backend on, whatever the settings)."""
    if start is not None:
        return ORDER[ORDER.index(start):]
    backend = backend or config.current().backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} (argument or MXTRAIN_BACKEND)")
    if op.backend_policy == "ignore" or (op.backend_policy == "reference_only" and backend != "reference"):
        backend = "auto"
    if backend == "auto":
        return _AUTO.get(device.type, ("reference",))
    present = {k.backend for k in _KERNELS[op.name]}
    if backend == "cuda" and not op.strict_cuda and "cuda" not in present:
        backend = "triton"  # "cuda": the CUDA C++ kernels where an operation has one, Triton's elsewhere
    if backend != "reference" and backend not in present:
        raise RuntimeError(f"backend {backend!r} is not available here (registered: "
                           f"{', '.join(sorted(present)) or 'none'})")
    return ORDER[ORDER.index(backend):]


def chain(op: str, device: torch.device, backend: str | None = None, start: str | None = None) -> tuple[Kernel, ...]:
    """The implementations a call of ``op`` on ``device`` would try, in order."""
    settings = config.current()
    ck = (op, device, backend, start, id(settings))
    # while tracing, neither read nor write the cache: dynamo would guard on its contents (a recompile each
    # time an eager call adds the key)
    hit = None if torch.compiler.is_compiling() else _CHAINS.get(ck)
    if hit is not None:
        return hit[1]
    _load()
    operation = _operation(op)
    walk = _backends(operation, device, backend, start)
    found = tuple(k for k in _KERNELS[op] if k.backend in walk)
    if not found:
        raise RuntimeError(f"no implementation of {op!r} is registered for backends {', '.join(walk)}")
    if torch.compiler.is_compiling():  # no entry keyed by a traced tensor's device (a side effect compile refuses)
        return found
    if len(_CHAINS) > _MAX_CACHED:
        _CHAINS.clear()
    _CHAINS[ck] = (settings, found)  # the settings stay alive with the entry, so their id is not reused
    return found


def _reason(kernel: Kernel, call, device) -> str | None:
    broken = _BROKEN.get((kernel, device))
    if broken is not None:
        return f"failed here before: {broken}"
    return None if kernel.supports is None else kernel.supports(call)


def select(op: str, call, device: torch.device, backend: str | None = None, start: str | None = None) -> Kernel:
    """The implementation that runs ``call``: the first of :func:`chain` whose ``supports`` returns None."""
    found = chain(op, device, backend, start)
    first = found[0]
    if first.supports is None and (first, device) not in _BROKEN:
        return first
    key_fn = _OPS[op].key
    dk = None
    if key_fn is not None and not torch.compiler.is_compiling():  # a key reads data pointers (alignment): eager
        dk = (op, device, backend, start, id(config.current()), key_fn(call))
        hit = _DECISIONS.get(dk)
        if hit is not None:
            return hit[1]
    for kernel in found:
        if _reason(kernel, call, device) is None:
            if dk is not None:
                if len(_DECISIONS) > _MAX_CACHED:
                    _DECISIONS.clear()
                _DECISIONS[dk] = (config.current(), kernel)
            return kernel
    raise RuntimeError(f"no implementation of {op!r} takes this call: "
                       + "; ".join(f"{k.backend}:{k.name}: {_reason(k, call, device)}" for k in found))


def run(op: str, call, device: torch.device, backend: str | None = None, start: str | None = None):
    """Run ``call`` on the implementation :func:`select` picks (walking on past one that finds, once,
    that it cannot run on this device: :class:`KernelUnavailable`)."""
    kernel = select(op, call, device, backend, start)
    try:
        return kernel.fn(call)
    except KernelUnavailable as e:
        _BROKEN[(kernel, device)] = str(e)
        _changed()
        return run(op, call, device, backend, start)
    except KernelDeclined:
        found = chain(op, device, backend, start)
        for later in found[found.index(kernel) + 1:]:
            if _reason(later, call, device) is None:
                return later.fn(call)
        raise


def run_from(op: str, call, device: torch.device, start: str):
    """Run ``call`` walking from backend ``start`` on, whatever ``MXTRAIN_BACKEND`` says (the public
    per-backend entry points such as ``cast.triton_quantize`` are this)."""
    return run(op, call, device, start=start)


def preferred_backend(op: str, device: torch.device, backend: str | None = None) -> str:
    """The backend a call of ``op`` on ``device`` tries first (of those registered)."""
    return chain(op, device, backend)[0].backend


def walks(op: str, device: torch.device, backend_name: str, backend: str | None = None) -> bool:
    """Whether a call of ``op`` on ``device`` may reach a ``backend_name`` implementation (the fused FP8
    casts of the modules are Triton kernels beside the registered ones: they run where Triton's would)."""
    return any(k.backend == backend_name for k in chain(op, device, backend))


def broken(op: str) -> dict[str, str]:
    """``{"backend:name on device": why}`` for each implementation of ``op`` that failed at run time (see
    :class:`KernelUnavailable`) and is skipped since."""
    return {f"{k.backend}:{k.name} on {dev}": why for (k, dev), why in _BROKEN.items() if k.op == op}


def explain(op: str, /, *, backend: str | None = None, **arguments) -> list[tuple[str, str | None]]:
    """Which implementation of ``op`` would run for these arguments, and why the others would not.

    ``arguments`` are the operation's (``explain("quantize", x=x, fmt="fp8_e4m3", axis=(-1, 0))``).
    Returns ``[(backend:name, reason), ...]`` for every registered implementation, in walk order; the
    one that runs has reason None. Asking may build the CUDA extension (as the first call would)."""
    operation = _operation(op)
    call = operation.make_call(**arguments)
    device = call.device
    walk = chain(op, device, backend)
    chosen = None
    out = []
    for kernel in kernels(op):
        label = f"{kernel.backend}:{kernel.name}"
        if kernel not in walk:
            why = backend or config.current().backend
            out.append((label, f"not tried: backend {why!r} on {device.type} walks "
                               f"{', '.join(dict.fromkeys(k.backend for k in walk))}"))
        elif chosen is not None:
            out.append((label, f"not reached: {chosen} takes the call first"))
        else:
            reason = _reason(kernel, call, device)
            out.append((label, reason))
            if reason is None:
                chosen = label
    return out
