"""microxcaling's ``mx.norm_utils``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.norm_utils`."""

import sys

from mxtrain.emulation import norm_utils as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
