"""Whole training steps captured in a CUDA graph: the host issues one replay instead of thousands of launches.

Small and mid-sized models leave the GPU waiting on the host, which issues each step kernel by
kernel (more so under MX and FP8 recipes, whose casts are extra launches). A step whose work is
all on the GPU, with the same shapes and tensors every time, can be captured once and replayed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["make_graphed_step"]


def make_graphed_step(step: Callable[[], object], *, warmup: int = 3, stream: torch.cuda.Stream | None = None):
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
    tensor, a data-dependent shape) cannot be captured: the error names the operation. After a failed
    capture torch's own CUDA generator may refuse further draws in this process: fix the step and restart.
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
    for (_, dev), gen in _GENERATORS.items():
        if dev.type == "cuda" and (dev.index is None or dev.index == device):
            if not hasattr(graph, "register_generator_state"):
                raise RuntimeError("make_graphed_step: this torch cannot register a stochastic-rounding "
                                   "generator with a CUDA graph (CUDAGraph.register_generator_state); "
                                   "use a recipe without stochastic rounding or a newer torch")
            graph.register_generator_state(gen)
    try:
        with torch.cuda.graph(graph, stream=side):
            out = step()
    except RuntimeError as e:
        raise RuntimeError(
            f"make_graphed_step: the step could not be captured in a CUDA graph ({e}). Everything in it must "
            "run on the GPU without waiting for the host: no .item()/.cpu()/print of a tensor, no shapes that "
            "depend on values, no CPU tensors, and an optimizer built with capturable=True") from e

    def replay():
        graph.replay()
        return out

    replay.graph = graph
    return replay
