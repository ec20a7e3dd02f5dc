"""Pieces shared by the module autograd functions: role quantization, elementwise rounding, seeds."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mxtrain import config
from mxtrain.kernels.dispatch import quantize
from mxtrain.modules._float8 import quantize_float8_operand
from mxtrain.quantization import MXTensor, quantize_elemwise
from mxtrain.recipes.float8 import Float8RoleSpec
from mxtrain.recipes.recipe import MXRecipeBase, RoleSpec

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


def quantize_operand(t2d: torch.Tensor, specs_axes, generator,
                     at_once: bool = False) -> list["MXTensor | torch.Tensor"]:
    """Quantize a 2-D tensor for several (RoleSpec, axis) uses; identical specs share one call.

    A role whose format is None gets the tensor itself (high precision). A spec
    given for two axes produces both planes in one quantize call, which is what
    the one-pass rowwise+columnwise kernels do; each use then gets an MXTensor
    holding only its own plane. ``at_once``: every plane goes to a GEMM right away
    (backward's gradient operands), so on CUDA the cast may write all of them as
    values (see ``config.current().carry_values``).

    A weight all-gathered by FSDP2 in MX (``mxtrain.distributed``) carries the
    planes already: a use they serve gets them as they are, never quantized again.
    """
    if hasattr(t2d, "mx_gathered_plane"):
        return _gathered_operand(t2d, specs_axes, generator)
    key = _cache_key(t2d, specs_axes, at_once)
    if key is not None:
        hit = _WEIGHT_CASTS.entries.get(key)
        if hit is not None and hit[0]() is t2d and hit[1] == (t2d._version, t2d.data_ptr()):
            return list(hit[2])
    out = _quantize_operand(t2d, specs_axes, generator, at_once)
    if key is not None:
        _WEIGHT_CASTS.entries[key] = (weakref.ref(t2d), (t2d._version, t2d.data_ptr()), tuple(out))
    return out


def _quantize_operand(t2d: torch.Tensor, specs_axes, generator, at_once: bool) -> list:
    out: list = [None] * len(specs_axes)
    groups: list = []  # [(spec, uses)], grouped by identity: a spec holding a recipe state is not hashed (dynamo)
    for i, (spec, axis) in enumerate(specs_axes):
        if spec is None or spec.fmt is None:
            out[i] = t2d
        else:
            group = next((g for g in groups if g[0] is spec), None)
            if group is None:
                groups.append(group := (spec, []))
            group[1].append((i, axis))
    for spec, uses in groups:
        axes = tuple(dict.fromkeys(axis for _, axis in uses))
        if isinstance(spec, Float8RoleSpec):  # FP8 recipes: a Float8Tensor (data + scale_inv) per use
            fp8 = quantize_float8_operand(t2d, spec, axes)
            for i, axis in uses:
                out[i] = fp8.only(axis)
            continue
        now = _used_at_once(t2d, axes, at_once)
        extra = {} if not now else dict(dequantized=now, keep_codes=tuple(a for a in axes if a not in now))
        mx = quantize(t2d, spec.fmt, block_size=spec.block_size, axis=axes, scale_mode=spec.scale_mode,
                      rounding=spec.rounding, seed=generator, **extra)
        _hand_out(mx, uses, now, out)
    return out


class _WeightCastCache:
    """Weight casts kept inside :func:`weight_cast_cache`: (weight, uses) -> (weakref, (version, address), planes)."""

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


def _cache_key(t2d: torch.Tensor, specs_axes, at_once: bool):
    """The cache key of a weight cast, or None where it is not cached (see :func:`weight_cast_cache`)."""
    if not _WEIGHT_CASTS.depth or not isinstance(t2d, torch.nn.Parameter) or torch.compiler.is_compiling():
        return None
    if t2d.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    for spec, _ in specs_axes:
        # a stochastic cast draws afresh each time; a delayed-scaling one records the weight's amax
        if (isinstance(spec, RoleSpec) and spec.rounding == "stochastic") or (
                isinstance(spec, Float8RoleSpec) and spec.scaling == "delayed"):
            return None
    return id(t2d), tuple(specs_axes), at_once


def _hand_out(mx: MXTensor, uses, now: tuple[int, ...], out: list) -> None:
    """Give each (index, axis) use only its own plane of ``mx`` (codes, or values for the axes in ``now``):
    what a module keeps for backward (the columnwise wgrad/dgrad operand) must not pin the rowwise plane."""
    for i, axis in uses:
        if axis in now:
            values = mx.dequantized_values(axis)
            if values is None:
                raise RuntimeError(f"the cast did not write the dequantized values of axis {axis} it was asked for")
            out[i] = mx._only(values=((axis % 2, values),))
        else:
            out[i] = mx if len(mx.planes) == 1 and not mx.values else mx._only(planes=(mx.plane(axis),))


# On CUDA the modules compute a norm's or an activation's output inside the cast of it (norm_cast,
# activation_cast): the kernels' fp32 arithmetic is not torch's, so an output can differ from the
# unfused path by an ulp of its dtype (and then a code); each kernel's codes are bit-exact against the
# reference cast of its own output. MXTRAIN_FUSE_SOURCES=0 computes the torch op, then casts.


def source_cast_args(spec, axes, deq, keep, generator) -> dict:
    """A fused source cast's keyword arguments (``norm_cast``, ``activation_cast``,
    ``activation_backward_cast``) for one MX role spec, as :func:`source_operands` hands them over."""
    return dict(fmt=spec.fmt, block_size=spec.block_size, axis=axes, scale_mode=spec.scale_mode,
                rounding=spec.rounding, seed=generator, dequantized=deq, keep_codes=keep)


def source_operands(like: torch.Tensor, specs_axes, cast, recipe, at_once: bool = False):
    """The operands of several uses of a norm's or an activation's output, from one fused source cast.

    ``cast(spec, axes, dequantized, keep_codes) -> MXTensor`` runs the fused kernel
    (:func:`~mxtrain.kernels.norm_cast.norm_cast`, :func:`~mxtrain.kernels.activation_cast.activation_cast`)
    on the source, whose output never exists in memory. ``like`` stands in for that output
    (dtype, device, shape) in the values policy of :func:`quantize_operand`. Returns None where
    the fusion does not apply, and the caller computes the output and quantizes it: off CUDA
    (the reference path stays as it is), under an elementwise-precision recipe (the output
    is rounded before the cast), or unless every use is one MX spec.
    """
    settings = config.current()
    if (not settings.fuse_sources or not like.is_cuda or getattr(recipe, "elemwise_format", None) is not None
            or (torch.compiler.is_compiling() and not settings.compile_fused_sources)):
        return None  # compiled: the norm / activation op, then the cast op (fullgraph; see compile_fused_sources)
    used = [(spec, axis) for spec, axis in specs_axes if spec is not None]
    specs = {spec for spec, _ in used}
    if len(specs) != 1:
        return None
    (spec,) = specs
    if isinstance(spec, Float8RoleSpec) or spec.fmt is None:
        return None
    axes = tuple(dict.fromkeys(axis for _, axis in used))
    now = _used_at_once(like, axes, at_once)
    mx = cast(spec, axes, now, tuple(a for a in axes if a not in now))
    out: list = [None] * len(specs_axes)
    _hand_out(mx, [(i, axis) for i, (spec, axis) in enumerate(specs_axes) if spec is not None], now, out)
    return out


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


def _gathered_operand(weight, specs_axes, generator) -> list:
    out = [weight.mx_gathered_plane(spec, axis) for spec, axis in specs_axes]
    rest = [i for i, o in enumerate(out) if o is None]
    if rest:  # high-precision uses, or planes this all-gather did not bring (raises if it brought MX only)
        for i, o in zip(rest, quantize_operand(weight.high_precision(), [specs_axes[i] for i in rest], generator)):
            out[i] = o
    return out


def weight_planes(weight: torch.Tensor, role, need_dgrad: bool, generator):
    """A weight's fprop plane, and its dgrad plane from the same cast when an FP8 recipe gives both
    uses one spec (current / block scaling) and backward will need it: ``(row, col)``; else
    ``(row, None)`` and backward casts the dgrad plane itself (MX recipes: per phase, so FSDP2
    gathers only the plane each phase needs). The kept plane costs 1 byte per weight element
    between forward and backward, and saves backward an amax pass and a cast. A weight all-gathered
    by FSDP2 says whether to keep it (``mx_keep_dgrad_plane``): mostly not, as backward's all-gather
    brings the dgrad plane and keeping it would hold every layer's full weight between the passes."""
    uses = weight_uses(role, need_dgrad, weight)
    ops = quantize_operand(weight, uses, generator)
    return ops[0], (ops[1] if len(uses) == 2 else None)


def weight_uses(role, need_dgrad: bool, weight: torch.Tensor | None = None) -> list:
    """The (spec, axis) uses :func:`weight_planes` casts in forward: fprop's, and dgrad's with it where one
    FP8 spec serves both (and ``weight``, if FSDP2-gathered, wants its dgrad plane kept)."""
    fprop, dgrad = role("fprop_weight"), role("dgrad_weight")
    if (need_dgrad and isinstance(fprop, Float8RoleSpec) and fprop.fmt is not None and dgrad == fprop
            and (not hasattr(weight, "mx_keep_dgrad_plane") or weight.mx_keep_dgrad_plane(fprop))):
        return [(fprop, 1), (dgrad, 0)]
    return [(fprop, 1)]


def save_for_backward(ctx, *tensors: torch.Tensor | None, **operands) -> None:
    """``ctx.save_for_backward(*tensors)`` plus the tensors inside quantized operands (``MXTensor``,
    ``Float8Tensor``: codes, scales, values), so that whatever governs saved tensors governs them too:
    activation checkpointing frees them after the forward and recomputes them, saved-tensor hooks
    (CPU offload) see them. Only their structure stays on ``ctx``. Read back with :func:`saved_tensors`."""
    flat: list = []
    ctx.mx_operand_layout = (len(tensors), {name: _flatten(op, flat) for name, op in operands.items()})
    ctx.save_for_backward(*tensors, *flat)


def saved_tensors(ctx) -> tuple[list, dict]:
    """``(tensors, operands)`` as given to :func:`save_for_backward` (operands rebuilt around the saved tensors)."""
    saved = ctx.saved_tensors
    n, layout = ctx.mx_operand_layout
    return list(saved[:n]), {name: _unflatten(node, saved, n) for name, node in layout.items()}


def _flatten(obj, flat: list):
    if isinstance(obj, torch.Tensor):
        flat.append(obj)
        return ("t", len(flat) - 1)
    if isinstance(obj, tuple):
        return ("tuple", tuple(_flatten(o, flat) for o in obj))
    if obj is None or isinstance(obj, (str, int, float, torch.dtype, torch.device)):
        return ("v", obj)  # before the dataclass test: dynamo (torch 2.11) cannot trace hasattr on torch.dtype
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return ("dc", type(obj), {f.name: _flatten(getattr(obj, f.name), flat) for f in dataclasses.fields(obj)})
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


_WARNED_EAGER_GATHERED = []


@torch.compiler.disable
def _apply_eagerly(fn, *args):
    if not _WARNED_EAGER_GATHERED:
        _WARNED_EAGER_GATHERED.append(True)
        warnings.warn("torch.compile with FSDP2 quantized all-gathers (mxtrain.distributed."
                      "enable_quantized_all_gather): mxtrain's modules run their GEMM path eagerly, one graph break "
                      "each (the gathered weights' gradient is lost when traced); the rest of the block stays compiled. "
                      "FSDP2 with its own bf16 all-gathers compiles whole.", RuntimeWarning, stacklevel=2)
    return fn.apply(*args)


def apply_module_fn(fn, weights, *args):
    """``fn.apply(*args)`` for a module's autograd function; under ``torch.compile``, run eagerly (one graph
    break) when one of ``weights`` arrived from an FSDP2 quantized all-gather: traced, the gradient of that
    gathered-weight tensor subclass never reached FSDP's parameter (the GEMM weights of a compiled layer got
    no gradient at all), so such modules stay out of the graph until the subclass can be traced."""
    if torch.compiler.is_compiling() and any(hasattr(w, "mx_gathered_plane") for w in weights):
        return _apply_eagerly(fn, *args)
    return fn.apply(*args)
