"""Every notebook runs top to bottom, and every test cell in it passes: executed as `nbdev_test` runs it (cells
flagged `cuda` or `slow` are skipped), by docs/nbdocs.py, which the docs build uses too.

An executed copy is cached under a key of the notebook, the package and the versions that can change its outputs,
so a notebook that the docs build (CI's step before this one) ran at this commit is not run a second time. A copy
that passed only on the docs build's second try does not count: the notebook runs again here, and one failure fails.
"""
import sys

import pytest

from conftest import NBS, ROOT

sys.path.insert(0, str(ROOT / "docs"))
import nbdocs  # noqa: E402

NOTEBOOKS = [p.name for p in nbdocs.notebooks()]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook(notebook):
    "The notebook runs top to bottom, and every test cell in it passes."
    try:
        nbdocs.execute_notebooks([NBS / notebook], jobs=1, retry=False, log=lambda *_: None)
    except nbdocs.NotebookError as e:
        pytest.fail(str(e)[-12000:], pytrace=False)
