"""Write README.md from nbs/index.ipynb: markdown cells as they are, code cells as fenced Python with text outputs.

Cells marked `#| hide` are left out and `#|` directive lines are dropped, as on the docs site.
Usage: python tools/make_readme.py [--check]   (--check exits 1 if README.md is out of date)
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cell_text(cell) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def render(nb: dict) -> str:
    parts = ["<!-- WARNING: generated from nbs/index.ipynb by tools/make_readme.py; edit the notebook instead -->\n"]
    for cell in nb["cells"]:
        text = cell_text(cell)
        lines = text.splitlines()
        if any(l.strip().replace(" ", "") in ("#|hide", "#|hide_input") for l in lines):
            continue
        if cell["cell_type"] == "markdown":
            parts.append(text.strip() + "\n")
        elif cell["cell_type"] == "code":
            code = "\n".join(l for l in lines if not l.lstrip().startswith("#|")).strip()
            if code:
                parts.append(f"```python\n{code}\n```\n")
            for out in cell.get("outputs", []):
                body = out.get("text") or out.get("data", {}).get("text/plain")
                if body:
                    body = "".join(body) if isinstance(body, list) else body
                    parts.append(f"```\n{body.rstrip()}\n```\n")
    return "\n".join(parts)


def main() -> int:
    nb = json.loads((ROOT / "nbs" / "index.ipynb").read_text())
    readme, text = ROOT / "README.md", render(nb)
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text() != text:
            print("README.md is out of date with nbs/index.ipynb: run `python tools/make_readme.py`")
            return 1
        return 0
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
