"""Whole training steps captured in a CUDA graph: the host issues one replay instead of thousands of launches.

Small and mid-sized models leave the GPU waiting on the host, which issues each step kernel by
kernel (more so under MX and FP8 recipes, whose casts are extra launches). A step whose work is
all on the GPU, with the same shapes and tensors every time, can be captured once and replayed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["make_graphed_step"]


def make_graphed_step(step: Callable[[], object], *, warmup: int = 3, stream: torch.cuda.Stream | None = None,
                      group=None):
    """Capture ``step()`` in a CUDA graph and return a function that replays it.

    ``step`` runs a whole training step on static tensors: its inputs are read from tensors that
    the caller refills in place (``ids.copy_(batch)``), it enters ``mx_autocast`` itself, calls
    ``backward`` and the optimizer (built with ``capturable=True``; ``zero_grad(set_to_none=False)``
    inside the step, or gradients made before the capture, so their addresses stay fixed).
    It runs ``warmup`` times on a side stream first (kernel builds, autotuning, lazy state such as
    DelayedScaling's slots): real steps, which update the weights, the optimizer and recipe state on
    the batch the static tensors hold. Then it is captured on the same stream. The returned function returns what ``step``
    returned during the capture; its tensors hold each replay's values.

    mxtrain's stochastic-rounding generators on the device are registered with the graph, so each
    replay draws fresh random bits. A step that synchronises with the host (``.item()``, printing a
    tensor, a data-dependent shape) cannot be captured: the error names the operation. The process stays
    usable after a failed capture (the random generators the capture took are released from it).

    Distributed steps (FSDP2's ``fully_shard`` with NCCL, mxtrain's quantized all-gathers included) are
    captured whole: every rank of ``group`` (default: all ranks) calls ``make_graphed_step`` at the same
    point, as it would a collective, and each replay runs the step's all-gathers, reduce-scatters and casts
    from the graph. The host decisions of the captured step are fixed: its recipe, which planes each gather
    sends, FSDP2's reshard and prefetch settings, gradient synchronisation; capture again to change them. The
    ranks agree after the capture (over a gloo group made for it): if any rank failed to capture, every rank
    raises, instead of replaying a graph whose collectives would wait for that rank forever. Load checkpoints
    before the capture: loading optimizer state replaces the tensors the graph reads. Eager forwards between
    replays (evaluation) see the replays' weights: each replay reshards the groups an eager forward left
    unsharded and marks the parameters it wrote as changed (``mxtrain.distributed.fsdp.ReplayBookkeeping``).
    """
    if not callable(step):
        raise TypeError(f"make_graphed_step expects a callable step, got {type(step).__name__}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (lazy state is made in the warm-up, not under capture), "
                         f"got {warmup!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_step needs a CUDA device: CUDA graphs capture GPU work only")
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    from mxtrain.modules._common import _GENERATORS

    device = torch.cuda.current_device()
    generators = [gen for (_, dev), gen in _GENERATORS.items()
                  if dev.type == "cuda" and (dev.index is None or dev.index == device)]
    for gen in generators:
        if not hasattr(graph, "register_generator_state"):
            raise RuntimeError("make_graphed_step: this torch cannot register a stochastic-rounding "
                               "generator with a CUDA graph (CUDAGraph.register_generator_state); "
                               "use a recipe without stochastic rounding or a newer torch")
        graph.register_generator_state(gen)
    agree = _capture_agreement(group)
    books = _fsdp_bookkeeping()
    try:
        with torch.cuda.graph(graph, stream=side):
            out = step()
    except RuntimeError as e:
        _release_generators(generators, side)
        if agree is not None:
            agree(False)
        raise RuntimeError(
            f"make_graphed_step: the step could not be captured in a CUDA graph ({e}). Everything in it must "
            "run on the GPU without waiting for the host: no .item()/.cpu()/print of a tensor, no shapes that "
            "depend on values, no CPU tensors, and an optimizer built with capturable=True") from e
    if agree is not None:
        agree(True)
    if books is not None:
        books.captured()

    def replay():
        if books is not None:
            books.before_replay()
        graph.replay()
        if books is not None:
            books.after_replay()
        return out

    replay.graph = graph
    return replay


def _fsdp_bookkeeping():
    """A ``ReplayBookkeeping`` where FSDP2 states exist in this process (the step may be sharded), else None."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from mxtrain.distributed.fsdp import ReplayBookkeeping, _live_param_groups

    return ReplayBookkeeping() if _live_param_groups() else None


def _release_generators(generators: list, stream) -> None:
    """Take the random generators of a failed capture out of capture mode.

    A capture marks torch's CUDA generator (and the ones registered with it) as capturing until the capture ends
    well; one that fails leaves the mark, and every later draw outside a capture raised "Offset increment outside
    graph capture encountered unexpectedly". An empty capture that ends well clears it."""
    repair = torch.cuda.CUDAGraph()
    for gen in generators:
        repair.register_generator_state(gen)
    try:
        with torch.cuda.graph(repair, stream=stream):
            pass
    except RuntimeError:  # (the caller raises the capture's own error)
        pass


_AGREEMENT_GROUPS: dict = {}


def _capture_agreement(group):
    """Under torch.distributed with more than one rank in ``group``: a function ``agree(ok)`` that every rank
    calls after its capture; it raises on the ranks that captured when another did not. None otherwise.

    The flags travel over a gloo group of the same ranks (made here, every rank at once, and kept): a failed
    capture may leave the rank's NCCL stream unusable, and a CPU collective needs none."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("make_graphed_step: group was given but torch.distributed is not initialized")
        return None
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if len(ranks) == 1:
        return None
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"make_graphed_step: this rank ({me}) is not in group (ranks {list(ranks)}); call it with "
                         "the group of the ranks that capture together")
    gloo = _AGREEMENT_GROUPS.get(ranks)
    if gloo is None:
        gloo = _AGREEMENT_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)

    def agree(ok: bool) -> None:
        flags = [torch.zeros(1, dtype=torch.int32) for _ in ranks]
        dist.all_gather(flags, torch.tensor([int(ok)], dtype=torch.int32), group=gloo)
        failed = [r for r, f in zip(ranks, flags) if not int(f)]
        if failed and ok:
            raise RuntimeError(f"make_graphed_step: rank(s) {failed} could not capture the step (their own error "
                               "says why); this rank captured it, but its graph's collectives would wait for them "
                               "in every replay, so it is not returned")
    return agree
