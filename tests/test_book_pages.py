"""The book's pages: landing-page times, chapter links, citations, no placeholder."""

import json
import pathlib
import re

import nbformat
import pytest
import yaml

from utils.notebook_times import (intro_with_reading, intro_with_times, minutes_label, reading_label,
                                  reading_words, toc_notebooks)

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOC = yaml.safe_load((ROOT / "_toc.yml").read_text())
NUMBERED = [c["file"] for part in TOC["parts"] if part.get("numbered")
            for c in part["chapters"]]
CHAPTER_0 = "notebooks/00_the_picture"  # before Part I, in "Getting started"
PAGES = [ROOT / "README.md"] + sorted((ROOT / "book").glob("*.md"))


def markdown_sources():
    for path in toc_notebooks():
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "markdown":
                yield f"{path.name} cell {i}", cell.source
    for path in PAGES:
        yield path.name, path.read_text()


def test_chapters_are_numbered_in_reading_order():
    names = [pathlib.Path(f).name for f in NUMBERED]
    assert names[:10] == sorted(names[:10]) and names[0] == "01_samplers", names
    assert all(name.startswith(f"{i:02d}_") for i, name in enumerate(names, 1)), names


def test_every_chapter_number_in_the_text_links_to_that_chapter():
    wrong = []
    # "[chapter 3](03_set_epoch.ipynb)", and "chapters [2](...) and [3](...)"
    linked = re.compile(r"\[(?:[Cc]hapters? )?(\d+)\]\(([^)#]*\d\d_[^)#]+)")
    for where, text in markdown_sources():
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks are not prose
        for m in linked.finditer(text):
            n, target = int(m.group(1)), pathlib.Path(m.group(2)).stem
            chapter = CHAPTER_0 if n == 0 else NUMBERED[n - 1] if n <= len(NUMBERED) else ""
            if pathlib.Path(chapter).name != target:
                wrong.append(f"{where}: {m.group(0)} links the wrong chapter")
        bare = re.sub(r"\[[^\]]*\]\([^)]*\)", "", text)  # drop every link
        for m in re.finditer(r"\b[Cc]hapters? \d+\b", bare):
            wrong.append(f"{where}: '{m.group(0)}' is not a link")
    assert not wrong, "\n".join(wrong)


def test_every_citation_has_a_bibliography_entry_with_a_label():
    bib = (ROOT / "book" / "references.bib").read_text()
    entries = dict(re.findall(r"@\w+\{([\w-]+),(.*?)\n\}", bib, flags=re.S))
    assert {"s0", "s1", "s2", "s3", "s4"} <= set(entries)
    missing_label = [k for k, body in entries.items() if "shorthand" not in body]
    assert not missing_label
    cited = set()
    for _, text in markdown_sources():
        for keys in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", text):
            cited.update(k.strip() for k in keys.split(","))
    assert cited - set(entries) == set()
    assert {"s0", "s1", "s2", "s3", "s4"} <= cited


def test_landing_page_times_come_from_the_results_file():
    results = json.loads((ROOT / "book/results/notebook_times_cpu.json").read_text())
    names = {p.relative_to(ROOT).as_posix() for p in toc_notebooks()}
    assert set(results["seconds"]) == names, "re-run python -m utils.notebook_times"
    intro = (ROOT / "book/intro.md").read_text()
    assert intro_with_times(intro, results["seconds"]) == intro
    for name, seconds in results["seconds"].items():
        row = next(line for line in intro.splitlines()
                   if line.startswith("|") and f"(../{name})" in line)
        assert row.rstrip(" |").endswith(minutes_label(seconds)), row


def test_landing_page_reading_times_come_from_the_chapters_words():
    intro = (ROOT / "book/intro.md").read_text()
    assert intro_with_reading(intro, reading_words()) == intro, (
        "re-run python -m utils.notebook_times --reading-only")
    assert reading_label(1) == "1 min" and reading_label(151) == "2 min"


def test_intro_with_times_refuses_a_chapter_without_a_row():
    with pytest.raises(ValueError, match="no table row linking"):
        intro_with_times("| 1 | [x](../notebooks/x.ipynb) | 1 min |",
                         {"notebooks/x.ipynb": 30, "notebooks/y.ipynb": 30})
    with pytest.raises(ValueError, match="no table row linking"):  # a part's "builds on" link
        intro_with_times("| | **Part I** (builds on [1](../notebooks/x.ipynb)) | |",
                         {"notebooks/x.ipynb": 30})
    row = "| 1 | [x](../notebooks/x.ipynb) | ? |"
    assert intro_with_times(row, {"notebooks/x.ipynb": 61}) == row.replace("?", "2 min")
    with pytest.raises(ValueError, match="positive"):
        minutes_label(0)


def test_no_placeholder_in_config_or_pages():
    config = (ROOT / "_config.yml").read_text()
    assert "example" not in config and "The book's authors" not in config
    for path in PAGES:
        text = path.read_text()
        assert "<this repository>" not in text and "<it>" not in text, path.name


def test_timing_only_some_chapters_keeps_the_others_with_their_dates(tmp_path,
                                                                      monkeypatch):
    from utils import notebook_times

    out = tmp_path / "times.json"
    out.write_text(json.dumps({"seconds": {"notebooks/01_samplers.ipynb": 5.0,
                                           "notebooks/02_distributed_sampler.ipynb": 9.0},
                               "date": "2026-01-01T00:00:00+00:00"}))
    saved = []
    monkeypatch.setattr(notebook_times, "time_notebook",
                        lambda path, save=False: saved.append(save) or 70.0)
    monkeypatch.setattr(notebook_times.results, "write",
                        lambda path, result, sources: out.write_text(json.dumps(result)))
    notebook_times.main(["--only", "notebooks/02_distributed_sampler.ipynb",
                         "--out", str(out), "--save-outputs"])
    assert saved == [True]
    written = json.loads(out.read_text())
    assert written["seconds"] == {"notebooks/01_samplers.ipynb": 5.0,
                                  "notebooks/02_distributed_sampler.ipynb": 70.0}
    assert written["measured"]["notebooks/01_samplers.ipynb"].startswith("2026-01-01")
    assert written["measured"]["notebooks/02_distributed_sampler.ipynb"] == \
        written["date"]
    with pytest.raises(SystemExit, match="not in _toc.yml"):
        notebook_times.main(["--only", "notebooks/nope.ipynb", "--out", str(out)])


def test_a_timed_notebook_is_saved_with_the_outputs_of_that_run_only_when_asked(tmp_path):
    from utils.notebook_times import time_notebook

    path = tmp_path / "n.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nbformat.write(nb, path)
    assert time_notebook(path) > 0 and not nbformat.read(path, 4).cells[0].outputs
    time_notebook(path, save=True)
    assert nbformat.read(path, 4).cells[0].outputs[0]["text"] == "42\n"


def test_the_readme_is_short_enough_for_a_newcomer():
    """At most 800 words (issue 43): what it is, the two commands, how to run on GPUs;
    measurement history lives in book/results/, not in it."""
    assert len((ROOT / "README.md").read_text().split()) <= 800


def heading_anchors(page: str) -> set[str]:
    """The anchors MyST gives a notebook's headings (as in links like ``#a-dead-rank``)."""
    nb = nbformat.read(ROOT / f"{page}.ipynb", as_version=4)
    headings = [line.lstrip("#").strip() for cell in nb.cells if cell.cell_type == "markdown"
                for line in cell.source.splitlines() if re.match(r"#{1,2} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_old_addresses_of_moved_chapters_send_the_reader_to_the_new_page_or_section(tmp_path):
    import sys
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import redirects
    pages = {c["file"] for part in TOC["parts"] for c in part["chapters"]}
    assert "notebooks/12_exact_resume" in pages and "notebooks/12_surviving_a_cluster" not in pages
    for old, (new, sections) in redirects.MOVED.items():
        assert old not in pages and new in pages, (old, new)
        for where in sections.values():
            page, _, anchor = where.partition("#")
            assert page in pages, where
            assert not anchor or anchor in heading_anchors(page), f"{where}: no such heading"
    written = redirects.write_stubs(tmp_path, pages=pages)
    stub = (tmp_path / "notebooks" / "12_surviving_a_cluster.html").read_text()
    assert len(written) == len(redirects.MOVED)
    assert 'content="0; url=../notebooks/12_exact_resume.html"' in stub
    moved = json.loads(re.search(r"var moved = (\{.*?\});", stub).group(1))
    assert moved["hardening-step-4-a-dead-rank"] == "../notebooks/13_restarts_and_slurm.html#a-dead-rank"
    with pytest.raises(ValueError, match="is a page of the book"):
        redirects.write_stubs(tmp_path, pages=pages | {"notebooks/15_streams_of_shards"})
