"""Reference FP8 quantizer: scales, casts against ml_dtypes and a grid search, planes, blocks, delayed state.

The oracles here are written by hand (plain Python floats, math.frexp, loops over
blocks and steps) or come from ml_dtypes; none calls mxtrain's scale code.
"""

import math

import numpy as np
import pytest
import torch

from mxtrain.quantization.float8 import (
    FP8_MAX, DelayedScalingState, Float8Tensor, amax_from_history, compute_delayed_scale, compute_scale,
    fake_quantize_float8, quantize_float8, round_scale_down_to_power_of_2,
)
from mxtrain.recipes import DelayedScaling

from .reference import (
    F32_MAX, NP_FP8, TORCH_FP8, RefDelayed, f32, np_cast, ref_block_quantize, ref_current_scale, ref_pow2_floor,
)

FORMATS = ["fp8_e4m3", "fp8_e5m2"]


def fp8_values(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


# --- scales --------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scale_matches_hand_reference(fmt, pow2):
    amaxes = [0.0, 1e-45, 1e-40, 1e-30, 3e-3, 0.1, 1.0, 3.0, 448.0, 449.0, 1e5, 3e38, math.inf, math.nan]
    amaxes += list(np.random.default_rng(0).lognormal(0, 8, size=200).astype(np.float32))
    got = compute_scale(torch.tensor(amaxes, dtype=torch.float32), FP8_MAX[fmt], power_of_2=pow2)
    expected = [ref_current_scale(f32(a), FP8_MAX[fmt], pow2) for a in amaxes]
    assert got.tolist() == expected


def test_amax_epsilon_raises_small_amaxes():
    got = compute_scale(torch.tensor([0.0, 1e-9, 2.0]), 448.0, epsilon=1e-6)
    assert got.tolist() == [ref_current_scale(f32(a), 448.0, eps=1e-6) for a in (0.0, 1e-9, 2.0)]
    assert got[0].item() == f32(448.0 / f32(1e-6))  # a zero amax, raised to epsilon, is no longer zero


def test_round_scale_down_to_power_of_2():
    s = torch.tensor([1.0, 1.5, 3.999, 4.0, 448 / 3.1, F32_MAX, 2.0 ** -100], dtype=torch.float32)
    assert round_scale_down_to_power_of_2(s).tolist() == [ref_pow2_floor(f32(v)) for v in s.tolist()]


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("pow2", [False, True])
def test_delayed_scale_keeps_previous_on_bad_amax(margin, pow2):
    amax = torch.tensor([0.0, math.inf, math.nan, 2.5, 1e-44], dtype=torch.float32)
    prev = torch.tensor([3.0, 5.0, 7.0, 9.0, 11.0])
    got = compute_delayed_scale(amax, prev, 448.0, margin=margin, power_of_2=pow2).tolist()
    expected = []
    for a, p in zip(amax.tolist(), prev.tolist()):
        if a == 0 or not math.isfinite(a):
            expected.append(p)
            continue
        with np.errstate(over="ignore"):
            s = float(np.float32(448.0) / np.float32(a) / np.float32(2.0 ** margin))
        s = F32_MAX if math.isinf(s) else s
        expected.append(ref_pow2_floor(s) if pow2 else s)
    assert got == expected


def test_amax_from_history():
    h = torch.tensor([[1.0, 5.0], [3.0, 2.0], [2.0, 0.0]])
    assert amax_from_history(h, "max").tolist() == [3.0, 5.0]
    assert amax_from_history(h, "most_recent").tolist() == [1.0, 5.0]
    with pytest.raises(ValueError, match="amax_compute_algo"):
        amax_from_history(h, "mean")


# --- casts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_and_every_midpoint_casts_like_ml_dtypes(fmt):
    codes = torch.arange(256, dtype=torch.uint8).view(TORCH_FP8[fmt]).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2  # ties: round to even
    nudged = torch.cat([mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf))])
    beyond = torch.tensor([FP8_MAX[fmt] * 1.01, -FP8_MAX[fmt] * 1.5, 1e30, -0.0, 1e-30, -1e-30])
    x = torch.cat([finite, mids, nudged, beyond])
    q = quantize_float8(x, fmt, scale=torch.tensor(1.0))
    assert torch.equal(q.plane().data.view(torch.uint8),
                       torch.from_numpy(np_cast(x.numpy(), 1.0, fmt).astype(NP_FP8[fmt]).view(np.uint8)))
    # brute-force nearest grid point (ties to an even code) for the values inside the range
    inside = x[x.abs() <= FP8_MAX[fmt]]
    grid = finite.double()
    d = (inside.double()[:, None] - grid[None, :]).abs()
    best = d.min(1, keepdim=True).values
    cand = (d == best)
    codes_of_grid = torch.tensor([int(np.array(v, dtype=NP_FP8[fmt]).view(np.uint8)) for v in finite.tolist()])
    even = (codes_of_grid % 2 == 0)[None, :] | (cand.sum(1, keepdim=True) == 1)
    pick = (cand & even).double().argmax(1)
    got = quantize_float8(inside, fmt, scale=torch.tensor(1.0)).plane().data.float()
    assert torch.equal(got.abs(), grid[pick].float().abs())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scaling_quantize_dequantize(fmt, dtype, pow2):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(48, 80, generator=g) * torch.logspace(-3, 3, 80)).to(dtype)
    q = quantize_float8(x, fmt, axes=(1, 0), power_of_2_scales=pow2)
    amax = f32(x.float().abs().max().item())
    scale = ref_current_scale(amax, FP8_MAX[fmt], pow2)
    assert q.amax.item() == amax and isinstance(q, Float8Tensor)
    assert q.scale_inv.item() == f32(1.0 / np.float32(scale))
    expected = np_cast(x.float().numpy(), scale, fmt)
    row, col = q.plane(1), q.plane(0)
    assert row.data.dtype == TORCH_FP8[fmt] and row.data.shape == (48, 80) and col.data.shape == (80, 48)
    assert np.array_equal(fp8_values(row.data), expected)
    assert torch.equal(col.data.view(torch.uint8), row.data.t().contiguous().view(torch.uint8))
    assert col.scale_inv is row.scale_inv  # one scale for both planes, written by the same cast
    deq = q.dequantize(torch.float32, axis=1)
    assert torch.equal(deq, torch.from_numpy(expected) * q.scale_inv)
    assert torch.equal(q.dequantize(torch.float32, axis=0), deq)
    assert torch.equal(q.dequantize_blocked(torch.float32, axis=0), deq.t())
    assert q.dequantize().dtype == dtype
    assert torch.equal(fake_quantize_float8(x, fmt, power_of_2_scales=pow2), deq.to(dtype))
    assert q.only(0).planes == (col,) and q.nbytes == 2 * 48 * 80 + 4


def test_given_scale_is_used_and_amax_is_recorded():
    x = torch.tensor([[1.0, -600.0], [3.0, 0.25]])
    q = quantize_float8(x, "fp8_e4m3", scale=torch.tensor(0.5))
    assert q.plane().data.float().tolist() == [[0.5, -288.0], [1.5, 0.125]]
    assert q.scale_inv.item() == 2.0 and q.amax.item() == 600.0


def test_special_values():
    x = torch.tensor([[math.nan, 1.0, -0.0, math.inf], [-math.inf, 2.0, 0.0, -1.0]])
    q = quantize_float8(x, "fp8_e4m3", scale=torch.tensor(1.0))
    v = q.plane().data.float()
    # NaN stays NaN and +-Inf becomes NaN (non-finite values propagate: test_float8_nonfinite.py)
    assert math.isnan(v[0, 0]) and math.isnan(v[0, 3]) and math.isnan(v[1, 0])
    assert torch.signbit(v[0, 2]) and not torch.signbit(v[1, 2])
    assert q.amax.item() == math.inf  # a NaN makes the amax non-finite
    cur = quantize_float8(x, "fp8_e4m3")  # current scaling: a non-finite amax gives scale 1
    assert cur.scale_inv.item() == 1.0
    zero = quantize_float8(torch.zeros(4, 4), "fp8_e5m2")
    assert zero.scale_inv.item() == 1.0 and zero.plane().data.float().abs().sum() == 0


def test_argument_errors():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="unknown FP8 format"):
        quantize_float8(x, "fp4")
    with pytest.raises(ValueError, match="reduce over the last axis, or axis 0 of a 2-D tensor"):
        quantize_float8(torch.randn(2, 3, 4), axes=0)
    with pytest.raises(ValueError, match="block scaling needs a 2-D tensor"):
        quantize_float8(torch.randn(2, 3, 4), block=(1, 128))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_float8(torch.ones(3, dtype=torch.int32))
    assert quantize_float8(torch.randn(2, 3, 4)).plane(-1).data.shape == (2, 3, 4)


# --- blocks --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (1, 129)])
@pytest.mark.parametrize("pow2", [True, False])
def test_1x128_blocks_each_plane_along_its_reduction_axis(shape, pow2):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[1])
    x[:, :128] = 0.0 if shape[1] > 128 else x[:, :128]  # some all-zero blocks (scale 1)
    q = quantize_float8(x, "fp8_e4m3", axes=(1, 0), block=(1, 128), power_of_2_scales=pow2)
    for axis, src in ((1, x), (0, x.t())):
        p = q.plane(axis)
        vals, sinv = ref_block_quantize(src.numpy(), (1, 128), "fp8_e4m3", pow2)
        assert p.block == (1, 128) and p.scale_inv.shape == sinv.shape
        assert np.array_equal(fp8_values(p.data), vals)
        assert np.array_equal(p.scale_inv.numpy(), sinv)
        expect = torch.from_numpy(vals) * torch.from_numpy(sinv).repeat_interleave(128, 1)[:, :src.shape[1]]
        assert torch.equal(q.dequantize_blocked(torch.float32, axis), expect)
    assert q.amax is None


@pytest.mark.parametrize("shape", [(256, 256), (200, 130)])
def test_128x128_weight_blocks_and_their_transpose(shape):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g) * 0.02
    w[128:, :128] *= 1000
    q = quantize_float8(w, "fp8_e4m3", axes=(1, 0), block=(128, 128), power_of_2_scales=False)
    vals, sinv = ref_block_quantize(w.numpy(), (128, 128), "fp8_e4m3", False)
    row, col = q.plane(1), q.plane(0)
    assert np.array_equal(fp8_values(row.data), vals) and np.array_equal(row.scale_inv.numpy(), sinv)
    assert np.array_equal(fp8_values(col.data), vals.T) and np.array_equal(col.scale_inv.numpy(), sinv.T)
    assert torch.equal(q.dequantize(torch.float32, 0), q.dequantize(torch.float32, 1))


def test_block_epsilon_and_e5m2():
    x = torch.randn(4, 256) * 1e-3
    q = quantize_float8(x, "fp8_e5m2", block=(1, 128), amax_epsilon=1.0, power_of_2_scales=False)
    vals, sinv = ref_block_quantize(x.numpy(), (1, 128), "fp8_e5m2", False, eps=1.0)
    assert np.array_equal(fp8_values(q.plane().data), vals) and np.array_equal(q.plane().scale_inv.numpy(), sinv)


# --- delayed scaling state -----------------------------------------------------------------

@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len, margin, pow2", [(1, 0, False), (4, 1, False), (3, 0, True)])
def test_state_follows_hand_reference(algo, history_len, margin, pow2):
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo, margin=margin,
                            power_of_2_scales=pow2)
    state = recipe.make_state()
    rng = np.random.default_rng(4)
    refs = {"a": RefDelayed(448.0, history_len, algo, margin, pow2),
            "g": RefDelayed(57344.0, history_len, algo, margin, pow2)}
    fmts = {"a": "fp8_e4m3", "g": "fp8_e5m2"}
    for step in range(12):
        state.update(recipe)
        for ref in refs.values():
            ref.update()
        for name, ref in refs.items():
            assert state.scale_for(name, fmts[name], torch.device("cpu")).item() == f32(ref.scale), (step, name)
        for name, ref in refs.items():
            if name == "g" and step % 4 == 3:
                continue  # a step without backward: the slot keeps its history
            uses = 2 if name == "a" else 1  # two casts in a step record the max of both
            for _ in range(uses):
                amax = f32(0.0 if step == 5 else (math.inf if step == 7 else rng.lognormal(0, 3)))
                state.record(name, torch.tensor(amax))
                ref.record(amax)
    assert state.updates == 12 - 1


def test_state_dict_round_trip_and_resize():
    recipe = DelayedScaling(amax_history_len=3)
    state = recipe.make_state()
    for step in range(5):
        state.update(recipe)
        state.scale_for("x", "fp8_e4m3", torch.device("cpu"))
        state.record("x", torch.tensor(float(step + 1)))
    d = state.state_dict()
    again = DelayedScalingState.from_state_dict(d)
    assert again.state_dict().keys() == d.keys()
    for k, v in d.items():
        assert (torch.equal(v, again.state_dict()[k]) if isinstance(v, torch.Tensor)
                else v == again.state_dict()[k]), k
    state.update(recipe)
    again.update(recipe)
    assert torch.equal(state.scale, again.scale) and torch.equal(state.amax_history, again.amax_history)
    assert state.amax_history[:, 0].tolist() == [5.0, 4.0, 3.0]
    state.update(DelayedScaling(amax_history_len=5))
    assert state.amax_history[:, 0].tolist() == [5.0, 4.0, 3.0, 0.0, 0.0]
    state.update(DelayedScaling(amax_history_len=2))
    assert state.amax_history[:, 0].tolist() == [5.0, 4.0]
    with pytest.raises(ValueError, match="not a DelayedScaling state"):
        state.load_state_dict({"kind": "other"})


@pytest.mark.parametrize("layout", ["interleaved", "contiguous", "uneven"])
def test_record_many_and_scales_for_equal_one_slot_at_a_time(layout):
    """A MoE layer's experts record their amaxes and read their scales in a few strided ops
    (``record_many`` / ``scales_for``): over several steps (records before and after updates, a second record in one
    step, NaN and Inf, gradient slots) histories, scales and pending amaxes equal those of one ``record`` /
    ``scale_for`` per slot; slots not evenly spaced take the per-slot path with the same result."""
    recipe = DelayedScaling(amax_history_len=3)
    names = {"interleaved": [f"expert{e}.{t}" for e in range(4) for t in ("input", "weight", "grad_output")],
             "contiguous": [f"expert{e}.input" for e in range(4)] + [f"expert{e}.grad_output" for e in range(4)],
             "uneven": ["expert0.input", "x", "expert1.input", "expert2.input", "y", "z", "expert3.input"]}[layout]
    groups = [[n for n in names if n.startswith("expert") and n.endswith(t)] for t in ("input", "grad_output")]
    groups = [g for g in groups if g]
    one, many = DelayedScalingState(3), DelayedScalingState(3)
    for st in (one, many):
        st.ensure_slots([(n, "fp8_e5m2" if n.endswith("grad_output") else "fp8_e4m3") for n in names])
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        for rep in range(2 if step == 1 else 1):  # step 1 records twice before its update (the max is kept)
            for slots in groups:
                amax = torch.rand(len(slots), generator=g) * 10 ** step
                if step == 2:
                    amax[0], amax[-1] = float("nan"), float("inf")
                fmt = "fp8_e5m2" if slots[0].endswith("grad_output") else "fp8_e4m3"
                want = torch.stack([one.scale_for(s, fmt, torch.device("cpu")) for s in slots])
                assert torch.equal(many.scales_for(slots, fmt, torch.device("cpu")), want)
                for s, a in zip(slots, amax):
                    one.record(s, a)
                many.record_many(slots, amax.clone())
        assert torch.allclose(one.pending_amax, many.pending_amax, rtol=0, atol=0, equal_nan=True)
        assert one.recorded == many.recorded
        one.update(recipe)
        many.update(recipe)
        for name in ("amax_history", "scale"):
            assert torch.allclose(getattr(one, name), getattr(many, name), rtol=0, atol=0, equal_nan=True), name
        assert one.eager_updates == many.eager_updates and one.unseasoned() == many.unseasoned()
