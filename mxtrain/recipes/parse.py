"""Recipes from command-line strings: ``--recipe mxfp8:fp8_format=hybrid,block_size=16``."""

from __future__ import annotations

from mxtrain.recipes.recipe import _FROM_TEXT, RECIPE_SHORT_NAMES, Recipe

__all__ = ["RECIPE_SHORT_NAMES", "HIGH_PRECISION_NAMES", "recipe_from_string"]

# Words meaning "no MX recipe": the model runs in its own dtype, mx_autocast(enabled=False).
HIGH_PRECISION_NAMES = ("none", "off", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


def _syntax() -> str:
    # built when needed: a recipe class defined after this import adds its short name
    return ("'NAME' or 'NAME:key=value,key=value' with NAME one of "
            f"{', '.join(repr(n) for n in RECIPE_SHORT_NAMES)} or {', '.join(repr(n) for n in HIGH_PRECISION_NAMES)}")


def recipe_from_string(text: str) -> Recipe | None:
    """Parse a command-line recipe spec; None for high precision.

    ``"mxfp8"``, ``"mxfp6"``, ``"mxfp4"``, ``"mxint8"``, ``"mx"`` name the MX recipe
    classes, ``"fp8_current"``, ``"fp8_delayed"``, ``"fp8_block"`` the FP8 ones, and a
    subclass that sets its own ``short_name`` is found by it (case-insensitive, ``-`` or
    ``_``); ``"bf16"``, ``"none"``, ``"off"``, ``"fp32"``...
    give None (no MX quantization). Options follow a colon as comma-separated
    ``key=value`` pairs, with the recipe's field names as keys::

        mxfp8:fp8_format=hybrid
        mxfp4:grad_rounding=stochastic,seed=0,elemwise_format=bfloat16
        mx:fprop_input=fp8_e4m3,fprop_weight=int4,quantize_backward=false,block_size=16
        fp8_delayed:amax_history_len=16,amax_compute_algo=most_recent,margin=1

    Values are read for the field's type: ints (``16``, ``0x10``), bools
    (``true``/``false``/``yes``/``no``/``1``/``0``), ``none`` for optional fields,
    strings otherwise; then validated like any recipe.
    """
    if not isinstance(text, str):
        raise TypeError(f"recipe spec must be a str like 'mxfp8', got {type(text).__name__} {text!r}")
    name, sep, options = text.strip().partition(":")
    name = name.strip().lower().replace("-", "_")
    if name in HIGH_PRECISION_NAMES:
        if sep and options.strip():
            raise ValueError(f"recipe spec {text!r}: {name!r} means no MX recipe and takes no options")
        return None
    cls = RECIPE_SHORT_NAMES.get(name)
    if cls is None:
        raise ValueError(f"unknown recipe {name!r} in {text!r}; expected {_syntax()}")
    return cls(**_parse_options(cls, options, text))


def _parse_options(cls: type[Recipe], options: str, text: str) -> dict:
    field_by_name = {f.name: f for f in cls._ordered_fields()}
    kwargs = {}
    for item in filter(None, (part.strip() for part in options.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise ValueError(f"recipe spec {text!r}: option {item!r} is not key=value; expected {_syntax()}")
        if key not in field_by_name:
            raise ValueError(f"recipe spec {text!r}: unknown option {key!r} for {cls.__name__}; "
                             f"valid options: {', '.join(field_by_name)}")
        if key in kwargs:
            raise ValueError(f"recipe spec {text!r}: option {key!r} given twice")
        kwargs[key] = field_by_name[key].metadata[_FROM_TEXT](value)
    return kwargs
