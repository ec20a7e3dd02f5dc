"""FP8 kernel tests run on Triton's CPU interpreter where there is no CUDA (set before kernels are imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
