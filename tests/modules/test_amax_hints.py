"""Recorded row maxima (mxtrain.modules.amax_hints): bound to one tensor and its version; GroupedLinear's per-tensor
FP8 casts of a tensor with recorded maxima skip their amax pass, with the same bits as without."""

import importlib
import os

import pytest
import torch

import mxtrain
from mxtrain.modules.amax_hints import record_row_maxima, row_maxima

gl_module = importlib.import_module("mxtrain.modules.grouped_linear")


def _maxima(t, pieces=2):
    a = torch.where(torch.isnan(t), torch.tensor(float("inf")), t.detach().float().abs())
    return torch.stack([p.amax(1) for p in a.tensor_split(pieces, 1)], 1)


def test_a_record_is_bound_to_the_tensor_and_its_version():
    t = torch.randn(6, 8)
    assert row_maxima(t) is None
    m = _maxima(t)
    record_row_maxima(t, m)
    assert row_maxima(t) is m
    assert row_maxima(t.view(6, 8)) is None and row_maxima(t.clone()) is None  # another tensor: none
    t.view(-1)[0] += 1  # an in-place change (through a view) drops it
    assert row_maxima(t) is None
    record_row_maxima(t, _maxima(t))
    with torch.no_grad():
        t.mul_(2)
    assert row_maxima(t) is None


def test_records_die_with_their_tensor_and_bad_maxima_are_refused():
    import gc
    from mxtrain.modules import amax_hints

    t = torch.randn(4, 4)
    record_row_maxima(t, _maxima(t))
    n = len(amax_hints._RECORDS)
    del t
    gc.collect()
    assert len(amax_hints._RECORDS) == n - 1
    with pytest.raises(ValueError, match=r"maxima must be a float32 \[4, P\] tensor"):
        record_row_maxima(torch.randn(4, 4), torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"maxima must be a float32 \[4, P\] tensor"):
        record_row_maxima(torch.randn(4, 4), torch.zeros(4, 1, dtype=torch.float64))


class _RecordingIdentity(torch.autograd.Function):
    """The identity that records its output's row maxima, and in backward its gradient's, as mxtrain.gated_activation's
    CUDA kernels record theirs (``scale`` scales the recorded maxima: 1 records the true ones)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        y = x.clone()
        record_row_maxima(y, _maxima(y) * scale)
        return y

    @staticmethod
    def backward(ctx, g):
        d = g.clone()
        record_row_maxima(d, _maxima(d) * ctx.scale)
        return d, None


def _casts(monkeypatch):
    from mxtrain.kernels import registry
    calls, real = [], registry.run

    def counting(op, call, *a, **k):
        if op == "grouped_float8_cast":
            calls.append((tuple(call.x.shape), call.row_amax is not None))
        return real(op, call, *a, **k)
    monkeypatch.setattr(registry, "run", counting)
    return calls


def _experts(seed=0):
    torch.manual_seed(seed)
    fc1 = mxtrain.GroupedLinear(3, 32, 48, bias=False).bfloat16()
    fc2 = mxtrain.GroupedLinear(3, 48, 16, bias=False).bfloat16()
    return fc1, fc2


def _run(fc1, fc2, splits, scale, recipe=None):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(splits), 32, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), 16, generator=g).bfloat16()
    with mxtrain.mx_autocast(recipe=recipe or mxtrain.Float8CurrentScaling()):
        h = fc1(x, splits)
        y = fc2(_RecordingIdentity.apply(h, scale) if scale else h, splits)
    y.backward(dy)
    grads = [p.grad.clone() for p in (*fc1.parameters(), *fc2.parameters())]
    for p in (*fc1.parameters(), *fc2.parameters()):
        p.grad = None
    return y.detach(), x.grad, grads


def _needs_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the grouped FP8 cast runs on Triton: the CPU needs TRITON_INTERPRET=1 (CUDA: tests/gpu)")


def test_grouped_linear_casts_take_recorded_maxima_with_the_same_bits(monkeypatch, mx_config):
    """fc2's input (forward) and fc1's output gradient (backward) carry recorded maxima: their grouped casts take
    them (no amax pass over the tensor), and every output and gradient equals the run without records bit for bit."""
    _needs_interpreter()
    mx_config(backend="triton")
    splits = [16, 0, 32]
    fc1, fc2 = _experts()
    want = _run(fc1, fc2, splits, scale=None)
    calls = _casts(monkeypatch)
    got = _run(fc1, fc2, splits, scale=1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    # fc1: weights, x; fc2: weights, its input (recorded); backward: fc2's dy, then fc1's dy (recorded)
    assert calls == [((3 * 48, 32), False), ((48, 32), False), ((3 * 16, 48), False), ((48, 48), True),
                     ((48, 16), False), ((48, 48), True)]


def test_recorded_maxima_are_what_the_casts_scale_by(monkeypatch, mx_config):
    """The records are used, not recomputed: maxima recorded three times too large change the results (each
    expert's scale is a third: other roundings), where unused records would change nothing. DelayedScaling
    (scales from its history) ignores them."""
    _needs_interpreter()
    mx_config(backend="triton")
    splits = [16, 0, 32]
    fc1, fc2 = _experts()
    want = _run(fc1, fc2, splits, scale=None)
    got = _run(fc1, fc2, splits, scale=3.0)
    assert not torch.equal(got[0], want[0]) and not torch.equal(got[1], want[1])
    recipe = mxtrain.DelayedScaling()
    fc1, fc2 = _experts()
    first = [_run(fc1, fc2, splits, scale=None, recipe=recipe) for _ in range(2)]
    fc1, fc2 = _experts()
    second = [_run(fc1, fc2, splits, scale=3.0, recipe=recipe) for _ in range(2)]
    for a, b in zip(first, second):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_ragged_counts_keep_their_per_expert_casts_with_records(monkeypatch, mx_config):
    """Counts that are not multiples of 16 cast the tokens per expert (amax passes of their own), records or not:
    records three times too large change nothing, and only the weights are cast grouped."""
    _needs_interpreter()
    mx_config(backend="triton")
    fc1, fc2 = _experts()
    splits = [5, 0, 11]
    want = _run(fc1, fc2, splits, scale=None)
    calls = _casts(monkeypatch)
    got = _run(fc1, fc2, splits, scale=3.0)  # records ignored: the same bits
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert calls == [((3 * 48, 32), False), ((3 * 16, 48), False)]  # the two weights


def test_inference_tensors_get_no_records():
    """Inference tensors have no version counter: nothing is recorded for them (no error), and a lookup finds
    nothing; mxtrain.gated_activation runs under inference mode."""
    with torch.inference_mode():
        t = torch.randn(4, 6)
        record_row_maxima(t, _maxima(t))
        assert row_maxima(t) is None
        y = mxtrain.gated_activation(torch.randn(4, 6), "swiglu")
    assert y.shape == (4, 3)
