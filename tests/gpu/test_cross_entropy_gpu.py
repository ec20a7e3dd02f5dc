"""mxtrain.cross_entropy's Triton kernels on CUDA: against torch's F.cross_entropy(logits.float()) at language-model
vocabularies, through the registry (the Triton path is the one taken), and captured in a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

import mxtrain
from mxtrain.kernels import registry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _pair(logits, targets):
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    la = mxtrain.cross_entropy(a, targets)
    la.backward()
    lb = F.cross_entropy(b.float().view(-1, b.shape[-1]), targets.view(-1))
    lb.backward()
    return (la, a.grad), (lb, b.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1024, 32000), (64, 128256), (300, 49152), (7, 3)])
def test_matches_torch(dtype, rows, vocab):
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda") * 5).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    targets[::7] = -100
    call = registry._OPS["cross_entropy_forward"].make_call(logits=logits, targets=targets)
    assert registry.select("cross_entropy_forward", call, logits.device).backend == "triton"
    (la, ga), (lb, gb) = _pair(logits, targets)
    torch.testing.assert_close(la, lb, rtol=2e-6, atol=1e-6)
    assert ga.dtype == dtype
    torch.testing.assert_close(ga.float(), gb.float(), rtol={torch.float32: 1e-5}.get(dtype, 8e-3), atol=1e-7)


def test_captured_in_a_cuda_graph():
    torch.manual_seed(1)
    logits = (torch.randn(256, 32000, device="cuda") * 3).bfloat16().requires_grad_()
    targets = torch.randint(0, 32000, (256,), device="cuda")
    (want, want_grad), _ = _pair(logits.detach(), targets)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (Triton compiles) outside the capture
        mxtrain.cross_entropy(logits, targets).backward()
    torch.cuda.current_stream().wait_stream(s)
    logits.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = mxtrain.cross_entropy(logits, targets)
        loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(loss, want) and torch.equal(logits.grad, want_grad)
