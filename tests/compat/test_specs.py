"""mx_specs semantics: keys and defaults, finalize rules, argparse flags, errors, recipe conversion."""

import argparse

import pytest
import torch

from mxtrain.compat import mx
from mxtrain.compat.mx.specs import DEFAULTS
from mxtrain.recipes import MXFP8Recipe, MXINT8Recipe, MXRecipe

MICROXCALING_DEFAULTS = {
    "scale_bits": 0, "w_elem_format": None, "a_elem_format": None, "w_elem_format_bp": None, "a_elem_format_bp": None,
    "a_elem_format_bp_ex": None, "a_elem_format_bp_os": None, "mx_flush_fp32_subnorms": False,
    "shared_exp_method": "max", "block_size": 0, "bfloat": 0, "fp": 0, "bfloat_subnorms": True,
    "quantize_backprop": True, "round": "nearest", "round_m": "nearest", "round_weight": "nearest",
    "round_output": "nearest", "round_grad_weight": "nearest", "round_grad_input": "nearest",
    "round_mx_output": "nearest", "round_mx_input_grad_input": "nearest", "round_mx_weight_grad_input": "nearest",
    "round_mx_grad_output_grad_input": "nearest", "round_mx_input_grad_weight": "nearest",
    "round_mx_grad_output_grad_weight": "nearest", "softmax_exp2": False, "vec_use_exp2": False,
    "vec_use_recip": False, "custom_cuda": False,
}


def test_defaults():
    assert dict(mx.MxSpecs()) == MICROXCALING_DEFAULTS
    assert list(DEFAULTS) == list(MICROXCALING_DEFAULTS)
    s = mx.MxSpecs({"bfloat": 16})
    assert s["bfloat"] == 16 and s["fp"] == 0


def test_unknown_keys_are_refused():
    with pytest.raises(KeyError, match="w_elem_format"):
        mx.MxSpecs({"w_elem_fromat": "int8"})
    s = mx.MxSpecs()
    with pytest.raises(KeyError, match="valid keys"):
        s["blocksize"] = 32
    with pytest.raises(KeyError):
        mx.apply_mx_specs({"nope": 1})


def test_finalize_inherits_backward_formats_and_roundings():
    specs = {"w_elem_format": "fp8_e4m3", "a_elem_format": "int8", "a_elem_format_bp_os": "fp8_e5m2",
             "round": "even", "round_grad_input": "floor"}
    out = mx.finalize_mx_specs(specs)
    assert isinstance(out, mx.MxSpecs)
    assert out["w_elem_format_bp"] == "fp8_e4m3"
    assert out["a_elem_format_bp"] == out["a_elem_format_bp_ex"] == "int8"
    assert out["a_elem_format_bp_os"] == "fp8_e5m2"  # given, so kept
    for k in ("round_m", "round_output", "round_grad_weight", "round_weight", "round_mx_output"):
        assert out[k] == "even", k
    assert out["round_grad_input"] == "floor"
    for k in ("round_mx_input_grad_input", "round_mx_weight_grad_input", "round_mx_grad_output_grad_input",
              "round_mx_input_grad_weight", "round_mx_grad_output_grad_weight"):
        assert out[k] == "floor", k  # inherit from round_grad_input
    assert specs["w_elem_format_bp"] == "fp8_e4m3"  # written into the given dict too, as microxcaling does


def test_finalize_of_a_full_mxspecs_keeps_its_roundings():
    # MxSpecs() already holds every round_* key, so a later round change does not propagate (microxcaling)
    s = mx.MxSpecs()
    s["a_elem_format"] = "int8"
    s["round"] = "even"
    out = mx.finalize_mx_specs(s)
    assert out["round"] == "even" and out["round_output"] == "nearest" and out["a_elem_format_bp"] == "int8"


def test_finalize_early_exit():
    assert mx.finalize_mx_specs({}) is None
    assert mx.finalize_mx_specs({"round": "even", "block_size": 32}) is None
    assert mx.finalize_mx_specs({}, early_exit=False) == mx.MxSpecs()
    assert mx.finalize_mx_specs({"bfloat": 16})["bfloat"] == 16
    assert mx.finalize_mx_specs({"fp": 8})["fp"] == 8


def test_backward_specs():
    s = mx.finalize_mx_specs({"w_elem_format": "int8", "a_elem_format": "int8", "block_size": 32, "bfloat": 16,
                              "quantize_backprop": False})
    b = mx.get_backwards_mx_specs(s)
    assert all(b[k] is None for k in ("w_elem_format", "a_elem_format", "w_elem_format_bp", "a_elem_format_bp",
                                      "a_elem_format_bp_os", "a_elem_format_bp_ex"))
    assert b["bfloat"] == 0 and b["fp"] == 0 and b["block_size"] == 0
    assert s["bfloat"] == 16  # a copy


def parse(argv):
    parser = mx.add_mx_args(argparse.ArgumentParser())
    return mx.get_mx_specs(parser.parse_args(argv))


def test_argparse_flags():
    parser = mx.add_mx_args(argparse.ArgumentParser())
    flags = {s for a in parser._actions for s in a.option_strings}
    for k, v in MICROXCALING_DEFAULTS.items():
        assert ("--no_" + k if v is True else "--" + k) in flags, k
    assert {"--mx_dir", "--skip_early_exit", "--no_quantize_backprop", "--no_bfloat_subnorms"} <= flags
    args = parser.parse_args([])
    assert args.scale_bits is None and args.round is None and args.no_quantize_backprop is False
    assert parse([]) is None
    s = parse(["--w_elem_format", "fp8_e4m3", "--a_elem_format", "fp8_e4m3", "--block_size", "32",
               "--scale_bits", "8", "--bfloat", "16", "--no_quantize_backprop", "--round", "even", "--softmax_exp2"])
    assert s["quantize_backprop"] is False and s["bfloat_subnorms"] is True and s["softmax_exp2"] is True
    assert s["block_size"] == 32 and s["a_elem_format_bp_ex"] == "fp8_e4m3" and s["round_mx_output"] == "even"
    assert parse(["--skip_early_exit"]) == mx.MxSpecs()
    # hyphenated aliases
    s2 = parse(["--w-elem-format", "int8", "--no-bfloat-subnorms", "--block-size", "16"])
    assert s2["w_elem_format"] == "int8" and s2["bfloat_subnorms"] is False and s2["block_size"] == 16


@pytest.mark.parametrize("specs, match", [
    ({"bfloat": 8}, "bfloat"), ({"fp": 6}, "fp"), ({"bfloat": 16, "fp": 16}, "both"), ({"fp": 40}, "fp"),
])
def test_elementwise_width_errors(specs, match):
    s = mx.finalize_mx_specs(specs)
    with pytest.raises(ValueError, match=match):
        mx.quantize_elemwise_op(torch.ones(3), s)


def test_bad_formats_and_modes():
    s = mx.finalize_mx_specs({"a_elem_format": "fp5"})
    with pytest.raises(ValueError, match="fp8_e4m3"):
        mx.linear(torch.ones(2, 4), torch.ones(3, 4), mx_specs=s)
    s = mx.finalize_mx_specs({"a_elem_format": "int8", "round": "up"})
    with pytest.raises(ValueError, match="rounding"):
        mx.quantize_mx_op(torch.ones(4), s, elem_format="int8", axes=[-1], round=s["round"])
    with pytest.raises(ValueError, match="mode_config"):
        mx.matmul(torch.ones(2, 4), torch.ones(4, 3), mx_specs=mx.finalize_mx_specs({"bfloat": 16}), mode_config="ww")


def test_recipe_round_trip():
    r = MXRecipe(fprop_input="fp8_e4m3", fprop_weight="int8", dgrad_weight="fp6_e2m3", dgrad_grad_output="fp8_e5m2",
                 wgrad_input="fp4_e2m1", wgrad_grad_output="int4", block_size=16, scale_mode="floor",
                 rounding="nearest", grad_rounding="even", elemwise_format="fp12", elemwise_subnormals=False)
    s = mx.specs_from_recipe(r)
    assert s["a_elem_format"] == "fp8_e4m3" and s["w_elem_format"] == "int8" and s["w_elem_format_bp"] == "fp6_e2m3"
    assert s["a_elem_format_bp_os"] == "fp8_e5m2" and s["a_elem_format_bp"] == "fp4_e2m1"
    assert s["a_elem_format_bp_ex"] == "int4" and s["fp"] == 12 and s["bfloat"] == 0
    assert s["round_mx_grad_output_grad_input"] == "even" and s["round_output"] == "nearest"
    assert mx.recipe_from_specs(s) == r
    r2 = MXFP8Recipe(scale_mode="floor", elemwise_format="bfloat16", quantize_backward=False)
    back = mx.recipe_from_specs(mx.specs_from_recipe(r2))
    assert dict(back.roles()) == dict(r2.roles()) and back.elemwise_format == "bfloat16"


def test_recipe_from_lab_specs():
    specs = mx.MxSpecs()
    specs.update(w_elem_format="int8", a_elem_format="int8", block_size=32, scale_bits=8, bfloat=16)
    r = mx.recipe_from_specs(specs)
    assert r.role("dgrad_weight").fmt == "int8" and r.rounding == "nearest" and r.scale_mode == "floor"
    assert r.elemwise_format == "bfloat16" and r.block_size == 32


def test_conversion_errors():
    with pytest.raises(ValueError, match="floor"):
        mx.specs_from_recipe(MXINT8Recipe())  # rceil by default
    with pytest.raises(ValueError, match="scale_bits"):
        mx.recipe_from_specs({"a_elem_format": "int8", "scale_bits": 5})
    with pytest.raises(ValueError, match="fp16"):
        mx.recipe_from_specs({"a_elem_format": "fp16"})
    with pytest.raises(ValueError, match="round_output"):
        mx.recipe_from_specs({"a_elem_format": "int8", "round_output": "even"})
