"""MXTensor: MX element codes and their E8M0 scale bytes, owned together.

The scale-inverse never lives apart from the bits it decodes (the lesson of
Transformer Engine PR 1083): an :class:`MXTensor` is produced whole by a
quantizer (reference or kernel) and consumed whole by dequantize, GEMM and
communication.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mxtrain.formats import ELEMENT_FORMATS, MX_FORMAT_NAMES, ElemFormat, parse_format
from mxtrain.quantization._validate import ROUNDINGS, SCALE_MODES, SUPPORTED_DTYPES, check_dequantize_dtype
from mxtrain.quantization.dequantize import dequantize_plane
from mxtrain.quantization.packing import packed_length, unpack_codes

__all__ = ["MXPlane", "MXTensor"]


@dataclass(frozen=True)
class MXPlane:
    """One orientation of an MX tensor.

    Attributes:
        data: uint8 codes with the block axis moved last and zero-padded to
            ``nblocks * block_size`` (packed along it when ``packed``).
        scale: uint8 E8M0 bytes ``[..., nblocks]`` (same leading dims as ``data``).
        axis: the block axis in the logical tensor (non-negative).
        packed: whether sub-byte codes are packed.
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: int
    packed: bool

    def to(self, *args, **kwargs) -> "MXPlane":
        return replace(self, data=self.data.to(*args, **kwargs), scale=self.scale.to(*args, **kwargs))


class PlaneLookup:
    """``rowwise`` / ``columnwise`` of a quantized tensor holding ``planes`` (each with an ``axis``) and ``ndim``:
    shared by :class:`MXTensor` and :class:`~mxtrain.quantization.float8.Float8Tensor`."""

    def _find(self, axis: int):
        for p in self.planes:
            if p.axis == axis:
                return p
        return None

    def _plane_at(self, axis: int | None):
        """The plane for ``axis`` (negative counts from the end; the first plane when None), or None."""
        if axis is None:
            return self.planes[0]
        return self._find(axis % self.ndim if self.ndim else axis)

    @property
    def rowwise(self):
        """The plane blocked along the last axis, or None."""
        return self._find(self.ndim - 1)

    @property
    def columnwise(self):
        """The plane blocked along axis 0 of a 2-D+ tensor (the transpose the GEMMs read), or None."""
        return self._find(0) if self.ndim >= 2 else None


@dataclass(frozen=True)
class MXTensor(PlaneLookup):
    """An MX-quantized tensor: one or more planes (block orientations) of codes with their scales.

    ``rowwise`` is the plane blocked along the last axis, ``columnwise`` the one
    blocked along the first axis of a 2-D tensor (what the transposed GEMM
    operand needs). ``shape`` and ``dtype`` are the logical (original) ones.

    ``values`` (optional, default empty) carries, for some block axes, the
    dequantized values of that plane: ``((axis, tensor), ...)`` with each tensor
    in the logical shape (as :meth:`dequantize` returns it), written by a cast
    that dequantized while it quantized (``mxtrain.kernels.dispatch.quantize(...,
    dequantized=...)``), so a GEMM that uses the plane right away skips the
    dequantize pass. They equal ``dequantize(tensor.dtype, axis)`` bit for bit.
    A plane may be carried by its values alone (its codes were never needed
    later, e.g. a forward GEMM operand): then ``planes`` may be empty, and
    :meth:`dequantize` of that axis returns the values cast to the asked dtype
    (exact when the values are fp32, or bf16 from a bf16 input: every MX value
    of a bf16 input is exact in bf16). ``nbytes`` counts codes and scales only.

    ``MXTensor(...)`` checks every field (a known format, uint8 codes and scale bytes, shapes that
    agree); kernels that have just written the parts build it with ``MXTensor._unchecked``.
    """

    planes: tuple[MXPlane, ...]
    fmt: str
    block_size: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    scale_mode: str = "floor"
    rounding: str = "even"
    whole_axis: bool = False
    values: tuple = ()

    def __post_init__(self):
        self._check_fields()
        if not self.planes and not self.values:
            raise ValueError("an MXTensor needs at least one plane (or the dequantized values of one)")
        axes = [p.axis for p in self.planes]
        if len(set(axes)) != len(axes):
            raise ValueError(f"planes must have distinct axes, got {axes}")
        vaxes = []
        for entry in self.values:
            if (not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], int)
                    or not isinstance(entry[1], torch.Tensor)):
                raise TypeError("values must be a tuple of (axis, tensor) pairs")
            if tuple(entry[1].shape) != tuple(self.shape):
                raise ValueError(f"dequantized values of shape {list(entry[1].shape)} for an MXTensor of shape "
                                 f"{list(self.shape)}")
            vaxes.append(entry[0])
        if len(set(vaxes)) != len(vaxes):
            raise ValueError(f"values must have distinct axes, got {vaxes}")

    def _check_fields(self) -> None:
        """The public constructor's checks: every field of the right kind, planes consistent with the shape."""
        fmt = self.fmt.name if isinstance(self.fmt, ElemFormat) else self.fmt
        try:
            fmt = parse_format(fmt).name if isinstance(fmt, str) else None
        except ValueError:
            fmt = None
        if fmt not in ELEMENT_FORMATS:
            raise ValueError(f"MXTensor.fmt must name an MX element format ({', '.join(MX_FORMAT_NAMES)}), "
                             f"got {self.fmt!r}")
        object.__setattr__(self, "fmt", fmt)
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"MXTensor.block_size must be a positive int (elements per scale), got {bs!r}")
        if not isinstance(self.shape, (tuple, torch.Size)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.shape):
            raise ValueError(f"MXTensor.shape must be a tuple of non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"MXTensor.dtype (the dtype that was quantized) must be one of "
                            f"{', '.join(map(str, SUPPORTED_DTYPES))}, got {self.dtype!r}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"MXTensor.scale_mode must be one of {', '.join(SCALE_MODES)}, got {self.scale_mode!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"MXTensor.rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if not isinstance(self.planes, tuple) or not isinstance(self.values, tuple):
            raise TypeError("MXTensor.planes and MXTensor.values must be tuples")
        for p in self.planes:
            self._check_plane(p)

    def _check_plane(self, p) -> None:
        if not isinstance(p, MXPlane):
            raise TypeError(f"MXTensor.planes must hold MXPlane objects, got {type(p).__name__}")
        ndim = len(self.shape)
        if isinstance(p.axis, bool) or not isinstance(p.axis, int) or not 0 <= p.axis < max(ndim, 1):
            raise ValueError(f"MXPlane.axis must be an int in [0, {max(ndim, 1) - 1}] for shape {list(self.shape)}, "
                             f"got {p.axis!r}")
        for name in ("data", "scale"):
            t = getattr(p, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
                what = "integer element codes" if name == "data" else "E8M0 scale bytes"
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"MXPlane.{name} must be a torch.uint8 tensor ({what}), got {got}")
        if p.data.device != p.scale.device:
            raise ValueError(f"MXPlane.data and .scale must be on one device, got {p.data.device} and {p.scale.device}")
        lead = self.shape[:p.axis] + self.shape[p.axis + 1:]
        length = self.shape[p.axis] if ndim else 1
        bs = max(length, 1) if self.whole_axis else self.block_size
        nblocks = -(-length // bs)
        codes = nblocks * bs
        if p.packed:
            try:
                codes = packed_length(codes, self.fmt)
            except ValueError as err:
                raise ValueError(f"MXPlane packed: {err}") from None
        want_data, want_scale = [*lead, codes], [*lead, nblocks]
        if list(p.data.shape) != want_data or list(p.scale.shape) != want_scale:
            raise ValueError(f"an MXTensor of shape {list(self.shape)}, {self.fmt}, block {bs} along axis {p.axis} "
                             f"({'packed' if p.packed else 'unpacked'}) needs data {want_data} and scale "
                             f"{want_scale}, got data {list(p.data.shape)} and scale {list(p.scale.shape)}")

    @classmethod
    def _unchecked(cls, planes: tuple, fmt: str, block_size: int, shape: tuple, dtype: torch.dtype,
                   scale_mode: str = "floor", rounding: str = "even", whole_axis: bool = False,
                   values: tuple = ()) -> MXTensor:
        """An MXTensor from parts a kernel has just written, without the checks of ``__init__``
        (the casts' hot path: those parts are correct by construction). Anything else builds it
        with ``MXTensor(...)``."""
        if torch.compiler.is_compiling():  # dynamo (torch 2.11) cannot trace the __dict__ update; checks are free there
            return cls(planes, fmt, block_size, shape, dtype, scale_mode, rounding, whole_axis, values)
        self = object.__new__(cls)
        self.__dict__.update(planes=planes, fmt=fmt, block_size=block_size, shape=shape, dtype=dtype,
                             scale_mode=scale_mode, rounding=rounding, whole_axis=whole_axis, values=values)
        return self

    def _only(self, planes: tuple = (), values: tuple = ()) -> MXTensor:
        """This tensor holding only the given planes / values (a subset of its own: unchecked)."""
        return MXTensor._unchecked(planes, self.fmt, self.block_size, self.shape, self.dtype, self.scale_mode,
                                   self.rounding, self.whole_axis, values)

    @property
    def format(self) -> ElemFormat:
        return parse_format(self.fmt)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        return self.planes[0].data.device if self.planes else self.values[0][1].device

    def plane(self, axis: int | None = None) -> MXPlane:
        """The plane blocked along ``axis`` (the first plane when None)."""
        p = self._plane_at(axis)
        if p is not None:
            return p
        raise ValueError(f"this MXTensor has no plane (codes) blocked along axis {axis}; "
                         f"it has planes along {[p.axis for p in self.planes]}"
                         + (f" and dequantized values along {[a for a, _ in self.values]}" if self.values else ""))

    def dequantized_values(self, axis: int) -> torch.Tensor | None:
        """The carried dequantized values of the plane blocked along ``axis`` (logical shape), or None."""
        ax = axis % self.ndim if self.ndim else axis
        return next((v for a, v in self.values if a == ax), None)

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales over all planes."""
        return sum(p.data.numel() * p.data.element_size() + p.scale.numel() for p in self.planes)

    def codes(self, axis: int | None = None) -> torch.Tensor:
        """Unpacked uint8 codes of a plane, in its stored layout (block axis last, padded)."""
        p = self.plane(axis)
        return unpack_codes(p.data, self.format) if p.packed else p.data

    def dequantize(self, dtype: torch.dtype | None = None, axis: int | None = None) -> torch.Tensor:
        """The values ``code * 2**X`` in the logical shape (exact in fp32), cast to ``dtype``.

        ``dtype`` defaults to the dtype that was quantized. Casting to bf16/fp16
        rounds only where a value falls outside their range or below their
        subnormals (tiny scales); fp32 is always exact. A plane carried only by
        its dequantized values (see ``values``) returns those, cast to ``dtype``.
        """
        check_dequantize_dtype(dtype)
        carried = self.values_only(axis)
        if carried is not None:
            return carried[1].to(dtype or self.dtype)
        p = self.plane(axis)
        return self.dequantize_blocked(dtype, p.axis).movedim(-1, p.axis)

    def values_only(self, axis: int | None = None) -> tuple[int, torch.Tensor] | None:
        """``(axis, values)`` when the plane along ``axis`` is carried by its dequantized values
        without its codes, else None (``axis`` None: the first plane, as :meth:`plane`)."""
        if axis is None:
            return self.values[0] if not self.planes and self.values else None
        ax = axis % self.ndim if self.ndim else axis
        if self._find(ax) is not None:
            return None
        return next(((a, v) for a, v in self.values if a == ax), None)

    def dequantize_blocked(self, dtype: torch.dtype | None = None, axis: int | None = None) -> torch.Tensor:
        """Like :meth:`dequantize` but in the plane's stored layout: the block axis last, unpadded.

        For the columnwise plane of a 2-D ``[M, K]`` tensor this is the ``[K, M]``
        transpose, which is the operand layout a GEMM reducing over M wants.
        """
        check_dequantize_dtype(dtype)
        carried = self.values_only(axis)
        if carried is not None:
            # contiguous, as the codes path returns it (a GEMM on it then runs the same way)
            return carried[1].to(dtype or self.dtype).movedim(carried[0], -1).contiguous()
        p = self.plane(axis)
        moved = list(self.shape)
        length = moved.pop(p.axis)
        values = dequantize_plane(p.data, p.scale, self.format, p.packed, length, dtype or self.dtype)
        return values.reshape(*moved, length)

    def to(self, *args, **kwargs) -> "MXTensor":
        """Move every plane (codes and scales together, and carried values) to a device."""
        return replace(self, planes=tuple(p.to(*args, **kwargs) for p in self.planes),
                       values=tuple((a, v.to(*args, **kwargs)) for a, v in self.values))

    def cpu(self) -> "MXTensor":
        return self.to("cpu")

    def cuda(self, device=None) -> "MXTensor":
        return self.to(device or "cuda")

    def __repr__(self) -> str:
        orient = []
        for p in self.planes:
            name = "rowwise" if p.axis == self.ndim - 1 else ("columnwise" if p.axis == 0 else f"axis={p.axis}")
            orient.append(f"{name}: data{list(p.data.shape)}{' packed' if p.packed else ''} "
                          f"scale{list(p.scale.shape)}")
        for a, v in self.values:
            name = "rowwise" if a == self.ndim - 1 else ("columnwise" if a == 0 else f"axis={a}")
            orient.append(f"{name} dequantized values: {v.dtype}")
        block = "whole-axis" if self.whole_axis else str(self.block_size)
        return (f"MXTensor({self.fmt}, shape={list(self.shape)}, dtype={self.dtype}, block={block}, "
                f"scale_mode={self.scale_mode}, rounding={self.rounding}, device={self.device}, "
                f"nbytes={self.nbytes}, planes=[{'; '.join(orient)}])")


def _register_safe_globals() -> None:
    # torch.load(weights_only=True) (the default) accepts these classes
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add([MXTensor, MXPlane])


_register_safe_globals()
