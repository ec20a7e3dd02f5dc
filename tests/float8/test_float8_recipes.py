"""FP8 recipes: defaults, role views, validation errors, dict/JSON/string round trips."""

import json
import pickle

import pytest

import mxtrain
from mxtrain.recipes import (
    ALL_RECIPE_CLASSES, FLOAT8_RECIPE_CLASSES, RECIPE_CLASSES, ROLE_NAMES, DelayedScaling,
    Float8BlockScaling, Float8CurrentScaling, Float8Recipe, Float8RoleSpec, Recipe, recipe_from_dict,
    recipe_from_string,
)

FP8_CLASSES = [Float8CurrentScaling, DelayedScaling, Float8BlockScaling]
TENSOR_OF = {"fprop_input": "input", "wgrad_input": "input", "fprop_weight": "weight", "dgrad_weight": "weight",
             "dgrad_grad_output": "grad_output", "wgrad_grad_output": "grad_output"}


def test_defaults_follow_transformer_engine():
    c, d, b = Float8CurrentScaling(), DelayedScaling(), Float8BlockScaling()
    assert (c.fp8_format, c.power_of_2_scales, c.amax_epsilon) == ("hybrid", False, 0.0)
    assert (d.fp8_format, d.margin, d.amax_history_len, d.amax_compute_algo, d.power_of_2_scales) == \
        ("hybrid", 0, 1024, "max", False)
    assert (b.fp8_format, b.power_of_2_scales, b.amax_epsilon) == ("e4m3", True, 0.0)
    for r in (c, d, b):
        assert isinstance(r, Recipe) and isinstance(r, Float8Recipe)
        assert (r.elemwise_format, r.elemwise_subnormals, r.quantize_backward) == (None, True, True)


@pytest.mark.parametrize("cls", FP8_CLASSES)
@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_role_views(cls, fp8_format):
    r = cls(fp8_format=fp8_format)
    for name in ROLE_NAMES:
        spec = r.role(name)
        assert isinstance(spec, Float8RoleSpec) and spec.quantized
        assert spec.tensor == TENSOR_OF[name] and spec.scaling == cls.scaling
        grad = TENSOR_OF[name] == "grad_output"
        assert spec.fmt == ("fp8_e5m2" if (grad and fp8_format == "hybrid") else "fp8_e4m3")
        if cls is Float8BlockScaling:
            assert spec.block == ((128, 128) if spec.tensor == "weight" else (1, 128)) 
        else:
            assert spec.block is None
    # the two uses of one tensor share one spec, so a module's Quantizer casts them in one call
    assert r.role("fprop_input") == r.role("wgrad_input")
    assert r.role("fprop_weight") == r.role("dgrad_weight")
    assert r.role("dgrad_grad_output") == r.role("wgrad_grad_output")


@pytest.mark.parametrize("cls", FP8_CLASSES)
def test_quantize_backward_false(cls):
    r = cls(quantize_backward=False)
    assert [r.role(n).fmt is None for n in ROLE_NAMES] == [n not in ("fprop_input", "fprop_weight")
                                                           for n in ROLE_NAMES]


def test_options_reach_the_specs():
    spec = Float8CurrentScaling(power_of_2_scales=True, amax_epsilon=1e-6).role("fprop_input")
    assert (spec.power_of_2_scales, spec.amax_epsilon) == (True, 1e-6)
    assert DelayedScaling(margin=3).role("fprop_weight").margin == 3


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(fp8_format="e5m2"), ValueError, r"fp8_format='e5m2'.*no e5m2 x e5m2 GEMM.*'hybrid'"),
    (dict(fp8_format="fp4"), ValueError, r"fp8_format must be one of 'e4m3', 'hybrid'"),
    (dict(fp8_format=3), TypeError, r"fp8_format must be a str"),
    (dict(power_of_2_scales="yes"), TypeError, r"power_of_2_scales must be a bool"),
    (dict(amax_epsilon=-1.0), ValueError, r"amax_epsilon must be a finite float >= 0"),
    (dict(amax_epsilon=float("nan")), ValueError, r"amax_epsilon must be a finite float >= 0"),
    (dict(amax_epsilon="0"), TypeError, r"amax_epsilon must be a float"),
    (dict(block_size=16), TypeError, r"Float8CurrentScaling\.block_size is an MX recipe option and does not apply "
                                     r"to FP8 recipes; valid options: fp8_format, power_of_2_scales, amax_epsilon"),
    (dict(scale_mode="floor"), TypeError, r"scale_mode is an MX recipe option"),
    (dict(rounding="stochastic"), TypeError, r"rounding is an MX recipe option"),
    (dict(seed=1), TypeError, r"seed is an MX recipe option"),
    (dict(margin=1), TypeError, r"Float8CurrentScaling has no option 'margin' \(an option of DelayedScaling\)"),
    (dict(elemwise_format="fp8_e4m3"), ValueError, r"elemwise_format got 'fp8_e4m3'"),
])
def test_current_scaling_validation(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        Float8CurrentScaling(**kwargs)


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(margin=-1), ValueError, r"DelayedScaling\.margin must be an int in \[0, 127\]"),
    (dict(margin=1.5), TypeError, r"margin must be an int"),
    (dict(amax_history_len=0), ValueError, r"amax_history_len must be an int in \[1, "),
    (dict(amax_compute_algo="mean"), ValueError, r"amax_compute_algo must be one of 'max', 'most_recent'"),
    (dict(grad_rounding="stochastic"), TypeError, r"grad_rounding is an MX recipe option"),
])
def test_delayed_scaling_validation(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        DelayedScaling(**kwargs)


def test_abstract_base_refuses():
    with pytest.raises(TypeError, match="Float8Recipe is an abstract base class"):
        Float8Recipe()


def test_spellings_are_canonicalised():
    assert Float8CurrentScaling(fp8_format="E4M3") == Float8CurrentScaling(fp8_format="fp8_e4m3")
    assert DelayedScaling(amax_compute_algo="MAX") == DelayedScaling()


@pytest.mark.parametrize("recipe", [
    Float8CurrentScaling(), Float8CurrentScaling(fp8_format="e4m3", power_of_2_scales=True, amax_epsilon=1e-12,
                                                 elemwise_format="bfloat16"),
    DelayedScaling(), DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="most_recent",
                                     quantize_backward=False),
    Float8BlockScaling(), Float8BlockScaling(fp8_format="hybrid", power_of_2_scales=False),
], ids=repr)
def test_round_trips(recipe):
    d = recipe.to_dict()
    assert d["recipe"] == type(recipe).__name__
    assert not {"block_size", "scale_mode", "rounding", "grad_rounding", "seed", "amax_reduction_group"} & set(d)
    text = json.dumps(d)
    for rebuilt in (recipe_from_dict(json.loads(text)), type(recipe).from_dict(json.loads(text)),
                    Recipe.from_dict(json.loads(text)), mxtrain.recipe_from_dict(json.loads(text)),
                    pickle.loads(pickle.dumps(recipe)), eval(repr(recipe), vars(mxtrain.recipes))):
        assert rebuilt == recipe and type(rebuilt) is type(recipe) and hash(rebuilt) == hash(recipe)
    options = ",".join(f"{k}={v}" for k, v in d.items() if k != "recipe")
    assert recipe_from_string(f"{type(recipe).short_name}:{options}") == recipe


def test_from_dict_errors():
    with pytest.raises(ValueError, match=r"unknown key\(s\) for Float8CurrentScaling: 'block_size'"):
        Float8CurrentScaling.from_dict({"block_size": 32})
    with pytest.raises(ValueError, match=r"unknown key\(s\) for DelayedScaling: 'amax_reduction_group'"):
        DelayedScaling.from_dict({"amax_reduction_group": None})
    with pytest.raises(ValueError, match=r"unknown recipe type recipe='Float9'; valid: 'MXFP8Recipe'.*"
                                         r"'Float8CurrentScaling', 'DelayedScaling', 'Float8BlockScaling'"):
        recipe_from_dict({"recipe": "Float9"})


def test_registries():
    assert set(FLOAT8_RECIPE_CLASSES) == {"Float8CurrentScaling", "DelayedScaling", "Float8BlockScaling"}
    assert set(ALL_RECIPE_CLASSES) == set(RECIPE_CLASSES) | set(FLOAT8_RECIPE_CLASSES)


@pytest.mark.parametrize("text, expected", [
    ("fp8_current", Float8CurrentScaling()),
    ("FP8-Delayed", DelayedScaling()),
    ("fp8_block", Float8BlockScaling()),
    ("fp8_delayed:amax_history_len=16,amax_compute_algo=most_recent,margin=1",
     DelayedScaling(amax_history_len=16, amax_compute_algo="most_recent", margin=1)),
    ("fp8_current:power_of_2_scales=true,amax_epsilon=1e-10", Float8CurrentScaling(power_of_2_scales=True,
                                                                                   amax_epsilon=1e-10)),
])
def test_recipe_from_string(text, expected):
    assert recipe_from_string(text) == expected


def test_recipe_from_string_errors():
    with pytest.raises(ValueError, match=r"unknown option 'block_size' for Float8BlockScaling"):
        recipe_from_string("fp8_block:block_size=64")
    with pytest.raises(TypeError, match=r"amax_epsilon must be a float.*'tiny'"):
        recipe_from_string("fp8_current:amax_epsilon=tiny")


def test_process_group_is_runtime_only():
    group = object()  # stands in for a ProcessGroup: never serialised nor compared
    r = Float8CurrentScaling(amax_reduction_group=group)
    assert r == Float8CurrentScaling() and "amax_reduction_group" not in repr(r)
    assert r.role("fprop_input").amax_reduction_group is group
    assert r.to_dict() == Float8CurrentScaling().to_dict()
