"""microxcaling's ``mx.formats``: mxtrain's elementwise emulation, :mod:`mxtrain.emulation.formats`."""

import sys

from mxtrain.emulation import formats as _emulation

# the same module object under microxcaling's name, so private names, module state and patches agree
sys.modules[__name__] = _emulation
