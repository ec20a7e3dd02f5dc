"""The typed arguments of each kernel operation, as they cross from an entry point to an implementation.

A call holds its arguments as given; :meth:`QuantizeCall.spec` validates them once (the reference's checks
and errors) for the implementations that need them parsed. ``key()`` is what an implementation's
``supports()`` may read: devices, dtypes, shapes, strides, 16-byte alignment and the scalar arguments,
never values, so the registry (:mod:`mxtrain.kernels.registry`) caches its decision by it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mxtrain.formats import ElemFormat
from mxtrain.quantization._validate import check_float_tensor, normalize_axes
from mxtrain.quantization.mx import _check_common

__all__ = ["CastSpec", "QuantizeCall", "DequantizeCall", "DequantizeShardsCall", "Float8QuantizeCall",
           "BlockCastCall", "GroupedFloat8CastCall", "CrossEntropyCall", "TransposeCall", "GemmCall", "values_request",
           "VALUES_DTYPES"]

VALUES_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _meta(t: torch.Tensor | None):
    """What a decision may read of a tensor: dtype, shape, strides, device and 16-byte alignment."""
    if t is None:
        return None
    return t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16


def values_request(ndim: int, axis, dequantized, keep_codes, dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Normalized ``(dequantized axes, axes whose codes are kept)`` of a quantize call, validated.

    ``dequantized``: axes (among ``axis``) whose dequantized values the result carries;
    ``keep_codes``: axes whose codes+scales it keeps (None: all of ``axis``). Every axis of
    ``axis`` needs its codes or its values. Remembered per argument tuple (every cast of a
    training step asks it, with a handful of distinct requests).
    """
    if torch.compiler.is_compiling():  # traced as it is (dynamo warns on every lru_cache it traces through)
        return _values_request(ndim, axis, dequantized, keep_codes, dtype)
    try:
        return _values_request_cached(ndim, axis, dequantized, keep_codes, dtype)
    except TypeError:  # unhashable arguments (lists): worked out afresh
        return _values_request(ndim, axis, dequantized, keep_codes, dtype)


def _values_request(ndim: int, axis, dequantized, keep_codes, dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    axes = axis if isinstance(axis, tuple) else (axis,)
    norm = lambda a: a % ndim if ndim and -ndim <= a < ndim else a  # noqa: E731  (bad axes: quantize_mx says)
    axes = tuple(norm(a) for a in axes)
    deq = dequantized if isinstance(dequantized, (tuple, list)) else (dequantized,)
    deq = tuple(dict.fromkeys(norm(a) for a in deq))
    keep = axes if keep_codes is None else (keep_codes if isinstance(keep_codes, (tuple, list)) else (keep_codes,))
    keep = tuple(dict.fromkeys(norm(a) for a in keep))
    for what, sub in (("dequantized", deq), ("keep_codes", keep)):
        if any(a not in axes for a in sub):
            raise ValueError(f"{what} axes {sub} must be among the quantized axes {axes}")
    if any(a not in keep and a not in deq for a in axes):
        raise ValueError(f"axes {axes}: each needs its codes kept or its values dequantized "
                         f"(keep_codes={keep}, dequantized={deq})")
    if deq and dtype not in VALUES_DTYPES:
        raise ValueError(f"dequantized_dtype must be one of {VALUES_DTYPES}, got {dtype}")
    return deq, keep


_values_request_cached = functools.lru_cache(maxsize=1024, typed=True)(_values_request)


class CastSpec(NamedTuple):
    """An MX cast's arguments, validated: the format, block size, normalized axes, scale mode, rounding,
    the axes whose values are written (``deq``) and those whose codes are kept (``keep``)."""

    fmt: ElemFormat
    block_size: int
    axes: tuple[int, ...]
    scale_mode: str
    rounding: str
    deq: tuple[int, ...]
    keep: tuple[int, ...]


def _cast_spec(x, fmt, block_size, axis, scale_mode, rounding, dequantized, keep_codes, dequantized_dtype) -> CastSpec:
    fmt, bs, mode, rounding = _check_common(x, fmt, block_size, scale_mode, rounding)
    axes = normalize_axes(axis, x.ndim)
    deq, keep = values_request(x.ndim, axes, dequantized, keep_codes, dequantized_dtype)
    return CastSpec(fmt, bs, axes, mode, rounding, deq, keep)


@functools.lru_cache(maxsize=1024, typed=True)
def _cast_spec_cached(ndim, *args) -> CastSpec:
    return _cast_spec(torch.empty((0,) * ndim), *args)  # x's dtype checked by the caller; only its ndim matters


class QuantizeCall:
    """An MX cast: :func:`mxtrain.kernels.dispatch.quantize`'s arguments."""

    __slots__ = ("x", "fmt", "block_size", "axis", "scale_mode", "rounding", "seed", "pack", "dequantized",
                 "dequantized_dtype", "keep_codes", "_spec")

    def __init__(self, x, fmt, block_size=32, axis=-1, scale_mode="floor", rounding="even", seed=None, pack=True,
                 dequantized=(), dequantized_dtype=torch.bfloat16, keep_codes=None):
        self.x, self.fmt, self.block_size, self.axis = x, fmt, block_size, axis
        self.scale_mode, self.rounding, self.seed, self.pack = scale_mode, rounding, seed, pack
        self.dequantized, self.dequantized_dtype, self.keep_codes = dequantized, dequantized_dtype, keep_codes
        self._spec = None

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def plain(self) -> bool:
        """Codes of every axis, no values: what ``quantize_mx`` alone returns."""
        return self.dequantized == () and self.keep_codes is None

    def spec(self) -> CastSpec:
        """The validated arguments (raises what the reference raises for bad ones); remembered per argument
        tuple, as a training step repeats a handful of them."""
        if self._spec is None:
            x = self.x
            args = (self.fmt, self.block_size, self.axis, self.scale_mode, self.rounding, self.dequantized,
                    self.keep_codes, self.dequantized_dtype)
            try:
                check_float_tensor(x)
                self._spec = _cast_spec_cached(x.ndim, *args)
            except TypeError:  # unhashable arguments (lists), or a bad x: worked out afresh (it raises there)
                self._spec = _cast_spec(x, *args)
        return self._spec

    def key(self):
        s = self.spec()
        return (_meta(self.x), s.fmt.name, s.block_size, s.axes, s.scale_mode, s.rounding, s.deq, s.keep, self.pack,
                self.dequantized_dtype)


class DequantizeCall:
    """``mxt.dequantize(dtype, axis)``, optionally into ``out`` (the logical shape, any strides)."""

    __slots__ = ("mxt", "dtype", "axis", "out")

    def __init__(self, mxt, dtype=None, axis=None, out=None):
        self.mxt, self.dtype, self.axis, self.out = mxt, dtype or mxt.dtype, axis, out

    @property
    def device(self) -> torch.device:
        return self.mxt.device

    def key(self):
        m, p = self.mxt, self.mxt.plane(self.axis)
        return (m.fmt, m.block_size, m.whole_axis, tuple(m.shape), p.axis, p.packed, _meta(p.data), _meta(p.scale),
                self.dtype, _meta(self.out))


class DequantizeShardsCall:
    """``count`` 2-D MX shards of one layout (``shard`` the first; the others ``data_step`` / ``scale_step``
    elements further) dequantized into the rows of ``out``, shard after shard (an FSDP2 gather)."""

    __slots__ = ("shard", "count", "data_step", "scale_step", "out", "axis")

    def __init__(self, shard, count, data_step, scale_step, out, axis=None):
        self.shard, self.count, self.data_step, self.scale_step = shard, count, data_step, scale_step
        self.out, self.axis = out, axis

    @property
    def device(self) -> torch.device:
        return self.shard.device

    def key(self):
        m, p = self.shard, self.shard.plane(self.axis)
        return (m.fmt, m.block_size, m.whole_axis, tuple(m.shape), p.axis, p.packed, _meta(p.data), _meta(p.scale),
                _meta(self.out), self.count, self.data_step, self.scale_step)


class Float8QuantizeCall:
    """An FP8 cast: :func:`mxtrain.quantization.float8.quantize_float8`'s arguments."""

    __slots__ = ("x", "fmt", "axes", "scale", "block", "power_of_2_scales", "amax_epsilon", "amax_reduction_group")

    def __init__(self, x, fmt, axes=-1, scale=None, block=None, power_of_2_scales=False, amax_epsilon=0.0,
                 amax_reduction_group=None):
        self.x, self.fmt, self.axes, self.scale, self.block = x, fmt, axes, scale, block
        self.power_of_2_scales, self.amax_epsilon = power_of_2_scales, amax_epsilon
        self.amax_reduction_group = amax_reduction_group

    @property
    def device(self) -> torch.device:
        return self.x.device

    def key(self):
        axes = self.axes if isinstance(self.axes, int) else tuple(self.axes)
        return (_meta(self.x), axes, None if self.block is None else tuple(self.block))


class BlockCastCall:
    """A 128-block FP8 cast of a 2-D source (``x``, ``act(x)`` or ``grad * act'(x)``), validated by
    ``float8_cast.block_cast_float8``: ``x`` / ``grad`` have contiguous rows."""

    __slots__ = ("x", "grad", "fmt", "block", "rowwise", "columnwise", "act", "power_of_2_scales", "amax_epsilon",
                 "dbias")

    def __init__(self, x, grad, fmt, block, rowwise, columnwise, act, power_of_2_scales, amax_epsilon, dbias):
        self.x, self.grad, self.fmt, self.block = x, grad, fmt, tuple(block)
        self.rowwise, self.columnwise, self.act = rowwise, columnwise, act
        self.power_of_2_scales, self.amax_epsilon, self.dbias = power_of_2_scales, amax_epsilon, dbias

    @property
    def device(self) -> torch.device:
        return self.x.device

    def key(self):
        return (_meta(self.x), _meta(self.grad), self.fmt, self.block, self.rowwise, self.columnwise, self.act,
                self.dbias)


class GroupedFloat8CastCall:
    """A per-tensor FP8 cast of the experts' row segments of one stacked 2-D tensor, each segment with its own
    scale (``grouped_float8_cast.grouped_cast_float8``): ``x [T, K]`` with contiguous rows; the segments end at
    the device tensor ``ends [E]`` or are ``rows_per_expert`` rows each; ``scale [E]`` given: delayed scaling.
    ``segment_multiple``: the caller's promise that every segment's row count is a multiple of it (the kernel
    does not read the ends on the host; 16 lets it store the transposed plane in 16-byte pieces). ``row_amax``
    (current scaling): ``[T, P]`` fp32 maxima of ``|x|`` over pieces of each row (``mxtrain.modules.amax_hints``),
    reduced per expert instead of an amax pass over ``x``."""

    __slots__ = ("x", "ends", "rows_per_expert", "num_experts", "fmt", "rowwise", "columnwise", "col_layout",
                 "scale", "power_of_2_scales", "amax_epsilon", "amax_reduction_group", "segment_multiple", "row_amax")

    def __init__(self, x, ends, rows_per_expert, num_experts, fmt, rowwise, columnwise, col_layout, scale,
                 power_of_2_scales, amax_epsilon, amax_reduction_group, segment_multiple=1, row_amax=None):
        self.segment_multiple, self.row_amax = segment_multiple, row_amax
        self.x, self.ends, self.rows_per_expert, self.num_experts = x, ends, rows_per_expert, num_experts
        self.fmt, self.rowwise, self.columnwise, self.col_layout = fmt, rowwise, columnwise, col_layout
        self.scale, self.power_of_2_scales, self.amax_epsilon = scale, power_of_2_scales, amax_epsilon
        self.amax_reduction_group = amax_reduction_group

    @property
    def device(self) -> torch.device:
        return self.x.device

    def key(self):
        return (_meta(self.x), _meta(self.ends), _meta(self.scale), self.rows_per_expert, self.num_experts, self.fmt,
                self.rowwise, self.columnwise, self.col_layout, self.segment_multiple, _meta(self.row_amax))


class CrossEntropyCall:
    """The loss of ``logits [N, V]`` against ``targets [N]`` (int64; ``ignore_index`` rows count nothing):
    :mod:`mxtrain.kernels.cross_entropy`'s arguments; the backward's also ``lse [N]`` (the forward's) and
    ``scale`` (0-d fp32: the gradient of every counted row's loss)."""

    __slots__ = ("logits", "targets", "ignore_index", "lse", "scale")

    def __init__(self, logits, targets, ignore_index, lse=None, scale=None):
        self.logits, self.targets, self.ignore_index, self.lse, self.scale = logits, targets, ignore_index, lse, scale

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def key(self):
        return _meta(self.logits), _meta(self.targets), self.ignore_index


class TransposeCall:
    """``out = src.t()`` of a 2-D tensor of one-byte elements: :mod:`mxtrain.kernels.transpose`'s arguments."""

    __slots__ = ("src", "out")

    def __init__(self, src, out):
        self.src, self.out = src, out

    @property
    def device(self) -> torch.device:
        return self.src.device

    def key(self):
        return _meta(self.src), _meta(self.out)


class TransposeManyCall:
    """``outs[i] = srcs[i].t()`` for several 2-D tensors of one-byte elements on one device
    (:func:`mxtrain.kernels.transpose.transpose_bytes_many`'s arguments)."""

    __slots__ = ("srcs", "outs")

    def __init__(self, srcs, outs):
        self.srcs, self.outs = tuple(srcs), tuple(outs)

    @property
    def device(self) -> torch.device:
        return self.srcs[0].device


class GemmCall:
    """``A @ B.T (+ bias)`` of MX, FP8 or plain operands: :func:`mxtrain.kernels.dispatch.mx_gemm`'s arguments.

    ``out``: where the caller wants the result (a row-contiguous ``[M, N]`` tensor of ``out_dtype``, e.g. one
    expert's rows of GroupedLinear's output). An implementation may write it there and return it; one that
    returns another tensor has it copied there by :func:`~mxtrain.kernels.dispatch.mx_gemm`."""

    __slots__ = ("a", "b", "a_axis", "b_axis", "out_dtype", "bias", "out")

    def __init__(self, a, b, a_axis=1, b_axis=1, out_dtype=torch.float32, bias=None, out=None):
        self.a, self.b, self.a_axis, self.b_axis, self.out_dtype, self.bias = a, b, a_axis, b_axis, out_dtype, bias
        self.out = out

    @property
    def device(self) -> torch.device:
        return self.a.device if hasattr(self.a, "device") else torch.device("cpu")

    def kwargs(self) -> dict:
        return dict(a_axis=self.a_axis, b_axis=self.b_axis, out_dtype=self.out_dtype, bias=self.bias)
