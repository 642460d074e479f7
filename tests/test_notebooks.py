"""The book's rules for chapters, checked on every notebook.

Their outputs are checked by nbval; these tests check what the book shows of them.
"""

import pathlib
import re

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the chapters and the appendix notebooks
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb")
                   if not p.name.startswith("_"))


def test_there_are_chapters():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_rules(path):
    nb = nbformat.read(path, as_version=4)
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    code = [c for c in nb.cells if c.cell_type == "code"]
    title = markdown[0]
    assert title.startswith("# ") and not title.startswith("# #"), (
        "the first cell is the title")
    assert not any(re.match(r"#\s+#", m) for m in markdown), (
        "a heading with a stray '# '")
    assert "you will learn" in title, "learning goals at the top"
    assert any("## Summary" in m for m in markdown)
    assert any("## Exercises" in m for m in markdown)
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), (
        "at least one picture")
    assert sum(bool(c.outputs) for c in code) >= len(code) / 2, "committed with outputs"
    assert not any(o.output_type == "error" for c in code for o in c.outputs), (
        "no stored errors")
    assert not any(o.output_type == "stream" and o.name == "stderr"
                   for c in code for o in c.outputs), (
        "no stored stderr (conftest.py: nbval reports stderr as a warning where a cell "
        "stores none; print what the chapter shows to stdout)")
    exempt = [c for c in code
              if "NBVAL_IGNORE_OUTPUT" in c.source or "NBVAL_SKIP" in c.source]
    assert len(exempt) <= 0.15 * len(code), (
        "at most 15% of code cells exempt from comparison")
    assert all("assert" in c.source for c in exempt), "an exempt cell asserts its claim"
    assert f"notebooks/{path.stem}" in (ROOT / "_toc.yml").read_text(), (
        "listed in _toc.yml")


# Code that starts processes whose start method follows the platform's (DataLoader
# workers, torchrun's workers, multiprocessing): such a chapter must be in one of the
# Makefile's passes that force a start method (PORTABLE_NOTEBOOKS: forkserver with torch
# preloaded; SPAWN_NOTEBOOKS: spawn), or in OWN_START_NOTEBOOKS, whose workers start only
# through scripts that choose their start method themselves.
STARTS_PROCESSES = re.compile(
    r"num_workers=(?!0\b)|--workers|multiprocessing|torch\.distributed\.run")
PASSES = ("PORTABLE_NOTEBOOKS", "SPAWN_NOTEBOOKS", "OWN_START_NOTEBOOKS")


def makefile_list(makefile: str, name: str) -> list[str]:
    found = re.search(rf"^{name}\s*:=(.*)$", makefile, re.M)
    assert found, f"{name} is not set in the Makefile"
    return found.group(1).split()


def test_every_chapter_that_starts_worker_processes_is_in_a_start_method_pass():
    makefile = (ROOT / "Makefile").read_text()
    makefile = makefile.replace("\\\n", " ")  # join continued lines
    lists = {name: makefile_list(makefile, name) for name in PASSES}
    listed = [n for names in lists.values() for n in names]
    assert len(listed) == len(set(listed)), f"a chapter in two of {PASSES}: {lists}"
    starting = set()
    for p in NOTEBOOKS:
        cells = nbformat.read(p, as_version=4).cells
        if STARTS_PROCESSES.search("\n".join(c.source for c in cells
                                             if c.cell_type == "code")):
            starting.add(p.stem)
    missing = sorted(n for n in listed
                     if not (ROOT / "notebooks" / f"{n}.ipynb").exists())
    assert not missing, f"the Makefile names notebooks that do not exist: {missing}"
    assert starting <= set(listed), (
        f"add {sorted(starting - set(listed))} to PORTABLE_NOTEBOOKS in the Makefile")
    # the pattern still finds them
    assert {"03_set_epoch", "06_workers", "11_cifar10_ddp", "12_exact_resume",
            "13_restarts_and_slurm"} <= starting
    # the chapter that teaches start methods runs under spawn itself
    assert lists["SPAWN_NOTEBOOKS"] == ["06_workers"]


def test_chapters_11_to_13_start_workers_only_through_scripts_that_choose_their_start_method():
    """OWN_START_NOTEBOOKS leave the portability pass because no worker of theirs follows
    the platform's start method: each script they run gives its loaders a context."""
    makefile = (ROOT / "Makefile").read_text()
    chapters = makefile_list(makefile, "OWN_START_NOTEBOOKS")
    assert chapters == ["11_cifar10_ddp", "12_exact_resume", "13_restarts_and_slurm"]
    cells = [c for n in chapters
             for c in nbformat.read(ROOT / "notebooks" / f"{n}.ipynb", as_version=4).cells]
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert "DataLoader(" not in code and "num_workers=" not in code
    for script in ("examples/train_ddp.py", "examples/train_single.py",
                   "utils/train_cifar10"):
        path = ROOT / script  # a package: all its modules
        text = "\n".join(p.read_text() for p in sorted(path.glob("*.py"))) if path.is_dir() else path.read_text()
        calls = [text[m.end():m.end() + 500].split("\n\n")[0]
                 for m in re.finditer(r"\bDataLoader\(", text)]
        # the context given directly, or in the keyword dict the script passes on
        assert calls and all(any(k in call for k in ("multiprocessing_context=",
                                                     "**loader_kwargs", "**workers"))
                             for call in calls), script
        assert "multiprocessing_context=" in text, script


# A folder made with tempfile.mkdtemp outlives the kernel (nbval stops the kernel without
# running atexit handlers), and chapter 12 writes hundreds of MB: every CI run would leave
# them. A chapter that makes one at top level removes it in its last code cell (folders
# made inside another, with dir=, go with it).
MKDTEMP = re.compile(r"^(\w+) = tempfile\.mkdtemp\((?![^)]*\bdir=)", re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_chapter_removes_the_scratch_folders_it_makes(path):
    code = [c.source for c in nbformat.read(path, as_version=4).cells
            if c.cell_type == "code"]
    made = MKDTEMP.findall("\n".join(code))
    kept = [name for name in made if f"shutil.rmtree({name})" not in code[-1]]
    assert not kept, (
        f"{path.name} makes {kept} with tempfile.mkdtemp but its last code cell does "
        f"not remove them: end it with shutil.rmtree(...) for each (or use "
        f"tempfile.TemporaryDirectory in a with block)")


# --- what the book shows: line lengths, figures, widgets ------------------------------

MAX_LINE = 88
# the column is about 690 CSS px in a 1280-px window; a retina PNG is shown at half its
# pixels, which IPython records in the output's metadata
MAX_FIGURE_PX = 720
TEXT_MIMES = ("text/plain", "text/markdown")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
IMAGE_FILE = re.compile(r"^\S+\.(png|jpe?g|gif|svg|webp)$", re.I)
FIGURE_NAME = re.compile(r"^fig-[a-z0-9]+(-[a-z0-9]+)+$")


def _code_cells(path):
    """(index, cell) of every code cell, the index counting all cells."""
    nb = nbformat.read(path, as_version=4)
    return [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def _where(path, index, cell):
    return f"{path.name} cell {index} (id {cell.get('id', '?')})"


def _output_texts(output):
    """(label, text) of each text an output shows: stream, text/plain, text/markdown."""
    if output.output_type == "stream":
        return [(f"{output.name}", output.text)]
    data = output.get("data", {})
    if WIDGET_MIME in data:
        return []  # its text/plain is a fallback, never shown where widgets work
    return [(mime, data[mime]) for mime in TEXT_MIMES if mime in data]


def long_lines(path):
    """Every code line and shown output line of a notebook over MAX_LINE characters."""
    found = []
    for i, cell in _code_cells(path):
        for n, line in enumerate(cell.source.splitlines(), 1):
            if len(line) > MAX_LINE:
                found.append(f"{_where(path, i, cell)} code line {n}: "
                             f"{len(line)} chars")
        for k, output in enumerate(cell.outputs):
            for label, text in _output_texts(output):
                for n, line in enumerate(text.splitlines(), 1):
                    if len(line) > MAX_LINE:
                        found.append(f"{_where(path, i, cell)} output {k} ({label}) "
                                     f"line {n}: {len(line)} chars: {line[:60]!r}...")
    return found


def figure_problems(path):
    """What is missing for each image output to be a numbered, described figure."""
    problems = []
    for i, cell in _code_cells(path):
        images = [o for o in cell.outputs
                  if any(m.startswith("image/") for m in o.get("data", {}))]
        if not images:
            continue
        where = _where(path, i, cell)
        meta = cell.metadata.get("mystnb", {})
        alt = str(meta.get("image", {}).get("alt", "")).strip()
        figure = meta.get("figure", {})
        if len(alt.split()) < 5 or IMAGE_FILE.match(alt):
            problems.append(f"{where}: no alt text (mystnb.image.alt, a sentence "
                            f"saying what the picture shows), got {alt!r}")
        if not str(figure.get("caption", "")).strip():
            problems.append(f"{where}: no caption (mystnb.figure.caption)")
        # the name carries the chapter's number (or 'appendix'): a renumbered
        # chapter's figures follow it
        prefix = "fig-%s-" % path.name.split("_")[0]
        name = str(figure.get("name", ""))
        if not FIGURE_NAME.match(name) or not name.startswith(prefix):
            problems.append(f"{where}: no figure name like '{prefix}four-epochs' "
                            f"(mystnb.figure.name), got {figure.get('name')!r}")
        # myst-nb wraps every rich output of the cell in the figure: one, or the name
        # would label several figures
        rich = [o for o in cell.outputs
                if o.output_type in ("display_data", "execute_result")]
        if len(rich) != 1:
            problems.append(f"{where}: {len(rich)} rich outputs in a figure cell; "
                            "expected the figure only (print the rest)")
        for image in images:
            size = image.get("metadata", {}).get("image/png", {})
            if "image/png" in image.get("data", {}) and "width" not in size:
                problems.append(f"{where}: PNG without width metadata (not retina: "
                                '%config InlineBackend.figure_formats = ["retina"])')
            elif size.get("width", 0) > MAX_FIGURE_PX:
                problems.append(f"{where}: figure {size['width']} px wide, over the "
                                f"column's {MAX_FIGURE_PX}")
    return problems


# A cell that does set-up, run and read-out at once is hard to follow: split it
MAX_CELL_LINES = 40


def long_cells(path):
    """Every code cell over MAX_CELL_LINES lines."""
    return [f"{_where(path, i, cell)}: {n} lines, over {MAX_CELL_LINES}: split it into "
            "set-up, run and read-out" for i, cell in _code_cells(path)
            if (n := len(cell.source.splitlines())) > MAX_CELL_LINES]


KEY_POINTS = "```{admonition} Key points"
DONT_COPY = "```{admonition} Don't copy"


def marking_problems(path):
    """A "Key points" box closes the summary; wrong code sits under a "Don't copy" box.

    Code reproduced to show a mistake starts with the comment "# Don't copy: <what is
    wrong>", and the markdown cell right above it opens the red "Don't copy" admonition
    (```{admonition} Don't copy ... :class: danger), so that the page tells wrong code
    from right code before the reader copies it.
    """
    cells = nbformat.read(path, as_version=4).cells
    problems = []
    boxes = [i for i, c in enumerate(cells)
             if c.cell_type == "markdown" and KEY_POINTS in c.source]
    if len(boxes) != 1:
        problems.append(f"{path.name}: {len(boxes)} Key points boxes, want one")
    else:
        text = cells[boxes[0]].source
        before = "\n".join(c.source for c in cells[:boxes[0]] if c.cell_type == "markdown")
        at = text.index(KEY_POINTS)
        if "## Summary" not in before + text[:at] or "## Exercises" in before + text[:at]:
            problems.append(f"{path.name}: the Key points box belongs after '## Summary' "
                            "and before '## Exercises'")
        elif (before + "\n" + text[:at]).rsplit("## Summary", 1)[1].strip():
            problems.append(f"{path.name}: one recap: '## Summary' holds the Key points "
                            "box alone, no prose summary before it")
        if ":class: tip" not in text[at:].split("```")[1]:
            problems.append(f"{path.name}: the Key points box wants ':class: tip'")
    for i, cell in enumerate(cells):
        above = cells[i - 1] if i else None
        marked_above = (above is not None and above.cell_type == "markdown"
                        and DONT_COPY in above.source)
        if cell.cell_type == "code" and cell.source.startswith("# Don't copy:"):
            if not marked_above:
                problems.append(f"{_where(path, i, cell)}: wrong code without a "
                                "'Don't copy' admonition in the cell above")
        elif cell.cell_type == "markdown" and DONT_COPY in cell.source:
            box = cell.source[cell.source.index(DONT_COPY):].split("```")[1]
            if ":class: danger" not in box:
                problems.append(f"{path.name} cell {i}: a Don't copy box wants "
                                "':class: danger'")
            nxt = cells[i + 1] if i + 1 < len(cells) else None
            if nxt is None or not (nxt.cell_type == "code"
                                   and nxt.source.startswith("# Don't copy:")):
                problems.append(f"{path.name} cell {i}: a Don't copy box not followed by "
                                "a code cell starting '# Don't copy:'")
    return problems


@pytest.mark.parametrize("check", [long_lines, figure_problems, long_cells,
                                   marking_problems],
                         ids=["lines_within_88", "figures_with_alt_caption_name",
                              "cells_within_40_lines", "key_points_and_dont_copy"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_what_the_book_shows(path, check):
    """Code and output lines fit the page; each picture is a described, numbered figure."""
    problems = check(path)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_figure_names_are_unique_across_the_book():
    names = [cell.metadata["mystnb"]["figure"]["name"]
             for path in NOTEBOOKS for _, cell in _code_cells(path)
             if "name" in cell.metadata.get("mystnb", {}).get("figure", {})]
    assert len(names) >= 16
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


# a text size below 9 pt, set in a chapter or in utils/viz.py
SMALL_FONT = re.compile(r"""\b(?:fontsize|labelsize|size)\s*=\s*"""
                        r"""(?:(\d+(?:\.\d+)?)\b|["'](xx?-small|small|smaller)["'])""")


def test_no_figure_text_is_set_below_9_points():
    sources = {p.name: "\n".join(c.source for _, c in _code_cells(p))
               for p in NOTEBOOKS}
    sources["utils/viz.py"] = (ROOT / "utils" / "viz.py").read_text()
    small = [(name, m.group(0)) for name, text in sources.items()
             for m in SMALL_FONT.finditer(text)
             if m.group(2) or float(m.group(1)) < 9]
    assert not small, small


def test_widgets_are_shown_in_the_book_as_a_static_figure():
    """A widget needs a kernel: the book drops its output and shows a picture."""
    import yaml

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    widget_cells = 0
    for path in NOTEBOOKS:
        cells = _code_cells(path)
        for k, (i, cell) in enumerate(cells):
            if not any(WIDGET_MIME in o.get("data", {}) for o in cell.outputs):
                continue
            widget_cells += 1
            where = _where(path, i, cell)
            assert "remove-output" in cell.metadata.get("tags", []), (
                f"{where}: a widget output, blank or dead without a kernel; tag the "
                "cell 'remove-output' and draw a static figure in the next cell")
            caption = cells[k + 1][1].metadata.get("mystnb", {}).get("figure", {}).get(
                "caption", "") if k + 1 < len(cells) else ""
            assert "Jupyter" in caption, (
                f"{where}: the next code cell should show the widget's picture, with a "
                "caption saying that it is live in Jupyter")
    assert widget_cells >= 1  # chapter 2's shard explorer
    # no CDN script for widgets in the book (their outputs are removed)
    assert config["sphinx"]["config"].get("nb_ipywidgets_js") == {}


def test_the_checks_report_what_they_should(tmp_path):
    """A notebook with each defect: every one is reported, with its cell and line."""
    png = {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure size 680x300>"}

    def size(width):
        return {"image/png": {"width": width, "height": 300}}

    good_meta = {"mystnb": {
        "image": {"alt": "Two rows of cells: the same order twice."},
        "figure": {"caption": "An order.", "name": "fig-00-order"}}}
    cells = [
        nbformat.v4.new_code_cell("x = 1\n" + "y" * 89),  # a long code line
        nbformat.v4.new_code_cell("print(x)", outputs=[nbformat.v4.new_output(
            "stream", name="stdout", text="ok\n" + "z" * 89 + "\n")]),
        nbformat.v4.new_code_cell("plt.show()", metadata=good_meta, outputs=[
            nbformat.v4.new_output("display_data", data=png, metadata=size(680))]),
        nbformat.v4.new_code_cell("plt.show()", outputs=[  # no alt, caption, retina
            nbformat.v4.new_output("display_data", data=png)]),
        nbformat.v4.new_code_cell("plt.show()", metadata={"mystnb": {
            "image": {"alt": "c023cdd93182d9077f5c.png"},
            "figure": {"caption": "Wide.", "name": "fig-00-wide"}}}, outputs=[
            nbformat.v4.new_output("display_data", data=png, metadata=size(900))]),
    ]
    path = tmp_path / "00_defects.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    assert long_lines(path) == [
        "00_defects.ipynb cell 0 (id %s) code line 2: 89 chars" % cells[0].id,
        "00_defects.ipynb cell 1 (id %s) output 0 (stdout) line 2: 89 chars: %r..."
        % (cells[1].id, "z" * 60)]
    problems = figure_problems(path)
    assert not any("cell 2 " in p for p in problems)  # the good figure
    assert sum("cell 3 " in p for p in problems) == 4  # alt, caption, name, retina
    assert any("cell 4 " in p and "alt" in p for p in problems)
    assert any("cell 4 " in p and "900 px wide" in p for p in problems)


# A cell that calls the book's helper to start ranks or audit shards has no counterpart in a
# reader's own script: each chapter with one says where the plain-torch version is.
HELPERS = re.compile(r"\b(run_distributed|audit_shards)\(")
TAKE_AWAY = re.compile(r"`examples/part[12]_\w+\.py` \(\[chapter [58]\]\("
                       r"0[58]_\w+\.ipynb#part-i{1,2}-in-one-script\)\)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_chapter_that_uses_the_books_helpers_links_their_plain_torch_version(path):
    cells = nbformat.read(path, as_version=4).cells
    if not any(HELPERS.search(c.source) for c in cells if c.cell_type == "code"):
        return
    markdown = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    # the two part chapters show their script whole, under a heading the links reach
    home = re.search(r"^## Part I{1,2} in one script$", markdown, re.M)
    assert home or TAKE_AWAY.search(markdown), (
        "say where the plain-torch version is: `examples/part1_sharding.py` "
        "([chapter 5](05_custom_samplers.ipynb#part-i-in-one-script))")
