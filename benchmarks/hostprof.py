"""Where the host's time goes while it issues training steps: cProfile over a few steps, two short tables.

Used by ``bench_e2e.py --host-profile`` and ``bench_moe.py --host-profile``. The steps run back to back with one
synchronisation before and after (so the profile is the host's issue, not a wait for the GPU, as long as the GPU
keeps up); cProfile's own overhead inflates every figure (roughly 2x on calls of a few microseconds), so read the
ranking, not the absolute times. ``--host-profile-out DIR`` also keeps each profile as a ``.prof`` file
(``python -m pstats`` or snakeviz read it). On Python 3.12, whose cProfile rides ``sys.monitoring``, the profile
also holds the autograd engine's device thread (where a CUDA backward's Python runs); on 3.11 that thread's work
appears as the one ``run_backward`` call that waits for it.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re


def _name(func: tuple) -> str:
    path, line, name = func
    if path == "~":  # a builtin: "<method 'x' of 'y' objects>" or "<built-in method torch.foo>"
        return re.sub(r"^<(?:built-in method|method) ", "", name).rstrip(">")
    parts = path.replace("\\", "/").split("/")
    # from the last package folder named in the path (site-packages/triton, not /opt/torch/.venv above it)
    at = [i for i, part in enumerate(parts) if part in ("mxtrain", "torch", "triton", "torchao", "transformers")]
    parts = parts[at[-1]:] if at else parts[-2:]
    return f"{'/'.join(parts)}:{line}({name})"


def host_profile(step, steps: int, label: str, rows: int = 25, sync=None, out_dir: str | None = None) -> str:
    """cProfile ``steps`` calls of ``step``; returns (and the caller prints) the top ``rows`` functions by own time
    and by inclusive time, per step, in milliseconds."""
    if sync is not None:
        sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    if sync is not None:
        sync()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        prof.dump_stats(os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", label) + ".prof"))
    stats = pstats.Stats(prof, stream=io.StringIO())
    table = stats.stats  # {func: (primitive calls, calls, own s, inclusive s, callers)}
    total = sum(v[2] for v in table.values())
    calls = sum(v[1] for v in table.values())
    lines = [f"## host profile: {label} ({steps} steps under cProfile): {1e3 * total / steps:.1f} ms of "
             f"profiled time and {calls // steps} calls a step"]
    for title, key in (("own", 2), ("inclusive", 3)):
        lines.append(f"{'ms/step ' + title:>16} {'calls/step':>11}  function")
        for func, v in sorted(table.items(), key=lambda kv: -kv[1][key])[:rows]:
            lines.append(f"{1e3 * v[key] / steps:16.2f} {v[1] / steps:11.1f}  {_name(func)}")
    return "\n".join(lines)
