"""mxtrain: training and format exploration in Microscaling (MX) formats for PyTorch."""

from mxtrain import formats
from mxtrain.formats import ElemFormat, parse_format, parse_elemwise_format

__version__ = "0.1.0"
