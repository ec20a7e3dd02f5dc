"""The entry points of the kernel operations: quantize, dequantize, FP8 cast, MX / FP8 GEMM.

Each builds its call (:mod:`mxtrain.kernels.calls`) and hands it to :mod:`mxtrain.kernels.registry`,
which picks the implementation: ``"reference"`` (pure PyTorch, any device, registered here) or, once
registered by the GPU kernel modules, ``"triton"`` / ``"cuda"`` (the CUDA C++ kernels of ``mxtrain/csrc``).
``MXTRAIN_BACKEND`` or the ``backend=`` argument forces where the walk starts (what it selects per
operation: :mod:`mxtrain.config`). By default CUDA tensors take the fastest kernel that supports the call
(CUDA C++, then Triton: ``benchmarks/RESULTS.md``) and CPU tensors the reference. Under ``torch.compile``
each entry point is one registered op.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Callable

import torch

from mxtrain.formats import parse_format
from mxtrain.kernels import registry
from mxtrain.oplib import opaque_op
from mxtrain.kernels.calls import (  # noqa: F401  (values_request, VALUES_DTYPES: part of this module's API)
    VALUES_DTYPES, DequantizeCall, Float8QuantizeCall, GemmCall, QuantizeCall, values_request,
)
from mxtrain.quantization import MXTensor, quantize_mx
from mxtrain.quantization._validate import normalize_axes
from mxtrain.quantization.mxtensor import MXPlane
from mxtrain.quantization.packing import packed_length
from mxtrain.quantization.float8 import (
    FP8_DTYPES, Float8Plane, Float8Tensor, _check_block as check_float8_block, _normalize_axes as float8_axes,
    fp8_format_name, quantize_float8 as quantize_float8_reference,
)

BACKENDS = registry.BACKENDS

# The operations' names (the tables of kernels live in mxtrain.kernels.registry). Kept under their former
# table names for callers that ask ``_resolve(None, device, _QUANTIZE_IMPLS)``; a GEMM name set empty
# (tests do, to compare casts with the GEMM held on the reference) sends that GEMM to the reference.
_QUANTIZE_IMPLS = "quantize"
_DEQUANTIZE_IMPLS = "dequantize"
_FLOAT8_QUANTIZE_IMPLS = "float8_quantize"
_GEMM_IMPLS = "gemm"
_FLOAT8_GEMM_IMPLS = "float8_gemm"


def set_kernel_loader(loader: Callable[[], None]) -> None:
    """Install the function that imports the kernel modules on first use (``mxtrain/kernels/__init__.py``
    does, so the kernel modules, which register with :mod:`mxtrain.kernels.registry`, never import the
    file that imports them)."""
    registry.set_kernel_loader(loader)


def _load_kernels() -> None:
    """Import the kernel modules once, where they can run (they register themselves)."""
    registry._load()


def _resolve(backend: str | None, device: torch.device, op: str) -> str:
    """The backend a call of ``op`` on ``device`` tries first (:func:`mxtrain.kernels.registry.preferred_backend`)."""
    return registry.preferred_backend(op, device, backend)


def attach_values(mxt: MXTensor, dequantized: tuple[int, ...], dtype: torch.dtype,
                  keep_codes: tuple[int, ...], backend: str | None = None) -> MXTensor:
    """``mxt`` with the dequantized values of the ``dequantized`` axes attached and only the planes of
    ``keep_codes`` kept: the semantics of ``quantize(..., dequantized=...)`` (quantize, then dequantize)."""
    values = tuple((a, dequantize(mxt, dtype, a, backend=backend)) for a in dequantized)
    planes = tuple(p for p in mxt.planes if p.axis in keep_codes)
    return dataclasses.replace(mxt, planes=planes, values=values)


def quantize(x: torch.Tensor, fmt, block_size: int = 32, axis=-1, scale_mode: str = "floor",
             rounding: str = "even", seed=None, pack: bool = True, backend: str | None = None,
             dequantized=(), dequantized_dtype: torch.dtype = torch.bfloat16, keep_codes=None) -> MXTensor:
    """``quantize_mx`` through the selected backend (bit-identical across backends).

    ``dequantized``: axes (among ``axis``) whose plane the result also carries as
    dequantized values in ``dequantized_dtype`` (logical layout; see
    :attr:`MXTensor.values`), bit-identical to ``result.dequantize(dtype, axis)``.
    The Triton cast writes them in the same pass (no separate dequantize pass);
    other backends quantize, then dequantize. ``keep_codes``: axes whose codes and
    scales are kept (default: all); a plane needed only as a GEMM operand right
    away can skip its codes (``keep_codes`` without that axis).
    """
    if not torch.compiler.is_compiling():  # eager: the implementation itself, without the op's host overhead
        return _quantize_impl(x, fmt, block_size, axis, scale_mode, rounding, seed, pack, backend, dequantized,
                              dequantized_dtype, keep_codes)
    if rounding == "stochastic" and not (seed is None or type(seed) is int):
        # a Generator cannot enter a registered op: eager only (a bad seed: the cast says what is wrong)
        if torch.compiler.is_compiling() and isinstance(seed, torch.Generator):
            raise NotImplementedError("quantize: stochastic rounding with a torch.Generator (an MX recipe's seed) "
                                      "cannot be compiled yet; use a recipe without a seed, or run it eagerly")
        return _quantize_impl(x, fmt, block_size, axis, scale_mode, rounding, seed, pack, backend, dequantized,
                              dequantized_dtype, keep_codes)
    if not isinstance(x, torch.Tensor):  # the reference says what is wrong
        return _quantize_impl(x, fmt, block_size, axis, scale_mode, rounding, seed, pack, backend, dequantized,
                              dequantized_dtype, keep_codes)
    fmt_ = parse_format(fmt)
    axes = normalize_axes(axis, x.ndim)
    if dequantized == () and keep_codes is None:
        deq, keep = (), axes
    else:
        deq, keep = values_request(x.ndim, axes, dequantized, keep_codes, dequantized_dtype)
    parts = torch.ops.mxtrain.quantize_mx(x, fmt_.name, block_size, list(axes), scale_mode, rounding,
                                          seed if rounding == "stochastic" else None, pack, list(deq),
                                          dequantized_dtype, list(keep), backend)
    return mx_from_op_outputs(parts, tuple(x.shape), x.dtype, fmt_.name, block_size, axes, keep, deq, scale_mode,
                              rounding, pack)[0]


def _quantize_impl(x, fmt, block_size, axis, scale_mode, rounding, seed, pack, backend, dequantized,
                   dequantized_dtype, keep_codes) -> MXTensor:
    call = QuantizeCall(x, fmt, block_size, axis, scale_mode, rounding, seed, pack, dequantized, dequantized_dtype,
                        keep_codes)
    return registry.run("quantize", call, x.device, backend)


def reference_quantize(call: QuantizeCall) -> MXTensor:
    """The reference implementation of the MX cast: ``quantize_mx``, then the values asked for."""
    mxt = quantize_mx(call.x, call.fmt, block_size=call.block_size, axis=call.axis, scale_mode=call.scale_mode,
                      rounding=call.rounding, seed=call.seed, pack=call.pack)
    if call.plain:
        return mxt
    spec = call.spec()
    return attach_values(mxt, spec.deq, call.dequantized_dtype, spec.keep, backend="reference")


# Registered ops: each quantization entry point is one opaque op of plain tensors under torch.compile (no
# graph break, and inductor never traces the reference's bitcast chains, which it has miscompiled). Inside,
# the backend is chosen at run time as in eager, so compiled and eager results are the same bits.


def _plane_geometry(shape, axis: int, block_size: int, fmt: str, pack: bool):
    """(lead shape, code bytes, blocks) of the plane of a tensor of ``shape`` blocked along ``axis``."""
    length = shape[axis] if len(shape) else 1
    lead = [n for i, n in enumerate(shape) if i != axis]
    bs = block_size if block_size > 0 else max(length, 1)
    nblocks = -(-length // bs)
    return lead, (packed_length(nblocks * bs, fmt) if pack else nblocks * bs), nblocks


def _values_layout(v: torch.Tensor, axis: int) -> torch.Tensor:
    """``v`` (logical shape) laid out as a dequantized plane is: its block axis innermost (no copy if it is)."""
    return v.movedim(axis, -1).contiguous().movedim(-1, axis)


# The MX casts (quantize and the fused source casts: norm_cast, activation_cast, activation_backward_cast) hand
# their MXTensor across their registered ops as these plain tensors: axis by axis, [codes, scales] if kept, then
# values if asked for.


def mx_op_outputs(mxt: MXTensor, axes, keep, deq, pack: bool, who: str) -> list[torch.Tensor]:
    """The planes of ``mxt`` as a registered op returns them (see :func:`mx_from_op_outputs`)."""
    out = []
    for ax in axes:
        if ax in keep:
            p = mxt.plane(ax)
            if p.packed != pack:
                raise RuntimeError(f"{who} returned a plane with packed={p.packed}, asked for {pack}")
            out += [p.data.contiguous(), p.scale.contiguous()]
        if ax in deq:
            # in logical layout, row-major, as the CUDA and Triton casts write them (eager's layout): a layout of
            # the op's own would cost a transposed copy of every columnwise values plane under compile
            out.append(mxt.dequantized_values(ax).contiguous())
    return out


def mx_from_op_outputs(parts, shape, dtype: torch.dtype, fmt: str, block_size: int, axes, keep, deq,
                       scale_mode: str, rounding: str, pack: bool) -> tuple[MXTensor, int]:
    """The MXTensor of ``parts`` (:func:`mx_op_outputs`) and how many of them it took."""
    planes, values, i = [], [], 0
    for ax in axes:
        if ax in keep:
            planes.append(MXPlane(parts[i], parts[i + 1], ax, pack))
            i += 2
        if ax in deq:
            values.append((ax, parts[i]))
            i += 1
    length = shape[axes[0]] if len(shape) else 1
    return MXTensor._unchecked(tuple(planes), fmt, block_size or max(length, 1), tuple(shape), dtype, scale_mode,
                               rounding, block_size == 0, tuple(values)), i


def mx_op_fake_outputs(like: torch.Tensor, shape, fmt: str, block_size: int, axes, keep, deq, pack: bool,
                       dequantized_dtype: torch.dtype) -> list[torch.Tensor]:
    """Empty tensors shaped as :func:`mx_op_outputs` returns them for a tensor of ``shape`` (fake implementations)."""
    out = []
    for ax in axes:
        lead, nbytes, nblocks = _plane_geometry(shape, ax, block_size, fmt, pack)
        if ax in keep:
            out += [like.new_empty((*lead, nbytes), dtype=torch.uint8),
                    like.new_empty((*lead, nblocks), dtype=torch.uint8)]
        if ax in deq:
            out.append(like.new_empty(list(shape), dtype=dequantized_dtype))
    return out


def op_seed(seed, rounding: str, who: str):
    """The seed a registered op takes (an int or None), or what ``seed`` is when it cannot take it: a
    torch.Generator under stochastic rounding cannot enter an op (NotImplementedError under compile)."""
    if rounding != "stochastic":
        return None
    if isinstance(seed, torch.Generator):
        raise NotImplementedError(f"{who}: stochastic rounding with a torch.Generator (an MX recipe's seed) cannot "
                                  "be compiled yet; use a recipe without a seed, or run it eagerly")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int, a torch.Generator or None, got {type(seed).__name__}")
    return seed


@opaque_op("mxtrain::quantize_mx")
def _quantize_mx_op(x: torch.Tensor, fmt: str, block_size: int, axes: list[int], scale_mode: str, rounding: str,
                    seed: int | None, pack: bool, dequantized: list[int], dequantized_dtype: torch.dtype,
                    keep_codes: list[int], backend: str | None) -> list[torch.Tensor]:
    """``[codes, scales]`` of each kept axis then ``values`` of each dequantized one, axis by axis (see quantize)."""
    extra = {} if not dequantized and keep_codes == axes else dict(dequantized=tuple(dequantized),
                                                                  keep_codes=tuple(keep_codes))
    mxt = _quantize_impl(x, fmt, block_size, tuple(axes), scale_mode, rounding, seed, pack, backend,
                         extra.get("dequantized", ()), dequantized_dtype, extra.get("keep_codes"))
    return _distinct(mx_op_outputs(mxt, axes, keep_codes, dequantized, pack, f"the {backend or 'selected'} cast"), x)


@_quantize_mx_op.register_fake
def _(x, fmt, block_size, axes, scale_mode, rounding, seed, pack, dequantized, dequantized_dtype, keep_codes,
      backend):
    return mx_op_fake_outputs(x, x.shape, fmt, block_size, axes, keep_codes, dequantized, pack, dequantized_dtype)


def dequantize(mxt: MXTensor, dtype: torch.dtype | None = None, axis: int | None = None,
               backend: str | None = None) -> torch.Tensor:
    """``mxt.dequantize(dtype, axis)`` through the selected backend (bit-identical across backends)."""
    if not torch.compiler.is_compiling():  # eager: the implementation itself
        if mxt.values_only(axis) is not None:  # values without codes: cast them
            return mxt.dequantize(dtype, axis)
        return registry.run("dequantize", DequantizeCall(mxt, dtype, axis), mxt.device, backend)
    if mxt.values_only(axis) is not None:  # values without codes: cast them
        return mxt.dequantize(dtype, axis)
    p = mxt.plane(axis)
    return torch.ops.mxtrain.dequantize_mx(p.data, p.scale, mxt.fmt, mxt.block_size, list(mxt.shape), mxt.dtype,
                                           mxt.scale_mode, mxt.rounding, mxt.whole_axis, p.axis, p.packed,
                                           dtype or mxt.dtype, backend)


@opaque_op("mxtrain::dequantize_mx")
def _dequantize_mx_op(data: torch.Tensor, scale: torch.Tensor, fmt: str, block_size: int, shape: list[int],
                      src_dtype: torch.dtype, scale_mode: str, rounding: str, whole_axis: bool, axis: int,
                      packed: bool, dtype: torch.dtype, backend: str | None) -> torch.Tensor:
    """The logical-shape values of one MX plane (``data``, ``scale``), through the selected backend."""
    mxt = MXTensor._unchecked((MXPlane(data, scale, axis, packed),), fmt, block_size, tuple(shape), src_dtype,
                              scale_mode, rounding, whole_axis)
    out = registry.run("dequantize", DequantizeCall(mxt, dtype, axis), data.device, backend)
    return _distinct([_values_layout(out, axis)], data, scale)[0]


@_dequantize_mx_op.register_fake
def _(data, scale, fmt, block_size, shape, src_dtype, scale_mode, rounding, whole_axis, axis, packed, dtype,
      backend):
    moved = [n for i, n in enumerate(shape) if i != axis] + [shape[axis]]
    return data.new_empty(moved, dtype=dtype).movedim(-1, axis)


def quantize_float8(x: torch.Tensor, fmt, *, axes=-1, scale: torch.Tensor | None = None, block=None,
                    power_of_2_scales: bool = False, amax_epsilon: float = 0.0, amax_reduction_group=None,
                    backend: str | None = None) -> Float8Tensor:
    """``mxtrain.quantization.float8.quantize_float8`` through the selected backend (bit-identical)."""
    if not torch.compiler.is_compiling():  # eager: the implementation itself
        return _quantize_float8_impl(x, fmt, axes, scale, block, power_of_2_scales, amax_epsilon,
                                     amax_reduction_group, backend)
    if amax_reduction_group is not None or not isinstance(x, torch.Tensor) or not x.is_floating_point():
        # a process group cannot enter a registered op: eager only (bad input: the cast says what is wrong)
        if torch.compiler.is_compiling() and amax_reduction_group is not None:
            raise NotImplementedError("quantize_float8: an amax_reduction_group (current scaling with the amax "
                                      "all-reduced over a group) cannot be compiled yet; run it eagerly")
        return _quantize_float8_impl(x, fmt, axes, scale, block, power_of_2_scales, amax_epsilon,
                                     amax_reduction_group, backend)
    fmt = fp8_format_name(fmt)
    axes = float8_axes(axes, x.ndim)
    block = check_float8_block(block, x.ndim)
    if block is None:
        # per-tensor: the implementation the registry picks, chosen while tracing (as mx_gemm's); a traceable
        # one (the Triton cast) enters the graph as its own ops, with no Python of this op per call on the
        # host. (Block casts choose at run time: the CUDA cast's choice reads the data's alignment.)
        call = Float8QuantizeCall(x, fmt, axes, scale, block, power_of_2_scales, amax_epsilon, None)
        kernel = registry.select("float8_quantize", call, x.device, backend)
        if kernel.traceable:
            return kernel.fn(call)
    parts = torch.ops.mxtrain.quantize_float8(x, fmt, list(axes), None if block is not None else scale,
                                              None if block is None else list(block), power_of_2_scales,
                                              float(amax_epsilon), backend)
    n = len(axes)
    if block is None:
        planes = tuple(Float8Plane(parts[i], parts[n], a) for i, a in enumerate(axes))
        return Float8Tensor(planes, fmt, tuple(x.shape), x.dtype, parts[n + 1])
    planes = tuple(Float8Plane(parts[i], parts[n + i], a, block) for i, a in enumerate(axes))
    return Float8Tensor(planes, fmt, tuple(x.shape), x.dtype, None)


def _quantize_float8_impl(x, fmt, axes, scale, block, power_of_2_scales, amax_epsilon, amax_reduction_group,
                          backend) -> Float8Tensor:
    call = Float8QuantizeCall(x, fmt, axes, scale, block, power_of_2_scales, amax_epsilon, amax_reduction_group)
    return registry.run("float8_quantize", call, x.device, backend)


def reference_quantize_float8(call: Float8QuantizeCall) -> Float8Tensor:
    """The reference implementation of the FP8 cast (``quantize_float8``)."""
    return quantize_float8_reference(call.x, call.fmt, axes=call.axes, scale=call.scale, block=call.block,
                                     power_of_2_scales=call.power_of_2_scales, amax_epsilon=call.amax_epsilon,
                                     amax_reduction_group=call.amax_reduction_group)


@opaque_op("mxtrain::quantize_float8")
def _quantize_float8_op(x: torch.Tensor, fmt: str, axes: list[int], scale: torch.Tensor | None,
                        block: list[int] | None, power_of_2_scales: bool, amax_epsilon: float,
                        backend: str | None) -> list[torch.Tensor]:
    """Per-tensor scaling: ``[data of each axis..., scale_inv, amax]``; block scaling: ``[data of each axis...,
    scale_inv of each axis...]`` (see quantize_float8)."""
    q = _quantize_float8_impl(x, fmt, tuple(axes), scale, None if block is None else tuple(block),
                              power_of_2_scales, amax_epsilon, None, backend)
    planes = [q.plane(a) for a in axes]
    data = [p.data.contiguous() for p in planes]
    if block is None:
        return _distinct([*data, q.scale_inv, q.amax], x)
    return _distinct([*data, *(p.scale_inv.contiguous() for p in planes)], x)


def _distinct(outs: list[torch.Tensor], *inputs: torch.Tensor) -> list[torch.Tensor]:
    """``outs`` with any tensor sharing memory with an input or an earlier output copied (a registered op's
    outputs may not alias: e.g. a 1x1 block of scales and its transpose)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    res = []
    for t in outs:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        res.append(t)
    return res


@_quantize_float8_op.register_fake
def _(x, fmt, axes, scale, block, power_of_2_scales, amax_epsilon, backend):
    fp8 = FP8_DTYPES[fmt]
    last = max(x.ndim - 1, 0)
    data = [x.new_empty(x.shape if a == last else (x.shape[1], x.shape[0]), dtype=fp8) for a in axes]
    if block is None:
        return [*data, x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)]
    br, bc = block
    scales = []
    for a in axes:
        rows, cols = (x.shape[0], x.shape[1]) if a == 1 else (x.shape[1], x.shape[0])
        scales.append(x.new_empty((-(-rows // br), -(-cols // bc)), dtype=torch.float32))
    return [*data, *scales]


def bias_grad(dy2d: torch.Tensor) -> torch.Tensor:
    """The fp32 column sums of a 2-D gradient (a bias gradient), as ``dy2d.sum(0, dtype=torch.float32)``
    computes them: one opaque op under torch.compile, so the compiled sum is eager's bit for bit
    (inductor's own reduction adds in another order)."""
    if not torch.compiler.is_compiling():
        return dy2d.sum(0, dtype=torch.float32)
    return torch.ops.mxtrain.bias_grad(dy2d)


def _bias_grad_op(dy2d: torch.Tensor) -> torch.Tensor:
    return dy2d.sum(0, dtype=torch.float32)


opaque_op("mxtrain::bias_grad", _bias_grad_op, fake=_bias_grad_op)


def gemm_operand(t: "MXTensor | torch.Tensor", axis: int) -> torch.Tensor:
    """fp32 values of a 2-D GEMM operand with its reduction axis ``axis`` moved last.

    An :class:`MXTensor` must have a plane blocked along ``axis`` (blocks run
    along the reduction dim); a plain tensor is used as is (high precision).
    """
    if isinstance(t, (MXTensor, Float8Tensor)):
        if t.ndim != 2:
            raise ValueError(f"GEMM operands must be 2-D, got an {type(t).__name__} of shape {list(t.shape)}")
        return t.dequantize_blocked(torch.float32, axis=axis)
    if t.ndim != 2:
        raise ValueError(f"GEMM operands must be 2-D, got shape {list(t.shape)}")
    t = t.float()
    return t if axis % 2 == 1 else t.t()


def mx_gemm(a: "MXTensor | torch.Tensor", b: "MXTensor | torch.Tensor", *, a_axis: int = 1, b_axis: int = 1,
            out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None,
            backend: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ B.T (+ bias)`` with fp32 accumulation, reducing along ``a_axis`` of a and ``b_axis`` of b.

    The result equals the fp32-accumulated product of the dequantized operands
    (the order of accumulation is free), plus ``bias`` in fp32, rounded once to
    ``out_dtype``. Fprop ``X W^T``: ``(x, 1), (w, 1)``; dgrad ``dY W``:
    ``(dy, 1), (w, 0)``; wgrad ``dY^T X``: ``(dy, 0), (x, 0)``. CUDA operands take
    the cuBLAS path of :mod:`mxtrain.kernels.gemm` (``Float8Tensor`` operands: the FP8
    GEMMs of :mod:`mxtrain.kernels.float8_gemm`); others the reference.

    ``out``: a row-contiguous ``[M, N]`` tensor of ``out_dtype`` to hold the result (returned); the per-tensor
    FP8 GEMM writes it there itself (GroupedLinear's experts fill their rows of one output: no concatenation).
    """
    if not all(isinstance(t, (MXTensor, Float8Tensor, torch.Tensor)) for t in (a, b)):
        raise TypeError(f"mx_gemm operands must be MXTensor, Float8Tensor or torch.Tensor, got "
                        f"{type(a).__name__} and {type(b).__name__}")
    if out is not None:
        _check_gemm_out(a, b, a_axis, b_axis, out_dtype, out)
    if not torch.compiler.is_compiling():  # eager: the implementation itself
        return _mx_gemm_impl(a, b, a_axis=a_axis, b_axis=b_axis, out_dtype=out_dtype, bias=bias, backend=backend,
                             out=out)
    y = _traced_gemm(a, b, a_axis, b_axis, out_dtype, bias, backend)
    return y if out is None else out.copy_(y)


def _check_gemm_out(a, b, a_axis: int, b_axis: int, out_dtype: torch.dtype, out) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"mx_gemm out must be a torch.Tensor, got {type(out).__name__}")
    shape = [t.shape[0] if axis % 2 == 1 else t.shape[-1] for t, axis in ((a, a_axis), (b, b_axis))]
    if list(out.shape) != shape or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"mx_gemm out must be a contiguous {shape} tensor of out_dtype {out_dtype}, got "
                         f"{list(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if out.device != a.device:
        raise ValueError(f"mx_gemm out is on {out.device}, the operands on {a.device}")


def _traced_gemm(a, b, a_axis: int, b_axis: int, out_dtype: torch.dtype, bias, backend):
    """:func:`mx_gemm` while compiling."""
    if isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor):
        # the implementation the registry picks, chosen while tracing (operands' devices, formats, planes and
        # shapes: what dynamo guards on); one made of torch ops (cuBLAS per-tensor FP8) enters the graph as
        # those ops: the compiled step calls torch._scaled_mm directly, not this op's Python (~0.1-0.2 ms of
        # host time a GEMM: FSDP2 steps, which cannot be CUDA-graphed, waited on it)
        call = GemmCall(a, b, a_axis, b_axis, out_dtype, bias)
        kernel = registry.select(_FLOAT8_GEMM_IMPLS, call, call.device, backend)
        if kernel.traceable:
            return kernel.fn(call)
    (ta, ma), (tb, mb) = _operand_parts(a, a_axis), _operand_parts(b, b_axis)
    return torch.ops.mxtrain.mx_gemm(ta, ma, tb, mb, a_axis, b_axis, out_dtype, bias, backend)


# A GEMM operand enters the op as its tensors and a description of the rest (a literal Python tuple):
# ("hp",) for a plain tensor; ("mx", fields...) for the one MX plane (or values) the GEMM reads;
# ("fp8", fields...) for the one FP8 plane it reads.


def _operand_parts(t, axis: int) -> tuple[list[torch.Tensor], str]:
    if isinstance(t, MXTensor):
        carried = t.values_only(axis)
        if carried is not None:
            return [carried[1]], repr(("mx", t.fmt, t.block_size, tuple(t.shape), _dtype_name(t.dtype), t.scale_mode,
                                       t.rounding, t.whole_axis, carried[0], None))
        p = t.plane(axis) if t.ndim == 2 else t.plane(None)  # 1-D and 3-D+: the GEMM says what is wrong
        return [p.data, p.scale], repr(("mx", t.fmt, t.block_size, tuple(t.shape), _dtype_name(t.dtype),
                                        t.scale_mode, t.rounding, t.whole_axis, p.axis, p.packed))
    if isinstance(t, Float8Tensor):
        p = t.plane(axis) if t.ndim == 2 else t.plane(None)
        return [p.data, p.scale_inv], repr(("fp8", t.fmt, tuple(t.shape), _dtype_name(t.dtype), p.axis, p.block))
    return [t], "('hp',)"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=1024)
def _parse_meta(meta: str) -> tuple:
    """An operand description (``_operand_parts``) back as a tuple; a model has a few distinct ones, and a compiled
    step runs this per GEMM operand on the host, so each is parsed once."""
    return ast.literal_eval(meta)


def _operand(tensors: list[torch.Tensor], meta: str):
    desc = _parse_meta(meta)
    if desc[0] == "hp":
        return tensors[0]
    if desc[0] == "mx":
        _, fmt, bs, shape, dtype, scale_mode, rounding, whole_axis, axis, packed = desc
        planes, values = ((MXPlane(tensors[0], tensors[1], axis, packed),), ()) if packed is not None else \
            ((), ((axis, tensors[0]),))
        return MXTensor._unchecked(planes, fmt, bs, shape, getattr(torch, dtype), scale_mode, rounding, whole_axis,
                                   values)
    _, fmt, shape, dtype, axis, block = desc
    return Float8Tensor((Float8Plane(tensors[0], tensors[1], axis, block),), fmt, shape, getattr(torch, dtype))


def _operand_rows(tensors: list[torch.Tensor], meta: str, axis: int):
    """The rows a GEMM operand contributes (its size along the axis it does not reduce over)."""
    if meta == "('hp',)":
        return tensors[0].shape[1 - axis % 2]
    shape = _parse_meta(meta)[3 if meta.startswith("('mx'") else 2]
    return shape[1 - axis % 2]


@opaque_op("mxtrain::mx_gemm")
def _mx_gemm_op(a: list[torch.Tensor], a_meta: str, b: list[torch.Tensor], b_meta: str, a_axis: int, b_axis: int,
                out_dtype: torch.dtype, bias: torch.Tensor | None, backend: str | None) -> torch.Tensor:
    """:func:`mx_gemm` of operands given as their parts (see ``_operand_parts``)."""
    out = _mx_gemm_impl(_operand(a, a_meta), _operand(b, b_meta), a_axis=a_axis, b_axis=b_axis, out_dtype=out_dtype,
                        bias=bias, backend=backend)
    return _distinct([out], *a, *b, bias)[0]


@_mx_gemm_op.register_fake
def _(a, a_meta, b, b_meta, a_axis, b_axis, out_dtype, bias, backend):
    return a[0].new_empty((_operand_rows(a, a_meta, a_axis), _operand_rows(b, b_meta, b_axis)), dtype=out_dtype)


def _mx_gemm_impl(a, b, *, a_axis: int, b_axis: int, out_dtype: torch.dtype, bias: torch.Tensor | None,
                  backend: str | None, out: torch.Tensor | None = None) -> torch.Tensor:
    device = a.device if isinstance(a, (MXTensor, Float8Tensor, torch.Tensor)) else torch.device("cpu")
    # FP8 operands (Float8Tensor) have GEMMs of their own (mxtrain/kernels/float8_gemm.py); a forced kernel
    # backend names the casts, the GEMM then takes whatever GPU GEMM supports it (backend_policy below)
    op = _FLOAT8_GEMM_IMPLS if isinstance(a, Float8Tensor) or isinstance(b, Float8Tensor) else _GEMM_IMPLS
    if not op:
        y = reference_gemm(a, b, a_axis=a_axis, b_axis=b_axis, out_dtype=out_dtype, bias=bias)
    else:
        y = registry.run(op, GemmCall(a, b, a_axis, b_axis, out_dtype, bias, out), device, backend)
    return y if out is None or y is out else out.copy_(y)


def reference_gemm(a, b, *, a_axis: int, b_axis: int, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """The reference of :func:`mx_gemm`: the fp32 GEMM of the dequantized operands, fp32 bias, one rounding."""
    av, bv = gemm_operand(a, a_axis), gemm_operand(b, b_axis)
    if av.shape[1] != bv.shape[1]:
        raise ValueError(f"GEMM reduction sizes differ: {av.shape[1]} vs {bv.shape[1]}")
    out = av @ bv.t()
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def _reference_gemm_call(call: GemmCall) -> torch.Tensor:
    return reference_gemm(call.a, call.b, **call.kwargs())


def _reference_dequantize(call: DequantizeCall) -> torch.Tensor:
    values = call.mxt.dequantize(call.dtype, call.axis)
    return values if call.out is None else call.out.copy_(values)


def _make_quantize(*, x, fmt, **kw) -> QuantizeCall:
    return QuantizeCall(x, fmt, **kw)


def _make_dequantize(*, mxt, dtype=None, axis=None, out=None) -> DequantizeCall:
    return DequantizeCall(mxt, dtype, axis, out)


def _make_float8_quantize(*, x, fmt, **kw) -> Float8QuantizeCall:
    return Float8QuantizeCall(x, fmt, **kw)


def _make_gemm(*, a, b, **kw) -> GemmCall:
    return GemmCall(a, b, **kw)


# The operations and their reference implementations; the kernel modules register theirs.
registry.define(registry.Operation("quantize", _make_quantize, QuantizeCall.key, strict_cuda=True))
registry.define(registry.Operation("dequantize", _make_dequantize, DequantizeCall.key))
registry.define(registry.Operation("float8_quantize", _make_float8_quantize, Float8QuantizeCall.key))
registry.define(registry.Operation("gemm", _make_gemm, backend_policy="reference_only"))
registry.define(registry.Operation("float8_gemm", _make_gemm, backend_policy="reference_only"))
registry.register("quantize", "reference", reference_quantize)
registry.register("dequantize", "reference", _reference_dequantize)
registry.register("float8_quantize", "reference", reference_quantize_float8)
registry.register("gemm", "reference", _reference_gemm_call)
registry.register("float8_gemm", "reference", _reference_gemm_call)
