"""microxcaling's ``mx.softmax``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.softmax`."""

import sys

from mxtrain.emulation import softmax as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
