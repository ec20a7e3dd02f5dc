"""mxtrain.convert of Conv3d, ConvTranspose1d/2d/3d, GroupNorm and BatchNorm1d/2d/3d.

Without a recipe the converted modules are torch's, exactly; under a recipe the convs
equal a torch conv on operands fake-quantized here with the reference quantizer
(blocks inside each group), and the norms equal microxcaling's ops (mxtrain.compat.mx)
at the same elementwise precision, while the batch norms' running statistics stay torch's.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mxtrain
from mxtrain.compat import mx
from mxtrain.convert import convert, unconvert
from mxtrain.modules import batchnorm as mbn
from mxtrain.modules import conv as mconv
from mxtrain.modules.groupnorm import GroupNorm
from mxtrain.quantization import fake_quantize_mx, quantize_elemwise
from mxtrain.recipes import Float8CurrentScaling, MXFP8Recipe, MXINT8Recipe

RECIPE = MXFP8Recipe(elemwise_format="bfloat16")
SPECS = mx.finalize_mx_specs({"bfloat": 16, "round": "even"})  # RECIPE's elementwise precision, microxcaling-style

# (factory, input shape, replacement type)
CASES = {
    "conv3d": (lambda: nn.Conv3d(4, 6, 3, stride=(1, 2, 1), padding=1, dilation=(1, 1, 2), groups=2),
               (2, 4, 5, 6, 6), mconv.Conv3d),
    "conv3d_reflect": (lambda: nn.Conv3d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 4, 4, 4), mconv.Conv3d),
    "convT1d": (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
                (3, 4, 7), mconv.ConvTranspose1d),
    "convT2d": (lambda: nn.ConvTranspose2d(6, 4, (3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2),
                                           dilation=(1, 2), groups=2), (2, 6, 4, 5), mconv.ConvTranspose2d),
    "convT3d": (lambda: nn.ConvTranspose3d(4, 5, 2, stride=2, bias=False), (2, 4, 3, 2, 3), mconv.ConvTranspose3d),
    "groupnorm": (lambda: nn.GroupNorm(3, 6), (4, 6, 3, 5), GroupNorm),
    "groupnorm_noaffine": (lambda: nn.GroupNorm(2, 4, affine=False, eps=1e-3), (3, 4, 7), GroupNorm),
    "bn1d": (lambda: nn.BatchNorm1d(5), (6, 5), mbn.BatchNorm1d),
    "bn1d_seq": (lambda: nn.BatchNorm1d(5, momentum=None), (4, 5, 3), mbn.BatchNorm1d),
    "bn2d": (lambda: nn.BatchNorm2d(6, momentum=0.3), (3, 6, 4, 4), mbn.BatchNorm2d),
    "bn2d_notrack": (lambda: nn.BatchNorm2d(4, track_running_stats=False), (3, 4, 2, 5), mbn.BatchNorm2d),
    "bn3d_noaffine": (lambda: nn.BatchNorm3d(3, affine=False, eps=1e-3), (2, 3, 2, 3, 3), mbn.BatchNorm3d),
}


def _randn(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _make(case, seed=0):
    factory, shape, _ = CASES[case]
    torch.manual_seed(seed)
    m = factory()
    with torch.no_grad():  # non-trivial affine parameters and running statistics
        for p in m.parameters():
            p.add_(0.3 * _randn(p.shape, seed + 1))
        if getattr(m, "running_var", None) is not None:
            m.running_mean.copy_(0.2 * _randn(m.running_mean.shape, seed + 2))
            m.running_var.copy_(0.5 + _randn(m.running_var.shape, seed + 3).abs())
    return m, _randn(shape, seed + 4)


def _grads(model, x, seed=7):
    """Output and gradients of (output * fixed random weights).sum() with respect to x and every parameter."""
    x = x.detach().requires_grad_(True)
    y = model(x)
    w = _randn(y.shape, seed)
    leaves = [x] + [p for p in model.parameters()]
    return y, torch.autograd.grad((y * w).sum(), leaves)


def _wide(t, seed):
    """``t`` times random powers of two in [2^-8, 2^8]: blocks with a wide dynamic range, so that which
    elements share a scale changes the quantized values (with narrow blocks FP8 rounding hardly depends on it)."""
    g = torch.Generator().manual_seed(seed)
    return t * torch.exp2(torch.randint(-8, 9, t.shape, generator=g).float())


def _equal_all(a, b):
    return len(a) == len(b) and all(torch.equal(s, t) for s, t in zip(a, b))


# --- without a recipe: exactly torch, same objects, undoable ---------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_no_recipe_is_torch_exactly_and_undo_restores(case, mode):
    m, x = _make(case)
    model = nn.Sequential(m)
    getattr(model, mode)()
    twin = copy.deepcopy(model)  # the torch reference, stepping its own buffers
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    keys = list(model.state_dict())
    handle = convert(model)
    assert type(model[0]) is CASES[case][2] and handle.replaced[0][:2] == ("0", type(m).__name__)
    assert model[0].training == (mode == "train")
    assert all(p is params[k] for k, p in model.named_parameters())
    assert all(b is buffers[k] for k, b in model.named_buffers())
    assert list(model.state_dict()) == keys
    for step in range(2):
        y, g = _grads(model, x + step)
        y_ref, g_ref = _grads(twin, x + step)
        assert torch.equal(y, y_ref) and _equal_all(g, g_ref)
        assert _equal_all(list(model.state_dict().values()), list(twin.state_dict().values()))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    handle.undo()
    assert model[0] is m and list(model.state_dict()) == keys
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# --- convolutions under a recipe ---------------------------------------------------------------------------


def _q(t, role, axis, groups=1, recipe=RECIPE):
    """Reference fake quantization of one GEMM operand, blocks inside each of ``groups`` parts of ``axis``."""
    spec = recipe.role(role)
    shape = t.shape
    split = t.detach().float().reshape(*shape[:axis], groups, shape[axis] // groups, *shape[axis + 1:])
    return fake_quantize_mx(split, spec.fmt, spec.block_size, axis + 1, spec.scale_mode,
                            spec.rounding).reshape(shape).contiguous()


def _conv_reference(m, x, dy, recipe=RECIPE):
    """(y, dx, dw, db) of ``m`` on MX operands per the recipe's roles, computed with torch on quantized tensors."""
    transposed = isinstance(m, nn.modules.conv._ConvTransposeNd)
    dims = x.ndim - 2
    g = m.groups
    b = None if m.bias is None else m.bias.detach()
    padded = not transposed and m.padding_mode != "zeros"
    padding = 0 if padded else m.padding

    def pad(xx):
        return F.pad(xx, m._reversed_padding_repeated_twice, mode=m.padding_mode) if padded else xx

    def run(xx, ww, bb=None):
        if transposed:
            fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
            return fn(xx, ww, bb, m.stride, padding, m.output_padding, g, m.dilation)
        fn = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
        return fn(xx, ww, bb, m.stride, padding, m.dilation, g)

    w = m.weight.detach()
    xq = _q(pad(x), "fprop_input", 1, g, recipe)
    wq = _q(w, "fprop_weight", 0, g, recipe) if transposed else _q(w, "fprop_weight", 1, 1, recipe)
    y = run(xq, wq, b)
    # dgrad: dx of the conv with the dgrad weight, fed the dgrad grad-output (the conv is linear in x)
    x_leaf = x.detach().clone().requires_grad_(True)
    wd = _q(w, "dgrad_weight", 1, 1, recipe) if transposed else _q(w, "dgrad_weight", 0, g, recipe)
    dx, = torch.autograd.grad(run(pad(x_leaf), wd), x_leaf, _q(dy, "dgrad_grad_output", 1, g, recipe))
    w_leaf = w.clone().requires_grad_(True)
    dw, = torch.autograd.grad(run(_q(pad(x), "wgrad_input", 0, 1, recipe), w_leaf), w_leaf,
                              _q(dy, "wgrad_grad_output", 0, 1, recipe))
    db = None if b is None else dy.sum([0] + list(range(2, dy.ndim)))
    return y, dx, dw, db


@pytest.mark.parametrize("recipe", [RECIPE, MXINT8Recipe(scale_mode="floor", rounding="nearest")],
                         ids=["mxfp8", "mxint8"])
@pytest.mark.parametrize("case", ["conv3d", "conv3d_reflect", "convT1d", "convT2d", "convT3d"])
def test_conv_under_recipe_equals_torch_on_quantized_operands(case, recipe):
    m, x = _make(case)
    x = _wide(x, 11)
    with torch.no_grad():
        m.weight.copy_(_wide(m.weight, 12))
    plain = m(x)
    model = nn.Sequential(m)
    convert(model, recipe)
    x_leaf = x.clone().requires_grad_(True)
    y = model(x_leaf)
    dy = _wide(_randn(y.shape, 5), 13)
    y.backward(dy)
    y_ref, dx_ref, dw_ref, db_ref = _conv_reference(m, x, dy, recipe)
    assert torch.equal(x_leaf.grad, dx_ref)
    assert torch.equal(y, y_ref) and not torch.allclose(y, plain, rtol=1e-3, atol=1e-3)
    assert torch.equal(m.weight.grad, dw_ref)
    assert db_ref is None or torch.equal(m.bias.grad, db_ref)


def test_conv_groups_block_within_each_group():
    torch.manual_seed(0)
    m = nn.Conv2d(6, 4, 3, groups=2, bias=False)
    x = torch.randn(2, 6, 5, 5)
    x[:, :3] *= 1000
    with mxtrain.mx_autocast(recipe=RECIPE):
        y = mconv.mx_conv(x, m.weight, None, groups=2)
    spec = RECIPE.role("fprop_input")
    across = fake_quantize_mx(x, spec.fmt, spec.block_size, 1, spec.scale_mode, spec.rounding)
    wq = _q(m.weight, "fprop_weight", 1)
    assert torch.equal(y, F.conv2d(_q(x, "fprop_input", 1, 2), wq, groups=2))
    assert not torch.equal(y, F.conv2d(across, wq, groups=2))  # blocking across the groups would differ


def test_conv_unbatched_output_size_and_same_padding():
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 4, 3, padding="same", dilation=2)
    convt = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1)
    model = nn.Sequential(conv, convt)
    x = torch.randn(3, 4, 5, 6)
    convert(model, RECIPE)
    batched = model[0](x.unsqueeze(0))
    assert batched.shape == (1, 4, 4, 5, 6) and torch.equal(model[0](x), batched[0])
    h = torch.randn(2, 4, 5, 6)
    out = model[1](h, output_size=[10, 12])
    assert out.shape == (2, 3, 10, 12)
    assert torch.equal(out, F.conv_transpose2d(_q(h, "fprop_input", 1), _q(convt.weight, "fprop_weight", 0),
                                               convt.bias, 2, 1, (1, 1)))
    with pytest.raises(ValueError, match="input"):
        model[1](torch.randn(4, 5))


def test_conv_fp8_recipe_is_skipped_or_refused():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ConvTranspose3d(4, 2, 2), nn.Linear(4, 4))
    h = convert(model, Float8CurrentScaling())
    assert [name for name, _ in h.skipped] == ["0", "1"] and "FP8" in h.skipped[0][1]
    assert type(model[0]) is nn.Conv2d and isinstance(model[2], mxtrain.Linear)
    h.undo()
    convert(model)  # following mx_autocast: an ambient FP8 recipe is refused at run time
    with mxtrain.mx_autocast(recipe=Float8CurrentScaling()), pytest.raises(NotImplementedError, match="FP8"):
        model[0](torch.randn(1, 3, 4, 4))


# --- norms under a recipe -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["groupnorm", "groupnorm_noaffine"])
def test_groupnorm_under_recipe_equals_microxcaling(case):
    m, x = _make(case)
    plain = m(x)
    model = nn.Sequential(m)
    convert(model, RECIPE)
    y, grads = _grads(model, x)
    C = m.num_channels
    w = torch.ones(C) if m.weight is None else m.weight.detach().clone().requires_grad_(True)
    b = torch.zeros(C) if m.bias is None else m.bias.detach().clone().requires_grad_(True)
    x_leaf = x.clone().requires_grad_(True)
    y_ref = mx.group_norm(x_leaf, m.num_groups, w, b, m.eps, mx_specs=SPECS)
    leaves = [x_leaf] + ([w, b] if m.affine else [])
    grads_ref = torch.autograd.grad((y_ref * _randn(y_ref.shape, 7)).sum(), leaves)
    assert torch.equal(y, y_ref) and _equal_all(grads, grads_ref)
    assert not torch.equal(y, plain) and quantize_elemwise(y, "bfloat16").equal(y)


@pytest.mark.parametrize("case", ["bn1d", "bn1d_seq", "bn2d", "bn2d_notrack", "bn3d_noaffine"])
def test_batchnorm_train_under_recipe(case):
    m, x = _make(case)
    twin = copy.deepcopy(m)  # torch's BatchNorm: the running statistics must follow it exactly
    model = nn.Sequential(m)
    convert(model, RECIPE)
    C = x.shape[1]
    for step in range(3):
        xs = x * (1 + step) + step
        plain = twin(xs)
        y, grads = _grads(model, xs)
        w = torch.ones(C) if m.weight is None else m.weight.detach().clone().requires_grad_(True)
        b = torch.zeros(C) if m.bias is None else m.bias.detach().clone().requires_grad_(True)
        x_leaf = xs.clone().requires_grad_(True)
        y_ref = mx.batch_norm(x_leaf, None, None, w, b, is_training=True, eps=m.eps, mx_specs=SPECS)
        leaves = [x_leaf] + ([w, b] if m.affine else [])
        grads_ref = torch.autograd.grad((y_ref * _randn(y_ref.shape, 7)).sum(), leaves)
        assert torch.equal(y, y_ref) and _equal_all(grads, grads_ref)
        assert not torch.equal(y, plain)
        assert _equal_all(list(m.state_dict().values()), list(twin.state_dict().values()))
    if m.track_running_stats:
        assert int(m.num_batches_tracked) == 3


@pytest.mark.parametrize("case", ["bn1d_seq", "bn2d", "bn3d_noaffine"])
def test_batchnorm_eval_under_recipe_uses_running_stats(case):
    m, x = _make(case)
    m.eval()
    twin = copy.deepcopy(m)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    model = nn.Sequential(m)
    convert(model, RECIPE)
    y, grads = _grads(model, x)
    C = x.shape[1]
    w = torch.ones(C) if m.weight is None else m.weight.detach()
    b = torch.zeros(C) if m.bias is None else m.bias.detach()
    assert torch.equal(y, mx.batch_norm(x, m.running_mean, m.running_var, w, b, is_training=False, eps=m.eps,
                                        mx_specs=SPECS))
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())  # evaluation changes no buffer

    def bf(t):
        return quantize_elemwise(t, "bfloat16", "even")

    # the statistics are constants: dx = dy * w * 1/sqrt(var + eps), each step rounded
    shape = [1, C] + [1] * (x.ndim - 2)
    std_inv = bf(1 / bf(torch.sqrt(bf(bf(m.running_var) + m.eps)))).view(shape)
    dy = bf(_randn(y.shape, 7))
    assert torch.equal(grads[0], bf(bf(dy * bf(w).view(shape)) * std_inv))
    y_plain, grads_plain = _grads(twin, x)
    assert not torch.equal(y, y_plain)
    assert torch.allclose(grads[0], grads_plain[0], rtol=2e-2, atol=2e-2)


def test_norm_errors_under_recipe():
    model = nn.Sequential(nn.GroupNorm(2, 4), nn.BatchNorm2d(4))
    convert(model, RECIPE)
    with pytest.raises(ValueError, match="GroupNorm"):
        model[0](torch.randn(2, 6, 3))
    with pytest.raises(ValueError, match="4D"):
        model[1](torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="more than 1 value"):
        model[1](torch.randn(1, 4, 1, 1))


# --- a whole model ------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.gn = nn.GroupNorm(2, 4)
        self.vol = nn.Conv3d(1, 2, 3, padding=1)

    def forward(self, x):
        h = self.gn(self.up(self.act(self.bn(self.conv(x)))))
        return self.vol(h.unsqueeze(1))


def test_model_training_step_state_dict_and_pickle():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 3, 4, 4)
    originals = dict(net.named_modules())
    keys = list(net.state_dict())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    handle = convert(net, RECIPE)
    assert len(handle.replaced) == 6 and not handle.skipped and list(net.state_dict()) == keys
    net(x).square().mean().backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    net.eval()
    loaded.eval()
    assert torch.equal(loaded(x), net(x))
    assert unconvert(net) == 1
    assert all(m is originals[k] for k, m in net.named_modules())
    after = net.state_dict()
    assert int(after["bn.num_batches_tracked"]) == 1 and not torch.equal(after["bn.running_mean"],
                                                                         before["bn.running_mean"])
    assert not torch.equal(after["up.weight"], before["up.weight"])
    assert not torch.equal(after["vol.weight"], before["vol.weight"])


def test_bfloat16_model_under_recipe():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(3, 4, 2, stride=2), nn.GroupNorm(2, 4), nn.BatchNorm2d(4),
                          nn.Conv3d(1, 1, 3, padding=1)).to(torch.bfloat16)
    twin = copy.deepcopy(model[2])
    x = torch.randn(2, 3, 3, 3, dtype=torch.bfloat16, requires_grad=True)
    convert(model, RECIPE)
    g = model[1](model[0](x))
    h = model[2](g)
    y = model[3](h.unsqueeze(1))
    assert h.dtype == y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    twin(g.detach())  # the running statistics follow torch's, in bfloat16 too
    assert _equal_all(list(model[2].state_dict().values())[2:], list(twin.state_dict().values())[2:])
