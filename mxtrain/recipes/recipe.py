"""Recipes: which MX format, block size, scale mode and rounding each GEMM operand gets.

A recipe is a frozen, validated dataclass. The modules never read its fields
directly: they ask for the *role view*, ``recipe.role(name) -> RoleSpec``, for
each of the six GEMM operand roles of a linear layer ``Y = X Wᵀ``::

    fprop  Y  = X Wᵀ    fprop_input (X),       fprop_weight (W)
    dgrad  dX = dY W    dgrad_grad_output (dY), dgrad_weight (W)
    wgrad  dW = dYᵀ X   wgrad_grad_output (dY), wgrad_input (X)

plus the options every recipe shares (:class:`Recipe`: ``elemwise_format``,
``elemwise_subnormals``, ``quantize_backward``). The MX recipes derive from
:class:`MXRecipeBase`, which adds what only they have (``block_size``, ``scale_mode``,
``rounding``, ``grad_rounding``, ``seed``): the shorthand ones (:class:`MXFP8Recipe`,
:class:`MXFP6Recipe`, :class:`MXFP4Recipe`, :class:`MXINT8Recipe`) and the fully custom
:class:`MXRecipe`. The FP8 family lives in :mod:`mxtrain.recipes.float8`. Code that needs a
family's own options asks for the family (``isinstance(recipe, MXRecipeBase)``).

Every concrete recipe class registers itself when it is defined, so
:meth:`Recipe.from_dict` rebuilds any of them, a user's subclass included.

This module is pure data: it imports no torch, so a recipe can be built, printed
and serialised anywhere (a launcher, a sweep driver, a config file).
"""

from __future__ import annotations

import warnings

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
    "MXRecipeBase",
    "MXRecipe",
    "MXFP8Recipe",
    "MXFP6Recipe",
    "MXFP4Recipe",
    "MXINT8Recipe",
    "RECIPE_CLASSES",
    "ALL_RECIPE_CLASSES",
    "RECIPE_SHORT_NAMES",
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


# --- Recipe base and the class registry -------------------------------------------

# Every recipe class is declared with this: kw_only because positional recipe
# arguments would be unreadable at call sites; repr=False keeps Recipe.__repr__.
_recipe_dataclass = dataclass(frozen=True, kw_only=True, repr=False)

# Every concrete recipe class, by the name its to_dict "recipe" tag carries, and by its short name
# (recipe_from_string). Filled by Recipe.__init_subclass__, so a class is known once it is defined.
_CLASSES: dict[str, type["Recipe"]] = {}
_SHORT_NAMES: dict[str, type["Recipe"]] = {}


def _register(cls: type["Recipe"]) -> None:
    # A class defined again under the same module and qualified name (a module reload) replaces itself.
    entries = [(table, key, what) for table, key, what in ((_CLASSES, cls.__name__, "class name"),
                                                          (_SHORT_NAMES, cls.__dict__.get("short_name"), "short name"))
               if key]
    for table, key, what in entries:
        old = table.get(key)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            # a user subclass of the same name (to change defaults), or local classes of one name in two
            # places: the first keeps the name, so dicts and strings naming it keep meaning what they meant
            warnings.warn(f"recipe {what} {key!r} of {cls.__module__}.{cls.__qualname__} is already taken by "
                          f"{old.__module__}.{old.__qualname__}: recipe dicts and recipe strings naming {key!r} "
                          f"build that class; give this one another name to have it built from them", stacklevel=4)
            continue
        table[key] = cls


class _RecipeClasses(Mapping):
    """A live, read-only ``{class name: class}`` view of the registered recipe classes deriving from ``base``."""

    def __init__(self, base: type["Recipe"]) -> None:
        self._base = base

    def _classes(self) -> dict[str, type["Recipe"]]:
        return {name: cls for name, cls in _CLASSES.items() if issubclass(cls, self._base)}

    def __getitem__(self, name: str) -> type["Recipe"]:
        return self._classes()[name]

    def __iter__(self):
        return iter(self._classes())

    def __len__(self) -> int:
        return len(self._classes())

    def __repr__(self) -> str:
        return f"_RecipeClasses({self._base.__name__}: {', '.join(self._classes())})"


def _option_names(cls) -> set[str]:
    return {f.name for f in fields(cls) if f.init}


def _unknown_option_message(cls, name: str) -> str:
    owner = cls.__name__
    options = cls.field_names()
    valid = f"valid options: {', '.join(options + tuple(sorted(_option_names(cls) - set(options))))}"
    holders = [c for c in _CLASSES.values() if name in _option_names(c)]
    families = {c.family for c in holders}
    if len(families) == 1 and cls.family not in families:
        (family,) = families
        return f"{owner}.{name} is an {family} recipe option and does not apply to {cls.family} recipes; {valid}"
    if holders:
        return (f"{owner} has no option {name!r} (an option of {', '.join(c.__name__ for c in holders)}); {valid}")
    return f"{owner} has no option {name!r}; {valid}"


@_recipe_dataclass
class Recipe:
    """Base of every recipe: what all recipes share, the role view, serialisation and the class registry.

    Not instantiable itself. Two families derive from it: the MX recipes (:class:`MXRecipeBase`:
    :class:`MXFP8Recipe`, :class:`MXFP6Recipe`, :class:`MXFP4Recipe`, :class:`MXINT8Recipe`,
    :class:`MXRecipe`) and the FP8 recipes (:class:`~mxtrain.recipes.Float8Recipe`). Every concrete
    subclass registers itself when defined, under its class name (the ``"recipe"`` tag of
    :meth:`to_dict`, read back by :meth:`from_dict`) and its ``short_name`` (:func:`recipe_from_string`).
    A base that should not register is declared ``class Base(Recipe, abstract=True)``.

    Attributes (shared by every recipe):
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
    """

    elemwise_format: str | None = _recipe_field(None, _check_elemwise_format, _text_as_str_or_none)
    elemwise_subnormals: bool = _recipe_field(True, _check_bool, _text_as_bool)
    quantize_backward: bool = _recipe_field(True, _check_bool, _text_as_bool)

    # Short name used by recipe_from_string ("mxfp8", "mx", ...); registered only where a class sets its own.
    short_name: ClassVar[str] = ""
    # The family a class belongs to ("MX", "FP8"), named in error messages.
    family: ClassVar[str] = ""
    _abstract: ClassVar[bool] = True
    # Options listed last, in this order, by to_dict / repr / field_names (a class's own options come first).
    _trailing_fields: ClassVar[tuple[str, ...]] = ("elemwise_format", "elemwise_subnormals", "quantize_backward")

    def __init_subclass__(cls, *, abstract: bool = False, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._abstract = abstract
        if not abstract:
            _register(cls)

    def __new__(cls, /, *args, **kwargs):
        # Checked before the dataclass __init__, whose own error would neither list the valid options
        # nor say that an option belongs to the other family.
        if cls.__dict__.get("_abstract", False):
            raise TypeError(f"{cls.__name__} is an abstract base class; instantiate one of "
                            f"{', '.join(_RecipeClasses(cls))}")
        valid = _option_names(cls)
        for name in kwargs:
            if name not in valid:
                raise TypeError(_unknown_option_message(cls, name))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _run_field_checks(self)
        # built now, not on first use: a first use inside torch.compile would trace cached_property's
        # RLock (Python 3.11), which dynamo cannot enter (a graph break under fullgraph=True)
        self._role_specs

    # -- the interface the modules consume --

    def _make_role_specs(self) -> dict[str, Any]:
        """The role view of each of the six ``ROLE_NAMES``, computed once (see :meth:`role`)."""
        raise NotImplementedError

    @functools.cached_property
    def _role_specs(self) -> dict[str, Any]:
        # Computed once per recipe: modules call role() on every forward/backward.
        # (cached_property writes the instance __dict__ directly, so it works on a
        # frozen dataclass and is not a field: equality and hashing ignore it.)
        return self._make_role_specs()  # a plain dict, so the cache pickles with the recipe

    def role(self, name: str):
        """The quantization of one GEMM operand role (one of ``ROLE_NAMES``): a :class:`RoleSpec` for
        an MX recipe, a ``Float8RoleSpec`` for an FP8 one."""
        try:
            return self._role_specs[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown GEMM operand role {name!r}; valid roles: {_choices(ROLE_NAMES)}") from None

    def roles(self) -> Mapping[str, Any]:
        """All six role views, in ``ROLE_NAMES`` order (read-only mapping)."""
        return MappingProxyType(self._role_specs)

    @property
    def elemwise_rounding(self) -> str:
        """How results rounded to ``elemwise_format`` are rounded: ``"even"`` unless the family says otherwise."""
        return "even"

    # -- construction helpers --

    def replace(self, **changes) -> "Recipe":
        """A copy with some fields changed (validated like a fresh recipe)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def _ordered_fields(cls) -> list[dataclasses.Field]:
        # The recipe options (fields with a check; not run-time objects such as a process group):
        # the class's own (fp8_format, the role formats...) read best first.
        options = {f.name: f for f in fields(cls) if _CHECK in f.metadata}
        last = [options[name] for name in cls._trailing_fields if name in options]
        return [f for f in options.values() if f.name not in cls._trailing_fields] + last

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
        """Every option plus ``"recipe": <class name>``; values are str, int, float, bool or None (JSON-safe)."""
        d: dict[str, Any] = {RECIPE_TAG_KEY: type(self).__name__}
        d.update((f.name, getattr(self, f.name)) for f in self._ordered_fields())
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        """Rebuild a recipe from :meth:`to_dict` output; missing fields take their defaults.

        The ``"recipe"`` tag picks the class: any registered class on ``Recipe`` (and on a family
        base, any of that family); on a concrete class the tag is optional but must name it or a
        subclass. An unknown tag or key raises ``ValueError`` naming the valid ones.
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {_describe(d)}")
        kwargs = dict(d)
        target = cls
        if RECIPE_TAG_KEY in kwargs:
            tag = kwargs.pop(RECIPE_TAG_KEY)
            target = _CLASSES.get(tag) if isinstance(tag, str) else None
            if target is None:
                raise ValueError(f"unknown recipe type {RECIPE_TAG_KEY}={tag!r}; valid: {_choices(_CLASSES)}")
            if not issubclass(target, cls):
                raise ValueError(f"{cls.__name__}.from_dict got a dict tagged {RECIPE_TAG_KEY}={tag!r}, which is not "
                                 f"a subclass of {cls.__name__}; use Recipe.from_dict to rebuild any recipe class "
                                 f"from its tag")
        elif cls.__dict__.get("_abstract", False):
            raise ValueError(f"recipe dict has no {RECIPE_TAG_KEY!r} key naming its class; "
                             f"expected one of {_choices(_RecipeClasses(cls))}")
        valid = target.field_names()
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            raise ValueError(f"unknown key(s) for {target.__name__}: {_choices(unknown)}; "
                             f"valid keys: {_choices((RECIPE_TAG_KEY,) + valid)}")
        return target(**kwargs)


def recipe_from_dict(d: Mapping[str, Any]) -> Recipe:
    """Rebuild any recipe, MX or FP8, from ``recipe.to_dict()`` output: ``Recipe.from_dict(d)``."""
    return Recipe.from_dict(d)


# --- the MX family ----------------------------------------------------------------


@_recipe_dataclass
class MXRecipeBase(Recipe, abstract=True):
    """Base of the MX recipes (not instantiable): E8M0 block scales, and the options they share.

    Attributes (shared by every MX recipe, besides those of :class:`Recipe`):
        block_size: elements per shared scale (int >= 0, default 32; 0 = one scale for
            the whole reduction axis). microxcaling: ``block_size``.
        scale_mode: ``"rceil"`` (default; Transformer Engine / cuBLAS, never saturates),
            ``"floor"`` (OCP MX v1.0 and microxcaling) or ``"even"``.
        rounding: element rounding for every role, and for ``elemwise_format``: ``"even"``
            (default, ties to even), ``"nearest"`` (ties away from zero; microxcaling's
            ``round`` default), ``"floor"`` (toward zero) or ``"stochastic"``.
        grad_rounding: rounding for the two grad-output roles (``dgrad_grad_output``,
            ``wgrad_grad_output``), e.g. ``"stochastic"`` to round gradients
            stochastically while the forward stays deterministic. None (default; ``"stochastic"``
            in :class:`MXFP4Recipe`) = ``rounding``.
        seed: int in [0, 2**64 - 1] seeding stochastic rounding, so runs are
            reproducible; None uses torch's global RNG.
    """

    block_size: int = _recipe_field(32, _check_block_size, _text_as_int)
    scale_mode: str = _recipe_field("rceil", _check_scale_mode)
    rounding: str = _recipe_field("even", _check_rounding)
    grad_rounding: str | None = _recipe_field(None, _check_rounding_or_none, _text_as_str_or_none)
    seed: int | None = _recipe_field(None, _check_seed, _text_as_int_or_none)

    family: ClassVar[str] = "MX"
    _trailing_fields: ClassVar[tuple[str, ...]] = (
        "block_size", "scale_mode", "rounding", "grad_rounding", "elemwise_format", "elemwise_subnormals",
        "quantize_backward", "seed")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_block_packs(type(self).__name__, self.block_size, self._role_formats().values())

    def _role_formats(self) -> Mapping[str, str | None]:
        """The MX element format of each role before ``quantize_backward`` is applied."""
        raise NotImplementedError

    def _make_role_specs(self) -> dict[str, RoleSpec]:
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
        return specs

    @property
    def elemwise_rounding(self) -> str:
        """``rounding``: elementwise results are rounded as the GEMM operands are."""
        return self.rounding


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
class MXFP8Recipe(MXRecipeBase):
    """MXFP8 training: FP8 elements, 32-element blocks, E8M0 scales (Transformer Engine's MXFP8BlockScaling).

    Attributes:
        fp8_format: ``"e4m3"`` (default) for every role; ``"hybrid"``: e4m3 for inputs and
            weights, e5m2 (more range) for the two grad-output roles, like Transformer
            Engine's ``Format.HYBRID``; ``"e5m2"`` for every role. Any spelling of the
            two FP8 formats is accepted (``"E4M3"``, ``"fp8_e5m2"``) and stored short.

    The shared options (``block_size=32``, ``scale_mode="rceil"``, ``rounding="even"``,
    ``grad_rounding``, ``elemwise_format``, ``elemwise_subnormals``,
    ``quantize_backward``, ``seed``) are described on :class:`MXRecipeBase` and :class:`Recipe`.
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
class MXFP6Recipe(MXRecipeBase):
    """MXFP6: FP6 elements for every role.

    Attributes:
        fp6_format: ``"e2m3"`` (default: more mantissa, max 7.5) or ``"e3m2"`` (more
            range, max 28). Any spelling (``"fp6_e3m2"``, ``"E3M2"``) is accepted and stored short.

    Shared options: see :class:`MXRecipeBase` and :class:`Recipe`.
    """

    fp6_format: str = _recipe_field("e2m3", _check_fp6_format)
    short_name: ClassVar[str] = "mxfp6"

    def _role_formats(self) -> Mapping[str, str | None]:
        return _same_format_for_every_role(f"fp6_{self.fp6_format}")


@_recipe_dataclass
class MXFP4Recipe(MXRecipeBase):
    """MXFP4: fp4_e2m1 elements for every role, gradients rounded stochastically by default.

    With 8 magnitudes per block, rounding a gradient to nearest is biased and small
    components vanish; ``grad_rounding="stochastic"`` (the default here, as in Transformer
    Engine's NVFP4 recipe) keeps the two grad-output roles unbiased while the forward
    stays round-to-nearest-even. ``grad_rounding=None`` gives the deterministic recipe.
    Seed policy: ``seed=None`` (default) draws from torch's global RNG, so
    ``torch.manual_seed`` makes a run reproducible; an int gives the recipe its own
    stream and leaves the global RNG (dropout, data order) untouched.
    See docs/fp4.md for the layers :func:`mxtrain.convert` keeps in high precision.
    Shared options: see :class:`MXRecipeBase` and :class:`Recipe`.
    """

    grad_rounding: str | None = _recipe_field("stochastic", _check_rounding_or_none, _text_as_str_or_none)
    short_name: ClassVar[str] = "mxfp4"

    def _role_formats(self) -> Mapping[str, str | None]:
        return _same_format_for_every_role("fp4_e2m1")


@_recipe_dataclass
class MXINT8Recipe(MXRecipeBase):
    """MXINT8: int8 elements (sign-magnitude fixed point, k/64) for every role.

    Shared options: see :class:`MXRecipeBase` and :class:`Recipe`.
    """

    short_name: ClassVar[str] = "mxint8"

    def _role_formats(self) -> Mapping[str, str | None]:
        return _same_format_for_every_role("int8")


@_recipe_dataclass
class MXRecipe(MXRecipeBase):
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
    :class:`MXRecipeBase` and :class:`Recipe`; their microxcaling keys are ``block_size``, (none: microxcaling
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


# Live read-only views of the registry: a subclass defined later appears in them.
RECIPE_CLASSES: Mapping[str, type[Recipe]] = _RecipeClasses(MXRecipeBase)  # the MX recipe classes
ALL_RECIPE_CLASSES: Mapping[str, type[Recipe]] = _RecipeClasses(Recipe)  # every recipe class, MX and FP8
RECIPE_SHORT_NAMES: Mapping[str, type[Recipe]] = MappingProxyType(_SHORT_NAMES)  # recipe_from_string's names
