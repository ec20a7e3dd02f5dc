"""microxcaling's ``mx.activations``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.activations`."""

import sys

from mxtrain.emulation import activations as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
