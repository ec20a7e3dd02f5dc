"""Argument checks shared by the reference quantizers (clear errors, no silent casts)."""

from __future__ import annotations

import torch

from mxtrain.formats import MAX_BLOCK_SIZE

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_MODES = ("floor", "rceil", "even")
ROUNDINGS = ("even", "nearest", "floor", "stochastic")


def check_float_tensor(x, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        hint = " (cast with .float(): float64 is rounded to float32 first)" if x.dtype == torch.float64 else ""
        raise TypeError(f"{what} must have dtype float32, bfloat16 or float16, got {x.dtype}{hint}")


DEQUANTIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_dequantize_dtype(dtype) -> None:
    """``dtype`` of a dequantized result: None (the dtype that was quantized) or a floating dtype."""
    if dtype is not None and dtype not in DEQUANTIZE_DTYPES:
        raise TypeError(f"dequantize gives floating-point values: dtype must be None (the quantized tensor's "
                        f"dtype) or one of {', '.join(map(str, DEQUANTIZE_DTYPES))}, got {dtype!r}")


def check_choice(value, allowed: tuple[str, ...], what: str) -> str:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")
    return value.lower()


def check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int (0 = one block per axis), got {type(block_size).__name__}")
    if not 0 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [0, {MAX_BLOCK_SIZE}] (0 = one block for the whole axis), "
                         f"got {block_size}")
    return block_size


def normalize_axis(axis, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    if ndim == 0:
        raise ValueError("cannot quantize a 0-d tensor along an axis; reshape it to 1-d first")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a {ndim}-d tensor (allowed: {-ndim}..{ndim - 1})")
    return axis % ndim


def normalize_axes(axis, ndim: int) -> tuple[int, ...]:
    """``axis`` (an int or a tuple of them) as a tuple of distinct non-negative axes, validated."""
    axes = axis if isinstance(axis, tuple) else (axis,)
    if not axes:
        raise ValueError("axis tuple must name at least one axis")
    axes = tuple(normalize_axis(a, ndim) for a in axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis tuple {axis} names an axis twice")
    return axes


def make_generator(seed, device: torch.device) -> torch.Generator | None:
    """``None`` uses torch's global RNG; an int seeds a private generator; a Generator is used as is."""
    if seed is None or isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, a torch.Generator or None, got {type(seed).__name__}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
