"""MX-aware ``nn.Module``s: ordinary parameters, MX GEMMs under ``mx_autocast``."""

from mxtrain.modules.activations import ACTIVATIONS
from mxtrain.modules.conv import Conv1d, Conv2d, mx_conv
from mxtrain.modules.layernorm_linear import LayerNormLinear
from mxtrain.modules.layernorm_mlp import LayerNormMLP
from mxtrain.modules.linear import Linear, mx_linear
from mxtrain.modules.normalization import LayerNorm, RMSNorm

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "LayerNorm", "RMSNorm", "Conv1d", "Conv2d", "mx_linear",
           "mx_conv", "ACTIVATIONS"]
