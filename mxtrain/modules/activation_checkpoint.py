"""``mxtrain.checkpoint``: activation checkpointing that recomputes exactly what the forward computed.

Like Transformer Engine's ``te.checkpoint``: the recompute runs under the recipe the forward ran
under (an ``mx_autocast`` around the call is no longer active when backward recomputes), casts
with the DelayedScaling scales its forward used, leaves recipe state untouched, and draws the
same stochastic-rounding bits as its forward (the generators are put back afterwards).
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from mxtrain.autocast import get_recipe, mx_autocast
from mxtrain.modules._common import generator_states, set_generator_states
from mxtrain.modules._recipe_state import capture_scales, replay_scales

__all__ = ["checkpoint"]


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its activations recomputed in backward instead of kept.

    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` underneath: every tensor the
    mxtrain modules save for backward (MX / FP8 operands included) is freed after the forward.
    The recipe active at the call (``get_recipe()``) is carried into the recompute, and so are the
    scales and generator states the forward used (see the module doc).
    """
    if not callable(fn):
        raise TypeError(f"mxtrain.checkpoint expects a callable first, got {type(fn).__name__}")
    recipe = get_recipe()
    delayed = getattr(recipe, "make_state", None) is not None  # DelayedScaling: a recipe with per-module state
    if delayed and _fsdp_quantized_gathers(fn):
        raise NotImplementedError(
            "mxtrain.checkpoint under DelayedScaling of a block whose weights FSDP2 all-gathers as FP8 codes "
            "(enable_quantized_all_gather) is not supported: its recompute casts at the forward's scales, which the "
            "backward gather does not carry. Checkpoint with torch.utils.checkpoint.checkpoint(..., "
            "use_reentrant=False) and open mx_autocast inside the checkpointed function, or gather in high "
            "precision; Float8CurrentScaling, Float8BlockScaling and the MX recipes work with mxtrain.checkpoint")
    if torch.compiler.is_compiling():
        if delayed:
            # DelayedScaling records amaxes into its state (side effects a traced checkpoint region refuses):
            # this region runs eagerly, with the contexts below (one graph break; fullgraph=True refuses it)
            return _eager_checkpoint(fn, *args, **kwargs)
        return _compiled_checkpoint(fn, *args, **kwargs)
    scales: deque = deque()
    generators: list = []

    @contextlib.contextmanager
    def forward_context():
        generators[:] = generator_states()  # the bits the forward draws from
        with capture_scales(scales):
            yield

    @contextlib.contextmanager
    def recompute_context():
        now = generator_states()
        set_generator_states(generators)
        try:
            with mx_autocast(enabled=recipe is not None, recipe=recipe), replay_scales(scales):
                yield
        finally:
            set_generator_states(now)  # backward goes on drawing where it was

    return _torch_checkpoint(fn, *args, use_reentrant=False,
                             context_fn=lambda: (forward_context(), recompute_context()), **kwargs)


def _compiled_checkpoint(fn, *args, **kwargs):
    """Under ``torch.compile``: torch's checkpoint, which dynamo traces into the graph (its ``context_fn`` takes
    only selective-checkpoint policies, so the contexts above cannot go in). The compiled backward recomputes
    the traced region from the forward's graph values: the recipe is the one the trace saw, a DelayedScaling
    cast's scale is the value its forward read, and a seeded stochastic rounding draws from the forward's
    seed, as the contexts above arrange for eager."""
    return _torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


@torch.compiler.disable
def _eager_checkpoint(fn, *args, **kwargs):
    return checkpoint(fn, *args, **kwargs)


def _fsdp_quantized_gathers(fn) -> bool:
    """Whether ``fn`` is a module with a weight that FSDP2 all-gathers quantized (``mxtrain.distributed``'s
    sharded weights answer ``mx_keep_dgrad_plane``; under FSDP2 they are a DTensor's local tensor)."""
    if not isinstance(fn, torch.nn.Module):
        return False
    return any(hasattr(getattr(p, "_local_tensor", p), "mx_keep_dgrad_plane") for p in fn.parameters())
