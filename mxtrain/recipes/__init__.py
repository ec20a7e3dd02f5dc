"""Recipes: a base :class:`Recipe` with what every recipe shares (elementwise precision, backward on/off);
the MX family (:class:`MXRecipeBase`: per-GEMM-operand MX formats, block size, scale mode, rounding)
and the Hopper FP8 family (:class:`Float8Recipe`, :mod:`mxtrain.recipes.float8`).

See :mod:`mxtrain.recipes.recipe` for the interface the modules consume
(``recipe.role(name) -> RoleSpec``) and docs/recipes.md for a guide.
"""

from mxtrain.recipes import float8 as _float8
from mxtrain.recipes import parse as _parse
from mxtrain.recipes import recipe as _recipe
from mxtrain.recipes.float8 import *  # noqa: F403
from mxtrain.recipes.parse import *  # noqa: F403
from mxtrain.recipes.recipe import *  # noqa: F403

# the package exports what its modules export (each module's __all__ is the one list)
__all__ = list(dict.fromkeys(_recipe.__all__ + _float8.__all__ + _parse.__all__))
