"""MX-aware ``nn.Module``s: ordinary parameters, MX GEMMs under ``mx_autocast``."""

from mxtrain.modules._common import weight_cast_cache
from mxtrain.modules.activation_checkpoint import checkpoint
from mxtrain.modules.activations import ACTIVATIONS, gated_activation
from mxtrain.modules.batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from mxtrain.modules.conv import (Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, mx_conv,
                                  mx_conv_transpose)
from mxtrain.modules.groupnorm import GroupNorm
from mxtrain.modules.grouped_linear import GroupedLinear, mx_grouped_linear
from mxtrain.modules.layernorm_linear import LayerNormLinear
from mxtrain.modules.layernorm_mlp import LayerNormMLP
from mxtrain.modules.linear import Linear, mx_linear
from mxtrain.modules.loss import cross_entropy
from mxtrain.modules.normalization import LayerNorm, RMSNorm

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "LayerNorm", "RMSNorm", "Conv1d", "Conv2d", "Conv3d",
           "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "GroupNorm", "BatchNorm1d", "BatchNorm2d",
           "BatchNorm3d", "GroupedLinear", "mx_grouped_linear", "mx_linear", "mx_conv", "mx_conv_transpose",
           "ACTIVATIONS", "gated_activation", "weight_cast_cache", "checkpoint", "cross_entropy"]
