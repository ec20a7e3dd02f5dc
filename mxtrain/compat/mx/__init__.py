"""Drop-in replacement for microxcaling's ``mx`` package, on mxtrain's exact quantizers.

Code written for microxcaling runs unchanged but for its import line::

    from mxtrain.compat import mx          # instead of: import mx
    mx_specs = mx.MxSpecs()
    mx_specs["w_elem_format"] = "fp8_e4m3"; mx_specs["a_elem_format"] = "fp8_e4m3"
    mx_specs["block_size"] = 32; mx_specs["scale_bits"] = 8; mx_specs["bfloat"] = 16
    mx_specs = mx.finalize_mx_specs(mx_specs)
    fc = mx.Linear(784, 10, mx_specs=mx_specs)

The submodules keep microxcaling's names (``mx.specs``, ``mx.mx_ops``,
``mx.elemwise_ops``, ``mx.vector_ops``, ``mx.linear``, ...). Results equal
microxcaling's on fp32 inputs in every rounding mode except where its float
``log2`` misplaces an exponent (fp32 values a few ulps under a power of two) or
its ``floor(x + 0.5)`` double-rounds; mxtrain is exact there (docs/numerics.md).
``custom_cuda=True`` uses mxtrain's GPU kernels on CUDA tensors and the exact
CPU path otherwise. :func:`specs_from_recipe` / :func:`recipe_from_specs` convert
to and from mxtrain recipes.
"""

from mxtrain.compat.mx.activations import (GELU, LeakyReLU, ReLU, ReLU6, Sigmoid, SiLU, Tanh, gelu, leaky_relu, relu,
                                           relu6, sigmoid, silu, tanh)
from mxtrain.compat.mx.adaptive_avg_pooling import AdaptiveAvgPool2d, adaptive_avg_pool2d
from mxtrain.compat.mx.batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, batch_norm
from mxtrain.compat.mx.bmm import bmm
from mxtrain.compat.mx.convolution import Conv1d, Conv2d, Conv3d, conv1d, conv2d, conv3d
from mxtrain.compat.mx.elemwise_ops import elemwise_format_of, quantize_elemwise_op
from mxtrain.compat.mx.formats import ElemFormat, RoundingMode
from mxtrain.compat.mx.groupnorm import GroupNorm, group_norm
from mxtrain.compat.mx.layernorm import LayerNorm, RMSNorm, layer_norm
from mxtrain.compat.mx.linear import Linear, linear
from mxtrain.compat.mx.matmul import matmul
from mxtrain.compat.mx.mx_mapping import inject_pyt_ops, restore_pyt_ops
from mxtrain.compat.mx.mx_ops import quantize_mx_op
from mxtrain.compat.mx.quantize import quantize_bfloat
from mxtrain.compat.mx.recipes import recipe_from_specs, specs_from_recipe
from mxtrain.compat.mx.rnn import LSTM
from mxtrain.compat.mx.simd_ops import (simd_add, simd_div, simd_exp, simd_log, simd_mul, simd_norm,
                                        simd_reduce_mean, simd_reduce_sum, simd_split, simd_sqrt, simd_square,
                                        simd_sub)
from mxtrain.compat.mx.softmax import Softmax, softmax
from mxtrain.compat.mx.specs import (MxSpecs, add_mx_args, apply_mx_specs, finalize_mx_specs, get_backwards_mx_specs,
                                     get_default_mx_specs, get_mx_specs)
from mxtrain.compat.mx.transpose_convolution import ConvTranspose2d

__all__ = [
    "MxSpecs", "add_mx_args", "finalize_mx_specs", "get_mx_specs", "get_backwards_mx_specs", "apply_mx_specs",
    "get_default_mx_specs", "quantize_bfloat", "quantize_mx_op", "quantize_elemwise_op", "elemwise_format_of",
    "Linear", "linear", "matmul", "bmm", "Conv1d", "Conv2d", "Conv3d", "conv1d", "conv2d", "conv3d",
    "ConvTranspose2d", "LSTM", "sigmoid", "tanh", "relu", "relu6", "leaky_relu", "silu", "gelu", "Sigmoid", "Tanh",
    "ReLU", "ReLU6", "LeakyReLU", "SiLU", "GELU", "adaptive_avg_pool2d", "AdaptiveAvgPool2d", "BatchNorm1d",
    "BatchNorm2d", "BatchNorm3d", "batch_norm", "LayerNorm", "RMSNorm", "layer_norm", "GroupNorm", "group_norm",
    "simd_add", "simd_sub", "simd_mul", "simd_div", "simd_split", "simd_sqrt", "simd_square", "simd_exp",
    "simd_log", "simd_reduce_sum", "simd_reduce_mean", "simd_norm", "Softmax", "softmax", "inject_pyt_ops",
    "restore_pyt_ops", "specs_from_recipe", "recipe_from_specs", "ElemFormat", "RoundingMode",
]
