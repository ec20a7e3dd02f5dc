"""A clone folder named ``mxtrain`` found on sys.path before the installed package does not shadow it.

Without the repository's root ``__init__.py`` the clone imports as an empty namespace package and the user
meets "module 'mxtrain' has no attribute 'LayerNormMLP'"; with it, ``import mxtrain`` gives the clone's
``mxtrain/`` package. Each test builds the situation in a temporary folder and imports in a fresh process.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = "import mxtrain, mxtrain.formats\nprint('imported', mxtrain.LayerNormMLP.__name__, mxtrain.__file__)\n"


def _link(link: pathlib.Path, target: pathlib.Path) -> None:
    try:
        link.symlink_to(target, target_is_directory=True)
    except OSError as err:  # pragma: no cover - filesystems without symlinks
        pytest.skip(f"cannot create a symlink here: {err}")


def _run(args, cwd, pythonpath=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.parametrize("how", ["script", "-c"])
def test_clone_named_mxtrain_beside_the_script_imports_its_package(tmp_path, how):
    _link(tmp_path / "mxtrain", REPO)  # a clone named mxtrain in the folder the user runs from
    (tmp_path / "run.py").write_text(SCRIPT)
    out = _run(["run.py"] if how == "script" else ["-c", SCRIPT], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("imported LayerNormMLP"), out.stdout
    assert out.stdout.split()[-1] == str(tmp_path / "mxtrain" / "mxtrain" / "__init__.py")


def test_without_the_guard_the_clone_shadows_the_package(tmp_path):
    # the failure the guard prevents: the same layout with no root __init__.py, the package installed
    # in editable mode (its finder comes after the path finder, which takes the clone as a namespace package)
    clone = tmp_path / "mxtrain"
    clone.mkdir()
    _link(clone / "mxtrain", REPO / "mxtrain")
    (tmp_path / "run.py").write_text(SCRIPT)
    if _run(["-c", "import mxtrain"], cwd=pathlib.Path("/")).returncode != 0:
        pytest.skip("mxtrain is not installed here (found on PYTHONPATH only): the shadowing needs an install")
    out = _run(["run.py"], cwd=tmp_path)
    if out.returncode == 0:
        pytest.skip("mxtrain is installed here where the path finder finds it first (not an editable install)")
    assert "has no attribute 'LayerNormMLP'" in out.stderr, out.stderr
    shutil.copy(REPO / "__init__.py", clone / "__init__.py")
    out = _run(["run.py"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_pytest_in_a_clone_named_mxtrain(tmp_path):
    # pytest imports a rootdir holding __init__.py under the folder's name, with its parent on sys.path
    clone = tmp_path / "mxtrain"
    (clone / "tests").mkdir(parents=True)
    shutil.copy(REPO / "__init__.py", clone / "__init__.py")
    _link(clone / "mxtrain", REPO / "mxtrain")
    (clone / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    (clone / "tests" / "test_import.py").write_text(
        "import mxtrain\n\ndef test_package():\n    assert mxtrain.LayerNormMLP.__name__ == 'LayerNormMLP'\n")
    out = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=clone)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
