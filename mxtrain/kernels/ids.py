"""The integer ids the kernels take for source dtypes and activations: one table each.

The Triton kernels compare them as constexprs (named from these tables) and the CUDA sources
switch on them (``csrc/cast_common.cuh``'s ``act_fwd`` / ``act_bwd``, the ``dtype`` switches of
``csrc/*.cu``); ``tests/kernels/test_ids.py`` reads those sources and checks that they agree.
"""

from __future__ import annotations

import torch

from mxtrain.activations import ACTIVATIONS, GATE_ACTIVATION, PLAIN

__all__ = ["DTYPE_IDS", "ACTIVATION_IDS", "PLAIN_ACTIVATION_IDS", "gate_activation_id"]

# The dtype of a cast's source (and of what its prologue writes): the CUDA entry points' ``dtype``
# argument, the Triton kernels' OUT_KIND / W_KIND.
DTYPE_IDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

# A cast's activation prologue: the plain activations 1-5 (act_fwd / act_bwd in CUDA, _activation /
# _act_bwd in Triton), the gated ones 6-9 (their gate runs the plain activation GATE_ACTIVATION names).
ACTIVATION_IDS = {"gelu": 1, "gelu_tanh": 2, "relu": 3, "squared_relu": 4, "silu": 5,
                  "swiglu": 6, "geglu": 7, "reglu": 8, "geglu_tanh": 9}
assert set(ACTIVATION_IDS) == set(ACTIVATIONS)
assert min(ACTIVATION_IDS[name] for name in GATE_ACTIVATION) > max(ACTIVATION_IDS[name] for name in PLAIN)
PLAIN_ACTIVATION_IDS = {name: ACTIVATION_IDS[name] for name in PLAIN}


def gate_activation_id(name: str) -> int:
    """The plain activation id of a gated activation's gate (``swiglu`` -> silu's)."""
    return ACTIVATION_IDS[GATE_ACTIVATION[name]]
