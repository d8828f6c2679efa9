"""Write README.md from nbs/index.ipynb with the docs site's notebook tooling (docs/nbdocs.py).

The notebook is rendered as stored (it is not executed): nbdev directives are applied as on the site (`#| hide`
cells left out, `#|` lines dropped), then nbconvert's markdown exporter writes GitHub markdown (code fenced as
python, text outputs fenced, figures left out).
Usage: python docs/make_readme.py [--check]   (--check exits 1 if README.md is out of date)
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

from nbdocs import render_readme  # noqa: E402


def main() -> int:
    readme, text = ROOT / "README.md", render_readme(ROOT / "nbs" / "index.ipynb")
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text(encoding="utf-8") != text:
            print("README.md is out of date with nbs/index.ipynb: run `python docs/make_readme.py`")
            return 1
        return 0
    readme.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
