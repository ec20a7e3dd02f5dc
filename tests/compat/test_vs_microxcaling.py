"""mxtrain.compat.mx gives microxcaling's exact values (outputs and gradients) on randn inputs.

Runs microxcaling itself from third_party/microxcaling (skipped when absent). On
randn data its float log2 and floor(x + 0.5) are exact, so every element must agree.
"""

import warnings

import pytest

from cases import CASES, SPECS, run
from conftest import mismatch, same
from mxtrain.compat import mx


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spec", list(SPECS))
def test_equal_to_microxcaling(ms, spec, case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = run(ms, SPECS[spec], case)
    ours = run(mx, SPECS[spec], case)
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert same(a, b), f"{case} under {spec}, result {i}: {mismatch(a, b)}"


def test_specs_parsing_equal_to_microxcaling(ms):
    import argparse
    argv = ["--w_elem_format", "fp8_e4m3", "--a_elem_format", "int8", "--block_size", "32", "--bfloat", "16",
            "--round", "even", "--no_quantize_backprop", "--softmax_exp2"]
    theirs = ms.get_mx_specs(ms.add_mx_args(argparse.ArgumentParser()).parse_args(argv))
    ours = mx.get_mx_specs(mx.add_mx_args(argparse.ArgumentParser()).parse_args(argv))
    assert dict(ours) == dict(theirs)
    for specs in ({"a_elem_format": "fp4_e2m1", "round": "floor"}, {"fp": 10}, {}, {"bfloat": 16, "round_output": "even"}):
        a, b = mx.finalize_mx_specs(dict(specs)), ms.finalize_mx_specs(dict(specs))
        assert (a is None and b is None) or dict(a) == dict(b)
