"""Train a small Mixture-of-Experts language model on Jane Austen under a recipe, against high precision.

    python examples/train_moe.py                          # high precision and MXFP8 on the CPU
    python examples/train_moe.py --compare bf16,mxfp8,fp8_current --steps 300 --device cuda

Each block is attention (``mxtrain.LayerNormLinear`` qkv, ``mxtrain.Linear`` out) and an MoE feed-forward:
an RMSNorm, a router (an ``nn.Linear`` kept in high precision, as MoE recipes usually keep it), top-k
gating, the tokens sorted by expert, two ``mxtrain.GroupedLinear`` (fc1 to SwiGLU's gate and up, fc2),
and the expert outputs summed back with their gate weights. A Switch-style load-balancing loss keeps
the experts busy. "bf16" in ``--compare`` means no recipe (the model's own dtype; fp32 on the CPU).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import mxtrain
from mxtrain.data import austen_lm_tokens, get_lm_batches


class MoEFeedForward(nn.Module):
    def __init__(self, d_model: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.norm = mxtrain.RMSNorm(d_model)
        self.router = nn.Linear(d_model, experts, bias=False)
        self.fc1 = mxtrain.GroupedLinear(experts, d_model, 2 * ffn, bias=False)
        self.fc2 = mxtrain.GroupedLinear(experts, ffn, d_model, bias=False)

    def forward(self, x):
        shape = x.shape
        h = self.norm(x).reshape(-1, shape[-1])
        probs = self.router(h).float().softmax(-1)
        gate, expert = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        gate = gate / gate.sum(-1, keepdim=True)
        # sort the (token, choice) pairs by expert: GroupedLinear takes each expert's rows together
        flat_expert = expert.flatten()
        order = flat_expert.argsort(stable=True)
        token = order // self.top_k
        splits = torch.bincount(flat_expert, minlength=self.experts).tolist()
        # SwiGLU: silu(gate) * up, as one kernel forward and one backward on CUDA, which also record the maxima
        # that fc2's and fc1's FP8 casts would otherwise read the tensors for (docs/modules.md)
        act = mxtrain.gated_activation(self.fc1(h[token], splits), "swiglu")
        out = self.fc2(act, splits) * gate.flatten()[order, None].to(x.dtype)
        y = torch.zeros_like(h).index_add_(0, token, out)
        # Switch Transformer's balance loss: fraction of tokens per expert times mean router probability
        frac = torch.bincount(flat_expert, minlength=self.experts).float() / flat_expert.numel()
        self.aux_loss = self.experts * (frac * probs.mean(0)).sum()
        return y.reshape(shape)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.heads = heads
        self.qkv = mxtrain.LayerNormLinear(d_model, 3 * d_model, normalization="RMSNorm")
        self.proj = mxtrain.Linear(d_model, d_model)
        self.moe = MoEFeedForward(d_model, ffn, experts, top_k)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(x)


class MoEGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int, ffn: int, experts: int,
                 top_k: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, ffn, experts, top_k) for _ in range(layers))
        self.norm = mxtrain.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)  # the output layer stays in high precision

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        aux = sum(block.moe.aux_loss for block in self.blocks) / len(self.blocks)
        return loss, aux


def evaluate(model, val_ids, args, device, recipe) -> float:
    model.eval()
    losses = []
    with torch.no_grad(), mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        for x, y in get_lm_batches(val_ids, args.batch_size, args.seq_len, seed=1234, num_batches=args.eval_batches,
                                   device=device):
            losses.append(model(x, y)[0].item())
    model.train()
    return sum(losses) / len(losses)


def train(recipe_name: str, args, device) -> dict:
    recipe = mxtrain.recipe_from_string(recipe_name)
    train_ids, val_ids, tok = austen_lm_tokens()
    torch.manual_seed(args.seed)  # the same initial weights for every recipe
    model = MoEGPT(tok.vocab_size, args.seq_len, args.d_model, args.layers, args.heads, args.ffn, args.experts,
                   args.top_k).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    batches = get_lm_batches(train_ids, args.batch_size, args.seq_len, seed=args.seed, device=device)
    curve, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            loss, aux = model(x, y)
        (loss + args.aux_weight * aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps:
            curve.append((step, loss.item()))
    return {"recipe": recipe_name, "curve": curve, "val": evaluate(model, val_ids, args, device, recipe),
            "seconds": time.perf_counter() - t0}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", default="bf16,mxfp8", help="recipes, comma separated (bf16: no recipe)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.compare.split(",") if n.strip()]
    for n in names:
        mxtrain.recipe_from_string(n)  # an unknown name fails here, before any training
    device = torch.device(args.device)
    runs = [train(n, args, device) for n in names]
    base = runs[0]
    print(f"{'step':>6s} " + " ".join(f"{r['recipe']:>12s}" for r in runs))
    for i, (step, _) in enumerate(base["curve"]):
        print(f"{step:6d} " + " ".join(f"{r['curve'][i][1]:12.4f}" for r in runs))
    print(f"{'val':>6s} " + " ".join(f"{r['val']:12.4f}" for r in runs))
    for r in runs[1:]:
        print(f"{r['recipe']}: val loss {100 * (r['val'] / base['val'] - 1):+.2f}% against {base['recipe']} "
              f"({r['seconds']:.0f} s; {base['recipe']}: {base['seconds']:.0f} s)")
    return runs


if __name__ == "__main__":
    main()
