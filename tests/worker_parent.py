"""A data set for tests/test_workers.py in a module of its own: a worker that is not a fork of the
test imports it by name, and this module imports torch alone (the test module imports much more)."""

import os

from torch.utils.data import Dataset


class WorkerParent(Dataset):
    """Sample i: (i, the loading process's pid, its parent's pid)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return index, os.getpid(), os.getppid()
