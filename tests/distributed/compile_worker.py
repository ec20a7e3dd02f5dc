"""``fsdp_worker.py compile``: FSDP2 with quantized all-gathers and compiled blocks (``torch.compile`` of each
block, as torchtitan does): every weight must get the gradient the eager run gives. Per recipe, the names of the
parameters without a gradient and of those differing from eager (test_fsdp_compile.py reads them)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import mxtrain
from mxtrain.distributed import enable_quantized_all_gather

WIDTH, FFN, TOKENS = 64, 128, 16


def build(recipe, compiled: bool, device):
    torch.manual_seed(0)
    blocks = nn.ModuleList([mxtrain.LayerNormMLP(WIDTH, FFN, normalization="RMSNorm"),
                            mxtrain.LayerNormLinear(WIDTH, WIDTH, normalization="RMSNorm"),
                            mxtrain.Linear(WIDTH, WIDTH)]).to(device)
    enable_quantized_all_gather(blocks, recipe=recipe)
    if compiled:
        for i, blk in enumerate(list(blocks)):
            blocks[i] = torch.compile(blk, backend="aot_eager")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in blocks:
        fully_shard(blk, mp_policy=mp)
    return blocks


def grads(recipe, compiled: bool, device, rank: int) -> dict:
    blocks = build(recipe, compiled, device)
    torch.manual_seed(1 + rank)
    x = torch.randn(TOKENS, WIDTH, device=device)
    with mxtrain.mx_autocast(recipe=recipe):
        for blk in blocks:
            x = blk(x)
    x.float().square().mean().backward()
    return {name.replace("_orig_mod.", ""): None if p.grad is None else p.grad.full_tensor().clone()
            for name, p in blocks.named_parameters()}


def scenario_compile(rank: int, device) -> dict:
    import warnings

    result = {}
    warnings.simplefilter("always")
    for name in ("fp8_current", "mxfp8"):
        recipe = mxtrain.recipe_from_string(name)
        eager = grads(recipe, False, device, rank)
        with warnings.catch_warnings(record=True) as seen:
            compiled = grads(recipe, True, device, rank)
        result[name] = {
            "params": sorted(eager),
            "warned": sum("run their GEMM path eagerly" in str(w.message) for w in seen),
            "no_grad": sorted(n for n, g in compiled.items() if g is None or not g.abs().max() > 0),
            "differ": sorted(n for n, g in compiled.items()
                             if g is not None and eager.get(n) is not None and not torch.equal(g, eager[n])),
        }
    return result
