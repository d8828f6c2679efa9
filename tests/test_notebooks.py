"""Run every notebook through nbdev's test runner (cells flagged `cuda` or `slow` are skipped)."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NBS, ROOT

NOTEBOOKS = sorted(p.name for p in NBS.glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook(notebook):
    "The notebook runs top to bottom, and every test cell in it passes."
    nbdev_test = Path(sys.executable).parent / "nbdev_test"
    proc = subprocess.run([str(nbdev_test), "--path", str(NBS / notebook)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{notebook} failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-8000:]}"
