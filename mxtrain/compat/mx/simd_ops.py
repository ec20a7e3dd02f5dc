"""microxcaling's ``mx.simd_ops``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.simd_ops`."""

import sys

from mxtrain.emulation import simd_ops as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
