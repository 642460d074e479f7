"""The built book in headless Chromium (book_check.py), and tests of the checker itself.

`make test-browser` builds the book first; run alone, these need `make book` done (or
BOOK_HTML naming another built copy).
The checker's own tests break a copy of the built book and show each break reported.
"""

import os
import pathlib
import re
import shutil

import pytest

import book_check
from book_check import Failure, alt_problem, check_book, html_path, read_toc

HTML = pathlib.Path(os.environ.get("BOOK_HTML", book_check.ROOT / "_build" / "html"))
SCREENSHOTS = book_check.ROOT / "_build" / "screenshots"
# full-page screenshots double the check's CPU time: taken by `make test-browser`, which sets
# BOOK_SCREENSHOTS=1, not by `make test`, where no one looks at them
TAKE_SCREENSHOTS = os.environ.get("BOOK_SCREENSHOTS") == "1"
TOC = read_toc(book_check.ROOT / "_toc.yml")
CHAPTERS = [p for p in TOC.pages if p.startswith("notebooks/")]


@pytest.fixture(scope="module")
def built() -> pathlib.Path:
    if not (HTML / "index.html").is_file():
        pytest.fail(f"no built book in {HTML}: run `make book` "
                    "(`make test-browser` does)")
    return HTML


@pytest.fixture
def copy(built, tmp_path) -> pathlib.Path:
    shutil.copytree(built, tmp_path / "html")
    return tmp_path / "html"


def test_the_built_book_passes_in_the_browser(built):
    report = check_book(built, screenshots=SCREENSHOTS if TAKE_SCREENSHOTS else None)
    print(report.summary())
    if report.failures:
        pytest.fail(report.summary(), pytrace=False)
    assert report.pages == TOC.pages and len(TOC.pages) >= len(CHAPTERS) + 2
    if TAKE_SCREENSHOTS:
        assert len(list(SCREENSHOTS.glob("*.png"))) == len(TOC.pages)
    assert report.stats["images"] >= len(CHAPTERS)  # every chapter has a picture


def local_image(html_root: pathlib.Path) -> tuple[str, pathlib.Path]:
    """The first chapter page that shows an image file of the build, and that file."""
    for page in CHAPTERS:
        html = (html_root / page).read_text()
        for src in re.findall(r'<img[^>]*\ssrc="([^"#?:]+)"', html):
            image = (html_root / page).parent / src
            if image.is_file():
                return page, image.resolve()
    raise AssertionError(f"no chapter page of {html_root} shows an image file")


def test_a_removed_image_is_reported_on_its_page(copy):
    page, image = local_image(copy)
    relative = image.relative_to(copy).as_posix()
    before = check_book(copy, pages=[page], site=False)
    assert not [f for f in before.failures if image.name in f.reason]
    image.unlink()
    after = check_book(copy, pages=[page], site=False)
    reasons = [f.reason for f in after.failures if f.page == page]
    assert any(r.startswith("image does not load") and image.name in r for r in reasons)
    assert f"HTTP 404 for {relative}" in reasons


def test_a_removed_page_is_reported_and_so_are_the_links_to_it(copy):
    gone, neighbour = CHAPTERS[1], CHAPTERS[2]
    (copy / gone).unlink()
    report = check_book(copy, pages=[gone, neighbour], site=False)
    assert Failure(gone, "does not load (HTTP 404)") in report.failures
    link = Failure(neighbour, f"links to {gone}, which is not in the build")
    assert link in report.failures


def test_a_sidebar_in_another_order_than_the_toc_is_reported(built, tmp_path):
    toc = (book_check.ROOT / "_toc.yml").read_text()
    first, second = (p.removesuffix(".html") for p in CHAPTERS[:2])
    swapped = toc.replace(first, "\0").replace(second, first).replace("\0", second)
    (tmp_path / "_toc.yml").write_text(swapped)
    report = check_book(built, toc=tmp_path / "_toc.yml", pages=[TOC.pages[0]],
                        site=False)
    assert [f.page for f in report.failures if "sidebar differs" in f.reason] == [
        TOC.pages[0]]


PLANTED = """
<script>console.error("planted console error")</script>
<script>throw new Error("planted page error")</script>
<a href="#planted-missing-anchor">a link to nowhere</a>
<img src="https://example.invalid/planted.png" alt="a picture from another host">
<img src="../_static/favicon.svg" alt="favicon.svg">
</body>"""


def test_planted_errors_are_each_reported(copy):
    page = CHAPTERS[0]
    html = (copy / page).read_text()
    assert html.count("</body>") == 1
    (copy / page).write_text(html.replace("</body>", PLANTED))
    reasons = [f.reason for f in check_book(copy, pages=[page], site=False).failures
               if f.page == page]
    expected = ["console error: planted console error",
                "page error: planted page error",
                f"links to {page}#planted-missing-anchor, an anchor that page does not",
                "requests https://example.invalid/planted.png from another host",
                "image does not load: https://example.invalid/planted.png",
                "image ../_static/favicon.svg has a file name as alt text"]
    missing = [e for e in expected if not any(r.startswith(e) for r in reasons)]
    assert not missing, f"not reported: {missing}; reported: {reasons}"


def test_code_that_scrolls_or_is_cut_in_print_is_reported_without_the_books_css(copy):
    (copy / "_static" / "book.css").write_text("")
    page = CHAPTERS[0]
    reasons = [f.reason for f in check_book(copy, pages=[page], site=False).failures]
    for where in ("scrolling sideways at 390 px", "clipped in print layout"):
        found = [r for r in reasons if re.match(rf"\d+ <pre> {where}", r)]
        assert found, (where, reasons)
    assert any(r.startswith("an 88-character line needs") for r in reasons), reasons


def test_a_search_that_misses_chapter_3_and_a_missing_favicon_are_reported(copy):
    index = copy / "searchindex.js"
    assert book_check.SEARCH_QUERY in index.read_text()
    index.write_text(index.read_text().replace(book_check.SEARCH_QUERY, "set_epoxy"))
    (copy / "favicon.ico").unlink()
    reasons = [str(f) for f in check_book(copy, pages=[TOC.pages[0]]).failures]
    missed = f"does not list {book_check.SEARCH_EXPECTS}"
    assert any(missed in r for r in reasons), reasons
    assert "favicon.ico: icon favicon.ico answers HTTP 404" in reasons


def test_alt_text_must_describe_the_image():
    assert alt_problem("Two ranks' shards of 16 samples, epoch 0 and 1") is None
    assert alt_problem(None) == "has no alt text"
    assert alt_problem("  ") == "has no alt text"
    assert "file name" in alt_problem("../_images/plot.png")
    assert "hash-like" in alt_problem("c023cdd93182d9077f5c7aa4721cf2961e9b15809fcc")
    assert "hash-like" in alt_problem("fig1a2b3c4d5e6f7g8h")


def test_toc_entries_map_to_html_pages(tmp_path):
    assert html_path("notebooks/01_samplers") == "notebooks/01_samplers.html"
    assert html_path("book/intro.md") == "book/intro.html"
    assert TOC.pages[0] == html_path(book_check.yaml.safe_load(
        (book_check.ROOT / "_toc.yml").read_text())["root"])
    (tmp_path / "bad.yml").write_text("format: jb-book\nchapters: []\n")
    with pytest.raises(ValueError, match="'root' key"):
        read_toc(tmp_path / "bad.yml")
