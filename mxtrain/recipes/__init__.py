"""Recipes: per-GEMM-operand MX formats, block size, scale mode, rounding, elementwise precision;
and the Hopper FP8 recipes (:mod:`mxtrain.recipes.float8`).

See :mod:`mxtrain.recipes.recipe` for the interface the modules consume
(``recipe.role(name) -> RoleSpec``) and docs/recipes.md for a guide.
"""

from mxtrain.recipes import recipe as _recipe_module
from mxtrain.recipes.float8 import (
    ALL_RECIPE_CLASSES,
    FLOAT8_RECIPE_CLASSES,
    BoundFloat8Recipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8Recipe,
    Float8RoleSpec,
    recipe_from_dict,
)
from mxtrain.recipes.parse import HIGH_PRECISION_NAMES, RECIPE_SHORT_NAMES, recipe_from_string
from mxtrain.recipes.recipe import (
    BACKWARD_ROLES,
    FORWARD_ROLES,
    GRAD_OUTPUT_ROLES,
    RECIPE_CLASSES,
    ROLE_NAMES,
    ROUNDINGS,
    SCALE_MODES,
    MXFP4Recipe,
    MXFP6Recipe,
    MXFP8Recipe,
    MXINT8Recipe,
    MXRecipe,
    Recipe,
    RoleSpec,
)

# Recipe.from_dict(d) dispatches through recipe.py's module-level recipe_from_dict, which knows
# the MX classes only; point it at the one that also knows the FP8 classes.
_recipe_module.recipe_from_dict = recipe_from_dict

__all__ = [
    "Recipe",
    "RoleSpec",
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
