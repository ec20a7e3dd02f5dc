"""Per-tensor FP8 casts of many tensors in one launch each: the weight shards an FSDP2 step casts before its
all-gathers (``mxtrain.distributed.fsdp``'s batched casts).

Two operations of the kernel registry, each with a ``reference`` (torch ops per tensor, any device) and a
``triton`` implementation (one launch for all the tensors: a device-side table of their addresses):

* ``float8_shard_amaxes``: fp32 ``[T]``, each tensor's max |x| (NaN if it holds a NaN);
* ``float8_shard_codes``: each tensor rounded to a parameter dtype (fp32 master weights to bf16: round to
  nearest even on the bits) and cast to FP8 at its own scale (``scale[i]``): ``cast_to_fp8``'s bytes
  (saturating, a NaN or +-Inf value becomes NaN), but for the sign of a NaN, which the GPU's arithmetic leaves.

The first Triton launch of each operation on a device is checked against the reference (one synchronisation):
a kernel that computes wrong there raises :class:`~mxtrain.kernels.registry.KernelUnavailable`, and the
registry runs the reference from then on. Inputs: non-empty, contiguous tensors of one dtype (fp32, bf16 or
fp16) on one device; ``param_dtype`` their dtype, or bf16 for fp32 tensors.
"""

from __future__ import annotations

import warnings

import torch

from mxtrain.kernels import registry
from mxtrain.kernels._triton_utils import HAVE_TRITON, device_supported, interpret_mode, launch_options, tl, triton
from mxtrain.kernels.ids import DTYPE_IDS
from mxtrain.quantization.float8 import FP8_DTYPES, FP8_MAX, cast_to_fp8, fp8_format_name

__all__ = ["shard_amaxes", "shard_codes", "ShardsCall", "SHARD_BLOCK"]

SHARD_BLOCK = (1024, 16, 4)  # (elements a step, steps a program, warps): a program takes 16384 elements


class ShardsCall:
    """The arguments of both operations: ``shards`` (a tuple of tensors), and for the codes ``scale`` (fp32
    ``[T]``), ``param_dtype`` and ``fmt``; ``outs`` the FP8 tensors the codes go to (made by the entry point)."""

    __slots__ = ("shards", "scale", "param_dtype", "fmt", "outs")

    def __init__(self, shards, scale=None, param_dtype=None, fmt=None, outs=None):
        self.shards, self.scale, self.param_dtype, self.fmt, self.outs = tuple(shards), scale, param_dtype, fmt, outs

    @property
    def device(self) -> torch.device:
        return self.shards[0].device


def _check(op: str, shards, param_dtype=None) -> None:
    if not shards:
        raise ValueError(f"{op}: no tensors given")
    first = shards[0]
    for i, x in enumerate(shards):
        if not isinstance(x, torch.Tensor) or x.dtype not in DTYPE_IDS:
            raise ValueError(f"{op}: tensor {i} must be a float32, bfloat16 or float16 tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dtype != first.dtype or x.device != first.device:
            raise ValueError(f"{op}: every tensor must have one dtype and device; tensor {i} is {x.dtype} on "
                             f"{x.device}, tensor 0 {first.dtype} on {first.device}")
        if not x.numel() or not x.is_contiguous():
            raise ValueError(f"{op}: tensor {i} must be non-empty and contiguous (shape {tuple(x.shape)}, "
                             f"strides {x.stride()})")
    if param_dtype is not None and param_dtype != first.dtype and not (first.dtype == torch.float32
                                                                        and param_dtype == torch.bfloat16):
        raise ValueError(f"{op}: param_dtype must be the tensors' dtype ({first.dtype}), or bfloat16 for float32 "
                         f"tensors; got {param_dtype}")


def shard_amaxes(shards, backend: str | None = None) -> torch.Tensor:
    """fp32 ``[len(shards)]``: each tensor's max |x|, NaN where it holds a NaN (as ``x.abs().amax()``)."""
    shards = list(shards)
    _check("shard_amaxes", shards)
    return registry.run("float8_shard_amaxes", ShardsCall(shards), shards[0].device, backend)


def shard_codes(shards, scale: torch.Tensor, param_dtype: torch.dtype, fmt: str = "fp8_e4m3",
                backend: str | None = None) -> list:
    """Each tensor rounded to ``param_dtype`` and cast to FP8 ``fmt`` at ``scale[i]`` (fp32 ``[T]`` on their device):
    ``cast_to_fp8(x.to(param_dtype), scale[i], fmt)`` for every ``x``, in their shapes."""
    shards = list(shards)
    _check("shard_codes", shards, param_dtype)
    fmt = fp8_format_name(fmt)
    if not isinstance(scale, torch.Tensor) or scale.shape != (len(shards),) or scale.dtype != torch.float32 \
            or scale.device != shards[0].device:
        raise ValueError(f"shard_codes: scale must be a float32 tensor of shape ({len(shards)},) on "
                         f"{shards[0].device}, got {getattr(scale, 'dtype', None)} of shape "
                         f"{tuple(getattr(scale, 'shape', ()))} on {getattr(scale, 'device', None)}")
    outs = [torch.empty(x.shape, dtype=FP8_DTYPES[fmt], device=x.device) for x in shards]
    call = ShardsCall(shards, scale.contiguous(), param_dtype, fmt, outs)
    return registry.run("float8_shard_codes", call, shards[0].device, backend)


def _reference_amaxes(call: ShardsCall) -> torch.Tensor:
    return torch.stack([x.abs().amax() for x in call.shards]).float()


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype``: fp32 to bf16 by round to nearest even on the bits (NaN kept; the kernel's
    ``_round_to_dtype``), returned as fp32 values; any other pair by ``to``."""
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        nan = x.isnan()
        bits = torch.where(nan, 0.0, x).view(torch.int32)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return torch.where(nan, x, bits.view(torch.float32))
    return x.to(dtype)


def _reference_codes(call: ShardsCall) -> list:
    for i, (x, out) in enumerate(zip(call.shards, call.outs)):
        out.copy_(cast_to_fp8(_rounded(x, call.param_dtype), call.scale[i], call.fmt))
    return list(call.outs)


def _same_codes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal FP8 bytes, a NaN's sign aside."""
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_a])


_VERIFIED: set = set()  # kernel variants (operation, device, dtypes, format, steps) whose first launch matched


def _verify_once(op: str, call: ShardsCall, got, steps: int) -> None:
    """The first launch of each compiled variant of ``op`` on a device (its dtypes, format and steps) against the
    reference: a synchronisation, once a variant. A mismatch warns and raises ``KernelUnavailable``."""
    variant = (op, call.device, call.shards[0].dtype, call.param_dtype, call.fmt, steps)
    if variant in _VERIFIED:
        return
    if op == "float8_shard_amaxes":
        ok = torch.allclose(got, _reference_amaxes(call), rtol=0, atol=0, equal_nan=True)  # (NaN where NaN)
    else:
        ref = ShardsCall(call.shards, call.scale, call.param_dtype, call.fmt,
                         [torch.empty_like(o) for o in call.outs])
        ok = all(_same_codes(g, r) for g, r in zip(got, _reference_codes(ref)))
    if not ok:
        why = f"the Triton {op} kernel wrote wrong values on its first launch"
        warnings.warn(f"mxtrain: {why} on {call.device} ({call.shards[0].dtype} tensors); the reference runs "
                      "from now on (one op per tensor)", RuntimeWarning, stacklevel=2)
        raise registry.KernelUnavailable(why)
    _VERIFIED.add(variant)


_KERNELS = HAVE_TRITON
if _KERNELS:
    try:  # a broken Triton install: the reference alone (as the other kernel modules do)
        from mxtrain.kernels.cast import _round_to_dtype, _widen
        from mxtrain.kernels.float8_cast import _FP8_BITS, _fp8_bytes, _scaled, _store_bits
    except ImportError:
        _KERNELS = False

if _KERNELS:

    @triton.jit
    def _address(table, t, ALIGNED: tl.constexpr):
        """Entry ``t`` of an address table; ALIGNED: every address in it is a multiple of 16 (checked by the
        caller), which lets the compiler vectorise the loads and stores through it."""
        addr = tl.load(table + t)
        if ALIGNED:
            addr = tl.multiple_of(addr, 16)
        return addr

    @triton.jit
    def _shard_source(table, t, KIND: tl.constexpr, BF16_BITS: tl.constexpr, ALIGNED: tl.constexpr):
        """Tensor ``t``'s address from the table, as a pointer to its dtype (bf16 as int16 bits: ``_widen``)."""
        addr = _address(table, t, ALIGNED)
        if KIND == 2:
            return addr.to(tl.pointer_type(tl.float32))
        elif KIND == 1:
            return addr.to(tl.pointer_type(tl.float16))
        elif BF16_BITS:
            return addr.to(tl.pointer_type(tl.int16))
        else:
            return addr.to(tl.pointer_type(tl.bfloat16))

    @triton.jit
    def _shard_amax_kernel(src_table, numel_table, part_ptr, CHUNKS, KIND: tl.constexpr, BF16_BITS: tl.constexpr,
                           ALIGNED: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        """``part[t, c]``: max |x| over elements [c * BLOCK * STEPS, (c + 1) * BLOCK * STEPS) of tensor t (0 past its
        end), NaN where they hold a NaN (torch's amax of the partials keeps it)."""
        t = tl.program_id(0)
        c = tl.program_id(1)
        n = tl.load(numel_table + t)
        start = c.to(tl.int64) * (BLOCK * STEPS)
        lanes = tl.arange(0, BLOCK)
        m = tl.zeros([BLOCK], tl.float32)
        bad = tl.zeros([BLOCK], tl.int32)
        if start < n:
            src = _shard_source(src_table, t, KIND, BF16_BITS, ALIGNED)
            for i in range(STEPS):
                offs = start + i * BLOCK + lanes
                v = _widen(tl.load(src + offs, mask=offs < n, other=0), BF16_BITS)
                bad = tl.maximum(bad, (v != v).to(tl.int32))
                m = tl.maximum(m, tl.where(v != v, 0.0, tl.abs(v)))
        top = tl.zeros([BLOCK], tl.float32) + tl.max(m, axis=0)
        top = tl.where((tl.zeros([BLOCK], tl.int32) + tl.max(bad, axis=0)) > 0, float("nan"), top)
        tl.store(part_ptr + (t.to(tl.int64) * CHUNKS + c) + lanes * 0, top, mask=lanes == 0)

    @triton.jit
    def _shard_cast_kernel(src_table, dst_table, numel_table, scale_ptr, KIND: tl.constexpr,
                           BF16_BITS: tl.constexpr, ALIGNED: tl.constexpr, PARAM_KIND: tl.constexpr, FMAX: tl.constexpr,
                           MBITS: tl.constexpr, EMIN: tl.constexpr, GPU: tl.constexpr, BLOCK: tl.constexpr,
                           STEPS: tl.constexpr):
        """FP8 bytes of elements [c * BLOCK * STEPS, (c + 1) * BLOCK * STEPS) of tensor t: rounded to the parameter
        dtype (PARAM_KIND), times ``scale[t]``, saturated (``_fp8_bytes``), into the t-th output."""
        t = tl.program_id(0)
        c = tl.program_id(1)
        n = tl.load(numel_table + t)
        start = c.to(tl.int64) * (BLOCK * STEPS)
        if start < n:
            lanes = tl.arange(0, BLOCK)
            src = _shard_source(src_table, t, KIND, BF16_BITS, ALIGNED)
            dst = _address(dst_table, t, ALIGNED).to(tl.pointer_type(tl.uint8))
            s = tl.zeros([BLOCK], tl.float32) + tl.load(scale_ptr + t)
            for i in range(STEPS):
                offs = start + i * BLOCK + lanes
                mask = offs < n
                v = _round_to_dtype(_widen(tl.load(src + offs, mask=mask, other=0), BF16_BITS), PARAM_KIND)
                _store_bits(dst + offs, _fp8_bytes(_scaled(v, s), FMAX, MBITS, EMIN, GPU), mask)

    def _triton_supports(call: ShardsCall) -> str | None:
        if not device_supported(call.device):
            return f"no Triton kernels for {call.device.type} tensors here"
        return None

    def _grid(call: ShardsCall) -> tuple:
        """``(tensors, chunks a tensor, steps a program)``: a program takes BLOCK * steps elements, at most 65535
        programs a tensor (CUDA's grid)."""
        block, steps, _ = SHARD_BLOCK
        longest = max(x.numel() for x in call.shards)
        while triton.cdiv(longest, block * steps) > 65535:
            steps *= 4
        return len(call.shards), triton.cdiv(longest, block * steps), steps

    def _table(device: torch.device, *columns) -> torch.Tensor:
        """An int64 device tensor ``[len(columns), T]`` of addresses and sizes: one small copy from pinned host
        memory (torch's caching host allocator keeps the block until the copy is done), so the host does not wait
        on the device for it (from pageable memory the driver may synchronise with the stream)."""
        table = torch.tensor(columns, dtype=torch.int64)
        if device.type == "cuda":
            table = table.pin_memory()
        return table.to(device, non_blocking=True)

    def _kinds(call: ShardsCall) -> dict:
        dtype = call.shards[0].dtype
        aligned = all(t.data_ptr() % 16 == 0 for t in (*call.shards, *(call.outs or ())))
        return {"KIND": DTYPE_IDS[dtype], "BF16_BITS": dtype == torch.bfloat16 and interpret_mode(), "ALIGNED": aligned}

    def _triton_amaxes(call: ShardsCall) -> torch.Tensor:
        block, _, warps = SHARD_BLOCK
        tensors, chunks, steps = _grid(call)
        table = _table(call.device, [x.data_ptr() for x in call.shards], [x.numel() for x in call.shards])
        part = torch.empty((tensors, chunks), dtype=torch.float32, device=call.device)
        _shard_amax_kernel[(tensors, chunks)](table[0], table[1], part, chunks, BLOCK=block, STEPS=steps,
                                              num_warps=warps, **_kinds(call), **launch_options())
        got = part.amax(1)
        _verify_once("float8_shard_amaxes", call, got, steps)
        return got

    def _triton_codes(call: ShardsCall) -> list:
        block, _, warps = SHARD_BLOCK
        tensors, chunks, steps = _grid(call)
        table = _table(call.device, [x.data_ptr() for x in call.shards], [o.data_ptr() for o in call.outs],
                       [x.numel() for x in call.shards])
        mbits, emin = _FP8_BITS[call.fmt]
        _shard_cast_kernel[(tensors, chunks)](table[0], table[1], table[2], call.scale,
                                              PARAM_KIND=DTYPE_IDS[call.param_dtype], FMAX=FP8_MAX[call.fmt],
                                              MBITS=mbits, EMIN=emin, GPU=not interpret_mode(), BLOCK=block,
                                              STEPS=steps, num_warps=warps, **_kinds(call), **launch_options())
        _verify_once("float8_shard_codes", call, call.outs, steps)
        return list(call.outs)


def _make_call(*, shards, scale=None, param_dtype=None, fmt=None, outs=None):
    return ShardsCall(shards, scale, param_dtype, fmt, outs)


for _op, _ref in (("float8_shard_amaxes", _reference_amaxes), ("float8_shard_codes", _reference_codes)):
    registry.define(registry.Operation(_op, _make_call))
    registry.register(_op, "reference", _ref)
if _KERNELS:
    registry.register("float8_shard_amaxes", "triton", _triton_amaxes, supports=_triton_supports)
    registry.register("float8_shard_codes", "triton", _triton_codes, supports=_triton_supports)
