"""Exact reference numerics: the specification every kernel is tested against."""

from mxtrain.quantization.elemwise import quantize_elemwise
from mxtrain.quantization.mx import fake_quantize_mx, quantize_mx, scale_values, shared_exponent_bytes
from mxtrain.quantization.mxtensor import MXPlane, MXTensor
from mxtrain.quantization.packing import pack_codes, packed_length, unpack_codes
from mxtrain.quantization.rounding import code_table, decode_codes, element_codes

__all__ = [
    "quantize_mx", "fake_quantize_mx", "quantize_elemwise", "MXTensor", "MXPlane",
    "pack_codes", "unpack_codes", "packed_length", "element_codes", "decode_codes", "code_table",
    "scale_values", "shared_exponent_bytes",
]
