"""weight_cast_cache: weights cast once per optimizer step across microbatches, recast when they change."""

from unittest import mock

import pytest
import torch

import mxtrain
from mxtrain.modules import _common
from mxtrain.modules._quantizer import Quantizer

RECIPES = ["mxfp8", "fp8_current", "fp8_block"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(mxtrain.LayerNormMLP(64, 96, activation="swiglu", normalization="RMSNorm"),
                               mxtrain.Linear(64, 32))


def _weights(model):
    return {id(p) for n, p in model.named_parameters() if n.endswith("weight") and p.ndim == 2}


def _train(model, batches, recipe, cached: bool, steps: int = 2):
    """``steps`` optimizer steps of len(batches) microbatches; returns losses, final parameters and the
    number of casts of each weight."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights, casts = _weights(model), {}
    real = Quantizer._cast

    def counting(self, t2d, rowwise, columnwise, at_once):
        if id(t2d) in weights:
            casts[id(t2d)] = casts.get(id(t2d), 0) + 1
        return real(self, t2d, rowwise, columnwise, at_once)
    losses = []
    with mock.patch.object(Quantizer, "_cast", autospec=True, side_effect=counting):
        for _ in range(steps):
            with mxtrain.weight_cast_cache() if cached else torch.enable_grad():
                for x in batches:
                    with mxtrain.mx_autocast(recipe=recipe):
                        loss = model(x).square().mean()
                    loss.backward()
                    losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()], casts


@pytest.mark.parametrize("recipe", RECIPES)
def test_cached_training_equals_uncached_with_fewer_casts(recipe):
    rec = mxtrain.recipe_from_string(recipe)
    batches = [torch.randn(8, 64) for _ in range(3)]
    losses_u, params_u, casts_u = _train(_model(), batches, rec, cached=False)
    losses_c, params_c, casts_c = _train(_model(), batches, rec, cached=True)
    for a, b in zip(losses_u, losses_c):
        assert torch.equal(a, b)
    for a, b in zip(params_u, params_c):
        assert torch.equal(a, b)
    # uncached: every microbatch casts every weight (forward, and backward for MX recipes' dgrad plane);
    # cached: once per optimizer step for each distinct cast
    assert sum(casts_u.values()) == 3 * sum(casts_c.values()), (casts_u, casts_c)


def test_in_place_change_and_context_exit_recast():
    model = mxtrain.Linear(64, 32)
    x = torch.randn(4, 64)
    rec = mxtrain.MXFP8Recipe()
    with mxtrain.weight_cast_cache(), mxtrain.mx_autocast(recipe=rec), torch.no_grad():
        y1 = model(x)
        assert torch.equal(model(x), y1)  # reused
        assert len(_common._WEIGHT_CASTS.entries) == 1
        model.weight.mul_(2)  # in place: the version counter moves, the next forward recasts
        y2 = model(x)
        model.weight.div_(2)
        assert not torch.equal(y1, y2)
        assert torch.equal(model(x), y1)
    assert _common._WEIGHT_CASTS.entries == {}  # freed at exit


@pytest.mark.parametrize("spec", ["fp8_delayed", "mxfp4:rounding=stochastic,seed=0"])
def test_not_cached_where_a_cast_is_not_a_pure_function_of_the_weight(spec):
    model = mxtrain.Linear(64, 32)
    with mxtrain.weight_cast_cache(), mxtrain.mx_autocast(recipe=mxtrain.recipe_from_string(spec)), \
            torch.no_grad():
        model(torch.randn(4, 64))
        assert _common._WEIGHT_CASTS.entries == {}


def test_an_optimizer_step_through_data_recasts():
    """Optimizers that write ``p.data`` leave the version counter alone: any optimizer step drops the casts."""

    class DataSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(1.0)  # no version bump

    model = mxtrain.Linear(64, 32)
    x = torch.randn(4, 64)
    opt = DataSGD(model.parameters())
    with mxtrain.weight_cast_cache(), mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()), torch.no_grad():
        y1 = model(x)
        version = model.weight._version
        opt.step()
        assert model.weight._version == version and _common._WEIGHT_CASTS.entries == {}
        y2 = model(x)
    with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()), torch.no_grad():
        assert torch.equal(y2, model(x)) and not torch.equal(y1, y2)
