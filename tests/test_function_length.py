"""Library code is read in the book and shown with ``utils.show_source``: no function or
method in utils/**/*.py may span more than 80 lines (from its ``def`` line to its last
line, docstring included, decorators not), so that each one reads as one step and a
long one is split into named steps instead."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 80
UTILS = sorted((ROOT / "utils").rglob("*.py"))  # the package utils.train_cifar10 too


def function_lengths(path: pathlib.Path) -> dict[str, int]:
    """``{qualified name: lines}`` for every function and method in ``path``, nested
    ones too (``Class.method``, ``outer.inner``)."""
    lengths = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # lineno is the ``def`` line: decorators are not counted
                lengths[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return lengths


def long_functions(path: pathlib.Path, limit: int = LIMIT) -> list[str]:
    """``module:function:N lines`` for every function of ``path`` longer than
    ``limit``."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{name}:{function}:{lines} lines"
            for function, lines in function_lengths(path).items() if lines > limit]


# (tests/test_line_length.py checks that this glob finds the modules)
@pytest.mark.parametrize("path", UTILS, ids=lambda p: str(p.relative_to(ROOT / "utils")))
def test_no_function_longer_than_80_lines(path):
    found = long_functions(path)
    assert not found, (f"{len(found)} function(s) longer than {LIMIT} lines; split "
                       f"them into named steps:\n" + "\n".join(found))


def test_the_check_names_module_function_and_length(tmp_path):
    sample = tmp_path / "sample.py"
    body = [f"x{i} = {i}" for i in range(LIMIT - 2)]

    def block(indent, lines):
        return "".join(" " * indent + line + "\n" for line in lines)

    sample.write_text(
        "import functools\n\n\n@functools.lru_cache\n"  # a decorator: not counted
        + block(0, ["def fits():", '    """Doc."""']) + block(4, body)  # LIMIT lines
        + block(0, ["def too_long():", '    """Doc."""']) + block(4, body + ["y = 1"])
        + block(0, ["class Box:", "    def method(self):"])
        + block(8, body + ["def inner():", "    return 1", "return inner"]),
        encoding="utf-8")
    lengths = function_lengths(sample)
    assert lengths["fits"] == LIMIT and lengths["Box.method.inner"] == 2
    assert long_functions(sample) == [f"{sample}:too_long:{LIMIT + 1} lines",
                                      f"{sample}:Box.method:{LIMIT + 2} lines"]
