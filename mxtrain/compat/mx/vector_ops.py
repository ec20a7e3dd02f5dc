"""microxcaling's ``mx.vector_ops``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.vector_ops`."""

import sys

from mxtrain.emulation import vector_ops as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
