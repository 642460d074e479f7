"""The portability pass (forkserver with torch preloaded, `make test`'s second lane) fails a notebook
that relies on state a DataLoader worker inherits, as `spawn` fails it, though each worker there is
a fork: a data set class defined in the notebook, and a module global changed after import.

The notebook is executed under fork first, which stores the outputs a Linux user would see; nbval
then re-executes it under fork (it passes) and under the pass's settings (both cells fail)."""

import os
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_METHOD = os.path.join(ROOT, "tests", "start_method")

CELLS = [
    # a class of the notebook's __main__: a worker that did not fork from the kernel lacks it
    """from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return index * index

print(list(DataLoader(Squares(), batch_size=4, num_workers=1))[0].tolist())""",
    # a module global set after import: a worker that imports the module sees its source's value
    """import utils.examples as examples
from utils.examples import WhatWorkersSee, report_worker_start

examples.SCALE = 10
loader = DataLoader(WhatWorkersSee(), batch_size=None, num_workers=1,
                    worker_init_fn=report_worker_start)
print("module SCALE in the worker:", list(loader)[0]["module SCALE"])""",
]


def nbval(path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-q",
                           "-p", "no:cacheprovider", "-p", "no:xdist", str(path)],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(sys.platform != "linux", reason="the stored outputs are fork's")
def test_a_cell_that_relies_on_what_a_worker_inherits_fails_the_portability_pass(tmp_path):
    path = tmp_path / "inherits.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    fork = {"PYTHONPATH": START_METHOD, "BOOK_START_METHOD": "fork"}
    done = subprocess.run([sys.executable, "-m", "jupyter", "execute", "--inplace", str(path)],
                          cwd=ROOT,
                          env={**os.environ, **fork}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stored = [o.get("text", "") for c in nbformat.read(path, as_version=4).cells
              for o in c.outputs]
    assert stored == ["[0, 1, 4, 9]\n", "module SCALE in the worker: 10\n"]

    same = nbval(path, **fork)
    assert same.returncode == 0 and "2 passed" in same.stdout, same.stdout[-3000:]

    portable = nbval(path, PYTHONPATH=START_METHOD, BOOK_START_METHOD="forkserver")
    report = portable.stdout
    assert "2 failed" in report, report[-3000:]
    # the worker cannot rebuild the notebook's class; the module's global is its source's
    assert "Can't get attribute 'Squares'" in report or "exited unexpectedly" in report, report
    assert "module SCALE in the worker: 1" in report, report[-3000:]
