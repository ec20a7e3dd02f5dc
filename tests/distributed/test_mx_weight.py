"""In-process tests of the MX all-gather weight (no torchrun): setup, shape checks, the pack/unpack
of shards (simulated all-gather), and that the subclass behaves as its tensor everywhere else."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mxtrain
from mxtrain.distributed import (
    MXAllGatherWeight, MXGatheredWeight, check_mx_all_gather_shapes, disable_mx_all_gather, enable_mx_all_gather,
)
from mxtrain.distributed.fsdp import _GatheredState, _WeightInfo
from mxtrain.kernels.dispatch import quantize


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(mxtrain.LayerNormLinear(64, 128), nn.GELU(), mxtrain.Linear(128, 64),
                         mxtrain.LayerNormMLP(64, 128), nn.Linear(64, 64))


def test_enable_converts_only_mxtrain_gemm_weights():
    m = small_model()
    names = enable_mx_all_gather(m)
    assert names == ["0.weight", "2.weight", "3.fc1_weight", "3.fc2_weight"]
    assert isinstance(m[3].fc1_weight, nn.Parameter) and isinstance(m[3].fc1_weight, MXAllGatherWeight)
    assert type(m[4].weight) is nn.Parameter  # torch module untouched
    assert not isinstance(m[0].layer_norm_weight, MXAllGatherWeight)  # norms are not GEMM weights
    assert enable_mx_all_gather(m) == []  # idempotent
    assert disable_mx_all_gather(m) == names
    assert type(m[3].fc1_weight) is nn.Parameter


def test_shape_check_names_the_size_to_use():
    m = nn.Sequential(mxtrain.LayerNormMLP(64, 96))  # fc1 [96, 64]: 48 rows per rank, not whole blocks of 32
    with pytest.raises(ValueError, match=r"0\.fc1_weight.*48 rows per rank.*multiple of 64 \(e\.g\. 128\)"):
        enable_mx_all_gather(m, world_size=2)
    assert not isinstance(m[0].fc1_weight, MXAllGatherWeight)
    with pytest.raises(ValueError, match=r"which 3 ranks cannot share evenly"):
        enable_mx_all_gather(nn.Sequential(mxtrain.Linear(64, 64)), world_size=3)
    assert len(check_mx_all_gather_shapes(m, 2)) == 1 and check_mx_all_gather_shapes(m, 1) == []
    with pytest.warns(UserWarning, match="keep high-precision all-gathers"):
        names = enable_mx_all_gather(m, world_size=2, strict=False)
    assert names == ["0.fc2_weight"]  # fc2 [64, 96]: 32 rows per rank, fine


def test_subclass_trains_and_saves_like_the_plain_weight():
    plain, wrapped = small_model(), small_model()
    enable_mx_all_gather(wrapped)
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(1))
    recipe = mxtrain.MXFP8Recipe()
    for model in (plain, wrapped):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            with mxtrain.mx_autocast(recipe=recipe):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        model.final_loss = loss.item()
        model.opt = opt
    assert wrapped.final_loss == plain.final_loss
    sd_p, sd_w = plain.state_dict(), wrapped.state_dict()
    assert all(type(v) is torch.Tensor for v in sd_w.values())  # no subclass in state dicts
    assert all(torch.equal(sd_p[k], sd_w[k]) for k in sd_p)
    assert all(type(t) is torch.Tensor for s in wrapped.opt.state.values() for t in s.values())
    # loading writes into the master weight, and the subclass stays
    fresh = small_model()
    enable_mx_all_gather(fresh)
    fresh.load_state_dict(sd_p)
    assert isinstance(fresh[3].fc1_weight, MXAllGatherWeight)
    assert torch.equal(fresh[3].fc1_weight._data, sd_p["3.fc1_weight"])
    assert isinstance(copy.deepcopy(fresh)[2].weight, MXAllGatherWeight)


def _simulated_all_gather(full, world, uses, param_dtype=None):
    """What fsdp_pre_all_gather sends from each rank, concatenated as FSDP2's all-gather does, then unpacked."""
    param_dtype = param_dtype or full.dtype
    info = _WeightInfo(name="w")
    bufs, meta = [], None
    for shard in full.chunk(world, dim=0):
        w = MXAllGatherWeight(shard.contiguous(), info)
        (buf,), meta = w._mx_input(uses, full.shape, world, param_dtype)
        bufs.append(buf)
    state = _GatheredState(name="w", inner=[torch.empty(0, dtype=torch.uint8)])
    gathered = torch.cat(bufs)
    state.fill(gathered, meta)
    assert gathered.untyped_storage().size() == 0  # the all-gather output is given back once copied out
    return MXGatheredWeight(full.shape, param_dtype, full.device, state), meta


@pytest.mark.parametrize("recipe", [mxtrain.MXFP8Recipe(), mxtrain.MXFP4Recipe(), mxtrain.MXFP6Recipe(),
                                    mxtrain.MXINT8Recipe(block_size=16, scale_mode="floor")],
                         ids=["mxfp8", "mxfp4", "mxfp6", "mxint8_b16"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", [(128, 64), (128, 80)], ids=["K64", "K80"])
def test_shards_rebuild_the_full_weights_planes(recipe, world, shape):
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(world)) * 3
    full[5, :7] = 0.0  # a zero run
    spec_r, spec_c = recipe.role("fprop_weight"), recipe.role("dgrad_weight")
    w, meta = _simulated_all_gather(full, world, [(spec_r, 1), (spec_c, 0)])
    assert meta["what"] == "both"
    for spec, axis in ((spec_r, 1), (spec_c, 0)):
        ref = quantize(full, spec.fmt, block_size=spec.block_size, axis=axis, scale_mode=spec.scale_mode,
                       rounding=spec.rounding)
        got = w.mx_gathered_plane(spec, axis)
        assert torch.equal(got.plane(axis).data, ref.plane(axis).data)
        assert torch.equal(got.plane(axis).scale, ref.plane(axis).scale)
        assert (got.shape, got.dtype, got.fmt, got.block_size, got.scale_mode, got.rounding) == (
            ref.shape, ref.dtype, ref.fmt, ref.block_size, ref.scale_mode, ref.rounding)
        assert torch.equal(got.dequantize(), ref.dequantize())


def test_bf16_param_dtype_quantizes_the_bf16_weight():
    full = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    spec = mxtrain.MXFP8Recipe().role("fprop_weight")
    w, _ = _simulated_all_gather(full, 2, [(spec, 1)], param_dtype=torch.bfloat16)
    ref = quantize(full.bfloat16(), spec.fmt, block_size=32, axis=1, scale_mode=spec.scale_mode)
    got = w.mx_gathered_plane(spec, 1)
    assert got.dtype == torch.bfloat16 and torch.equal(got.plane(1).data, ref.plane(1).data)


def test_gathered_weight_explains_a_missing_plane():
    full = torch.randn(64, 64)
    recipe = mxtrain.MXFP8Recipe()
    w, _ = _simulated_all_gather(full, 2, [(recipe.role("fprop_weight"), 1)])
    assert w.mx_gathered_plane(recipe.role("dgrad_weight"), 0) is None  # columnwise was not sent
    assert w.mx_gathered_plane(mxtrain.MXFP4Recipe().role("fprop_weight"), 1) is None  # other spec
    with pytest.raises(RuntimeError, match="all-gathered by FSDP2 as MX planes only.*activation_checkpointing=True"):
        w.high_precision()
    with pytest.raises(RuntimeError, match="MX planes only"):
        torch.nn.functional.linear(torch.randn(2, 64), w)
    # metadata-only ops still work (FSDP zeros_like's the grad shape)
    assert torch.zeros_like(w).shape == (64, 64)
    assert "rowwise" in repr(w)


def test_columnwise_needs_whole_blocks_per_rank():
    spec = mxtrain.MXFP8Recipe().role("dgrad_weight")
    with pytest.raises(ValueError, match="multiple of 64"):
        _simulated_all_gather(torch.randn(96, 64), 2, [(spec, 0)])


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_set_block_prefetch_rejects_bad_counts(bad):
    from mxtrain.distributed import set_block_prefetch

    with pytest.raises(ValueError, match="forward prefetch must be a non-negative int"):
        set_block_prefetch([], forward=bad)
    with pytest.raises(ValueError, match="backward prefetch must be a non-negative int"):
        set_block_prefetch([], backward=bad)


def test_recipe_decides_the_shape_check():
    from mxtrain.distributed import enable_quantized_all_gather

    assert enable_quantized_all_gather is enable_mx_all_gather  # the recipe-neutral name, same function
    # fc1 [96, 64] over 2 ranks: 48 rows each, not whole MX blocks of 32 (dim 0); FP8 codes need no whole blocks
    with pytest.raises(ValueError, match=r"48 rows per rank"):
        enable_quantized_all_gather(nn.Sequential(mxtrain.LayerNormMLP(64, 96)), world_size=2,
                                    recipe=mxtrain.MXFP8Recipe())
    for recipe in (mxtrain.Float8CurrentScaling(), mxtrain.DelayedScaling(), mxtrain.Float8BlockScaling()):
        m = nn.Sequential(mxtrain.LayerNormMLP(64, 96), mxtrain.Linear(64, 49))  # 49 rows: uneven shards
        assert enable_quantized_all_gather(m, world_size=2, recipe=recipe) == ["0.fc1_weight", "0.fc2_weight",
                                                                               "1.weight"]
    assert m[0].fc1_weight._info.gemm == "fc1" and m[1].weight._info.gemm == ""  # DelayedScaling slots


def test_delayed_gathered_plane_check_reads_nothing_on_the_host(monkeypatch):
    """Whether a gathered FP8 weight cast with a module's delayed scales is still current is decided on the host:
    after a compiled update (the state's update count then lives on the device) it read the device every step."""
    from mxtrain.quantization.float8 import quantize_float8
    from mxtrain.recipes.float8 import Float8RoleSpec
    recipe = mxtrain.DelayedScaling(amax_history_len=4)
    m = mxtrain.Linear(32, 16)

    def step(module, x):
        with mxtrain.mx_autocast(recipe=recipe):
            return module(x)
    torch._dynamo.reset()
    fn = torch.compile(step, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        fn(m, torch.randn(8, 32)).sum().backward()
    state = m.recipe_state
    slot = next(s for s in state.slots if s.endswith("weight"))
    fmt = state.formats[state.slots[slot]]
    spec = Float8RoleSpec(fmt, "delayed", "weight", state=state, slot=slot)
    plane = quantize_float8(m.weight.detach(), fmt, scale=state.scale_for(slot, fmt, m.weight.device))
    gathered = _GatheredState(name="w", inner=[torch.empty(0, dtype=torch.uint8)])
    gathered.planes, gathered.delayed_updates = {1: (spec, plane)}, state.eager_updates  # as a gather leaves them
    w = MXGatheredWeight(m.weight.shape, m.weight.dtype, m.weight.device, gathered)

    def refuse(*a, **k):
        raise AssertionError("host read of a tensor")
    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    assert w.mx_gathered_plane(spec, 1) is plane
    state.update(recipe)  # takes the amax the plane's use recorded: new scales, the plane is stale
    assert w.mx_gathered_plane(spec, 1) is None


def test_flat_unwrap_matches_pytree():
    """The subclasses' __torch_dispatch__ unwraps arguments in one flat pass; whatever the shape of the
    arguments, it gives what pytree.tree_map_only gives (nested ones go to pytree itself)."""
    import collections

    import torch.utils._pytree as pytree

    from mxtrain.distributed.fsdp import _map_flat

    info = _WeightInfo(name="w")
    a, b, c = (MXAllGatherWeight(torch.randn(2, 3), info) for _ in range(3))
    pair = collections.namedtuple("pair", "x y")
    cases = [
        ((a, 2.0), {}),
        ((a, b), {"alpha": 0.5}),
        (([a, b], [c, torch.ones(1)], 1), {}),  # Tensor[] arguments (foreach ops)
        ((a, torch.Size([3, 2])), {}),
        ((a, [1, 2]), {"out": c}),
        (([[a], b],), {}),  # nested deeper: pytree's walk
        ((pair(a, b),), {}),
        ((a,), {"d": {"k": b}}),
        ((), {}),
    ]
    unwrap = lambda t: t._data  # noqa: E731

    def same(x, y):
        if isinstance(x, torch.Tensor):
            return x is y
        if isinstance(x, (list, tuple)):
            # pytree rebuilds a torch.Size as a plain tuple; the flat pass keeps it (an op's int[] either way)
            kinds = {type(x), type(y)}
            return ((len(kinds) == 1 or kinds == {tuple, torch.Size}) and len(x) == len(y)
                    and all(same(p, q) for p, q in zip(x, y)))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y

    for args, kwargs in cases:
        want = pytree.tree_map_only(MXAllGatherWeight, unwrap, (args, kwargs))
        got = _map_flat(MXAllGatherWeight, unwrap, args, kwargs)
        assert same(got[0], tuple(want[0])) and same(got[1], want[1]), (args, kwargs)
    # a foreach op over wrapped weights writes their data and bumps its version (the FP8 amax reuse reads it)
    before = [t._data.clone() for t in (a, b)]
    versions = [t._data._version for t in (a, b)]
    torch._foreach_mul_([a, b], 2.0)
    assert all(torch.equal(t._data, 2 * v) for t, v in zip((a, b), before))
    assert all(t._data._version > v for t, v in zip((a, b), versions))


def test_pre_all_gather_signature_is_the_one_fsdp_expects():
    import inspect

    w = MXAllGatherWeight(torch.randn(2, 3), _WeightInfo(name="w"))
    params = list(inspect.signature(w.fsdp_pre_all_gather).parameters)
    assert params == ["mesh", "orig_size", "contiguous_orig_stride", "module", "mp_policy"]
