"""Per-module recipe state and quantizers: what a module casts its GEMM tensors with.

A module builds its quantizers (:class:`~mxtrain.modules._quantizer.Quantizer`) once per recipe
(:meth:`RecipeStateMixin.forward_quantizers`, Transformer Engine's ``make_quantizers()``) and keeps them
until the recipe (or the state they are bound to) changes: a forward looks up no spec.

Most recipes are stateless. A recipe that needs state per module (``DelayedScaling``: amax
histories and scales of the module's tensors) offers ``recipe.make_state()`` -> a fresh state
object, with ``state_dict()`` / ``load_state_dict(d)`` and an ``update(recipe)`` run once per
forward; the quantizers are then bound to it (each spec carries the state and its tensor's slot),
and the module's autograd ctx keeps them for backward.

:class:`RecipeStateMixin` gives a module that: :meth:`~RecipeStateMixin.forward_quantizers`
creates the state lazily on the first forward under such a recipe, runs its
per-step update and binds it; the state is saved in the module's state dict under
``<prefix>_extra_state`` (PyTorch's name for non-tensor module state) *only when
the module has one*, so modules that never ran a stateful recipe keep exactly
their torch counterpart's state-dict keys (and load ``nn.Linear`` checkpoints
strictly). Loading a state dict that carries one restores it, before any
forward, so a run resumes exactly.

Only training forwards change the state. A forward under ``torch.no_grad`` (evaluation)
and the recompute of activation checkpointing (any forward run while autograd runs a
backward, and :func:`mxtrain.checkpoint`'s recompute) cast with the current scales but
neither update the histories nor record amaxes: Transformer Engine likewise skips the
amax/scale update when grad is disabled (``autocast_exit`` checks ``torch.is_grad_enabled()``),
so evaluating between steps never changes training, and a recompute quantizes as its
forward did. Under :func:`mxtrain.checkpoint` the recompute uses the scales its forward
used even if the module ran another training forward in between.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import deque

import torch

import mxtrain.kernels.float8_state  # noqa: F401  (registers DelayedScaling's update and record ops)
from mxtrain.modules._common import recipe_generator
from mxtrain.modules._quantizer import delayed_slots, make_quantizers

__all__ = ["RecipeStateMixin", "EXTRA_STATE_KEY", "STATE_TYPES", "recipe_state_modules", "recipe_states",
           "load_recipe_states"]

EXTRA_STATE_KEY = "_extra_state"
_ATTR = "_mxtrain_recipe_state"
_QUANTIZERS = "_mxtrain_quantizers"  # the quantizers of the last recipe (and state binding) this module ran
_UNPLACED = "_mxtrain_recipe_state_unplaced"  # set by a load: place the state on the next update
_KEY = "_mxtrain_recipe_state_key"  # a tensor that leads a trace-time call back to its module (see _new_key)


def _state_types() -> dict:
    from mxtrain.quantization.float8 import DelayedScalingState
    return {DelayedScalingState.kind: DelayedScalingState}


STATE_TYPES = _state_types()  # state_dict()["kind"] -> class with from_state_dict(d)


class RecipeStateMixin:
    """Mix into an ``nn.Module`` (before the torch base) to give it per-module recipe state."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._take_own_key()

    def __setstate__(self, state) -> None:  # a copy (deepcopy, pickle) gets its own key
        super().__setstate__(state)
        self._take_own_key()

    def _take_own_key(self) -> None:
        """Give this module the key a trace finds it by (see ``_new_key``); a module built from another's
        ``__dict__`` (``mxtrain.convert``'s recipe pinning) must call it."""
        self.__dict__[_KEY] = _new_key(self)

    @property
    def recipe_state(self):
        """The recipe state this module keeps (None until a stateful recipe has run or been loaded)."""
        return self.__dict__.get(_ATTR)

    def forward_quantizers(self, recipe, device: torch.device):
        """The quantizers this forward under ``recipe`` casts with, on ``device`` (the input's: the stochastic-
        rounding generator's); for DelayedScaling bound to this module's state (see module doc)."""
        make_state = getattr(recipe, "make_state", None)
        if make_state is None:
            return self._quantizers(recipe, None, device)
        if torch.compiler.is_compiling():
            return self._traced_forward_quantizers(recipe, device)
        state = self.__dict__.get(_ATTR)
        replay = _REPLAY.get()
        if replay is not None or not torch.is_grad_enabled() or in_backward():
            # evaluation or a recompute: cast with the scales of now (or of the forward being recomputed)
            scales, fresh = replay.popleft() if replay else (None, None)
            state = state if state is not None else make_state()
            if hasattr(state, "follow_recipe"):
                state.follow_recipe(recipe)
            return self._quantizers(recipe, FrozenState(state, scales, fresh), device)
        state = self._prepare_state(recipe)
        state.update(recipe)  # the previous step's amaxes enter the histories; new scales
        capture = _CAPTURE.get()
        if capture is not None:
            capture.append((state.scale.clone(), frozenset(s for s in state.slots if state.fresh(s))))
        return self._quantizers(recipe, state, device)

    def _quantizers(self, recipe, state, device: torch.device):
        """The quantizers of ``recipe`` bound to ``state`` (None: stateless): the ones this module built last
        while the recipe, the state and the generator are the same objects, else built now and kept. Not kept:
        those bound to a frozen view (evaluation, recompute: one per forward) and those built while
        torch.compile traces (the graph keeps what it needs)."""
        gen = recipe_generator(recipe, device)
        if torch.compiler.is_compiling() or isinstance(state, FrozenState):
            return make_quantizers(recipe, state, self.recipe_state_gemms(), gen)
        kept = self.__dict__.get(_QUANTIZERS)
        if kept is not None and kept.recipe is recipe and kept.state is state and kept.generator is gen:
            return kept
        kept = self.__dict__[_QUANTIZERS] = make_quantizers(recipe, state, self.recipe_state_gemms(), gen)
        return kept

    def __getstate__(self):
        state = super().__getstate__()
        state.pop(_QUANTIZERS, None)  # rebuilt on the next forward (a generator does not pickle)
        state.pop(_KEY, None)  # made anew by __setstate__ (a weak reference does not pickle)
        return state

    def _traced_forward_quantizers(self, recipe, device: torch.device):
        """forward_quantizers while torch.compile traces: the state is made (and placed) for real at trace time
        (or at a graph break, where graphs may break), so that its tensors are the graph's inputs; the update is
        one registered op that mutates them. Nothing here guards on the module itself: layers compiled apart
        share their graphs."""
        if _ACTIVE_SETTINGS and _setting_entered_here():
            raise NotImplementedError(
                f"{type(recipe).__name__} under torch.compile inside mxtrain.checkpoint (its recompute replays the "
                "scales of the forward, kept on the host) cannot be compiled yet; compile the checkpointed function's "
                "callers without mxtrain.checkpoint, or run it eagerly")
        if not torch.is_grad_enabled() and self.__dict__.get(_ATTR) is None:
            # evaluation of a module that never trained: as eager, a state of this forward's own, kept nowhere
            # (read only: its tensors may be the graph's own)
            return self._quantizers(recipe, _evaluation_state(recipe, self.recipe_state_gemms(), device), device)
        if not _tracing_one_graph() and self.__dict__.get(_ATTR) is None:
            # a module without state yet: made eagerly at a graph break, so that the graph traced after it finds
            # a state, and the next such module (a sibling layer compiled apart) runs the same graphs, not a
            # recompile of its own (dynamo's guards would not find the state the trace made for the first one)
            _prepare_at_graph_break(self, recipe)
        # always, even for a state an eager step made. The reads of the module's __dict__ above found a state
        # or ended the graph: one that found none before this made it would leave dynamo a view without it
        _prepare_state_while_tracing(self, recipe)
        state = self.__dict__[_ATTR]
        # the slots without history, read on the host while tracing: dynamo guards on the state's host-side
        # record of them, so the first step's graph (their casts take the scale from the tensor cast, as an
        # eager first step's do) is traced again, without, once the update has seasoned them
        fresh = state.unseasoned() if hasattr(state, "unseasoned") else frozenset()
        if not torch.is_grad_enabled():  # evaluation: cast with the scales of now, record nothing
            return self._quantizers(recipe, FrozenState(state, None, fresh), device)
        state.update(recipe)
        return self._quantizers(recipe, FirstStepState(state, fresh) if fresh else state, device)

    def gather_quantizers(self, recipe, gemm: str = "", *, update: bool = True):
        """The quantizers (:class:`~mxtrain.modules._quantizer.GemmQuantizers`) an FSDP2 pre-all-gather casts
        this module's weight of GEMM ``gemm`` with ("" for a one-GEMM module, "fc1" / "fc2" for
        LayerNormMLP), bound to this module's state.

        ``update``: ahead of the forward (or its recompute): the forward's update happens here (its own
        update then finds nothing new), without a scale snapshot for :func:`mxtrain.checkpoint`; in a
        recompute the state is only read. FSDP2 gathers under no_grad, so an evaluation forward's gather
        cannot be told from a training one's: it applies the pending update (amaxes recorded by earlier
        training steps) that the next training forward would apply, and the evaluation itself records
        nothing. Without ``update`` (backward) the state is only read, and None is returned when the module
        has none yet."""
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"{type(recipe).__name__}: FSDP2's all-gather of weights cast with the module's delayed scales "
                "cannot be compiled yet; run the FSDP2 model eagerly or use Float8CurrentScaling")
        state = self.__dict__.get(_ATTR)
        if not update:
            return None if state is None else make_quantizers(recipe, state, (gemm,))[gemm]
        if _REPLAY.get() is not None or in_backward():
            frozen = FrozenState(state if state is not None else recipe.make_state())
            return make_quantizers(recipe, frozen, (gemm,))[gemm]
        # made (on the parameters' device: NCCL all-reduces no CPU tensor), placed, and its slots made, as a
        # training forward does
        state = self._prepare_state(recipe)
        state.update(recipe)
        return make_quantizers(recipe, state, (gemm,))[gemm]

    def recipe_state_gemms(self) -> tuple[str, ...]:
        """The names this module's GEMMs have in its recipe state ("" for a one-GEMM module, "fc1" / "fc2" for
        LayerNormMLP, "expert<i>" for GroupedLinear): their slots are made at the start of a forward."""
        # read from the instance's dicts: a missing attribute is an nn.Module __getattr__ miss (an exception), which
        # torch.compile guards with a hasattr check on every call of a compiled block
        n = self.__dict__.get("num_gemms")
        if isinstance(n, int):
            return tuple(f"expert{e}" for e in range(n))
        params = self.__dict__.get("_parameters", {})
        if "fc1_weight" in params and "fc2_weight" in params:
            return ("fc1", "fc2")
        return ("",)

    def _prepare_state(self, recipe):
        """This module's state for a training forward under ``recipe``: made if it has none (on the parameters'
        device), a loaded one placed, its history resized, and the slots of all its GEMMs made, in GEMM order
        (so an eager and a compiled run lay out the same state)."""
        state = self.__dict__.get(_ATTR)
        if state is None:
            state = self.__dict__[_ATTR] = recipe.make_state()
            self._follow_device(state)
        self._place_loaded_state(state)
        state.resize_history(recipe.amax_history_len)
        for gemm in self.recipe_state_gemms():
            state._ensure_slots(delayed_slots(recipe, gemm), state.scale.device)
        return state

    def _place_loaded_state(self, state) -> None:
        """Once after a load: move the loaded state to the parameters' device (the model may have moved since
        the load). A state this process made needs nothing: its tensors are made where the casts run."""
        if self.__dict__.pop(_UNPLACED, False):
            self._follow_device(state)

    def _follow_device(self, state) -> None:
        """Move ``state`` to the device of this module's parameters (a state loaded from a checkpoint sits on
        the CPU), so that its update runs where the uninterrupted run's does: same kernels, same bits."""
        p = next(self.parameters(), None)
        if p is not None and p.device.type != "meta" and hasattr(state, "to"):
            state.to(p.device)

    def reset_recipe_state(self) -> None:
        """Forget the recipe state (histories, scales); the next forward starts afresh."""
        self.__dict__.pop(_ATTR, None)
        self.__dict__.pop(_QUANTIZERS, None)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        state = self.__dict__.get(_ATTR)
        if state is not None:
            destination[prefix + EXTRA_STATE_KEY] = state.state_dict()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + EXTRA_STATE_KEY
        if key in state_dict:
            d = state_dict[key]
            cls = STATE_TYPES.get(d.get("kind")) if isinstance(d, dict) else None
            if cls is None:
                error_msgs.append(f"{key}: not an mxtrain recipe state (expected a dict with 'kind' in "
                                  f"{sorted(STATE_TYPES)})")
            else:
                state = self.__dict__[_ATTR] = cls.from_state_dict(d)
                self._follow_device(state)
                self.__dict__[_UNPLACED] = True
            # torch would report the key as unexpected: this class does not override set_extra_state
            # (so that modules without state need no such key when loading strictly)
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


# mxtrain.checkpoint: the scales each training forward of a checkpointed function cast with (in call order),
# and, during its recompute, the same queue being replayed
_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("mxtrain_capture_scales", default=None)
_REPLAY: contextvars.ContextVar = contextvars.ContextVar("mxtrain_replay_scales", default=None)


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread: a module forward then is a recompute."""
    return torch._C._current_graph_task_id() != -1


class FrozenState:
    """A recipe state as a forward sees it that must not change it: casts read its scales (``scales``, a
    snapshot, when given: slots created after it have scale 1, as every new slot does) and record nothing.
    ``fresh``: the slots that had no history when the snapshot was taken (default: the state's now); their
    casts take the scale from the tensor cast, and a recompute sees the tensor its forward saw."""

    def __init__(self, state, scales: torch.Tensor | None = None, fresh: frozenset | None = None) -> None:
        self.state, self.scales, self.fresh_slots = state, scales, fresh

    def fresh(self, slot: str) -> bool:
        return self.state.fresh(slot) if self.fresh_slots is None else slot in self.fresh_slots

    def scale_for(self, slot: str, fmt: str, device: torch.device, **tensor) -> torch.Tensor:
        i = self.state.index(slot, fmt, device)
        snap = None if self.scales is None else (
            self.scales[i].to(device) if i < self.scales.numel() else torch.ones((), device=device))
        if tensor and self.fresh(slot):
            return self.state.first_scale(slot, fmt, device, previous=snap, **tensor)
        return self.state.scale_for(slot, fmt, device) if snap is None else snap

    def record(self, slot: str, amax: torch.Tensor) -> None:
        pass

    @property
    def updates(self) -> int:
        return self.state.updates

    @property
    def eager_updates(self) -> int:
        return self.state.eager_updates

    @property
    def amax_reduction_group(self):
        """The underlying state's amax reduction group (see ``DelayedScalingState.amax_reduction_group``)."""
        return self.state.amax_reduction_group

    # two frozen views of one state with the same scales are the same state to a role spec: FSDP2's
    # pre-gather and the module's own (recomputed) forward each make one, and their specs must agree
    def __eq__(self, other) -> bool:
        return type(other) is FrozenState and other.state is self.state and other.scales is self.scales

    def __hash__(self) -> int:
        return hash((id(self.state), id(self.scales)))


class FirstStepState(FrozenState):
    """A compiled training forward's view of a state whose slots ``fresh`` have no history yet: those casts take
    the scale from the tensor cast (:meth:`FrozenState.scale_for`), every cast records its amax into the state."""

    def __init__(self, state, fresh: frozenset) -> None:
        super().__init__(state, None, fresh)

    @property
    def first_step_of(self):
        """The state this view sees the first compiled step of: its casts are that state's (FSDP2's gathered
        codes, cast with the state itself, serve them)."""
        return self.state

    def record(self, slot: str, amax: torch.Tensor) -> None:
        self.state.record(slot, amax)

    def __eq__(self, other) -> bool:
        return type(other) is FirstStepState and other.state is self.state and other.fresh_slots == self.fresh_slots

    def __hash__(self) -> int:
        return hash((id(self.state), self.fresh_slots))


def capture_scales(queue: deque):
    """Context: training forwards append the scales they cast with to ``queue`` (see :func:`replay_scales`)."""
    return _setting(_CAPTURE, queue)


def replay_scales(queue: deque):
    """Context: forwards take their scales from ``queue`` in order and leave recipe state untouched."""
    return _setting(_REPLAY, deque(queue))


# how many capture / replay contexts this context (thread, task) has entered
_SETTINGS_HERE: contextvars.ContextVar = contextvars.ContextVar("mxtrain_recipe_settings", default=0)
# how many are entered in the whole process, as a plain list that torch.compile can read and guard on (a
# ContextVar it can do neither): a trace that finds one asks _setting_entered_here() whether it is its own
_ACTIVE_SETTINGS: list = []


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
    token, here = var.set(value), _SETTINGS_HERE.set(_SETTINGS_HERE.get() + 1)
    _ACTIVE_SETTINGS.append(var)
    try:
        yield
    finally:
        _ACTIVE_SETTINGS.pop()
        _SETTINGS_HERE.reset(here)
        var.reset(token)


@torch.compiler.assume_constant_result
def _setting_entered_here() -> bool:
    """Whether the calling context is inside a capture / replay context (read for real while tracing: dynamo
    cannot read a ContextVar; its guard on ``_ACTIVE_SETTINGS`` retraces when any thread enters or leaves one)."""
    return _SETTINGS_HERE.get() > 0


def _evaluation_state(recipe, gemms, device: torch.device) -> FrozenState:
    """What an evaluation forward of a module without state casts with: a fresh state (every slot without
    history: its casts take the scale from the tensor), viewed frozen; the module keeps none, as in eager."""
    state = recipe.make_state()
    if hasattr(state, "follow_recipe"):
        state.follow_recipe(recipe)
    for gemm in gemms:
        state._ensure_slots(delayed_slots(recipe, gemm), device)
    return FrozenState(state, None, frozenset(state.slots))


def _new_key(module) -> torch.Tensor:
    """An empty meta tensor that refers back to ``module``: what a trace hands to :func:`_prepare_by_key`. Dynamo
    passes a tensor to such a function as itself and guards it as a tensor (dtype, shape), the same for every
    module; the module itself (or its id) it would guard by identity: one recompile per module."""
    key = torch.empty(0, device="meta")
    key._mxtrain_module = weakref.ref(module)
    return key


def _prepare_state_while_tracing(module, recipe) -> None:
    """Runs for real while torch.compile traces ``module``'s forward, before the trace reads the state:
    :meth:`RecipeStateMixin._prepare_state` (a tensor the compiled graph made could not be written by its
    backward, where gradients' amaxes are recorded). Older dynamo (torch 2.11) passes only constants and tensors
    to such a function: the module goes by its key tensor, the recipe by id (alive while the trace runs)."""
    key = getattr(module, _KEY, None)  # not via __dict__: see _traced_forward_quantizers
    if key is None:  # a module built without __init__ (and without _take_own_key): correct, one graph per module
        _prepare_by_id(id(module), id(recipe))
    else:
        _prepare_by_key(key, id(recipe))


@torch.compiler.assume_constant_result
def _prepare_by_key(key: torch.Tensor, recipe_id: int) -> bool:
    import ctypes
    module = key._mxtrain_module()
    if module is None or module.__dict__.get(_KEY) is not key:
        raise RuntimeError("mxtrain: a recipe-state key that leads to no live module reached a trace; the module "
                           "was copied or rebuilt without RecipeStateMixin.__init__/__setstate__")
    module._prepare_state(ctypes.cast(recipe_id, ctypes.py_object).value)
    return True


@torch.compiler.assume_constant_result
def _prepare_by_id(module_id: int, recipe_id: int) -> bool:
    import ctypes
    module, recipe = (ctypes.cast(i, ctypes.py_object).value for i in (module_id, recipe_id))
    module._prepare_state(recipe)
    return True


@torch.compiler.disable
def _prepare_at_graph_break(module, recipe) -> None:
    module._prepare_state(recipe)


@torch.compiler.assume_constant_result
def _tracing_one_graph() -> bool:
    """Whether the function torch.compile traces now may not break its graph (``fullgraph=True``, or graph breaks
    made errors); read for real while tracing. True where it cannot be told: never break then."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        return bool(tx.one_graph or getattr(tx, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001  (a private API of dynamo: without it, keep the graph whole)
        return True


# wrappers whose attribute name torch's distributed state dicts leave out of parameter names
_WRAPPER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _state_modules(model) -> dict:
    """``{name: module}`` of the modules that can keep recipe state, named as their parameters are in
    ``get_state_dict`` (without torch.compile / checkpoint / FSDP1 wrapper segments), so that a model saved
    compiled loads into the plain one."""
    return {".".join(p for p in name.split(".") if p not in _WRAPPER_NAMES): m
            for name, m in model.named_modules() if isinstance(m, RecipeStateMixin)}


def recipe_state_modules(model) -> list[str]:
    """Names (as the model's state-dict keys name them) of the modules in ``model`` that can keep recipe state."""
    return list(_state_modules(model))


def init_recipe_state(model, recipe=None) -> list[str]:
    """Make the recipe state of every module of ``model`` that keeps one, as its first training forward under
    ``recipe`` (default: the active ``mx_autocast`` recipe) would make it: on the parameters' device, every
    GEMM's slots, no history yet. Returns the names of the modules given a state ([] for a recipe without
    state: only DelayedScaling keeps one).

    A compiled forward makes a missing state while it is traced; layers compiled apart with ``fullgraph=True``
    cannot break their graph to make it first, so each such layer was traced again for its own first step
    (past dynamo's ``recompile_limit``, an error). Called before the first step, the layers share one graph
    from the start. Training gives the same bits with or without this call."""
    from mxtrain.autocast import get_recipe

    recipe = get_recipe() if recipe is None else recipe
    if recipe is None:
        raise ValueError("init_recipe_state: no recipe given and no mx_autocast recipe active")
    if getattr(recipe, "make_state", None) is None:
        return []
    modules = _state_modules(model)
    for module in modules.values():
        module._prepare_state(recipe)
    return list(modules)


def recipe_states(model) -> dict:
    """``{module name: state_dict()}`` of every module of ``model`` that keeps recipe state now."""
    return {name: m.recipe_state.state_dict() for name, m in _state_modules(model).items()
            if m.recipe_state is not None}


def load_recipe_states(model, states: dict) -> None:
    """Give each recipe-state module of ``model`` its entry of ``states`` (from :func:`recipe_states`),
    created if the module has none yet; modules without an entry forget theirs. Raises on names or
    kinds ``model`` cannot take, before changing any module."""
    modules = _state_modules(model)
    unknown = sorted(set(states) - set(modules))
    if unknown:
        raise ValueError(f"recipe state saved for modules this model lacks: {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}")
    built = {}
    for name, d in states.items():
        cls = STATE_TYPES.get(d.get("kind")) if isinstance(d, dict) else None
        if cls is None:
            raise ValueError(f"recipe state of {name!r}: not an mxtrain recipe state (expected a dict with "
                             f"'kind' in {sorted(STATE_TYPES)})")
        built[name] = cls.from_state_dict(d)
    for name, m in modules.items():
        if name in built:
            m.__dict__[_ATTR] = built[name]
            m._follow_device(built[name])
            m.__dict__[_UNPLACED] = True
        else:
            m.reset_recipe_state()
