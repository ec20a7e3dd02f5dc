"""microxcaling's ``mx.specs``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.specs`."""

import sys

from mxtrain.emulation import specs as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
