"""Helpers for the compat tests: microxcaling from third_party (skipped when absent), exact comparisons."""

import importlib
import pathlib
import sys

import pytest
import torch

MICROXCALING = pathlib.Path(__file__).resolve().parents[2] / "third_party" / "microxcaling"
MICROXCALING_COMMIT = "7bc41952de39"  # the microxcaling commit the compat layer is compared against
ENABLE_HINT = ("to run them, from the repository root: git clone https://github.com/microsoft/microxcaling "
               f"third_party/microxcaling && git -C third_party/microxcaling checkout {MICROXCALING_COMMIT}")


def load_microxcaling():
    """microxcaling's ``mx`` package, or skip the test when third_party/microxcaling is absent."""
    if not (MICROXCALING / "mx" / "__init__.py").is_file():
        pytest.skip(f"third_party/microxcaling is not checked out; {ENABLE_HINT}")
    if str(MICROXCALING) not in sys.path:
        sys.path.insert(0, str(MICROXCALING))
    try:
        return importlib.import_module("mx")
    except Exception as err:  # pragma: no cover - depends on the environment
        pytest.skip(f"microxcaling (third_party/microxcaling) does not import here: {err}")


@pytest.fixture(scope="session")
def ms():
    return load_microxcaling()


def same(a, b) -> bool:
    """Equal values (NaN equal to NaN, -0.0 equal to 0.0), same shape."""
    if a is None or b is None:
        return a is None and b is None
    a, b = a.detach().float(), b.detach().float()
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def mismatch(a, b) -> str:
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    bad = ~((a == b) | (a.isnan() & b.isnan()))
    return f"{int(bad.sum())} of {a.numel()} elements differ, max |diff| {float((a - b)[bad].abs().max()):.3g}"


sys.path.insert(0, str(pathlib.Path(__file__).parent))  # cases.py
