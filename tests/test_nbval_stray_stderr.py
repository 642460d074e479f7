"""The repository's conftest.py: a stray stderr line is reported, not failed; the rest stays strict.

Each test writes a one-cell notebook whose stored output is `print("stored")`'s, changes
what the cell does, and runs nbval on it in a fresh pytest process with the repository's
conftest.py (and without it, to show the strict default the conftest relaxes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _notebook(path: Path, source: str, outputs: list) -> None:
    cell = nbformat.v4.new_code_cell(source, execution_count=1, outputs=outputs)
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)


def _nbval(tmp_path: Path, source: str, *, conftest: bool = True,
           stored_stderr: str | None = None) -> subprocess.CompletedProcess:
    outputs = [nbformat.v4.new_output("stream", name="stdout", text="stored\n")]
    if stored_stderr is not None:
        outputs.append(nbformat.v4.new_output("stream", name="stderr", text=stored_stderr))
    _notebook(tmp_path / "chapter.ipynb", source, outputs)
    if conftest:
        (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-p",
         "no:cacheprovider", "-W", "default", "chapter.ipynb"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)


# a thread of the kernel writes to stderr while the cell runs (as a multiprocessing queue's
# feeder thread prints its BrokenPipeError when a DataLoader worker was terminated)
STRAY = ('import sys, threading\nprint("stored")\n'
         't = threading.Thread(target=print, args=("a line from a thread",), '
         'kwargs={"file": sys.stderr})\nt.start()\nt.join()')


def test_stray_stderr_fails_strict_nbval_without_the_conftest(tmp_path):
    run = _nbval(tmp_path, STRAY, conftest=False)
    assert run.returncode == 1, run.stdout
    assert "a line from a thread" in run.stdout


def test_stray_stderr_is_reported_as_a_warning_not_a_failure(tmp_path):
    run = _nbval(tmp_path, STRAY)
    assert run.returncode == 0, run.stdout
    assert "StrayStderrWarning" in run.stdout
    assert "chapter.ipynb Cell 0" in run.stdout and "a line from a thread" in run.stdout


@pytest.mark.parametrize("source", [
    'print("changed")',                                         # stdout differs
    STRAY.replace('print("stored")', 'print("changed")'),      # ... with stray stderr
    'raise ValueError("boom")',                                 # the cell fails
])
def test_everything_else_is_still_compared(tmp_path, source):
    run = _nbval(tmp_path, source)
    assert run.returncode == 1, run.stdout


def test_stderr_the_stored_outputs_have_is_compared(tmp_path):
    source = 'import sys\nprint("stored")\nprint("other", file=sys.stderr)'
    run = _nbval(tmp_path, source, stored_stderr="expected\n")
    assert run.returncode == 1, run.stdout
    same = _nbval(tmp_path, source, stored_stderr="other\n")
    assert same.returncode == 0, same.stdout
