"""Reference FP8 numerics for the Hopper recipes: scales, saturating casts, ``Float8Tensor``, delayed-scaling state.

Per-tensor scaling (current and delayed) and block scaling (1x128, 128x128) in
plain PyTorch; the Triton casts (mxtrain/kernels/float8_cast.py) are tested
bit-for-bit against these functions.

Numerics (Transformer Engine's, written out):

* ``amax``: max |x| in fp32; a NaN anywhere makes it +Inf (a non-finite amax).
* current / block scale: ``amax`` raised to ``amax_epsilon``; 0 or non-finite
  amax -> 1; else ``max_fp8 / amax`` in fp32 (an Inf quotient -> fp32 max).
* delayed scale: ``max_fp8 / amax / 2**margin``; 0 or non-finite amax keeps the
  previous scale; an Inf quotient -> fp32 max.
* power-of-two scales: the scale rounded *down* to a power of two (never overflows).
* cast: ``clamp(x * scale, -max_fp8, max_fp8)`` in fp32, then to the float8
  dtype (round to nearest even). NaN stays NaN, and a ±Inf source value becomes
  NaN (Transformer Engine saturates it to ±max_fp8; here, as in the MX formats,
  a non-finite value reaches the GEMM result so a loss scaler or NaN check sees
  it). A finite value whose product with the scale overflows still saturates.
* ``scale_inv = 1 / scale`` in fp32; dequantize is ``fp8 * scale_inv`` in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mxtrain.formats import ELEMENT_FORMATS
from mxtrain.quantization._validate import check_dequantize_dtype
from mxtrain.quantization.mxtensor import PlaneLookup

__all__ = [
    "FP8_DTYPES", "FP8_MAX", "Float8Plane", "Float8Tensor", "DelayedScalingState", "delayed_scaling_update_",
    "delayed_scaling_record_",
    "fp8_format_name", "tensor_amax", "block_amax", "compute_scale", "compute_delayed_scale",
    "round_scale_down_to_power_of_2", "amax_from_history", "cast_to_fp8", "quantize_float8",
    "fake_quantize_float8", "all_reduce_amax",
]

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {name: ELEMENT_FORMATS[name].max_norm for name in FP8_DTYPES}  # 448 and 57344
_FP32_MAX = torch.finfo(torch.float32).max
_ALIASES = {"e4m3": "fp8_e4m3", "e4m3fn": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
            "e5m2": "fp8_e5m2", "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2"}


def fp8_format_name(fmt) -> str:
    """``"fp8_e4m3"`` or ``"fp8_e5m2"`` from a name (``"e4m3"``...) or a torch float8 dtype."""
    if isinstance(fmt, torch.dtype):
        for name, dtype in FP8_DTYPES.items():
            if dtype == fmt:
                return name
        raise ValueError(f"not an FP8 dtype mxtrain casts to: {fmt} (use torch.float8_e4m3fn or float8_e5m2)")
    key = str(fmt).strip().lower()
    if key not in _ALIASES:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected 'fp8_e4m3' or 'fp8_e5m2'")
    return _ALIASES[key]


# --- amax and scales -----------------------------------------------------------------------


def _nan_to_inf(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor (0 for an empty tensor, +Inf when x holds a NaN)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)  # one reduction pass, no |x| temporary, NaN propagates
    return _nan_to_inf(torch.maximum(hi.float(), -lo.float()).abs())  # abs: +0, never -0


def all_reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (MAX) ``amax`` in place over ``group`` (a no-op for None or a one-rank group)."""
    if group is None:
        return amax
    import torch.distributed as dist
    if dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _padded_blocks(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x2d`` zero-padded to whole blocks and viewed as ``[R/br, br, C/bc, bc]``."""
    br, bc = block
    rows, cols = x2d.shape
    pr, pc = -rows % br, -cols % bc
    if pr or pc:
        x2d = torch.nn.functional.pad(x2d, (0, pc, 0, pr))
    return x2d.reshape((rows + pr) // br, br, (cols + pc) // bc, bc)


def block_amax(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| per ``block`` of a 2-D tensor: fp32 ``[ceil(R/br), ceil(C/bc)]`` (+Inf for a block with NaN)."""
    blocks = _padded_blocks(x2d, block)
    return _nan_to_inf(blocks.abs().float().amax(dim=(1, 3)))


def round_scale_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= each (positive, normal, finite) fp32 scale: its mantissa bits cleared."""
    bits = scale.float().view(torch.int32) & -(1 << 23)  # a Python int: no host-to-device copy
    return bits.view(torch.float32)


def compute_scale(amax: torch.Tensor, fp8_max: float, *, power_of_2: bool = False,
                  epsilon: float = 0.0) -> torch.Tensor:
    """Current / block scaling: ``fp8_max / max(amax, epsilon)``; 1 for a zero or non-finite amax."""
    amax = amax.float()
    if epsilon > 0:
        amax = torch.clamp_min(amax, epsilon)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    bad = (amax == 0) | ~torch.isfinite(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    return round_scale_down_to_power_of_2(scale) if power_of_2 else scale


def compute_delayed_scale(amax: torch.Tensor, previous: torch.Tensor, fp8_max, *, margin: int = 0,
                          power_of_2: bool = False) -> torch.Tensor:
    """Delayed scaling: ``fp8_max / amax / 2**margin``; where amax is 0 or non-finite, ``previous``.

    ``fp8_max`` is a float or a tensor broadcasting against ``amax`` (one per tensor slot).
    """
    amax = amax.float()
    fp8_max = torch.as_tensor(fp8_max, dtype=torch.float32, device=amax.device)
    scale = (fp8_max / amax) / (2.0 ** margin)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    if power_of_2:
        scale = round_scale_down_to_power_of_2(scale)
    keep = (amax == 0) | ~torch.isfinite(amax)
    return torch.where(keep, previous.float(), scale)


def amax_from_history(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a delayed scale uses: ``"max"`` over the history (newest first, dim 0), or ``"most_recent"``."""
    if algo == "max":
        return history.amax(dim=0)
    if algo == "most_recent":
        return history[0]
    raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {algo!r}")


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturating cast ``clamp(x * scale, ±max) -> float8`` (round to nearest even); a NaN or ±Inf
    element of ``x`` becomes NaN (non-finite values propagate; see the module docstring)."""
    fmax = FP8_MAX[fmt]
    xf = x.float()
    y = (xf * scale).clamp_(-fmax, fmax)
    return y.masked_fill_(xf.isinf(), float("nan")).to(FP8_DTYPES[fmt])


# --- the quantized tensor -----------------------------------------------------------------


@dataclass(frozen=True)
class Float8Plane:
    """One orientation of an FP8 tensor: the data a GEMM reads and its scale-inverse.

    Attributes:
        data: float8 values in the layout the GEMM reads, the reduction axis last:
            the logical layout for ``axis == ndim - 1`` (rowwise), the ``[K, M]``
            transpose of a 2-D ``[M, K]`` tensor for ``axis == 0`` (columnwise).
        scale_inv: fp32 dequantization factor: a 0-d tensor for per-tensor
            scaling, else ``[ceil(R/br), ceil(C/bc)]`` for ``data`` of shape
            ``[R, C]`` and ``block == (br, bc)``.
        axis: the logical axis this plane reduces over.
        block: ``(br, bc)`` in ``data``'s layout, or None (one scale).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    axis: int
    block: tuple[int, int] | None = None

    def to(self, *args, **kwargs) -> "Float8Plane":
        return replace(self, data=self.data.to(*args, **kwargs), scale_inv=self.scale_inv.to(*args, **kwargs))

    def values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` in fp32 (in ``data``'s layout), cast to ``dtype``."""
        v = self.data.float()
        if self.block is None:
            v = v * self.scale_inv
        else:
            (br, bc), (rows, cols) = self.block, v.shape
            s = self.scale_inv
            if br > 1:
                s = s.repeat_interleave(br, dim=0)[:rows]
            if bc > 1:
                s = s.repeat_interleave(bc, dim=1)[:, :cols]
            v = v * s
        return v.to(dtype)


@dataclass(frozen=True)
class Float8Tensor(PlaneLookup):
    """FP8 data with its scale-inverse, in one or two orientations, owned together.

    Made whole by a cast (:func:`quantize_float8` or its Triton twin) and consumed
    whole by ``mx_gemm``: the scale-inverse never travels apart from the bits it
    decodes (Transformer Engine PR 1083). With per-tensor scaling both planes share
    one ``scale_inv``; the columnwise plane is the transpose Hopper's TN-only FP8
    GEMM needs, written by the same cast.

    Attributes:
        planes: one or two :class:`Float8Plane` (distinct ``axis``).
        fmt: ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        shape, dtype: the logical (source) shape and dtype.
        amax: per-tensor scaling: the source's amax (fp32 0-d, +Inf with a NaN),
            what delayed scaling records; None for block scaling.
    """

    planes: tuple[Float8Plane, ...]
    fmt: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    amax: torch.Tensor | None = None

    def __post_init__(self):
        if not self.planes:
            raise ValueError("a Float8Tensor needs at least one plane")
        axes = [p.axis for p in self.planes]
        if len(set(axes)) != len(axes):
            raise ValueError(f"planes must have distinct axes, got {axes}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        return self.planes[0].data.device

    @property
    def fp8_dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.fmt]

    @property
    def block(self) -> tuple[int, int] | None:
        return self.planes[0].block

    @property
    def scale_inv(self) -> torch.Tensor:
        """The scale-inverse of the first plane (the only one, shared, for per-tensor scaling)."""
        return self.planes[0].scale_inv

    def plane(self, axis: int | None = None) -> Float8Plane:
        """The plane reducing over ``axis`` (the first plane when None)."""
        p = self._plane_at(axis)
        if p is not None:
            return p
        raise ValueError(f"this Float8Tensor has no plane for axis {axis}; it has planes for "
                         f"{[p.axis for p in self.planes]}")

    @property
    def nbytes(self) -> int:
        """Bytes of data plus scale-inverses over all planes (a shared scale counted once)."""
        seen, total = set(), 0
        for p in self.planes:
            total += p.data.numel() * p.data.element_size()
            if id(p.scale_inv) not in seen:
                seen.add(id(p.scale_inv))
                total += p.scale_inv.numel() * 4
        return total

    def dequantize_blocked(self, dtype: torch.dtype | None = None, axis: int | None = None) -> torch.Tensor:
        """The values of one plane in its stored layout (reduction axis last): ``[K, M]`` for columnwise."""
        check_dequantize_dtype(dtype)
        return self.plane(axis).values(dtype or self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None, axis: int | None = None) -> torch.Tensor:
        """The values of one plane in the logical shape, cast to ``dtype`` (default: the source dtype)."""
        check_dequantize_dtype(dtype)
        p = self.plane(axis)
        v = p.values(dtype or self.dtype)
        return v.t() if (self.ndim >= 2 and p.axis == 0) else v

    def only(self, axis: int) -> "Float8Tensor":
        """A Float8Tensor holding just the plane for ``axis`` (what a use keeps, not both)."""
        if len(self.planes) == 1:
            return self
        # built directly: dataclasses.replace walks the fields on every call (twice per GEMM operand)
        return Float8Tensor((self.plane(axis),), self.fmt, self.shape, self.dtype, self.amax)

    def to(self, *args, **kwargs) -> "Float8Tensor":
        return replace(self, planes=tuple(p.to(*args, **kwargs) for p in self.planes),
                       amax=None if self.amax is None else self.amax.to(*args, **kwargs))

    def __repr__(self) -> str:
        orient = []
        for p in self.planes:
            name = "rowwise" if p.axis == self.ndim - 1 else ("columnwise" if p.axis == 0 else f"axis={p.axis}")
            orient.append(f"{name}: data{list(p.data.shape)} scale_inv{list(p.scale_inv.shape)}")
        scaling = "per-tensor" if self.block is None else f"block {self.block[0]}x{self.block[1]}"
        return (f"Float8Tensor({self.fmt}, {scaling}, shape={list(self.shape)}, dtype={self.dtype}, "
                f"{'; '.join(orient)})")


# --- quantize -------------------------------------------------------------------------------


def _normalize_axes(axes, ndim: int) -> tuple[int, ...]:
    if isinstance(axes, int):
        axes = (axes,)
    out = []
    for a in axes:
        if not -max(ndim, 1) <= a < max(ndim, 1):
            raise ValueError(f"axis {a} out of range for a {ndim}-D tensor")
        a = a % max(ndim, 1)
        if a != max(ndim - 1, 0) and not (ndim == 2 and a == 0):
            raise ValueError(f"FP8 planes reduce over the last axis, or axis 0 of a 2-D tensor (the "
                             f"transpose); got axis {a} for a {ndim}-D tensor")
        if a not in out:
            out.append(a)
    if not out:
        raise ValueError("quantize_float8 needs at least one axis")
    return tuple(out)


def _check_block(block, ndim: int) -> tuple[int, int] | None:
    if block is None:
        return None
    block = tuple(int(b) for b in block)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be (rows, cols) of positive ints, got {block!r}")
    if ndim != 2:
        raise ValueError(f"block scaling needs a 2-D tensor, got {ndim}-D")
    return block


def _cast_blocks(x2d: torch.Tensor, fmt: str, block, power_of_2: bool, epsilon: float):
    """(data, scale_inv) of a 2-D tensor with one scale per ``block``."""
    blocks = _padded_blocks(x2d, block)
    amax = _nan_to_inf(blocks.abs().float().amax(dim=(1, 3)))
    scale = compute_scale(amax, FP8_MAX[fmt], power_of_2=power_of_2, epsilon=epsilon)
    data = cast_to_fp8(blocks, scale[:, None, :, None], fmt)
    rows, cols = x2d.shape
    data = data.reshape(blocks.shape[0] * blocks.shape[1], -1)[:rows, :cols]
    return data.contiguous(), torch.reciprocal(scale)


def quantize_float8(x: torch.Tensor, fmt="fp8_e4m3", *, axes=-1, scale: torch.Tensor | None = None,
                    block=None, power_of_2_scales: bool = False, amax_epsilon: float = 0.0,
                    amax_reduction_group=None) -> Float8Tensor:
    """Cast ``x`` to FP8 with its scale-inverse, one plane per axis in ``axes``.

    Args:
        x: fp32 / bf16 / fp16 tensor. Columnwise planes (``axis=0``) and block
            scaling need it 2-D.
        fmt: ``"fp8_e4m3"`` or ``"fp8_e5m2"`` (or a torch float8 dtype).
        axes: the reduction axes the planes serve: ``-1`` (rowwise), ``0``
            (columnwise: the transpose), or both ``(1, 0)``, written by one call.
        scale: per-tensor scale to use (delayed scaling); None computes it from
            ``x`` (current scaling), after all-reducing the amax over
            ``amax_reduction_group``. Ignored with ``block``.
        block: None (one scale per tensor), or ``(br, bc)`` blocks in each plane's
            layout (reduction axis last): ``(1, 128)`` gives each plane its own
            scales along its reduction axis; a square block ``(128, 128)`` is cast
            once and its columnwise plane is the transpose of data and scales.
        power_of_2_scales, amax_epsilon: see the module docstring.

    Returns a :class:`Float8Tensor` whose ``amax`` is the per-tensor amax (reduced
    over the group when current scaling computed it; local when ``scale`` was given).
    """
    fmt = fp8_format_name(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize_float8 expects a floating-point tensor, got "
                        f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    axes = _normalize_axes(axes, x.ndim)
    block = _check_block(block, x.ndim)
    last = max(x.ndim - 1, 0)
    if block is not None:
        return _quantize_blocks(x, fmt, axes, block, power_of_2_scales, amax_epsilon)
    amax = tensor_amax(x)
    if scale is None:
        all_reduce_amax(amax, amax_reduction_group)
        scale = compute_scale(amax, FP8_MAX[fmt], power_of_2=power_of_2_scales, epsilon=amax_epsilon)
    else:
        scale = scale.to(device=x.device, dtype=torch.float32).reshape(())
    scale_inv = torch.reciprocal(scale)
    data = cast_to_fp8(x, scale, fmt)
    planes = []
    for a in axes:
        planes.append(Float8Plane(data if a == last else data.t().contiguous(), scale_inv, a))
    return Float8Tensor(tuple(planes), fmt, tuple(x.shape), x.dtype, amax)


def _quantize_blocks(x, fmt, axes, block, power_of_2, epsilon) -> Float8Tensor:
    planes = []
    if block[0] == block[1]:  # a square block is the same block in both layouts: cast once
        data, scale_inv = _cast_blocks(x, fmt, block, power_of_2, epsilon)
        for a in axes:
            if a == 1:
                planes.append(Float8Plane(data, scale_inv, 1, block))
            else:
                planes.append(Float8Plane(data.t().contiguous(), scale_inv.t().contiguous(), 0, block))
    else:
        for a in axes:
            src = x if a == 1 else x.t()
            data, scale_inv = _cast_blocks(src, fmt, block, power_of_2, epsilon)
            planes.append(Float8Plane(data, scale_inv, a, block))
    return Float8Tensor(tuple(planes), fmt, tuple(x.shape), x.dtype, None)


def fake_quantize_float8(x: torch.Tensor, fmt="fp8_e4m3", *, axis: int = -1, **kwargs) -> torch.Tensor:
    """Quantize then dequantize, in ``x``'s logical shape and dtype (fp32 values cast to ``x.dtype``)."""
    return quantize_float8(x, fmt, axes=axis, **kwargs).dequantize(x.dtype, axis)


# --- delayed scaling state ------------------------------------------------------------------


# device type -> fused update with delayed_scaling_update_'s signature, in place and bit-identical to it
# (mxtrain.kernels.float8_state registers the CUDA one and the registered ops used under torch.compile)
_FUSED_DELAYED_UPDATES: dict = {}
_DELAYED_OPS: dict = {}  # "update" / "record": the registered ops (torch.ops.mxtrain.*), for torch.compile


def register_fused_delayed_update(device_type: str, fn) -> None:
    _FUSED_DELAYED_UPDATES[device_type] = fn


def register_delayed_scaling_ops(update, record) -> None:
    """The registered (compilable) forms of :func:`delayed_scaling_update_` and :func:`delayed_scaling_record_`."""
    _DELAYED_OPS.update(update=update, record=record)


def _recorded(stamp: torch.Tensor, gen: torch.Tensor) -> torch.Tensor:
    return stamp == gen


def delayed_scaling_update_(history, scale, gen, fwd_amax, fwd_stamp, grad_amax, grad_stamp, fp8_max, margin: int,
                            most_recent: bool, power_of_2: bool, reduce=None) -> None:
    """DelayedScaling's step, in place and on the device (no host reads): every slot recorded since the last
    update (its stamp equals ``gen``) pushes its amax into its history column (newest first) and gets
    ``compute_delayed_scale`` of the history's max (or newest); other slots keep both; ``gen`` += 1 if any
    slot was recorded.
    ``reduce(amax)``: all-reduce the amaxes (MAX) first, in place (eager only)."""
    fwd, bwd = _recorded(fwd_stamp, gen), _recorded(grad_stamp, gen)
    recorded = fwd | bwd
    amax = torch.where(fwd, fwd_amax, torch.where(bwd, grad_amax, torch.zeros_like(grad_amax)))
    if reduce is not None:
        reduce(amax)
    rolled = torch.cat([amax[None], history[:-1]], 0)
    hist = torch.where(recorded[None], rolled, history)
    new = compute_delayed_scale(hist[0] if most_recent else hist.amax(dim=0), scale, fp8_max, margin=margin,
                                power_of_2=power_of_2)
    history.copy_(hist)
    scale.copy_(torch.where(recorded, new, scale))
    gen.add_(recorded.any().to(gen.dtype))


def _even_slice(idx: list[int]) -> slice | None:
    """``slice(a, b, step)`` selecting exactly the columns ``idx`` in order (evenly spaced, increasing); None if none
    does."""
    if not idx:
        return None
    step = idx[1] - idx[0] if len(idx) > 1 else 1
    if step < 1 or any(i != idx[0] + j * step for j, i in enumerate(idx)):
        return None
    return slice(idx[0], idx[-1] + 1, step)


def delayed_scaling_record_(amax_buf, stamp, gen, index: int, amax) -> None:
    """Keep ``amax`` for slot ``index`` (the max with amaxes recorded since the last update), in place."""
    a = amax.to(amax_buf.device, torch.float32).reshape(())
    same = stamp[index] == gen
    amax_buf[index] = torch.where(same, torch.maximum(amax_buf[index], a), a)
    stamp[index] = gen


class DelayedScalingState:
    """One module's delayed-scaling state: per tensor slot, an amax history and the current scale.

    Slots are named by the module (``"input"``, ``"fc1.weight"``, ``"fc2.grad_output"``...)
    and created on first use with scale 1 and an all-zero history. A cast with the
    slot's scale :meth:`record`\\ s the tensor's amax (the max of all casts since the
    last update); :meth:`update`, run at the start of the module's next forward,
    pushes each recorded amax into its history (newest first), all-reduces them
    over the recipe's ``amax_reduction_group`` and recomputes the scales
    (:func:`compute_delayed_scale`). Slots not recorded since the last update keep
    their history and scale.

    Whether a slot was recorded lives on the device (a stamp per slot against the update count ``gen``), so
    that the update reads nothing on the host (CUDA-graph capture) and is one registered op under
    torch.compile. Amaxes of gradients (slots ``*grad_output``, cast in backward) are kept apart from those of
    forward casts: a compiled graph may not write one tensor in both passes.

    Tensors live on the device of the first tensor cast and follow the data
    if it moves (modules move a loaded state to their parameters' device before
    its first update: :meth:`to`). :meth:`state_dict` / :meth:`load_state_dict`
    round-trip everything, pending amaxes included, so a checkpoint resumes exactly.
    """

    kind = "DelayedScaling"
    version = 1
    _TENSORS = ("amax_history", "scale", "fp8_max", "fwd_amax", "fwd_stamp", "grad_amax", "grad_stamp", "gen")

    def __init__(self, history_len: int) -> None:
        self.history_len = int(history_len)
        self.slots: dict[str, int] = {}
        self.formats: list[str] = []
        self.amax_history = torch.zeros(self.history_len, 0)
        self.scale = torch.ones(0)
        self.fp8_max = torch.zeros(0)
        self.fwd_amax, self.grad_amax = torch.zeros(0), torch.zeros(0)
        self.fwd_stamp = torch.zeros(0, dtype=torch.int64)
        self.grad_stamp = torch.zeros(0, dtype=torch.int64)
        self.gen = torch.zeros((), dtype=torch.int64)  # updates so far; a slot's stamp == gen: recorded since
        self._updates = 0  # gen on the host, while only eager updates ran (no device read for `updates`)
        self._dirty = False  # an eager record since the last eager update (then gen moves)
        self._compiled_updates = False
        # host-side: slots whose recorded amax has entered the history (an eager update found it); the others
        # are "fresh" and their casts take the scale from the tensor itself (see scale_for)
        self._seasoned: set[str] = set()
        self._recorded_host: set[str] = set()
        self._margin, self._power_of_2, self._group = 0, False, None  # the recipe's, as of the last update

    # -- slots

    def to(self, device: torch.device) -> "DelayedScalingState":
        """Move the histories, scales and pending amaxes to ``device`` (values unchanged); returns self."""
        device = torch.device(device)
        if self.scale.device != device:
            for name in self._TENSORS:
                setattr(self, name, getattr(self, name).to(device))
        return self

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state keeps (histories, scales, amaxes recorded, stamps, the update count)."""
        return [getattr(self, name) for name in self._TENSORS]

    def ensure_slots(self, slots, device: torch.device | None = None) -> None:
        """Create the slots ``((name, fmt), ...)`` that do not exist yet (and follow a changed format), on
        ``device`` (default: where the state is). Under torch.compile this runs while tracing, so the
        tensors are the graph's inputs."""
        device = self.scale.device if device is None else torch.device(device)
        if self.scale.device == device and all(self.slots.get(n) is not None and self.formats[self.slots[n]] == f
                                               for n, f in slots):
            return
        if torch.compiler.is_compiling():
            self._not_made_while_tracing([n for n, _ in slots])
        self._ensure_slots(slots, device)

    def _ensure_slots(self, slots, device: torch.device) -> None:
        for slot, fmt in slots:
            self._index_now(slot, fmt, device)

    def index(self, slot: str, fmt: str, device: torch.device) -> int:
        """The column of ``slot`` (created with scale 1 and an empty history on first use)."""
        i = self.slots.get(slot)
        if i is not None and self.formats[i] == fmt and self.scale.device == device:
            return i
        if torch.compiler.is_compiling():
            self._not_made_while_tracing([slot])
        return self._index_now(slot, fmt, device)

    def _not_made_while_tracing(self, names) -> None:
        raise NotImplementedError(
            f"DelayedScaling under torch.compile: the state slots {names} (or a changed format or device) were not "
            f"made before tracing (a module makes those of the GEMMs its recipe_state_gemms() names); the state has "
            f"{list(self.slots)}. Run one step eagerly first, or name the GEMM in recipe_state_gemms()")

    def _index_now(self, slot: str, fmt: str, device: torch.device) -> int:
        self.to(device)
        i = self.slots.get(slot)
        if i is None:
            i = self.slots[slot] = len(self.slots)
            self.formats.append(fmt)
            f = {"device": device, "dtype": torch.float32}
            self.amax_history = torch.cat([self.amax_history, torch.zeros(self.history_len, 1, **f)], 1)
            self.scale = torch.cat([self.scale, torch.ones(1, **f)])
            self.fp8_max = torch.cat([self.fp8_max, torch.full((1,), FP8_MAX[fmt], **f)])
            self.fwd_amax = torch.cat([self.fwd_amax, torch.zeros(1, **f)])
            self.grad_amax = torch.cat([self.grad_amax, torch.zeros(1, **f)])
            never = torch.full((1,), -1, device=device, dtype=torch.int64)
            self.fwd_stamp = torch.cat([self.fwd_stamp, never])
            self.grad_stamp = torch.cat([self.grad_stamp, never])
        elif self.formats[i] != fmt:
            self.formats[i] = fmt  # the recipe changed the format: the next update uses the new max
            self.fp8_max[i] = FP8_MAX[fmt]
        return i

    def follow_recipe(self, recipe) -> None:
        """Take the recipe's margin, power-of-2 rule and amax group for the first-step scales (an update does
        this; an evaluation before any update must too)."""
        self._margin, self._power_of_2 = recipe.margin, bool(recipe.power_of_2_scales)
        self._group = getattr(recipe, "amax_reduction_group", None)

    @property
    def amax_reduction_group(self):
        """The process group the amaxes are all-reduced over (the recipe's ``amax_reduction_group`` as of the last
        update or :meth:`follow_recipe`; None: this rank's own)."""
        return self._group

    def fresh(self, slot: str) -> bool:
        """Whether ``slot`` has no history yet: no update has taken an amax recorded for it. Never while
        compiling: a compiled forward learns its fresh slots from :meth:`unseasoned` when it is traced, and
        casts through a view that knows them (``FirstStepState``)."""
        return slot not in self._seasoned and not torch.compiler.is_compiling()

    def unseasoned(self) -> frozenset:
        """The slots that the next update leaves without history: none seasoned, none recorded by an eager
        step since the last update (host-side; while tracing, dynamo guards on both). A compiled update
        seasons every slot (it cannot read on the host which were recorded): a slot that a compiled first
        step does not cast stays on scale 1 until its amax enters the history."""
        return frozenset(s for s in self.slots if s not in self._seasoned and s not in self._recorded_host)

    def scale_for(self, slot: str, fmt: str, device: torch.device, *, source: torch.Tensor | None = None,
                  amax: torch.Tensor | None = None) -> torch.Tensor:
        """The scale a cast of ``slot`` uses now (0-d fp32).

        A fresh slot (no history yet) given the tensor to cast (``source``, or its ``amax``) takes the scale
        from that amax, as current scaling does. With Transformer Engine's scale of 1 there, gradients of a
        large model underflow in E5M2, the zero gradient flows down to the layers below, whose recorded amax
        is then 0 too, and each step brings back only one more layer (a 16-layer model trained on its top
        layers alone for 16 steps, 2026-11-25)."""
        i = self.index(slot, fmt, device)
        if (source is not None or amax is not None) and self.fresh(slot):
            return self.first_scale(slot, fmt, device, source=source, amax=amax)
        return self.scale[i].clone()  # a copy: the next update writes self.scale in place

    def first_scale(self, slot: str, fmt: str, device: torch.device, *, source: torch.Tensor | None = None,
                    amax: torch.Tensor | None = None, previous: torch.Tensor | None = None) -> torch.Tensor:
        """The scale of a fresh slot's cast of ``source`` (or of a tensor whose amax is ``amax``): the delayed
        formula on that amax; ``previous`` (default: the slot's scale now) where the amax is 0 or non-finite.
        The amax of ``source`` is all-reduced over the recipe's ``amax_reduction_group``, as its update would."""
        i = self.index(slot, fmt, device)
        if amax is None:
            amax = all_reduce_amax(tensor_amax(source.detach()), self._group)
        return compute_delayed_scale(amax.float().reshape(()), self.scale[i] if previous is None else previous,
                                     self.fp8_max[i], margin=self._margin, power_of_2=self._power_of_2)

    def scales_for(self, slots: list[str], fmt: str, device: torch.device) -> torch.Tensor:
        """``[len(slots)]``: each slot's scale now (:meth:`scale_for` without a tensor, for every slot at once): one
        strided copy where the slots' columns are evenly spaced (a MoE layer's experts), else one copy each."""
        idx = [self.index(slot, fmt, device) for slot in slots]
        spaced = _even_slice(idx)
        if spaced is not None:
            return self.scale[spaced].clone()
        return torch.stack([self.scale[i] for i in idx])

    def record_many(self, slots: list[str], amaxes: torch.Tensor) -> None:
        """:meth:`record` of ``amaxes[j]`` for each ``slots[j]`` (distinct slots): the same values in five ops where
        the slots are all forward or all gradient slots with evenly spaced columns (a MoE layer's experts: a
        record each was seven small ops, hundreds a step on the host), else one record each."""
        idx = [self.slots[slot] for slot in slots]
        grads = {self.is_gradient_slot(slot) for slot in slots}
        spaced = _even_slice(idx) if len(grads) == 1 and not torch.compiler.is_compiling() else None
        if spaced is None or amaxes.shape != (len(slots),):
            for j, slot in enumerate(slots):
                self.record(slot, amaxes[j])
            return
        buf, stamp = (self.grad_amax, self.grad_stamp) if grads == {True} else (self.fwd_amax, self.fwd_stamp)
        b, st = buf[spaced], stamp[spaced]
        a = amaxes.to(buf.device, torch.float32)
        b.copy_(torch.where(st == self.gen, torch.maximum(b, a), a))
        st.copy_(self.gen.expand(st.shape))
        self._dirty = True
        self._recorded_host.update(slots)

    @staticmethod
    def is_gradient_slot(slot: str) -> bool:
        return slot.endswith("grad_output")

    def record(self, slot: str, amax: torch.Tensor) -> None:
        """Keep ``amax`` (max with earlier ones since the last update) for the next update."""
        i = self.slots[slot]
        buf, stamp = ((self.grad_amax, self.grad_stamp) if self.is_gradient_slot(slot)
                      else (self.fwd_amax, self.fwd_stamp))
        if torch.compiler.is_compiling():
            _DELAYED_OPS["record"](buf, stamp, self.gen, i, amax.float().reshape(()))
        else:
            delayed_scaling_record_(buf, stamp, self.gen, i, amax)
            self._dirty = True
            self._recorded_host.add(slot)

    # -- the step

    def resize_history(self, history_len: int) -> None:
        """Keep the newest ``history_len`` rows (zero rows appended when growing)."""
        history_len = int(history_len)
        if history_len == self.history_len:
            return
        h = self.amax_history
        if history_len < h.shape[0]:
            h = h[:history_len].clone()
        else:
            h = torch.cat([h, h.new_zeros(history_len - h.shape[0], h.shape[1])], 0)
        self.amax_history, self.history_len = h, history_len

    def update(self, recipe) -> None:
        """Push the recorded amaxes into their histories and recompute those slots' scales (on the device)."""
        group = getattr(recipe, "amax_reduction_group", None)
        args = (self.amax_history, self.scale, self.gen, self.fwd_amax, self.fwd_stamp, self.grad_amax,
                self.grad_stamp, self.fp8_max, recipe.margin, recipe.amax_compute_algo == "most_recent",
                bool(recipe.power_of_2_scales))
        if torch.compiler.is_compiling():
            if group is not None:
                raise NotImplementedError(
                    "DelayedScaling with an amax_reduction_group (amaxes all-reduced across ranks at each update) "
                    "cannot be compiled yet: the all-reduce cannot enter the registered update op; run it eagerly "
                    "or leave amax_reduction_group None")
            if self.history_len != recipe.amax_history_len:
                raise NotImplementedError(
                    f"DelayedScaling: amax_history_len changed from {self.history_len} to {recipe.amax_history_len} "
                    "inside a compiled function (the history is reallocated); run one step eagerly after the change")
            _DELAYED_OPS["update"](*args)
            self._compiled_updates = True  # `updates` must read gen from now on
            self._seasoned |= set(self.slots)
            return
        self.follow_recipe(recipe)
        self._seasoned |= self._recorded_host
        self._recorded_host.clear()
        self.resize_history(recipe.amax_history_len)
        args = (self.amax_history, *args[1:])  # a resized history is a new tensor
        self._updates += self._dirty
        self._dirty = False
        fused = _FUSED_DELAYED_UPDATES.get(self.scale.device.type)
        if fused is not None and group is None and self.slots:
            # one kernel instead of ~20 small ops (GPU): they would stall an idle GPU at a step's start
            fused(*args)
        else:
            delayed_scaling_update_(*args, reduce=None if group is None else (lambda a: all_reduce_amax(a, group)))

    @property
    def updates(self) -> int:
        """Updates that found recorded amaxes so far. A device read (a host sync) once a compiled update has run:
        for checkpoints and inspection, not for every step (there: :attr:`eager_updates`)."""
        return int(self.gen) if self._compiled_updates else self._updates

    @property
    def eager_updates(self) -> int:
        """The eager updates that found amaxes recorded by eager casts: read on the host only, never a device
        sync. Equal to :attr:`updates` while every update and cast ran eagerly; an update inside a compiled graph
        is not counted (the host does not see it run)."""
        return self._updates

    @property
    def pending_amax(self) -> torch.Tensor:
        """Per slot, the amax recorded since the last update (0 where none was)."""
        fwd, bwd = _recorded(self.fwd_stamp, self.gen), _recorded(self.grad_stamp, self.gen)
        return torch.where(fwd, self.fwd_amax, torch.where(bwd, self.grad_amax, torch.zeros_like(self.grad_amax)))

    @property
    def recorded(self) -> set[str]:
        """Names of the slots recorded since the last update (reads the device)."""
        rec = (_recorded(self.fwd_stamp, self.gen) | _recorded(self.grad_stamp, self.gen)).tolist()
        return {name for name, i in self.slots.items() if rec[i]}

    # -- checkpoints

    def state_dict(self) -> dict:
        names = sorted(self.slots, key=self.slots.get)
        return {
            "kind": self.kind, "version": self.version, "slots": names, "formats": list(self.formats),
            "amax_history": self.amax_history.detach().clone(), "scale": self.scale.detach().clone(),
            "pending_amax": self.pending_amax.detach().clone(),
            "recorded": sorted(self.recorded, key=self.slots.get), "updates": self.updates,
            "seasoned": sorted(self._seasoned & set(self.slots), key=self.slots.get),
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("kind") != self.kind:
            raise ValueError(f"not a {self.kind} state: kind={d.get('kind')!r}")
        device = self.scale.device
        f = {"device": device, "dtype": torch.float32}
        self.slots = {name: i for i, name in enumerate(d["slots"])}
        self.formats = list(d["formats"])
        self.amax_history = d["amax_history"].detach().to(**f).clone()
        self.history_len = self.amax_history.shape[0]
        self.scale = d["scale"].detach().to(**f).clone()
        self.fp8_max = torch.tensor([FP8_MAX[fmt] for fmt in self.formats], **f)
        self._updates, self._compiled_updates = int(d.get("updates", 0)), False
        self._dirty = bool(d["recorded"])
        self.gen = torch.tensor(self._updates, device=device, dtype=torch.int64)
        pending = d["pending_amax"].detach().to(**f)
        recorded = set(d["recorded"])
        grad = torch.tensor([self.is_gradient_slot(n) for n in d["slots"]], device=device, dtype=torch.bool)
        rec = torch.tensor([n in recorded for n in d["slots"]], device=device, dtype=torch.bool)
        never = torch.full_like(rec, -1, dtype=torch.int64)
        self.fwd_amax = torch.where(rec & ~grad, pending, 0.0)
        self.grad_amax = torch.where(rec & grad, pending, 0.0)
        self.fwd_stamp = torch.where(rec & ~grad, self.gen, never)
        self.grad_stamp = torch.where(rec & grad, self.gen, never)
        if "seasoned" in d:
            self._seasoned = set(d["seasoned"])
        else:  # saved before the key existed: the slots with a history
            had = (self.amax_history != 0).any(0).tolist()
            self._seasoned = {name for name, i in self.slots.items() if had[i]}
        self._recorded_host = set(recorded)

    @classmethod
    def from_state_dict(cls, d: dict) -> "DelayedScalingState":
        state = cls(d["amax_history"].shape[0])
        state.load_state_dict(d)
        return state

    def __repr__(self) -> str:
        return (f"DelayedScalingState(history_len={self.history_len}, slots={list(self.slots)}, "
                f"updates={self.updates})")
