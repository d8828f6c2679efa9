"""The docs site: `docs/build.py` builds it from nbs/, and it works offline in headless Chromium.

The site is built once per session into a temporary folder (the notebooks' executed outputs come from the cache in
_proc/docs/exec/ when CI's docs step, or an earlier build, already ran them). Then, with Debian's Chromium driven by
Playwright, from file:// and from a local server: every page of the navigation loads with its title, logs no console
error, sends no request off the machine, shows every image; every internal link resolves; search finds a name that
one notebook teaches. Screenshots of two pages go to test-artifacts/.
Outside CI, no Playwright or no /usr/bin/chromium skips the browser tests (with the reason); under CI they must run.
"""
from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

import pytest

from conftest import NBS, ROOT

sys.path.insert(0, str(ROOT / "docs"))
import nbdocs  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
ARTIFACTS = ROOT / "test-artifacts"
SEARCH_TERM, SEARCH_PAGE = "RowParallelLinear", "03_parallel_linear.html"
UNIQUE_TERM = "every_rank_adds_bias"  # a name that only the parallel-linear notebook uses


# ---------------------------------------------------------------------------------------------------------------
# the build

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "build.py"), "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"docs build failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-10000:]}"
    return out


class _Links(HTMLParser):
    "The ids, links, and fetched URLs (src=, stylesheet/icon/preload hrefs) of one HTML page."
    def __init__(self):
        super().__init__()
        self.ids, self.links, self.fetched, self.title = set(), [], [], ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        if tag == "a" and a.get("href") is not None:
            self.links.append(a["href"])
        for key in ("src", "data-src", "poster"):
            if a.get(key):
                self.fetched.append(a[key])
        if tag == "link" and a.get("href") and not {"canonical", "alternate"} & set((a.get("rel") or "").split()):
            self.fetched.append(a["href"])
        self._in_title = tag == "title"

    def handle_data(self, data):
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag):
        self._in_title = False


@functools.lru_cache(maxsize=None)
def parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def nav_pages(site: Path) -> list[tuple[str, str]]:
    "The (href, title) of every page in the site's navigation, in order, from the home page's sidebar."
    text = (site / "index.html").read_text(encoding="utf-8")
    nav = text[text.index('<nav class="md-nav md-nav--primary"'):]
    found = []
    for href, label in re.findall(r'<a href="([^"#]+)" class="md-nav__link[^"]*">\s*<span class="md-ellipsis">\s*(.*?)\s*</span>',
                                  nav, flags=re.S):
        href = "index.html" if href in ("", ".", "./") else href
        if (href, label) not in found:
            found.append((href, html.unescape(re.sub(r"<[^>]+>", "", label)).strip()))
    return found


def test_every_notebook_is_a_page_in_order(site):
    pages = [href for href, _ in nav_pages(site)]
    stems = [p.stem for p in nbdocs.notebooks() if p.stem != "index"]
    assert pages[0] == "index.html"
    assert [p[:-5] for p in pages[1:1 + len(stems)]] == stems, pages
    assert all((site / p).is_file() for p in pages)
    api = [p for p in pages if p.startswith("api/")]
    modules = [m for m in (nbdocs.default_exp(json.loads(p.read_text())) for p in nbdocs.notebooks()) if m]
    assert api == [f"api/minivllm.{m}.html" for m in modules]


def test_pages_show_code_outputs_and_api(site):
    text = (site / SEARCH_PAGE).read_text(encoding="utf-8")
    assert "class RowParallelLinear" in re.sub(r"<[^>]+>", "", text)  # the exported code, shown
    assert "<img" in text and "data:image/png;base64," in text        # the notebook's figure, executed at build time
    assert not re.search(r"(?m)^\s*#\s*\|", html.unescape(re.sub(r"<[^>]+>", "", text)))  # no directive lines
    assert "default_exp" not in text
    api = (site / "api" / "minivllm.layers.linear.html").read_text(encoding="utf-8")
    assert 'id="minivllm.layers.linear.RowParallelLinear"' in api    # mkdocstrings' entry for the class
    assert "weight_loader" in api


def test_no_directive_or_hidden_cell_reaches_a_page(site):
    "No `#|` line on any page, and the code of each `#| hide` cell appears on no page (unless shown elsewhere too)."
    pages = {p.name: html.unescape(re.sub(r"<[^>]+>", "", p.read_text(encoding="utf-8"))) for p in site.glob("*.html")}
    for name, text in pages.items():
        assert not re.search(r"(?m)^\s*#\s*\|", text), f"{name} shows a `#|` directive line"
    for nb_path in nbdocs.notebooks():
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
        shown = "\n".join(nbdocs.cell_source(c) for c in nbdocs.process_notebook(nb)["cells"])
        for cell in nb["cells"]:
            src = nbdocs.cell_source(cell)
            if "hide" in nbdocs.directives(src):
                for line in (l.strip() for l in src.splitlines()):
                    if len(line) > 25 and not line.startswith("#") and line not in shown:
                        assert line not in pages[f"{nb_path.stem}.html"], f"hidden code shown: {line!r}"


def test_process_notebook_applies_nbdev_directives():
    code = lambda s, outputs=(): {"cell_type": "code", "metadata": {}, "source": s, "outputs": list(outputs)}
    out = {"output_type": "stream", "name": "stdout", "text": "hi\n"}
    nb = {"cells": [code("#| default_exp foo"), code("#| hide\nsecret = 1"), code("#|export\ndef f(): pass"),
                    code("#| slow\nbig()"), code("#| echo: false\nprint('hi')", [out]), code("#| output: false\nx", [out]),
                    {"cell_type": "markdown", "metadata": {}, "source": "# Title"}], "metadata": {}}
    cells = nbdocs.process_notebook(nb, flags={"slow", "cuda"}, mark_not_run=True)["cells"]
    assert [c["source"] for c in cells] == ["def f(): pass", "big()", "print('hi')", "x", "# Title"]
    assert cells[1]["metadata"]["tags"] == ["not run in the docs build (slow)"]
    assert cells[2]["metadata"]["transient"] == {"remove_source": True} and cells[2]["outputs"] == [out]
    assert cells[3]["outputs"] == []


def test_readme_is_rendered_from_index_notebook(tmp_path):
    assert (ROOT / "README.md").read_text(encoding="utf-8") == nbdocs.render_readme(NBS / "index.ipynb")
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "execution_count": 1, "source": "#| hide\nimport os"},
                    {"cell_type": "code", "metadata": {}, "execution_count": 2, "source": "#| export\n1 + 1",
                     "outputs": [{"output_type": "execute_result", "execution_count": 2, "metadata": {},
                                  "data": {"text/plain": "2"}}]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "index.ipynb").write_text(json.dumps(nb))
    md = nbdocs.render_readme(tmp_path / "index.ipynb")
    assert md == nbdocs.README_HEADER + "```python\n1 + 1\n```\n\n```\n2\n```\n"


_FETCH_PATTERNS = [
    re.compile(r"""\b(?:src|data-src|poster)\s*=\s*["']?\s*(?:https?:)?//""", re.I),
    re.compile(r"""<link\b(?![^>]*\brel=["']?(?:canonical|alternate)\b)[^>]*\bhref=["']?\s*(?:https?:)?//""", re.I),
    re.compile(r"""@import\s+(?:url\()?\s*["']?\s*(?:https?:)?//""", re.I),
    re.compile(r"""url\(\s*["']?\s*(?:https?:)?//""", re.I),
    re.compile(r"""\bimport\s*(?:\(|[\w{}*\s,]+from\s*)\s*["'](?:https?:)?//""", re.I),
    re.compile(r"""importScripts\(\s*["'](?:https?:)?//""", re.I),
]


def test_no_external_url_is_fetched_by_the_built_files(site):
    "No src=, stylesheet link, @import, url() or module import in the built HTML/CSS/JS points off the machine."
    bad = []
    for path in site.rglob("*"):
        if path.suffix not in (".html", ".css", ".js", ".mjs", ".svg") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for pat in _FETCH_PATTERNS:
            for m in pat.finditer(text):
                bad.append(f"{path.relative_to(site)}: {text[max(0, m.start() - 40):m.end() + 60]!r}")
    assert not bad, "external resources would be fetched:\n" + "\n".join(bad[:20])
    polyfill = site / "assets" / "vendor" / "iframe-worker" / "shim.js"
    assert polyfill.is_file() and 'src="assets/vendor/iframe-worker/shim.js"' in (site / "index.html").read_text()


def test_every_internal_link_resolves(site):
    "Links, and what pages load, resolve to files of the site (and anchors to ids); 404.html, served by a web server"
    " for any missing path, uses root-absolute links and is left out."
    broken = []
    for page in site.rglob("*.html"):
        if page.name == "404.html":
            continue
        p = parse(page)
        for href in p.links + p.fetched:
            url = urlparse(href)
            if url.scheme or url.netloc or href.startswith(("mailto:", "javascript:", "data:")):
                continue
            path, frag = urldefrag(href)
            target = page if not path else (page.parent / unquote(path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(site)} -> {href}")
            elif frag and target.suffix == ".html" and unquote(frag) not in parse(target).ids:
                broken.append(f"{page.relative_to(site)} -> {href} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken[:30])


# ---------------------------------------------------------------------------------------------------------------
# in the browser

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "the Playwright python package is not installed (pip install playwright)"
    if reason is None and not CHROMIUM.exists():
        reason = f"{CHROMIUM} not found (apt-get install -y chromium)"
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests, but {reason}")
        print(f"SKIP browser tests: {reason}")
        pytest.skip(reason)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900}, service_workers="block")
        try:
            yield context
        finally:
            context.close()


def _local(url: str) -> bool:
    "A URL that stays on this machine: a file, inline data, or the loopback server."
    u = urlparse(url)
    return u.scheme in ("file", "data", "blob", "about") or (
        u.scheme in ("http", "https", "ws") and u.hostname in ("127.0.0.1", "localhost", "::1"))


class Watch:
    "What the pages of one test did: console errors, uncaught exceptions, failed requests, requests sent off the machine."
    def __init__(self):
        self.errors, self.offsite = [], []

    def route(self, route):
        if _local(route.request.url):
            route.continue_()
        else:  # never let it out: record it and fail the request
            self.offsite.append(route.request.url)
            route.abort()

    def attach(self, pg):
        pg.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text} @ {m.location}"))
        pg.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        pg.on("requestfailed", lambda r: self.errors.append(f"request failed: {r.url} {r.failure}"))
        pg.on("request", lambda r: None if _local(r.url) else self.offsite.append(r.url))


@pytest.fixture
def page(browser):
    watch = Watch()
    browser.route("**/*", watch.route)
    pg = browser.new_page()
    watch.attach(pg)
    pg.watch = watch
    yield pg
    pg.close()
    browser.unroute("**/*")


def _check_loaded(pg, title: str) -> int:
    "The page has its title and a heading, and every image loaded; returns the number of images."
    # subtle: "networkidle", not only "load": the browser asks for the favicon after the page has loaded, and going
    # to the next page before it came back aborts that request (a failure that says nothing about the site)
    pg.wait_for_load_state("networkidle")
    title = "minivllm" if title == "Home" else title  # the theme titles the home page with the site's name
    assert title in pg.title(), f"{pg.url}: title {pg.title()!r} lacks {title!r}"
    assert pg.locator("article h1").first.is_visible(), f"{pg.url}: no heading"
    images = pg.evaluate("""async () => {
        const imgs = Array.from(document.images);
        await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
        return imgs.map(i => [i.currentSrc.slice(0, 60), i.complete, i.naturalWidth]);
    }""")
    not_loaded = [src for src, complete, width in images if not (complete and width > 0)]
    assert not not_loaded, f"{pg.url}: images not loaded: {not_loaded}"
    return len(images)


def test_the_watch_catches_an_offsite_request(page):
    "The interception the other browser tests rely on: a request for another host is recorded, and never sent."
    page.set_content('<img src="https://example.invalid/x.png">')
    page.wait_for_timeout(200)
    assert set(page.watch.offsite) == {"https://example.invalid/x.png"}  # seen by the route and the listener
    page.watch.errors.clear()  # the aborted request is reported as failed: expected here


def test_every_nav_page_loads_offline_from_file_url(site, page):
    pages = nav_pages(site)
    assert len(pages) >= 3
    figures = {}
    for href, title in pages:
        page.goto((site / href).as_uri())
        figures[href] = _check_loaded(page, title)
    assert figures[SEARCH_PAGE] >= 1, "the parallel-linear notebook's figure is missing"
    assert not page.watch.offsite, f"requests that would leave the machine: {page.watch.offsite}"
    assert not page.watch.errors, "\n".join(page.watch.errors)


def test_math_and_screenshots(site, page):
    "Math is typeset by the site's own MathJax; screenshots of the home page and of a page with a figure."
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto((site / "index.html").as_uri())
    page.wait_for_load_state("load")
    page.screenshot(path=str(ARTIFACTS / "docs-home.png"))
    page.set_viewport_size({"width": 1280, "height": 1800})  # the title, the prose and the first figure
    page.goto((site / SEARCH_PAGE).as_uri())
    page.wait_for_function("() => document.querySelectorAll('mjx-container svg').length > 0", timeout=20_000)
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "docs-parallel-linear.png"))
    assert not page.watch.offsite and not page.watch.errors, (page.watch.offsite, page.watch.errors)


def _search(pg, term: str) -> list[str]:
    box = pg.locator("input.md-search__input")
    box.click()
    box.fill("")
    box.press_sequentially(term, delay=10)  # the theme searches on key events: fill() alone does not trigger it
    pg.wait_for_selector(".md-search-result__item a", timeout=20_000)
    hrefs = pg.eval_on_selector_all(".md-search-result__item a", "els => els.map(e => e.getAttribute('href'))")
    return [urlparse(h).path.rsplit("/", 2)[-1] if "/api/" not in h else "api/" + urlparse(h).path.rsplit("/", 1)[-1]
            for h in hrefs]


def _check_search(pg):
    assert SEARCH_PAGE in _search(pg, SEARCH_TERM)
    owners = [p.stem for p in nbdocs.notebooks() if UNIQUE_TERM in p.read_text(encoding="utf-8")]
    assert owners == [SEARCH_PAGE[:-5]], f"choose another UNIQUE_TERM: {UNIQUE_TERM!r} is in {owners}"
    assert {h for h in _search(pg, UNIQUE_TERM) if not h.startswith("api/")} == {SEARCH_PAGE}


def test_search_works_from_file_url(site, page):
    page.goto((site / "index.html").as_uri())
    page.wait_for_load_state("load")
    _check_search(page)
    assert not page.watch.offsite and not page.watch.errors, (page.watch.offsite, page.watch.errors)


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_site_works_from_a_local_server(site, server, page):
    for href, title in nav_pages(site)[:3] + [(SEARCH_PAGE, "Parallel")]:
        page.goto(f"{server}/{href}")
        _check_loaded(page, title)
    _check_search(page)
    assert not page.watch.offsite and not page.watch.errors, (page.watch.offsite, page.watch.errors)
