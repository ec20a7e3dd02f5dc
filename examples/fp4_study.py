"""MXFP4 defaults study: validation loss of a small character-level GPT on Jane Austen.

    python examples/fp4_study.py                      # the setting of docs/fp4.md (CPU, a few minutes a run)
    python examples/fp4_study.py --steps 20 --layers 1 --width 64 --variants fp32,mxfp4   # smoke run
    python examples/fp4_study.py --replot s0.json,s1.json --out docs/fp4_study   # merge runs made per seed

The model is written here as nanoGPT writes it (plain ``nn.Linear`` / ``nn.LayerNorm`` /
``nn.GELU``, input and output embeddings tied) and is converted with
``mxtrain.convert`` exactly as a new user would. Each variant starts from the same
weights and sees the same batches; only the conversion differs:

| variant | conversion |
|---|---|
| ``fp32`` | none |
| ``mxfp8`` | ``convert(model, MXFP8Recipe())`` |
| ``mxfp4-old`` | ``convert(model, MXFP4Recipe(grad_rounding=None), keep_output_layer=False)``: the defaults before 2026-11-25 |
| ``mxfp4-sr`` | ``convert(model, MXFP4Recipe(), keep_output_layer=False)``: stochastic gradient rounding only |
| ``mxfp4-head`` | ``convert(model, MXFP4Recipe(grad_rounding=None))``: output layer kept in high precision only |
| ``mxfp4`` | ``convert(model, MXFP4Recipe())``: today's defaults (both) |

Writes a JSON of the curves and a PNG plot (``--out``), and prints a markdown table of the
final validation losses relative to fp32 (mean over ``--seeds``).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import torch
import torch.nn.functional as F
from torch import nn

import mxtrain
from mxtrain.data import CharTokenizer, get_lm_batches, join_corpus, load_austen, split_corpus

VARIANTS = {
    "fp32": None,
    "mxfp8": lambda: dict(recipe=mxtrain.MXFP8Recipe()),
    "mxfp4-old": lambda: dict(recipe=mxtrain.MXFP4Recipe(grad_rounding=None), keep_output_layer=False),
    "mxfp4-sr": lambda: dict(recipe=mxtrain.MXFP4Recipe(), keep_output_layer=False),
    "mxfp4-head": lambda: dict(recipe=mxtrain.MXFP4Recipe(grad_rounding=None)),
    "mxfp4": lambda: dict(recipe=mxtrain.MXFP4Recipe()),
}


# --- the model: nanoGPT's, unmodified in spirit ---------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, layers: int, width: int, heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq_len, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        for name, p in self.named_parameters():
            if p.dim() == 2:  # nanoGPT's init: N(0, 0.02), residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# --- one run -------------------------------------------------------------------------------------

def char_data():
    train, val = split_corpus(load_austen(), 0.1)  # held-out part of each book
    train_text, val_text = join_corpus(train), join_corpus(val)
    tok = CharTokenizer.from_text(train_text + val_text)
    return tok.encode(train_text), tok.encode(val_text), tok.vocab_size


@torch.no_grad()
def evaluate(model, batches) -> float:
    model.eval()
    loss = sum(model(x, y).item() for x, y in batches) / len(batches)
    model.train()
    return loss


def run(variant: str, args, data, seed: int) -> dict:
    train_ids, val_ids, vocab = data
    torch.manual_seed(seed)  # same initial weights for every variant; also seeds stochastic rounding (seed=None)
    model = GPT(vocab, args.seq_len, args.layers, args.width, args.heads)
    make = VARIANTS[variant]
    handle = mxtrain.convert(model, **make()) if make else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
    val_batches = list(get_lm_batches(val_ids, args.batch_size, args.seq_len, seed=1234,
                                      num_batches=args.eval_batches))
    batches = get_lm_batches(train_ids, args.batch_size, args.seq_len, seed=seed)
    curve, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / args.warmup)  # linear warmup, then constant
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = next(batches)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, evaluate(model, val_batches)))
    kept = [name for name, why in handle.skipped] if handle else []
    return {"variant": variant, "seed": seed, "curve": curve, "val_loss": curve[-1][1],
            "seconds": time.perf_counter() - start, "kept_high_precision": kept}


def table(results: list[dict], variants: list[str]) -> str:
    final = {v: [r["val_loss"] for r in results if r["variant"] == v] for v in variants}
    mean = {v: sum(x) / len(x) for v, x in final.items()}
    base = mean.get("fp32")
    lines = ["| variant | val loss (per seed) | mean | vs fp32 |", "|---|---|---|---|"]
    for v in variants:
        rel = f"{100 * (mean[v] / base - 1):+.1f}%" if base else "n/a"
        lines.append(f"| {v} | {', '.join(f'{x:.4f}' for x in final[v])} | {mean[v]:.4f} | {rel} |")
    return "\n".join(lines)


def plot(results: list[dict], variants: list[str], path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for v in variants:
        runs = [r["curve"] for r in results if r["variant"] == v]
        steps = [s for s, _ in runs[0]]
        mean = [sum(c[i][1] for c in runs) / len(runs) for i in range(len(steps))]
        style = "--" if v in ("fp32", "mxfp8") else "-"
        ax.plot(steps, mean, style, marker="o", markersize=3, label=v)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (weights, batches and rounding)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default="fp4_study", help="writes <out>.json and <out>.png")
    p.add_argument("--replot", default=None, metavar="A.json,B.json",
                   help="train nothing: merge the results of earlier runs (e.g. one per seed) into <out>")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.replot:
        saved = [json.loads(pathlib.Path(f).read_text()) for f in args.replot.split(",")]
        if len({s["setting"] for s in saved}) != 1:
            p.error("--replot: the runs were made with different settings: " + "; ".join(s["setting"] for s in saved))
        setting = saved[0]["setting"]
        results = [r for s in saved for r in s["results"] if r["variant"] in variants]
    else:
        seeds = [int(s) for s in args.seeds.split(",")]
        torch.set_num_threads(args.threads)
        data = char_data()
        results = []
        for seed in seeds:
            for v in variants:
                r = run(v, args, data, seed)
                results.append(r)
                print(f"seed {seed} {v:>10}: val loss {r['val_loss']:.4f} ({r['seconds']:.0f} s; "
                      f"high precision: {', '.join(r['kept_high_precision']) or '-'})", flush=True)
        setting = (f"{args.layers} layers, width {args.width}, {args.heads} heads, vocab {data[2]} chars, "
                   f"{args.steps} steps of {args.batch_size}x{args.seq_len}, AdamW lr {args.lr}")
    print(setting)
    print(table(results, variants))
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"setting": setting, "args": vars(args), "results": results},
                                                   indent=1))
    seeds_run = len({r["seed"] for r in results})
    plot(results, variants, out.with_suffix(".png"), f"char-level GPT on Austen, mean of {seeds_run} seed(s)\n{setting}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
