"""Per-parameter cache of quantized weights, valid while the parameter's version counter is unchanged.

A weight is rounded (elementwise, then MX along one axis) once per optimizer
step and reused by every forward and backward that sees the same version, e.g.
all the batches of an evaluation pass. Only leaf tensors that require grad
(parameters) are cached; entries die with the parameter.
"""

from __future__ import annotations

import weakref

import torch

# id(tensor) -> (weak reference to it, version, {key: value}); a tensor's == is elementwise, so no WeakKeyDictionary
_CACHE: dict[int, tuple[weakref.ref, int, dict]] = {}


def cacheable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad


def cached(src: torch.Tensor, key: tuple, fn, version: int | None = None):
    """``fn()``, memoised on (``src``'s identity, its version, ``key``); ``version`` pins the expected version."""
    if not cacheable(src):
        return fn()
    ver = src._version
    if version is not None and version != ver:
        return fn()
    key_id = id(src)
    entry = _CACHE.get(key_id)
    if entry is None or entry[0]() is not src or entry[1] != ver:
        entry = (weakref.ref(src, lambda _, k=key_id, cache=_CACHE: cache.pop(k, None)), ver, {})
        _CACHE[key_id] = entry
    store = entry[2]
    if key not in store:
        store[key] = fn()
    return store[key]


def clear() -> None:
    _CACHE.clear()
