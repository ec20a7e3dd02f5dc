"""The CUDA sources switch on the ids of mxtrain.kernels.ids by number: they must agree with the tables.

The Triton kernels read the tables themselves (constexprs named from them); the CUDA C++ cannot, so
its switches are read here and each case is recognised by what it computes (its formula's telltale
call), and each ``switch (dtype)`` by the element type it launches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mxtrain.activations import GATE_ACTIVATION, PLAIN
from mxtrain.kernels.ids import ACTIVATION_IDS, DTYPE_IDS, PLAIN_ACTIVATION_IDS, gate_activation_id

CSRC = Path(__file__).resolve().parents[2] / "mxtrain" / "csrc"

# what only that activation's formula (forward, backward) contains in cast_common.cuh
TELLTALE = {
    "gelu": ("erff(", "erff("),
    "gelu_tanh": ("tanhf(", "tanhf("),
    "relu": ("return x <= 0.0f ? 0.0f : x;", "return x <= 0.0f ? 0.0f : g;"),
    "squared_relu": ("__fmul_rn(r, r)", "__fmul_rn(2.0f, r)"),
    "silu": ("expf(-x)", "expf(-x)"),
}
CUDA_TYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half", torch.float32: "float"}


def _function_body(source: str, signature: str) -> str:
    start = source.index(signature)
    depth, i = 0, source.index("{", start)
    for j in range(i, len(source)):
        depth += {"{": 1, "}": -1}.get(source[j], 0)
        if depth == 0:
            return source[i:j + 1]
    raise AssertionError(f"unbalanced braces after {signature!r}")


def _switch_cases(body: str) -> dict:
    """``{case number or "default": its code}`` of the (first) switch in ``body``."""
    parts = re.split(r"\b(?:case\s+(\d+)|(default))\s*:", body)
    return {(int(num) if num else "default"): code for num, default, code in
            zip(parts[1::3], parts[2::3], parts[3::3])}


@pytest.mark.parametrize("function, which", [("float act_fwd(", 0), ("float act_bwd(", 1)])
def test_cuda_activation_switch_matches_the_table(function, which):
    cases = _switch_cases(_function_body((CSRC / "cast_common.cuh").read_text(), function))
    assert set(cases) - {"default"} <= set(PLAIN_ACTIVATION_IDS.values())
    for name, telltales in TELLTALE.items():
        found = [k for k, code in cases.items() if telltales[which] in code]
        assert len(found) == 1, (function, name, found)
        want = PLAIN_ACTIVATION_IDS[name]
        # the default case takes the one plain id no case names
        assert found[0] == want or (found[0] == "default" and want not in cases), (function, name, found, want)
    assert set(TELLTALE) == set(PLAIN)


@pytest.mark.parametrize("source", ["mx_cast.cu", "fp8_block_cast.cu"])
def test_cuda_dtype_switches_match_the_table(source):
    text = (CSRC / source).read_text()
    switches = [m.start() for m in re.finditer(r"switch \(dtype\)", text)]
    assert switches, f"no dtype switch in {source}"
    for at in switches:
        cases = _switch_cases(text[at:text.index("default", at)] + "default:")
        for dtype, cuda_type in CUDA_TYPES.items():
            assert f"<{cuda_type}>" in cases[DTYPE_IDS[dtype]], (source, dtype, cases)


def test_tables_are_one_fact():
    """The launchers' tables are the one table (views of it), not copies that could drift."""
    from mxtrain.kernels import activation_cast, cuda_cast, float8_cast, gated_activation
    assert activation_cast.ACTIVATION_IDS is ACTIVATION_IDS
    assert float8_cast.FUSED_ACTIVATIONS is PLAIN_ACTIVATION_IDS and cuda_cast.CUDA_ACTIVATIONS is PLAIN_ACTIVATION_IDS
    assert all(float8_cast.FUSED_ACTIVATION_GRADS[n] == ACTIVATION_IDS[n] for n in float8_cast.FUSED_ACTIVATION_GRADS)
    assert cuda_cast._DTYPES is DTYPE_IDS
    assert gated_activation.GATE_IDS == {g: ACTIVATION_IDS[p] for g, p in GATE_ACTIVATION.items()}
    assert gate_activation_id("swiglu") == ACTIVATION_IDS["silu"]
    from mxtrain.formats import ELEMENT_FORMATS
    from mxtrain.quantization.float8 import FP8_MAX
    assert FP8_MAX == {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
    assert all(FP8_MAX[n] == ELEMENT_FORMATS[n].max_norm for n in FP8_MAX) and cuda_cast.FP8_MAX is FP8_MAX
