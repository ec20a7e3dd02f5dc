"""Conversions between mxtrain recipes and microxcaling ``mx_specs``.

Role mapping (as microxcaling's ``linear`` uses the keys)::

    fprop_input        a_elem_format         fprop_weight    w_elem_format
    dgrad_weight       w_elem_format_bp      dgrad_grad_output a_elem_format_bp_os
    wgrad_input        a_elem_format_bp      wgrad_grad_output a_elem_format_bp_ex

``block_size`` <-> ``block_size``; ``rounding`` <-> ``round`` (and the ``round_*`` keys
it propagates to; ``"stochastic"`` <-> ``"dither"``); ``grad_rounding`` <-> the MX
rounding of the gradient operands (``round_mx_grad_output_grad_input`` and
``round_mx_grad_output_grad_weight``); ``elemwise_format`` <-> ``bfloat`` / ``fp``;
``elemwise_subnormals`` <-> ``bfloat_subnorms``; ``quantize_backward`` <->
``quantize_backprop``. microxcaling has one shared-exponent rule, so a recipe
must use ``scale_mode="floor"``; ``scale_bits`` must be 8 (or 0);
``shared_exp_method`` "max" and no ``mx_flush_fp32_subnorms``. The elementwise
algorithm flags (``softmax_exp2``, ``vec_use_exp2``, ``vec_use_recip``,
``custom_cuda``) have no recipe field and are not carried over.
"""

from __future__ import annotations

from mxtrain.compat.mx.elemwise_ops import elemwise_format_of
from mxtrain.compat.mx.specs import DEFAULTS, MxSpecs, finalize_mx_specs
from mxtrain.formats import MX_FORMAT_NAMES, parse_elemwise_format
from mxtrain.recipes import MXRecipe, MXRecipeBase, Recipe

__all__ = ["specs_from_recipe", "recipe_from_specs", "ROLE_TO_SPEC_KEY"]

ROLE_TO_SPEC_KEY = {
    "fprop_input": "a_elem_format",
    "fprop_weight": "w_elem_format",
    "dgrad_weight": "w_elem_format_bp",
    "dgrad_grad_output": "a_elem_format_bp_os",
    "wgrad_input": "a_elem_format_bp",
    "wgrad_grad_output": "a_elem_format_bp_ex",
}
_TO_MX_ROUND = {"even": "even", "nearest": "nearest", "floor": "floor", "stochastic": "dither"}
_FROM_MX_ROUND = {v: k for k, v in _TO_MX_ROUND.items()}
_GRAD_MX_ROUND_KEYS = ("round_mx_grad_output_grad_input", "round_mx_grad_output_grad_weight")
_OTHER_ROUND_KEYS = tuple(k for k in DEFAULTS if k.startswith("round_") and k not in _GRAD_MX_ROUND_KEYS
                          and k != "round_m")


def specs_from_recipe(recipe: Recipe) -> MxSpecs:
    """The :class:`MxSpecs` that computes what ``recipe`` asks for (finalized; see the module docstring)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"specs_from_recipe expects a recipe (MXFP8Recipe(), MXRecipe(...)...), "
                        f"got {type(recipe).__name__}")
    if not isinstance(recipe, MXRecipeBase):
        raise TypeError(f"specs_from_recipe takes MX recipes (MXFP8Recipe, MXRecipe...); microxcaling has no "
                        f"equivalent of the {recipe.family or type(recipe).__name__} recipe {type(recipe).__name__}")
    if recipe.scale_mode != "floor":
        raise ValueError(f"microxcaling computes the shared exponent with the floor rule only; this recipe has "
                         f"scale_mode={recipe.scale_mode!r}. Use recipe.replace(scale_mode='floor')")
    specs = MxSpecs()
    # the role view reports None for backward roles when quantize_backward is off: read them with it on
    roles = recipe.replace(quantize_backward=True).roles()
    for role, key in ROLE_TO_SPEC_KEY.items():
        specs[key] = roles[role].fmt
    specs["scale_bits"] = 8
    specs["block_size"] = recipe.block_size
    rnd = _TO_MX_ROUND[recipe.rounding]
    for k in ("round", "round_m") + _OTHER_ROUND_KEYS:
        specs[k] = rnd
    grad = _TO_MX_ROUND[recipe.grad_rounding or recipe.rounding]
    for k in _GRAD_MX_ROUND_KEYS:
        specs[k] = grad
    if recipe.elemwise_format is not None:
        fmt = parse_elemwise_format(recipe.elemwise_format)
        specs["bfloat" if fmt.ebits == 8 else "fp"] = fmt.bits
    specs["bfloat_subnorms"] = recipe.elemwise_subnormals
    specs["quantize_backprop"] = recipe.quantize_backward
    return specs


def recipe_from_specs(specs) -> MXRecipe:
    """The :class:`~mxtrain.recipes.MXRecipe` equivalent to ``specs`` (finalized first, on a copy)."""
    full = finalize_mx_specs(dict(specs), early_exit=False)
    problems = []
    if full["scale_bits"] not in (0, 8):
        problems.append(f"scale_bits={full['scale_bits']} (recipes use 8-bit E8M0 scales)")
    if full["shared_exp_method"] != "max":
        problems.append(f"shared_exp_method={full['shared_exp_method']!r} (recipes share one exponent per block)")
    if full["mx_flush_fp32_subnorms"]:
        problems.append("mx_flush_fp32_subnorms=True (no recipe field)")
    roles = {}
    for role, key in ROLE_TO_SPEC_KEY.items():
        value = full[key]
        name = value.name if hasattr(value, "name") else value
        if name is not None and str(name).lower() == "fp4":
            name = "fp4_e2m1"
        if name is not None and str(name).lower() not in MX_FORMAT_NAMES:
            problems.append(f"{key}={value!r} (recipes take {', '.join(MX_FORMAT_NAMES)} or None)")
        roles[role] = name
    rounds = {}
    for k in ("round",) + _OTHER_ROUND_KEYS + _GRAD_MX_ROUND_KEYS:
        if full[k] not in _FROM_MX_ROUND:
            problems.append(f"{k}={full[k]!r} (one of {', '.join(_FROM_MX_ROUND)})")
        rounds[k] = full[k]
    if problems:
        raise ValueError("these mx_specs have no recipe equivalent: " + "; ".join(problems))
    differing = [k for k in _OTHER_ROUND_KEYS if rounds[k] != rounds["round"]]
    if differing:
        raise ValueError(f"recipes have one rounding for values and activations; these keys differ from "
                         f"round={rounds['round']!r}: {', '.join(f'{k}={rounds[k]!r}' for k in differing)}")
    grad = {rounds[k] for k in _GRAD_MX_ROUND_KEYS}
    if len(grad) > 1:
        raise ValueError(f"recipes have one gradient rounding; got {', '.join(f'{k}={rounds[k]!r}' for k in _GRAD_MX_ROUND_KEYS)}")
    grad_rounding = _FROM_MX_ROUND[grad.pop()]
    rounding = _FROM_MX_ROUND[rounds["round"]]
    fmt = elemwise_format_of(full)
    return MXRecipe(**roles, block_size=full["block_size"], scale_mode="floor", rounding=rounding,
                    grad_rounding=None if grad_rounding == rounding else grad_rounding,
                    elemwise_format=None if fmt is None else fmt.name,
                    elemwise_subnormals=bool(full["bfloat_subnorms"]),
                    quantize_backward=bool(full["quantize_backprop"]))
