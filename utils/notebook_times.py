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
import sys
import time

import nbformat
import yaml

from . import results
from .bench import environment

ROOT = pathlib.Path(__file__).resolve().parent.parent

__all__ = ["toc_notebooks", "time_notebook", "minutes_label", "intro_with_times"]

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


def time_notebook(path: pathlib.Path, timeout: int = 1800) -> float:
    """Execute a copy of the notebook in a fresh kernel; return its wall time (s).

    Raises the kernel's error if a cell fails, so a broken chapter is never timed.
    """
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


def minutes_label(seconds: float) -> str:
    """How the book quotes a run time: under a minute, or whole minutes rounded up."""
    if seconds <= 0:
        raise ValueError(f"a run time must be positive, got {seconds}")
    if seconds < 60:
        return "< 1 min"
    return f"{math.ceil(seconds / 60)} min"


def intro_with_times(text: str, seconds: dict[str, float]) -> str:
    """The landing page's text with each chapter row's last cell set to its time.

    A row is a table line that links ``../notebooks/NAME.ipynb``; its last cell becomes
    ``minutes_label`` of ``seconds["notebooks/NAME.ipynb"]``. Raises if a timed notebook
    has no row, so the table cannot silently miss a chapter.
    """
    lines = text.split("\n")
    done = set()
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        for name, value in seconds.items():
            if f"(../{name})" in line:
                cells = line.rstrip().rstrip("|").split("|")
                cells[-1] = f" {minutes_label(value)} "
                lines[i] = "|".join(cells) + "|"
                done.add(name)
    missing = sorted(set(seconds) - done)
    if missing:
        raise ValueError(f"book/intro.md has no table row linking {missing}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update-intro", action="store_true",
                        help="also write the times into book/intro.md's table")
    parser.add_argument("--out", type=pathlib.Path, required=True,
                        help="JSON file to write, e.g. "
                             "book/results/notebook_times_cpu.json")
    args = parser.parse_args(argv)
    times = {}
    for path in toc_notebooks():
        seconds = time_notebook(path)
        name = path.relative_to(ROOT).as_posix()
        times[name] = round(seconds, 1)
        print(f"{name}: {seconds:.1f} s ({minutes_label(seconds)})", flush=True)
    result = {
        "benchmark": "wall time of each chapter, run top to bottom in a fresh kernel",
        "seconds": times,
        "start_method": multiprocessing.get_start_method(),
        "environment": environment(),
        "command": "python -m utils.notebook_times "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    # not the notebooks among the sources: their times move by seconds with each edit,
    # and the landing page quotes them rounded to minutes (regenerate when a chapter's
    # work changes: python -m utils.notebook_times --update-intro)
    results.write(str(args.out), result, ["utils/notebook_times.py::time_notebook"])
    if args.update_intro:
        INTRO.write_text(intro_with_times(INTRO.read_text(), times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
