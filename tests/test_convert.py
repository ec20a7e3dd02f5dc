"""mxtrain.convert: in-place, undoable module swap; outputs, parameters and state dict carried over exactly."""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mxtrain
from mxtrain.compat import mx
from mxtrain.convert import convert, unconvert
from mxtrain.elementwise import modules as em
from mxtrain.modules.conv import Conv1d, Conv2d
from mxtrain.quantization import fake_quantize_mx, quantize_elemwise
from mxtrain.recipes import MXFP8Recipe, MXRecipe


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1d = nn.Conv1d(8, 8, 3, padding="same")
        self.act = nn.ReLU()
        self.body = nn.Sequential(nn.Linear(8 * 16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))
        self.head = nn.Softmax(dim=-1)

    def forward(self, x):
        h = self.act(self.conv(x))  # [N, 8, 4, 4]
        h = self.conv1d(h.flatten(2)).flatten(1)
        return self.head(self.body(h))


def make():
    torch.manual_seed(0)
    return Net(), torch.randn(5, 3, 4, 4)


def test_round_trip_outside_autocast_is_exact():
    net, x = make()
    originals = dict(net.named_modules())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    params = {k: p for k, p in net.named_parameters()}
    ref = net(x)
    handle = convert(net)
    assert isinstance(net.body[0], mxtrain.Linear) and isinstance(net.conv, Conv2d) and isinstance(net.conv1d, Conv1d)
    assert isinstance(net.body[2], mxtrain.LayerNorm) and isinstance(net.act, em.ReLU)
    assert isinstance(net.body[1], em.GELU) and isinstance(net.head, em.Softmax)
    assert len(handle.replaced) == 8 and not handle.skipped
    assert all(p is params[k] for k, p in net.named_parameters())  # the same Parameter objects
    assert net.state_dict().keys() == state.keys()
    assert torch.equal(net(x), ref)  # no recipe active: plain torch numerics
    handle.undo()
    assert all(m is originals[k] for k, m in net.named_modules())
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    assert torch.equal(net(x), ref)


def test_under_autocast_linear_and_conv_use_mx_operands():
    recipe = MXRecipe.uniform("fp8_e4m3", scale_mode="floor", rounding="even")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, 3), nn.Flatten(), nn.Linear(6 * 4, 3))
    x = torch.randn(2, 4, 4, 4, requires_grad=True)
    convert(model)
    with mxtrain.mx_autocast(recipe=recipe):
        y = model(x)
    conv, lin = model[0], model[2]

    def q(t, axis):
        return fake_quantize_mx(t, "fp8_e4m3", 32, axis, "floor", "even")

    h = F.conv2d(q(x.detach(), 1), q(conv.weight.detach(), 1), conv.bias.detach()).flatten(1)
    ref = q(h, -1) @ q(lin.weight.detach(), -1).t() + lin.bias.detach()
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    assert x.grad is not None and conv.weight.grad is not None and lin.weight.grad is not None


def test_pinned_recipe_and_elementwise_precision():
    recipe = MXFP8Recipe(scale_mode="floor", elemwise_format="bfloat12", rounding="nearest")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.SiLU(), nn.Softmax(dim=-1))
    x = torch.randn(4, 16)
    plain = model(x)
    handle = convert(model, recipe, include=[nn.SiLU, nn.Softmax])
    assert [r[0] for r in handle.replaced] == ["1", "2"] and type(model[0]) is nn.Linear
    specs = mx.finalize_mx_specs({"bfloat": 12, "round": "nearest"})
    expected = mx.softmax(mx.silu(model[0](x), mx_specs=specs), -1, mx_specs=specs)
    assert torch.equal(model(x), expected) and not torch.equal(model(x), plain)
    # the pinned recipe wins over the ambient one
    with mxtrain.mx_autocast(recipe=MXFP8Recipe(elemwise_format="fp8")):
        assert torch.equal(model(x), expected)
    mxtrain_unconverted = unconvert(model)
    assert mxtrain_unconverted == 1 and torch.equal(model(x), plain)
    assert quantize_elemwise(expected, "bfloat12", "nearest").equal(expected)


def test_filters_skips_and_context_manager():
    net, x = make()
    with convert(net, exclude=["body.*", nn.Softmax]) as h:
        assert type(net.body[0]) is nn.Linear and type(net.head) is nn.Softmax and isinstance(net.conv, Conv2d)
        assert {r[0] for r in h.replaced} == {"conv", "conv1d", "act"}
    assert type(net.conv) is nn.Conv2d
    ln = nn.Sequential(nn.LayerNorm([4, 4]))
    h = convert(ln)
    assert h.skipped and type(ln[0]) is nn.LayerNorm
    with pytest.raises(TypeError):
        convert(net, include=3.5)


def test_shared_modules_and_pickle():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    convert(model, MXFP8Recipe())
    assert model[0] is model[2] and isinstance(model[0], mxtrain.Linear)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(3, 4)
    assert torch.equal(loaded(x), model(x))
    unconvert(model)
    assert model[0] is lin and model[2] is lin


def test_training_updates_reach_the_original_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = convert(model, MXFP8Recipe(elemwise_format="bfloat16"))
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    h.undo()
    assert not torch.equal(model[0].weight, before)
