"""Opaque torch operators with a plain Python kernel: the lean way to keep a computation whole under
``torch.compile``.

``torch.library.custom_op`` wraps each call in Python layers (an autograd kernel, a dynamo-disabled wrapper,
an output-aliasing check): tens of microseconds of host time a call, which a compiled FSDP2 step (no CUDA
graph) pays for every norm of every layer. An op defined here is one dispatcher entry that calls the function
itself; autograd stays with the caller (the ops are called inside ``torch.autograd.Function``s: no gradient
flows through the op itself). Like a custom op's, its outputs must not alias its inputs.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["opaque_op"]

_LIBS: dict[str, torch.library.Library] = {}


def opaque_op(qualname: str, fn: Callable, fake: Callable | None = None) -> Callable:
    """Define ``qualname`` (``"namespace::name"``) with the schema of ``fn``'s annotations, ``fn`` as its kernel on
    every device and ``fake`` (default: ``fn`` itself, for functions made of ops with meta kernels) for tracing.
    Returns the op's default overload."""
    ns, name = qualname.split("::")
    lib = _LIBS.get(ns)
    if lib is None:
        lib = _LIBS[ns] = torch.library.Library(ns, "FRAGMENT")  # noqa: TOR901 (kept for the process)
    lib.define(name + torch.library.infer_schema(fn, mutates_args=()))
    lib.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake or fn, lib=lib)
    return getattr(getattr(torch.ops, ns), name).default
