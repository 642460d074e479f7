"""utils.source_archive: the zip that the built book offers as its source ("How to run this
book", "Get the source") holds the repository's files under ddl-book/, runnable once unzipped,
and nothing that git ignores."""

import os
import stat
import subprocess
import sys
import zipfile

from utils import source_archive

ROOT = source_archive.ROOT


def test_the_zip_holds_the_repository_under_one_folder_and_runs_unzipped(tmp_path):
    path = tmp_path / "ddl-book-source.zip"
    count = source_archive.write(str(path))
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        ci_run = archive.getinfo("ddl-book/.ci/run")
        archive.extractall(tmp_path / "unzipped")
    assert count == len(names) and all(n.startswith("ddl-book/") for n in names)
    for needed in ("README.md", "Makefile", "constraints.txt", "book/how_to_run.md",
                   "utils/train_cifar10/__main__.py", "examples/train_ddp.py",
                   "notebooks/00_the_picture.ipynb"):
        assert f"ddl-book/{needed}" in names, needed
    ignored = [n for n in names if n.split("/")[1] in (".venv", "_build", ".git", "data", "runs")]
    assert not ignored, ignored[:5]
    assert (ci_run.external_attr >> 16) & stat.S_IXUSR  # scripts stay executable
    # the unzipped copy is a working source: its training script answers --help
    done = subprocess.run([sys.executable, "-m", "utils.train_cifar10", "--help"],
                          cwd=tmp_path / "unzipped" / "ddl-book", capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "unzipped" / "ddl-book")})
    assert done.returncode == 0 and "usage: python -m utils.train_cifar10" in done.stdout, done.stderr


def test_outside_a_git_checkout_the_folders_gitignore_names_are_left_out(tmp_path):
    (tmp_path / ".gitignore").write_text(".venv/\n_build/\n*.pyc\n")
    for name in ("README.md", "utils/a.py", ".venv/bin/python", "_build/html/index.html", ".git/HEAD"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert source_archive.source_files(str(tmp_path)) == [".gitignore", "README.md", "utils/a.py"]
