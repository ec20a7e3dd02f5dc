"""microxcaling's ``inject_pyt_ops``: replace torch's modules and functions globally by the MX ones.

Prefer :func:`mxtrain.convert`, which swaps the modules of one model and can be
undone. :func:`inject_pyt_ops` patches ``torch``, ``torch.nn`` and
``torch.nn.functional`` for every model built afterwards; :func:`restore_pyt_ops`
puts the originals back.
"""

from __future__ import annotations

import sys

import torch

from mxtrain.compat.mx import activations as _act
from mxtrain.compat.mx.adaptive_avg_pooling import AdaptiveAvgPool2d, adaptive_avg_pool2d
from mxtrain.compat.mx.batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, batch_norm
from mxtrain.compat.mx.bmm import bmm
from mxtrain.compat.mx.convolution import Conv1d, Conv2d, Conv3d, conv1d, conv2d, conv3d
from mxtrain.compat.mx.groupnorm import GroupNorm, group_norm
from mxtrain.compat.mx.layernorm import LayerNorm, layer_norm
from mxtrain.compat.mx.linear import Linear, linear
from mxtrain.compat.mx.matmul import MatMulFunction, matmul
from mxtrain.compat.mx.simd_ops import (simd_add, simd_div, simd_exp, simd_log, simd_mul, simd_norm,
                                        simd_reduce_mean, simd_reduce_sum, simd_square, simd_sub)
from mxtrain.compat.mx.softmax import Softmax, softmax
from mxtrain.compat.mx.specs import apply_mx_specs
from mxtrain.compat.mx.transpose_convolution import ConvTranspose2d

__all__ = ["inject_pyt_ops", "restore_pyt_ops", "MODULE_MAPPING", "FUNCTION_MAPPING", "addmm_mx"]

torch_addmm = torch.addmm


def addmm_mx(bias, in1, in2, mx_specs=None, name=None):
    if mx_specs is None:
        return torch_addmm(bias, in1, in2)
    return MatMulFunction.apply(in1, in2, bias, apply_mx_specs(mx_specs), name)


MODULE_MAPPING = {
    "AdaptiveAvgPool2d": AdaptiveAvgPool2d, "BatchNorm1d": BatchNorm1d, "BatchNorm2d": BatchNorm2d,
    "BatchNorm3d": BatchNorm3d, "Conv1d": Conv1d, "Conv2d": Conv2d, "Conv3d": Conv3d,
    "ConvTranspose2d": ConvTranspose2d, "GELU": _act.GELU, "GroupNorm": GroupNorm, "LayerNorm": LayerNorm,
    "LeakyReLU": _act.LeakyReLU, "Linear": Linear, "ReLU": _act.ReLU, "ReLU6": _act.ReLU6, "SiLU": _act.SiLU,
    "Sigmoid": _act.Sigmoid, "Softmax": Softmax, "Tanh": _act.Tanh,
}

FUNCTION_MAPPING = {
    "adaptive_avg_pool2d": adaptive_avg_pool2d, "batch_norm": batch_norm, "conv1d": conv1d, "conv2d": conv2d,
    "conv3d": conv3d, "gelu": _act.gelu, "group_norm": group_norm, "layer_norm": layer_norm,
    "leaky_relu": _act.leaky_relu, "linear": linear, "relu": _act.relu, "relu6": _act.relu6,
    "sigmoid": _act.sigmoid, "silu": _act.silu, "softmax": softmax, "tanh": _act.tanh, "add": simd_add,
    "sub": simd_sub, "mul": simd_mul, "div": simd_div, "exp": simd_exp, "log": simd_log, "sum": simd_reduce_sum,
    "mean": simd_reduce_mean, "norm": simd_norm, "square": simd_square, "matmul": matmul, "mm": matmul,
    "addmm": addmm_mx, "bmm": bmm,
}

_SAVED: list[tuple[dict, str, object]] = []


def _with_specs(func, mx_specs, original):
    def wrapper(*args, **kwargs):
        # mxtrain's own code (the MX ops, their backward, the quantizers) keeps calling the torch op itself
        if sys._getframe(1).f_globals.get("__name__", "").startswith("mxtrain."):
            return original(*args, **kwargs)
        dtype = kwargs.pop("dtype", None)
        res = func(*args, mx_specs=mx_specs, **kwargs)
        return res.to(dtype) if dtype is not None else res
    wrapper.__name__ = getattr(func, "__name__", "mx_op")
    return wrapper


def inject_pyt_ops(mx_specs) -> None:
    """Replace torch's functions and ``torch.nn`` modules by MX ones using ``mx_specs`` (global; see module doc)."""

    def module_factory(cls):
        def __init__(self, *args, **kwargs):
            cls.__init__(self, *args, mx_specs=mx_specs, **kwargs)
        return type(f"{cls.__name__}_inj", (cls,), {"__init__": __init__})

    def patch(namespace: dict, key: str, value) -> None:
        _SAVED.append((namespace, key, namespace[key]))
        namespace[key] = value

    for k, v in FUNCTION_MAPPING.items():
        for ns in (torch.__dict__, torch.nn.functional.__dict__):
            if k in ns:
                patch(ns, k, _with_specs(v, mx_specs, ns[k]))
    for k, v in MODULE_MAPPING.items():
        patch(torch.nn.__dict__, k, module_factory(v))


def restore_pyt_ops() -> None:
    """Undo every :func:`inject_pyt_ops` (latest first)."""
    while _SAVED:
        namespace, key, original = _SAVED.pop()
        namespace[key] = original
