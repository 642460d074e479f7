"""The book's source as one zip file, for the built book to offer as a download, so that
a reader of the rendered pages can get the code without knowing where it is hosted.

    python -m utils.source_archive _build/source/ddl-book-source.zip

The files are the repository's (``git ls-files``: tracked, and new files git does not
ignore), under one folder, ``ddl-book/``; outside a git checkout, every file of the
folder except what ``.gitignore``'s top-level folders name (``.venv/``, ``_build/``,
``data/`` ...). The zip is written to a temporary file and renamed into place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "ddl-book"


def source_files(root: str = ROOT) -> list[str]:
    """The repository's files, relative to ``root``, sorted."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root, capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        return _walk(root)
    # a file deleted but not yet committed is still listed: keep what exists
    return sorted(f for f in listed if f and os.path.isfile(os.path.join(root, f)))


def _walk(root: str) -> list[str]:
    """Every file under ``root`` except the folders that ``.gitignore`` names (lines
    ending in ``/``) and ``.git``."""
    skipped = {".git"}
    try:
        with open(os.path.join(root, ".gitignore")) as f:
            skipped |= {line.strip().strip("/") for line in f
                        if line.strip().endswith("/")}
    except OSError:
        pass
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skipped]
        found += [os.path.relpath(os.path.join(folder, f), root) for f in files]
    return sorted(found)


def write(path: str, root: str = ROOT) -> int:
    """The zip at ``path``; returns the number of files in it."""
    files = source_files(root)
    if not files:
        raise SystemExit(f"error: no files found under {root}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as archive:
            for name in files:
                archive.write(os.path.join(root, name), f"{PREFIX}/{name}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return len(files)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m utils.source_archive OUT.zip")
    count = write(sys.argv[1])
    print(f"{sys.argv[1]}: {count} files, {os.path.getsize(sys.argv[1]) / 1e6:.1f} MB")
