"""Activation + MX cast in one pass: read the fc1 output once, write the MX planes of act(h).

``activation_cast(h, "swiglu", "fp8_e4m3", axis=(-1, 0))`` computes the activation in fp32 with torch's
formulas, rounds it to ``h``'s dtype as torch does, optionally writes it, and quantizes it: codes and
scales are bit-identical to ``quantize_mx`` of the kernel's own output, which is torch's within one ulp of
the dtype (exact for relu, squared_relu, reglu). ``activation_backward_cast`` does the same for
``dh = grad * act'(h)``, optionally with the bias gradient. CUDA C++ and Triton paths: docs/kernels.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mxtrain.kernels import cast as _cast
from mxtrain.activations import activation as torch_activation_impl, check_activation, is_gated
from mxtrain.kernels.ids import ACTIVATION_IDS
from mxtrain.oplib import opaque_op
from mxtrain.quantization import MXTensor, quantize_mx
from mxtrain.quantization._validate import normalize_axis
from mxtrain.quantization.mx import _check_common

__all__ = ["activation_cast", "activation_backward_cast", "ActivationGradCast", "torch_activation", "ACTIVATION_IDS"]



class _OutputLike(NamedTuple):
    """What the cast's checks and assembly read of the activation output (which is never allocated)."""
    shape: tuple
    dtype: torch.dtype
    device: torch.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)


def torch_activation(h: torch.Tensor, name: str) -> torch.Tensor:
    """The unfused torch activation (the modules' own): what the kernel's output is compared with."""
    return torch_activation_impl(h, check_activation(name))


def activation_cast(h: torch.Tensor, activation: str, fmt, block_size: int = 32, axis=(-1, 0),
                    scale_mode: str = "floor", rounding: str = "even", seed=None, pack: bool = True,
                    return_output: bool = False, dequantized=(), dequantized_dtype: torch.dtype = torch.bfloat16,
                    keep_codes=None):
    """MX planes of ``act(h)`` (``h``: [..., N], or [..., 2N] for gated activations).

    Returns the :class:`MXTensor` of the activation output (logical shape [..., N]),
    or ``(mxt, out)`` with ``return_output=True`` (``out`` in ``h``'s dtype). Blocks
    along the last axis (any ndim) and/or the first axis of a 2-D output. Where the
    kernel cannot run (see :func:`mxtrain.kernels.cast._fallback_reason`) it computes
    ``torch_activation`` and the reference cast. ``dequantized`` / ``keep_codes`` /
    ``dequantized_dtype`` as :func:`mxtrain.kernels.dispatch.quantize` (the CUDA kernel writes bf16
    values in the same pass; elsewhere the planes are dequantized after the cast). Under
    ``torch.compile`` it is one registered op (``mxtrain::activation_cast``), the same bits.
    """
    if torch.compiler.is_compiling():
        return _activation_cast_compiled(h, activation, fmt, block_size, axis, scale_mode, rounding, seed, pack,
                                         return_output, dequantized, dequantized_dtype, keep_codes)
    return _activation_cast_impl(h, activation, fmt, block_size, axis, scale_mode, rounding, seed, pack,
                                 return_output, dequantized, dequantized_dtype, keep_codes)


def _activation_args(h, activation, fmt, block_size, axis, scale_mode, rounding, dequantized, dequantized_dtype,
                     keep_codes):
    """Checked arguments of :func:`activation_cast`: ``(name, act id, output shape, format, block size, scale
    mode, rounding, normalized axes, dequantized axes, kept axes)``."""
    from mxtrain.kernels.dispatch import values_request

    name = check_activation(activation)
    act = ACTIVATION_IDS[name]
    gated = act >= 6
    if h.ndim < 1 or (gated and h.shape[-1] % 2):
        raise ValueError(f"{name} needs an input with an even last dimension, got {list(h.shape)}")
    out_shape = tuple(h.shape[:-1]) + ((h.shape[-1] // 2,) if gated else (h.shape[-1],))
    fmt_, block_size, scale_mode, rounding = _check_common(h, fmt, block_size, scale_mode, rounding)
    axes = axis if isinstance(axis, tuple) else (axis,)
    axes = tuple(normalize_axis(a, len(out_shape)) for a in axes)
    deq, keep = values_request(len(out_shape), axes, dequantized, keep_codes, dequantized_dtype)
    return name, act, out_shape, fmt_, block_size, scale_mode, rounding, axes, deq, keep


def _activation_cast_impl(h, activation, fmt, block_size, axis, scale_mode, rounding, seed, pack, return_output,
                          dequantized, dequantized_dtype, keep_codes):
    from mxtrain.kernels.dispatch import attach_values

    name, act, out_shape, fmt_, block_size, scale_mode, rounding, axes, deq, keep = _activation_args(
        h, activation, fmt, block_size, axis, scale_mode, rounding, dequantized, dequantized_dtype, keep_codes)
    gated = act >= 6
    last = len(out_shape) - 1
    want_row, want_col = last in axes, (0 in axes and len(out_shape) >= 2)

    def finish(mxt, out):  # values asked for, where the kernel wrote codes
        if deq or set(keep) != set(axes):
            mxt = attach_values(mxt, deq, dequantized_dtype, keep)
        return (mxt, out) if return_output else mxt
    probe = _OutputLike(out_shape, h.dtype, h.device)  # stand-in for the output (no memory)
    reason = _cast._fallback_reason(probe, fmt_, block_size, axes, pack)
    if reason is None and want_col and (len(out_shape) > 2 or block_size > _cast.MAX_FUSED_BLOCK_SIZE):
        reason = "the columnwise plane is fused for a 2-D output and block_size <= 128 only"
    if reason is not None:
        out = torch_activation(h, name)
        mxt = quantize_mx(out, fmt_, block_size=block_size, axis=axis, scale_mode=scale_mode, rounding=rounding,
                          seed=seed, pack=pack)
        return finish(mxt, out)
    h2 = h.reshape(-1, h.shape[-1])
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    from mxtrain.kernels import cuda_cast

    if h.is_cuda and not gated and (len(out_shape) == 2 or not want_col) and cuda_cast.fused_sources_selected(h.device):
        native = dequantized_dtype == torch.bfloat16  # the kernel writes bf16 values itself
        res = cuda_cast.activation_cast(
            h2, name, fmt_, block_size, scale_mode, rounding, pack, want_row, want_col, return_output,
            outputs=_cast.plane_outputs(last, keep, deq, dequantized_dtype) if native else None)
        if res is not None:  # the CUDA C++ cast with the activation as its prologue
            row, col, y = res
            mxt = _cast.assemble_mxtensor(probe, fmt_, block_size, axes, scale_mode, rounding, pack, row, col)
            y = y.reshape(out_shape) if y is not None else None
            if native:
                return (mxt, y) if return_output else mxt
            return finish(mxt, y)
    n_out = out_shape[-1]
    y = torch.empty(h2.shape[0], n_out, dtype=h.dtype, device=h.device) if return_output else None
    seed_t = _cast._philox_seed(seed, h.device) if rounding == "stochastic" else None
    row, col = _cast._launch(h2, fmt_, block_size, want_row, want_col, scale_mode, rounding, seed_t, pack,
                             act=act, y=y, **_cast.plane_outputs(last, keep, deq, dequantized_dtype))
    mxt = _cast.assemble_mxtensor(probe, fmt_, block_size, axes, scale_mode, rounding, pack, row, col)
    y = y.reshape(out_shape) if y is not None else None
    return (mxt, y) if return_output else mxt


# activations whose gradient the cast kernels compute: all of them (the fused modules and tests read this)
GRAD_FUSED = tuple(ACTIVATION_IDS)


class ActivationGradCast(NamedTuple):
    mx: MXTensor                # the MX planes of dh
    out: torch.Tensor | None    # dh in h's dtype, with return_output=True
    dbias: torch.Tensor | None  # the fp32 sum of dh over every axis but the last, with dbias=True


def activation_backward_cast(h: torch.Tensor, grad: torch.Tensor, activation: str, fmt, block_size: int = 32,
                             axis=(-1, 0), scale_mode: str = "floor", rounding: str = "even", seed=None,
                             pack: bool = True, return_output: bool = False, dbias: bool = False, dequantized=(),
                             dequantized_dtype: torch.dtype = torch.bfloat16, keep_codes=None,
                             reuse_grad: bool = False) -> ActivationGradCast:
    """MX planes of the activation's input gradient ``dh = grad * act'(h)`` in one pass over ``h`` and ``grad``.

    ``grad`` has the activation output's shape (half ``h``'s last dimension for gated ones); ``dh`` has ``h``'s.

    ``dh`` is computed in fp32 with torch's backward formulas and rounded to ``h``'s dtype, as
    torch's backward ops write it (libdevice on the GPU: within one ulp of torch's); its codes
    and scales are bit-identical to ``quantize_mx`` of that ``dh`` (``return_output=True`` gives
    it). ``dbias=True`` also returns its fp32 sum over the tokens (the bias gradient of the
    layer that produced ``h``) from the same pass. Every activation runs in the kernel (2-D
    columnwise, or rowwise at any ndim); a gated one's ``dh`` is ``[d_gate, d_up]`` as autograd of
    ``act(gate) * up`` writes it in ``h``'s dtype (``d_up = grad * act(gate)``, ``d_gate = act'(gate)``
    applied to ``grad * up``, each rounded where torch rounds). What the kernel does not take (see
    :func:`mxtrain.kernels.cast._fallback_reason`) computes torch's backward, then the cast.
    ``dequantized`` / ``keep_codes`` as :func:`mxtrain.kernels.dispatch.quantize`.
    ``reuse_grad=True`` lets the kernel write the rowwise values over ``grad`` (the caller gives it up:
    one tensor of ``h``'s size less at the peak of a backward) where it can: not gated (``grad`` is then
    ``dh``'s shape), contiguous, of the values' dtype. Under ``torch.compile`` it is one registered op
    (``mxtrain::activation_backward_cast``), the same bits; ``grad`` is then left as it is (a registered
    op's outputs cannot take an input's memory).
    """
    if torch.compiler.is_compiling():
        return _activation_backward_cast_compiled(h, grad, activation, fmt, block_size, axis, scale_mode, rounding,
                                                  seed, pack, return_output, dbias, dequantized, dequantized_dtype,
                                                  keep_codes)
    return _activation_backward_cast_impl(h, grad, activation, fmt, block_size, axis, scale_mode, rounding, seed,
                                          pack, return_output, dbias, dequantized, dequantized_dtype, keep_codes,
                                          reuse_grad)


def _backward_args(h, grad, activation, fmt, block_size, axis, scale_mode, rounding, dequantized, dequantized_dtype,
                   keep_codes):
    """Checked arguments of :func:`activation_backward_cast`: ``(name, format, block size, scale mode, rounding,
    normalized axes, dequantized axes, kept axes)``."""
    from mxtrain.kernels.dispatch import values_request

    name = check_activation(activation)
    gated = is_gated(name)
    if h.ndim < 1 or (gated and h.shape[-1] % 2):
        raise ValueError(f"{name} needs an input with {'an even' if gated else 'a'} last dimension, "
                         f"got {list(h.shape)}")
    out_shape = tuple(h.shape[:-1]) + ((h.shape[-1] // 2,) if gated else (h.shape[-1],))
    if not isinstance(grad, torch.Tensor) or tuple(grad.shape) != out_shape or grad.dtype != h.dtype \
            or grad.device != h.device:
        raise ValueError(f"grad must match act(h) in shape ({list(out_shape)}), and h in dtype ({h.dtype}) and "
                         f"device ({h.device}); got {list(getattr(grad, 'shape', []))} "
                         f"{getattr(grad, 'dtype', type(grad))} on {getattr(grad, 'device', None)}")
    fmt_, block_size, scale_mode, rounding = _check_common(h, fmt, block_size, scale_mode, rounding)
    axes = axis if isinstance(axis, tuple) else (axis,)
    axes = tuple(normalize_axis(a, h.ndim) for a in axes)
    deq, keep = values_request(h.ndim, axes, dequantized, keep_codes, dequantized_dtype)
    return name, fmt_, block_size, scale_mode, rounding, axes, deq, keep


def _activation_backward_cast_impl(h, grad, activation, fmt, block_size, axis, scale_mode, rounding, seed, pack,
                                   return_output, dbias, dequantized, dequantized_dtype, keep_codes,
                                   reuse_grad) -> ActivationGradCast:
    from mxtrain.kernels.dispatch import quantize
    from mxtrain.activations import activation_backward

    name, fmt_, block_size, scale_mode, rounding, axes, deq, keep = _backward_args(
        h, grad, activation, fmt, block_size, axis, scale_mode, rounding, dequantized, dequantized_dtype, keep_codes)
    gated = is_gated(name)
    last = h.ndim - 1
    want_row, want_col = last in axes, (0 in axes and h.ndim >= 2)
    reason = _cast._fallback_reason(h, fmt_, block_size, axes, pack)
    if reason is None and want_col and (h.ndim > 2 or block_size > _cast.MAX_FUSED_BLOCK_SIZE):
        reason = "the columnwise plane is fused for a 2-D gradient and block_size <= 128 only"
    if reason is not None:
        out = activation_backward(h, grad, name)
        mxt = quantize(out, fmt_, block_size=block_size, axis=axes, scale_mode=scale_mode, rounding=rounding,
                       seed=seed, pack=pack, dequantized=deq, dequantized_dtype=dequantized_dtype, keep_codes=keep)
        db = out.reshape(-1, out.shape[-1]).sum(0, dtype=torch.float32) if dbias else None
        return ActivationGradCast(mxt, out if return_output else None, db)
    h2, g2 = h.reshape(-1, h.shape[-1]), grad.reshape(-1, grad.shape[-1])
    h2 = h2 if h2.stride(-1) == 1 else h2.contiguous()
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    outs = _cast.plane_outputs(last, keep, deq, dequantized_dtype)
    into_grad = (reuse_grad and not gated and outs["row_vals"] is not None and g2.dtype == outs["row_vals"]
                 and g2.is_contiguous() and g2.data_ptr() != h2.data_ptr())
    if h.is_cuda and not gated and not dbias:
        from mxtrain.kernels import cuda_cast

        if cuda_cast.fused_sources_selected(h.device):
            res = cuda_cast.activation_backward_cast(h2, g2, name, fmt_, block_size, scale_mode, rounding, pack,
                                                     want_row, want_col, return_output, outs, into_grad)
            if res is not None:  # the CUDA C++ cast with the activation's gradient as its prologue
                row, col, y = res
                mxt = _cast.assemble_mxtensor(h, fmt_, block_size, axes, scale_mode, rounding, pack, row, col)
                return ActivationGradCast(mxt, y.reshape(h.shape) if y is not None else None, None)
    y = torch.empty_like(h2) if return_output else None
    seed_t = _cast._philox_seed(seed, h.device) if rounding == "stochastic" else None
    row, col, *db = _cast._launch(h2, fmt_, block_size, want_row, want_col, scale_mode, rounding, seed_t, pack,
                                  act=ACTIVATION_IDS[name], y=y, grad=g2, dbias=dbias, row_vals_into_grad=into_grad,
                                  **outs)
    mxt = _cast.assemble_mxtensor(h, fmt_, block_size, axes, scale_mode, rounding, pack, row, col)
    return ActivationGradCast(mxt, y.reshape(h.shape) if y is not None else None, db[0] if dbias else None)


# Under torch.compile each cast is one registered op of plain tensors (no graph break); inside, the kernel is
# chosen at run time as in eager, so compiled and eager results are the same bits.


def _activation_cast_compiled(h, activation, fmt, block_size, axis, scale_mode, rounding, seed, pack, return_output,
                              dequantized, dequantized_dtype, keep_codes):
    from mxtrain.kernels.dispatch import mx_from_op_outputs, op_seed

    name, _, out_shape, fmt_, block_size, scale_mode, rounding, axes, deq, keep = _activation_args(
        h, activation, fmt, block_size, axis, scale_mode, rounding, dequantized, dequantized_dtype, keep_codes)
    parts = torch.ops.mxtrain.activation_cast(h, name, fmt_.name, block_size, list(axes), scale_mode, rounding,
                                              op_seed(seed, rounding, "activation_cast"), bool(pack),
                                              bool(return_output), list(deq), dequantized_dtype, list(keep))
    mxt, i = mx_from_op_outputs(parts, out_shape, h.dtype, fmt_.name, block_size, axes, keep, deq, scale_mode,
                                rounding, pack)
    return (mxt, parts[i]) if return_output else mxt


@opaque_op("mxtrain::activation_cast")
def _activation_cast_op(h: torch.Tensor, activation: str, fmt: str, block_size: int, axes: list[int],
                        scale_mode: str, rounding: str, seed: int | None, pack: bool, return_output: bool,
                        dequantized: list[int], dequantized_dtype: torch.dtype,
                        keep_codes: list[int]) -> list[torch.Tensor]:
    """The planes of each axis (see :func:`mxtrain.kernels.dispatch.mx_op_outputs`), then ``act(h)`` with
    ``return_output``."""
    from mxtrain.kernels.dispatch import _distinct, mx_op_outputs

    r = _activation_cast_impl(h, activation, fmt, block_size, tuple(axes), scale_mode, rounding, seed, pack,
                              return_output, tuple(dequantized), dequantized_dtype, tuple(keep_codes))
    mxt, y = r if return_output else (r, None)
    out = mx_op_outputs(mxt, axes, keep_codes, dequantized, pack, "activation_cast")
    return _distinct(out + ([y.contiguous()] if return_output else []), h)


@_activation_cast_op.register_fake
def _(h, activation, fmt, block_size, axes, scale_mode, rounding, seed, pack, return_output, dequantized,
      dequantized_dtype, keep_codes):
    from mxtrain.kernels.dispatch import mx_op_fake_outputs

    out_shape = (*h.shape[:-1], h.shape[-1] // 2 if is_gated(activation) else h.shape[-1])
    out = mx_op_fake_outputs(h, out_shape, fmt, block_size, axes, keep_codes, dequantized, pack, dequantized_dtype)
    return out + ([h.new_empty(out_shape)] if return_output else [])


def _activation_backward_cast_compiled(h, grad, activation, fmt, block_size, axis, scale_mode, rounding, seed, pack,
                                       return_output, dbias, dequantized, dequantized_dtype,
                                       keep_codes) -> ActivationGradCast:
    from mxtrain.kernels.dispatch import mx_from_op_outputs, op_seed

    name, fmt_, block_size, scale_mode, rounding, axes, deq, keep = _backward_args(
        h, grad, activation, fmt, block_size, axis, scale_mode, rounding, dequantized, dequantized_dtype, keep_codes)
    parts = torch.ops.mxtrain.activation_backward_cast(
        h, grad, name, fmt_.name, block_size, list(axes), scale_mode, rounding,
        op_seed(seed, rounding, "activation_backward_cast"), bool(pack), bool(return_output), bool(dbias), list(deq),
        dequantized_dtype, list(keep))
    mxt, i = mx_from_op_outputs(parts, tuple(h.shape), h.dtype, fmt_.name, block_size, axes, keep, deq, scale_mode,
                                rounding, pack)
    out = parts[i] if return_output else None
    return ActivationGradCast(mxt, out, parts[i + bool(return_output)] if dbias else None)


@opaque_op("mxtrain::activation_backward_cast")
def _activation_backward_cast_op(h: torch.Tensor, grad: torch.Tensor, activation: str, fmt: str, block_size: int,
                                 axes: list[int], scale_mode: str, rounding: str, seed: int | None, pack: bool,
                                 return_output: bool, dbias: bool, dequantized: list[int],
                                 dequantized_dtype: torch.dtype, keep_codes: list[int]) -> list[torch.Tensor]:
    """The planes of each axis (see :func:`mxtrain.kernels.dispatch.mx_op_outputs`), then ``dh`` with
    ``return_output``, then the fp32 bias gradient with ``dbias``."""
    from mxtrain.kernels.dispatch import _distinct, mx_op_outputs

    r = _activation_backward_cast_impl(h, grad, activation, fmt, block_size, tuple(axes), scale_mode, rounding, seed,
                                       pack, return_output, dbias, tuple(dequantized), dequantized_dtype,
                                       tuple(keep_codes), False)
    out = mx_op_outputs(r.mx, axes, keep_codes, dequantized, pack, "activation_backward_cast")
    out += ([r.out.contiguous()] if return_output else []) + ([r.dbias] if dbias else [])
    return _distinct(out, h, grad)


@_activation_backward_cast_op.register_fake
def _(h, grad, activation, fmt, block_size, axes, scale_mode, rounding, seed, pack, return_output, dbias, dequantized,
      dequantized_dtype, keep_codes):
    from mxtrain.kernels.dispatch import mx_op_fake_outputs

    out = mx_op_fake_outputs(h, h.shape, fmt, block_size, axes, keep_codes, dequantized, pack, dequantized_dtype)
    out += [h.new_empty(h.shape)] if return_output else []
    return out + ([h.new_empty(h.shape[-1], dtype=torch.float32)] if dbias else [])
