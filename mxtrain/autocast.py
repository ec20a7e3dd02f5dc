"""``mx_autocast``: turn a recipe on for the code inside a ``with`` block or a decorated function.

The active recipe lives in a :class:`contextvars.ContextVar`, so it is local to the
current thread and asyncio task:

* Nesting: the innermost ``mx_autocast`` wins and the outer one is restored on
  exit, also when the block raises. ``mx_autocast(enabled=False)`` inside an
  enabled block turns MX off for its body.
* Threads: a ``threading.Thread`` starts with an empty context, so it does **not**
  see an ``mx_autocast`` that was active where it was started; open one inside the
  thread (``with mx_autocast(recipe=parent_recipe):``) or run the thread's target
  in a copy of the caller's context (``contextvars.copy_context().run``, which is
  what ``asyncio.to_thread`` does). (Free-threaded Python 3.14+ builds copy the
  caller's context into new threads by default, so there a thread does see it.)
* asyncio: a task copies the context when it is created, so it sees the
  autocast active there, and its own ``mx_autocast`` does not leak into others.
* Backward: autograd runs backward outside the ``with`` block, often on another
  thread. Modules therefore call :func:`get_recipe` in forward and keep the
  recipe on their autograd ctx; backward uses that, never the current state.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from typing import Callable, TypeVar

import torch

from mxtrain.recipes import MXFP8Recipe, Recipe

__all__ = ["mx_autocast", "get_recipe", "is_autocast_enabled"]

_F = TypeVar("_F", bound=Callable)

# Recipes are immutable, so every mx_autocast() without a recipe can share one.
_DEFAULT_RECIPE = MXFP8Recipe()


class _Frame:
    """One entered ``mx_autocast``: its recipe (None = disabled) and how to undo it."""

    __slots__ = ("recipe", "owner", "token", "outer")

    def __init__(self, recipe: Recipe | None, owner: "mx_autocast") -> None:
        self.recipe = recipe
        self.owner = owner
        self.token: contextvars.Token | None = None
        self.outer: _Frame | None = None  # this thread's mirror before this entry


# Keeping the reset token in the frame (not on the mx_autocast object) makes one
# mx_autocast object safe to enter again while already entered, and from several
# threads at once: each entry's undo information lives in its own context.
_ACTIVE_FRAME: contextvars.ContextVar[_Frame | None] = contextvars.ContextVar(
    "mxtrain_mx_autocast_frame", default=None)

# Recipes of the mx_autocast blocks entered inside a function torch.compile is tracing: dynamo cannot trace
# ContextVar.set, but it follows (and replays) a list's appends and pops, so get_recipe() sees them while tracing.
_TRACED_RECIPES: list = []

# This thread's innermost eager frame, mirrored from _ACTIVE_FRAME for torch.compile: dynamo cannot read a
# ContextVar (a graph break in every module when mx_autocast is entered outside the compiled function), but it
# reads a threading.local's attribute and guards on it. Eager code reads the ContextVar only; the mirror can
# differ from it only in a context copied to another thread or in interleaved asyncio tasks, while compiling.
_THREAD_FRAME = threading.local()


class mx_autocast:
    """Run MX-aware modules with ``recipe`` inside a ``with`` block, or for every call of a function.

    Args:
        enabled: bool. False turns MX off for the block, also inside an enabled
            ``mx_autocast``; ``recipe`` is then checked but not used, so
            ``mx_autocast(enabled=args.mx, recipe=recipe)`` works either way.
        recipe: a recipe instance (:class:`~mxtrain.recipes.MXFP8Recipe`,
            :class:`~mxtrain.recipes.MXRecipe`, ...). None with ``enabled=True``
            means ``MXFP8Recipe()``.

    ``with mx_autocast(...) as recipe:`` binds the active recipe (None when disabled).
    As a decorator, ``@mx_autocast(recipe=r)`` enters a fresh context on every call,
    so recursive and concurrent calls are safe. (A decorated generator function
    gets the recipe only while the generator is created, not while it runs.)

    See the module docstring for threads and for how modules use the recipe in backward.
    """

    def __init__(self, enabled: bool = True, recipe: Recipe | None = None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"mx_autocast(enabled=...) must be a bool, got {type(enabled).__name__} {enabled!r}")
        if recipe is not None and not isinstance(recipe, Recipe):
            hint = (" (to build one from a string use mxtrain.recipes.recipe_from_string)"
                    if isinstance(recipe, str) else "")
            raise TypeError("mx_autocast(recipe=...) must be a recipe instance such as MXFP8Recipe() "
                            f"or MXRecipe(...), or None; got {type(recipe).__name__} {recipe!r}{hint}")
        self.enabled = enabled
        # What get_recipe() returns inside this block.
        self.recipe: Recipe | None = (recipe if recipe is not None else _DEFAULT_RECIPE) if enabled else None

    def __enter__(self) -> Recipe | None:
        if torch.compiler.is_compiling():
            _TRACED_RECIPES.append(self.recipe)
            return self.recipe
        frame = _Frame(self.recipe, self)
        frame.token = _ACTIVE_FRAME.set(frame)
        frame.outer = getattr(_THREAD_FRAME, "frame", None)
        _THREAD_FRAME.frame = frame
        return self.recipe

    def __exit__(self, exc_type, exc, tb) -> bool:
        if torch.compiler.is_compiling():
            _TRACED_RECIPES.pop()
            return False
        frame = _ACTIVE_FRAME.get()
        if frame is None or frame.owner is not self:
            # Only reachable by calling __enter__/__exit__ by hand, out of order.
            raise RuntimeError("mx_autocast exited out of order: the innermost active "
                               "mx_autocast is not this one")
        _ACTIVE_FRAME.reset(frame.token)
        if getattr(_THREAD_FRAME, "frame", None) is frame:
            _THREAD_FRAME.frame = frame.outer
        return False  # never swallow the exception

    def __call__(self, func: _F) -> _F:
        if not callable(func):
            raise TypeError(f"mx_autocast(...) decorates a callable, got {type(func).__name__}")
        enabled, recipe = self.enabled, self.recipe

        @functools.wraps(func)
        def run_with_recipe(*args, **kwargs):
            with mx_autocast(enabled=enabled, recipe=recipe):
                return func(*args, **kwargs)

        return run_with_recipe  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"mx_autocast(enabled={self.enabled}, recipe={self.recipe!r})"


def get_recipe() -> Recipe | None:
    """The recipe of the innermost active ``mx_autocast`` in this context, or None when MX is off."""
    if torch.compiler.is_compiling():
        if _TRACED_RECIPES:
            return _TRACED_RECIPES[-1]
        frame = getattr(_THREAD_FRAME, "frame", None)
        return None if frame is None else frame.recipe
    frame = _ACTIVE_FRAME.get()
    return None if frame is None else frame.recipe


def is_autocast_enabled() -> bool:
    """True inside an enabled ``mx_autocast`` (and not inside a nested disabled one)."""
    return get_recipe() is not None
