"""The integer ids the kernels take for source dtypes and activations: one table each.

The Triton kernels compare them as constexprs (named from these tables) and the CUDA sources
switch on them (``csrc/cast_common.cuh``'s ``act_fwd`` / ``act_bwd``, the ``dtype`` switches of
``csrc/*.cu``); ``tests/kernels/test_ids.py`` reads those sources and checks that they agree.
"""

from __future__ import annotations

import enum

import torch

from mxtrain.activations import ACTIVATIONS, GATE_ACTIVATION, PLAIN

__all__ = ["DTYPE_IDS", "ACTIVATION_IDS", "PLAIN_ACTIVATION_IDS", "gate_activation_id", "Activation", "Prologue"]

# The dtype of a cast's source (and of what its prologue writes): the CUDA entry points' ``dtype``
# argument, the Triton kernels' OUT_KIND / W_KIND.
DTYPE_IDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}



class Activation(enum.IntEnum):
    """A cast's activation prologue: the plain activations 1-5 (act_fwd / act_bwd in CUDA, _activation /
    _act_bwd in Triton), the gated ones 6-9 (their gate runs the plain activation GATE_ACTIVATION names).
    Kernels take ``int(member)``; ``Activation.of("swiglu")`` names one."""

    GELU = 1
    GELU_TANH = 2
    RELU = 3
    SQUARED_RELU = 4
    SILU = 5
    SWIGLU = 6
    GEGLU = 7
    REGLU = 8
    GEGLU_TANH = 9

    @classmethod
    def of(cls, name: str) -> "Activation":
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown activation {name!r}; allowed: {', '.join(ACTIVATION_IDS)}") from None


class Prologue(enum.IntEnum):
    """What an FP8 cast computes before it quantizes (``PRE`` of the Triton kernels of ``float8_cast.py`` and
    of ``csrc/fp8_block_cast.cu``): the source itself, ``act(x)``, or ``grad * act'(x)``."""

    NONE = 0
    ACTIVATION = 1
    ACTIVATION_GRAD = 2

    @classmethod
    def of(cls, act: "str | None", grad) -> "Prologue":
        return cls.NONE if act is None else (cls.ACTIVATION if grad is None else cls.ACTIVATION_GRAD)


ACTIVATION_IDS = {a.name.lower(): int(a) for a in Activation}  # plain ints: Triton constexprs and ctypes
assert set(ACTIVATION_IDS) == set(ACTIVATIONS)
assert min(ACTIVATION_IDS[name] for name in GATE_ACTIVATION) > max(ACTIVATION_IDS[name] for name in PLAIN)
PLAIN_ACTIVATION_IDS = {name: ACTIVATION_IDS[name] for name in PLAIN}


def gate_activation_id(name: str) -> int:
    """The plain activation id of a gated activation's gate (``swiglu`` -> silu's)."""
    return ACTIVATION_IDS[GATE_ACTIVATION[name]]
