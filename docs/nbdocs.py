"""Notebook processing shared by the docs site (docs/hooks.py) and the README (docs/make_readme.py).

- `directives` / `process_notebook`: nbdev's cell directives, applied the way nbdev's docs apply them: cells with
  `#| hide` (or `#| include: false`) are dropped, `#| echo: false` hides a cell's code, `#| output: false` its outputs,
  and every `#|` line is stripped from the code that is shown.
- `execute_notebooks`: runs notebooks the way `nbdev_test` does (execnb's `CaptureShell`, one fresh process per
  notebook, the working directory `nbs/`, the repository root on `sys.path`, two at a time), skipping the cells that
  `nbdev_test` skips (flags in settings.ini's `tst_flags` such as `slow` and `cuda`, and `#| eval: false`), and keeps
  the executed copies in a cache keyed by everything that can change their outputs. The docs build and
  tests/test_notebooks.py both run notebooks through it, so CI runs each notebook once per commit, not twice.
- `render_readme`: the README, GitHub-flavoured markdown, through nbconvert's markdown exporter.

Why execute at build time: the notebooks are stored with their figures' images only (docs/keep_figures.py), and the
site must show every printed result too, so the build runs them. A cold build of the ~10 notebooks costs about as long as
`nbdev_test` (a minute or two on two cores); the cache under `_proc/docs/exec/` makes a rebuild after an unrelated
change take seconds. Any exception stops the build (the equivalent of `allow_errors: false`).

Run as a script, `python docs/nbdocs.py execute SRC DEST` executes one notebook (the child process).
"""
from __future__ import annotations

import configparser
import copy
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"
CACHE = ROOT / "_proc" / "docs" / "exec"
HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"

_DIRECTIVE = re.compile(r"^\s*#\s*\|")
_NOT_RUN_TAG = "not run in the docs build"


def notebooks() -> list[Path]:
    "Every notebook in `nbs/`, in file-name order (nbdev skips names that start with `_` or `.`)."
    return sorted(p for p in NBS.glob("*.ipynb") if not p.name.startswith(("_", ".")))


def tst_flags() -> set[str]:
    "The flags (settings.ini `tst_flags`) whose cells `nbdev_test` does not run: they are not run for the docs either."
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "settings.ini")
    return set(cfg.get("DEFAULT", "tst_flags", fallback="").split())


def cell_source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def directives(source: str) -> dict[str, list[str]]:
    "nbdev's directives: the `#| ...` comment lines before a cell's first line of code. `#| eval: false` -> {'eval:': ['false']}."
    found = {}
    for line in source.splitlines():
        if not line.strip():
            continue
        if not _DIRECTIVE.match(line):
            break
        words = _DIRECTIVE.sub("", line, count=1).strip()
        words = words.replace(":", ": ", 1) if ":" in words else words
        if words.endswith(":"):  # `#| hide:` is quarto's spelling of `#| hide`
            words = words[:-1]
        if words.split():
            name, *args = words.split()
            found[name] = args
    return found


def _false(d: dict, key: str) -> bool:
    return d.get(key, [""])[:1] == ["false"]


def not_run_reason(cell: dict, flags: set[str]) -> str | None:
    "Why `nbdev_test` (and so the docs build) does not run this cell, or None when it does."
    if cell.get("cell_type") != "code":
        return "not code"
    src = cell_source(cell)
    if "nbdev_export" + "(" in src:
        return "nbdev_export"
    d = directives(src)
    if _false(d, "eval:"):
        return "eval: false"
    skipped = sorted(flags & d.keys())
    return ", ".join(skipped) if skipped else None


def default_exp(nb: dict) -> str | None:
    "The module a notebook exports to (`#| default_exp layers.linear` -> 'layers.linear'), if any."
    for cell in nb["cells"]:
        if cell.get("cell_type") == "code":
            args = directives(cell_source(cell)).get("default_exp")
            if args:
                return args[0]
    return None


def process_notebook(nb: dict, *, flags: set[str] = frozenset(), mark_not_run: bool = False) -> dict:
    """A copy of `nb` as a reader sees it: hidden cells dropped, `#|` lines stripped, cells left empty dropped.

    With `mark_not_run`, a code cell that the build did not run (a `tst_flags` flag, `eval: false`) gets a cell tag
    saying so, which the site's notebook template shows above the cell."""
    out = copy.deepcopy(nb)
    cells = []
    for cell in out["cells"]:
        src = cell["source"] = cell_source(cell)
        d = directives(src)
        if "hide" in d or _false(d, "include:"):
            continue
        if cell.get("cell_type") == "code":
            reason = not_run_reason(cell, flags)
            code = "\n".join(l for l in src.splitlines() if not _DIRECTIVE.match(l)).strip("\n")
            cell["source"] = code
            if _false(d, "output:"):
                cell["outputs"] = []
            if _false(d, "echo:") or "hide_input" in d:
                cell.setdefault("metadata", {}).setdefault("transient", {})["remove_source"] = True
            if not code.strip() and not cell.get("outputs"):
                continue
            if mark_not_run and reason:
                tags = cell.setdefault("metadata", {}).setdefault("tags", [])
                tags.append(f"{_NOT_RUN_TAG} ({reason})")
        cells.append(cell)
    for i, cell in enumerate(cells):  # nbformat 4.5 wants cell ids (nbdev_clean may strip them)
        cell.setdefault("id", f"cell-{i}")
    out["cells"] = cells
    out["nbformat"], out["nbformat_minor"] = 4, max(5, out.get("nbformat_minor", 5))
    out.setdefault("metadata", {}).setdefault(
        "kernelspec", {"display_name": "Python 3", "language": "python", "name": "python3"})
    out["metadata"].setdefault("language_info", {"name": "python"})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Execution (with a cache)

def _environment_key() -> bytes:
    "Everything besides the notebook that can change what it prints: the package, data in nbs/, this file, settings, versions."
    h = hashlib.sha256()
    for p in sorted((ROOT / "minivllm").rglob("*")):  # code, and data it ships (a default model's weights)
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    for p in sorted(NBS.iterdir()):  # data the notebooks read and draw (measured figures such as bench_serve.json)
        if p.is_file() and p.suffix != ".ipynb":
            h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update(" ".join(sorted(tst_flags())).encode())
    h.update(sys.version.encode())
    for dist in ("torch", "transformers", "matplotlib", "execnb", "ipython", "numpy", "triton"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    return h.digest()


def _cache_path(nb_path: Path, env_key: bytes) -> Path:
    key = hashlib.sha256(env_key + nb_path.read_bytes()).hexdigest()[:20]
    return CACHE / f"{nb_path.stem}.{key}.ipynb"


class NotebookError(RuntimeError):
    pass


def _run_child(src: Path, dst: Path, timeout: float) -> tuple[Path, float]:
    start = time.time()
    tmp = dst.with_suffix(".tmp")
    cmd = [sys.executable, str(Path(__file__).resolve()), "execute", str(src), str(tmp)]
    # the notebooks check the C++ kernels themselves: a missing one is built before they use it, not in the background
    env = os.environ | {"MINIVLLM_KERNEL_BUILD": os.environ.get("MINIVLLM_KERNEL_BUILD", "wait")}
    proc = subprocess.run(cmd, cwd=NBS, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NotebookError(f"{src.name} failed to execute:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    tmp.replace(dst)
    return dst, time.time() - start


def _retried_marker(cached: Path) -> Path:
    "The file that says an executed copy passed only on its second try (a notebook that failed once beside another)."
    return cached.with_suffix(".retried")


def execute_notebooks(paths: list[Path], *, use_cache: bool = True, jobs: int = 2, timeout: float = 900,
                      log=print, retry: bool = True) -> dict[Path, Path]:
    """Executed copies of `paths` (from the cache when nothing they depend on changed). Raises NotebookError on failure.

    With `retry`, a notebook that fails is run once more, alone, and its copy is marked as passed on a second try;
    without, a failure is final and a marked copy does not count (the notebook runs again): what the tests ask."""
    CACHE.mkdir(parents=True, exist_ok=True)
    env_key = _environment_key()
    targets = {p: _cache_path(p, env_key) for p in paths}
    todo = [p for p, c in targets.items()
            if not (use_cache and c.exists() and (retry or not _retried_marker(c).exists()))]
    if len(todo) < len(paths):
        log(f"docs: {len(paths) - len(todo)} notebook(s) unchanged, outputs taken from {CACHE.relative_to(ROOT)}/")
    if todo:
        log(f"docs: executing {len(todo)} notebook(s), {jobs} at a time: {' '.join(p.name for p in todo)}")
        failed = {}
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {p: pool.submit(_run_child, p, targets[p], timeout) for p in todo}
            for p, fut in futures.items():
                try:
                    _, secs = fut.result()
                    _retried_marker(targets[p]).unlink(missing_ok=True)
                    log(f"docs:   {p.name} executed in {secs:.0f} s")
                except (NotebookError, subprocess.TimeoutExpired) as e:
                    failed[p] = str(e)
        if not retry and failed:
            raise NotebookError("\n\n".join(failed.values()))
        # subtle: notebooks that spawn rank processes share the machine (free ports, CPU) with the one running beside
        # them; a failure is retried once, alone, so that only a notebook that fails by itself fails the build
        errors = []
        for p, first in failed.items():
            log(f"docs:   {p.name} failed; running it again on its own. First failure:\n{first[-3000:]}")
            try:
                _, secs = _run_child(p, targets[p], timeout)
                _retried_marker(targets[p]).touch()
                log(f"docs:   {p.name} executed in {secs:.0f} s on the second try")
            except (NotebookError, subprocess.TimeoutExpired) as e:
                errors.append(str(e))
        if errors:
            raise NotebookError("\n\n".join(errors))
    for p, c in targets.items():  # drop stale copies of these notebooks, and their marks
        for old in [*CACHE.glob(f"{p.stem}.*.ipynb"), *CACHE.glob(f"{p.stem}.*.retried")]:
            if old not in (c, _retried_marker(c)):
                old.unlink(missing_ok=True)
    return targets


def _execute_one(src: Path, dst: Path) -> int:
    "Child process: run `src` like nbdev_test does and write it, with its outputs, to `dst`."
    sys.path.insert(0, str(ROOT))
    os.chdir(src.parent)
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell

    flags = tst_flags()
    nb = read_nb(src)
    shell = CaptureShell(src)
    try:
        shell.run_all(nb, exc_stop=True, preproc=lambda cell: not_run_reason(cell, flags) is not None)
    except BaseException:
        sys.stderr.write(shell.prettytb(fname=src) + "\n")
        return 1
    for cell in nb.cells:  # belt and braces: no traceback may reach the site
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                sys.stderr.write(f"{src.name}: a cell produced an error output: {out.get('ename')}: {out.get('evalue')}\n")
                return 1
    write_nb(nb, dst)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# README

README_HEADER = "<!-- WARNING: generated from nbs/index.ipynb by docs/make_readme.py; edit the notebook instead -->\n\n"


def render_readme(index: Path = NBS / "index.ipynb") -> str:
    "README.md from the notebook as stored: GitHub markdown through nbconvert, with the site's directive handling."
    import nbformat
    from nbconvert import MarkdownExporter

    nb = process_notebook(json.loads(index.read_text(encoding="utf-8")))
    node = nbformat.from_dict(nb)
    exporter = MarkdownExporter(template_file="readme.md.j2", extra_template_paths=[str(TEMPLATES)])
    body, _ = exporter.from_notebook_node(node)
    return README_HEADER + _squeeze_blank_lines(body).strip("\n") + "\n"


def _squeeze_blank_lines(md: str) -> str:
    "Runs of blank lines become one, except inside fenced code (the template leaves gaps between blocks)."
    out, fence, blank = [], None, False
    for line in md.split("\n"):
        marker = re.match(r"\s*(```+|~~~+)", line)
        if fence is None and marker:
            fence = marker.group(1)
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None and not line.strip():
            if blank:
                continue
            blank = True
            out.append(line)
            continue
        blank = False
        out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "execute":
        sys.exit(_execute_one(Path(sys.argv[2]).resolve(), Path(sys.argv[3]).resolve()))
    sys.exit(f"usage: {sys.argv[0]} execute SRC.ipynb DEST.ipynb")
