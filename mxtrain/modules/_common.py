"""Pieces shared by the module autograd functions: saved operands, elementwise rounding, seeds, the weight-cast cache."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mxtrain import config
from mxtrain.quantization import quantize_elemwise
from mxtrain.recipes.recipe import MXRecipeBase

_GENERATORS: dict[tuple[int, torch.device], torch.Generator] = {}


def recipe_generator(recipe, device: torch.device) -> torch.Generator | None:
    """One generator per (recipe seed, device), advanced call after call: reproducible runs.
    None (torch's global RNG) for an MX recipe without a seed and for FP8 recipes (no stochastic rounding)."""
    if not isinstance(recipe, MXRecipeBase) or recipe.seed is None:
        return None
    if torch.compiler.is_compiling():
        raise NotImplementedError("an MX recipe with a seed (stochastic rounding with a torch.Generator) cannot "
                                  "be compiled yet; use seed=None (torch's global RNG) or run it eagerly")
    key = (recipe.seed, device)
    gen = _GENERATORS.get(key)
    if gen is None:
        gen = _GENERATORS[key] = torch.Generator(device=device)
        gen.manual_seed(recipe.seed)
    return gen


def generator_states() -> list[dict]:
    """The state of every stochastic-rounding generator of this process (for checkpoints)."""
    return [{"seed": seed, "device": str(device), "state": gen.get_state()}
            for (seed, device), gen in _GENERATORS.items()]


def set_generator_states(states: list[dict]) -> None:
    """Restore generators saved by :func:`generator_states` (created if this process has none yet);
    generators of seeds not in ``states`` start afresh from their seed, as in a new process. In place:
    an autograd graph alive now keeps drawing from the same generator objects."""
    restored = set()
    for entry in states:
        key = (int(entry["seed"]), torch.device(entry["device"]))
        if key[1].type == "cuda" and (not torch.cuda.is_available() or (key[1].index or 0) >= torch.cuda.device_count()):
            warnings.warn(f"stochastic-rounding generator of seed {key[0]} on {key[1]} not restored: this process has "
                          "no such device, so its stochastic rounding starts afresh from the seed", stacklevel=2)
            continue
        gen = _GENERATORS.get(key)
        if gen is None:
            gen = _GENERATORS[key] = torch.Generator(device=key[1])
        gen.set_state(entry["state"])
        restored.add(key)
    for key, gen in _GENERATORS.items():
        if key not in restored:
            gen.manual_seed(key[0])


class _WeightCastCache:
    """Weight casts kept inside :func:`weight_cast_cache`: (weight, specs, at_once) -> (weakref, (version, address), planes)."""

    def __init__(self):
        self.depth, self.entries = 0, {}


_WEIGHT_CASTS = _WeightCastCache()


@contextlib.contextmanager
def weight_cast_cache():
    """Cast each weight once and reuse its quantized planes until the weight changes (gradient accumulation).

    Inside the context a module's weight planes (forward and backward) are kept after their first
    cast and reused while the parameter is the same object with the same version counter and
    storage, and no ``torch.optim`` optimizer has stepped: an optimizer step or any in-place change recasts
    it, as Transformer Engine's ``is_first_microbatch`` does by hand. Writes through ``p.data`` outside an
    optimizer are invisible to the version counter: leave the context before making them. Results are
    bit-identical to casting every time. Under plain FSDP2 (no quantized all-gather) the cached planes of
    every layer stay alive through the step. Not cached:
    stochastically rounded weights, DelayedScaling (its scale moves every forward), FSDP2-gathered
    MX planes (they arrive cast), and casts under ``torch.compile`` or CUDA-graph capture. The planes
    are freed when the outermost context exits; wrap one optimizer step's microbatches::

        for step in range(steps):
            with mxtrain.weight_cast_cache():
                for micro in batches[step]:
                    loss_fn(model(micro)).backward()
            opt.step(); opt.zero_grad()
    """
    _WEIGHT_CASTS.depth += 1
    # an optimizer that writes through ``p.data`` leaves the version counter alone: any step drops the casts
    hook = register_optimizer_step_post_hook(lambda *_: _WEIGHT_CASTS.entries.clear())
    try:
        yield
    finally:
        hook.remove()
        _WEIGHT_CASTS.depth -= 1
        if _WEIGHT_CASTS.depth == 0:
            _WEIGHT_CASTS.entries.clear()


# On CUDA, planes that a GEMM consumes right away are written by the cast as their dequantized
# bf16 values, without codes (the GEMM then runs no dequantize pass): every rowwise (axis 1)
# operand (fprop input and weight, dgrad grad-output: never kept for backward by any module),
# a weight's columnwise plane (dgrad weight: quantized in backward, used at once) and every plane
# a backward casts (``at_once``: the gradients' wgrad planes, a recomputed activation's). The
# columnwise planes a forward keeps for backward (wgrad inputs) keep their codes (1 byte each).
# Only for bf16 tensors, whose MX values are all exact in bf16 (so the values serve a GEMM in
# any dtype); elsewhere, and always on the CPU, nothing changes. MXTRAIN_CARRY_VALUES=0 turns it off.


def _used_at_once(t2d: torch.Tensor, axes, at_once: bool = False) -> tuple[int, ...]:
    """The axes among ``axes`` whose planes are cast straight to dequantized values (see ``config.current().carry_values``)."""
    if not config.current().carry_values or t2d.device.type != "cuda" or t2d.dtype != torch.bfloat16 or t2d.ndim != 2:
        return ()
    from mxtrain.kernels.gemm import native_mx_gemm

    if native_mx_gemm(t2d.device):  # sm_100+: the GEMM reads the codes on block-scaled tensor cores
        return ()
    return tuple(a for a in axes if at_once or a % 2 == 1 or isinstance(t2d, torch.nn.Parameter))


def save_for_backward(ctx, *tensors: torch.Tensor | None, **operands) -> None:
    """``ctx.save_for_backward(*tensors)`` plus the tensors inside quantized operands (``MXTensor``,
    ``Float8Tensor``: codes, scales, values), so that whatever governs saved tensors governs them too:
    activation checkpointing frees them after the forward and recomputes them, saved-tensor hooks
    (CPU offload) see them. Only their structure stays on ``ctx``. Read back with :func:`saved_tensors`."""
    flat: list = []
    # eager: the field names of each operand type from a cache (dataclasses.fields builds them per call);
    # traced: not read nor written (dynamo would guard on the cache's contents)
    names = _field_names if torch.compiler.is_compiling() else _cached_field_names
    ctx.mx_operand_layout = (len(tensors), {name: _flatten(op, flat, names) for name, op in operands.items()})
    ctx.save_for_backward(*tensors, *flat)


def saved_tensors(ctx) -> tuple[list, dict]:
    """``(tensors, operands)`` as given to :func:`save_for_backward` (operands rebuilt around the saved tensors)."""
    saved = ctx.saved_tensors
    n, layout = ctx.mx_operand_layout
    return list(saved[:n]), {name: _unflatten(node, saved, n) for name, node in layout.items()}


def _field_names(obj) -> tuple[str, ...] | None:
    """The field names of a dataclass instance, or None for anything else."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return tuple(f.name for f in dataclasses.fields(obj))
    return None


_FIELD_NAMES: dict = {}


def _cached_field_names(obj) -> tuple[str, ...] | None:
    cls = type(obj)
    try:
        return _FIELD_NAMES[cls]
    except KeyError:
        names = _FIELD_NAMES[cls] = _field_names(obj)
        return names


_PLAIN = frozenset((int, float, bool, str, type(None)))


def _flatten(obj, flat: list, field_names=_field_names):
    if isinstance(obj, torch.Tensor):
        flat.append(obj)
        return ("t", len(flat) - 1)
    if isinstance(obj, tuple):
        for o in obj:
            if type(o) not in _PLAIN:
                return ("tuple", tuple(_flatten(o, flat, field_names) for o in obj))
        return ("v", obj)  # a shape or a block: kept whole (a node per element cost a call each, twice)
    if obj is None or isinstance(obj, (str, int, float, torch.dtype, torch.device)):
        return ("v", obj)  # before the dataclass test: dynamo (torch 2.11) cannot trace hasattr on torch.dtype
    names = field_names(obj)
    if names is not None:
        return ("dc", type(obj), {name: _flatten(getattr(obj, name), flat, field_names) for name in names})
    return ("v", obj)


def _unflatten(node, saved, offset: int):
    kind, body = node[0], node[1]
    if kind == "t":
        return saved[offset + body]
    if kind == "tuple":
        return tuple(_unflatten(n, saved, offset) for n in body)
    if kind == "dc":
        return body(**{name: _unflatten(n, saved, offset) for name, n in node[2].items()})
    return body


def free_operand(op) -> None:
    """Free, mid-backward, the codes of a quantized operand a forward (or this backward) cast from an
    activation and this backward has used for the last time (see :func:`free_saved`); its scales are left
    alone. Codes are the cast's own buffer (possibly seen through a view), never a caller's tensor."""
    if torch.compiler.is_compiling():
        return
    for plane in getattr(op, "planes", ()):
        t = plane.data
        if t.untyped_storage().nbytes() == t.numel() * t.element_size():
            t.untyped_storage().resize_(0)


def release_mx_operands(ctx, *names: str) -> None:
    """Mark ``ctx``'s operands as used by its backward (and drop any ``names`` kept on it): backward frees
    operand memory in place (:func:`free_operand`, :func:`free_saved`), so the flag turns a second
    backward through the same graph into a clear error."""
    for name in names:
        setattr(ctx, name, None)
    ctx.mx_operands_released = True


def free_saved(*tensors: torch.Tensor | None) -> None:
    """Free, mid-backward, the memory of intermediates a forward saved and this backward has used for the
    last time (LayerNormMLP's fc1 output ``h`` once the activation gradient is cast): their storage
    shrinks to nothing, as Transformer Engine's backward does with its saved activations. Autograd
    would otherwise keep them until the whole backward returns, through the peak that follows.

    Only for tensors the forward made itself (never a caller's input or an output); a second backward
    through the same graph raises first (:func:`check_mx_operands`). Under ``torch.compile`` nothing is
    freed (the compiled graph owns its buffers)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None and t._base is None and t.untyped_storage().nbytes() == t.numel() * t.element_size():
            t.untyped_storage().resize_(0)


def empty_batch_forward(ctx, inputs: tuple, out):
    """Forward of a zero-token batch: return ``out`` (the empty result torch's layer gives) without
    quantizing anything (an empty tensor has no amax to record) and note the inputs' shapes for
    :func:`empty_batch_backward`."""
    ctx.empty_batch = tuple((t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in inputs)
    return out


def empty_batch_backward(ctx) -> tuple | None:
    """Gradients of a zero-token forward, as torch gives them: zeros shaped and typed as each input
    that needs one (weights and biases: all-zero; the input: empty). None for any other forward."""
    shapes = getattr(ctx, "empty_batch", None)
    if shapes is None:
        return None
    return tuple(torch.zeros(s[0], dtype=s[1], device=s[2]) if s is not None and need else None
                 for s, need in zip(shapes, ctx.needs_input_grad))


class _NoDoubleBackward(torch.autograd.Function):
    """Passes gradients through; differentiating them raises (see :func:`once_differentiable`)."""

    @staticmethod
    def forward(ctx, message, *grads):
        ctx.message = message
        return grads

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


def once_differentiable(module: str):
    """Decorate an mxtrain autograd Function's ``backward``: it runs without building a graph, and
    under ``create_graph=True`` its gradients carry a node that raises a clear error when they are
    differentiated in turn (double backward: quantized GEMMs and rounding have no useful second
    derivative). A first-order ``create_graph=True`` backward still gives the usual gradients.
    ``torch.autograd.function.once_differentiable``, with a message that names the module."""
    message = (f"double backward through mxtrain {module} is not supported: its backward runs quantized GEMMs "
               "(and rounding) that have no useful derivative. Compute second-order terms (gradient penalties, "
               "Hessian-vector products) outside mx_autocast, where the module is its torch counterpart")

    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not (torch.is_grad_enabled()
                    and any(isinstance(g, torch.Tensor) and g.requires_grad for g in grad_outputs)):
                return grads
            single = not isinstance(grads, tuple)
            grads = (grads,) if single else grads
            slots = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
            # detached leaves that require grad: the outputs then hang off the raising node
            tracked = _NoDoubleBackward.apply(message, *(grads[i].detach().requires_grad_() for i in slots))
            out = list(grads)
            for i, g in zip(slots, tracked):
                out[i] = g
            return out[0] if single else tuple(out)
        return wrapper
    return wrap


def check_mx_operands(ctx, module: str) -> None:
    if torch.compiler.is_compiling():  # a compiled backward frees nothing (free_operand), and is traced once
        return
    if getattr(ctx, "mx_operands_released", False):
        raise RuntimeError(
            f"Trying to backward through an mxtrain {module} a second time (retain_graph=True): its MX "
            "operands are released after the first backward to save memory; run the forward again instead")


def round_elemwise(t: torch.Tensor, recipe) -> torch.Tensor:
    """Round a norm/activation result to the recipe's elementwise precision (identity when unset).
    Stochastic rounding draws from the recipe's generator (:func:`recipe_generator`: seeded by
    ``recipe.seed``, shared with the GEMM operands' rounding), torch's global RNG when the seed is None."""
    if recipe is None or recipe.elemwise_format is None:
        return t
    rounding = recipe.elemwise_rounding
    gen = recipe_generator(recipe, t.device) if rounding == "stochastic" else None
    return quantize_elemwise(t, recipe.elemwise_format, rounding=rounding,
                             subnormals=recipe.elemwise_subnormals, seed=gen)


def autocast_boundary(x: torch.Tensor):
    """``(x, context)`` for a module running a recipe: under ``torch.autocast`` on ``x``'s device, ``x`` cast
    to the autocast dtype (the dtype torch's layer would return) and a context that turns autocast off for
    the module's own ops, whose operand dtypes the recipe fixes; elsewhere ``x`` and a null context.
    Parameters keep their dtype, and so do their gradients (as Transformer Engine's modules do)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, contextlib.nullcontext()
    return x.to(torch.get_autocast_dtype(device)), torch.autocast(device, enabled=False)


def check_input(x: torch.Tensor, features: int, name: str, what: str = "last dimension") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor input, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype == torch.float64:
        raise TypeError(f"{name} supports float32, bfloat16 and float16 inputs, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != features:
        raise ValueError(f"{name} expects inputs of shape [..., {features}], got {list(x.shape)} "
                         f"({what} must be {features})")


_WARNED_EAGER_GATHERED: set = set()


@torch.compiler.disable
def _apply_eagerly(fn, weights, why: str, *args):
    for w in weights:
        if hasattr(w, "mx_trace_next_gathers"):
            w.mx_trace_next_gathers()
    if why not in _WARNED_EAGER_GATHERED:
        _WARNED_EAGER_GATHERED.add(why)
        warnings.warn("torch.compile with FSDP2 quantized all-gathers (mxtrain.distributed."
                      f"enable_quantized_all_gather): this module runs its GEMM path eagerly, one graph break: {why}",
                      RuntimeWarning, stacklevel=2)
    return fn.apply(*args)


def apply_module_fn(fn, weights, *args):
    """``fn.apply(*args)`` for a module's autograd function. Under ``torch.compile``, a weight all-gathered by
    FSDP2 in MX / FP8 (``MXGatheredWeight``) is handed to ``fn`` as its traced stand-in (``mx_traced_weight``):
    dynamo takes the gathered subclass for a Python object, not a tensor, so passed as it is its gradient never
    left the graph (every GEMM weight of a compiled block got none). Where the stand-in cannot serve yet (a
    weight gathered for forward only: until its gathers carry both planes, from the next step on) or at all
    (DelayedScaling) the function runs eagerly (one graph break) with a warning naming why."""
    if not (torch.compiler.is_compiling() and any(hasattr(w, "mx_gathered_plane") for w in weights)):
        return fn.apply(*args)
    args = list(args)
    for w in weights:
        if not hasattr(w, "mx_gathered_plane"):
            continue
        traced = w.mx_traced_weight() if hasattr(w, "mx_traced_weight") else "an MXAllGatherWeight outside FSDP2"
        if isinstance(traced, str):
            return _apply_eagerly(fn, weights, traced, *args)
        for i in range(len(args)):
            if args[i] is w:
                args[i] = traced
    return fn.apply(*args)
