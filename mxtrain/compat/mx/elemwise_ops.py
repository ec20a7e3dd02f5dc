"""microxcaling's ``mx.elemwise_ops``: elementwise rounding to ``bfloat=N`` / ``fp=N`` from mx_specs.

:func:`quantize_elemwise_op` reproduces microxcaling's rules and exact values
(bit-exact where its float ``log2`` is exact; mxtrain is exact everywhere, see
docs/numerics.md): ``bfloat`` and ``fp`` both 0 means no rounding; both set is an
error; ``bfloat`` must be 10..32 (32 = fp32, no rounding) and ``fp`` 7..32;
overflow goes to Inf; ``bfloat_subnorms=False`` flushes subnormals to zero.
"""

from __future__ import annotations

from mxtrain.compat.mx.precision import elemwise_format_of, precision_of
from mxtrain.emulation.precision import round_to

__all__ = ["quantize_elemwise_op", "elemwise_format_of"]


def quantize_elemwise_op(A, mx_specs, round=None):
    """Round every element of ``A`` to the specs' bfloatN/fpN (identity when off or ``mx_specs`` is None)."""
    return round_to(A, precision_of(mx_specs, round))
