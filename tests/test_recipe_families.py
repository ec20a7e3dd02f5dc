"""Recipe families and the class registry: the base holds only shared options, MX and FP8 recipes
have only their own, every registered class round-trips, and a subclass registers itself."""

import dataclasses
import json
import pickle

import pytest
import torch

import mxtrain
from mxtrain.recipes import (
    ALL_RECIPE_CLASSES,
    FLOAT8_RECIPE_CLASSES,
    RECIPE_CLASSES,
    RECIPE_SHORT_NAMES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8Recipe,
    Float8RoleSpec,
    MXFP4Recipe,
    MXFP8Recipe,
    MXRecipe,
    MXRecipeBase,
    Recipe,
    RoleSpec,
    recipe_from_dict,
    recipe_from_string,
)
from mxtrain.recipes import recipe as recipe_module

BUILT_IN = dict(ALL_RECIPE_CLASSES)  # as registered at import, before any test defines a subclass


def _options(cls) -> set[str]:
    return set(cls.field_names())


MX_OPTIONS = set().union(*map(_options, RECIPE_CLASSES.values()))
FP8_OPTIONS = set().union(*map(_options, FLOAT8_RECIPE_CLASSES.values()))
MX_ONLY, FP8_ONLY = MX_OPTIONS - FP8_OPTIONS, FP8_OPTIONS - MX_OPTIONS

# Values to try for each option, in order: the first the class accepts and that differs from its default is used.
CANDIDATES = {
    "fp8_format": ["hybrid", "e4m3"], "fp6_format": ["e3m2"], "block_size": [16], "scale_mode": ["floor"],
    "rounding": ["nearest"], "grad_rounding": ["stochastic", None], "seed": [7], "elemwise_format": ["bfloat16"],
    "elemwise_subnormals": [False], "quantize_backward": [False], "power_of_2_scales": [True, False],
    "amax_epsilon": [1e-6], "margin": [2], "amax_history_len": [16], "amax_compute_algo": ["most_recent"],
    **{role: ["int8"] for role in mxtrain.ROLE_NAMES},
}


@pytest.fixture
def registry():
    """Restores the class registry after a test that defines recipe classes."""
    classes, short = dict(recipe_module._CLASSES), dict(recipe_module._SHORT_NAMES)
    yield
    recipe_module._CLASSES.clear()
    recipe_module._CLASSES.update(classes)
    recipe_module._SHORT_NAMES.clear()
    recipe_module._SHORT_NAMES.update(short)


def _varied(cls) -> Recipe:
    """An instance of ``cls`` with every option off its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    changes = {}
    for name in cls.field_names():
        for value in CANDIDATES.get(name, ()):
            if value != defaults[name]:
                cls(**{name: value})
                changes[name] = value
                break
        else:
            pytest.fail(f"{cls.__name__}.{name}: add a non-default value to CANDIDATES")
    return cls(**changes)


# --- the families --------------------------------------------------------------------------


def test_families_and_registry():
    assert set(RECIPE_CLASSES) == {"MXFP8Recipe", "MXFP6Recipe", "MXFP4Recipe", "MXINT8Recipe", "MXRecipe"}
    assert set(FLOAT8_RECIPE_CLASSES) == {"Float8CurrentScaling", "DelayedScaling", "Float8BlockScaling"}
    assert set(ALL_RECIPE_CLASSES) == set(RECIPE_CLASSES) | set(FLOAT8_RECIPE_CLASSES)
    assert all(issubclass(c, MXRecipeBase) for c in RECIPE_CLASSES.values())
    assert all(issubclass(c, Float8Recipe) and not issubclass(c, MXRecipeBase) for c in FLOAT8_RECIPE_CLASSES.values())
    assert set(RECIPE_SHORT_NAMES) == {"mxfp8", "mxfp6", "mxfp4", "mxint8", "mx",
                                      "fp8_current", "fp8_delayed", "fp8_block"}
    assert _options(Recipe) == {"elemwise_format", "elemwise_subnormals", "quantize_backward"}
    assert MX_ONLY >= {"block_size", "scale_mode", "rounding", "grad_rounding", "seed"}
    assert FP8_ONLY >= {"power_of_2_scales", "amax_epsilon", "margin", "amax_history_len", "amax_compute_algo"}
    assert mxtrain.MXRecipeBase is MXRecipeBase


@pytest.mark.parametrize("cls", FLOAT8_RECIPE_CLASSES.values(), ids=lambda c: c.__name__)
def test_fp8_recipes_have_no_mx_attributes(cls):
    recipe = _varied(cls)
    assert not [name for name in MX_ONLY if hasattr(recipe, name)]
    for spec in recipe.roles().values():
        assert isinstance(spec, Float8RoleSpec) and not isinstance(spec, RoleSpec)
        assert not [name for name in ("block_size", "scale_mode", "rounding") if hasattr(spec, name)]
    assert recipe.elemwise_rounding == "even"  # an FP8 recipe rounds its elementwise precision to nearest-even


@pytest.mark.parametrize("cls", RECIPE_CLASSES.values(), ids=lambda c: c.__name__)
def test_mx_recipes_have_no_fp8_attributes(cls):
    recipe = _varied(cls)
    assert not [name for name in FP8_ONLY | {"amax_reduction_group", "scaling", "tensor_format"}
                if hasattr(recipe, name)]
    for spec in recipe.roles().values():
        assert isinstance(spec, RoleSpec)
        assert not [name for name in ("scaling", "tensor", "block", "power_of_2_scales") if hasattr(spec, name)]
    assert recipe.elemwise_rounding == recipe.rounding == "nearest"


@pytest.mark.parametrize("make, pattern", [
    (lambda: Float8CurrentScaling(seed=1), r"Float8CurrentScaling\.seed is an MX recipe option and does not apply "
                                           r"to FP8 recipes; valid options: fp8_format, .*amax_reduction_group"),
    (lambda: DelayedScaling().replace(block_size=16), r"DelayedScaling\.block_size is an MX recipe option"),
    (lambda: MXFP8Recipe(margin=1), r"MXFP8Recipe\.margin is an FP8 recipe option and does not apply to MX recipes"),
    (lambda: MXFP8Recipe(fprop_weight="int4"), r"MXFP8Recipe has no option 'fprop_weight' \(an option of MXRecipe\)"),
    (lambda: MXFP4Recipe(blocksize=16), r"MXFP4Recipe has no option 'blocksize'; valid options: block_size, "),
    (lambda: MXRecipeBase(), r"MXRecipeBase is an abstract base class; instantiate one of MXFP8Recipe, .*MXRecipe$"),
    (lambda: Recipe(), r"Recipe is an abstract base class; instantiate one of MXFP8Recipe, .*Float8BlockScaling"),
])
def test_wrong_family_options_are_named(make, pattern):
    with pytest.raises(TypeError, match=pattern):
        make()


# --- serialisation ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", BUILT_IN.values(), ids=lambda c: c.__name__)
def test_every_registered_class_round_trips(cls):
    for recipe in (cls(), _varied(cls)):
        d = recipe.to_dict()
        assert d["recipe"] == cls.__name__ and list(d)[1:] == list(cls.field_names())
        text = json.dumps(d)
        family = MXRecipeBase if issubclass(cls, MXRecipeBase) else Float8Recipe
        for rebuilt in (Recipe.from_dict(json.loads(text)), recipe_from_dict(json.loads(text)),
                        family.from_dict(json.loads(text)), cls.from_dict(json.loads(text)),
                        cls.from_dict({k: v for k, v in d.items() if k != "recipe"}),
                        pickle.loads(pickle.dumps(recipe)), eval(repr(recipe), vars(mxtrain.recipes))):
            assert type(rebuilt) is cls and rebuilt == recipe and hash(rebuilt) == hash(recipe)
        assert recipe_from_string(f"{cls.short_name}:" + ",".join(f"{k}={v}" for k, v in list(d.items())[1:])) == recipe


# What to_dict wrote before the families were split (commit db780ee): checkpoints and recipe files keep these.
SAVED_LAYOUTS = [
    ({"recipe": "MXFP8Recipe", "fp8_format": "hybrid", "block_size": 32, "scale_mode": "rceil", "rounding": "even",
      "grad_rounding": None, "elemwise_format": None, "elemwise_subnormals": True, "quantize_backward": True,
      "seed": None}, MXFP8Recipe(fp8_format="hybrid")),
    ({"recipe": "MXFP4Recipe", "block_size": 16, "scale_mode": "floor", "rounding": "even",
      "grad_rounding": "stochastic", "elemwise_format": "bfloat16", "elemwise_subnormals": True,
      "quantize_backward": True, "seed": 3}, MXFP4Recipe(block_size=16, scale_mode="floor", seed=3,
                                                      elemwise_format="bf16")),
    ({"recipe": "MXRecipe", "fprop_input": "fp8_e4m3", "fprop_weight": "int4", "dgrad_weight": None,
      "dgrad_grad_output": None, "wgrad_input": None, "wgrad_grad_output": None, "block_size": 32,
      "scale_mode": "rceil", "rounding": "even", "grad_rounding": None, "elemwise_format": None,
      "elemwise_subnormals": True, "quantize_backward": False, "seed": None},
     MXRecipe(fprop_input="e4m3", fprop_weight="int4", quantize_backward=False)),
    ({"recipe": "DelayedScaling", "fp8_format": "hybrid", "power_of_2_scales": False, "margin": 0,
      "amax_history_len": 4, "amax_compute_algo": "max", "elemwise_format": None, "elemwise_subnormals": True,
      "quantize_backward": True}, DelayedScaling(amax_history_len=4)),
    ({"recipe": "Float8BlockScaling", "fp8_format": "e4m3", "power_of_2_scales": True, "amax_epsilon": 0.0,
      "elemwise_format": None, "elemwise_subnormals": True, "quantize_backward": True}, Float8BlockScaling()),
    ({"recipe": "Float8CurrentScaling", "fp8_format": "hybrid", "power_of_2_scales": False, "amax_epsilon": 0.0,
      "elemwise_format": None, "elemwise_subnormals": True, "quantize_backward": True}, Float8CurrentScaling()),
]


@pytest.mark.parametrize("saved, recipe", SAVED_LAYOUTS, ids=lambda v: v["recipe"] if isinstance(v, dict) else "")
def test_saved_layouts_still_load(saved, recipe):
    """A checkpoint's meta.json compares the saved dict with ``recipe.to_dict()``: same keys, same order."""
    assert list(recipe.to_dict().items()) == list(saved.items())
    assert Recipe.from_dict(saved) == recipe


def test_from_dict_errors_name_the_known_classes():
    known = r"'MXFP8Recipe', 'MXFP6Recipe', 'MXFP4Recipe', 'MXINT8Recipe', 'MXRecipe', 'Float8CurrentScaling', " \
            r"'DelayedScaling', 'Float8BlockScaling'"
    with pytest.raises(ValueError, match=rf"unknown recipe type recipe='MXFP9Recipe'; valid: {known}$"):
        Recipe.from_dict({"recipe": "MXFP9Recipe"})
    with pytest.raises(ValueError, match=rf"unknown recipe type recipe=3; valid: {known}$"):
        recipe_from_dict({"recipe": 3})
    with pytest.raises(ValueError, match=rf"no 'recipe' key naming its class; expected one of {known}$"):
        Recipe.from_dict({"block_size": 32})
    with pytest.raises(ValueError, match=r"MXRecipeBase\.from_dict got a dict tagged recipe='DelayedScaling', which "
                                         r"is not a subclass of MXRecipeBase"):
        MXRecipeBase.from_dict(DelayedScaling().to_dict())
    with pytest.raises(TypeError, match=r"Recipe\.from_dict expects a mapping, got str"):
        Recipe.from_dict("mxfp8")


# --- subclasses register themselves -------------------------------------------------------


def test_subclass_registers_itself(registry):
    @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
    class CoarseMXFP8(MXFP8Recipe):
        short_name = "coarse_mxfp8"

        def __post_init__(self):
            super().__post_init__()
            if self.block_size < 64:
                raise ValueError(f"CoarseMXFP8.block_size must be >= 64, got {self.block_size}")

    recipe = CoarseMXFP8(block_size=128, fp8_format="hybrid")
    assert ALL_RECIPE_CLASSES["CoarseMXFP8"] is CoarseMXFP8 and RECIPE_CLASSES["CoarseMXFP8"] is CoarseMXFP8
    assert "CoarseMXFP8" not in FLOAT8_RECIPE_CLASSES
    assert Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    assert MXFP8Recipe.from_dict(recipe.to_dict()) == recipe  # the tag may name a subclass
    assert recipe_from_string("coarse-mxfp8:block_size=128,fp8_format=hybrid") == recipe
    with pytest.raises(ValueError, match="must be >= 64"):
        Recipe.from_dict({**recipe.to_dict(), "block_size": 32})
    with pytest.raises(ValueError, match=r"CoarseMXFP8\.from_dict got a dict tagged recipe='MXFP8Recipe'"):
        CoarseMXFP8.from_dict(MXFP8Recipe().to_dict())


def test_family_bases_and_name_clashes(registry):
    @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
    class TunedFloat8Base(Float8CurrentScaling, abstract=True):
        pass

    @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
    class TunedFloat8(TunedFloat8Base):
        pass

    assert "TunedFloat8Base" not in ALL_RECIPE_CLASSES and FLOAT8_RECIPE_CLASSES["TunedFloat8"] is TunedFloat8
    assert TunedFloat8.short_name == "fp8_current" and RECIPE_SHORT_NAMES["fp8_current"] is Float8CurrentScaling
    with pytest.raises(TypeError, match=r"TunedFloat8Base is an abstract base class; instantiate one of TunedFloat8$"):
        TunedFloat8Base()
    # a second class of a taken name or short name works but is not registered under it (a warning says so)
    with pytest.warns(UserWarning, match=r"recipe class name 'MXFP8Recipe' of .* is already taken by "
                                         r"mxtrain\.recipes\.recipe\.MXFP8Recipe"):
        Shadow = type("MXFP8Recipe", (MXFP4Recipe,), {})
    assert ALL_RECIPE_CLASSES["MXFP8Recipe"] is MXFP8Recipe and Shadow().block_size == 32
    with pytest.warns(UserWarning, match=r"recipe short name 'mxfp4' of .* is already taken"):
        type("OtherFP4", (MXFP4Recipe,), {"short_name": "mxfp4"})
    assert RECIPE_SHORT_NAMES["mxfp4"] is MXFP4Recipe


# --- consumers ask the family ---------------------------------------------------------------


def test_consumers_ask_the_family():
    from mxtrain.compat.mx import specs_from_recipe
    from mxtrain.modules._common import recipe_generator, round_elemwise
    from mxtrain.modules.conv import fake_quantize_role, unsupported_recipe

    fp8 = Float8CurrentScaling(elemwise_format="bfloat12")
    assert recipe_generator(fp8, torch.device("cpu")) is None
    assert recipe_generator(MXFP4Recipe(seed=5), torch.device("cpu")) is not None
    x = torch.tensor([1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4])  # ties at bfloat12 (3 mantissa bits)
    assert round_elemwise(x, fp8).tolist() == [1.0, 1.25]  # nearest-even
    assert round_elemwise(x, MXFP8Recipe(elemwise_format="bfloat12", rounding="nearest")).tolist() == [1.125, 1.25]
    assert "MX convolutions take MX recipes" in unsupported_recipe(fp8) and unsupported_recipe(MXFP8Recipe()) is None
    with pytest.raises(NotImplementedError, match="MX convolutions take MX role specs, got Float8RoleSpec"):
        fake_quantize_role(torch.ones(2, 32), fp8.role("fprop_input"), 1, None)
    with pytest.raises(TypeError, match="specs_from_recipe takes MX recipes.*FP8 recipe Float8CurrentScaling"):
        specs_from_recipe(fp8)
