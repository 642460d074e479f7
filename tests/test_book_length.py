"""The book's length, measured from the notebooks' own text: words of markdown per chapter
(outside its exercises and their solutions), per cell, in all chapters and in the appendices;
inline citations of the five source articles; recaps per chapter. The limits are the second
edition's (DESIGN.md, "Chapter plan"); a chapter still over its limit is listed in
``STILL_OVER`` with the words it has now, a ceiling it may not grow past, until it is cut.

``python tests/test_book_length.py`` prints the table."""

import re
from pathlib import Path

import pytest

from utils.notebook_times import cell_sources, prose_words

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTER_WORDS = 3_500  # markdown words of one chapter, outside its exercises
CELL_WORDS = 450  # words of one markdown cell
CHAPTERS_WORDS = 36_000  # all chapters together, outside their exercises
APPENDIX_WORDS = 10_000  # all appendices together
CITATIONS = 20  # inline citations of S0-S4, in all notebooks
# chapters not yet cut to CHAPTER_WORDS (issue 45): their words now, as a ceiling
STILL_OVER: dict[str, int] = {}
# the chapters together, until they are cut to CHAPTERS_WORDS (then None)
STILL_OVER_IN_ALL: int | None = None

CITATION = re.compile(r"\[S[0-4]\]|\{cite:[a-z]+\}`s[0-4]`")


def notebooks():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def is_appendix(path: Path) -> bool:
    return path.stem.startswith("appendix")


def measure(path: Path) -> dict:
    """Words outside the exercises, the longest markdown cell, citations (markdown and code),
    citations in headings, and recaps ("## Summary" sections and Key points boxes)."""
    cells = cell_sources(path)
    cells_words = [len(source.split()) for kind, source in cells if kind == "markdown"]
    text = [source for _, source in cells]
    headings = [line for kind, source in cells if kind == "markdown"
                for line in source.splitlines() if line.startswith("#")]
    return {"words": prose_words(path), "longest_cell": max(cells_words, default=0),
            "citations": sum(len(CITATION.findall(t)) for t in text),
            "cited_in_headings": [h for h in headings if CITATION.search(h)],
            "key_points": sum(t.count("```{admonition} Key points") for t in text)}


@pytest.fixture(scope="module")
def lengths():
    return {path.stem: measure(path) for path in notebooks()}


def test_every_markdown_cell_is_readable_in_one_go(lengths):
    assert {name: m["longest_cell"] for name, m in lengths.items()
            if m["longest_cell"] > CELL_WORDS} == {}


def test_chapters_are_a_sitting_each_and_the_ones_still_over_do_not_grow(lengths):
    chapters = {name: m["words"] for name, m in lengths.items() if not name.startswith("appendix")}
    over = {name: words for name, words in chapters.items()
            if words > STILL_OVER.get(name, CHAPTER_WORDS)}
    assert over == {}, f"over {CHAPTER_WORDS} words (or their ceiling in STILL_OVER)"
    cut = [name for name in STILL_OVER if chapters.get(name, 0) <= CHAPTER_WORDS]
    assert cut == [], "cut to the limit: take them out of STILL_OVER"
    total = sum(chapters.values())
    assert total <= (STILL_OVER_IN_ALL or CHAPTERS_WORDS)
    assert STILL_OVER_IN_ALL is None or total > CHAPTERS_WORDS, \
        "cut to the limit: set STILL_OVER_IN_ALL = None"


def test_appendices_stay_within_their_limit(lengths):
    assert sum(m["words"] for name, m in lengths.items() if name.startswith("appendix")) \
        <= APPENDIX_WORDS


def test_the_sources_are_cited_sparingly_and_never_in_a_heading(lengths):
    assert sum(m["citations"] for m in lengths.values()) <= CITATIONS
    assert {name: m["cited_in_headings"] for name, m in lengths.items()
            if m["cited_in_headings"]} == {}


def test_each_chapter_recaps_once(lengths):
    assert {name: m["key_points"] for name, m in lengths.items() if m["key_points"] != 1} == {}


if __name__ == "__main__":
    rows = {path.stem: measure(path) for path in notebooks()}
    print(f"{'notebook':<36}{'words':>7}{'longest cell':>14}{'citations':>11}")
    for name, m in rows.items():
        print(f"{name:<36}{m['words']:>7}{m['longest_cell']:>14}{m['citations']:>11}")
    chapters = sum(m["words"] for name, m in rows.items() if not name.startswith("appendix"))
    print(f"chapters: {chapters} words; citations: {sum(m['citations'] for m in rows.values())}")
