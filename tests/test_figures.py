"""Figures are visible without running a notebook: each figure cell of a committed notebook holds its image, and no
other cell holds an output (docs/keep_figures.py writes them; this is its --check, without executing anything)."""
import json
import sys

import pytest

from conftest import NBS, ROOT

sys.path.insert(0, str(ROOT / "docs"))
import keep_figures  # noqa: E402

NOTEBOOKS = sorted(p for p in NBS.glob("*.ipynb") if not p.name.startswith(("_", ".")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_figure_is_committed_with_its_notebook(path):
    assert keep_figures.problems(path) == []


def test_the_check_names_a_missing_figure_and_a_stray_output(tmp_path):
    figure = {"cell_type": "code", "id": "a", "metadata": {}, "execution_count": None, "outputs": [],
              "source": "fig, ax = plt.subplots()\nax.plot([1, 2])"}
    printed = {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": None, "source": "print(1)",
               "outputs": [{"output_type": "stream", "name": "stdout", "text": "1\n"}]}
    nb = tmp_path / "x.ipynb"
    nb.write_text(json.dumps({"cells": [figure, printed], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert keep_figures.problems(nb) == [
        "x.ipynb: cell 0 draws a figure but holds no image: run python docs/keep_figures.py x.ipynb",
        "x.ipynb: cell 1 holds an output that is not a figure: run python docs/keep_figures.py x.ipynb"]
    assert sum(keep_figures.problems(p) == [] for p in NOTEBOOKS) == len(NOTEBOOKS)
    assert sum(keep_figures.is_figure_cell(c) for p in NOTEBOOKS for c in json.loads(p.read_text())["cells"]) >= 12
