"""Build the docs site from nbs/ into _docs/ (MkDocs + Material + mkdocs-jupyter + mkdocstrings; see mkdocs.yml).

Usage: python docs/build.py [--site-dir DIR] [--no-cache] [--jobs N]

Every nbs/*.ipynb becomes a page, in file-name order, index.ipynb the home page; each notebook is executed the
way nbdev_test runs it (cells flagged `slow` or `cuda` are not run; an error fails the build), and the outputs
are cached in _proc/docs/exec/ until the notebook or the package changes (--no-cache re-runs them all).
The site works offline: open _docs/index.html in a browser, or serve _docs/ with any static server.
`mkdocs build` does the same (the work is done by docs/hooks.py); this script adds the options and a timing.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(site_dir: str | Path | None = None, *, use_cache: bool = True, jobs: int | None = None,
          verbose: bool = False) -> Path:
    "Build the site into `site_dir` (default: mkdocs.yml's `_docs`) and return its folder. Raises on failure."
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config

    os.environ["MINIVLLM_DOCS_CACHE"] = "1" if use_cache else "0"
    if jobs:
        os.environ["MINIVLLM_DOCS_JOBS"] = str(jobs)
    logging.basicConfig(format="%(levelname)-7s -  %(message)s")
    logging.getLogger("mkdocs").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("mkdocs.hooks.minivllm").setLevel(logging.INFO)
    overrides = {"site_dir": str(Path(site_dir).resolve())} if site_dir else {}
    cfg = load_config(str(ROOT / "mkdocs.yml"), **overrides)
    mkdocs_build(cfg)
    return Path(cfg.site_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site-dir", help="where to write the site (default: _docs)")
    ap.add_argument("--no-cache", action="store_true", help="execute every notebook again")
    ap.add_argument("--jobs", type=int, help="notebooks executed at a time (default 2)")
    ap.add_argument("--verbose", action="store_true", help="show MkDocs' own progress")
    args = ap.parse_args()
    start = time.time()
    try:
        site = build(args.site_dir, use_cache=not args.no_cache, jobs=args.jobs, verbose=args.verbose)
    except Exception as e:  # mkdocs' Abort/PluginError carry the message; the traceback adds nothing
        print(f"docs build failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"docs: built {site} in {time.time() - start:.1f} s; open {site / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
