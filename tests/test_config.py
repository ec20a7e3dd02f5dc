"""mxtrain.config: every MXTRAIN_* switch parsed in one place, overridable for a block."""

import pathlib
import re

import pytest

from mxtrain import config


def test_defaults_and_parsing():
    assert config.from_environ({}) == config.Settings()
    s = config.from_environ({"MXTRAIN_BACKEND": "triton", "MXTRAIN_FUSE_SOURCES": "0", "MXTRAIN_CUDA_VERBOSE": "1",
                             "MXTRAIN_CAST_STRIP": "8,16,64,4", "MXTRAIN_GATHER_VALUES": "1",
                             "MXTRAIN_REQUIRE_DATA": "yes", "MXTRAIN_DATA_DIR": "/d", "MXTRAIN_FAULT_STEP": "5"})
    assert (s.backend, s.fuse_sources, s.cuda_verbose, s.cast_strip) == ("triton", False, True, (8, 16, 64, 4))
    assert (s.gather_values, s.require_data, s.data_dir, s.fault_step) == (True, True, "/d", 5)
    assert config.from_environ({"MXTRAIN_CAST_STRIP": "0", "MXTRAIN_GATHER_VALUES": "0"}).cast_strip is None
    assert config.from_environ({"MXTRAIN_REQUIRE_DATA": "0"}).require_data is False


@pytest.mark.parametrize("name, value, message", [
    ("MXTRAIN_BACKEND", "gpu", "allowed: auto, reference, triton, cuda"),
    ("MXTRAIN_CAST_STRIP", "8,16", "four integers"),
    ("MXTRAIN_GATHER_VALUES", "yes", "allowed: 0, 1, auto"),
    ("MXTRAIN_FAULT_STEP", "x", "must be an integer"),
])
def test_bad_values_name_the_variable(name, value, message):
    with pytest.raises(ValueError, match=f"{name}.*{re.escape(message)}"):
        config.from_environ({name: value})


def test_override_nests_and_restores(mx_config):
    before = config.current()
    with config.override(backend="reference") as outer:
        assert config.current() is outer and outer.backend == "reference"
        with config.override(fuse_sources=False):
            assert (config.current().backend, config.current().fuse_sources) == ("reference", False)
        assert config.current().fuse_sources is True
    assert config.current() is before
    with pytest.raises(TypeError, match="unknown mxtrain.config setting.*allowed: "):
        with config.override(bakend="triton"):
            pass
    assert config.current() is before
    mx_config(carry_values=False)
    assert config.current().carry_values is False


def test_only_config_reads_the_environment():
    """No file of the package, examples or benchmarks reads an MXTRAIN_* variable itself."""
    root = pathlib.Path(__file__).resolve().parents[1]
    pattern = re.compile(r"(environ\b|getenv\b)[^\n]*MXTRAIN_")
    offenders = [str(p.relative_to(root)) for folder in ("mxtrain", "examples", "benchmarks")
                 for p in (root / folder).rglob("*.py")
                 if p.name != "config.py" and pattern.search(p.read_text())]
    assert not offenders


def test_use_keeps_one_settings_object_across_entries():
    import dataclasses

    from mxtrain import config

    before = config.current()
    mine = dataclasses.replace(before, compile_fused_sources=not before.compile_fused_sources)
    for _ in range(2):
        with config.use(mine) as active:
            assert active is mine and config.current() is mine
        assert config.current() is before
    with pytest.raises(TypeError, match="takes a Settings"):
        with config.use({"compile_fused_sources": True}):
            pass
