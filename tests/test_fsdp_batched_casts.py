"""The FP8 all-gathers' batched casts (``mxtrain.kernels.shard_cast``: ``shard_amaxes`` / ``shard_codes``, one
launch each for every shard): the bits of the per-weight casts, for shards with NaN, Inf, zeros and tiny values,
on the reference and on Triton (the interpreter on the CPU); the first Triton launch checked against the
reference; the switch that turns them on and the failure path. Their use inside FSDP2 is tested under torchrun
(tests/distributed/test_fsdp_fp8.py)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from mxtrain.distributed import fsdp
from mxtrain.kernels import registry, shard_cast
from mxtrain.kernels.shard_cast import shard_amaxes, shard_codes
from mxtrain.quantization.float8 import FP8_MAX, compute_scale, quantize_float8

from float8.test_float8_kernels_interpret import same_tensor


def _no_fallback(backend):
    """A Triton kernel whose first launch wrote wrong values is replaced by the reference in silence but for a
    warning: a test of the Triton backend checks that it was not."""
    if backend == "triton":
        assert registry.broken("float8_shard_amaxes") == {} and registry.broken("float8_shard_codes") == {}


def _shards():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(48, 64, generator=g) * 0.02
    b = torch.randn(16, 40, generator=g) * 300.0  # saturates after the bf16 rounding at some elements
    b[0, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    c = torch.zeros(8, 32)  # amax 0: scale 1
    d = torch.randn(8, 32, generator=g) * 1e-30  # its NaN makes the amax +Inf: scale 1, every code 0 or NaN
    d[3, 3] = float("nan")
    return [a, b, c, d]


TRITON = os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
# (device, backend): the reference anywhere; Triton on CUDA, or on the CPU under the interpreter
BACKENDS = [("cpu", "reference"),
            pytest.param("cpu", "triton", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                                                  reason="the Triton interpreter is off")),
            pytest.param("cuda", "reference", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
            pytest.param("cuda", "triton", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device, backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_batched_casts_are_the_per_weight_casts_bits(fmt, param_dtype, device, backend):
    shards = [x.to(device) for x in _shards()]
    amax = shard_amaxes(shards, backend=backend)
    eager = torch.stack([x.abs().amax() for x in shards]).float()
    assert torch.equal(amax.isnan(), eager.isnan()) and torch.equal(amax.nan_to_num(), eager.nan_to_num())
    assert amax[3].isnan() and amax[1] == float("inf") and amax[2] == 0
    # as _fp8_scales goes on: a NaN makes the amax +Inf, the amax of the weight in the param dtype
    amax = torch.nan_to_num(amax, nan=float("inf"), posinf=float("inf")).to(param_dtype).float()
    scale = compute_scale(amax, FP8_MAX[fmt])
    codes = shard_codes(shards, scale, param_dtype, fmt, backend=backend)
    kernels = fsdp._triton_float8_casts(torch.device(device), param_dtype) if device == "cuda" else None
    for x, a, q in zip(shards, amax, codes):
        # the reference quantizer of the weight in the param dtype, at the all-reduced amax's scale
        ref = quantize_float8(x.to(param_dtype), fmt, scale=compute_scale(a, FP8_MAX[fmt]), axes=1)
        same_tensor(q, ref.plane(1).data, f"{fmt} {param_dtype} shard {tuple(x.shape)}")  # any NaN code is NaN
        if kernels is not None:  # and what the per-weight gather sends on CUDA: the Triton cast given the amax
            per_weight = kernels[0](x.to(param_dtype).contiguous(), fmt, amax=a)[0]
            same_tensor(q, per_weight.planes[0].data, f"{fmt} {param_dtype} shard {tuple(x.shape)}, Triton")
    _no_fallback(backend)


@pytest.mark.parametrize("device, backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_shards_batch_as_each_alone(device, backend, dtype, monkeypatch):
    """Twenty shards of mixed sizes and scales, one with a NaN and one with an Inf: each shard's amax and codes in
    one launch are what the reference gives for it alone; programs of 128 elements in two steps, so that most
    shards take several programs, one of them ragged."""
    monkeypatch.setattr(shard_cast, "SHARD_BLOCK", (64, 2, 1))
    g = torch.Generator().manual_seed(5)
    shards = [(torch.randn(8 + 8 * (i % 5), 16 * (1 + i % 3), generator=g) * 10.0 ** (i % 7 - 3)).to(device)
              for i in range(20)]
    shards[7][1, 2] = float("nan")
    shards[11][0, 0] = float("inf")
    shards[19][-1, -1] = 1e6  # the largest value in the last element of the last shard
    shards = [x.to(dtype) for x in shards]
    amax = shard_amaxes(shards, backend=backend)
    want = torch.stack([shard_amaxes([x], backend="reference")[0] for x in shards])
    assert torch.allclose(amax, want, rtol=0, atol=0, equal_nan=True)
    amax = torch.nan_to_num(amax, nan=float("inf")).to(torch.bfloat16).float()
    scale = compute_scale(amax, FP8_MAX["fp8_e4m3"])
    codes = shard_codes(shards, scale, torch.bfloat16, "fp8_e4m3", backend=backend)
    for i, (q, x) in enumerate(zip(codes, shards)):
        ref = shard_codes([x], scale[i:i + 1], torch.bfloat16, "fp8_e4m3", backend="reference")[0]
        same_tensor(q, ref, f"shard {i} {tuple(shards[i].shape)}")
    _no_fallback(backend)


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
    """The reference's ``_rounded`` (integer round-to-nearest-even) equals ``x.to(bf16).float()``, eager and
    compiled: random bit patterns (every exponent, subnormals, NaN payloads of both signs), the largest finite
    values (which round to Inf), signed zeros and infinities."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    edge = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45,
                         float("nan"), 1.0 + 2**-8, 1.0 + 3 * 2**-8])
    x = torch.cat([bits.view(torch.float32), edge]).to(device)
    want = x.to(torch.bfloat16).float()
    for got in (shard_cast._rounded(x, torch.bfloat16), torch.compile(shard_cast._rounded)(x, torch.bfloat16)):
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert bool(same.all()), x[~same][:8]


def test_a_batch_that_fails_sends_the_gathers_to_their_own_casts(monkeypatch):
    """A batched cast that raises (here: a kernel that does not build) does not stop training: a warning, once, and
    every batched call from then on returns None (the gathers cast per weight: the same bits)."""
    monkeypatch.setattr(fsdp, "_BATCH_FAILED", [])

    def broken(*args):
        raise RuntimeError("triton: no compiler for this GPU\ndetails")

    shards = _shards()
    with pytest.warns(RuntimeWarning, match=r"the batched casts failed \(RuntimeError: triton: no compiler for this "
                                            r"GPU\); each weight is cast in its own gather"):
        assert fsdp._batched_call(broken, shards) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and no call: the working function is not run either
        assert fsdp._batched_call(shard_codes, shards, torch.ones(4), torch.bfloat16, "fp8_e4m3") is None


def test_out_of_memory_in_a_batch_raises(monkeypatch):
    monkeypatch.setattr(fsdp, "_BATCH_FAILED", [])

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        fsdp._batched_call(oom, _shards())
    assert fsdp._BATCH_FAILED == []  # not taken for a kernel failure


@pytest.mark.skipif(not TRITON, reason="no Triton device (CUDA, or the interpreter on the CPU)")
@pytest.mark.parametrize("op", ["float8_shard_amaxes", "float8_shard_codes"])
def test_a_first_launch_that_computes_wrong_falls_back_to_the_reference(op, monkeypatch):
    """The first Triton launch of each operation on a device is checked against the reference: a kernel that
    writes wrong values there (here: the real kernel, its partial maxima spoiled after it, or the codes cast at
    twice the scale) is marked unavailable, and the reference answers with the right values."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(shard_cast, "_VERIFIED", set())
    monkeypatch.setattr(registry, "_BROKEN", {})
    attr = "_shard_amax_kernel" if op == "float8_shard_amaxes" else "_shard_cast_kernel"
    real = getattr(shard_cast, attr)

    class Wrong:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if op == "float8_shard_amaxes":
                    real[grid](*args, **kwargs)
                    args[2].add_(1.0)  # the partial maxima
                else:
                    real[grid](*args[:3], args[3] * 2, *args[4:], **kwargs)  # twice the scale
            return launch

    monkeypatch.setattr(shard_cast, attr, Wrong())
    shards = [x.to(device) for x in _shards()[:3]]
    scale = torch.tensor([1.0, 0.5, 1.0], device=device)
    with pytest.warns(RuntimeWarning, match=rf"the Triton {op} kernel wrote wrong values on its first launch on "
                                            rf"{device.type}.*the reference runs from now on"):
        if op == "float8_shard_amaxes":
            got = shard_amaxes(shards, backend="triton")
        else:
            got = shard_codes(shards, scale, torch.bfloat16, "fp8_e4m3", backend="triton")
    if op == "float8_shard_amaxes":
        assert torch.equal(got.cpu(), shard_amaxes(shards, backend="reference").cpu())
    else:
        for q, ref in zip(got, shard_codes(shards, scale, torch.bfloat16, "fp8_e4m3", backend="reference")):
            same_tensor(q, ref, "after the fallback")
    assert list(registry.broken(op).values()) == [f"the Triton {op} kernel wrote wrong values on its first launch"]


def test_batchable_shards(mx_config):
    mx_config(fsdp_batched_casts="1")
    cpu, fp32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    w = torch.zeros(4, 8)
    assert fsdp._batchable([w, w[:2]], bf16, cpu)  # fp32 rounded to bf16
    assert fsdp._batchable([w.bfloat16()[:2]], bf16, cpu)  # bf16 as it is
    assert not fsdp._batchable([w, w.bfloat16()], bf16, cpu)  # one launch takes one dtype
    assert fsdp._batchable([w], fp32, cpu)
    assert not fsdp._batchable([w], torch.float16, cpu)  # fp32 masters of fp16 params: cast per weight
    assert not fsdp._batchable([w, w.bfloat16()], fp32, cpu)  # two dtypes
    assert not fsdp._batchable([], fp32, cpu)
    assert not fsdp._batchable([w, w[:0]], fp32, cpu)  # an empty shard
    assert not fsdp._batchable([w.t()], fp32, cpu)  # not contiguous
    assert not fsdp._batchable([w.reshape(-1)], fp32, cpu)  # not 2-D
    mx_config(fsdp_batched_casts="0")
    assert not fsdp._batchable([w], fp32, cpu)


def test_shard_casts_refuse_bad_arguments():
    x = torch.ones(4, 8)
    with pytest.raises(ValueError, match=r"shard_amaxes: no tensors given"):
        shard_amaxes([])
    with pytest.raises(ValueError, match=r"shard_amaxes: tensor 1 must be a float32, bfloat16 or float16 tensor, "
                                         r"got torch.int32"):
        shard_amaxes([x, x.int()])
    with pytest.raises(ValueError, match=r"every tensor must have one dtype and device; tensor 1 is torch.bfloat16"):
        shard_amaxes([x, x.bfloat16()])
    with pytest.raises(ValueError, match=r"tensor 0 must be non-empty and contiguous \(shape \(8, 4\)"):
        shard_amaxes([x.t()])
    with pytest.raises(ValueError, match=r"tensor 1 must be non-empty and contiguous \(shape \(0, 8\)"):
        shard_amaxes([x, x[:0]])
    with pytest.raises(ValueError, match=r"param_dtype must be the tensors' dtype \(torch.bfloat16\), or bfloat16 for "
                                         r"float32 tensors; got torch.float32"):
        shard_codes([x.bfloat16()], torch.ones(1), torch.float32)
    with pytest.raises(ValueError, match=r"scale must be a float32 tensor of shape \(2,\) on cpu, got torch.float32 "
                                         r"of shape \(1,\)"):
        shard_codes([x, x], torch.ones(1), torch.bfloat16)
    with pytest.raises(ValueError, match=r"unknown FP8 format 'int8'; expected 'fp8_e4m3' or 'fp8_e5m2'"):
        shard_codes([x], torch.ones(1), torch.bfloat16, "int8")
