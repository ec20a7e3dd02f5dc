"""Triton kernel tests: on a machine without CUDA they run on Triton's CPU interpreter.

``TRITON_INTERPRET=1`` must be set before the kernel modules are imported (Triton
decides interpreter vs compiler when a kernel is decorated), so it is set here,
when pytest loads this conftest, before the test modules import anything. With
CUDA the same tests run compiled on the GPU (leave TRITON_INTERPRET unset there).
"""

import importlib.util
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def kdevice() -> torch.device:
    """Where kernel inputs live: the CPU under the interpreter, else the GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return torch.device("cpu")
    return torch.device("cuda")


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Kernel outputs start as 0xA5 bytes, so a byte the kernel forgot to write fails the comparison."""
    try:
        import mxtrain.kernels.cast as cast
        import mxtrain.kernels.dequantize as dequantize
    except ImportError:
        yield
        return
    monkeypatch.setattr(cast, "POISON_OUTPUTS", True)
    monkeypatch.setattr(dequantize, "POISON_OUTPUTS", True)
    yield


_NAME = "kernel_helpers"  # a name no other test dir uses
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, pathlib.Path(__file__).with_name("helpers.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
