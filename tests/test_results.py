"""Every file in book/results/ says what code it measured (utils.results): a CPU results file whose
sources changed since it was written fails here, with the command that remakes it. A file measured on a
GPU cannot be remade on a CPU machine: chapter 12, which shows it, prints which of its sources changed."""

import glob
import json
import os

import pytest

from utils import results

FILES = sorted(glob.glob(os.path.join(results.RESULTS, "*.json")))


def test_there_are_results_files():
    assert len(FILES) >= 8


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_each_results_file_was_measured_on_the_code_as_it_is_now(path):
    with open(path) as f:
        record = json.load(f)
    assert record.get("sources"), f"{path} does not say which code it measured"
    meta = record.get("meta", record)  # the loader benchmark keeps them in its "meta"
    assert meta.get("command") and meta.get("date")
    if record.get("gpu"):
        return  # shown with its changed sources by chapter 12 (see below)
    changed = results.stale(path)
    assert not changed, (f"{os.path.basename(path)} was measured on an earlier version of "
                         f"{', '.join(changed)}: run `{meta['command']}` again")


def test_chapter_12_shows_which_sources_of_a_gpu_file_changed_since():
    with open(os.path.join(results.ROOT, "notebooks", "12_exact_resume.ipynb")) as f:
        cells = ["".join(c["source"]) for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    assert any("gpu_check_*.json" in c and "results.stale(" in c for c in cells)


def test_a_changed_source_makes_a_file_stale_and_an_unrelated_change_does_not(tmp_path):
    code = tmp_path / "utils" / "bench.py"
    code.parent.mkdir()
    code.write_text("X = 1\n\n\ndef measured():\n    return X\n\n\ndef other():\n    pass\n")
    out = str(tmp_path / "r.json")
    results.write(out, {"command": "c"}, ["utils/bench.py::measured", "utils/bench.py::X"],
                  root=str(tmp_path))
    assert results.stale(out, root=str(tmp_path)) == []
    code.write_text(code.read_text().replace("pass", "return 2"))  # another function
    assert results.stale(out, root=str(tmp_path)) == []
    # a docstring, a comment, a line wrapped: the same code
    code.write_text(code.read_text().replace("def measured():\n    return X",
                                             'def measured():\n    """Why."""  # note\n    return (\n        X)'))
    assert results.stale(out, root=str(tmp_path)) == []
    code.write_text(code.read_text().replace("        X)", "        X + 1)"))
    assert results.stale(out, root=str(tmp_path)) == ["utils/bench.py::measured"]
    code.unlink()
    assert results.stale(out, root=str(tmp_path)) == ["utils/bench.py::X", "utils/bench.py::measured"]
    with pytest.raises(ValueError, match="not found: \\['utils/nothing.py'\\]"):
        results.write(out, {}, ["utils/nothing.py"], root=str(tmp_path))


def test_a_file_that_records_no_sources_is_stale(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"command": "c"}))
    assert results.stale(str(path)) == ["(no sources recorded)"]


def test_the_hash_is_the_same_on_every_python():
    """A GPU machine's Python (3.12 there) and the tests' (3.11 here) must hash the same code
    alike: ast.dump differs between them (3.12 adds type_params=[], 3.13 drops empty fields).
    This text is what 3.10, 3.11, 3.12 and 3.13 all printed."""
    import ast
    tree = ast.parse('def f(x, k=None):\n    """Doc."""\n    return x\n\n\nclass C:\n    pass\n')
    assert results._code_only(tree) == (
        "Module(body=[FunctionDef(name='f', args=arguments(args=[arg(arg='x'), arg(arg='k')], "
        "defaults=[Constant()]), body=[Return(value=Name(id='x', ctx=Load()))]), "
        "ClassDef(name='C', body=[Pass()])])")
