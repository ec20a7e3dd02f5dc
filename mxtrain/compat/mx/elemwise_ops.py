"""microxcaling's ``mx.elemwise_ops``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.elemwise_ops`."""

import sys

from mxtrain.emulation import elemwise_ops as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
