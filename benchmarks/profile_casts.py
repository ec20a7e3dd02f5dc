#!/usr/bin/env python
"""Run each MXFP8 row+col cast once after a warm-up, for a profiler (``ncu``) to read its counters.

    ncu --clock-control none -k regex:mx_cast --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy python benchmarks/profile_casts.py
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main() -> int:
    from mxtrain.kernels import cast, cuda_cast

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    runs = [lambda: cast.triton_quantize(x, "fp8_e4m3", axis=(-1, 0))]
    if cuda_cast.library() is not None:
        runs.append(lambda: cuda_cast.cuda_quantize(x, "fp8_e4m3", axis=(-1, 0)))
    for fn in runs:  # compile / build outside the profiled launches
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
