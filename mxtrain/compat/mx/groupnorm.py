"""microxcaling's ``mx.groupnorm``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.groupnorm`."""

import sys

from mxtrain.emulation import groupnorm as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
