"""Hopper FP8 recipes: per-tensor current scaling, delayed scaling, DeepSeek-V3-style 128-block scaling.

They plug into the same machinery as the MX recipes: ``mx_autocast(recipe=...)``,
the same modules, the same ``recipe.role(name)`` view. They share only the
options of :class:`~mxtrain.recipes.Recipe` with the MX recipes: block sizes, scale
modes, rounding and seeds are MX options they do not have. Their role view is a
:class:`Float8RoleSpec`, not an MX :class:`~mxtrain.recipes.RoleSpec`; a module's
quantizers (mxtrain/modules/_quantizer.py) cast with those to FP8 and ``mx_gemm``
sends the resulting ``Float8Tensor`` operands to the FP8 GEMM.

* :class:`Float8CurrentScaling`: one fp32 scale per tensor, ``max_fp8 / amax`` of
  the tensor being cast (Transformer Engine's ``Float8CurrentScaling``).
* :class:`DelayedScaling`: the scale comes from a history of amaxes of earlier
  steps (TE's ``DelayedScaling``). The history lives on each module (its
  ``_extra_state`` in the state dict); see :meth:`DelayedScaling.make_state`.
* :class:`Float8BlockScaling`: one scale per 1x128 block of activations and
  gradients and per 128x128 block of weights (TE's ``Float8BlockScaling``,
  DeepSeek-V3).

Like mxtrain/recipes/recipe.py this module imports no torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mxtrain.formats import parse_format
from mxtrain.recipes.recipe import (
    ALL_RECIPE_CLASSES,
    BACKWARD_ROLES,
    ROLE_NAMES,
    Recipe,
    _RecipeClasses,
    _check_bool,
    _check_choice,
    _check_int,
    _choices,
    _describe,
    _recipe_dataclass,
    _recipe_field,
    _text_as_bool,
    _text_as_int,
    recipe_from_dict,
)

__all__ = [
    "FLOAT8_SCALINGS",
    "AMAX_COMPUTE_ALGOS",
    "ROLE_TENSORS",
    "BLOCK_LEN",
    "Float8RoleSpec",
    "Float8Recipe",
    "Float8CurrentScaling",
    "DelayedScaling",
    "Float8BlockScaling",
    "FLOAT8_RECIPE_CLASSES",
    "ALL_RECIPE_CLASSES",
    "recipe_from_dict",
]

FLOAT8_SCALINGS = ("current", "delayed", "block")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The tensor each GEMM operand role quantizes. Per-tensor scales belong to the tensor, so the
# two uses of X (fprop rowwise, wgrad columnwise) share one scale and are cast in one call.
ROLE_TENSORS: Mapping[str, str] = {
    "fprop_input": "input", "wgrad_input": "input",
    "fprop_weight": "weight", "dgrad_weight": "weight",
    "dgrad_grad_output": "grad_output", "wgrad_grad_output": "grad_output",
}
BLOCK_LEN = 128  # Float8BlockScaling: 1 x BLOCK_LEN activation/gradient blocks, BLOCK_LEN^2 weight blocks
_FP8_FORMATS = ("e4m3", "hybrid")


def _check_float8_format(owner: str, name: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str, one of {_choices(_FP8_FORMATS)}; got {_describe(value)}")
    key = value.strip().lower().removeprefix("fp8_").removeprefix("fp8")
    if key in ("e5m2",):
        raise ValueError(f"{owner}.{name}={value!r}: e5m2 for every role is not offered: Hopper's FP8 tensor "
                         f"cores have no e5m2 x e5m2 GEMM; use 'hybrid' (e4m3 inputs and weights, e5m2 gradients)")
    if key not in _FP8_FORMATS:
        raise ValueError(f"{owner}.{name} must be one of {_choices(_FP8_FORMATS)} ('hybrid' = e4m3 inputs and "
                         f"weights, e5m2 grad-outputs, as Transformer Engine's Format.HYBRID), got {value!r}")
    return key


def _check_amax_epsilon(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}.{name} must be a float >= 0 (smallest amax used for a scale), got {_describe(value)}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{owner}.{name} must be a finite float >= 0 (smallest amax used for a scale), got {value!r}")
    return value


def _text_as_float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _check_margin(owner: str, name: str, value) -> int:
    return _check_int(owner, name, value, minimum=0, maximum=127,
                      meaning="the scale is divided by 2**margin, headroom for amax growth")


def _check_history_len(owner: str, name: str, value) -> int:
    return _check_int(owner, name, value, minimum=1, maximum=1 << 20, meaning="steps of amax kept per tensor")


def _check_amax_algo(owner: str, name: str, value) -> str:
    return _check_choice(owner, name, value, AMAX_COMPUTE_ALGOS)


# --- role view ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Float8RoleSpec:
    """How one GEMM operand is cast to FP8: what ``Float8Recipe.role(name)`` returns.

    Attributes:
        fmt: ``"fp8_e4m3"``, ``"fp8_e5m2"`` or None (high precision).
        scaling: ``"current"``, ``"delayed"`` or ``"block"``.
        tensor: ``"input"``, ``"weight"`` or ``"grad_output"`` (see ``ROLE_TENSORS``).
        block: block shape ``(rows, cols)`` in the layout the GEMM reads (the reduction
            axis last): ``(1, 128)`` or ``(128, 128)`` for block scaling, None for one
            scale per tensor.
        power_of_2_scales: scales rounded down to a power of two.
        amax_epsilon: amaxes below it are raised to it before computing a scale.
        margin: delayed scaling: scale divided by ``2**margin``.
        amax_reduction_group: process group whose ranks share one amax (all-reduce
            MAX) for current scaling; compared by identity.
        state, slot: delayed scaling: the module's amax-history state and the name
            of this tensor in it (set when a module builds its quantizers; None otherwise).

    Like an MX :class:`~mxtrain.recipes.RoleSpec` it has ``fmt``, ``quantized`` and
    ``elem_format``; MX's ``block_size``, ``scale_mode`` and ``rounding`` it has not (an
    FP8 cast rounds to nearest-even and saturates): code that needs them asks
    ``isinstance(spec, RoleSpec)`` first.
    """

    fmt: str | None
    scaling: str
    tensor: str
    block: tuple[int, int] | None = None
    power_of_2_scales: bool = False
    amax_epsilon: float = 0.0
    margin: int = 0
    amax_reduction_group: Any = field(default=None, repr=False)
    state: Any = field(default=None, repr=False)
    slot: str | None = None

    def __post_init__(self) -> None:
        if self.fmt not in (None, "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"Float8RoleSpec.fmt must be 'fp8_e4m3', 'fp8_e5m2' or None, got {self.fmt!r}")
        _check_choice("Float8RoleSpec", "scaling", self.scaling, FLOAT8_SCALINGS)
        if self.block is not None:
            object.__setattr__(self, "block", tuple(self.block))

    @property
    def quantized(self) -> bool:
        return self.fmt is not None

    @property
    def elem_format(self):
        return None if self.fmt is None else parse_format(self.fmt)


# --- recipes ------------------------------------------------------------------------------

@_recipe_dataclass
class Float8Recipe(Recipe, abstract=True):
    """Base of the FP8 recipes (not instantiable): the options they share.

    Attributes:
        fp8_format: ``"hybrid"`` (e4m3 inputs and weights, e5m2 grad-outputs;
            Transformer Engine's ``Format.HYBRID``) or ``"e4m3"`` (every role).
        power_of_2_scales: round every scale down to a power of two (then the
            scale-inverse is exact and dequantization is exact in fp32).
        elemwise_format, elemwise_subnormals, quantize_backward: as on
            :class:`~mxtrain.recipes.Recipe`.
        amax_reduction_group: a ``torch.distributed`` process group, or None. Not a
            recipe option but the run's topology, so it is neither compared nor
            serialised: pass it where a tensor is sharded across ranks (sequence /
            tensor parallelism) so that all ranks cast with the same scale.

    The MX options (``block_size``, ``scale_mode``, ``rounding``, ``grad_rounding``,
    ``seed``) are not options of the FP8 recipes: FP8 casts round to nearest-even with
    fp32 scales. Passing one raises ``TypeError`` saying so.
    """

    fp8_format: str = _recipe_field("hybrid", _check_float8_format)
    power_of_2_scales: bool = _recipe_field(False, _check_bool, _text_as_bool)
    amax_reduction_group: Any = field(default=None, compare=False)

    scaling: ClassVar[str] = ""
    family: ClassVar[str] = "FP8"

    def tensor_format(self, tensor: str) -> str:
        """The FP8 format of ``"input"``, ``"weight"`` or ``"grad_output"``."""
        return "fp8_e5m2" if (self.fp8_format == "hybrid" and tensor == "grad_output") else "fp8_e4m3"

    def _spec_options(self, tensor: str) -> dict:
        return {}

    def _make_role_specs(self) -> dict[str, Float8RoleSpec]:
        specs = {}
        for name in ROLE_NAMES:
            tensor = ROLE_TENSORS[name]
            fmt = None if (name in BACKWARD_ROLES and not self.quantize_backward) else self.tensor_format(tensor)
            specs[name] = Float8RoleSpec(fmt=fmt, scaling=self.scaling, tensor=tensor,
                                         power_of_2_scales=self.power_of_2_scales, slot=None,
                                         **self._spec_options(tensor))
        return specs


@_recipe_dataclass
class Float8CurrentScaling(Float8Recipe):
    """FP8 with one fp32 scale per tensor, computed from the tensor being cast.

    ``scale = max_fp8 / amax(tensor)`` (448 for e4m3, 57344 for e5m2); an all-zero
    or non-finite amax gives scale 1; optionally rounded down to a power of two.
    Every cast writes the FP8 data and ``scale_inv = 1 / scale`` together
    (``mxtrain.quantization.float8.Float8Tensor``), and for a tensor that a GEMM
    also needs transposed, the transpose in the same call.

    Attributes:
        fp8_format: ``"hybrid"`` (default) or ``"e4m3"``.
        power_of_2_scales: default False.
        amax_epsilon: float >= 0; an amax below it is raised to it (default 0).
        amax_reduction_group: see :class:`Float8Recipe`.

    Shared options (elemwise_format, elemwise_subnormals, quantize_backward): see
    :class:`~mxtrain.recipes.Recipe`.
    """

    amax_epsilon: float = _recipe_field(0.0, _check_amax_epsilon, _text_as_float)
    short_name: ClassVar[str] = "fp8_current"
    scaling: ClassVar[str] = "current"

    def _spec_options(self, tensor: str) -> dict:
        return {"amax_epsilon": self.amax_epsilon, "amax_reduction_group": self.amax_reduction_group}


@_recipe_dataclass
class DelayedScaling(Float8Recipe):
    """FP8 with per-tensor scales from a history of amaxes of earlier steps (Transformer Engine's DelayedScaling).

    Each cast uses the tensor's current scale and records the tensor's amax. At the
    start of the module's next forward (one training step later) every recorded
    amax enters its tensor's history (newest first, ``amax_history_len`` kept),
    the amaxes are all-reduced (MAX) over ``amax_reduction_group`` if one is given,
    and each scale becomes ``max_fp8 / amax / 2**margin`` with
    ``amax = max(history)`` (``"max"``) or the newest entry (``"most_recent"``). An
    amax of 0 or a non-finite one keeps the previous scale. A tensor's first cast
    (no history yet) takes its scale from its own amax, as current scaling does;
    Transformer Engine casts with 1 there, so that small gradients underflow in
    E5M2 and the layers below get zeros, one more layer recovering per step.
    Under ``torch.compile`` a graph casts with the delayed scale from the first
    step (scale 1, as in TE): run one step eagerly first.

    The state (histories, scales, amaxes recorded since the last update) lives on
    each module: created by :meth:`make_state` on the first forward under this
    recipe and saved in the module's state dict under ``_extra_state``, so a
    checkpoint resumes exactly. LayerNormMLP keeps fc1 and fc2 tensors apart.
    The functional ``mxtrain.modules.mx_linear`` has no module to keep it on and
    refuses this recipe.

    Attributes:
        fp8_format: ``"hybrid"`` (default) or ``"e4m3"``.
        margin: int >= 0 (default 0).
        amax_history_len: int >= 1 (default 1024).
        amax_compute_algo: ``"max"`` (default) or ``"most_recent"``.
        power_of_2_scales: default False.
        amax_reduction_group: see :class:`Float8Recipe`.
    """

    margin: int = _recipe_field(0, _check_margin, _text_as_int)
    amax_history_len: int = _recipe_field(1024, _check_history_len, _text_as_int)
    amax_compute_algo: str = _recipe_field("max", _check_amax_algo)
    short_name: ClassVar[str] = "fp8_delayed"
    scaling: ClassVar[str] = "delayed"

    def _spec_options(self, tensor: str) -> dict:
        return {"margin": self.margin}

    def make_state(self):
        """A fresh per-module state (amax histories, scales): ``DelayedScalingState``. A module's quantizers
        are bound to it: their specs carry the state and a slot per tensor (mxtrain/modules/_quantizer.py)."""
        from mxtrain.quantization.float8 import DelayedScalingState  # torch lives below the recipes
        return DelayedScalingState(self.amax_history_len)


@_recipe_dataclass
class Float8BlockScaling(Float8Recipe):
    """FP8 with one scale per block: 1x128 for inputs and gradients, 128x128 for weights (DeepSeek-V3).

    Blocks lie along the GEMM's reduction axis: X is cast with 1x128 blocks along K
    for fprop and, separately, along tokens for wgrad; dY the same way along N and
    along tokens; W once in 128x128 blocks (its transpose reuses the blocks).
    Each block's scale is ``max_fp8 / amax(block)`` (1 for an all-zero block).
    The GEMM accumulates each 128-long K slice in the tensor cores and adds it,
    scaled, into an fp32 accumulator ("promotion every 128 K").

    Attributes:
        fp8_format: ``"e4m3"`` (default, as TE's block recipe) or ``"hybrid"``.
        power_of_2_scales: default True (as Transformer Engine's block recipe).
        amax_epsilon: float >= 0 (default 0).
    """

    fp8_format: str = _recipe_field("e4m3", _check_float8_format)
    power_of_2_scales: bool = _recipe_field(True, _check_bool, _text_as_bool)
    amax_epsilon: float = _recipe_field(0.0, _check_amax_epsilon, _text_as_float)
    short_name: ClassVar[str] = "fp8_block"
    scaling: ClassVar[str] = "block"

    def _spec_options(self, tensor: str) -> dict:
        block = (BLOCK_LEN, BLOCK_LEN) if tensor == "weight" else (1, BLOCK_LEN)
        return {"block": block, "amax_epsilon": self.amax_epsilon}


# A live read-only view of the registered FP8 recipe classes (ALL_RECIPE_CLASSES: MX and FP8).
FLOAT8_RECIPE_CLASSES: Mapping[str, type[Recipe]] = _RecipeClasses(Float8Recipe)
