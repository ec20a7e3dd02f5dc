"""scripts/pytest_skip_summary.py (loaded by scripts/run_tests.sh) prints a line per skip reason with its count."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

TESTS = '''
import pytest

@pytest.mark.parametrize("i", range(3))
@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu(i):
    pass

def test_data():
    pytest.skip("data not installed")

def test_runs():
    pass
'''


def test_skip_reasons_grouped_with_counts(tmp_path):
    (tmp_path / "test_a.py").write_text(TESTS)
    (tmp_path / "test_b.py").write_text('import pytest\npytest.skip("needs CUDA", allow_module_level=True)\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "scripts.pytest_skip_summary", str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "5 skipped, by reason" in line)
    assert [line.split(None, 1) for line in lines[start + 1:start + 3]] == [["4", "needs CUDA"],
                                                                          ["1", "data not installed"]]
    assert "1 passed, 5 skipped" in lines[-1]
