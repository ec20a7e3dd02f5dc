"""The one-kernel DelayedScaling update (mxtrain.kernels.float8_state) against the torch ops it replaces.

Runs in Triton's interpreter on CPU tensors (and compiled on a GPU): two states see the same
recorded amaxes (zeros, +Inf, tiny and huge values, slots skipped some steps); one updates
with torch ops, the other with the kernel. Histories, scales and pending amaxes must be
bit-identical after every step.
"""

import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from mxtrain.kernels.float8_state import fused_delayed_update  # noqa: E402
from mxtrain.quantization import float8 as f8  # noqa: E402
from mxtrain.recipes import DelayedScaling  # noqa: E402

DEVICE = torch.device("cpu") if os.environ.get("TRITON_INTERPRET", "0") == "1" else torch.device("cuda")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len, margin, pow2", [(1, 0, False), (4, 1, False), (16, 0, True), (5, 3, True)])
def test_fused_update_is_bit_identical(algo, history_len, margin, pow2, monkeypatch):
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo, margin=margin,
                            power_of_2_scales=pow2)
    torch_state, fused_state = recipe.make_state(), recipe.make_state()
    rng = np.random.default_rng(7)
    slots = {"fc1.input": "fp8_e4m3", "fc1.weight": "fp8_e4m3", "fc1.grad_output": "fp8_e5m2",
             "fc2.input": "fp8_e4m3", "fc2.grad_output": "fp8_e5m2"}
    for step in range(14):
        torch_state.update(recipe)
        monkeypatch.setitem(f8._FUSED_DELAYED_UPDATES, DEVICE.type, fused_delayed_update)
        fused_state.update(recipe)
        monkeypatch.delitem(f8._FUSED_DELAYED_UPDATES, DEVICE.type)
        for name in ("amax_history", "scale", "pending_amax"):
            a, b = getattr(torch_state, name), getattr(fused_state, name)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (step, name, a, b)
        assert torch_state.updates == fused_state.updates and torch_state.recorded == fused_state.recorded
        for name, fmt in slots.items():
            if name.endswith("grad_output") and step % 5 == 4:
                continue  # a step without backward: those slots are not recorded
            amax = {3: 0.0, 6: math.inf, 9: 1e-39}.get(step, float(rng.lognormal(0, 8)))
            for state in (torch_state, fused_state):
                state.scale_for(name, fmt, DEVICE)
                state.record(name, torch.tensor(amax, device=DEVICE))
    assert fused_state.updates == 13 and (fused_state.scale != 1).any()
