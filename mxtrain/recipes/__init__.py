"""Recipes: a base :class:`Recipe` with what every recipe shares (elementwise precision, backward on/off);
the MX family (:class:`MXRecipeBase`: per-GEMM-operand MX formats, block size, scale mode, rounding)
and the Hopper FP8 family (:class:`Float8Recipe`, :mod:`mxtrain.recipes.float8`).

See :mod:`mxtrain.recipes.recipe` for the interface the modules consume
(``recipe.role(name) -> RoleSpec``) and docs/recipes.md for a guide.
"""

from mxtrain.recipes.float8 import (
    FLOAT8_RECIPE_CLASSES,
    BoundFloat8Recipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8Recipe,
    Float8RoleSpec,
)
from mxtrain.recipes.parse import HIGH_PRECISION_NAMES, recipe_from_string
from mxtrain.recipes.recipe import (
    ALL_RECIPE_CLASSES,
    BACKWARD_ROLES,
    FORWARD_ROLES,
    GRAD_OUTPUT_ROLES,
    RECIPE_CLASSES,
    RECIPE_SHORT_NAMES,
    ROLE_NAMES,
    ROUNDINGS,
    SCALE_MODES,
    MXFP4Recipe,
    MXFP6Recipe,
    MXFP8Recipe,
    MXINT8Recipe,
    MXRecipe,
    MXRecipeBase,
    Recipe,
    RoleSpec,
    recipe_from_dict,
)

__all__ = [
    "Recipe",
    "RoleSpec",
    "MXRecipeBase",
    "MXRecipe",
    "MXFP8Recipe",
    "MXFP6Recipe",
    "MXFP4Recipe",
    "MXINT8Recipe",
    "Float8Recipe",
    "Float8CurrentScaling",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8RoleSpec",
    "BoundFloat8Recipe",
    "recipe_from_dict",
    "recipe_from_string",
    "ROLE_NAMES",
    "FORWARD_ROLES",
    "BACKWARD_ROLES",
    "GRAD_OUTPUT_ROLES",
    "SCALE_MODES",
    "ROUNDINGS",
    "RECIPE_CLASSES",
    "FLOAT8_RECIPE_CLASSES",
    "ALL_RECIPE_CLASSES",
    "RECIPE_SHORT_NAMES",
    "HIGH_PRECISION_NAMES",
]
