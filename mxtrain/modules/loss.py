"""``cross_entropy``: a language model's loss over its logits in one pass forward and one backward
(:mod:`mxtrain.kernels.cross_entropy`), for ``F.cross_entropy(logits.float(), targets)`` with mean reduction."""

from __future__ import annotations

import torch

from mxtrain.kernels import cross_entropy as _ce

__all__ = ["cross_entropy"]


class _CrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int):
        loss, lse = torch.ops.mxtrain.cross_entropy_forward(logits, targets, ignore_index)
        counted = (targets != ignore_index).sum().float()
        ctx.save_for_backward(logits, targets, lse, counted)
        ctx.ignore_index = ignore_index
        return loss.sum() / counted

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse, counted = ctx.saved_tensors
        scale = grad.float() / counted
        return torch.ops.mxtrain.cross_entropy_backward(logits, targets, lse, scale, ctx.ignore_index), None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[..., vocab]`` (fp32, bf16 or fp16, computed in fp32) against integer
    ``targets`` ``[...]``, over the targets that are not ``ignore_index``: ``F.cross_entropy(logits.float()
    .flatten(0, -2), targets.flatten())`` to fp32 rounding, as a 0-d fp32 tensor. The gradient comes in the
    logits' dtype. All targets ignored: NaN, as torch's. A target outside ``[0, vocab)`` gives a NaN loss
    (torch raises, on the GPU through a device-side assert); a CPU call checks and raises."""
    if logits.ndim < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: targets must have the logits' shape without the vocabulary axis "
                         f"({tuple(logits.shape[:-1])}), got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise ValueError(f"cross_entropy: targets must be integer class indices, got {targets.dtype}")
    if logits.dtype not in _ce.LOGIT_DTYPES:
        raise ValueError(f"cross_entropy: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    vocab = logits.shape[-1]
    logits2d = logits.reshape(-1, vocab)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    flat = targets.reshape(-1).long()
    if flat.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
        if bool(bad.any()):
            raise ValueError(f"cross_entropy: target {int(flat[bad][0])} is outside [0, {vocab}) and is not "
                             f"ignore_index ({ignore_index})")
    return _CrossEntropyFn.apply(logits2d, flat, int(ignore_index))
