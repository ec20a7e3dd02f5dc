"""Opaque torch operators with a plain Python kernel: the lean way to keep a computation whole under
``torch.compile``.

``torch.library.custom_op`` wraps each call in Python layers (an autograd kernel, a dynamo-disabled wrapper,
an output-aliasing check): tens of microseconds of host time a call, which a compiled FSDP2 step (no CUDA
graph) pays for every cast, norm and GEMM of every layer. An op defined here is one dispatcher entry that
calls the function itself. Autograd stays with the caller: mxtrain calls these ops inside
``torch.autograd.Function``s, so no gradient flows through an op itself. As a custom op's, an op's outputs
must not alias its inputs (the functions copy where they would: see ``kernels.dispatch._distinct``).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["opaque_op", "OpaqueOp"]

_LIBS: dict[str, torch.library.Library] = {}


class OpaqueOp:
    """An op made by :func:`opaque_op`: call it as the function, ``register_fake`` its tracing rule (as a
    ``torch.library.custom_op``'s), ``op`` is its default overload."""

    def __init__(self, qualname: str, fn: Callable) -> None:
        ns, name = qualname.split("::")
        lib = _LIBS.get(ns)
        if lib is None:
            lib = _LIBS[ns] = torch.library.Library(ns, "FRAGMENT")  # kept for the process
        lib.define(name + torch.library.infer_schema(fn, mutates_args=()))
        lib.impl(name, fn, "CompositeExplicitAutograd")
        self.qualname, self.fn, self._lib = qualname, fn, lib
        self.op = getattr(getattr(torch.ops, ns), name).default

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fake, lib=self._lib)
        return fake

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)


def opaque_op(qualname: str, fn: Callable | None = None, *, fake: Callable | None = None):
    """Define ``qualname`` (``"namespace::name"``) with the schema of ``fn``'s annotations and ``fn`` as its kernel
    on every device; ``fake`` (or a later ``register_fake``) traces it. Without ``fn``, a decorator (as
    ``torch.library.custom_op(qualname, mutates_args=())``). Returns the :class:`OpaqueOp`."""
    if fn is None:
        return lambda f: opaque_op(qualname, f, fake=fake)
    op = OpaqueOp(qualname, fn)
    if fake is not None:
        op.register_fake(fake)
    return op
