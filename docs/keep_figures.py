"""Keep the figures in the committed notebooks, so that a reader who opens one on GitHub or in Jupyter sees them
without running it.

Usage: python docs/keep_figures.py [NOTEBOOK ...]   execute the notebooks (default: all of nbs/) the way the docs
                                                    build does (cached) and store each figure cell's image
       python docs/keep_figures.py --check [...]    exit 1 naming each figure cell without its image, and each cell
                                                    with an output that is not a figure (CI runs this)

A figure cell is a code cell that draws with matplotlib outside a function definition (`plt.` or `fig.`/`ax.` at
the top level of the cell, or a call of a `draw_*`/`plot_*` function). Only its `image/png` outputs are kept;
every other cell keeps no output. Run it after changing a figure cell (or what it draws), then `nbdev_clean`.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nbdocs  # noqa: E402

_DRAWS = re.compile(r"^(?!\s*(def|class)\b)(?:\s*)(?:.*\b(plt|fig|axes?)\.\w+\(|.*\b(draw|plot)_\w+\()", re.M)


def _top_level(source: str) -> str:
    "The lines of `source` outside function and class bodies (what runs when the cell runs)."
    out, in_def = [], False
    for line in source.splitlines():
        if re.match(r"(def|class)\s", line) or line.startswith("@"):
            in_def = True
            continue
        if in_def and (line.startswith((" ", "\t")) or not line.strip()):
            continue
        in_def = False
        out.append(line)
    return "\n".join(out)


def is_figure_cell(cell: dict) -> bool:
    "Whether running this code cell draws a matplotlib figure."
    return cell["cell_type"] == "code" and bool(_DRAWS.search(_top_level(nbdocs.cell_source(cell))))


def _images(outputs: list[dict]) -> list[dict]:
    "Just the PNG images among `outputs`, as display_data outputs."
    return [{"output_type": "display_data", "metadata": {}, "data": {"image/png": o["data"]["image/png"]}}
            for o in outputs if "image/png" in o.get("data", {})]


def problems(path: Path) -> list[str]:
    "What is wrong with the committed figures of the notebook at `path`: one line per cell."
    nb = json.loads(path.read_text())
    found = []
    for i, cell in enumerate(nb["cells"]):
        outs = cell.get("outputs", [])
        if is_figure_cell(cell) and not _images(outs):
            found.append(f"{path.name}: cell {i} draws a figure but holds no image: run python docs/keep_figures.py {path.name}")
        elif outs and (not is_figure_cell(cell) or len(_images(outs)) != len(outs)):
            found.append(f"{path.name}: cell {i} holds an output that is not a figure: run python docs/keep_figures.py {path.name}")
    return found


def keep_figures(paths: list[Path]) -> None:
    "Execute `paths` (cached, like the docs build) and write each back with only its figure cells' images."
    executed = nbdocs.execute_notebooks(paths)
    for path in paths:
        nb, run = json.loads(path.read_text()), json.loads(executed[path].read_text())
        mine, theirs = [c for c in nb["cells"]], [c for c in run["cells"]]
        assert [c.get("id") for c in mine] == [c.get("id") for c in theirs], f"{path.name} changed while it ran"
        for cell, ran in zip(mine, theirs):
            if cell["cell_type"] == "code":
                cell["outputs"] = _images(ran.get("outputs", [])) if is_figure_cell(cell) else []
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    for path in paths:  # nbdev's own formatting, so that CI's nbdev_clean check changes nothing
        subprocess.run(["nbdev_clean", "--fname", str(path)], check=True, capture_output=True)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    names = [a for a in argv if a != "--check"]
    paths = [nbdocs.NBS / Path(n).name for n in names] if names else nbdocs.notebooks()
    if check:
        found = [line for p in paths for line in problems(p)]
        for line in found: print(line)
        return 1 if found else 0
    keep_figures(paths)
    found = [line for p in paths for line in problems(p)]
    for line in found: print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
