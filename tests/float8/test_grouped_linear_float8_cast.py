"""GroupedLinear under per-tensor FP8 with the grouped cast (one amax pass and one cast launch over all experts
for the input, the grad-output and the stacked weights): bit for bit a loop of per-expert mxtrain.Linear
(Triton interpreter on CPU: MXTRAIN_BACKEND=triton; on a GPU with per-expert GEMMs, MXTRAIN_GROUPED_MM=0),
and the per-expert casts where the kernel does not run."""

import importlib
import os

import pytest
import torch

import mxtrain
from mxtrain.kernels import registry

pytest.importorskip("triton", reason="triton is not installed")
gl_module = importlib.import_module("mxtrain.modules.grouped_linear")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cpu") if INTERPRET else torch.device("cuda")


@pytest.fixture
def kernels_here(mx_config):
    """The grouped cast runs: the interpreter under MXTRAIN_BACKEND=triton on CPU; on a GPU as it is, with
    per-expert GEMMs (the grouped FP8 GEMM rounds otherwise than the loop's per-expert ones)."""
    if INTERPRET:
        mx_config(backend="triton", grouped_fp8_casts=True)
    else:
        mx_config(grouped_mm="0", grouped_fp8_casts=True)

RECIPES = {
    "fp8_current": lambda: mxtrain.Float8CurrentScaling(),
    "fp8_current_e4m3_pow2": lambda: mxtrain.Float8CurrentScaling(fp8_format="e4m3", power_of_2_scales=True),
    "fp8_delayed": lambda: mxtrain.DelayedScaling(amax_history_len=4),
}


def _pair(num, in_f, out_f, bias, dtype):
    torch.manual_seed(0)
    grouped = mxtrain.GroupedLinear(num, in_f, out_f, bias=bias).to(DEVICE, dtype)
    linears = [mxtrain.Linear(in_f, out_f, bias=bias).to(DEVICE, dtype) for _ in range(num)]
    with torch.no_grad():
        for e, lin in enumerate(linears):
            lin.weight.copy_(getattr(grouped, f"weight{e}"))
            if bias:
                lin.bias.copy_(getattr(grouped, f"bias{e}"))
    return grouped, linears


@pytest.fixture
def grouped_casts(monkeypatch):
    """The backends that ran each grouped FP8 cast."""
    ran, real = [], registry.run

    def run(op, call, device, *args, **kwargs):
        if op == "grouped_float8_cast":
            ran.append((registry.select(op, call, device, *args, **kwargs).backend, tuple(call.x.shape)))
        return real(op, call, device, *args, **kwargs)

    monkeypatch.setattr(registry, "run", run)
    return ran


def _step(grouped, linears, recipe, splits, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(splits)
    x = (torch.randn(tokens, grouped.in_features, generator=g) * 3).to(DEVICE, dtype)
    x[:splits[0]] *= 1e-3  # experts of very different amaxes: one shared scale would give other codes
    dy = torch.randn(tokens, grouped.out_features, generator=g).to(DEVICE, dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with mxtrain.mx_autocast(recipe=recipe):
        y1 = grouped(x1, splits)
        y2 = torch.cat([lin(xe) for lin, xe in zip(linears, x2.split(splits))])
    y1.backward(dy)
    y2.backward(dy)
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    for e, lin in enumerate(linears):
        for name in ("weight", "bias"):
            ref = getattr(lin, name)
            if ref is not None:
                want = ref.grad if ref.grad is not None else torch.zeros_like(ref)
                got = getattr(grouped, f"{name}{e}").grad
                if name == "bias":  # where Triton runs mxtrain.Linear sums the bias gradient inside its fused
                    # cast of dy (tile by tile), GroupedLinear over the tokens: another summation order
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                else:
                    assert torch.equal(got, want), f"{name}{e}"
    for p in [*grouped.parameters(), *(q for lin in linears for q in lin.parameters())]:
        p.grad = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_grouped_cast_matches_loop_of_linears(kernels_here, grouped_casts, recipe, dtype):
    recipe, splits = RECIPES[recipe](), [11, 0, 37, 5]
    grouped, linears = _pair(len(splits), 40, 24, True, dtype)
    steps = 3 if recipe.short_name == "fp8_delayed" else 1
    for step in range(steps):
        _step(grouped, linears, recipe, splits, dtype, seed=step)
    # every step: x, the weights, dy in one grouped cast each (DelayedScaling: from its second step on, when
    # every expert's slots have a history; its first step casts each expert alone, as the loop does)
    grouped_steps = steps - 1 if recipe.short_name == "fp8_delayed" else steps
    assert grouped_casts == [("triton", (53, 40)), ("triton", (96, 40)), ("triton", (53, 24))] * grouped_steps
    if recipe.short_name == "fp8_delayed":
        state = grouped.recipe_state
        for e, lin in enumerate(linears):
            if splits[e]:
                for tensor in ("input", "weight", "grad_output"):
                    i, j = state.slots[f"expert{e}.{tensor}"], lin.recipe_state.slots[tensor]
                    assert torch.equal(state.amax_history[:, i], lin.recipe_state.amax_history[:, j])
                    assert torch.equal(state.scale[i], lin.recipe_state.scale[j])


@pytest.mark.skipif(not INTERPRET, reason="the CPU's default walk (a GPU walks to Triton)")
def test_per_expert_casts_where_the_kernel_does_not_run(grouped_casts, mx_config):
    """The CPU's default backend walks to the reference: the grouped cast declines, each expert is cast alone."""
    grouped, linears = _pair(3, 32, 16, False, torch.float32)
    _step(grouped, linears, mxtrain.Float8CurrentScaling(), [4, 9, 0], torch.float32, seed=0)
    assert grouped_casts == []
    mx_config(backend="triton", grouped_fp8_casts=True, fp8_fused_casts=False)  # MXTRAIN_FP8_FUSED_CASTS=0: the unfused per-expert casts
    _step(grouped, linears, mxtrain.Float8CurrentScaling(), [4, 9, 0], torch.float32, seed=1)
    assert grouped_casts == []


def test_weight_cast_cache_keeps_serving_the_weights(kernels_here, grouped_casts):
    """Inside weight_cast_cache the weights are cast per expert through its cache (reused across microbatches);
    x and dy are still cast in one launch each."""
    grouped, linears = _pair(2, 32, 16, False, torch.float32)
    with mxtrain.weight_cast_cache():
        _step(grouped, linears, mxtrain.Float8CurrentScaling(), [7, 9], torch.float32, seed=0)
    assert grouped_casts == [("triton", (16, 32)), ("triton", (16, 16))]


def _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_grouped_mm's contract on the CPU: its own argument checks (run on meta copies of the
    arguments, strides kept), then the row-wise-scaled products of each group in fp32, rounded to bf16."""
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (a, b, scale_a, scale_b,
                                                                                              offs)]
    torch._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    ends, start, outs = offs.tolist(), 0, []
    for g, end in enumerate(ends):
        if b.ndim == 3:  # 2d-3d: groups of rows of a
            outs.append((a[start:end].float() * scale_a[start:end, None]) @ (b[g].float() * scale_b[g][None, :]))
        else:  # 2d-2d: groups along the reduction axis, one [M, N] output each
            m, n = a.shape[0], b.shape[1]
            outs.append((a[:, start:end].float() * scale_a[g * m:(g + 1) * m, None])
                        @ (b[start:end].float() * scale_b[g * n:(g + 1) * n][None, :]))
        start = end
    return (torch.cat(outs) if b.ndim == 3 else torch.stack(outs)).to(out_dtype)


def test_grouped_fp8_gemm_operands(monkeypatch):
    """The operands GroupedLinear gives torch._scaled_grouped_mm (CUDA only): accepted by its checks (meta) and,
    under its contract, each expert's product of dequantized operands: fprop, dgrad and the wgrad over tokens."""
    from mxtrain.kernels.grouped_float8_cast import grouped_cast_float8

    monkeypatch.setattr(gl_module, "_scaled_grouped_mm_fn", _emulated_scaled_grouped_mm)
    monkeypatch.setattr(gl_module, "_fast_accum", lambda a_axis, b_axis: False)
    splits, num, n_out, n_in = [16, 0, 48, 32], 4, 32, 48
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(sum(splits), n_in, generator=g).bfloat16()
         * torch.tensor([1.0] * 16 + [50.0] * 80)[:, None]).to(DEVICE)
    dy = torch.randn(sum(splits), n_out, generator=g).bfloat16().to(DEVICE)
    w = torch.randn(num, n_out, n_in, generator=g).bfloat16().to(DEVICE)
    ends = torch.tensor(splits).cumsum(0).to(torch.int32).to(DEVICE)
    kw = dict(backend="triton", columnwise=True)
    xq = grouped_cast_float8(x, ends=ends, col_layout="stacked", **kw)
    dyq = grouped_cast_float8(dy, ends=ends, col_layout="stacked", **kw)
    wq = grouped_cast_float8(w, **kw)
    y = gl_module._float8_grouped_mm(xq.row, gl_module._expert_planes(wq, num, 1), xq.scale_inv, wq.scale_inv, ends,
                                     False, rows=x.shape[0])
    dx = gl_module._float8_grouped_mm(dyq.row, gl_module._expert_planes(wq, num, 0), dyq.scale_inv, wq.scale_inv,
                                      ends, False, rows=x.shape[0])
    dw = gl_module._float8_grouped_wgrad(dyq, xq, ends, num)
    start = 0
    for e, n in enumerate(splits):
        xe = xq.expert(e, start, n, (1, 0))
        de = dyq.expert(e, start, n, (1, 0))
        we = wq.expert(e, e * n_out, n_out, (1, 0))
        close = dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(y[start:start + n], (xe.dequantize(torch.float32, 1)
                                                        @ we.dequantize(torch.float32, 1).t()).bfloat16(), **close)
        torch.testing.assert_close(dx[start:start + n], (de.dequantize(torch.float32, 1)
                                                         @ we.dequantize(torch.float32, 0)).bfloat16(), **close)
        torch.testing.assert_close(dw[e].float(), de.dequantize(torch.float32, 0).t().float()
                                   @ xe.dequantize(torch.float32, 0).float() if n else torch.zeros(n_out, n_in,
                                                                                                    device=DEVICE),
                                   **close)
        start += n
