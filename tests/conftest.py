"""Every test that needs CUDA carries the ``gpu`` marker, so ``-m gpu`` selects the GPU tier
(scripts/run_gpu_tests.sh --quick) and ``-m "not gpu"`` leaves it out.

Tests under tests/gpu/ and tests skipped by a ``skipif`` whose reason names CUDA get
the marker here if their module did not give it. ``mx_config`` sets mxtrain.config
switches for one test. Nothing of mxtrain is imported at the top here: the kernel test
directories set TRITON_INTERPRET in their own conftest before any kernel module is imported.
"""

import contextlib
import pathlib

import pytest

_GPU_DIR = pathlib.Path(__file__).resolve().with_name("gpu")


def _skips_without_cuda(item) -> bool:
    """A ``skipif`` that names CUDA and not the interpreter (those tests run without a GPU too)."""
    reasons = [str(m.kwargs.get("reason", "")).lower() for m in item.iter_markers("skipif")]
    return any("cuda" in r and "interpret" not in r for r in reasons)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is None and (
                _GPU_DIR in pathlib.Path(str(item.fspath)).resolve().parents or _skips_without_cuda(item)):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def mx_config():
    """Set ``mxtrain.config`` switches for one test: ``mx_config(backend="triton", fuse_sources=False)``.

    Each call overrides the named fields (see :class:`mxtrain.config.Settings`) until the test ends;
    later calls win. Returns the active settings.
    """
    from mxtrain import config

    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(config.override(**values))
