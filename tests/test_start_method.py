"""The start-method passes of `make test` really run under the start method they name."""

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

METHOD = os.environ.get("BOOK_START_METHOD")


@pytest.mark.skipif(not METHOD, reason="only in the start-method pass (BOOK_START_METHOD set)")
def test_this_process_and_its_children_use_the_forced_start_method():
    assert mp.get_start_method() == METHOD
    child = subprocess.run([sys.executable, "-c", "import multiprocessing as m; print(m.get_start_method())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == METHOD


@pytest.mark.skipif(METHOD != "forkserver", reason="only in the forkserver pass")
def test_the_portability_pass_preloads_what_utils_workers_preloads():
    """sitecustomize.py writes the list out (importing utils there would slow every interpreter)."""
    from multiprocessing import forkserver

    from utils.workers import PRELOAD

    assert forkserver._forkserver._preload_modules == list(PRELOAD)
