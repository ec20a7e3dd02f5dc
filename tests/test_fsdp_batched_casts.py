"""The FP8 all-gathers' batched casts (``mxtrain.distributed.fsdp._shard_amaxes`` / ``_shard_codes`` under
``torch.compile``): the bits of the per-weight casts, for shards with NaN, Inf, zeros and tiny values, and the
switch that turns them on. Their use inside FSDP2 is tested under torchrun (tests/distributed/test_fsdp_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from mxtrain.distributed import fsdp
from mxtrain.quantization.float8 import FP8_MAX, compute_scale, quantize_float8

from float8.test_float8_kernels_interpret import same_tensor


def _shards():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(48, 64, generator=g) * 0.02
    b = torch.randn(16, 40, generator=g) * 300.0  # saturates after the bf16 rounding at some elements
    b[0, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    c = torch.zeros(8, 32)  # amax 0: scale 1
    d = torch.randn(8, 32, generator=g) * 1e-30  # its NaN makes the amax +Inf: scale 1, every code 0 or NaN
    d[3, 3] = float("nan")
    return [a, b, c, d]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_compiled_batched_casts_are_the_per_weight_casts_bits(fmt, param_dtype, device):
    shards = [x.to(device) for x in _shards()]
    amax = fsdp._batched_call(fsdp._shard_amaxes, shards)
    eager = fsdp._shard_amaxes(shards)
    assert torch.equal(amax.isnan(), eager.isnan()) and torch.equal(amax.nan_to_num(), eager.nan_to_num())
    assert amax[3].isnan() and amax[1] == float("inf") and amax[2] == 0
    # as _fp8_scales goes on: a NaN makes the amax +Inf, the amax of the weight in the param dtype
    amax = torch.nan_to_num(amax, nan=float("inf"), posinf=float("inf")).to(param_dtype).float()
    scale = compute_scale(amax, FP8_MAX[fmt])
    codes = fsdp._batched_call(fsdp._shard_codes, shards, scale, param_dtype, fmt)
    kernels = fsdp._triton_float8_casts(torch.device(device), param_dtype) if device == "cuda" else None
    for x, a, q in zip(shards, amax, codes):
        # the reference quantizer of the weight in the param dtype, at the all-reduced amax's scale
        ref = quantize_float8(x.to(param_dtype), fmt, scale=compute_scale(a, FP8_MAX[fmt]), axes=1)
        same_tensor(q, ref.plane(1).data, f"{fmt} {param_dtype} shard {tuple(x.shape)}")  # any NaN code is NaN
        if kernels is not None:  # and what the per-weight gather sends on CUDA: the Triton cast given the amax
            per_weight = kernels[0](x.to(param_dtype).contiguous(), fmt, amax=a)[0]
            same_tensor(q, per_weight.planes[0].data, f"{fmt} {param_dtype} shard {tuple(x.shape)}, Triton")


@pytest.mark.parametrize("device", DEVICES)
def test_many_shards_batch_as_each_alone(device):
    """Forty shards of mixed sizes and scales, one with a NaN and one with an Inf: each shard's amax and codes in
    the compiled batch are what the uncompiled functions give for it."""
    g = torch.Generator().manual_seed(5)
    shards = [(torch.randn(8 + 8 * (i % 5), 16 * (1 + i % 3), generator=g) * 10.0 ** (i % 7 - 3)).to(device)
              for i in range(40)]
    shards[7][1, 2] = float("nan")
    shards[11][0, 0] = float("inf")
    amax = fsdp._batched_call(fsdp._shard_amaxes, shards)
    want = fsdp._shard_amaxes(shards)
    assert torch.allclose(amax, want, rtol=0, atol=0, equal_nan=True)
    amax = torch.nan_to_num(amax, nan=float("inf")).to(torch.bfloat16).float()
    scale = compute_scale(amax, FP8_MAX["fp8_e4m3"])
    codes = fsdp._batched_call(fsdp._shard_codes, shards, scale, torch.bfloat16, "fp8_e4m3")
    for i, (q, ref) in enumerate(zip(codes, fsdp._shard_codes(shards, scale, torch.bfloat16, "fp8_e4m3"))):
        same_tensor(q, ref, f"shard {i} {tuple(shards[i].shape)}")


@pytest.mark.parametrize("mode, device, on", [("auto", "cpu", False), ("auto", "cuda", True), ("1", "cpu", True),
                                              ("0", "cuda", False)])
def test_batched_casts_switch(mx_config, mode, device, on):
    mx_config(fsdp_batched_casts=mode)
    assert fsdp._batched_casts(torch.device(device)) is on


def test_batched_casts_switch_refuses_other_values():
    from mxtrain import config

    with pytest.raises(ValueError, match="MXTRAIN_FSDP_BATCHED_CASTS='yes' is not allowed; allowed: auto, 0, 1"):
        config.from_environ({"MXTRAIN_FSDP_BATCHED_CASTS": "yes"})


@pytest.mark.parametrize("device", DEVICES)
def test_rounded_to_bf16_is_torch_rounding_on_every_bit_pattern_class(device):
    """``_rounded`` (integer round-to-nearest-even, kept by inductor) equals ``x.to(bf16).float()`` eager and
    compiled: random bit patterns (every exponent, subnormals, NaN payloads of both signs), the largest finite
    values (which round to Inf), signed zeros and infinities."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    edge = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45,
                         float("nan"), 1.0 + 2**-8, 1.0 + 3 * 2**-8])
    x = torch.cat([bits.view(torch.float32), edge]).to(device)
    want = x.to(torch.bfloat16).float()
    for got in (fsdp._rounded(x, torch.bfloat16), torch.compile(fsdp._rounded)(x, torch.bfloat16)):
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert bool(same.all()), x[~same][:8]


def test_a_batch_that_fails_to_compile_sends_the_gathers_to_their_own_casts(monkeypatch):
    """A compiler failure (here: every compiled function raises) does not stop training: a warning, once, and
    every batched call from then on returns None (the gathers cast per weight: the same bits)."""
    monkeypatch.setattr(fsdp, "_BATCH_FAILED", [])

    def broken(fn, signature):
        def call(*args):
            raise RuntimeError("inductor: no C++ compiler found\ndetails")
        return call

    monkeypatch.setattr(fsdp, "_compiled", broken)
    shards = _shards()
    with pytest.warns(RuntimeWarning, match=r"batched casts could not be compiled \(RuntimeError: inductor: no C\+\+ "
                                            r"compiler found\); each weight is cast in its own gather"):
        assert fsdp._batched_call(fsdp._shard_amaxes, shards) is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert fsdp._batched_call(fsdp._shard_codes, shards, torch.ones(4), torch.bfloat16, "fp8_e4m3") is None


def test_out_of_memory_in_a_batch_raises(monkeypatch):
    monkeypatch.setattr(fsdp, "_BATCH_FAILED", [])

    def oom(fn, signature):
        def call(*args):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return call

    monkeypatch.setattr(fsdp, "_compiled", oom)
    with pytest.raises(torch.OutOfMemoryError):
        fsdp._batched_call(fsdp._shard_amaxes, _shards())
    assert fsdp._BATCH_FAILED == []  # not taken for a compiler failure


def test_each_signature_compiles_its_own_copy_past_dynamos_limit():
    """Ten shapes of shard lists: each signature compiles a copy of the function (its own dynamo cache), so
    none reaches dynamo's limit of 8 graphs a function (a fullgraph compile past it raises)."""
    before = len(fsdp._COMPILED_COPIES)
    for n in range(1, 11):
        shards = [torch.full((n, 4), float(n))]
        assert fsdp._batched_call(fsdp._shard_amaxes, shards).tolist() == [float(n)]
    assert fsdp._BATCH_FAILED == []
    assert len(fsdp._COMPILED_COPIES) - before == 10
    assert fsdp._batched_call(fsdp._shard_amaxes, [torch.full((3, 4), 3.0)]).tolist() == [3.0]  # compiled already
    assert len(fsdp._COMPILED_COPIES) - before == 10


def test_batchable_shards(mx_config):
    mx_config(fsdp_batched_casts="1")
    cpu, fp32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    w = torch.zeros(4, 8)
    assert fsdp._batchable([w, w.bfloat16()[:2]], bf16, cpu)  # fp32 rounded to bf16; bf16 as it is
    assert fsdp._batchable([w], fp32, cpu)
    assert not fsdp._batchable([w], torch.float16, cpu)  # a rounding inductor may drop: cast per weight
    assert not fsdp._batchable([w, w[:0]], fp32, cpu)  # an empty shard
    assert not fsdp._batchable([w.t()], fp32, cpu)  # not contiguous
    assert not fsdp._batchable([w.reshape(-1)], fp32, cpu)  # not 2-D
    mx_config(fsdp_batched_casts="0")
    assert not fsdp._batchable([w], fp32, cpu)
