"""Library code is shown in the book (``utils.show_source``): no line of utils/**/*.py
may be longer than 88 characters, so that no listing scrolls sideways or is cut off
in print."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 88
UTILS = sorted((ROOT / "utils").rglob("*.py"))  # the package utils.train_cifar10 too


def long_lines(path: pathlib.Path, limit: int = LIMIT) -> list[str]:
    """``file:line: N characters`` for every line of ``path`` longer than ``limit``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{name}:{number}: {len(line)} characters"
            for number, line in enumerate(lines, start=1) if len(line) > limit]


def test_there_are_utils_modules():
    assert len(UTILS) >= 10


@pytest.mark.parametrize("path", UTILS, ids=lambda p: str(p.relative_to(ROOT / "utils")))
def test_no_line_longer_than_88(path):
    found = long_lines(path)
    assert not found, (f"{len(found)} line(s) longer than {LIMIT} characters:\n"
                       + "\n".join(found))


def test_the_check_names_file_line_and_length(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("x = 1\n" + "#" * LIMIT + "\n" + "y = '" + "a" * 90 + "'\n"
                      + "é" * LIMIT + "\n", encoding="utf-8")
    assert long_lines(sample) == [f"{sample}:3: 96 characters"]
