"""mxtrain.cross_entropy (one pass forward, one backward over the logits) against torch's
F.cross_entropy(logits.float(), targets): the reference on the CPU, the Triton kernels on the interpreter
(the GPU test runs them compiled), the registered ops under opcheck and torch.compile(fullgraph=True)."""

import pytest
import torch
import torch.nn.functional as F

import mxtrain
from mxtrain.kernels import cross_entropy as ce
from mxtrain.kernels._triton_utils import interpret_mode, kernels_available

needs_interpreter = pytest.mark.skipif(not (kernels_available() and interpret_mode()),
                                       reason="needs Triton with TRITON_INTERPRET=1")


def _torch(logits, targets, ignore_index=-100):
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(x.float().reshape(-1, x.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)
    loss.backward()
    return loss.detach(), x.grad


def _ours(logits, targets, ignore_index=-100):
    x = logits.detach().clone().requires_grad_()
    loss = mxtrain.cross_entropy(x, targets, ignore_index=ignore_index)
    loss.backward()
    return loss.detach(), x.grad


def _case(shape, vocab, dtype, seed=0, ignore=0.2):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    targets[torch.rand(shape, generator=g) < ignore] = -100
    return logits, targets


def _assert_close(ours, ref, dtype):
    (l1, g1), (l2, g2) = ours, ref
    torch.testing.assert_close(l1, l2, rtol=2e-6, atol=1e-6)
    assert g1.dtype == g2.dtype == dtype
    # the gradient rounds to the logits' dtype once; the two fp32 values differ by a few ulps
    tol = {torch.float32: (1e-5, 1e-7), torch.bfloat16: (8e-3, 1e-6), torch.float16: (1e-3, 1e-7)}[dtype]
    torch.testing.assert_close(g1.float(), g2.float(), rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,vocab", [((4, 9), 50), ((3,), 1), ((2, 5), 5000)])
def test_reference_matches_torch(dtype, shape, vocab):
    logits, targets = _case(shape, vocab, dtype)
    _assert_close(_ours(logits, targets), _torch(logits, targets), dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(7, 50), (3, 5000), (2, 1)])
def test_triton_matches_reference(dtype, rows, vocab):
    """Blocks of 4096 with a ragged last one (5000), a one-column vocabulary, ignored rows."""
    logits, targets = _case((rows,), vocab, dtype, seed=rows)
    loss_r, lse_r = ce.cross_entropy_forward(logits, targets)
    loss_t, lse_t = ce.cross_entropy_forward(logits, targets, backend="triton")
    torch.testing.assert_close(loss_t, loss_r, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(lse_t, lse_r, rtol=2e-6, atol=1e-6)
    scale = torch.tensor(0.25)
    g_r = ce.cross_entropy_backward(logits, targets, lse_r, scale)
    g_t = ce.cross_entropy_backward(logits, targets, lse_r, scale, backend="triton")
    assert g_t.dtype == dtype
    torch.testing.assert_close(g_t.float(), g_r.float(), rtol={torch.float32: 1e-5}.get(dtype, 8e-3), atol=1e-7)
    assert torch.equal(g_t[targets == -100], torch.zeros_like(g_t[targets == -100]))


@needs_interpreter
def test_triton_special_values():
    """A NaN logit makes its row's loss NaN; -inf logits count nothing; a row of -inf but its target is finite;
    an out-of-range target gives NaN (never a read outside the row)."""
    x = torch.randn(4, 20)
    x[0, 3] = float("nan")
    x[1, :10] = float("-inf")
    x[2, :] = float("-inf")
    x[2, 5] = 1.0
    t = torch.tensor([1, 12, 5, 20])
    loss, lse = ce.cross_entropy_forward(x, t, backend="triton")
    want, want_lse = ce.cross_entropy_forward(x, t)
    assert torch.isnan(loss[0]) and torch.isnan(loss[3]) and torch.isnan(want[0]) and torch.isnan(want[3])
    torch.testing.assert_close(loss[1:3], want[1:3])
    torch.testing.assert_close(loss[2], torch.tensor(0.0))


def test_ignored_rows_and_bad_input():
    logits, targets = _case((6,), 11, torch.float32)
    targets[:] = -100
    loss, grad = _ours(logits, targets)
    assert torch.isnan(loss) and torch.equal(grad, torch.zeros_like(grad))  # torch: NaN as well
    logits, targets = _case((5,), 11, torch.float32, ignore=0)
    targets[2] = 7
    ref = _torch(logits, torch.where(targets == 7, -1, targets), ignore_index=-1)
    _assert_close(_ours(logits, torch.where(targets == 7, -1, targets), ignore_index=-1), ref, torch.float32)
    with pytest.raises(ValueError, match=r"target 11 is outside \[0, 11\)"):
        mxtrain.cross_entropy(logits, torch.full((5,), 11))
    with pytest.raises(ValueError, match="targets must have the logits' shape"):
        mxtrain.cross_entropy(logits, targets[:4])
    with pytest.raises(ValueError, match="integer class indices"):
        mxtrain.cross_entropy(logits, targets.float())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        mxtrain.cross_entropy(logits.double(), targets)


def test_opcheck_registered_ops():
    logits, targets = _case((5,), 33, torch.bfloat16)
    torch.library.opcheck(torch.ops.mxtrain.cross_entropy_forward, (logits, targets, -100))
    _, lse = ce.cross_entropy_forward(logits, targets)
    torch.library.opcheck(torch.ops.mxtrain.cross_entropy_backward, (logits, targets, lse, torch.tensor(0.5), -100))


def test_fullgraph_compile_matches_eager():
    """No graph break; inductor may divide by the count as a multiply, so to fp32 rounding."""
    logits, targets = _case((3, 4), 40, torch.bfloat16)

    def f(x, t):
        return mxtrain.cross_entropy(x * 2, t)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    torch._dynamo.reset()
    l1, l2 = f(x1, targets), torch.compile(f, fullgraph=True)(x2, targets)
    (l1 * 3).backward()
    (l2 * 3).backward()  # a gradient other than 1 reaches the kernel's scale
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=0)
    torch.testing.assert_close(x2.grad.float(), x1.grad.float(), rtol=8e-3, atol=1e-7)
    assert (x1.grad != 0).any()
