"""Recipes: which MX format, block size, scale mode and rounding each GEMM operand gets.

A recipe is a frozen, validated dataclass. The modules never read its fields
directly: they ask for the *role view*, ``recipe.role(name) -> RoleSpec``, for
each of the six GEMM operand roles of a linear layer ``Y = X Wᵀ``::

    fprop  Y  = X Wᵀ    fprop_input (X),       fprop_weight (W)
    dgrad  dX = dY W    dgrad_grad_output (dY), dgrad_weight (W)
    wgrad  dW = dYᵀ X   wgrad_grad_output (dY), wgrad_input (X)

plus four recipe-wide attributes: ``elemwise_format``, ``elemwise_subnormals``,
``quantize_backward`` and ``seed``. Every recipe class, the shorthand ones
(:class:`MXFP8Recipe`, :class:`MXFP6Recipe`, :class:`MXFP4Recipe`,
:class:`MXINT8Recipe`) and the fully custom :class:`MXRecipe`, answers the same
interface, so a module never needs to know which class it was given.

This module is pure data: it imports no torch, so a recipe can be built, printed
and serialised anywhere (a launcher, a sweep driver, a config file).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, ClassVar

from mxtrain.formats import (
    BFLOAT_MAX_BITS,
    BFLOAT_MIN_BITS,
    FP_MAX_BITS,
    FP_MIN_BITS,
    MAX_BLOCK_SIZE,
    MX_FORMAT_NAMES,
    ElemFormat,
    parse_elemwise_format,
    pack_group,
    parse_format,
)

__all__ = [
    "ROLE_NAMES",
    "FORWARD_ROLES",
    "BACKWARD_ROLES",
    "GRAD_OUTPUT_ROLES",
    "SCALE_MODES",
    "ROUNDINGS",
    "RoleSpec",
    "Recipe",
    "MXRecipe",
    "MXFP8Recipe",
    "MXFP6Recipe",
    "MXFP4Recipe",
    "MXINT8Recipe",
    "RECIPE_CLASSES",
    "recipe_from_dict",
]

ROLE_NAMES = (
    "fprop_input",
    "fprop_weight",
    "dgrad_weight",
    "dgrad_grad_output",
    "wgrad_input",
    "wgrad_grad_output",
)
FORWARD_ROLES = ("fprop_input", "fprop_weight")
BACKWARD_ROLES = ("dgrad_weight", "dgrad_grad_output", "wgrad_input", "wgrad_grad_output")
# The gradient tensors themselves: where HYBRID puts e5m2 and `grad_rounding` applies.
GRAD_OUTPUT_ROLES = ("dgrad_grad_output", "wgrad_grad_output")

# Same vocabulary as the quantizers (mxtrain/quantization); kept here so that recipes
# stay importable without torch. tests/test_recipes.py checks the two agree.
SCALE_MODES = ("floor", "rceil", "even")
ROUNDINGS = ("even", "nearest", "floor", "stochastic")

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes up to a 64-bit unsigned seed

RECIPE_TAG_KEY = "recipe"


def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


def _describe(value) -> str:
    return f"{type(value).__name__} {value!r}"


# --- field checks -----------------------------------------------------------------
# Each takes (owner, field_name, value) and returns the canonical value to store, so
# that equal recipes compare, hash and serialise equal however they were spelled.


def _check_int(owner: str, name: str, value, *, minimum: int, maximum: int | None, meaning: str) -> int:
    # bool is an int subclass; True as a block size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}.{name} must be an int ({meaning}), got {_describe(value)}")
    value = int(value)  # numpy/torch integers from a sweep become plain, JSON-able ints
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{owner}.{name} must be an int {allowed} ({meaning}), got {value!r}")
    return value


def _check_block_size(owner: str, name: str, value) -> int:
    return _check_int(owner, name, value, minimum=0, maximum=MAX_BLOCK_SIZE,
                      meaning="elements per shared scale; 0 = one scale for the whole axis")


def _check_block_packs(owner: str, block_size: int, formats) -> None:
    """Sub-byte codes are packed a group at a time (fp6: 4 codes in 3 bytes, fp4/int4: 2 a byte, int2:
    4 a byte), so a block must hold whole groups."""
    for fmt in dict.fromkeys(f for f in formats if f is not None):
        group = pack_group(fmt)
        if block_size % group:
            raise ValueError(f"{owner}.block_size={block_size} cannot be packed for {fmt} elements, which are "
                             f"packed {group} codes at a time: use a multiple of {group} (e.g. "
                             f"{max(group, block_size - block_size % group)}), or 0 for one scale per axis")


def _check_seed(owner: str, name: str, value) -> int | None:
    if value is None:
        return None
    return _check_int(owner, name, value, minimum=0, maximum=SEED_MAX,
                      meaning="seed for stochastic rounding, or None for torch's global RNG")


def _check_bool(owner: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool (True or False), got {_describe(value)}")
    return value


def _check_choice(owner: str, name: str, value, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str, one of {_choices(allowed)}; got {_describe(value)}")
    key = value.strip().lower()
    if key not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {_choices(allowed)}, got {value!r}")
    return key


def _check_scale_mode(owner: str, name: str, value) -> str:
    return _check_choice(owner, name, value, SCALE_MODES)


def _check_rounding(owner: str, name: str, value) -> str:
    return _check_choice(owner, name, value, ROUNDINGS)


def _check_rounding_or_none(owner: str, name: str, value) -> str | None:
    if value is None:
        return None
    return _check_choice(owner, name, value, ROUNDINGS)


def _mx_format(owner: str, name: str, value) -> ElemFormat:
    if not isinstance(value, (str, ElemFormat)):
        raise TypeError(f"{owner}.{name} must be an MX element format name (one of "
                        f"{', '.join(MX_FORMAT_NAMES)}), an ElemFormat or None; got {_describe(value)}")
    try:
        fmt = parse_format(value)
    except ValueError as err:
        raise ValueError(f"{owner}.{name}: {err}") from None
    # An ElemFormat built by hand could carry a name that parse_format cannot read
    # back; storing it would break to_dict/from_dict.
    if fmt.name not in MX_FORMAT_NAMES:
        raise ValueError(f"{owner}.{name}: {fmt!r} is not one of the named MX element formats "
                         f"({', '.join(MX_FORMAT_NAMES)})")
    return fmt


def _check_mx_format_or_none(owner: str, name: str, value) -> str | None:
    if value is None:
        return None
    try:
        return _mx_format(owner, name, value).name
    except ValueError as err:
        raise ValueError(f"{err} (or None to keep this operand in high precision)") from None


_ELEMWISE_ALLOWED = (f"None (no elementwise quantization), 'bfloatN' (N={BFLOAT_MIN_BITS}..{BFLOAT_MAX_BITS}, "
                     f"8 exponent bits, e.g. 'bfloat16') or 'fpN' (N={FP_MIN_BITS}..{FP_MAX_BITS}, "
                     f"5 exponent bits, e.g. 'fp16')")


def _check_elemwise_format(owner: str, name: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, ElemFormat)):
        raise TypeError(f"{owner}.{name} must be {_ELEMWISE_ALLOWED}; got {_describe(value)}")
    try:
        fmt = parse_elemwise_format(value)
    except ValueError as err:
        # parse_elemwise_format's own message also lists the MX element formats, which are
        # wrong here, so say what this field takes instead.
        raise ValueError(f"{owner}.{name} must be {_ELEMWISE_ALLOWED}; got {value!r}") from err
    if fmt.mx_element:
        raise ValueError(f"{owner}.{name} got {value!r}, which is an MX element format: those need a "
                         f"shared block scale and belong in the GEMM operand roles. Elementwise precision "
                         f"(norms, activations, softmax) must be {_ELEMWISE_ALLOWED}")
    if parse_elemwise_format(fmt.name) != fmt:
        raise ValueError(f"{owner}.{name}: {fmt!r} is not a named elementwise format; must be {_ELEMWISE_ALLOWED}")
    return fmt.name


# --- field declaration ------------------------------------------------------------

_CHECK = "mxtrain_check"
_FROM_TEXT = "mxtrain_from_text"

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("true", "yes", "on", "1")
_FALSE_WORDS = ("false", "no", "off", "0")


def _text_as_str(text: str) -> str:
    return text


def _text_as_str_or_none(text: str) -> str | None:
    return None if text.strip().lower() in _NONE_WORDS else text


def _text_as_int(text: str) -> int | str:
    try:
        return int(text, 0)
    except ValueError:
        return text  # the field check then reports the bad value with the allowed range


def _text_as_int_or_none(text: str) -> int | str | None:
    return None if text.strip().lower() in _NONE_WORDS else _text_as_int(text)


def _text_as_bool(text: str) -> bool | str:
    key = text.strip().lower()
    if key in _TRUE_WORDS:
        return True
    if key in _FALSE_WORDS:
        return False
    return text


def _recipe_field(default, check: Callable[[str, str, Any], Any],
                  from_text: Callable[[str], Any] = _text_as_str):
    """A recipe field: its check (run in __post_init__) and how to read it from a command line."""
    return field(default=default, metadata={_CHECK: check, _FROM_TEXT: from_text})


def _run_field_checks(obj) -> None:
    owner = type(obj).__name__
    for f in fields(obj):
        check = f.metadata.get(_CHECK)
        if check is not None:
            # frozen dataclass: canonicalise in place before anyone can see the object
            object.__setattr__(obj, f.name, check(owner, f.name, getattr(obj, f.name)))


# --- RoleSpec ---------------------------------------------------------------------


@dataclass(frozen=True)
class RoleSpec:
    """How one GEMM operand is quantized: what a module reads from ``recipe.role(name)``.

    Attributes:
        fmt: canonical MX element format name (``"fp8_e4m3"``, ``"fp4_e2m1"``, ``"int8"``...;
            see ``mxtrain.formats.MX_FORMAT_NAMES``), or ``None``: leave this operand in
            high precision (the GEMM then runs on the unquantized tensor).
        block_size: elements per shared E8M0 scale along the reduction axis; 0 = one
            scale for the whole axis.
        scale_mode: shared-exponent rule, one of ``SCALE_MODES`` (see DESIGN.md).
        rounding: element rounding, one of ``ROUNDINGS``.
    """

    fmt: str | None
    block_size: int
    scale_mode: str
    rounding: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", _check_mx_format_or_none("RoleSpec", "fmt", self.fmt))
        object.__setattr__(self, "block_size", _check_block_size("RoleSpec", "block_size", self.block_size))
        object.__setattr__(self, "scale_mode", _check_scale_mode("RoleSpec", "scale_mode", self.scale_mode))
        object.__setattr__(self, "rounding", _check_rounding("RoleSpec", "rounding", self.rounding))

    @property
    def quantized(self) -> bool:
        """False when this operand stays in high precision (``fmt is None``)."""
        return self.fmt is not None

    @property
    def elem_format(self) -> ElemFormat | None:
        """The :class:`~mxtrain.formats.ElemFormat` of ``fmt`` (None when not quantized)."""
        return None if self.fmt is None else parse_format(self.fmt)


# --- Recipe base ------------------------------------------------------------------

# Every recipe class is declared with this: kw_only because positional recipe
# arguments would be unreadable at call sites; repr=False keeps Recipe.__repr__.
_recipe_dataclass = dataclass(frozen=True, kw_only=True, repr=False)


@_recipe_dataclass
class Recipe:
    """Base of every recipe: the options shared by all, and the role-view interface.

    Not instantiable itself; use :class:`MXFP8Recipe`, :class:`MXFP6Recipe`,
    :class:`MXFP4Recipe`, :class:`MXINT8Recipe` or :class:`MXRecipe`.

    Attributes (shared by every recipe):
        block_size: elements per shared scale (int >= 0, default 32; 0 = one scale for
            the whole reduction axis). microxcaling: ``block_size``.
        scale_mode: ``"rceil"`` (default; Transformer Engine / cuBLAS, never saturates),
            ``"floor"`` (OCP MX v1.0 and microxcaling) or ``"even"``.
        rounding: element rounding for every role: ``"even"`` (default, ties to even),
            ``"nearest"`` (ties away from zero; microxcaling's ``round`` default),
            ``"floor"`` (toward zero) or ``"stochastic"``.
        grad_rounding: rounding for the two grad-output roles (``dgrad_grad_output``,
            ``wgrad_grad_output``), e.g. ``"stochastic"`` to round gradients
            stochastically while the forward stays deterministic. None (default; ``"stochastic"``
            in :class:`MXFP4Recipe`) = ``rounding``.
        elemwise_format: precision of elementwise ops (norms, activations, softmax):
            None (default, not quantized), ``"bfloatN"`` (8 exponent bits, e.g.
            ``"bfloat16"``) or ``"fpN"`` (5 exponent bits, e.g. ``"fp16"``). Stored
            canonically (``"bf16"`` becomes ``"bfloat16"``). Read it with
            ``mxtrain.formats.parse_elemwise_format``, not ``parse_format``: here
            ``"fp8"`` means 1-5-2, not fp8_e4m3. microxcaling: ``bfloat=N`` / ``fp=N``.
        elemwise_subnormals: False flushes elementwise subnormals to zero.
            microxcaling: ``bfloat_subnorms``.
        quantize_backward: False runs the dgrad and wgrad GEMMs in high precision
            (their four roles report ``fmt=None``). microxcaling: ``quantize_backprop``.
        seed: int in [0, 2**64 - 1] seeding stochastic rounding, so runs are
            reproducible; None uses torch's global RNG.
    """

    block_size: int = _recipe_field(32, _check_block_size, _text_as_int)
    scale_mode: str = _recipe_field("rceil", _check_scale_mode)
    rounding: str = _recipe_field("even", _check_rounding)
    grad_rounding: str | None = _recipe_field(None, _check_rounding_or_none, _text_as_str_or_none)
    elemwise_format: str | None = _recipe_field(None, _check_elemwise_format, _text_as_str_or_none)
    elemwise_subnormals: bool = _recipe_field(True, _check_bool, _text_as_bool)
    quantize_backward: bool = _recipe_field(True, _check_bool, _text_as_bool)
    seed: int | None = _recipe_field(None, _check_seed, _text_as_int_or_none)

    # Short name used by recipe_from_string ("mxfp8", "mx", ...).
    short_name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if type(self) is Recipe:
            raise TypeError("Recipe is the abstract base class; instantiate one of "
                            f"{', '.join(RECIPE_CLASSES)}")
        _run_field_checks(self)
        _check_block_packs(type(self).__name__, self.block_size, self._role_formats().values())

    # -- the interface the modules consume --

    def _role_formats(self) -> Mapping[str, str | None]:
        """The format of each role before ``quantize_backward`` is applied."""
        raise NotImplementedError

    @functools.cached_property
    def _role_specs(self) -> dict[str, RoleSpec]:
        # Computed once per recipe: modules call role() on every forward/backward.
        # (cached_property writes the instance __dict__ directly, so it works on a
        # frozen dataclass and is not a field: equality and hashing ignore it.)
        formats = self._role_formats()
        specs = {}
        for name in ROLE_NAMES:
            fmt = formats[name]
            if name in BACKWARD_ROLES and not self.quantize_backward:
                fmt = None
            rounding = self.rounding
            if name in GRAD_OUTPUT_ROLES and self.grad_rounding is not None:
                rounding = self.grad_rounding
            specs[name] = RoleSpec(fmt=fmt, block_size=self.block_size,
                                   scale_mode=self.scale_mode, rounding=rounding)
        return specs  # a plain dict, so the cache pickles with the recipe

    def role(self, name: str) -> RoleSpec:
        """The quantization of one GEMM operand role (one of ``ROLE_NAMES``)."""
        try:
            return self._role_specs[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown GEMM operand role {name!r}; valid roles: {_choices(ROLE_NAMES)}") from None

    def roles(self) -> Mapping[str, RoleSpec]:
        """All six role views, in ``ROLE_NAMES`` order (read-only mapping)."""
        return MappingProxyType(self._role_specs)

    # -- construction helpers --

    def replace(self, **changes) -> "Recipe":
        """A copy with some fields changed (validated like a fresh recipe)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def _ordered_fields(cls) -> list[dataclasses.Field]:
        # The class's own fields (fp8_format, the role formats...) read best first.
        shared = {f.name for f in fields(Recipe)}
        all_fields = fields(cls)
        return [f for f in all_fields if f.name not in shared] + [f for f in all_fields if f.name in shared]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls._ordered_fields())

    def __repr__(self) -> str:
        # Only the fields that differ from their defaults, like MXFP8Recipe(fp8_format='hybrid'):
        # short, and eval() gives the same recipe back.
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in self._ordered_fields()
                   if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(changed)})"

    # -- serialisation --

    def to_dict(self) -> dict[str, Any]:
        """Every field plus ``"recipe": <class name>``; values are str, int, bool or None (JSON-safe)."""
        d: dict[str, Any] = {RECIPE_TAG_KEY: type(self).__name__}
        d.update((f.name, getattr(self, f.name)) for f in self._ordered_fields())
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        """Rebuild a recipe from :meth:`to_dict` output. Missing fields take their defaults.

        On ``Recipe`` itself this dispatches on the ``"recipe"`` tag (see
        :func:`recipe_from_dict`); on a concrete class the tag is optional but must
        match. Unknown keys raise ``ValueError``.
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {_describe(d)}")
        if cls is Recipe:
            return recipe_from_dict(d)
        kwargs = dict(d)
        tag = kwargs.pop(RECIPE_TAG_KEY, cls.__name__)
        if tag != cls.__name__:
            raise ValueError(f"{cls.__name__}.from_dict got a dict tagged {RECIPE_TAG_KEY}={tag!r}; "
                             f"use recipe_from_dict to rebuild any recipe class from its tag")
        valid = cls.field_names()
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            raise ValueError(f"unknown key(s) for {cls.__name__}: {_choices(unknown)}; "
                             f"valid keys: {_choices((RECIPE_TAG_KEY,) + valid)}")
        return cls(**kwargs)


# --- concrete recipes -------------------------------------------------------------

_FP8_FORMATS = ("e4m3", "e5m2", "hybrid")
_FP6_FORMATS = ("e2m3", "e3m2")


def _check_format_variant(owner: str, name: str, value, prefix: str, variants: tuple[str, ...],
                          hint: str = "") -> str:
    """One of ``variants`` ("e4m3", "hybrid"...); any spelling of ``prefix + variant`` also works."""
    if not isinstance(value, (str, ElemFormat)):
        raise TypeError(f"{owner}.{name} must be a str, one of {_choices(variants)}; got {_describe(value)}")
    if isinstance(value, str) and value.strip().lower() in variants:
        return value.strip().lower()
    try:
        variant = _mx_format(owner, name, value).name.removeprefix(prefix)
    except ValueError:
        variant = None
    if variant not in variants:
        raise ValueError(f"{owner}.{name} must be one of {_choices(variants)}{hint}, got {value!r}")
    return variant


def _check_fp8_format(owner: str, name: str, value) -> str:
    return _check_format_variant(owner, name, value, "fp8_", _FP8_FORMATS,
                                 " ('hybrid' = e4m3 inputs and weights, e5m2 grad-outputs, "
                                 "as Transformer Engine's Format.HYBRID)")


def _check_fp6_format(owner: str, name: str, value) -> str:
    return _check_format_variant(owner, name, value, "fp6_", _FP6_FORMATS)


def _same_format_for_every_role(fmt: str) -> dict[str, str]:
    return dict.fromkeys(ROLE_NAMES, fmt)


@_recipe_dataclass
class MXFP8Recipe(Recipe):
    """MXFP8 training: FP8 elements, 32-element blocks, E8M0 scales (Transformer Engine's MXFP8BlockScaling).

    Attributes:
        fp8_format: ``"e4m3"`` (default) for every role; ``"hybrid"``: e4m3 for inputs and
            weights, e5m2 (more range) for the two grad-output roles, like Transformer
            Engine's ``Format.HYBRID``; ``"e5m2"`` for every role. Any spelling of the
            two FP8 formats is accepted (``"E4M3"``, ``"fp8_e5m2"``) and stored short.

    The shared options (``block_size=32``, ``scale_mode="rceil"``, ``rounding="even"``,
    ``grad_rounding``, ``elemwise_format``, ``elemwise_subnormals``,
    ``quantize_backward``, ``seed``) are described on :class:`Recipe`.
    """

    fp8_format: str = _recipe_field("e4m3", _check_fp8_format)
    short_name: ClassVar[str] = "mxfp8"

    def _role_formats(self) -> Mapping[str, str | None]:
        if self.fp8_format == "hybrid":
            formats = _same_format_for_every_role("fp8_e4m3")
            formats.update(dict.fromkeys(GRAD_OUTPUT_ROLES, "fp8_e5m2"))
            return formats
        return _same_format_for_every_role(f"fp8_{self.fp8_format}")


@_recipe_dataclass
class MXFP6Recipe(Recipe):
    """MXFP6: FP6 elements for every role.

    Attributes:
        fp6_format: ``"e2m3"`` (default: more mantissa, max 7.5) or ``"e3m2"`` (more
            range, max 28). Any spelling (``"fp6_e3m2"``, ``"E3M2"``) is accepted and stored short.

    Shared options: see :class:`Recipe`.
    """

    fp6_format: str = _recipe_field("e2m3", _check_fp6_format)
    short_name: ClassVar[str] = "mxfp6"

    def _role_formats(self) -> Mapping[str, str | None]:
        return _same_format_for_every_role(f"fp6_{self.fp6_format}")


@_recipe_dataclass
class MXFP4Recipe(Recipe):
    """MXFP4: fp4_e2m1 elements for every role, gradients rounded stochastically by default.

    With 8 magnitudes per block, rounding a gradient to nearest is biased and small
    components vanish; ``grad_rounding="stochastic"`` (the default here, as in Transformer
    Engine's NVFP4 recipe) keeps the two grad-output roles unbiased while the forward
    stays round-to-nearest-even. ``grad_rounding=None`` gives the deterministic recipe.
    Seed policy: ``seed=None`` (default) draws from torch's global RNG, so
    ``torch.manual_seed`` makes a run reproducible; an int gives the recipe its own
    stream and leaves the global RNG (dropout, data order) untouched.
    See docs/fp4.md for the layers :func:`mxtrain.convert` keeps in high precision.
    Shared options: see :class:`Recipe`.
    """

    grad_rounding: str | None = _recipe_field("stochastic", _check_rounding_or_none, _text_as_str_or_none)
    short_name: ClassVar[str] = "mxfp4"

    def _role_formats(self) -> Mapping[str, str | None]:
        return _same_format_for_every_role("fp4_e2m1")


@_recipe_dataclass
class MXINT8Recipe(Recipe):
    """MXINT8: int8 elements (sign-magnitude fixed point, k/64) for every role.

    Shared options: see :class:`Recipe`.
    """

    short_name: ClassVar[str] = "mxint8"

    def _role_formats(self) -> Mapping[str, str | None]:
        return _same_format_for_every_role("int8")


@_recipe_dataclass
class MXRecipe(Recipe):
    """Fully custom: an MX element format, or None (high precision), for each GEMM operand role.

    Each role field takes any name or alias ``mxtrain.formats.parse_format`` reads
    (``"e4m3"``, ``"mxfp4"``, ``"int4"``...) and stores the canonical name. Every role
    defaults to None, so ``MXRecipe()`` quantizes no GEMM (useful with
    ``elemwise_format`` alone). Unlike microxcaling, backward roles do not copy the
    forward ones when left unset: each role is exactly what you give it.

    Attributes, with the microxcaling ``mx_specs`` key each one corresponds to:
        fprop_input: X in ``Y = X Wᵀ``. mx_specs ``a_elem_format``.
        fprop_weight: W in ``Y = X Wᵀ``. mx_specs ``w_elem_format``.
        dgrad_weight: W in ``dX = dY W``. mx_specs ``w_elem_format_bp``.
        dgrad_grad_output: dY in ``dX = dY W``. mx_specs ``a_elem_format_bp_os``.
        wgrad_input: X in ``dW = dYᵀ X``. mx_specs ``a_elem_format_bp``.
        wgrad_grad_output: dY in ``dW = dYᵀ X``. mx_specs ``a_elem_format_bp_ex``
            (microxcaling's ``linear`` backward quantizes the input with
            ``a_elem_format_bp`` and the gradient with ``a_elem_format_bp_ex`` for the
            weight gradient, and the gradient with ``a_elem_format_bp_os`` for dgrad).

    The shared options (block_size, scale_mode, rounding, grad_rounding,
    elemwise_format, elemwise_subnormals, quantize_backward, seed) are described on
    :class:`Recipe`; their microxcaling keys are ``block_size``, (none: microxcaling
    always floors), ``round``, (none), ``bfloat`` / ``fp``, ``bfloat_subnorms``,
    ``quantize_backprop``, (none).
    """

    fprop_input: str | None = _recipe_field(None, _check_mx_format_or_none, _text_as_str_or_none)
    fprop_weight: str | None = _recipe_field(None, _check_mx_format_or_none, _text_as_str_or_none)
    dgrad_weight: str | None = _recipe_field(None, _check_mx_format_or_none, _text_as_str_or_none)
    dgrad_grad_output: str | None = _recipe_field(None, _check_mx_format_or_none, _text_as_str_or_none)
    wgrad_input: str | None = _recipe_field(None, _check_mx_format_or_none, _text_as_str_or_none)
    wgrad_grad_output: str | None = _recipe_field(None, _check_mx_format_or_none, _text_as_str_or_none)
    short_name: ClassVar[str] = "mx"

    @classmethod
    def uniform(cls, fmt: "str | ElemFormat | None", **options) -> "MXRecipe":
        """The same format for all six roles, e.g. ``MXRecipe.uniform("int4", block_size=16)``."""
        return cls(**dict.fromkeys(ROLE_NAMES, fmt), **options)

    def _role_formats(self) -> Mapping[str, str | None]:
        return {name: getattr(self, name) for name in ROLE_NAMES}


RECIPE_CLASSES: Mapping[str, type[Recipe]] = MappingProxyType({
    cls.__name__: cls for cls in (MXFP8Recipe, MXFP6Recipe, MXFP4Recipe, MXINT8Recipe, MXRecipe)
})


def recipe_from_dict(d: Mapping[str, Any]) -> Recipe:
    """Rebuild any recipe from ``recipe.to_dict()`` output, choosing the class by its ``"recipe"`` tag."""
    if not isinstance(d, Mapping):
        raise TypeError(f"recipe_from_dict expects a mapping, got {_describe(d)}")
    if RECIPE_TAG_KEY not in d:
        raise ValueError(f"recipe dict has no {RECIPE_TAG_KEY!r} key naming its class; "
                         f"expected one of {_choices(RECIPE_CLASSES)}")
    tag = d[RECIPE_TAG_KEY]
    cls = RECIPE_CLASSES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ValueError(f"unknown recipe type {RECIPE_TAG_KEY}={tag!r}; valid: {_choices(RECIPE_CLASSES)}")
    return cls.from_dict(d)
