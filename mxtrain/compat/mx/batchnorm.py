"""microxcaling's ``mx.batchnorm``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.batchnorm`."""

import sys

from mxtrain.emulation import batchnorm as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
