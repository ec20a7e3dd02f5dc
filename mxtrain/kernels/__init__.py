"""Fast kernels (Triton here, CUDA C++ in mxtrain/csrc) and the one registry that picks them.

:mod:`mxtrain.kernels.dispatch` holds the entry points; :mod:`mxtrain.kernels.registry` picks, per call,
a GPU kernel or the exact reference in :mod:`mxtrain.quantization` (identical bits), and
:func:`explain` says which one runs and why the others do not.
"""

import os
import warnings

import torch

from mxtrain.kernels import dispatch
from mxtrain.kernels.dispatch import gemm_operand, mx_gemm, quantize
from mxtrain.kernels.registry import explain

__all__ = ["mx_gemm", "gemm_operand", "quantize", "explain", "static_launch"]

# inductor's switch (torch >= 2.8) and the variable that forces it, read by each compile worker as it starts
_STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"
_STATIC_LAUNCH_SET_BY = "MXTRAIN_SET_STATIC_LAUNCH"  # "1": mxtrain set that variable (here, or in a parent process)


def static_launch(environ=None) -> str:
    """Let ``torch.compile`` launch mxtrain's traced Triton kernels (``torch.library.triton_op``) through inductor's
    static CUDA launcher, as it launches the kernels it generates; returns what it did.

    Under compile, a step launches the FP8 casts, norms and activations of every layer from inductor's code. Torch
    launches user-defined Triton kernels through Triton's Python launcher by default (about 40 us of host time a
    launch on an H100 host), its own through a static launcher (a few us); an FSDP2 step of a 1B Llama is
    host-bound on them. Where a kernel cannot launch statically, inductor launches it as before. The switch is
    inductor's, for the process: other user-defined Triton kernels launch statically too.

    Runs when :mod:`mxtrain.kernels` is imported on a machine with CUDA, before any compile: it sets inductor's
    ``static_launch_user_defined_triton_kernels`` and the variable ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_
    TRITON_KERNELS=1`` in ``environ`` (default ``os.environ``), which the compile workers started later read (and
    so do child processes: ``MXTRAIN_STATIC_LAUNCH=0`` must be set where the first process that imports mxtrain
    starts; a child that asks for it while a parent's mxtrain set the variable is warned that it cannot take
    effect there). Nothing changes with ``MXTRAIN_STATIC_LAUNCH=0``, where the user set the variable, or where
    this torch has no such switch."""
    from mxtrain import config

    environ = os.environ if environ is None else environ
    inherited = environ.get(_STATIC_LAUNCH_SET_BY) == "1" and environ.get(_STATIC_LAUNCH_ENV) == "1"
    if not config.current().static_launch:
        if inherited:
            warnings.warn(f"MXTRAIN_STATIC_LAUNCH=0 cannot take effect in this process: a parent process that "
                          f"imported mxtrain set {_STATIC_LAUNCH_ENV}=1, which torch reads as it starts; set "
                          "MXTRAIN_STATIC_LAUNCH=0 before that parent process starts", RuntimeWarning, stacklevel=2)
            return "on (set by a parent process; MXTRAIN_STATIC_LAUNCH=0 comes too late here)"
        return "off (MXTRAIN_STATIC_LAUNCH=0)"
    if _STATIC_LAUNCH_ENV in environ and not inherited:
        return f"left as set ({_STATIC_LAUNCH_ENV}={environ[_STATIC_LAUNCH_ENV]})"
    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return "no inductor"
    if not hasattr(inductor_config, "static_launch_user_defined_triton_kernels"):
        return f"not in torch {torch.__version__}"
    inductor_config.static_launch_user_defined_triton_kernels = True
    environ[_STATIC_LAUNCH_ENV] = "1"
    environ[_STATIC_LAUNCH_SET_BY] = "1"
    if not getattr(inductor_config, "use_static_cuda_launcher", True):
        return "on, but inductor's static launcher itself is off (TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0)"
    return "on"


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
if torch.cuda.is_available():
    static_launch()
