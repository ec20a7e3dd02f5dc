"""Quantizers: how a module casts each tensor of its GEMMs, built once per module and recipe.

A GEMM ``Y = X W^T`` casts three tensors, each used in two orientations (DESIGN.md, "GEMM operands"):

============  ======================  ========================
tensor        rowwise use (axis 1)    columnwise use (axis 0)
============  ======================  ========================
input         ``fprop_input``         ``wgrad_input``
weight        ``fprop_weight``        ``dgrad_weight``
grad_output   ``dgrad_grad_output``   ``wgrad_grad_output``
============  ======================  ========================

A :class:`Quantizer` holds the recipe's spec of both uses of one tensor (an MX ``RoleSpec`` or a
``Float8RoleSpec``: the modules do not tell them apart) and makes the operands asked for, both from one
cast where one spec serves both uses. :func:`make_quantizers` builds them for every GEMM of a module, as
Transformer Engine's ``RecipeState.make_quantizers()``; a DelayedScaling module's state is bound there
(each spec carries the state and the tensor's slot in it). ``RecipeStateMixin.forward_quantizers``
(``_recipe_state.py``) keeps them on the module, so a forward looks up no spec.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from mxtrain import config
from mxtrain.kernels.dispatch import quantize, quantize_float8
from mxtrain.modules._common import _WEIGHT_CASTS, _used_at_once
from mxtrain.quantization import MXTensor
from mxtrain.recipes.float8 import Float8RoleSpec
from mxtrain.recipes.recipe import ROLE_NAMES, RoleSpec

__all__ = ["TENSOR_ROLES", "Quantizer", "GemmQuantizers", "RecipeQuantizers", "make_quantizers", "delayed_slots"]

# each GEMM tensor's (rowwise, columnwise) role
TENSOR_ROLES = {"input": ("fprop_input", "wgrad_input"), "weight": ("fprop_weight", "dgrad_weight"),
                "grad_output": ("dgrad_grad_output", "wgrad_grad_output")}
_ROLE_USE = {role: (tensor, i) for tensor, roles in TENSOR_ROLES.items() for i, role in enumerate(roles)}


class Quantizer:
    """The casts of one GEMM tensor (a module's input, weight or output gradient of one GEMM).

    ``row_spec`` / ``col_spec``: the specs of its rowwise and columnwise uses (a spec whose ``fmt`` is
    None leaves that use in high precision: the operand is the tensor itself). ``generator``: the
    stochastic-rounding generator of the recipe's seed (None: torch's global RNG). ``fuse``: the recipe
    has no elementwise precision, so a norm or an activation may run inside the cast of its output.
    Every method returns ``(rowwise operand | None, columnwise operand | None)``: None for a use not asked for.
    Which kernel casts is left to the kernel registry at call time (``mxtrain.config`` settings may change
    between calls of one quantizer).
    """

    def __init__(self, tensor: str, row_spec, col_spec, generator=None, fuse: bool = True,
                 same: bool | None = None) -> None:
        self.tensor, self.row_spec, self.col_spec = tensor, row_spec, col_spec
        self.generator, self.fuse = generator, fuse
        self.float8 = isinstance(row_spec, Float8RoleSpec)
        self.row_quantized, self.col_quantized = row_spec.fmt is not None, col_spec.fmt is not None
        # ``same``: whether the two uses have one spec (make_quantizers compares the specs before binding a state)
        same = (row_spec is col_spec or row_spec == col_spec) if same is None else same
        # (isinstance, not getattr with a default: a compiled block guards a missing attribute with a hasattr check)
        stochastic = any(isinstance(s, RoleSpec) and s.rounding == "stochastic" for s in (row_spec, col_spec))
        delayed = self.float8 and "delayed" in (row_spec.scaling, col_spec.scaling)
        # a fused source cast serves both uses only where one spec does (MX)
        self.one_spec = same and self.row_quantized
        # one cast writes both planes; stochastic rounding draws each use's noise in a cast of its own
        self.shared = self.one_spec and not stochastic
        # FP8 (scales per tensor or per 128 x 128 block): a weight's forward cast also writes its dgrad plane
        self.dgrad_in_forward = self.float8 and self.one_spec
        # the weight-cast cache: a stochastic cast draws afresh each time; a delayed one records the amax
        self.cacheable = not (stochastic or delayed)

    def __repr__(self) -> str:
        return f"Quantizer({self.tensor}, rowwise={self.row_spec}, columnwise={self.col_spec})"

    def role(self, axis: int):
        """The spec of the use along ``axis`` (1: rowwise, 0: columnwise)."""
        return self.row_spec if axis % 2 else self.col_spec

    # ---- plain casts

    def quantize(self, t2d: torch.Tensor, rowwise: bool = True, columnwise: bool = True, at_once: bool = False):
        """The operands of a 2-D tensor for the uses asked for, from one cast where one spec serves both.

        ``at_once``: every plane goes to a GEMM right away (backward's gradient operands), so on CUDA
        the cast may write all of them as values (``config.current().carry_values``). A weight
        all-gathered by FSDP2 in MX or FP8 (``mxtrain.distributed``) carries its planes: a use they
        serve gets them as they are. Inside :func:`~mxtrain.modules.weight_cast_cache` a parameter's
        planes are reused while it is unchanged."""
        if hasattr(t2d, "mx_gathered_plane"):
            return self._gathered(t2d, rowwise, columnwise)
        key = _cache_key(t2d, self, rowwise, columnwise, at_once) if (_WEIGHT_CASTS.depth and self.cacheable) else None
        if key is not None:
            hit = _WEIGHT_CASTS.entries.get(key)
            if hit is not None and hit[0]() is t2d and hit[1] == (t2d._version, t2d.data_ptr()):
                return hit[2]
        out = self._cast(t2d, rowwise, columnwise, at_once)
        if key is not None:
            _WEIGHT_CASTS.entries[key] = (weakref.ref(t2d), (t2d._version, t2d.data_ptr()), out)
        return out

    def _cast(self, t2d, rowwise: bool, columnwise: bool, at_once: bool):
        row = t2d if rowwise and not self.row_quantized else None
        col = t2d if columnwise and not self.col_quantized else None
        rowwise, columnwise = rowwise and self.row_quantized, columnwise and self.col_quantized
        if rowwise and columnwise and self.shared:
            return tuple(self._planes(t2d, self.row_spec, (1, 0), at_once))
        if rowwise:
            (row,) = self._planes(t2d, self.row_spec, (1,), at_once)
        if columnwise:
            (col,) = self._planes(t2d, self.col_spec, (0,), at_once)
        return row, col

    def _planes(self, t2d, spec, axes: tuple[int, ...], at_once: bool) -> list:
        if self.float8:  # a Float8Tensor (data + scale_inv) per use
            fp8 = _float8_cast(t2d, spec, axes)
            return [fp8.only(axis) for axis in axes]
        now = _used_at_once(t2d, axes, at_once)
        extra = {} if not now else dict(dequantized=now, keep_codes=tuple(a for a in axes if a not in now))
        mx = quantize(t2d, spec.fmt, block_size=spec.block_size, axis=axes, scale_mode=spec.scale_mode,
                      rounding=spec.rounding, seed=self.generator, **extra)
        return _hand_out(mx, axes, now)

    def _gathered(self, weight, rowwise: bool, columnwise: bool):
        row = weight.mx_gathered_plane(self.row_spec, 1) if rowwise else None
        col = weight.mx_gathered_plane(self.col_spec, 0) if columnwise else None
        need_row, need_col = rowwise and row is None, columnwise and col is None
        if need_row or need_col:  # high-precision uses, or planes this all-gather did not bring (raises if MX only)
            r, c = self.quantize(weight.high_precision(), need_row, need_col)
            row, col = (r if need_row else row), (c if need_col else col)
        return row, col

    # ---- weights

    def weight_planes(self, weight: torch.Tensor, need_dgrad: bool):
        """A weight's fprop plane, and its dgrad plane from the same cast where an FP8 spec serves both uses
        (current / block scaling) and backward will need it; else ``(row, None)`` and backward casts the dgrad
        plane itself (MX recipes: per phase, so FSDP2 gathers only the plane each phase needs). The kept plane
        costs 1 byte per weight element between the passes and saves backward an amax pass and a cast. A
        weight all-gathered by FSDP2 says whether to keep it (``mx_keep_dgrad_plane``): mostly not, as
        backward's all-gather brings the dgrad plane."""
        col = need_dgrad and self.keeps_dgrad_plane(weight)
        return self.quantize(weight, True, col)

    def keeps_dgrad_plane(self, weight: torch.Tensor | None = None) -> bool:
        """Whether :meth:`weight_planes` makes the dgrad plane in forward (where backward needs one)."""
        return self.dgrad_in_forward and (weight is None or not hasattr(weight, "mx_keep_dgrad_plane")
                                          or weight.mx_keep_dgrad_plane(self.row_spec))

    # ---- fused casts: the source of the tensor is computed inside the cast

    def quantize_source(self, like: torch.Tensor, cast, rowwise: bool = True, columnwise: bool = True,
                        at_once: bool = False):
        """The operands of a norm's or an activation's output from one fused MX cast, or None.

        ``cast(**kwargs) -> MXTensor`` runs the fused kernel (:func:`~mxtrain.kernels.norm_cast.norm_cast`,
        :func:`~mxtrain.kernels.activation_cast.activation_cast`, ``activation_backward_cast``) with the
        cast's keyword arguments (fmt, block_size, axis, scale_mode, rounding, seed, dequantized,
        keep_codes); the output never exists in memory. ``like`` stands in for it (dtype, device) in
        the values policy of :meth:`quantize`. None where the fusion does not apply, and the caller
        computes the output and quantizes it: off CUDA (the reference path stays as it is), under an
        elementwise-precision recipe (the output is rounded before the cast), FP8 specs, or unless the
        uses asked for have one MX spec.

        On CUDA the kernels' fp32 arithmetic is not torch's, so an output can differ from the unfused path
        by an ulp of its dtype (and then a code); each kernel's codes are bit-exact against the reference
        cast of its own output. MXTRAIN_FUSE_SOURCES=0 computes the torch op, then casts."""
        if self.float8 or not self.fuse or not like.is_cuda:
            return None
        settings = config.current()
        if not settings.fuse_sources or (torch.compiler.is_compiling() and not settings.compile_fused_sources):
            return None  # MXTRAIN_COMPILE_FUSED_SOURCES=0 under compile: the norm / activation op, then the cast op
        if rowwise and columnwise:
            spec, axes = (self.row_spec, (1, 0)) if self.one_spec else (None, ())
        else:
            spec, axes = (self.row_spec, (1,)) if rowwise else (self.col_spec, (0,))
        if spec is None or spec.fmt is None:
            return None
        now = _used_at_once(like, axes, at_once)
        mx = cast(fmt=spec.fmt, block_size=spec.block_size, axis=axes, scale_mode=spec.scale_mode,
                  rounding=spec.rounding, seed=self.generator, dequantized=now,
                  keep_codes=tuple(a for a in axes if a not in now))
        planes = _hand_out(mx, axes, now)
        return (planes[0], planes[1]) if len(axes) == 2 else ((planes[0], None) if rowwise else (None, planes[0]))

    def quantize_fused(self, src: torch.Tensor, rowwise: bool = True, columnwise: bool = True, *,
                       act: str | None = None, grad: torch.Tensor | None = None, dbias: bool = False):
        """FP8 operands of ``act(src)`` / ``grad * act'(src)`` / ``src`` from fused Triton casts, and with
        ``dbias`` the fp32 column sums of the cast tensor (a bias gradient) from the same pass:
        ``((row, col), dbias | None)``, or None.

        The activation (or its derivative times ``grad``) is computed inside the cast: the unfused path
        writes it, reads it for the amax and again for the cast. None where the fused casts do not apply
        (an MX spec, a high-precision use, blocks other than 1x128 / 128x128, a fresh DelayedScaling slot,
        no Triton backend for the device, an activation the prologue lacks); the caller then runs the
        unfused ops (and where an elementwise-precision recipe rounds the source first, does not call this).
        MXTRAIN_FP8_FUSED_CASTS=0 always runs them."""
        if not self.float8 or not (rowwise or columnwise):
            return None
        settings = config.current()
        if (not settings.fp8_fused_casts or src.ndim != 2
                or src.dtype not in (torch.float32, torch.bfloat16, torch.float16)
                or (torch.compiler.is_compiling() and not settings.compile_fused_sources)):
            return None  # MXTRAIN_COMPILE_FUSED_SOURCES=0 under compile: the activation op, then the cast op
        if rowwise and columnwise and self.shared:
            groups = [(self.row_spec, (1, 0))]
        else:
            groups = ([(self.row_spec, (1,))] if rowwise else []) + ([(self.col_spec, (0,))] if columnwise else [])
        if any(spec.fmt is None or (spec.block is not None and spec.block not in ((1, 128), (128, 128)))
               or (spec.scaling == "delayed" and (spec.state is None or spec.state.fresh(spec.slot)))
               for spec, _ in groups):  # a fresh delayed slot's scale needs the cast tensor's amax first
            return None
        from mxtrain.kernels import registry

        try:
            if not registry.walks("float8_quantize", src.device, "triton"):  # the fused casts are Triton's
                return None
            from mxtrain.kernels.float8_cast import (
                FUSED_ACTIVATION_GRADS, FUSED_ACTIVATIONS, block_cast_float8, tensor_cast_float8,
            )
        except (ImportError, RuntimeError):
            return None
        if act is not None and act not in (FUSED_ACTIVATIONS if grad is None else FUSED_ACTIVATION_GRADS):
            return None
        out = [None, None]  # (row, col)
        bias_grad = amax = None
        for spec, axes in groups:
            kw = dict(rowwise=1 in axes, columnwise=0 in axes, act=act, grad=grad, dbias=dbias and bias_grad is None,
                      power_of_2_scales=spec.power_of_2_scales, amax_epsilon=spec.amax_epsilon)
            if spec.block is not None:  # 128-block scales: one pass, the prologue computed once
                q, db = block_cast_float8(src, spec.fmt, spec.block, **kw)
            elif spec.scaling == "delayed":
                q, db = tensor_cast_float8(src, spec.fmt, scale=spec.state.scale_for(spec.slot, spec.fmt, src.device),
                                           **kw)
                spec.state.record(spec.slot, q.amax)
            else:
                q, db = tensor_cast_float8(src, spec.fmt, amax=amax, amax_reduction_group=spec.amax_reduction_group,
                                           **kw)
                amax = q.amax  # the source's amax: the next group's cast skips its amax pass
            bias_grad = db if db is not None else bias_grad
            for axis in axes:
                out[1 - axis] = q.only(axis)
        return (out[0], out[1]), bias_grad


class GemmQuantizers:
    """The quantizers of one GEMM: ``input``, ``weight`` and ``grad_output``."""

    def __init__(self, gemm: str, input: Quantizer, weight: Quantizer, grad_output: Quantizer) -> None:
        self.gemm, self.input, self.weight, self.grad_output = gemm, input, weight, grad_output

    def role(self, name: str):
        """The spec of one of the six GEMM operand roles (``ROLE_NAMES``), as this GEMM's quantizers hold it."""
        use = _ROLE_USE.get(name)
        if use is None:
            raise ValueError(f"unknown GEMM operand role {name!r}; valid roles: {', '.join(ROLE_NAMES)}")
        return getattr(self, use[0]).role(1 - use[1])

    def __repr__(self) -> str:
        return f"GemmQuantizers({self.gemm!r}, {self.input}, {self.weight}, {self.grad_output})"


class RecipeQuantizers:
    """A module's quantizers under one recipe: a :class:`GemmQuantizers` per GEMM name (``""`` for a one-GEMM
    module, ``"fc1"`` / ``"fc2"``, ``"expert<i>"``). ``recipe``, ``state`` (DelayedScaling's, or None) and
    ``generator`` are what they were built for; ``fuse``: the recipe has no elementwise precision."""

    def __init__(self, recipe, state, generator, gemms: dict) -> None:
        self.recipe, self.state, self.generator, self.gemms = recipe, state, generator, gemms
        self.fuse = getattr(recipe, "elemwise_format", None) is None

    def __getitem__(self, gemm: str) -> GemmQuantizers:
        return self.gemms[gemm]

    def __repr__(self) -> str:
        return f"RecipeQuantizers({self.recipe!r}, gemms={list(self.gemms)})"


def make_quantizers(recipe, state=None, gemms: tuple[str, ...] = ("",), generator=None) -> RecipeQuantizers:
    """The quantizers of every GEMM in ``gemms`` under ``recipe`` (Transformer Engine's ``make_quantizers``).

    ``state``: DelayedScaling's per-module state (or a frozen view of it): every quantized spec gets it and
    its tensor's slot (``"<gemm>.<tensor>"``, or the tensor alone for gemm ``""``), and the slots are made now,
    in forward (a compiled backward cannot make one). ``generator``: see :class:`Quantizer`."""
    fuse = getattr(recipe, "elemwise_format", None) is None
    ensure = getattr(state, "ensure_slots", None)
    built = {}
    for gemm in gemms:
        if ensure is not None:
            ensure(delayed_slots(recipe, gemm))
        qs = []
        for tensor, (row_name, col_name) in TENSOR_ROLES.items():
            row, col = recipe.role(row_name), recipe.role(col_name)
            same = row == col
            if state is not None:
                row, col = _bound(row, state, gemm), _bound(col, state, gemm)
            qs.append(Quantizer(tensor, row, col, generator, fuse, same))
        built[gemm] = GemmQuantizers(gemm, *qs)
    return RecipeQuantizers(recipe, state, generator, built)


def delayed_slots(recipe, gemm: str = "") -> tuple[tuple[str, str], ...]:
    """``((slot, fmt), ...)`` of every quantized tensor of one GEMM under an FP8 recipe (input, weight,
    grad_output, in that order: the order a state lays its slots out in)."""
    slots = {}
    for name in ROLE_NAMES:
        spec = recipe.role(name)
        if spec.quantized:
            slots.setdefault(_slot(gemm, spec.tensor), spec.fmt)
    return tuple(slots.items())


def _slot(gemm: str, tensor: str) -> str:
    return f"{gemm}.{tensor}" if gemm else tensor


def _bound(spec, state, gemm: str):
    return dataclasses.replace(spec, state=state, slot=_slot(gemm, spec.tensor)) if spec.quantized else spec


def _float8_cast(t2d: torch.Tensor, spec, axes: tuple[int, ...]):
    """Cast ``t2d`` for the planes ``axes`` (1: rowwise, 0: the transpose) as ``spec`` says, in one call.

    Delayed scaling casts with the slot's scale from the module's state and records the tensor's amax
    there; current scaling computes the scale from ``t2d`` (all-reduced over the spec's group); block
    scaling computes one per block."""
    if spec.scaling == "delayed":
        state = spec.state
        if state is None:
            raise RuntimeError(
                "DelayedScaling keeps amax histories per module: run it through mxtrain modules (Linear, "
                "LayerNormLinear, LayerNormMLP), not the functional mx_linear, or use Float8CurrentScaling")
        scale = state.scale_for(spec.slot, spec.fmt, t2d.device, source=t2d)
        q = quantize_float8(t2d, spec.fmt, axes=axes, scale=scale)
        state.record(spec.slot, q.amax)
        return q
    return quantize_float8(t2d, spec.fmt, axes=axes, block=spec.block, power_of_2_scales=spec.power_of_2_scales,
                           amax_epsilon=spec.amax_epsilon, amax_reduction_group=spec.amax_reduction_group)


def _cache_key(t2d: torch.Tensor, q: Quantizer, rowwise: bool, columnwise: bool, at_once: bool):
    """The weight-cast cache key of a cast, or None where it is not cached (see ``weight_cast_cache``)."""
    if not isinstance(t2d, torch.nn.Parameter) or torch.compiler.is_compiling():
        return None
    if t2d.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return id(t2d), q.row_spec if rowwise else None, q.col_spec if columnwise else None, at_once


def _hand_out(mx: MXTensor, axes: tuple[int, ...], now: tuple[int, ...]) -> list:
    """Each axis's own plane of ``mx`` (codes, or values for the axes in ``now``): what a module keeps for
    backward (the columnwise wgrad/dgrad operand) must not pin the rowwise plane."""
    out = []
    for axis in axes:
        if axis in now:
            values = mx.dequantized_values(axis)
            if values is None:
                raise RuntimeError(f"the cast did not write the dequantized values of axis {axis} it was asked for")
            out.append(mx._only(values=((axis % 2, values),)))
        else:
            out.append(mx if len(mx.planes) == 1 and not mx.values else mx._only(planes=(mx.plane(axis),)))
    return out
