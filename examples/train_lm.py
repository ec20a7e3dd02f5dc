"""Train a small decoder-only transformer on Jane Austen, in bf16/fp32 or an MX recipe.

Single process:     python examples/train_lm.py --compare bf16,mxfp8
Distributed FSDP2:  torchrun --nproc_per_node=2 examples/train_lm.py --recipe mxfp8
Checkpoints:        ... --ckpt-dir ckpt --ckpt-every 50   (then add --resume to continue after a crash)
Smoke run:          python examples/train_lm.py --data random --steps 4 --d-model 64 --layers 1 --seq-len 16

Results (results.json, and loss.png with matplotlib) go to a run directory,
printed at the end (``--out``; default ``runs/train_lm/<date>-<time>``).

The attention projections are ``mxtrain.LayerNormLinear`` (qkv) and
``mxtrain.Linear`` (out); the MLPs are ``mxtrain.LayerNormMLP``. Attention itself
is torch's SDPA. Under ``torchrun`` every block and the root are wrapped with
torch's FSDP2 ``fully_shard`` (gloo on CPU, NCCL on GPU), and the weights of the
mxtrain modules are all-gathered as MX bytes, or FP8 codes under an FP8 recipe (``enable_mx_all_gather``,
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
from mxtrain import config
from mxtrain.cli import (HelpFormatter, check_device, check_writable_dir, clamp_warmup, new_run_dir, nonnegative_int,
                         positive_float, positive_int, run_label, save_results, split_recipe_specs)
from mxtrain.data import austen_lm_tokens, get_lm_batches
from mxtrain.modules.activations import ACTIVATIONS


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


def evaluate(model, val_ids, args, device, recipe, label: str = "", rank: int = 0) -> float:
    model.eval()
    losses = []
    batches = get_lm_batches(val_ids, args.batch_size, args.seq_len, seed=1234, num_batches=args.eval_batches,
                             device=device)
    bar = tqdm(batches, desc=f"{label} eval", total=args.eval_batches, unit="batch", leave=False,
               disable=rank != 0 or args.no_progress, file=sys.stdout, dynamic_ncols=True)
    with torch.no_grad(), mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe), autocast_ctx(args, device):
        for x, y in bar:
            losses.append(model(x, y).item())
    model.train()
    return sum(losses) / len(losses)


def autocast_ctx(args, device):
    if args.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def load_data(args):
    """``(train_ids, val_ids, vocab_size, description)``: Austen as bytes, or uniform random bytes."""
    if args.data == "random":  # for smoke and speed runs without the data set
        g = torch.Generator().manual_seed(args.seed)
        return (torch.randint(0, 256, (1 << 18,), generator=g), torch.randint(0, 256, (1 << 15,), generator=g),
                256, "random bytes")
    train_ids, val_ids, tok = austen_lm_tokens()
    return train_ids, val_ids, tok.vocab_size, "Austen (bytes)"


def ckpt_subdir(args, spec: str) -> str | None:
    """This recipe's checkpoint folder: ``--ckpt-dir``, or a subfolder per recipe when comparing."""
    if not args.ckpt_dir:
        return None
    return os.path.join(args.ckpt_dir, spec.replace(":", "_").replace("=", "-")) if args.compare else args.ckpt_dir


def train(spec: str, args, device, rank: int, world: int, data=None) -> dict:
    recipe = mxtrain.recipe_from_string(spec)
    label = run_label(spec, recipe is None, args.dtype)
    train_ids, val_ids, vocab_size, _ = data if data is not None else load_data(args)
    cfg = GPTConfig(vocab_size=vocab_size, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads, activation=args.activation)
    torch.manual_seed(args.seed)  # same init for every recipe
    model = GPT(cfg).to(device)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        if args.mx_all_gather and recipe is not None:
            from mxtrain.distributed import enable_mx_all_gather
            enable_mx_all_gather(model, recipe=recipe, strict=False)  # before fully_shard (MX or FP8 recipes)
        mesh = init_device_mesh(device.type, (world,))  # FSDP2's default is CUDA's wherever CUDA exists
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if args.prefetch:  # FSDP2's explicit prefetching: gathers issued blocks ahead of the host
            from mxtrain.distributed import set_block_prefetch
            set_block_prefetch(model.blocks, args.prefetch, args.prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    batches = get_lm_batches(train_ids, args.batch_size, args.seq_len, seed=args.seed + rank, device=device)
    tokens_per_step = args.batch_size * args.seq_len * world
    history = []
    ckpt_dir = ckpt_subdir(args, spec)
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
                print(f"[{label}] resumed from {path} (step {start}, saved by {meta['world_size']} ranks)")
    fault_step = config.current().fault_step  # fault drills (scripts/fault_resume_check.sh)
    bar = tqdm(range(start, args.steps), desc=f"{label} train", disable=rank != 0 or args.no_progress,
               file=sys.stdout, initial=start, total=args.steps, unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    for step in bar:
        if step == fault_step and rank == config.current().fault_rank:
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
        bar.set_postfix(loss=f"{history[-1]:.3f}")
        if ckpt_dir and ((args.ckpt_every and (step + 1) % args.ckpt_every == 0) or step + 1 == args.steps):
            from mxtrain.distributed.checkpoint import save_checkpoint
            written = save_checkpoint(ckpt_dir, step + 1, model, opt,
                                      extra={"sched": sched.state_dict(), "history": history}, recipe=recipe)
            if rank == 0:
                bar.write(f"[{label}] checkpoint of step {step + 1} written: {written}")
    bar.close()
    elapsed = max(time.perf_counter() - t0, 1e-9)
    tail = history[-20:]
    result = {
        "recipe": label,
        "spec": spec,
        "recipe_dict": recipe.to_dict() if recipe is not None else None,
        "train_loss": sum(tail) / max(1, len(tail)),
        "eval_loss": evaluate(model, val_ids, args, device, recipe, label, rank),
        "tokens_per_s": tokens_per_step * (args.steps - start) / elapsed if args.steps > start else float("nan"),
        "peak_mem_mib": peak_memory_mib(device),
        "history": history,
    }
    return result


def plot_losses(results: list[dict], path: str, title: str) -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=80)
    for r in results:
        h = r["history"]
        (line,) = ax.plot(range(1, len(h) + 1), h, lw=1.0, label=f"{r['recipe']} (eval {r['eval_loss']:.3f})")
    ax.set(xlabel="step", ylabel="train loss")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--recipe", default="mxfp8", help="bf16 (high precision: no MX, computed in --dtype), mxfp8, "
                   "mxfp6, mxfp4, mxint8, or 'mxfp8:fp8_format=hybrid' style strings")
    p.add_argument("--compare", action="append", default=None, metavar="RECIPES",
                   help="recipes trained one after the other from the same init: repeat the flag (--compare bf16 "
                        "--compare 'mxfp4:grad_rounding=stochastic,seed=0') or separate them with commas (a piece "
                        "with '=' but no ':' continues the options of the recipe before it)")
    p.add_argument("--steps", type=positive_int, default=200, help="training steps per recipe")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per rank and step")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence (the model's context)")
    p.add_argument("--d-model", type=positive_int, default=256, help="model width (a multiple of --heads)")
    p.add_argument("--layers", type=positive_int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    p.add_argument("--activation", default="gelu", choices=ACTIVATIONS, help="MLP activation")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="peak AdamW learning rate (warm-up, then cosine)")
    p.add_argument("--warmup", type=nonnegative_int, default=20, help="linear warm-up steps (at most --steps)")
    p.add_argument("--eval-batches", type=positive_int, default=8, help="held-out batches in the final evaluation")
    p.add_argument("--data", choices=["austen", "random"], default="austen",
                   help="'random': uniform random bytes (smoke and speed runs without the data set)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="high-precision compute dtype (torch.autocast bf16 on GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the initialization and batches")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for results.json and loss.png (default: runs/train_lm/<date>-<time>)")
    p.add_argument("--json", default=None, help="also write the results (incl. loss history) to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-mx-all-gather", dest="mx_all_gather", action="store_false",
                   help="under torchrun, all-gather the mxtrain weights in high precision instead of MX bytes")
    p.add_argument("--prefetch", type=nonnegative_int, default=0, metavar="N",
                   help="under torchrun, each block's forward gathers the next N blocks' weights and its backward the "
                        "N before it (FSDP2 explicit prefetching; 0: FSDP2's default order)")
    p.add_argument("--ckpt-dir", default=None, help="write torch.distributed.checkpoint checkpoints here "
                   "(a subdirectory per recipe with --compare); always at the last step")
    p.add_argument("--ckpt-every", "--save-every", dest="ckpt_every", type=nonnegative_int, default=0,
                   help="also checkpoint every N steps (0: only at the end; --save-every is its old name)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in "
                   "--ckpt-dir (any world size)")
    p.add_argument("--allow-recipe-change", action="store_true", help="with --resume, accept a checkpoint saved "
                   "under another recipe (refused otherwise)")
    return p


def parse_args(argv=None):
    """Parsed and checked options: recipe specs, shapes, device and folders are checked before any training."""
    p = build_parser()
    args = p.parse_args(argv)
    args.specs = split_recipe_specs(args.compare) if args.compare else [args.recipe.strip()]
    if not args.specs:
        p.error("--compare names no recipe; give e.g. --compare bf16,mxfp8")
    for spec in args.specs:
        try:
            mxtrain.recipe_from_string(spec)
        except (ValueError, TypeError) as err:
            p.error(f"recipe {spec!r}: {err}")
    if len(set(args.specs)) != len(args.specs):
        p.error(f"--compare names a recipe twice: {', '.join(args.specs)}")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    check_device(p, args.device)
    args.warmup = clamp_warmup(args.warmup, args.steps)
    return args


def main(argv=None) -> list[dict]:
    """Train every recipe; print and save the results. Exits 1 (after saving the finished runs) if a run failed."""
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device)
    run_dir = None
    if rank == 0:  # folders checked before any training
        if args.ckpt_dir:
            for spec in args.specs:
                check_writable_dir(ckpt_subdir(args, spec), "--ckpt-dir")
        run_dir = new_run_dir(args.out, os.path.join("runs", "train_lm"))
    if world > 1:
        import torch.distributed as dist
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    if rank == 0:
        print(f"loading data: {args.data}", flush=True)
    data = load_data(args)
    precision = f"high-precision compute {args.dtype} on {device.type}"
    if rank == 0:
        print(f"data: {data[3]}, {data[0].numel():,} train / {data[1].numel():,} held-out tokens; {precision}; "
              f"world size {world}, {args.batch_size}x{args.seq_len} tokens per rank and step", flush=True)
        if args.dtype == "fp32" and any(s.strip().lower() == "bf16" for s in args.specs):
            print("note: the recipe 'bf16' means no MX; with --dtype fp32 it computes in fp32 and is labelled fp32 "
                  "(--dtype bf16 for bf16 autocast)", flush=True)
    results, failures = [], []
    for spec in args.specs:
        try:
            results.append(train(spec, args, device, rank, world, data))
        except Exception as err:  # keep the finished runs; report this one
            if world > 1:
                raise  # the other ranks wait in collectives: a failed rank must end the job
            import traceback
            traceback.print_exc()
            failures.append({"spec": spec, "error": f"{type(err).__name__}: {err}"})
            print(f"[{spec}] failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    if rank == 0:
        if results:
            print(f"\n{'recipe':<28} {'train loss':>10} {'eval loss':>10} {'tokens/s':>10} {'peak MiB':>9}")
            for r in results:
                print(f"{r['recipe']:<28} {r['train_loss']:>10.4f} {r['eval_loss']:>10.4f} "
                      f"{r['tokens_per_s']:>10.0f} {r['peak_mem_mib']:>9.0f}")
            base = results[0]["eval_loss"]
            for r in results[1:]:
                print(f"{r['recipe']} eval loss vs {results[0]['recipe']}: {100 * (r['eval_loss'] / base - 1):+.2f}%")
        for f in failures:
            print(f"{f['spec']}: FAILED ({f['error']})")
        n_params = 12 * args.layers * args.d_model ** 2  # blocks only, for the title
        title = (f"GPT {args.layers} layers x {args.d_model} wide (~{n_params / 1e6:.1f}M block params) on "
                 f"{data[3]}; {args.dtype} on {device.type}, {world} rank(s), {args.steps} steps")
        payload = {"args": {k: v for k, v in vars(args).items()}, "world_size": world, "device": str(device),
                   "precision": precision, "torch": torch.__version__, "title": title, "results": results,
                   "failures": failures}
        written = save_results(run_dir, payload, (lambda png: plot_losses(results, png, title)) if results else None)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1, default=str)
            written.append(args.json)
        print(f"run directory: {run_dir} ({', '.join(os.path.basename(w) for w in written)})")
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    if failures:
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
