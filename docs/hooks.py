"""MkDocs hooks for the minivllm site (mkdocs.yml `hooks:`): the pages come from `nbs/`, not from the docs_dir.

- on_config: the navigation, made from every `nbs/*.ipynb` in file-name order (index.ipynb is the home page), then
  an "API reference" section with one mkdocstrings page per module a notebook exports (`#| default_exp`).
- on_pre_build: executes the notebooks (docs/nbdocs.py: like nbdev_test, cached, `slow`/`cuda` cells not run,
  any error stops the build), applies nbdev's directives (`#| hide` cells dropped, `#|` lines stripped: done here,
  on the executed copy, because mkdocs-jupyter's `remove_tag_config` reads cell tags, not `#|` comments), and
  writes the pages mkdocs-jupyter renders to `_proc/docs/pages/`. On the way, as nbdev's pages do, the title cell
  moves to the top; cells the build did not run get a tag saying so; figures get alt text; tqdm progress bars are
  dropped from stderr; names of notebooks and modules in `code` (the home page's table) link to their pages; and
  each notebook ends with a link to the API page of the module it exports.
- on_files: adds those pages, and the generated API pages, to the site (before mkdocs-jupyter wraps notebooks).
- mkdocs-jupyter's HTML exporter is patched to use docs/templates/notebook.html.j2, which drops nbconvert's
  cdnjs MathJax 2 and mermaid injections (the site serves MathJax 3 itself: nothing is fetched from the network).
- on_page_content: links between notebooks (`03_parallel_linear.ipynb`) point at their pages (`.html`), the
  table of contents is rebuilt from the rendered headings (mkdocs-jupyter's drops `code` from heading anchors), and
  ```mermaid blocks stay source code (the theme would fetch mermaid from unpkg to draw them).

Environment: MINIVLLM_DOCS_CACHE=0 re-executes every notebook; MINIVLLM_DOCS_JOBS=N runs N notebooks at a time (2).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import nbdocs  # noqa: E402

log = logging.getLogger("mkdocs.hooks.minivllm")
PAGES = nbdocs.ROOT / "_proc" / "docs" / "pages"
MKDOCS_JUPYTER_VERSION = "0.26.3"  # the version whose template and exporter call this file patches


# ---------------------------------------------------------------------------------------------------------------
# mkdocs-jupyter's exporter, with our template

def _patch_mkdocs_jupyter():
    from mkdocs_jupyter import __about__, nbconvert2

    if __about__.__version__ != MKDOCS_JUPYTER_VERSION:
        raise PluginError(f"docs/hooks.py patches mkdocs-jupyter {MKDOCS_JUPYTER_VERSION}, found "
                          f"{__about__.__version__}: check docs/templates/notebook.html.j2 and the pin")
    if getattr(nbconvert2.HTMLExporter, "_minivllm", False):
        return
    base = nbconvert2.HTMLExporter

    class SiteHTMLExporter(base):
        "mkdocs-jupyter's exporter with docs/templates/notebook.html.j2 (no CDN scripts) as its template."
        _minivllm = True

        def __init__(self, *args, template_file=None, extra_template_paths=(), **kwargs):
            super().__init__(*args, template_file="notebook.html.j2",
                             extra_template_paths=[str(nbdocs.TEMPLATES), *extra_template_paths], **kwargs)

    nbconvert2.HTMLExporter = SiteHTMLExporter


# ---------------------------------------------------------------------------------------------------------------
# pages

def _api_uri(module: str) -> str:
    return f"api/minivllm.{module}.md"


def _notebook_modules() -> dict[Path, str | None]:
    return {p: nbdocs.default_exp(json.loads(p.read_text(encoding="utf-8"))) for p in nbdocs.notebooks()}


_CODE_SPAN = re.compile(r"(?<![\[\w])`([\w.]+)`(?![\]\w])")


def _link_names(markdown: str, stems: set[str], modules: set[str]) -> str:
    "Link `03_parallel_linear` to its page and `minivllm.layers.linear` to its API page (outside code fences)."
    def link(m):
        name = m.group(1)
        if name in stems:
            return f"[`{name}`]({name}.html)"
        if name.startswith("minivllm.") and name[len("minivllm."):] in modules:
            return f"[`{name}`](api/{name}.html)"
        return m.group(0)
    parts = re.split(r"(^```.*?^```)", markdown, flags=re.S | re.M)
    return "".join(p if i % 2 else _CODE_SPAN.sub(link, p) for i, p in enumerate(parts))


def _add_alt_text(nb: dict) -> None:
    "Alt text for figures: the first sentence of the prose just before the cell that drew them."
    prose = ""
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = re.sub(r"[`*#>$\\]|\[|\]\([^)]*\)", "", cell["source"]).strip()
            prose = re.split(r"(?<=[.:!?])\s", " ".join(text.split()), maxsplit=1)[0][:200]
            continue
        for out in cell.get("outputs", []):
            for mime in ("image/png", "image/jpeg"):
                if mime in out.get("data", {}):
                    meta = out.setdefault("metadata", {}).setdefault(mime, {})
                    meta.setdefault("alt", f"Figure: {prose}" if prose else "A figure made by the code cell above")


_PROGRESS = re.compile(r"^.*\d+%\|.*\|.*$")


def _drop_progress_bars(nb: dict) -> None:
    "Drop tqdm progress bars (e.g. transformers' 'Loading weights: 100%|###|') from stderr outputs: noise on a page."
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                lines = re.split(r"(?<=[\r\n])", nbdocs.cell_source({"source": out.get("text", "")}))
                text = "".join(l for l in lines if not _PROGRESS.match(l.rstrip("\r\n")))
                if not text.strip():
                    continue
                out["text"] = text
            kept.append(out)
        cell["outputs"] = kept


def _stage(executed: dict[Path, Path], modules: dict[Path, str | None]) -> None:
    "Write the pages mkdocs-jupyter renders: processed, executed notebooks, with a closing link to their API page."
    flags = nbdocs.tst_flags()
    stems = {p.stem for p in executed}
    mods = {m for m in modules.values() if m}
    if PAGES.exists():
        shutil.rmtree(PAGES)
    PAGES.mkdir(parents=True)
    for src, run in executed.items():
        nb = nbdocs.process_notebook(json.loads(run.read_text(encoding="utf-8")), flags=flags, mark_not_run=True)
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                cell["source"] = _link_names(cell["source"], stems - {src.stem}, mods)
        module = modules.get(src)
        if module:
            nb["cells"].append({"cell_type": "markdown", "metadata": {}, "source": (
                "## API reference\n\n"
                f"The classes and functions this notebook exports into `minivllm.{module}`, with their signatures, "
                f"docstrings and source: [API reference for `minivllm.{module}`](api/minivllm.{module}.html).")})
        _title_first(nb)
        _add_alt_text(nb)
        _drop_progress_bars(nb)
        for i, cell in enumerate(nb["cells"]):  # the appended cell too
            cell.setdefault("id", f"cell-{i}")
        (PAGES / src.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False), encoding="utf-8")


def _title_first(nb: dict) -> None:
    "Move the title cell (`# Title` / `> summary`) to the top, as nbdev's pages do: cells before it (imports) follow."
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown" and cell["source"].lstrip().startswith("# "):
            nb["cells"].insert(0, nb["cells"].pop(i))
            return


def _title(nb_path: Path) -> str:
    "A notebook's title: its first `# heading` (its file name if it has none)."
    for cell in json.loads(nb_path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            m = re.search(r"^# (.+)$", nbdocs.cell_source(cell), flags=re.M)
            if m:
                return re.sub(r"[`*]", "", m.group(1)).strip()
    return nb_path.stem


def on_config(config, **kwargs):
    _patch_mkdocs_jupyter()
    modules = _notebook_modules()
    index = nbdocs.NBS / "index.ipynb"
    # explicit titles (mkdocs-jupyter's ignore_h1_titles keeps them): the notebooks' own, and "Home" for index
    nav = [{"Home": "index.ipynb"}] if index in modules else []
    nav += [{_title(p): p.name} for p in modules if p != index]
    api = [_api_uri(m) for m in modules.values() if m]
    if api:
        nav.append({"API reference": api})
    config["nav"] = nav
    return config


def on_pre_build(config, **kwargs):
    start = time.time()
    modules = _notebook_modules()
    try:
        executed = nbdocs.execute_notebooks(
            list(modules), use_cache=os.environ.get("MINIVLLM_DOCS_CACHE", "1") != "0",
            jobs=int(os.environ.get("MINIVLLM_DOCS_JOBS", "2")), log=log.info)
    except nbdocs.NotebookError as e:
        raise PluginError(f"a notebook failed while building the docs (fix it, or flag the cell `#| slow`):\n{e}")
    _stage(executed, modules)
    log.info(f"docs: {len(executed)} notebook page(s) ready in {time.time() - start:.1f} s")


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the .ipynb pages
def on_files(files, config, **kwargs):
    modules = _notebook_modules()
    for src, module in modules.items():
        # a File with a real src_dir, not File.generated: mkdocs-jupyter's NotebookFile wrapper reads abs_src_path
        # through src_dir, which a generated file lacks
        files.append(File(src.name, src_dir=str(PAGES), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
        if module:
            files.append(File.generated(config, _api_uri(module), content=(
                f"# `minivllm.{module}`\n\n"
                f"Exported from the notebook [{_title(src)}](../{src.name}) (`nbs/{src.name}`), which explains "
                "and tests it.\n\n"
                f"::: minivllm.{module}\n")))
    return files


_IPYNB_HREF = re.compile(r'href="(\.?/?)([\w.-]+)\.ipynb(#[^"]*)?"')
_HEADING = re.compile(r'<h([1-6])\b[^>]*\bid="([^"]+)"[^>]*>(.*?)</h\1>', re.S)


def _toc_from_html(content: str, depth: int):
    "The page's table of contents from the headings as rendered, so that every entry links to a real id."
    from mkdocs.structure.toc import get_toc

    root = {"level": 0, "children": []}
    stack = [root]
    for level, hid, inner in _HEADING.findall(content):
        level = int(level)
        if level > depth:
            continue
        name = re.sub(r"<[^>]+>", "", re.sub(r'<a class="anchor-link".*?</a>', "", inner, flags=re.S)).strip()
        token = {"level": level, "id": hid, "name": name, "children": []}
        while stack[-1]["level"] >= level:
            stack.pop()
        stack[-1]["children"].append(token)
        stack.append(token)
    return get_toc(root["children"])


def on_page_content(html, page, config, files, **kwargs):
    if page.file.src_uri.endswith(".ipynb"):
        stems = {p.stem for p in nbdocs.notebooks()}
        html = _IPYNB_HREF.sub(
            lambda m: f'href="{m.group(1)}{m.group(2)}.html{m.group(3) or ""}"' if m.group(2) in stems else m.group(0),
            html)
        # mkdocs-jupyter 0.26.3 builds the TOC from the markdown with `code` spans deleted, so a heading such as
        # "Rank 0's end: `ShmCommandChannel`" gets the anchor #rank-0s-end, which no element has
        # the theme would fetch mermaid from unpkg for a <pre class="mermaid"> (nbconvert's rendering of a ```mermaid
        # fence): show the diagram's source as code instead (vendor mermaid into docs/site to draw them)
        html = html.replace('<pre class="mermaid">', '<pre class="mermaid-source">')
        depth = config["plugins"]["mkdocs-jupyter"].config["toc_depth"]
        page.toc = _toc_from_html(html, depth)
    return html
