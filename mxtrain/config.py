"""Every ``MXTRAIN_*`` environment switch, read once, in one place.

:func:`current` returns the active :class:`Settings`; the rest of the package asks it
instead of ``os.environ``. The environment is read when this module is first
imported (a bad value raises there, naming the variable and what it allows).
Tests and benchmarks change switches with :func:`override` (a context manager),
or the ``mx_config`` fixture of ``tests/conftest.py``; setting ``os.environ``
after import has no effect.

``MXTRAIN_BACKEND`` (:attr:`Settings.backend`) selects per operation:

- quantize / dequantize / FP8 cast (``mxtrain.kernels.dispatch``): the
  implementation, ``reference`` | ``triton`` | ``cuda`` (``cuda`` runs Triton's
  kernel where an operation has no CUDA C++ one); ``auto``: CUDA C++, then
  Triton on CUDA tensors, the reference elsewhere.
- GEMM (``dispatch.mx_gemm``): only ``reference`` changes it (fp32 GEMM of the
  dequantized operands); any other value takes the fastest GEMM there is.
- fused norm / activation + cast and bf16 dequantize (``kernels.cuda_cast``):
  the CUDA C++ kernel only where the cast would pick ``cuda``; ``triton``
  keeps Triton's fused kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, Mapping

__all__ = ["Settings", "current", "override", "use", "from_environ", "reload"]


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """On unless set to ``"0"`` (default True) / on only when ``"1"`` (default False)."""
    raw = env.get(name)
    if raw is None:
        return default
    return raw != "0" if default else raw == "1"


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(name, default)
    if raw not in allowed:
        raise ValueError(f"{name}={raw!r} is not allowed; allowed: {', '.join(allowed)}")
    return raw


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _norm_lookahead(env: Mapping[str, str]) -> int:
    raw = env.get("MXTRAIN_NORM_LOOKAHEAD", "6")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"MXTRAIN_NORM_LOOKAHEAD must be a positive integer (bands of 128 rows), got {raw!r}")
    return value


def _cast_strip(env: Mapping[str, str]) -> tuple[int, int, int, int] | None:
    raw = env.get("MXTRAIN_CAST_STRIP")
    if not raw or raw == "0":
        return None
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != 4:
        raise ValueError(f"MXTRAIN_CAST_STRIP must be 0 or REP,J,BLOCK_K,WARPS (four integers), got {raw!r}")
    return values  # type: ignore[return-value]


def _gather_values(env: Mapping[str, str]) -> bool | str:
    raw = _choice(env, "MXTRAIN_GATHER_VALUES", "auto", ("0", "1", "auto"))
    return {"0": False, "1": True}.get(raw, "auto")


def _path(env: Mapping[str, str], name: str) -> str | None:
    return env.get(name) or None


@dataclasses.dataclass(frozen=True)
class Settings:
    """The value of every switch; each field names its variable and default."""

    # kernel selection
    backend: str = "auto"  # MXTRAIN_BACKEND: auto | reference | triton | cuda (per operation: module docstring)
    cuda_kernels: bool = True  # MXTRAIN_CUDA_KERNELS=0: never build or use the CUDA C++ extension
    cuda_verbose: bool = False  # MXTRAIN_CUDA_VERBOSE=1: show the extension's build
    cuda_fused_sources: bool = True  # MXTRAIN_CUDA_FUSED_SOURCES=0: norm/activation + cast on Triton, not CUDA C++
    cuda_dequantize: bool = True  # MXTRAIN_CUDA_DEQUANTIZE=0: bf16 dequantize on Triton, not CUDA C++
    norm_lookahead: int = 6  # MXTRAIN_NORM_LOOKAHEAD: bands of 128 rows a norm's statistics run ahead (CUDA)
    triton_hw_fp8: bool = True  # MXTRAIN_TRITON_HW_FP8=0: no hardware FP8 conversion in Triton casts
    cast_strip: tuple[int, int, int, int] | None = None  # MXTRAIN_CAST_STRIP=REP,J,BLOCK_K,WARPS: strip kernel; 0/unset: tile kernel
    mx_scaled_mm: bool = True  # MXTRAIN_MX_SCALED_MM=0: no cuBLAS MX GEMM (torch._scaled_mm), Triton's instead
    # FP8 recipes
    fp8_fused_casts: bool = True  # MXTRAIN_FP8_FUSED_CASTS=0: FP8 operands cast by separate, unfused ops
    fp8_fast_accum: str = "fprop"  # MXTRAIN_FP8_FAST_ACCUM: all | none | fprop (fast accumulation in which GEMMs)
    fp8_block_gemm: str = "auto"  # MXTRAIN_FP8_BLOCK_GEMM: auto | triton | cublas (1x128/128x128 block GEMM)
    fp8_block_cast: str = "auto"  # MXTRAIN_FP8_BLOCK_CAST=triton: block cast on Triton, not CUDA C++
    # modules and distributed
    fuse_sources: bool = True  # MXTRAIN_FUSE_SOURCES=0: modules compute the norm/activation, then cast
    # MXTRAIN_COMPILE_FUSED_SOURCES=0: under torch.compile the modules run the norm / activation op, then the
    # cast op (default: the fused casts, registered ops, stay in the graph: fullgraph, eager's bits)
    compile_fused_sources: bool = True
    # MXTRAIN_STATIC_LAUNCH=0: leave how inductor launches mxtrain's traced Triton kernels to torch (default, on
    # CUDA: its static launcher, with no Triton launcher in Python per launch; mxtrain.kernels.static_launch)
    static_launch: bool = True
    carry_values: bool = True  # MXTRAIN_CARRY_VALUES=0: no bf16 dequantized planes carried to GEMMs (CUDA)
    grouped_mm: str = "auto"  # MXTRAIN_GROUPED_MM: auto (CUDA only) | 1 (always) | 0 (never) torch grouped GEMM
    gather_values: bool | str = "auto"  # MXTRAIN_GATHER_VALUES: 0 | 1 | auto, FSDP gathers dequantize to bf16
    # MXTRAIN_FSDP_BATCHED_CASTS: auto (CUDA) | 1 (any device) | 0 (never): the FP8 all-gathers' per-tensor
    # current-scaled casts of every weight in two launches a step (amaxes, codes), not a cast per weight and
    # gather, and a group's dgrad transposes after a gather in one launch for up to four weights
    fsdp_batched_casts: str = "auto"
    compat_reference: bool = False  # MXTRAIN_COMPAT_REFERENCE=1: compat.mx runs the reference quantizer
    # data and tests
    data_dir: str | None = None  # MXTRAIN_DATA_DIR: root of installed data (None: ~/.cache/mxtrain)
    fashion_mnist_dir: str | None = None  # MXTRAIN_FASHION_MNIST_DIR: the Fashion-MNIST folder
    smollm2_gguf: str | None = None  # MXTRAIN_SMOLLM2_GGUF: the SmolLM2 GGUF file (None: search)
    require_data: bool = False  # MXTRAIN_REQUIRE_DATA=1: tests fail, not skip, when data is missing
    fault_step: int = -1  # MXTRAIN_FAULT_STEP: fault drills kill a rank at this step (-1: never)
    fault_rank: int = 0  # MXTRAIN_FAULT_RANK: the rank the fault drill kills


def from_environ(env: Mapping[str, str] | None = None) -> Settings:
    """The settings ``env`` (default ``os.environ``) asks for; ValueError names a bad variable."""
    env = os.environ if env is None else env
    return Settings(
        backend=_choice(env, "MXTRAIN_BACKEND", "auto", ("auto", "reference", "triton", "cuda")),
        cuda_kernels=_flag(env, "MXTRAIN_CUDA_KERNELS", True),
        cuda_verbose=_flag(env, "MXTRAIN_CUDA_VERBOSE", False),
        cuda_fused_sources=_flag(env, "MXTRAIN_CUDA_FUSED_SOURCES", True),
        cuda_dequantize=_flag(env, "MXTRAIN_CUDA_DEQUANTIZE", True),
        norm_lookahead=_norm_lookahead(env),
        triton_hw_fp8=_flag(env, "MXTRAIN_TRITON_HW_FP8", True),
        cast_strip=_cast_strip(env),
        mx_scaled_mm=_flag(env, "MXTRAIN_MX_SCALED_MM", True),
        fp8_fused_casts=_flag(env, "MXTRAIN_FP8_FUSED_CASTS", True),
        fp8_fast_accum=env.get("MXTRAIN_FP8_FAST_ACCUM", "fprop"),
        fp8_block_gemm=env.get("MXTRAIN_FP8_BLOCK_GEMM", "auto"),
        fp8_block_cast=env.get("MXTRAIN_FP8_BLOCK_CAST", "auto"),
        fuse_sources=_flag(env, "MXTRAIN_FUSE_SOURCES", True),
        compile_fused_sources=_flag(env, "MXTRAIN_COMPILE_FUSED_SOURCES", True),
        carry_values=_flag(env, "MXTRAIN_CARRY_VALUES", True),
        grouped_mm=env.get("MXTRAIN_GROUPED_MM", "auto"),
        gather_values=_gather_values(env),
        static_launch=_flag(env, "MXTRAIN_STATIC_LAUNCH", True),
        fsdp_batched_casts=_choice(env, "MXTRAIN_FSDP_BATCHED_CASTS", "auto", ("auto", "0", "1")),
        compat_reference=_flag(env, "MXTRAIN_COMPAT_REFERENCE", False),
        data_dir=_path(env, "MXTRAIN_DATA_DIR"),
        fashion_mnist_dir=_path(env, "MXTRAIN_FASHION_MNIST_DIR"),
        smollm2_gguf=_path(env, "MXTRAIN_SMOLLM2_GGUF"),
        require_data=env.get("MXTRAIN_REQUIRE_DATA", "") not in ("", "0"),
        fault_step=_int(env, "MXTRAIN_FAULT_STEP", -1),
        fault_rank=_int(env, "MXTRAIN_FAULT_RANK", 0),
    )


_current: Settings = from_environ()


def current() -> Settings:
    """The active settings (read from the environment at import, changed by :func:`override`)."""
    return _current


def reload() -> Settings:
    """Read the environment again and make that the active settings (after changing ``os.environ``)."""
    global _current
    _current = from_environ()
    return _current


@contextlib.contextmanager
def override(**values) -> Iterator[Settings]:
    """Set some switches by field name for the ``with`` block, then restore them (nestable).

    ``with mxtrain.config.override(backend="triton", fuse_sources=False): ...``; an unknown
    name raises TypeError listing the fields. Process-wide, not per thread.
    """
    global _current
    names = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(f"unknown mxtrain.config setting(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
    saved = _current
    _current = dataclasses.replace(saved, **values)
    try:
        yield _current
    finally:
        _current = saved


@contextlib.contextmanager
def use(settings: Settings) -> Iterator[Settings]:
    """Make ``settings`` (e.g. ``dataclasses.replace(current(), ...)``, built once) the active settings for the
    ``with`` block. Unlike :func:`override`, entering it again makes no new object, so what is cached per
    settings object (the kernel registry's decisions) stays cached from one entry to the next."""
    global _current
    if not isinstance(settings, Settings):
        raise TypeError(f"mxtrain.config.use takes a Settings, got {type(settings).__name__}")
    saved = _current
    _current = settings
    try:
        yield settings
    finally:
        _current = saved
