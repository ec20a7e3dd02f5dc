"""Fast kernels (Triton here, CUDA C++ in mxtrain/csrc) and the one registry that picks them.

:mod:`mxtrain.kernels.dispatch` holds the entry points; :mod:`mxtrain.kernels.registry` picks, per call,
a GPU kernel or the exact reference in :mod:`mxtrain.quantization` (identical bits), and
:func:`explain` says which one runs and why the others do not.
"""

import os

import torch

from mxtrain.kernels import dispatch
from mxtrain.kernels.dispatch import gemm_operand, mx_gemm, quantize
from mxtrain.kernels.registry import explain

__all__ = ["mx_gemm", "gemm_operand", "quantize", "explain"]

_KERNELS_LOADED = False


def _load_kernels() -> None:
    """Import the kernel modules once, where they can run (they register themselves with the registry).

    Only with CUDA or ``TRITON_INTERPRET=1``: CPU-only users never pay for importing Triton. It lives here,
    above the kernel modules, and is handed to the dispatch point, so no kernel file imports another's importer.
    """
    global _KERNELS_LOADED
    if _KERNELS_LOADED or not (os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available()):
        return
    _KERNELS_LOADED = True
    try:
        import mxtrain.kernels.cast  # noqa: F401
        import mxtrain.kernels.dequantize  # noqa: F401
        if torch.cuda.is_available():
            import mxtrain.kernels.gemm  # noqa: F401
            import mxtrain.kernels.cuda_cast  # noqa: F401  (registers "cuda"; builds on first use)
    except ImportError:  # no (working) triton: the reference serves every call
        pass
    try:
        import mxtrain.kernels.float8_cast  # noqa: F401
        if torch.cuda.is_available():
            import mxtrain.kernels.float8_gemm  # noqa: F401
            import mxtrain.kernels.float8_state  # noqa: F401
    except ImportError:
        pass
    try:  # apart: no module uses it yet, and its failing to import must not take the FP8 GEMMs with it
        import mxtrain.kernels.grouped_float8_cast  # noqa: F401
    except ImportError:
        pass


dispatch.set_kernel_loader(_load_kernels)
