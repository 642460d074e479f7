"""Check the built book page by page in a real browser (headless Chromium, Playwright).

Serves a built book (default _build/html) on 127.0.0.1 and, for every page of _toc.yml,
fails on: a page that does not load, a console error or page error, a failed local
request, a request to another host (the book must work offline), an image that does not
load or has no real alt text, a sidebar whose pages or captions differ from _toc.yml, an
internal link or #anchor that does not resolve, a page or <pre> that scrolls sideways at
1280 or 390 px, a line of at most 88 characters that does not fit its code block at
1280 px (longer ones wrap, and are listed), and a <pre> clipped in print layout.
Then: a search for `set_epoch` must list chapter 3, and /favicon.ico and the page's icon
must load. A full-page screenshot of each page at 1280 px goes to _build/screenshots/.
All failures are collected and reported together.

    python tests/browser/book_check.py [--html DIR] [--toc FILE] [--screenshots DIR]

exits 1 and prints one line per failure ("page: reason") when anything fails.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import functools
import html.parser
import http.server
import os
import pathlib
import re
import sys
import threading
import time
import urllib.parse

import yaml

import find_browser

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCREEN_WIDTHS = (1280, 390)  # a laptop and a phone; screenshots are taken at the first
SCREEN_HEIGHT = 900
# print layout: A4 portrait is 794 px wide at 96 dpi, less Chromium's 0.4 in margins
PRINT_WIDTH = 718
CODE_COLUMNS = 88  # the longest code or printed line the book allows
SEARCH_QUERY, SEARCH_EXPECTS = "set_epoch", "notebooks/03_set_epoch"
PAGE_TIMEOUT_MS = 30_000
IMAGE_SUFFIXES = r"png|jpe?g|gif|svg|webp|avif|bmp|ico"


@dataclasses.dataclass(frozen=True)
class Failure:
    page: str
    reason: str

    def __str__(self):
        return f"{self.page}: {self.reason}"


@dataclasses.dataclass
class Report:
    pages: list[str]
    failures: list[Failure]
    stats: dict[str, int]
    seconds: float
    wrapped: list[Failure]  # not failures: <pre> blocks whose lines wrap at 1280 px

    def summary(self) -> str:
        lines = [f"{w.page}: wraps at 1280 px: {w.reason}" for w in self.wrapped]
        lines += [str(f) for f in self.failures]
        stats = ", ".join(f"{k} {v}" for k, v in self.stats.items())
        lines.append(f"{len(self.pages)} pages checked in {self.seconds:.1f} s; "
                     f"{stats}; {len(self.failures)} failures")
        return "\n".join(lines)


# ---------------------------------------------------------------- the table of contents

@dataclasses.dataclass(frozen=True)
class Toc:
    pages: list[str]     # html paths relative to the build root, in reading order
    captions: list[str]  # the part captions, in order


def html_path(entry: str) -> str:
    """A _toc.yml entry ('notebooks/01_samplers', 'book/intro.md') -> its html page."""
    entry = entry.strip().lstrip("/")
    stem, suffix = os.path.splitext(entry)
    return (stem if suffix in {".md", ".ipynb", ".rst"} else entry) + ".html"


def read_toc(path: pathlib.Path) -> Toc:
    toc = yaml.safe_load(pathlib.Path(path).read_text())
    if not isinstance(toc, dict) or "root" not in toc:
        raise ValueError(f"{path}: a jb-book table of contents with a 'root' key is "
                         f"expected, got {type(toc).__name__}")
    pages, captions = [html_path(toc["root"])], []

    def walk(entries, where):
        for entry in entries or []:
            if not isinstance(entry, dict):
                raise ValueError(f"{path}: {where}: each entry must be a mapping, "
                                 f"got {entry!r}")
            if "glob" in entry:
                raise ValueError(f"{path}: {where}: 'glob' entries are not supported; "
                                 "list the files")
            if "file" in entry:
                pages.append(html_path(entry["file"]))
            elif "url" not in entry:
                raise ValueError(f"{path}: {where}: an entry needs 'file' or 'url', "
                                 f"got {sorted(entry)}")
            walk(entry.get("sections"), entry.get("file", where))

    for part in toc.get("parts") or []:
        if "caption" in part:
            captions.append(str(part["caption"]))
        walk(part.get("chapters"), part.get("caption", "a part"))
    walk(toc.get("chapters"), "chapters")
    walk(toc.get("sections"), "sections")
    return Toc(pages, captions)


# ---------------------------------------------------------------- links and anchors

class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value and (name == "id" or (tag == "a" and name == "name")):
                self.ids.add(value)


@functools.lru_cache(maxsize=None)
def page_ids(path: pathlib.Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(errors="replace"))
    return frozenset(parser.ids)


def link_problem(html_root: pathlib.Path, url: str) -> str | None:
    """Why a local URL (a path from the build root, maybe #anchor) does not resolve."""
    parts = urllib.parse.urlsplit(url)
    rel = urllib.parse.unquote(parts.path).lstrip("/")
    target = html_root / rel
    if rel == "" or rel.endswith("/"):
        target = target / "index.html"
    if not target.is_file():
        return f"links to {rel or '/'}, which is not in the build"
    fragment = urllib.parse.unquote(parts.fragment)
    if fragment and target.suffix == ".html" and fragment not in page_ids(target):
        return f"links to {rel}#{fragment}, an anchor that page does not have"
    return None


def alt_problem(alt: str | None) -> str | None:
    """Why an image's alt text is not a description of the image."""
    text = (alt or "").strip()
    if not text:
        return "has no alt text"
    if re.fullmatch(rf"[\w./\\-]+\.({IMAGE_SUFFIXES})", text, re.I):
        return f"has a file name as alt text ({text[:60]})"
    # one long token of letters and digits, or a run of hex digits
    token = re.fullmatch(r"\S{16,}", text) and re.search(r"\d", text) and re.search(
        r"[a-z]", text, re.I)
    if token or re.search(r"[0-9a-f]{12,}", text, re.I):
        return f"has a hash-like alt text ({text[:60]})"
    return None


# ---------------------------------------------------------------- in-page measurements

# every shown <pre>, labelled by its first line: `scrolls`, wider than its box;
# `clipped`, cut by an overflow box around it; `wraps`, the longest line of each that
# would be wider than its box if lines did not wrap; `fit`, the width an 88-character
# line needs and has (wraps and fit only when `whole`, at 1280 px); `wide`, what makes
# the page scroll.
JS_PRE = """([columns, whole]) => {
  const doc = document.documentElement;
  const label = (p) => (p.textContent.trim().split('\\n')[0] || '(empty)').slice(0, 60);
  const longest = (p) => p.textContent.split('\\n')
    .reduce((a, b) => (b.length > a.length ? b : a), '');
  const pres = [...document.querySelectorAll('pre')]
    .filter(p => p.offsetParent !== null);
  const out = {pageScroll: doc.scrollWidth > doc.clientWidth + 1,
               pageWidth: doc.scrollWidth, viewWidth: doc.clientWidth,
               wide: [], pres: pres.length, scrolls: [], clipped: [], wraps: [],
               fit: null};
  if (out.pageScroll) {
    const shown = (e) => {  // not inside a box that scrolls or clips it
      for (let a = e.parentElement; a && a !== document.body; a = a.parentElement)
        if (getComputedStyle(a).overflowX !== 'visible') return false;
      return true;
    };
    for (const e of document.body.querySelectorAll('*')) {
      const r = e.getBoundingClientRect(), pr = e.parentElement.getBoundingClientRect();
      const edge = doc.clientWidth + 1;
      if (r.right > edge && pr.right <= edge && shown(e)) {
        const classes = typeof e.className === 'string' ? e.className.trim() : '';
        out.wide.push(e.tagName.toLowerCase() +
          (classes ? '.' + classes.split(/\\s+/).slice(0, 2).join('.') : ''));
      }
      if (out.wide.length >= 3) break;
    }
  }
  for (const p of pres) {
    if (p.scrollWidth > p.clientWidth + 1) out.scrolls.push(label(p));
    for (let a = p.parentElement; a && a.tagName !== 'ARTICLE'; a = a.parentElement) {
      const s = getComputedStyle(a);
      if ((s.overflowX !== 'visible' && a.scrollWidth > a.clientWidth + 1) ||
          (s.overflowY !== 'visible' && a.scrollHeight > a.clientHeight + 1)) {
        out.clipped.push(label(p)); break;
      }
    }
    const s = getComputedStyle(p);
    if (s.overflowY !== 'visible' && p.scrollHeight > p.clientHeight + 1)
      out.clipped.push(label(p));
    if (whole) {
      const keep = p.style.whiteSpace;
      p.style.whiteSpace = 'pre';
      if (p.scrollWidth > p.clientWidth + 1) out.wraps.push(longest(p));
      p.style.whiteSpace = keep;
    }
  }
  const code = document.querySelector('div.highlight pre') || pres[0];
  if (whole && code) {
    const s = getComputedStyle(code), probe = document.createElement('span');
    probe.textContent = 'M'.repeat(columns);
    code.appendChild(probe);
    const padding = parseFloat(s.paddingLeft) + parseFloat(s.paddingRight);
    out.fit = {need: probe.getBoundingClientRect().width,
               have: code.clientWidth - padding, font: s.fontSize};
    probe.remove();
  }
  return out;
}"""

JS_IMAGES = """async () => Promise.all([...document.images].map(async (img) => {
  img.loading = 'eager';
  let ok = true;
  try { await img.decode(); } catch (e) { ok = false; }
  return {src: img.getAttribute('src'), alt: img.getAttribute('alt'),
          ok: ok && img.naturalWidth > 0};
}))"""

JS_SIDEBAR = """() => {
  const nav = document.querySelector('nav.bd-docs-nav');
  if (!nav) return null;
  return {links: [...nav.querySelectorAll('a[href]')].map(a => a.href),
          captions: [...nav.querySelectorAll('.caption-text')]
            .map(c => c.textContent.trim())};
}"""

JS_LINKS = "() => [...document.querySelectorAll('a[href]')].map(a => a.href)"
JS_OPEN_DETAILS = "() => document.querySelectorAll('details')" \
                  ".forEach(d => { d.open = true; })"
# measured layouts must not be half-way through a theme's transition
CSS_NO_MOTION = "*, *::before, *::after { transition: none !important; " \
                "animation: none !important; }"
# Sphinx's search says "finished" once it has asked for every result's page, and lists each
# result only when that page (for its summary) has arrived: done is both, or no match, so that
# the check does not navigate away while a summary is still loading (net::ERR_ABORTED)
JS_SEARCH_DONE = """() => {
  if (typeof Search === 'undefined' || !Search.status) return false;
  const said = Search.status.innerText;
  if (/did not match/i.test(said)) return true;
  const found = said.match(/found (\\d+) page/i);
  return /finished/i.test(said) && found !== null &&
    document.querySelectorAll('#search-results li').length >= Number(found[1]);
}"""


# ---------------------------------------------------------------- server and browser

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(html_root: pathlib.Path):
    """Serve a directory on 127.0.0.1 at a free port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(html_root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


_SHARED: dict = {}  # "playwright", "browser": one headless Chromium per process


def _close_browser():
    browser, pw = _SHARED.pop("browser", None), _SHARED.pop("playwright", None)
    for close in (browser and browser.close, pw and pw.stop):
        if close:
            with contextlib.suppress(Exception):  # already gone
                close()


atexit.register(_close_browser)


def _browser():
    """The browser find_browser.find() names, headless: started on the first check of this
    process and kept for the next ones (the checker's own tests check a page or two each, and
    starting Chromium costs more CPU than checking a page); started again if it has died."""
    if "browser" in _SHARED and not _SHARED["browser"].is_connected():
        _close_browser()
    if "browser" not in _SHARED:
        from playwright.sync_api import sync_playwright

        executable = find_browser.find()  # NoBrowser says what to install
        pw = sync_playwright().start()
        try:
            _SHARED["browser"] = pw.chromium.launch(
                executable_path=str(executable), args=find_browser.ARGS, headless=True)
        except BaseException:
            pw.stop()
            raise
        _SHARED["playwright"] = pw
    return _SHARED["browser"]


@contextlib.contextmanager
def browser_context():
    """A fresh browser context (its own cookies, storage and cache, as a new profile has)
    of the process's headless Chromium."""
    context = _browser().new_context(
        viewport={"width": SCREEN_WIDTHS[0], "height": SCREEN_HEIGHT})
    try:
        yield context
    finally:
        context.close()


# ---------------------------------------------------------------- the checks

class _Checker:
    def __init__(self, context, base: str, html_root: pathlib.Path, toc: Toc,
                 screenshots: pathlib.Path | None):
        self.base, self.html_root, self.toc = base, html_root, toc
        self.screenshots = screenshots
        self.failures: list[Failure] = []
        self.wrapped: list[Failure] = []
        self.stats = {"pre blocks": 0, "pre blocks wrapping at 1280 px": 0, "images": 0,
                      "local links": 0}
        self.current = "(browser start)"
        self.context = context
        # every page is a first visit: no theme mode or sidebar position left over
        context.add_init_script("try { localStorage.clear(); sessionStorage.clear(); }"
                                " catch (e) {}")
        context.route(lambda url: not url.startswith(self.base), self._outside)
        self.page = context.new_page()
        self.page.set_default_timeout(PAGE_TIMEOUT_MS)
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.fail(
            f"page error: {getattr(e, 'message', e)}"))
        self.page.on("requestfailed", self._request_failed)
        self.page.on("response", self._response)

    def fail(self, reason: str, page: str | None = None):
        failure = Failure(page or self.current, reason)
        if failure not in self.failures:
            self.failures.append(failure)

    def rel(self, url: str) -> str:
        return url[len(self.base):] if url.startswith(self.base) else url

    # events -------------------------------------------------------------------
    def _outside(self, route):
        url = route.request.url
        if url.startswith(("http://", "https://")):
            self.fail(f"requests {url[:100]} from another host (the book must work "
                      "offline)")
            route.abort()
        else:
            route.continue_()

    def _console(self, message):
        if message.type == "error":
            where = self.rel(message.location.get("url", "") or "")
            self.fail(f"console error: {message.text[:200]}"
                      + (f" (at {where})" if where else ""))

    def _request_failed(self, request):
        if request.url.startswith(self.base):
            self.fail(f"request failed: {self.rel(request.url)} ({request.failure})")

    def _response(self, response):
        if response.url.startswith(self.base) and response.status >= 400:
            self.fail(f"HTTP {response.status} for {self.rel(response.url)}")

    # one page -----------------------------------------------------------------
    def check_page(self, rel: str):
        self.current = rel
        page = self.page
        page.set_viewport_size({"width": SCREEN_WIDTHS[0], "height": SCREEN_HEIGHT})
        try:
            response = page.goto(self.base + rel, wait_until="load")
        except Exception as exc:  # a timeout or a refused connection: say what it was
            self.fail(f"does not load ({type(exc).__name__}: {str(exc)[:120]})")
            return
        status = response.status if response else None
        if status != 200:
            self.fail(f"does not load (HTTP {status})")
            return
        with contextlib.suppress(Exception):  # late requests, e.g. search summaries
            page.wait_for_load_state("networkidle", timeout=5_000)
        self.check_images()
        self.check_sidebar()
        self.check_links()
        if self.screenshots is not None:
            name = rel.split("?")[0].removesuffix(".html").replace("/", "__") + ".png"
            page.screenshot(path=str(self.screenshots / name), full_page=True)
        page.evaluate(JS_OPEN_DETAILS)  # folded cells count: a reader opens them
        page.add_style_tag(content=CSS_NO_MOTION)
        for width in SCREEN_WIDTHS:
            page.set_viewport_size({"width": width, "height": SCREEN_HEIGHT})
            self.check_widths(page.evaluate(JS_PRE, [CODE_COLUMNS, width == 1280]),
                              f"at {width} px")
        page.emulate_media(media="print")
        page.set_viewport_size({"width": PRINT_WIDTH, "height": SCREEN_HEIGHT})
        self.check_widths(page.evaluate(JS_PRE, [CODE_COLUMNS, False]),
                          "in print layout", printed=True)
        page.emulate_media(media="screen")

    def check_images(self):
        for image in self.page.evaluate(JS_IMAGES):
            self.stats["images"] += 1
            if not image["ok"]:
                self.fail(f"image does not load: {image['src']}")
            problem = alt_problem(image["alt"])
            if problem:
                self.fail(f"image {image['src']} {problem}")

    def check_sidebar(self):
        sidebar = self.page.evaluate(JS_SIDEBAR)
        if sidebar is None:
            self.fail("no sidebar navigation (nav.bd-docs-nav)")
            return
        listed = [self.rel(u.split("#")[0].split("?")[0]) for u in sidebar["links"]
                  if u.startswith(self.base)]
        if listed != self.toc.pages:
            missing = [p for p in self.toc.pages if p not in listed]
            extra = [p for p in listed if p not in self.toc.pages]
            self.fail("sidebar differs from _toc.yml: " + (
                f"missing {missing}" if missing else "") + (
                f" extra {extra}" if extra else "") + (
                "" if missing or extra else f" order {listed}"))
        if sidebar["captions"] != self.toc.captions:
            self.fail(f"sidebar captions {sidebar['captions']} differ from _toc.yml's "
                      f"{self.toc.captions}")

    def check_links(self):
        seen = set()
        for url in self.page.evaluate(JS_LINKS):
            if not url.startswith(self.base) or url in seen:
                continue
            seen.add(url)
            self.stats["local links"] += 1
            problem = link_problem(self.html_root, self.rel(url))
            if problem:
                self.fail(problem)

    def check_widths(self, found: dict, where: str, printed: bool = False):
        if found["pageScroll"]:
            self.fail(f"page scrolls sideways {where} ({found['pageWidth']} px wide in "
                      f"a {found['viewWidth']} px window; widest: "
                      f"{', '.join(found['wide'])})")
        verb = "clipped" if printed else "scrolling sideways"
        for labels, what in ((found["scrolls"], verb),
                             (found["clipped"], "cut by an overflow box")):
            if labels:
                examples = ", ".join(repr(label) for label in labels[:3])
                self.fail(f"{len(labels)} <pre> {what} {where}, first: {examples}")
        fit = found["fit"]
        if fit is not None:
            self.stats["pre blocks"] += found["pres"]
            self.stats["pre blocks wrapping at 1280 px"] += len(found["wraps"])
            for line in found["wraps"]:
                said = f"{len(line)} characters: {line.strip()[:60]!r}"
                if len(line) <= CODE_COLUMNS:  # the book's CSS promises these fit
                    self.fail(f"a line of {said} wraps {where}")
                else:
                    self.wrapped.append(Failure(self.current, said))
            if fit["need"] > fit["have"] + 0.5:
                self.fail(f"an {CODE_COLUMNS}-character line needs "
                          f"{fit['need']:.0f} px {where} but a code block has "
                          f"{fit['have']:.0f} px (font {fit['font']})")

    # the site -----------------------------------------------------------------
    def check_search(self, query: str, expects: str):
        self.current = f"search.html?q={query}"
        self.page.set_viewport_size({"width": SCREEN_WIDTHS[0],
                                     "height": SCREEN_HEIGHT})
        response = self.page.goto(self.base + self.current, wait_until="load")
        if not response or response.status != 200:
            self.fail(f"does not load (HTTP {response.status if response else None})")
            return
        try:
            self.page.wait_for_function(JS_SEARCH_DONE, timeout=15_000)
        except Exception as exc:
            self.fail(f"search did not finish ({type(exc).__name__})")
            return
        found = [self.rel(u).split("#")[0] for u in self.page.evaluate(
            "() => [...document.querySelectorAll('#search-results a')]"
            ".map(a => a.href)")]
        if expects + ".html" not in found:
            self.fail(f"search for {query!r} does not list {expects} (found {found})")
        self.check_links()

    def check_icons(self, root_page: str):
        icons = ["favicon.ico"]
        with contextlib.suppress(Exception):
            self.page.goto(self.base + root_page, wait_until="load")
            icons += [self.rel(u) for u in self.page.evaluate(
                "() => [...document.querySelectorAll('link[rel~=icon]')]"
                ".map(l => l.href)")]
        if len(icons) == 1:
            self.fail("no <link rel=icon> (favicon)", page=root_page)
        for icon in icons:
            status = self.context.request.get(self.base + icon).status
            if status != 200:
                self.fail(f"icon {icon} answers HTTP {status}", page=icon)


def check_book(html_root: pathlib.Path | str = ROOT / "_build" / "html",
               toc: pathlib.Path | str = ROOT / "_toc.yml",
               pages: list[str] | None = None,
               screenshots: pathlib.Path | str | None = None,
               site: bool = True) -> Report:
    """Check `pages` (html paths; default every page of the toc) of a built book.

    site: also the search for `set_epoch` and the favicon.
    """
    start = time.perf_counter()
    html_root = pathlib.Path(html_root).resolve()
    if not (html_root / "index.html").is_file():
        raise FileNotFoundError(f"{html_root} holds no built book (no index.html): "
                                "run `make book` first")
    contents = read_toc(pathlib.Path(toc))
    unknown = [p for p in pages or [] if p not in contents.pages]
    if unknown:
        raise ValueError(f"pages {unknown} are not in {toc}; allowed: {contents.pages}")
    if screenshots is not None:
        screenshots = pathlib.Path(screenshots)
        screenshots.mkdir(parents=True, exist_ok=True)
        for old in screenshots.glob("*.png"):
            old.unlink()
    page_ids.cache_clear()
    with serve(html_root) as base, browser_context() as context:
        checker = _Checker(context, base, html_root, contents, screenshots)
        for rel in pages or contents.pages:
            checker.check_page(rel)
        if site:
            checker.check_search(SEARCH_QUERY, SEARCH_EXPECTS)
            checker.check_icons(contents.pages[0])
    return Report(pages or contents.pages, checker.failures, checker.stats,
                  time.perf_counter() - start, checker.wrapped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--html", default=ROOT / "_build" / "html", type=pathlib.Path,
                        help="the built book (default: _build/html)")
    parser.add_argument("--toc", default=ROOT / "_toc.yml", type=pathlib.Path)
    parser.add_argument("--screenshots", default=ROOT / "_build" / "screenshots",
                        type=pathlib.Path, help="where the 1280 px screenshots go")
    args = parser.parse_args(argv)
    report = check_book(args.html, args.toc, screenshots=args.screenshots)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
