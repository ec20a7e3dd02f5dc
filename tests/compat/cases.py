"""The ops the compat tests run through both microxcaling and mxtrain.compat.mx: each returns its outputs and gradients."""

import importlib

import torch

SPECS = {
    "fp8_e4m3+bfloat16/nearest": dict(w_elem_format="fp8_e4m3", a_elem_format="fp8_e4m3", block_size=32, scale_bits=8,
                                      bfloat=16),
    "int8+fp12/even": dict(w_elem_format="int8", a_elem_format="int8", block_size=32, scale_bits=8, fp=12,
                           round="even"),
    "fp6_e3m2,fp4+fp32/floor": dict(w_elem_format="fp6_e3m2", a_elem_format="fp4_e2m1", block_size=16, scale_bits=8,
                                    round="floor"),
    "fp8_e5m2/block0+fp8/no-backprop": dict(w_elem_format="fp8_e5m2", a_elem_format="fp8_e5m2", block_size=0,
                                            scale_bits=8, fp=8, quantize_backprop=False),
    "int2,int4+bfloat10/even": dict(w_elem_format="int2", a_elem_format="int4", block_size=8, scale_bits=8, bfloat=10,
                                    round="even"),
    "bfloat16 only": dict(bfloat=16),
}


def leaf(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).requires_grad_(True)


def with_grads(out, tensors):
    g = torch.randn_like(out)
    return [out] + list(torch.autograd.grad(out, tensors, g, allow_unused=True))


def linear(lib, s):
    x, w, b = leaf(4, 6, 40), leaf(24, 40), leaf(24)
    return with_grads(lib.linear(x, w, b, mx_specs=s), [x, w, b])


def linear_module(lib, s):
    torch.manual_seed(5)
    m = lib.Linear(40, 24, mx_specs=s)
    x = leaf(7, 40)
    return with_grads(m(x), [x, m.weight, m.bias])


def matmul(mode):
    def case(lib, s):
        a, b, bias = leaf(3, 8, 40), leaf(3, 40, 16), leaf(16)
        return with_grads(lib.matmul(a, b, bias, mx_specs=s, mode_config=mode), [a, b, bias])
    return case


def bmm(lib, s):
    a, b = leaf(3, 8, 40), leaf(3, 40, 16)
    return with_grads(lib.bmm(a, b, mx_specs=s), [a, b])


def conv1d(lib, s):
    x, w, b = leaf(4, 40, 9), leaf(8, 40, 3), leaf(8)
    return with_grads(lib.conv1d(x, w, b, padding=1, mx_specs=s), [x, w, b])


def conv2d(lib, s):
    x, w, b = leaf(4, 6, 9, 9), leaf(8, 3, 3, 3), leaf(8)
    return with_grads(lib.conv2d(x, w, b, stride=2, padding=1, groups=2, mx_specs=s), [x, w, b])


def conv2d_module(lib, s):
    torch.manual_seed(5)
    m = lib.Conv2d(3, 16, 3, padding=1, mx_specs=s)
    x = leaf(4, 3, 8, 8)
    return with_grads(m(x), [x, m.weight, m.bias])


def conv3d(lib, s):
    x, w = leaf(2, 4, 5, 5, 5), leaf(6, 4, 3, 3, 3)
    return with_grads(lib.conv3d(x, w, None, mx_specs=s), [x, w])


def conv_transpose2d(lib, s):
    torch.manual_seed(3)
    m = lib.ConvTranspose2d(6, 4, 3, stride=2, mx_specs=s)
    x = leaf(2, 6, 5, 5)
    return with_grads(m(x), [x, m.weight, m.bias])


def _affine(m):
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    return m


def layer_norm(lib, s):
    torch.manual_seed(3)
    m = _affine(lib.LayerNorm(40, mx_specs=s))
    x = leaf(3, 5, 40)
    return with_grads(m(x), [x, m.weight, m.bias])


def rms_norm(lib, s):
    torch.manual_seed(3)
    m = _affine(lib.RMSNorm(40, mx_specs=s))
    x = leaf(3, 5, 40)
    return with_grads(m(x), [x, m.weight, m.bias])


def group_norm(lib, s):
    torch.manual_seed(3)
    m = _affine(lib.GroupNorm(3, 6, mx_specs=s))
    x = leaf(2, 6, 4, 4)
    return with_grads(m(x), [x, m.weight, m.bias])


def batch_norm(lib, s):
    torch.manual_seed(3)
    m = _affine(lib.BatchNorm2d(6, mx_specs=s))
    x = leaf(4, 6, 5, 5)
    out = with_grads(m(x), [x, m.weight, m.bias])
    m.eval()
    return out + [m(x.detach()), m.running_mean, m.running_var]


def activation(fn, **kw):
    def case(lib, s):
        x = leaf(4, 50, scale=3)
        return with_grads(getattr(lib, fn)(x, mx_specs=s, **kw), [x])
    return case


def softmax(exp2):
    def case(lib, s):
        s = dict(s)
        s["softmax_exp2"] = exp2
        x = leaf(4, 7, 33, scale=2)
        return with_grads(lib.softmax(x, dim=-1, mx_specs=s), [x])
    return case


def adaptive_avg_pool2d(lib, s):
    x = leaf(2, 3, 7, 9)
    return with_grads(lib.adaptive_avg_pool2d(x, (3, 4), mx_specs=s), [x])


def simd(lib, s):
    a, b = leaf(4, 10), leaf(10)
    pos = (torch.rand(4, 10) + 0.5).requires_grad_(True)
    y = lib.simd_add(a, b, mx_specs=s)
    y = lib.simd_mul(y, lib.simd_sub(a, 0.5, mx_specs=s), mx_specs=s)
    y = lib.simd_div(y, pos, mx_specs=s)
    for op in (lib.simd_sqrt, lib.simd_log):
        y = lib.simd_add(y, op(pos, mx_specs=s), mx_specs=s)
    for op in (lib.simd_exp, lib.simd_square):
        y = lib.simd_add(y, op(a, mx_specs=s), mx_specs=s)
    r = lib.simd_reduce_sum(y, 1, mx_specs=s)
    r2 = lib.simd_reduce_mean(y, [0], mx_specs=s)
    n = lib.simd_norm(y, mx_specs=s)
    tot = lib.simd_add(lib.simd_reduce_sum(r, mx_specs=s), lib.simd_reduce_sum(r2, mx_specs=s), mx_specs=s)
    return with_grads(lib.simd_add(tot, n, mx_specs=s), [a, b, pos]) + [r, r2, n]


def quantize_ops(lib, s):
    elemwise_ops = importlib.import_module(lib.__name__ + ".elemwise_ops")
    mx_ops = importlib.import_module(lib.__name__ + ".mx_ops")
    x = torch.randn(6, 40, 5)
    out = [elemwise_ops.quantize_elemwise_op(x, s)]
    for fmt in ("fp8_e4m3", "fp8_e5m2", "int8", "int2", "fp4_e2m1", "fp6_e2m3", "fp16"):
        for axes in ([1], [-1], [0]):
            out.append(mx_ops.quantize_mx_op(x, s, elem_format=fmt, axes=axes, round=s["round"]))
    out.append(mx_ops.quantize_mx_op(x, s, elem_format="int8", axes=[0, 2], block_size=0, round=s["round"]))
    return out


CASES = {
    "linear": linear, "Linear": linear_module, "matmul_aa": matmul("aa"), "matmul_aw": matmul("aw"),
    "matmul_wa": matmul("wa"), "bmm": bmm, "conv1d": conv1d, "conv2d": conv2d, "Conv2d": conv2d_module,
    "conv3d": conv3d, "ConvTranspose2d": conv_transpose2d, "LayerNorm": layer_norm, "RMSNorm": rms_norm,
    "GroupNorm": group_norm, "BatchNorm2d": batch_norm, "gelu": activation("gelu"),
    "gelu_first_order": activation("gelu", first_order_gelu=True), "relu": activation("relu"),
    "relu6": activation("relu6"), "leaky_relu": activation("leaky_relu", negative_slope=0.1),
    "silu": activation("silu"), "sigmoid": activation("sigmoid"), "tanh": activation("tanh"),
    "softmax": softmax(False), "softmax_exp2": softmax(True), "adaptive_avg_pool2d": adaptive_avg_pool2d,
    "simd": simd, "quantize_ops": quantize_ops,
}


def run(lib, specs, case):
    torch.manual_seed(1)
    return CASES[case](lib, lib.finalize_mx_specs(dict(specs)))
