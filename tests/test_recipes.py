import copy
import json
import pickle

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mxtrain.formats import MX_FORMAT_NAMES, bfloat, pack_group, parse_format
from mxtrain.recipes import (
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
    recipe_from_string,
)

ALL_CLASSES = [MXFP8Recipe, MXFP6Recipe, MXFP4Recipe, MXINT8Recipe, MXRecipe]
SHARED_DEFAULTS = dict(block_size=32, scale_mode="rceil", rounding="even", grad_rounding=None,
                       elemwise_format=None, elemwise_subnormals=True, quantize_backward=True, seed=None)


def role_formats(recipe):
    return {name: recipe.role(name).fmt for name in ROLE_NAMES}


# --- defaults and role views -------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_CLASSES)
def test_shared_defaults(cls):
    recipe = cls()
    # MXFP4 rounds its gradients stochastically by default (test_mxfp4_defaults_round_gradients_stochastically)
    expected = dict(SHARED_DEFAULTS, grad_rounding="stochastic") if cls is MXFP4Recipe else SHARED_DEFAULTS
    for name, value in expected.items():
        assert getattr(recipe, name) == value, name


def test_mxfp4_defaults_round_gradients_stochastically():
    roles = MXFP4Recipe().roles()
    for name in ROLE_NAMES:
        expected = "stochastic" if name in GRAD_OUTPUT_ROLES else "even"
        assert roles[name] == RoleSpec(fmt="fp4_e2m1", block_size=32, scale_mode="rceil", rounding=expected), name
    assert MXFP4Recipe().seed is None  # torch's global RNG: torch.manual_seed makes a run reproducible
    deterministic = MXFP4Recipe(grad_rounding=None)
    assert {s.rounding for s in deterministic.roles().values()} == {"even"}
    assert repr(deterministic) == "MXFP4Recipe(grad_rounding=None)"
    assert recipe_from_dict(deterministic.to_dict()) == deterministic
    assert recipe_from_string("mxfp4:grad_rounding=none") == deterministic
    # the other shorthand recipes keep deterministic gradients
    for cls in (MXFP8Recipe, MXFP6Recipe, MXINT8Recipe, MXRecipe):
        assert cls().grad_rounding is None


@pytest.mark.parametrize("cls, fmt", [(MXFP8Recipe, "fp8_e4m3"), (MXFP6Recipe, "fp6_e2m3"),
                                      (MXFP4Recipe, "fp4_e2m1"), (MXINT8Recipe, "int8")])
def test_shorthand_recipes_use_one_format_for_every_role(cls, fmt):
    assert role_formats(cls()) == dict.fromkeys(ROLE_NAMES, fmt)
    for name, spec in cls().roles().items():
        rounding = "stochastic" if cls is MXFP4Recipe and name in GRAD_OUTPUT_ROLES else "even"
        assert spec == RoleSpec(fmt=fmt, block_size=32, scale_mode="rceil", rounding=rounding)


def test_mx_recipe_defaults_to_high_precision_everywhere():
    assert role_formats(MXRecipe()) == dict.fromkeys(ROLE_NAMES, None)
    assert not any(spec.quantized for spec in MXRecipe().roles().values())


def test_role_names_partition():
    assert set(FORWARD_ROLES) | set(BACKWARD_ROLES) == set(ROLE_NAMES)
    assert not set(FORWARD_ROLES) & set(BACKWARD_ROLES)
    assert set(GRAD_OUTPUT_ROLES) <= set(BACKWARD_ROLES)
    assert list(MXFP8Recipe().roles()) == list(ROLE_NAMES)


def test_hybrid_gives_e5m2_to_the_grad_output_roles_only():
    formats = role_formats(MXFP8Recipe(fp8_format="hybrid"))
    assert formats == {"fprop_input": "fp8_e4m3", "fprop_weight": "fp8_e4m3", "dgrad_weight": "fp8_e4m3",
                       "dgrad_grad_output": "fp8_e5m2", "wgrad_input": "fp8_e4m3",
                       "wgrad_grad_output": "fp8_e5m2"}


@pytest.mark.parametrize("spelling", ["e5m2", "E5M2", "fp8_e5m2", "float8_e5m2", parse_format("e5m2")])
def test_fp8_format_e5m2_everywhere_any_spelling(spelling):
    recipe = MXFP8Recipe(fp8_format=spelling)
    assert recipe.fp8_format == "e5m2"
    assert role_formats(recipe) == dict.fromkeys(ROLE_NAMES, "fp8_e5m2")
    assert recipe == MXFP8Recipe(fp8_format="e5m2")


@pytest.mark.parametrize("spelling", ["e3m2", "E3M2", "fp6_e3m2", "mxfp6_e3m2"])
def test_fp6_e3m2(spelling):
    recipe = MXFP6Recipe(fp6_format=spelling)
    assert recipe.fp6_format == "e3m2"
    assert role_formats(recipe) == dict.fromkeys(ROLE_NAMES, "fp6_e3m2")


def test_mx_recipe_roles_map_one_to_one_and_canonicalise():
    recipe = MXRecipe(fprop_input="e4m3", fprop_weight="MXFP4", dgrad_weight="int4",
                      dgrad_grad_output="e5m2", wgrad_input=None, wgrad_grad_output=parse_format("int8"))
    assert role_formats(recipe) == {"fprop_input": "fp8_e4m3", "fprop_weight": "fp4_e2m1",
                                    "dgrad_weight": "int4", "dgrad_grad_output": "fp8_e5m2",
                                    "wgrad_input": None, "wgrad_grad_output": "int8"}
    assert recipe.fprop_weight == "fp4_e2m1"  # stored canonical


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
def test_mx_recipe_uniform_every_format(fmt):
    recipe = MXRecipe.uniform(fmt, block_size=16)
    assert role_formats(recipe) == dict.fromkeys(ROLE_NAMES, fmt)
    assert recipe.block_size == 16
    assert recipe.role("fprop_input").elem_format == parse_format(fmt)


def test_mx_recipe_uniform_matches_shorthand_views():
    assert MXRecipe.uniform("fp8_e4m3").roles() == MXFP8Recipe().roles()
    assert MXRecipe.uniform("int8").roles() == MXINT8Recipe().roles()


@pytest.mark.parametrize("cls", ALL_CLASSES)
def test_quantize_backward_false_leaves_backward_roles_unquantized(cls):
    base = cls() if cls is not MXRecipe else MXRecipe.uniform("fp8_e4m3")
    recipe = base.replace(quantize_backward=False)
    for name in FORWARD_ROLES:
        assert recipe.role(name) == base.role(name)
    for name in BACKWARD_ROLES:
        spec = recipe.role(name)
        assert spec.fmt is None and not spec.quantized and spec.elem_format is None
        assert spec.block_size == base.block_size  # the rest of the view stays meaningful


def test_grad_rounding_applies_to_grad_output_roles_only():
    recipe = MXFP4Recipe(rounding="nearest", grad_rounding="stochastic", seed=7)
    for name in ROLE_NAMES:
        expected = "stochastic" if name in GRAD_OUTPUT_ROLES else "nearest"
        assert recipe.role(name).rounding == expected
    assert recipe.seed == 7
    # grad_rounding=None: the gradients follow `rounding` (MXFP4Recipe's own default is "stochastic")
    assert MXFP4Recipe(rounding="floor", grad_rounding=None).role("wgrad_grad_output").rounding == "floor"
    assert MXFP8Recipe(rounding="floor").role("wgrad_grad_output").rounding == "floor"


def test_shared_options_reach_every_role():
    recipe = MXINT8Recipe(block_size=0, scale_mode="FLOOR", rounding="Nearest")
    assert recipe.scale_mode == "floor" and recipe.rounding == "nearest"
    for spec in recipe.roles().values():
        assert (spec.block_size, spec.scale_mode, spec.rounding) == (0, "floor", "nearest")


def test_role_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"unknown GEMM operand role 'input'.*fprop_input.*wgrad_grad_output"):
        MXFP8Recipe().role("input")
    with pytest.raises(ValueError, match="unknown GEMM operand role"):
        MXFP8Recipe().role(None)


def test_roles_mapping_is_read_only():
    with pytest.raises(TypeError):
        MXFP8Recipe().roles()["fprop_input"] = None


def test_elemwise_format_canonical_names():
    assert MXFP8Recipe(elemwise_format="bf16").elemwise_format == "bfloat16"
    assert MXFP8Recipe(elemwise_format="BFloat12").elemwise_format == "bfloat12"
    assert MXFP8Recipe(elemwise_format="half").elemwise_format == "fp16"
    # elementwise "fp8" is microxcaling's fp=8 (1-5-2), not the fp8_e4m3 MX element
    assert MXFP8Recipe(elemwise_format="fp8").elemwise_format == "fp8"
    assert MXFP8Recipe(elemwise_format=bfloat(14)).elemwise_format == "bfloat14"
    assert MXFP8Recipe(elemwise_subnormals=False).elemwise_subnormals is False


def test_vocabulary_matches_the_quantizers():
    validate = pytest.importorskip("mxtrain.quantization._validate")
    assert SCALE_MODES == validate.SCALE_MODES
    assert ROUNDINGS == validate.ROUNDINGS


# --- validation ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(block_size=-1), ValueError, r"MXFP8Recipe\.block_size must be an int in \[0, 8192\].*0 = one scale.*got -1"),
    (dict(block_size=True), TypeError, r"MXFP8Recipe\.block_size must be an int.*got bool True"),
    (dict(block_size=32.0), TypeError, r"MXFP8Recipe\.block_size must be an int.*got float 32\.0"),
    (dict(block_size="32"), TypeError, r"MXFP8Recipe\.block_size must be an int.*got str '32'"),
    (dict(scale_mode="ceil"), ValueError, r"MXFP8Recipe\.scale_mode must be one of 'floor', 'rceil', 'even', got 'ceil'"),
    (dict(scale_mode=None), TypeError, r"MXFP8Recipe\.scale_mode must be a str, one of 'floor', 'rceil', 'even'"),
    (dict(rounding="up"), ValueError,
     r"MXFP8Recipe\.rounding must be one of 'even', 'nearest', 'floor', 'stochastic', got 'up'"),
    (dict(grad_rounding="sr"), ValueError, r"MXFP8Recipe\.grad_rounding must be one of .*'stochastic', got 'sr'"),
    (dict(elemwise_format="fp8_e4m3"), ValueError,
     r"MXFP8Recipe\.elemwise_format got 'fp8_e4m3', which is an MX element format.*'bfloatN'.*'fpN'"),
    (dict(elemwise_format="fp4"), ValueError, r"elemwise_format got 'fp4', which is an MX element format"),
    (dict(elemwise_format="int8"), ValueError, r"elemwise_format got 'int8', which is an MX element format"),
    (dict(elemwise_format="float99"), ValueError,
     r"MXFP8Recipe\.elemwise_format must be None .*'bfloatN' \(N=10\.\.32.*'fpN' \(N=7\.\.32.*got 'float99'"),
    (dict(elemwise_format="tf32"), ValueError, r"elemwise_format must be None.*got 'tf32'"),
    (dict(elemwise_format=16), TypeError, r"MXFP8Recipe\.elemwise_format must be None.*got int 16"),
    (dict(elemwise_subnormals=1), TypeError, r"MXFP8Recipe\.elemwise_subnormals must be a bool.*got int 1"),
    (dict(quantize_backward="no"), TypeError, r"MXFP8Recipe\.quantize_backward must be a bool.*got str 'no'"),
    (dict(seed=-1), ValueError, r"MXFP8Recipe\.seed must be an int in \[0, 18446744073709551615\].*got -1"),
    (dict(seed=2**64), ValueError, r"MXFP8Recipe\.seed must be an int in \[0, "),
    (dict(seed=False), TypeError, r"MXFP8Recipe\.seed must be an int.*got bool False"),
    (dict(seed=1.5), TypeError, r"MXFP8Recipe\.seed must be an int.*got float 1\.5"),
    (dict(fp8_format="fp4_e2m1"), ValueError,
     r"MXFP8Recipe\.fp8_format must be one of 'e4m3', 'e5m2', 'hybrid'.*got 'fp4_e2m1'"),
    (dict(fp8_format="e5m3"), ValueError, r"MXFP8Recipe\.fp8_format must be one of 'e4m3', 'e5m2', 'hybrid'"),
    (dict(fp8_format=8), TypeError, r"MXFP8Recipe\.fp8_format must be a str, one of 'e4m3', 'e5m2', 'hybrid'"),
])
def test_validation_errors_name_field_value_and_choices(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        MXFP8Recipe(**kwargs)


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(fp6_format="e4m3"), ValueError, r"MXFP6Recipe\.fp6_format must be one of 'e2m3', 'e3m2', got 'e4m3'"),
    (dict(fp6_format=None), TypeError, r"MXFP6Recipe\.fp6_format must be a str, one of 'e2m3', 'e3m2'"),
])
def test_fp6_format_validation(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        MXFP6Recipe(**kwargs)


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(fprop_input="fp9"), ValueError,
     r"MXRecipe\.fprop_input: unknown MX element format 'fp9'; valid names: fp8_e4m3, .*int2.*or None"),
    (dict(wgrad_grad_output="bf16"), ValueError,
     r"MXRecipe\.wgrad_grad_output: unknown MX element format 'bf16'.*None to keep this operand in high precision"),
    (dict(dgrad_weight=bfloat(16)), ValueError, r"MXRecipe\.dgrad_weight: bfloat16 is an elementwise format"),
    (dict(fprop_weight=8), TypeError, r"MXRecipe\.fprop_weight must be an MX element format name .*got int 8"),
    (dict(block_size=-32), ValueError, r"MXRecipe\.block_size must be an int in \[0, 8192\]"),
])
def test_mx_recipe_validation(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        MXRecipe(**kwargs)


def test_unknown_constructor_argument_and_positional_arguments_rejected():
    with pytest.raises(TypeError, match="block"):
        MXFP8Recipe(block=32)
    with pytest.raises(TypeError):
        MXFP8Recipe("hybrid")  # keyword-only: positional recipe arguments would be unreadable


def test_base_recipe_is_abstract():
    with pytest.raises(TypeError, match="Recipe is an abstract base class.*MXFP8Recipe"):
        Recipe()


def test_role_spec_validates_too():
    assert RoleSpec(fmt="E4M3", block_size=32, scale_mode="RCEIL", rounding="even").fmt == "fp8_e4m3"
    with pytest.raises(ValueError, match=r"RoleSpec\.block_size must be an int in \[0, 8192\]"):
        RoleSpec(fmt=None, block_size=-1, scale_mode="floor", rounding="even")
    with pytest.raises(ValueError, match=r"RoleSpec\.rounding must be one of"):
        RoleSpec(fmt=None, block_size=32, scale_mode="floor", rounding="odd")


def test_frozen():
    recipe = MXFP8Recipe()
    with pytest.raises(AttributeError):
        recipe.block_size = 16
    with pytest.raises(AttributeError):
        recipe.role("fprop_input").fmt = "int8"


def test_numpy_style_integers_are_stored_as_int():
    class FakeNumpyInt(int):  # numbers.Integral, like numpy.int64 from a sweep grid
        pass

    recipe = MXFP8Recipe(block_size=FakeNumpyInt(16), seed=FakeNumpyInt(3))
    assert type(recipe.block_size) is int and type(recipe.seed) is int


def test_replace_revalidates():
    recipe = MXFP8Recipe()
    assert recipe.replace(block_size=16) == MXFP8Recipe(block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        recipe.replace(block_size=-1)


# --- equality, hashing, repr -----------------------------------------------------------


def test_equality_and_hash_use_canonical_values():
    a = MXFP8Recipe(fp8_format="HYBRID", scale_mode="RCEIL", elemwise_format="bf16")
    b = MXFP8Recipe(fp8_format="hybrid", elemwise_format="bfloat16")
    assert a == b and hash(a) == hash(b)
    assert len({a, b, MXFP8Recipe()}) == 2
    assert MXFP8Recipe() != MXFP8Recipe(block_size=16)
    assert MXFP8Recipe(seed=1) != MXFP8Recipe(seed=2)


def test_equal_views_of_different_classes_are_different_recipes():
    assert MXRecipe.uniform("fp8_e4m3") != MXFP8Recipe()
    assert MXFP4Recipe() != MXINT8Recipe()


def test_hash_ignores_the_cached_role_views():
    used, fresh = MXFP8Recipe(), MXFP8Recipe()
    used.role("fprop_input")
    assert used == fresh and hash(used) == hash(fresh)


def test_copy_and_pickle():
    recipe = MXRecipe(fprop_input="int4", grad_rounding="stochastic", seed=1)
    recipe.roles()
    for clone in (copy.copy(recipe), copy.deepcopy(recipe), pickle.loads(pickle.dumps(recipe))):
        assert clone == recipe and clone.roles() == recipe.roles()


def test_repr_shows_only_changed_fields_and_evals_back():
    assert repr(MXFP8Recipe()) == "MXFP8Recipe()"
    assert repr(MXFP4Recipe()) == "MXFP4Recipe()"
    assert repr(MXFP8Recipe(block_size=16, fp8_format="hybrid")) == "MXFP8Recipe(fp8_format='hybrid', block_size=16)"
    assert repr(MXRecipe(wgrad_input="e4m3", seed=0)) == "MXRecipe(wgrad_input='fp8_e4m3', seed=0)"
    namespace = {cls.__name__: cls for cls in ALL_CLASSES}
    for recipe in (MXFP8Recipe(fp8_format="hybrid", elemwise_format="fp12", quantize_backward=False),
                   MXRecipe(fprop_input="int2", scale_mode="even"), MXFP6Recipe(fp6_format="e3m2")):
        assert eval(repr(recipe), namespace) == recipe
    assert repr(MXFP8Recipe().role("fprop_input")) == (
        "RoleSpec(fmt='fp8_e4m3', block_size=32, scale_mode='rceil', rounding='even')")


# --- serialisation -----------------------------------------------------------------------


def test_to_dict_has_tag_and_every_field():
    d = MXFP8Recipe(fp8_format="hybrid").to_dict()
    assert d == {"recipe": "MXFP8Recipe", "fp8_format": "hybrid", **SHARED_DEFAULTS}
    assert list(d)[:2] == ["recipe", "fp8_format"]
    assert list(MXRecipe().to_dict())[1:7] == list(ROLE_NAMES)


@pytest.mark.parametrize("recipe", [
    MXFP8Recipe(), MXFP8Recipe(fp8_format="hybrid", grad_rounding="stochastic", seed=2**64 - 1),
    MXFP6Recipe(fp6_format="e3m2", block_size=0), MXFP4Recipe(elemwise_format="fp10", elemwise_subnormals=False),
    MXINT8Recipe(quantize_backward=False, scale_mode="even"),
    MXRecipe(fprop_input="int4", dgrad_grad_output="fp8_e5m2", elemwise_format="bfloat16"),
], ids=repr)
def test_round_trip_through_json(recipe):
    text = json.dumps(recipe.to_dict())
    for rebuilt in (recipe_from_dict(json.loads(text)), type(recipe).from_dict(json.loads(text)),
                    Recipe.from_dict(json.loads(text))):
        assert rebuilt == recipe and type(rebuilt) is type(recipe) and hash(rebuilt) == hash(recipe)


def test_from_dict_fills_defaults_and_tag_is_optional_on_the_class():
    assert MXFP8Recipe.from_dict({}) == MXFP8Recipe()
    assert MXFP8Recipe.from_dict({"block_size": 16}) == MXFP8Recipe(block_size=16)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) for MXFP8Recipe: 'blocksize'; valid keys: 'recipe', "
                                         r"'fp8_format', 'block_size'"):
        MXFP8Recipe.from_dict({"blocksize": 16})
    with pytest.raises(ValueError, match=r"unknown key\(s\) for MXFP4Recipe: 'fp8_format'"):
        recipe_from_dict({"recipe": "MXFP4Recipe", "fp8_format": "e4m3"})


def test_from_dict_validates_values():
    with pytest.raises(ValueError, match=r"MXRecipe\.fprop_input: unknown MX element format 'fp3'"):
        recipe_from_dict({"recipe": "MXRecipe", "fprop_input": "fp3"})


def test_from_dict_tag_errors():
    with pytest.raises(ValueError, match=r"MXFP8Recipe\.from_dict got a dict tagged recipe='MXFP4Recipe'"):
        MXFP8Recipe.from_dict({"recipe": "MXFP4Recipe"})
    with pytest.raises(ValueError, match=r"no 'recipe' key.*'MXFP8Recipe', .*'MXRecipe'"):
        recipe_from_dict({"block_size": 32})
    with pytest.raises(ValueError, match=r"unknown recipe type recipe='FP8Recipe'; valid: 'MXFP8Recipe'"):
        recipe_from_dict({"recipe": "FP8Recipe"})
    with pytest.raises(TypeError, match="expects a mapping"):
        recipe_from_dict("mxfp8")
    with pytest.raises(TypeError, match="expects a mapping"):
        MXFP8Recipe.from_dict([("block_size", 32)])


def test_registry_lists_every_class():
    assert set(RECIPE_CLASSES) == {cls.__name__ for cls in ALL_CLASSES}


_format_or_none = st.sampled_from((None,) + MX_FORMAT_NAMES)


@settings(max_examples=60, deadline=None)
@given(roles=st.fixed_dictionaries({name: _format_or_none for name in ROLE_NAMES}),
       block_size=st.integers(0, 4096), scale_mode=st.sampled_from(SCALE_MODES),
       rounding=st.sampled_from(ROUNDINGS), grad_rounding=st.sampled_from((None,) + ROUNDINGS),
       elemwise_format=st.sampled_from([None, "bfloat16", "bfloat10", "fp16", "fp7", "fp32"]),
       elemwise_subnormals=st.booleans(), quantize_backward=st.booleans(),
       seed=st.none() | st.integers(0, 2**64 - 1))
def test_any_mx_recipe_round_trips_and_views_follow_fields(roles, **options):
    # block sizes that the roles' formats cannot pack are refused (tests/test_edge_inputs.py)
    assume(all(options["block_size"] % pack_group(f) == 0 for f in roles.values() if f is not None))
    recipe = MXRecipe(**roles, **options)
    rebuilt = recipe_from_dict(json.loads(json.dumps(recipe.to_dict())))
    assert rebuilt == recipe and hash(rebuilt) == hash(recipe)
    for name in ROLE_NAMES:
        spec = recipe.role(name)
        backward_off = name in BACKWARD_ROLES and not options["quantize_backward"]
        assert spec.fmt == (None if backward_off else roles[name])
        grad_rounding = options["grad_rounding"] if name in GRAD_OUTPUT_ROLES else None
        assert spec.rounding == (grad_rounding or options["rounding"])
        assert (spec.block_size, spec.scale_mode) == (options["block_size"], options["scale_mode"])


# --- command-line strings ----------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("mxfp8", MXFP8Recipe()),
    ("MXFP6", MXFP6Recipe()),
    ("mxfp4", MXFP4Recipe()),
    ("mxint8", MXINT8Recipe()),
    ("mx", MXRecipe()),
    (" mxfp8 : fp8_format=hybrid , block_size=16 ", MXFP8Recipe(fp8_format="hybrid", block_size=16)),
    ("mxfp6:fp6_format=e3m2", MXFP6Recipe(fp6_format="e3m2")),
    ("mxfp4:grad_rounding=stochastic,seed=0,elemwise_format=bf16",
     MXFP4Recipe(grad_rounding="stochastic", seed=0, elemwise_format="bfloat16")),
    ("mx:fprop_input=e4m3,fprop_weight=int4,quantize_backward=false,block_size=0x10,seed=none",
     MXRecipe(fprop_input="fp8_e4m3", fprop_weight="int4", quantize_backward=False, block_size=16)),
    ("mxint8:elemwise_subnormals=no,grad_rounding=None", MXINT8Recipe(elemwise_subnormals=False)),
])
def test_recipe_from_string(text, expected):
    recipe = recipe_from_string(text)
    assert recipe == expected and type(recipe) is type(expected)


@pytest.mark.parametrize("text", ["none", "None", "off", "bf16", "bfloat16", "fp32"])
def test_recipe_from_string_high_precision_is_none(text):
    assert recipe_from_string(text) is None


@pytest.mark.parametrize("text, error, pattern", [
    ("mxfp5", ValueError, r"unknown recipe 'mxfp5'.*'mxfp8', 'mxfp6', 'mxfp4', 'mxint8', 'mx'.*'bf16'"),
    ("mxfp8:blocksize=16", ValueError, r"unknown option 'blocksize' for MXFP8Recipe; valid options: fp8_format, block_size"),
    ("mxfp8:block_size", ValueError, r"option 'block_size' is not key=value"),
    ("mxfp8:block_size=16,block_size=32", ValueError, r"option 'block_size' given twice"),
    ("mxfp8:block_size=big", TypeError, r"MXFP8Recipe\.block_size must be an int.*got str 'big'"),
    ("mxfp8:quantize_backward=maybe", TypeError, r"MXFP8Recipe\.quantize_backward must be a bool.*'maybe'"),
    ("mx:fprop_input=fp9", ValueError, r"MXRecipe\.fprop_input: unknown MX element format 'fp9'"),
    ("bf16:block_size=16", ValueError, r"'bf16' means no MX recipe and takes no options"),
    (None, TypeError, r"recipe spec must be a str"),
])
def test_recipe_from_string_errors(text, error, pattern):
    with pytest.raises(error, match=pattern):
        recipe_from_string(text)
