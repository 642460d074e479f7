"""The book's rules for chapters, checked on every notebook (their outputs are checked by nbval)."""

import pathlib
import re

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the chapters and the appendix notebooks
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.startswith("_"))


def test_there_are_chapters():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_rules(path):
    nb = nbformat.read(path, as_version=4)
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert markdown[0].startswith("# ") and not markdown[0].startswith("# #"), "the first cell is the title"
    assert not any(re.match(r"#\s+#", m) for m in markdown), "a heading with a stray '# '"
    assert "you will learn" in markdown[0], "learning goals at the top"
    assert any("## Summary" in m for m in markdown) and any("## Exercises" in m for m in markdown)
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), "at least one picture"
    assert sum(bool(c.outputs) for c in code) >= len(code) / 2, "committed with outputs"
    assert not any(o.output_type == "error" for c in code for o in c.outputs), "no stored errors"
    exempt = [c for c in code if "NBVAL_IGNORE_OUTPUT" in c.source or "NBVAL_SKIP" in c.source]
    assert len(exempt) <= 0.15 * len(code), "at most 15% of code cells exempt from comparison"
    assert all("assert" in c.source for c in exempt), "an exempt cell asserts its claim"
    assert f"notebooks/{path.stem}" in (ROOT / "_toc.yml").read_text(), "listed in _toc.yml"


# Code that starts processes whose start method follows the platform's (DataLoader workers,
# torchrun's workers, multiprocessing): such a chapter must be in the Makefile's spawn pass.
STARTS_PROCESSES = re.compile(r"num_workers=(?!0\b)|--workers|multiprocessing|torch\.distributed\.run")


def test_every_chapter_that_starts_worker_processes_is_in_the_spawn_pass():
    makefile = (ROOT / "Makefile").read_text()
    makefile = makefile.replace("\\\n", " ")  # join continued lines
    listed = set(re.search(r"^SPAWN_NOTEBOOKS\s*:=(.*)$", makefile, re.M).group(1).split())
    starting = {p.stem for p in NOTEBOOKS
                if STARTS_PROCESSES.search("\n".join(c.source for c in nbformat.read(p, as_version=4).cells
                                                    if c.cell_type == "code"))}
    missing = sorted(n for n in listed if not (ROOT / "notebooks" / f"{n}.ipynb").exists())
    assert not missing, f"SPAWN_NOTEBOOKS names notebooks that do not exist: {missing}"
    assert starting <= listed, f"add {sorted(starting - listed)} to SPAWN_NOTEBOOKS in the Makefile"
    assert {"03_set_epoch", "05_workers_seeding", "10_cifar10_ddp"} <= starting  # the pattern still finds them
