"""How long each chapter takes to run, top to bottom, in a fresh kernel.

``python -m utils.notebook_times --out book/results/notebook_times_cpu.json``
executes every notebook of ``_toc.yml`` (on copies; the stored outputs are not
touched) and writes the wall time of each, with the machine, the versions, the
command and the date. The landing page's table of chapters quotes these times, and
``tests/test_book_pages.py`` checks that it does.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import multiprocessing
import pathlib
import re
import sys
import time

import nbformat
import yaml

from . import results
from .bench import environment

ROOT = pathlib.Path(__file__).resolve().parent.parent

__all__ = ["toc_notebooks", "time_notebook", "minutes_label", "intro_with_times",
           "cell_sources", "prose_words", "reading_label", "intro_with_reading"]

INTRO = ROOT / "book" / "intro.md"


def toc_notebooks(toc: pathlib.Path = ROOT / "_toc.yml") -> list[pathlib.Path]:
    """The notebooks listed in the book's table of contents, in reading order."""
    spec = yaml.safe_load(toc.read_text())
    found = []
    for part in spec.get("parts", []):
        for chapter in part.get("chapters", []):
            path = ROOT / (chapter["file"] + ".ipynb")
            if path.exists():
                found.append(path)
    return found


def time_notebook(path: pathlib.Path, timeout: int = 1800, save: bool = False) -> float:
    """Execute a copy of the notebook in a fresh kernel; return its wall time (s).
    ``save``: write the executed notebook, its new outputs, back to ``path`` (after
    the clock stops), so one run gives both the time and the stored outputs.

    Raises the kernel's error if a cell fails, so a broken chapter is never timed.
    """
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    if save:
        nbformat.write(nb, path)
    return seconds


def minutes_label(seconds: float) -> str:
    """How the book quotes a run time: under a minute, or whole minutes rounded up."""
    if seconds <= 0:
        raise ValueError(f"a run time must be positive, got {seconds}")
    if seconds < 60:
        return "< 1 min"
    return f"{math.ceil(seconds / 60)} min"


# words of prose a reader takes in per minute, in a chapter that also has code and
# its output to read: the landing page's "Time to read"
READING_WORDS_PER_MINUTE = 150


def cell_sources(path: pathlib.Path) -> list[tuple[str, str]]:
    """Each cell's type and source text, read as plain JSON (no schema validation:
    fast enough to measure every chapter in a test)."""
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list)
             else c["source"]) for c in cells]


def prose_words(path: pathlib.Path) -> int:
    """Words of a chapter's markdown before its exercises: what one sitting reads."""
    words = 0
    for kind, source in cell_sources(path):
        if kind != "markdown":
            continue
        before, exercises, _ = ("\n" + source).partition("\n## Exercises")
        words += len(before.split())
        if exercises:
            break
    return words


def reading_label(words: int) -> str:
    """How the book quotes a reading time: whole minutes, rounded up."""
    return f"{max(1, math.ceil(words / READING_WORDS_PER_MINUTE))} min"


def _intro_with_cells(text: str, cells_by_name: dict[str, str], column: int) -> str:
    """The landing page's text with one cell (``column``, from the right: -1 is the
    last) of each chapter row set; a row is a table line that links
    ``../notebooks/NAME.ipynb`` first in its chapter cell, and ``cells_by_name`` is
    keyed by ``notebooks/NAME.ipynb``. Raises if a notebook has no row, so the table
    cannot silently miss a chapter (a link elsewhere in a row, a part's "builds on
    chapter N", does not make it that chapter's row)."""
    lines = text.split("\n")
    done = set()
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        cells = line.rstrip().rstrip("|").split("|")
        for name, value in cells_by_name.items():
            if len(cells) > 2 and re.match(rf"\s*\[[^\]]*\]\(\.\./{re.escape(name)}\)",
                                           cells[2]):
                cells[column] = f" {value} "
                lines[i] = "|".join(cells) + "|"
                done.add(name)
    missing = sorted(set(cells_by_name) - done)
    if missing:
        raise ValueError(f"book/intro.md has no table row linking {missing}")
    return "\n".join(lines)


def intro_with_times(text: str, seconds: dict[str, float]) -> str:
    """The landing page's text with each chapter row's last cell ("Time to run") set
    to ``minutes_label`` of ``seconds["notebooks/NAME.ipynb"]``."""
    return _intro_with_cells(text, {name: minutes_label(value)
                                    for name, value in seconds.items()}, -1)


def intro_with_reading(text: str, words: dict[str, int]) -> str:
    """The landing page's text with each chapter row's cell before the last ("Time to
    read") set to ``reading_label`` of ``words["notebooks/NAME.ipynb"]``."""
    return _intro_with_cells(text, {name: reading_label(value)
                                    for name, value in words.items()}, -2)


def reading_words() -> dict[str, int]:
    """``prose_words`` of every notebook in ``_toc.yml``, keyed as the intro's rows."""
    return {p.relative_to(ROOT).as_posix(): prose_words(p) for p in toc_notebooks()}


def _earlier(path: pathlib.Path) -> tuple[dict, dict]:
    """The times an earlier run wrote to ``path``, and when each was measured."""
    with open(path) as f:
        earlier = json.load(f)
    seconds = earlier["seconds"]
    return dict(seconds), dict(earlier.get("measured") or
                               {name: earlier["date"] for name in seconds})


def _chosen(only: list[str] | None) -> list[pathlib.Path]:
    notebooks = toc_notebooks()
    if not only:
        return notebooks
    names = {p.relative_to(ROOT).as_posix(): p for p in notebooks}
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise SystemExit(f"--only: {unknown} not in _toc.yml; choose from "
                         f"{sorted(names)}")
    return [names[name] for name in only]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update-intro", action="store_true",
                        help="also write the times, and the reading times from the "
                             "chapters' words, into book/intro.md's table")
    parser.add_argument("--reading-only", action="store_true",
                        help="write only the reading times into book/intro.md's "
                             "table (from the chapters' words; runs nothing)")
    parser.add_argument("--out", type=pathlib.Path,
                        help="JSON file to write, e.g. "
                             "book/results/notebook_times_cpu.json")
    parser.add_argument("--only", nargs="+", metavar="NOTEBOOK",
                        help="time only these notebooks (paths as in _toc.yml, e.g. "
                             "notebooks/16_streams_of_shards.ipynb) and keep the "
                             "others' times from --out, each with the date it was "
                             "measured")
    parser.add_argument("--save-outputs", action="store_true",
                        help="also write each executed notebook back, with its new "
                             "outputs (one run for the time and the stored outputs)")
    args = parser.parse_args(argv)
    if args.reading_only:
        INTRO.write_text(intro_with_reading(INTRO.read_text(), reading_words()))
        return 0
    if args.out is None:
        parser.error("--out is required (a JSON file to write), unless --reading-only")
    times, timed = _earlier(args.out) if args.only else ({}, {})
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    for path in _chosen(args.only):
        seconds = time_notebook(path, save=args.save_outputs)
        name = path.relative_to(ROOT).as_posix()
        times[name], timed[name] = round(seconds, 1), now
        print(f"{name}: {seconds:.1f} s ({minutes_label(seconds)})", flush=True)
    order = [p.relative_to(ROOT).as_posix() for p in toc_notebooks()]
    result = {
        "benchmark": "wall time of each chapter, run top to bottom in a fresh kernel",
        "seconds": {name: times[name] for name in order if name in times},
        "measured": {name: timed[name] for name in order if name in timed},
        "start_method": multiprocessing.get_start_method(),
        "environment": environment(),
        "command": "python -m utils.notebook_times "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "date": now,
    }
    # not the notebooks among the sources: their times move by seconds with each edit,
    # and the landing page quotes them rounded to minutes (regenerate when a chapter's
    # work changes: python -m utils.notebook_times --update-intro)
    results.write(str(args.out), result, ["utils/notebook_times.py::time_notebook"])
    if args.update_intro:
        INTRO.write_text(intro_with_reading(intro_with_times(INTRO.read_text(), times),
                                            reading_words()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
