"""The documentation site (issue 40): it builds with ``mkdocs build --strict``, and, served over a real
local HTTP server, a real headless browser (Debian's Chromium through Playwright) finds every page
rendered (a title, a heading and content), follows the navigation by clicking it, and no internal link
or image of any page is dead (each is fetched: 200, and a link's ``#anchor`` exists on its page).

The site is built once, into a temporary folder, from the checkout's ``mkdocs.yml``: the result tables
it generates come from whatever ``bench/results/`` holds. Skipped, saying why, where the docs extra or
Chromium is missing (``make setup`` installs the first; ``.ci/run`` installs Chromium with apt-get).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")  # Debian's; Playwright's own browsers are never downloaded

for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
    pytest.importorskip(module, reason=f"{module} is missing: the docs extra (pip install -e '.[docs]') builds the site")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing (pip install playwright)")

# Every page shows the primary navigation; these are its page links (the current page's table of
# contents, nested in it for small screens, is left out).
NAV_LINKS_JS = """() => Array.from(document.querySelectorAll('nav.md-nav--primary a.md-nav__link[href]'))
    .filter(a => !a.closest('.md-nav--secondary'))
    .map(a => a.href)"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built with --strict (a warning fails the build) into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    # without a formatter the reference's signatures stay on one line, and the build says so (the docs
    # extra brings ruff)
    assert "requires either Black or Ruff" not in done.stdout + done.stderr, "ruff is missing (the docs extra has it)"
    return out


@pytest.fixture(scope="module")
def base_url(site):
    """A real HTTP server over the built site, in a thread; its root URL."""
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"Debian's Chromium is not installed ({CHROMIUM}): apt-get install chromium (.ci/run does)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield chromium
        chromium.close()


def _tab(browser):
    """A wide tab (the navigation is a sidebar, not a drawer) and the list its script errors go to."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    errors = []
    tab.on("pageerror", lambda e: errors.append(f"{tab.url}: {e}"))
    tab.set_default_timeout(15_000)
    return context, tab, errors


@pytest.fixture
def page(browser):
    """A tab for one test, failing it on any script error."""
    context, tab, errors = _tab(browser)
    yield tab
    context.close()
    assert not errors, f"script errors on the site: {errors[:5]}"


@pytest.fixture(scope="module")
def visits(site, base_url, browser) -> dict[str, dict]:
    """Every page of the site, opened once in the browser: what it rendered and what it links to."""
    context, tab, errors = _tab(browser)
    out = {}
    for url in page_urls(site, base_url):
        response = tab.goto(url)
        content = tab.locator("article.md-content__inner")
        out[url] = {
            "status": response.status, "title": tab.title(), "h1": content.locator("h1").count(),
            "text": content.inner_text().strip() if content.count() == 1 else "",
            "refs": tab.evaluate("""() => [...Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
                                           ...Array.from(document.querySelectorAll('img[src]')).map(i => i.src)]"""),
        }
    context.close()
    assert not errors, f"script errors on the site: {errors[:5]}"
    return out


def page_urls(site: Path, base_url: str) -> list[str]:
    """Every page of the built site (each is a folder's index.html; the 404 page is not one)."""
    pages = sorted(p.relative_to(site).parent.as_posix() for p in site.rglob("index.html"))
    return [base_url + ("" if p == "." else p + "/") for p in pages]


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(v for k, v in attrs if k in ("id", "name") and v)


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_the_site_has_the_pages_of_the_issue(site):
    for page_dir in ("getting-started", "concepts/retention", "concepts/positions", "concepts/sessions",
                     "concepts/tiers", "concepts/retrieval", "concepts/hybrid", "guides/agent-sessions",
                     "guides/pace-serve", "guides/smolagents", "benchmarks", "benchmarks/results",
                     "reference/pace_hf", "reference/scoring", "reference/rope", "reference/tiers",
                     "reference/persist", "reference/retrieval", "reference/layout", "reference/window"):
        assert (site / page_dir / "index.html").is_file(), page_dir
    # One generated page per folder of bench/results that holds a report, each naming its command.
    results = REPO / "bench" / "results"
    folders = {md.parent.relative_to(results).as_posix() for md in results.rglob("*.md")}
    assert folders and {"48k", "ruler"} <= folders
    for folder in folders:
        html = (site / "benchmarks" / "results" / folder / "index.html").read_text()
        assert "Produced by" in html or "not recorded" in html, folder
    reference = (site / "reference" / "pace_hf" / "index.html").read_text()
    for name in ("Blueprint", "Span", "PACECache", "H2OCache", "SnapKVCache", "StreamingLLMCache", "EvictionCache",
                 "PACESession"):
        assert f'id="pace_hf.{name}"' in reference, name


def test_every_page_renders(visits):
    assert len(visits) >= 30
    for url, seen in visits.items():
        assert seen["status"] == 200, url
        assert seen["title"].strip() and "404" not in seen["title"], (url, seen["title"])
        assert seen["h1"] == 1, url
        assert len(seen["text"]) > 100, (url, seen["text"][:200])


def test_the_navigation_works(site, base_url, page):
    """Click through every link of the primary navigation, each from the page the previous click opened."""
    page.goto(base_url)
    targets = list(dict.fromkeys(page.evaluate(NAV_LINKS_JS)))
    assert len(targets) >= 30 and base_url + "getting-started/" in targets
    results = base_url + "benchmarks/results/"
    folder_pages = {u for u in page_urls(site, base_url) if u.startswith(results) and u != results}
    assert len(folder_pages) >= 30 and not folder_pages & set(targets), "a result folder's page is in the sidebar"
    assert set(targets) == set(page_urls(site, base_url)) - folder_pages, "a page of the site is missing from the navigation"
    page.goto(results)  # the result folders' pages are reached from the Result tables page
    listed = set(page.evaluate("() => Array.from(document.querySelectorAll('article a[href]')).map(a => a.href)"))
    assert folder_pages <= listed, f"result pages the Result tables page does not link: {sorted(folder_pages - listed)[:5]}"
    page.goto(base_url)
    for target in targets:
        links = page.locator("nav.md-nav--primary a.md-nav__link[href]")
        hrefs = page.evaluate(NAV_LINKS_JS)
        assert target in hrefs, (page.url, target)
        index = page.evaluate(
            """(target) => Array.from(document.querySelectorAll('nav.md-nav--primary a.md-nav__link[href]'))
                .findIndex(a => !a.closest('.md-nav--secondary') && a.href === target)""", target)
        with page.expect_navigation():
            links.nth(index).click()
        assert page.url == target
        assert page.locator("article.md-content__inner h1").is_visible(), target


def test_home_links_every_concept_and_guide(site, base_url, visits):
    """Home's "Where to go" left out a guide (Batches): every page of the Concepts and Guides sections is
    linked from it."""
    pages = [u for u in page_urls(site, base_url) if u.startswith((base_url + "concepts/", base_url + "guides/"))]
    assert len(pages) >= 10
    missing = sorted(set(pages) - set(visits[base_url]["refs"]))
    assert not missing, f"pages Home does not link to: {missing}"


def test_at_1280_px_nothing_is_cut_off_and_the_sidebar_names_no_folder(base_url, site, browser):
    """At 1,280 px (a laptop), a newcomer found code cut off at the column's right edge, the sidebar of
    every page listing some 30 raw result-folder names (``48k``, ``bfcl_base``, ...), and an emoji drawn as
    an empty box where no emoji font is installed. Every page: no code block wider than its column, no
    sidebar entry that is the name of a folder of ``bench/results``, no emoji in the text."""
    import re

    folders = {part for md in (REPO / "bench" / "results").rglob("*.md")
               for part in md.parent.relative_to(REPO / "bench" / "results").parts}
    assert {"48k", "ruler"} <= folders
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    cut, named, emoji, blocks = [], set(), [], 0
    try:
        for url in page_urls(site, base_url):
            tab.goto(url)
            tab.wait_for_load_state("load")
            seen = tab.evaluate("""() => ({
                code: Array.from(document.querySelectorAll('article pre > code')).map((c) => ({
                    over: c.scrollWidth - c.clientWidth,
                    line: c.innerText.split('\\n').reduce((a, l) => (l.length > a.length ? l : a), ''),
                })),
                nav: Array.from(document.querySelectorAll('nav.md-nav--primary .md-nav__link'))
                    .filter((a) => !a.closest('.md-nav--secondary')).map((a) => a.innerText.trim()),
                text: document.querySelector('article').innerText,
            })""")
            blocks += len(seen["code"])
            cut += [(url, c["over"], c["line"][:100]) for c in seen["code"] if c["over"] > 1]
            named |= folders & set(seen["nav"])
            emoji += [(url, ch) for ch in set(re.findall("[\U0001F000-\U0001FAFF]", seen["text"]))]
    finally:
        context.close()
    assert blocks > 50, "no code block was seen: the check saw nothing to check"
    assert not cut, f"code blocks wider than their column at 1,280 px (page, px hidden, longest line): {cut[:5]}"
    assert not named, f"sidebar entries that are result folders' names: {sorted(named)[:10]}"
    assert not emoji, f"emoji in the text (an empty box without an emoji font): {emoji[:5]}"


def test_no_internal_link_is_dead(base_url, visits):
    """Every <a href> and <img src> of every page that points into the site answers 200, and the anchor
    of a link exists on the page it names."""
    origin = urlsplit(base_url).netloc
    wanted: dict[str, set[str]] = {}  # URL -> the pages that link to it
    anchors: dict[tuple[str, str], str] = {}
    for url, seen in visits.items():
        for ref in seen["refs"]:
            if urlsplit(ref).netloc != origin:
                continue
            target, fragment = urldefrag(ref)
            wanted.setdefault(target, set()).add(url)
            if fragment:
                anchors[(target, unquote(fragment))] = url
    assert len(wanted) > 50
    bodies = {}
    dead = []
    for target, sources in sorted(wanted.items()):
        status, body = fetch(target)
        if status != 200:
            dead.append(f"{target} ({status}), linked from {sorted(sources)[:3]}")
        bodies[target] = body
    assert not dead, "dead internal links:\n" + "\n".join(dead)
    missing = []
    for (target, fragment), source in sorted(anchors.items()):
        parser = _Ids()
        parser.feed(bodies[target].decode("utf-8", "replace"))
        if fragment not in parser.ids:
            missing.append(f"{target}#{fragment}, linked from {source}")
    assert not missing, "links to anchors that do not exist:\n" + "\n".join(missing)


class _Text(HTMLParser):
    """A page's prose: its text outside scripts, styles and code (a command may name a revision)."""

    def __init__(self):
        super().__init__()
        self.parts, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in ("script", "style", "code", "pre")

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style", "code", "pre")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def test_every_name_of_pace_hf_all_has_a_reference_entry(site):
    import pace_hf

    ids = set()
    for html in (site / "reference").rglob("index.html"):
        parser = _Ids()
        parser.feed(html.read_text())
        ids.update(i for i in parser.ids if i.startswith("pace_hf."))
    missing = [name for name in pace_hf.__all__ if name != "__version__"
               and not any(i.endswith("." + name) for i in ids)]
    assert not missing, f"names of pace_hf.__all__ with no reference anchor: {missing}"


def test_no_page_cites_an_issue_or_a_commit(site):
    """Public prose says what changed, not which issue or commit changed it."""
    import re

    cited = {}
    for html in site.rglob("index.html"):
        parser = _Text()
        parser.feed(html.read_text())
        text = " ".join(parser.parts)
        hits = re.findall(r"(?i)\bissues? ?#?\d+", text) + [
            h for h in re.findall(r"(?<![\w-])[0-9a-f]{7,12}(?![\w-])|(?<![\w-])[0-9a-f]{40}(?![\w-])", text)
            if re.search(r"[a-f]", h) and re.search(r"\d", h)]
        if hits:
            cited[html.relative_to(site).parent.as_posix()] = sorted(set(hits))[:5]
    assert not cited, f"pages that cite an issue or a commit: {cited}"


def test_the_sitemap_lists_every_page_and_result_tables_come_last(site):
    sitemap = (site / "sitemap.xml").read_text()
    assert sitemap.count("<loc>") == len(page_urls(site, "")), "sitemap.xml is missing pages (site_url unset?)"
    import re

    home = (site / "index.html").read_text()  # the navigation comes first in every page
    at = {name: re.search(rf">\s*{name}\s*<", home).start() for name in ("API reference", "Limitations", "Result tables")}
    assert at["Result tables"] > at["Limitations"] > at["API reference"], "the result tables' ~50 entries come last"


def test_wide_tables_keep_their_key_columns_in_view(base_url, site, browser):
    """At 1,280 px every table of the benchmark pages fits its column, or scrolls sideways with its first
    column held in view and a line above it naming the columns out of view (docs/assets/tables.*)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    bad, wide = [], 0
    try:
        for url in page_urls(site, base_url):
            if not url.startswith(base_url + "benchmarks/"):
                continue
            tab.goto(url)
            tab.wait_for_load_state("load")
            for seen in tab.evaluate("""() => Array.from(document.querySelectorAll('article table')).map((table) => {
                const wrap = table.closest('.md-typeset__scrollwrap') || table.parentElement;
                const hint = wrap.previousElementSibling;
                const edge = wrap.getBoundingClientRect().right + 1;
                return {
                    overflows: table.scrollWidth > wrap.clientWidth + 1,
                    scrolls: ['auto', 'scroll'].includes(getComputedStyle(wrap).overflowX),
                    sticky: getComputedStyle(table.rows[0].cells[0]).position === 'sticky',
                    hint: hint && hint.classList.contains('pace-scroll-hint') && hint.offsetHeight > 0
                        ? hint.innerText : null,
                    hidden: Array.from(table.rows[0].cells).filter((c) => c.getBoundingClientRect().right > edge)
                        .map((c) => c.innerText.trim()),
                    first: table.rows[0].cells[0].innerText.trim(),
                };
            })"""):
                if not seen["overflows"]:
                    continue
                wide += 1
                if not (seen["scrolls"] and seen["sticky"] and seen["hint"]
                        and all(name in seen["hint"] for name in seen["hidden"])):
                    bad.append((url, seen["first"], seen["hidden"], seen["hint"]))
    finally:
        context.close()
    assert not bad, f"wide tables with no scroll hint or with their first column out of view: {bad[:5]}"
    assert wide, "no table is wider than its column: the check saw nothing to check"

