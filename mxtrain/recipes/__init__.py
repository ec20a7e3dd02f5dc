"""Recipes: per-GEMM-operand MX formats, block size, scale mode, rounding, elementwise precision.

See :mod:`mxtrain.recipes.recipe` for the interface the modules consume
(``recipe.role(name) -> RoleSpec``) and docs/recipes.md for a guide.
"""

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
    recipe_from_dict,
)

__all__ = [
    "Recipe",
    "RoleSpec",
    "MXRecipe",
    "MXFP8Recipe",
    "MXFP6Recipe",
    "MXFP4Recipe",
    "MXINT8Recipe",
    "recipe_from_dict",
    "recipe_from_string",
    "ROLE_NAMES",
    "FORWARD_ROLES",
    "BACKWARD_ROLES",
    "GRAD_OUTPUT_ROLES",
    "SCALE_MODES",
    "ROUNDINGS",
    "RECIPE_CLASSES",
    "RECIPE_SHORT_NAMES",
    "HIGH_PRECISION_NAMES",
]
