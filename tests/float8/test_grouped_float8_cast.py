"""The grouped per-tensor FP8 cast (one amax pass and one cast launch over all experts) against the reference
per-expert cast, bit for bit: codes of both planes, scale_inv and amax of every expert (interpreter on CPU,
compiled on a GPU). Shapes stay small: the interpreter is slow."""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from mxtrain.kernels import grouped_float8_cast as gfc  # noqa: E402
from mxtrain.kernels import registry  # noqa: E402
from mxtrain.quantization.float8 import quantize_float8  # noqa: E402

DEVICE = torch.device("cpu") if os.environ.get("TRITON_INTERPRET", "0") == "1" else torch.device("cuda")


def _codes(t):
    # any NaN code stands for NaN (GPU arithmetic does not keep the sign of a NaN)
    nan = torch.isnan(t.float())
    return torch.where(nan, torch.tensor(0x7F, dtype=torch.uint8, device=t.device), t.view(torch.uint8)).cpu()


def _bits(t):
    return t.float().contiguous().view(torch.int32).cpu()


def _source(rows, cols, dtype, seed, nonfinite=False):
    g = torch.Generator().manual_seed(seed)
    # per-row magnitudes over 12 decades: every expert gets its own amax, and small rows go subnormal
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, rows)[torch.randperm(rows, generator=g)][:, None]
    if nonfinite and rows > 8:
        x[3, 1] = float("nan")
        x[rows - 2, 0] = float("inf")
        x[rows - 1, cols - 1] = -float("inf")
    return x.to(dtype)


def _check_against_reference(x, splits, q, fmt, axes, scale=None, pow2=False, eps=0.0, what=""):
    K = x.shape[1]
    start = 0
    for e, n in enumerate(splits):
        seg = x[start:start + n]
        want = quantize_float8(seg, fmt, axes=axes, scale=None if scale is None else scale[e], power_of_2_scales=pow2,
                               amax_epsilon=eps)
        got = q.expert(e, start, n, axes)
        assert torch.equal(_bits(got.scale_inv), _bits(want.scale_inv)), f"{what} expert {e} scale_inv"
        assert torch.equal(_bits(got.amax), _bits(want.amax)), f"{what} expert {e} amax"
        for a in axes:
            pg, pw = got.plane(a), want.plane(a)
            assert pg.data.dtype == pw.data.dtype and pg.data.shape == pw.data.shape == ((n, K) if a else (K, n))
            assert torch.equal(_codes(pg.data), _codes(pw.data)), f"{what} expert {e} axis {a} codes"
        start += n


def _ends(splits):
    return torch.tensor(splits, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)


def _run(x, **kw):
    return gfc.grouped_cast_float8(x.to(DEVICE), backend="triton", **kw)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_current_scaling_ragged_with_empty_experts(fmt, dtype):
    splits = [0, 37, 5, 0, 70, 1]  # 113 rows: tiles straddle experts, two experts empty, odd K
    x = _source(sum(splits), 67, dtype, seed=1, nonfinite=True)
    q = _run(x, fmt=fmt, ends=_ends(splits), columnwise=True)
    assert registry.select("grouped_float8_cast", gfc.GroupedFloat8CastCall(
        x.to(DEVICE), _ends(splits), None, len(splits), fmt, True, True, "expert", None, False, 0.0, None),
        DEVICE, "triton" if DEVICE.type == "cpu" else None).backend == "triton"
    _check_against_reference(x, splits, q, fmt, (1, 0), what=f"{fmt} {dtype}")
    for e in (0, 3):  # an expert without rows: amax 0, scale 1, as the reference cast of an empty tensor
        assert q.amax[e].item() == 0.0 and q.scale_inv[e].item() == 1.0


@pytest.mark.parametrize("pow2,eps", [(True, 0.0), (False, 1e-2)])
def test_current_scaling_options_and_one_plane(pow2, eps):
    splits = [20, 0, 33]
    x = _source(sum(splits), 40, torch.bfloat16, seed=2)
    x[:20] *= 1e-9  # expert 0's amax below the epsilon
    for axes, kw in (((1,), dict(rowwise=True)), ((0,), dict(rowwise=False, columnwise=True))):
        q = _run(x, fmt="fp8_e4m3", ends=_ends(splits), power_of_2_scales=pow2, amax_epsilon=eps, **kw)
        assert (q.row is None) == (1 not in axes) and (q.col is None) == (0 not in axes)
        _check_against_reference(x, splits, q, "fp8_e4m3", axes, pow2=pow2, eps=eps, what=f"axes {axes}")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_delayed_scaling_given_scales_record_amax(fmt):
    splits = [9, 0, 50, 4]
    x = _source(sum(splits), 33, torch.float32, seed=3, nonfinite=True)
    # a strided view, as the per-expert slots of a DelayedScalingState lie
    scale = torch.tensor([[0.5, 9.0], [3.0, 9.0], [2.0 ** 20, 9.0], [1e-3, 9.0]])[:, 0]
    q = _run(x, fmt=fmt, ends=_ends(splits), columnwise=True, scale=scale.to(DEVICE))
    _check_against_reference(x, splits, q, fmt, (1, 0), scale=scale, what="delayed")
    assert q.amax[1].item() == 0.0 and q.scale_inv[1].item() == torch.tensor(3.0).reciprocal().item()


@pytest.mark.parametrize("delayed", [False, True])
def test_stacked_weights_and_stacked_column_layout(delayed):
    E, N, K = 3, 24, 40
    w = _source(E * N, K, torch.bfloat16, seed=4).view(E, N, K)
    scale = torch.tensor([4.0, 0.25, 1.0]) if delayed else None
    q = _run(w, fmt="fp8_e4m3", columnwise=True, scale=None if scale is None else scale.to(DEVICE))
    _check_against_reference(w.view(-1, K), [N] * E, q, "fp8_e4m3", (1, 0), scale=scale, what="weights")
    # the [K, T] transpose of the whole tensor: each expert's columns are its columnwise plane
    splits = [7, 0, 41, 24]
    x = _source(sum(splits), K, torch.float32, seed=5)
    q = _run(x, fmt="fp8_e5m2", ends=_ends(splits), columnwise=True, col_layout="stacked")
    assert q.col.shape == (K, sum(splits))
    _check_against_reference(x, splits, q, "fp8_e5m2", (1, 0), what="stacked")


def test_all_rows_in_one_expert_and_one_expert():
    x = _source(19, 16, torch.bfloat16, seed=6)
    for splits in ([0, 0, 19], [19]):
        q = _run(x, fmt="fp8_e4m3", ends=_ends(splits), columnwise=True)
        _check_against_reference(x, splits, q, "fp8_e4m3", (1, 0), what=str(splits))


def test_reference_implementation_matches_and_bad_arguments_raise():
    splits = [5, 0, 12]
    x = _source(17, 24, torch.float32, seed=7)
    q = gfc.grouped_cast_float8(x, "fp8_e4m3", ends=_ends(splits).cpu(), columnwise=True, backend="reference")
    _check_against_reference(x, splits, q, "fp8_e4m3", (1, 0), what="reference")
    with pytest.raises(ValueError, match="ends= .* or rows_per_expert="):
        gfc.grouped_cast_float8(x, "fp8_e4m3", num_experts=3)
    with pytest.raises(ValueError, match="int32/int64 tensor of 3 segment ends"):
        gfc.grouped_cast_float8(x, "fp8_e4m3", ends=torch.tensor([5.0, 5.0, 17.0]))
    with pytest.raises(ValueError, match="4 experts of 5 rows are not the 17 rows"):
        gfc.grouped_cast_float8(x, "fp8_e4m3", rows_per_expert=5, num_experts=4)
    with pytest.raises(ValueError, match="col_layout must be one of"):
        gfc.grouped_cast_float8(x, "fp8_e4m3", ends=_ends(splits).cpu(), columnwise=True, col_layout="rows")
    with pytest.raises(ValueError, match="2-D fp32/bf16/fp16"):
        gfc.grouped_cast_float8(x.double(), "fp8_e4m3", ends=_ends(splits).cpu())


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_of_multiples_of_16_one_expert_a_tile(delayed, dtype):
    """``segment_multiple=16`` (16-row tiles, each in one expert, 16-byte transposed stores): bit for bit the
    reference, empty experts and a ragged K included; stacked weights of 32 rows take the same path."""
    splits = [0, 48, 16, 0, 80, 32]
    K = 67
    x = _source(sum(splits), K, dtype, seed=8, nonfinite=True)
    scale = torch.tensor([0.5, 3.0, 2.0 ** 10, 1.0, 1e-2, 7.0]) if delayed else None
    q = _run(x, fmt="fp8_e4m3", ends=_ends(splits), columnwise=True, segment_multiple=16,
             scale=None if scale is None else scale.to(DEVICE))
    _check_against_reference(x, splits, q, "fp8_e4m3", (1, 0), scale=scale, what="seg16")
    w = _source(3 * 32, 40, dtype, seed=9).view(3, 32, 40)
    q = _run(w, fmt="fp8_e5m2", columnwise=True)
    _check_against_reference(w.view(-1, 40), [32] * 3, q, "fp8_e5m2", (1, 0), what="seg16 weights")


def test_segment_multiple_is_checked_where_it_can_be():
    x = _source(48, 16, torch.float32, seed=10)
    with pytest.raises(ValueError, match=r"segments of \[16, 32, 0\] rows, not all multiples of segment_multiple=32"):
        gfc.grouped_cast_float8(x, "fp8_e4m3", ends=_ends([16, 32, 0]).cpu(), segment_multiple=32, backend="reference")
    with pytest.raises(ValueError, match="segments of 16 rows are not multiples of segment_multiple=32"):
        gfc.grouped_cast_float8(x.view(3, 16, 16), "fp8_e4m3", segment_multiple=32)
    with pytest.raises(ValueError, match="segment_multiple must be a positive int"):
        gfc.grouped_cast_float8(x, "fp8_e4m3", ends=_ends([48]).cpu(), segment_multiple=0)


def _row_maxima(x, pieces):
    """Max |x| over ``pieces`` column pieces of each row ([rows, pieces] fp32, NaN as +Inf), as a kernel that
    wrote ``x`` records them (mxtrain.modules.amax_hints)."""
    a = torch.where(torch.isnan(x), torch.tensor(float("inf")), x.float().abs())
    return torch.stack([p.amax(1) if p.shape[1] else torch.zeros(x.shape[0]) for p in a.tensor_split(pieces, 1)], 1)


@pytest.mark.parametrize("multiple,splits", [(16, [0, 48, 16, 0, 80, 32]), (32, [64, 0, 32, 96]),
                                             (64, [64, 128, 0]), (1, [0, 37, 5, 70])])
def test_recorded_row_maxima_replace_the_amax_pass(multiple, splits):
    """``row_amax``: the experts' amaxes reduced from recorded row maxima: bit for bit the reference (which reads
    ``x``), for each segment multiple's tile (16-, 32-, 64-row tiles; ragged), non-finite values included."""
    x = _source(sum(splits), 67, torch.bfloat16, seed=11, nonfinite=True)
    maxima = _row_maxima(x, 3)
    q = _run(x, fmt="fp8_e5m2", ends=_ends(splits), columnwise=True, segment_multiple=multiple,
             row_amax=maxima.to(DEVICE))
    _check_against_reference(x, splits, q, "fp8_e5m2", (1, 0), what=f"row_amax, multiple {multiple}")
    w = _source(2 * 64, 40, torch.float32, seed=12)
    q = _run(w.view(2, 64, 40), fmt="fp8_e4m3", columnwise=True, row_amax=_row_maxima(w, 1).to(DEVICE))
    _check_against_reference(w, [64, 64], q, "fp8_e4m3", (1, 0), what="row_amax, weights")


def test_recorded_row_maxima_are_trusted_and_checked():
    """The kernel takes the maxima on trust (they are the scales' source: twice the true maxima give each expert
    the scale of twice its amax), and refuses maxima of the wrong shape, dtype, device, or beside a given scale."""
    from mxtrain.quantization.float8 import FP8_MAX
    splits = [32, 16]
    x = _source(48, 24, torch.float32, seed=13)
    doubled = _row_maxima(x, 2) * 2
    q = _run(x, fmt="fp8_e4m3", ends=_ends(splits), segment_multiple=16, row_amax=doubled.to(DEVICE))
    for e, (a, b) in enumerate(((0, 32), (32, 48))):
        assert torch.equal(_bits(q.amax[e]), _bits(doubled[a:b].amax()))
        want = quantize_float8(x[a:b], "fp8_e4m3", scale=FP8_MAX["fp8_e4m3"] / doubled[a:b].amax())
        assert torch.equal(_codes(q.expert(e, a, b - a).plane(1).data), _codes(want.plane(1).data))
    with pytest.raises(ValueError, match=r"row_amax must be a float32 \[48, P\] tensor"):
        _run(x, ends=_ends(splits), row_amax=torch.zeros(47, 2, device=DEVICE))
    with pytest.raises(ValueError, match=r"row_amax must be a float32 \[48, P\] tensor"):
        _run(x, ends=_ends(splits), row_amax=torch.zeros(48, 2, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="row_amax serves current scaling"):
        _run(x, ends=_ends(splits), row_amax=doubled.to(DEVICE), scale=torch.ones(2, device=DEVICE))


@pytest.mark.parametrize("layout", ["expert", "stacked"])
def test_experts_hands_out_what_expert_does(layout):
    """``experts(splits, axes)``: every expert's planes at once, equal to ``expert()`` one by one (None for an expert
    without rows), for both columnwise layouts."""
    splits = [16, 0, 48, 32]
    x = _source(sum(splits), 40, torch.bfloat16, seed=14)
    q = _run(x, fmt="fp8_e4m3", ends=_ends(splits), columnwise=True, col_layout=layout, segment_multiple=16)
    got = q.experts(splits, (1, 0))
    start = 0
    for e, n in enumerate(splits):
        if n == 0:
            assert got[e] is None
            continue
        for a in (1, 0):
            one, want = got[e][a], q.expert(e, start, n, (a,))
            assert [p.axis for p in one.planes] == [a] and one.shape == want.shape == (n, 40)
            assert torch.equal(_codes(one.plane(a).data), _codes(want.plane(a).data))
            assert torch.equal(_bits(one.scale_inv), _bits(want.scale_inv))
            assert torch.equal(_bits(one.amax), _bits(want.amax))
        start += n


@pytest.mark.parametrize("rows,experts", [(16, 3), (32, 2), (64, 3), (96, 1), (128, 2)])
@pytest.mark.parametrize("delayed", [False, True])
def test_uniform_segments_of_16_multiples_every_tile(rows, experts, delayed):
    """Stacked weights whose rows per expert are multiples of 16 (the 16-, 32- and 64-row tiles, each in one expert,
    the expert taken from the tile's row): bit for bit the reference, both planes and the stacked column layout,
    K not a multiple of the tile width."""
    K = 72
    w = _source(experts * rows, K, torch.bfloat16, seed=rows).view(experts, rows, K)
    scale = torch.tensor([4.0, 0.25, 1.0])[:experts] if delayed else None
    q = _run(w, fmt="fp8_e4m3", columnwise=True, scale=None if scale is None else scale.to(DEVICE),
             segment_multiple=rows)
    _check_against_reference(w.view(-1, K), [rows] * experts, q, "fp8_e4m3", (1, 0), scale=scale, what="uniform")
    stacked = _run(w, fmt="fp8_e4m3", columnwise=True, col_layout="stacked", segment_multiple=rows,
                   scale=None if scale is None else scale.to(DEVICE))
    assert torch.equal(stacked.col.view(torch.uint8).cpu(),
                       q.row.view(torch.uint8).cpu().t())  # the [K, T] transpose of the rowwise codes
