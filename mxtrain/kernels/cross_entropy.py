"""Cross-entropy of a language model's logits, forward and backward in one pass over the logits each.

``F.cross_entropy(logits.float(), targets)`` on bf16 logits copies them to fp32, runs log-softmax (writing
fp32 log-probabilities), and in backward writes the fp32 softmax gradient and copies it back to bf16: about
30 bytes of traffic per logit. For a 128256-token vocabulary at 8192 tokens a step (an 8B Llama's lm_head)
that is 11-14 ms of an H100 step. Here the forward reads each logit once (an online max and sum of
exponentials per row: the row's log-sum-exp and loss) and the backward reads it once more and writes its
gradient once, in the logits' dtype: 6 bytes per logit.

Two operations of the kernel registry, ``cross_entropy_forward`` and ``cross_entropy_backward``, each with a
``reference`` (torch, fp32, any device) and a ``triton`` implementation; ``torch.ops.mxtrain.cross_entropy_*``
are the registered ops (a compiled graph keeps them, a CUDA graph captures them: no host read). The Triton
sums run in another order than torch's: results agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from mxtrain.kernels import registry
from mxtrain.kernels.calls import CrossEntropyCall
from mxtrain.kernels._triton_utils import (HAVE_TRITON, bf16_bits, device_supported, interpret_mode, launch_options,
                                            tl, triton)
from mxtrain.kernels.ids import DTYPE_IDS
from mxtrain.oplib import opaque_op

__all__ = ["cross_entropy_forward", "cross_entropy_backward", "LOGIT_DTYPES"]

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _make_call(*, logits, targets, ignore_index=-100, lse=None, scale=None):
    return CrossEntropyCall(logits, targets, ignore_index, lse, scale)


def _check(logits: torch.Tensor, targets: torch.Tensor, lse=None, scale=None) -> None:
    if logits.ndim != 2 or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"cross_entropy: logits must be a [tokens, vocab] float32/bfloat16/float16 tensor, "
                         f"got {logits.dtype} of shape {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"cross_entropy: targets must be an int64 tensor of shape [{logits.shape[0]}], got "
                         f"{targets.dtype} of shape {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"cross_entropy: targets are on {targets.device}, logits on {logits.device}")
    if lse is not None and (lse.shape != logits.shape[:1] or lse.dtype != torch.float32):
        raise ValueError("cross_entropy_backward: lse must be the forward's float32 [tokens] log-sum-exp")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError("cross_entropy_backward: scale must be a 0-d float32 tensor")


# ---------------------------------------------------------------------------------------------- reference


def _reference_forward(call: CrossEntropyCall):
    """(loss per row, log-sum-exp per row), fp32: ``lse - logits[target]``, 0 for ignored rows, NaN for a
    target outside [0, vocab)."""
    x, t = call.logits.float(), call.targets
    lse = torch.logsumexp(x, dim=1) if x.shape[1] else torch.full_like(x[:, 0], float("-inf"))
    valid = t != call.ignore_index
    in_range = (t >= 0) & (t < x.shape[1])
    picked = x.gather(1, torch.where(in_range, t, 0).unsqueeze(1)).squeeze(1) if x.shape[1] else lse
    loss = torch.where(valid, torch.where(in_range, lse - picked, float("nan")), 0.0)
    return loss, lse


def _reference_backward(call: CrossEntropyCall) -> torch.Tensor:
    """``(softmax(logits) - onehot(target)) * scale`` in the logits' dtype, zero rows for ignored targets."""
    x, t = call.logits.float(), call.targets
    p = torch.exp(x - call.lse.unsqueeze(1))
    hit = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == t.unsqueeze(1)
    g = torch.where(hit, p - 1.0, p) * call.scale
    return torch.where((t != call.ignore_index).unsqueeze(1), g, 0.0).to(call.logits.dtype)


# ---------------------------------------------------------------------------------------------- Triton

if HAVE_TRITON:
    from mxtrain.kernels.cast import _BF16, _round_to_dtype, _store_out, _widen

    @triton.jit
    def _ce_forward_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, V, stride_x, ignore_index, IN_KIND: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.where(mask, _widen(tl.load(base + cols, mask=mask, other=0), IN_KIND == _BF16), float("-inf"))
            new_m = tl.maximum(m, tl.max(x, 0))
            # exp(-inf - -inf) is NaN: a block of -inf adds nothing while the row has no finite max yet
            safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
            s = s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m), 0)
            m = new_m
        lse = tl.where(m == float("-inf"), m, m + tl.log(s))
        lse = tl.where(s != s, s, lse)  # a NaN logit: NaN
        t = tl.load(t_ptr + row)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        xt = _widen(tl.load(base + t, mask=valid & in_range, other=0), IN_KIND == _BF16)
        loss = tl.where(valid, tl.where(in_range, lse - xt, float("nan")), 0.0)
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _ce_backward_kernel(x_ptr, t_ptr, lse_ptr, scale_ptr, g_ptr, V, stride_x, stride_g, ignore_index,
                            OUT_KIND: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        t = tl.load(t_ptr + row)
        lse = tl.load(lse_ptr + row)
        scale = tl.load(scale_ptr)
        x = _widen(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0), OUT_KIND == _BF16)
        p = tl.exp(x - lse)
        g = tl.where(cols == t, p - 1.0, p) * scale
        g = tl.where(t != ignore_index, g, 0.0)
        _store_out(g_ptr + row * stride_g + cols, _round_to_dtype(g, OUT_KIND), mask, OUT_KIND)

    def _triton_supports(call: CrossEntropyCall) -> str | None:
        x = call.logits
        if not device_supported(x.device):
            return f"no Triton kernels for {x.device.type} tensors here"
        if x.stride(1) != 1:
            return "the logits' rows must be contiguous"
        return None

    def _triton_forward(call: CrossEntropyCall):
        x, t = call.logits, call.targets
        n, v = x.shape
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        if n:
            _ce_forward_kernel[(n,)](bf16_bits(x), t, loss, lse, v, x.stride(0), call.ignore_index,
                                     IN_KIND=DTYPE_IDS[x.dtype], BLOCK=min(4096, triton.next_power_of_2(max(v, 1))),
                                     num_warps=8, **launch_options())
        return loss, lse

    def _triton_backward(call: CrossEntropyCall) -> torch.Tensor:
        x, t = call.logits, call.targets
        n, v = x.shape
        g = torch.empty((n, v), dtype=x.dtype, device=x.device)
        if g.numel():
            block = min(4096, triton.next_power_of_2(v))
            _ce_backward_kernel[(n, triton.cdiv(v, block))](
                bf16_bits(x), t, call.lse, call.scale, bf16_bits(g), v, x.stride(0), g.stride(0), call.ignore_index,
                OUT_KIND=DTYPE_IDS[x.dtype], BLOCK=block, num_warps=8, **launch_options())
        return g


registry.define(registry.Operation("cross_entropy_forward", _make_call, CrossEntropyCall.key))
registry.define(registry.Operation("cross_entropy_backward", _make_call, CrossEntropyCall.key))
registry.register("cross_entropy_forward", "reference", _reference_forward)
registry.register("cross_entropy_backward", "reference", _reference_backward)
if HAVE_TRITON:
    registry.register("cross_entropy_forward", "triton", _triton_forward, supports=_triton_supports)
    registry.register("cross_entropy_backward", "triton", _triton_backward, supports=_triton_supports)


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                          backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, log-sum-exp per row), both fp32 [N], of ``logits`` [N, V] against ``targets`` [N]:
    ``logsumexp(row) - row[target]``; 0 where the target is ``ignore_index``, NaN where it is outside [0, V)."""
    _check(logits, targets)
    call = CrossEntropyCall(logits, targets, int(ignore_index))
    return registry.run("cross_entropy_forward", call, logits.device, backend)


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                           ignore_index: int = -100, backend: str | None = None) -> torch.Tensor:
    """The gradient of ``scale * sum(counted rows' losses)`` with respect to ``logits``, in their dtype:
    ``(exp(logits - lse) - onehot(target)) * scale``, zero rows where the target is ``ignore_index``."""
    _check(logits, targets, lse, scale)
    call = CrossEntropyCall(logits, targets, int(ignore_index), lse, scale.reshape(()))
    return registry.run("cross_entropy_backward", call, logits.device, backend)


@opaque_op("mxtrain::cross_entropy_forward")
def _forward_op(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_forward(logits, targets, ignore_index)


@_forward_op.register_fake
def _(logits, targets, ignore_index):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@opaque_op("mxtrain::cross_entropy_backward")
def _backward_op(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                 ignore_index: int) -> torch.Tensor:
    return cross_entropy_backward(logits, targets, lse, scale, ignore_index)


@_backward_op.register_fake
def _(logits, targets, lse, scale, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)
