"""The tree is lint-clean: ``ruff check`` (pyproject.toml's [tool.ruff]: pycodestyle errors and
warnings, pyflakes) finds nothing in the package, the tests, the benchmarks and the scripts.
Skipped where ruff is not installed (it is in the ``test`` extra)."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATHS = ["leanact", "tests", "benchmarks", "scripts"]


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *PATHS],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check {' '.join(PATHS)}: exit {r.returncode}\n{r.stdout}{r.stderr}"
