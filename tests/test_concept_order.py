"""No chapter's code uses an idea before the chapter that teaches it.

Reading order is _toc.yml's. For each idea below, the table names the chapter that teaches
it; the test fails if a code cell of an earlier chapter uses it, or if the teaching chapter
uses it in code before its prose has named it. Chapter 0 teaches the distributed primitives
(process groups, collectives, DDP, how ranks start), so every later chapter may use them.
"""

import pathlib
import re

import nbformat
import pytest

from utils.notebook_times import toc_notebooks

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = [p for p in toc_notebooks() if p.parent.name == "notebooks"]

# idea: (pattern in code, what the prose calls it, the chapter that teaches it)
IDEAS = {
    "process groups": (r"init_process_group", "init_process_group", "00_the_picture"),
    "all-reduce": (r"all_reduce", "all_reduce", "00_the_picture"),
    "DDP": (r"\bDDP\(|DistributedDataParallel\(", "DistributedDataParallel",
            "00_the_picture"),
    "torchrun": (r"torchrun|torch\.distributed\.run\b", "torchrun", "00_the_picture"),
    "run_distributed": (r"\brun_distributed\b", "run_distributed", "00_the_picture"),
    "DistributedSampler": (r"\bDistributedSampler\b", "DistributedSampler",
                           "00_the_picture"),
    "set_epoch": (r"\bset_epoch\(", "set_epoch", "00_the_picture"),
    "worker_init_fn": (r"\bworker_init_fn\b", "worker_init_fn", "06_workers"),
    "no_sync": (r"\bno_sync\b", "no_sync", "10_ddp_from_scratch"),
    "SyncBatchNorm": (r"\bSyncBatchNorm\b", "SyncBatchNorm", "10_ddp_from_scratch"),
    "Join": (r"\bJoin\b", "Join", "10_ddp_from_scratch"),
}


def _cells(path):
    """The notebook's cells, import statements blanked (importing a name is not using
    it); a code cell that runs or shows a script of examples/ counts the script as its
    code."""
    cells = nbformat.read(path, as_version=4).cells
    for cell in cells:
        if cell.cell_type == "code":
            scripts = sorted(set(EXAMPLE.findall(cell.source)))
            cell.source = IMPORT.sub("", cell.source) + "".join(
                "\n" + (ROOT / "examples" / name).read_text() for name in scripts)
    return cells


EXAMPLE = re.compile(r"examples/(\w+\.py)")


IMPORT = re.compile(r"^[ \t]*(?:from\s+\S+\s+)?import\s+(?:\([^)]*\)|.*)$", re.M)


def test_the_table_names_chapters_of_the_book():
    stems = [p.stem for p in CHAPTERS]
    assert stems[0] == "00_the_picture", stems
    assert {ch for _, _, ch in IDEAS.values()} <= set(stems)


@pytest.mark.parametrize("idea", IDEAS)
def test_no_chapter_uses_an_idea_before_it_is_taught(idea):
    pattern, named, teacher = IDEAS[idea]
    stems = [p.stem for p in CHAPTERS]
    early = []
    for path in CHAPTERS[:stems.index(teacher)]:
        for i, cell in enumerate(_cells(path)):
            if cell.cell_type == "code" and re.search(pattern, cell.source):
                early.append(f"{path.name} cell {i}")
    assert not early, (f"{idea} is taught in {teacher}, but used in code before it: "
                       f"{early}")
    # in the chapter that teaches it, the prose names it before the code uses it
    cells = _cells(ROOT / "notebooks" / f"{teacher}.ipynb")
    first_code = next((i for i, c in enumerate(cells) if c.cell_type == "code"
                       and re.search(pattern, c.source)), None)
    assert first_code is not None, f"{teacher} never uses {idea} in code"
    assert any(c.cell_type == "markdown" and named in c.source
               for c in cells[:first_code]), (
        f"{teacher} cell {first_code} uses {idea} before its prose names {named!r}")
