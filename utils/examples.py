"""Small data sets the chapters load through DataLoader workers; they live in a module
because workers started with spawn must import them.

A worker started with ``spawn`` (the default on macOS and Windows) or ``forkserver``
(Linux from Python 3.14) is a fresh interpreter: it receives the data set pickled *by
reference to its class* and imports the class's module to rebuild it. A class defined in
a notebook lives in ``__main__``, which the worker does not have, so the chapters define
these here and show their source with ``utils.show_source``.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import sys
import tempfile
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .data import global_worker
from .seeding import sample_generator

__all__ = [
    "CustomDataset",
    "WhoLoaded",
    "SCALE",
    "WhatWorkersSee",
    "report_worker_start",
    "worker_stderr",
    "WorkerSeeds",
    "CropOffsets",
    "CropOffsetsFixed",
    "TorchCrop",
    "article_worker_init_fn",
    "AugmentedSamples",
    "SeedRecorder",
    "PyRandomCrop",
    "Numbers",
    "ShardByWorker",
    "ShardByRank",
]


# --- chapter 3: set_epoch -------------------------------------------------------------

class CustomDataset(Dataset):
    def __init__(self, length):
        self.len = length
        self.data = torch.arange(1, 17)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


# --- chapter 6: workers, start methods, processes per job, what spawn copies ----------

class WhoLoaded(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, index):
        info = get_worker_info()
        return index, -1 if info is None else info.id


SCALE = 1  # a module-level setting; chapter 6 changes it at run time


class WhatWorkersSee(Dataset):
    def __init__(self):
        self.scale = SCALE   # an attribute: pickled with the data set
        self.at_start = {}   # filled in by report_worker_start, in the worker's copy

    def __len__(self):
        return 1

    def __getitem__(self, index):
        return {"module SCALE": SCALE, "dataset.scale": self.scale, **self.at_start}


def report_worker_start(worker_id):
    info = get_worker_info()
    info.dataset.at_start = {
        "worker_id": worker_id,
        "torch seed = info.seed": torch.initial_seed() == info.seed,
        "process group": dist.is_available() and dist.is_initialized(),
    }


@contextlib.contextmanager
def worker_stderr() -> Iterator[io.StringIO]:
    """Collect what processes started in the block write to their stderr (descriptor 2).

    A worker that dies while it starts prints its traceback there, outside Python's
    ``sys.stderr``; chapter 6 shows its last line instead of a page of paths.
    """
    collected = io.StringIO()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield collected
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            collected.write(sink.read().decode("utf-8", "replace"))


class WorkerPid(Dataset):
    """Sample i is (i, the id of the process that loaded it)."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return index, os.getpid()


class CopiedOrShared(Dataset):
    """Counts its pickles; each worker writes into its NumPy array and its tensor."""

    pickled = 0   # a class attribute, counted in the process that pickles

    def __init__(self, megabytes=8):
        self.array = np.zeros(megabytes * 2**20 // 8, dtype=np.int64)
        self.tensor = torch.zeros(4, dtype=torch.int64)

    def __getstate__(self):
        type(self).pickled += 1
        return self.__dict__

    def __len__(self):
        return 2

    def __getitem__(self, index):
        worker = get_worker_info().id
        self.array[worker + 1] = self.tensor[worker + 1] = 7   # into this worker's copy
        return self.array[:4].tolist()                        # what its copy holds


# --- chapter 7: seeding and reproducibility -------------------------------------------

class WorkerSeeds(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        info = get_worker_info()
        return info.id, torch.initial_seed(), info.seed, int(np.random.randint(2**31))


class CropOffsets(Dataset):
    """Sample i is (i, a random crop offset); the mistake: an RNG made in __init__."""

    def __init__(self, n=64):
        self.n = n
        self.rng = np.random.default_rng(0)

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index, int(self.rng.integers(0, 1_000_000))


class CropOffsetsFixed(CropOffsets):
    def reseed(self, seed):
        self.rng = np.random.default_rng(seed)


class TorchCrop(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return index, int(torch.randint(0, 1_000_000, ()))


def article_worker_init_fn(worker_id):
    torch.manual_seed(42 + worker_id)   # the article's code


class AugmentedSamples(Dataset):
    def __init__(self, augment):
        self.augment, self.epoch = augment, 0

    def __len__(self):
        return 32

    def __getitem__(self, index):
        if self.augment == "worker_rng":     # draw from the worker's torch generator
            return index, int(torch.randint(0, 1_000_000, ()))
        # draw from a generator keyed by (seed, epoch, index)
        g = sample_generator(0, self.epoch, index)
        return index, int(torch.randint(0, 1_000_000, (), generator=g))


class SeedRecorder(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.initial_seed()


class PyRandomCrop(Dataset):
    def __init__(self):
        self.rng = random.Random(0)

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return index, self.rng.randrange(1_000_000)


def tutorial_seed_worker(worker_id):
    worker_seed = torch.initial_seed() % 2**32   # PyTorch's randomness notes; [S1]
    np.random.seed(worker_seed)
    random.seed(worker_seed)


class EpochKeyed(AugmentedSamples):
    """AugmentedSamples whose indices arrive as (epoch, index) pairs."""

    def __init__(self):
        super().__init__("keyed")

    def __getitem__(self, key):
        epoch, index = key   # the epoch travels with the index, to whichever worker
        g = sample_generator(0, epoch, index)
        return index, int(torch.randint(0, 1_000_000, (), generator=g))


# --- chapter 8: IterableDataset -------------------------------------------------------

class Numbers(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class ShardByWorker(Numbers):
    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(worker, self.n, workers))


class ShardByRank(Numbers):
    def __init__(self, n):
        super().__init__(n)
        # Read here, in the rank's own process: a spawned worker has no process group.
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def __iter__(self):
        return iter(range(self.rank, self.n, self.world_size))


# --- chapter 8: configuring each worker's copy in worker_init_fn ----------------------

class RangeStream(IterableDataset):
    """Yields start, ..., end - 1; a worker_init_fn may narrow its copy's range."""

    def __init__(self, start, end):
        self.start, self.end = start, end
        # Read here, in the rank's own process: a spawned worker has no process group.
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_range_per_worker(worker_id):
    """worker_init_fn: narrow this worker's copy of a RangeStream to its share."""
    info = get_worker_info()
    stream = info.dataset                         # this worker's own copy
    g, total = global_worker(stream.rank, stream.world_size, worker_id,
                             info.num_workers)
    start, size = stream.start, stream.end - stream.start
    stream.start = start + size * g // total
    stream.end = start + size * (g + 1) // total


# --- chapter 14: loader throughput ----------------------------------------------------

class IndexPid(Dataset):
    """Sample i is (i, the id of the process that loaded it), for ``n`` samples."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index, os.getpid()


class FileNames(Dataset):
    """``n`` file names, kept as a Python list of str (``storage="list"``) or as one
    NumPy array of fixed-width bytes (``storage="array"``); sample i is the length of
    name i and the id of the process that loaded it."""

    def __init__(self, n, storage="list"):
        if storage not in ("list", "array"):
            raise ValueError(f"storage must be 'list' or 'array', got {storage!r}")
        names = [f"train/class_{i % 1000:03d}/image_{i:08d}.jpg" for i in range(n)]
        self.names = names if storage == "list" else np.array(names, dtype=np.bytes_)

    def __len__(self):
        return len(self.names)

    def __getitem__(self, index):
        return len(self.names[index]), os.getpid()
