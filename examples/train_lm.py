"""Train a small decoder-only transformer on Jane Austen, in bf16/fp32 or an MX recipe.

Single process:     python examples/train_lm.py --compare bf16,mxfp8
Distributed FSDP2:  torchrun --nproc_per_node=2 examples/train_lm.py --recipe mxfp8
Checkpoints:        ... --ckpt-dir ckpt --save-every 50   (then add --resume to continue after a crash)

The attention projections are ``mxtrain.LayerNormLinear`` (qkv) and
``mxtrain.Linear`` (out); the MLPs are ``mxtrain.LayerNormMLP``. Attention itself
is torch's SDPA. Under ``torchrun`` every block and the root are wrapped with
torch's FSDP2 ``fully_shard`` (gloo on CPU, NCCL on GPU), and the weights of the
mxtrain modules are all-gathered as MX bytes (``mxtrain.distributed.enable_mx_all_gather``,
called before ``fully_shard``; ``--no-mx-all-gather`` sends them in high precision).
Checkpoints are written with torch.distributed.checkpoint (``mxtrain.distributed.checkpoint``)
and load into any number of ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import mxtrain
from mxtrain.data import austen_lm_tokens, get_lm_batches


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    ffn_mult: int = 4
    activation: str = "gelu"
    normalization: str = "LayerNorm"


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = mxtrain.LayerNormLinear(cfg.d_model, 3 * cfg.d_model, normalization=cfg.normalization)
        self.proj = mxtrain.Linear(cfg.d_model, cfg.d_model)
        self.mlp = mxtrain.LayerNormMLP(cfg.d_model, cfg.ffn_mult * cfg.d_model, activation=cfg.activation,
                                        normalization=cfg.normalization)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # stays high precision
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        for name in ("weight", "fc1_weight", "fc2_weight"):
            w = getattr(m, name, None)
            if isinstance(m, (mxtrain.Linear, mxtrain.LayerNormLinear, mxtrain.LayerNormMLP)) and w is not None:
                nn.init.normal_(w, std=0.02)

    def forward(self, idx, targets=None):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (KiB on Linux)


def evaluate(model, val_ids, args, device, recipe) -> float:
    model.eval()
    losses = []
    with torch.no_grad(), mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe), autocast_ctx(args, device):
        for x, y in get_lm_batches(val_ids, args.batch_size, args.seq_len, seed=1234, num_batches=args.eval_batches,
                                   device=device):
            losses.append(model(x, y).item())
    model.train()
    return sum(losses) / len(losses)


def autocast_ctx(args, device):
    if args.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def train(recipe_name: str, args, device, rank: int, world: int) -> dict:
    recipe = mxtrain.recipe_from_string(recipe_name)
    train_ids, val_ids, tok = austen_lm_tokens()
    cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads, activation=args.activation)
    torch.manual_seed(args.seed)  # same init for every recipe
    model = GPT(cfg).to(device)
    if world > 1:
        from torch.distributed.fsdp import fully_shard
        if args.mx_all_gather and recipe is not None:
            from mxtrain.distributed import enable_mx_all_gather
            enable_mx_all_gather(model, block_size=recipe.block_size, strict=False)  # before fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if args.prefetch:  # FSDP2's explicit prefetching: gathers issued blocks ahead of the host
            from mxtrain.distributed import set_block_prefetch
            set_block_prefetch(model.blocks, args.prefetch, args.prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    batches = get_lm_batches(train_ids, args.batch_size, args.seq_len, seed=args.seed + rank, device=device)
    tokens_per_step = args.batch_size * args.seq_len * world
    history = []
    ckpt_dir = (os.path.join(args.ckpt_dir, recipe_name.replace(":", "_").replace("=", "-")) if args.compare
                else args.ckpt_dir)
    start = 0
    if args.resume and ckpt_dir:
        from mxtrain.distributed.checkpoint import latest_checkpoint, load_checkpoint
        path = latest_checkpoint(ckpt_dir)
        if path is not None:
            meta = load_checkpoint(path, model, opt, recipe=recipe,
                                   allow_recipe_change=args.allow_recipe_change)
            start, history = meta["step"], meta["history"]
            sched.load_state_dict(meta["sched"])
            for _ in range(start):  # the data stream continues where it stopped
                next(batches)
            if rank == 0:
                print(f"resumed from {path} (step {start}, saved by {meta['world_size']} ranks)")
    fault_step = int(os.environ.get("MXTRAIN_FAULT_STEP", "-1"))  # fault drills (scripts/fault_resume_check.sh)
    bar = tqdm(range(start, args.steps), desc=f"{recipe_name:>6}", disable=rank != 0 or args.no_progress,
               file=sys.stdout)
    t0 = time.perf_counter()
    for step in bar:
        if step == fault_step and rank == int(os.environ.get("MXTRAIN_FAULT_RANK", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = next(batches)
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe), autocast_ctx(args, device):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        history.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if ckpt_dir and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            from mxtrain.distributed.checkpoint import save_checkpoint
            save_checkpoint(ckpt_dir, step + 1, model, opt,
                            extra={"sched": sched.state_dict(), "history": history}, recipe=recipe)
    elapsed = max(time.perf_counter() - t0, 1e-9)
    result = {
        "recipe": recipe_name,
        "train_loss": sum(history[-20:]) / len(history[-20:]),
        "eval_loss": evaluate(model, val_ids, args, device, recipe),
        "tokens_per_s": tokens_per_step * (args.steps - start) / elapsed,
        "peak_mem_mib": peak_memory_mib(device),
        "history": history,
    }
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="mxfp8", help="bf16 (high precision), mxfp8, mxfp6, mxfp4, mxint8, or "
                   "'mxfp8:fp8_format=hybrid' style strings")
    p.add_argument("--compare", default=None, help="comma-separated recipes to train one after the other")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--activation", default="gelu")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="high-precision compute dtype (torch.autocast bf16 on GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results (incl. loss history) to this file")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-mx-all-gather", dest="mx_all_gather", action="store_false",
                   help="under torchrun, all-gather the mxtrain weights in high precision instead of MX bytes")
    p.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="under torchrun, each block's forward gathers the next N blocks' weights and its backward the "
                        "N before it (FSDP2 explicit prefetching; 0: FSDP2's default order)")
    p.add_argument("--ckpt-dir", default=None, help="write torch.distributed.checkpoint checkpoints here "
                   "(a subdirectory per recipe with --compare); always at the last step")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in "
                   "--ckpt-dir (any world size)")
    p.add_argument("--allow-recipe-change", action="store_true", help="with --resume, accept a checkpoint saved "
                   "under another recipe (refused otherwise)")
    args = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device)
    if world > 1:
        import torch.distributed as dist
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    names = args.compare.split(",") if args.compare else [args.recipe]
    results = [train(n.strip(), args, device, rank, world) for n in names]
    if rank == 0:
        print(f"\n{'recipe':<28} {'train loss':>10} {'eval loss':>10} {'tokens/s':>10} {'peak MiB':>9}")
        for r in results:
            print(f"{r['recipe']:<28} {r['train_loss']:>10.4f} {r['eval_loss']:>10.4f} {r['tokens_per_s']:>10.0f} "
                  f"{r['peak_mem_mib']:>9.0f}")
        if len(results) > 1:
            base = results[0]["eval_loss"]
            for r in results[1:]:
                print(f"{r['recipe']} eval loss vs {results[0]['recipe']}: {100 * (r['eval_loss'] / base - 1):+.2f}%")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world_size": world, "results": results}, f, indent=1)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
