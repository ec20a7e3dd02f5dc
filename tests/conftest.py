"""Fixtures shared by every test folder."""

import contextlib

import pytest

from mxtrain import config


@pytest.fixture
def mx_config():
    """Set ``mxtrain.config`` switches for one test: ``mx_config(backend="triton", fuse_sources=False)``.

    Each call overrides the named fields (see :class:`mxtrain.config.Settings`) until the test ends;
    later calls win. Returns the active settings.
    """
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(config.override(**values))
