"""Data sets used by the chapters.

``Simple`` is the toy data set of the seed notebook on ``DistributedSampler``: sample
``i`` is the vector ``[i + 1] * n`` with a 0/1 label, so that printing a batch shows
which indices it holds.
"""

from __future__ import annotations

import itertools
import operator
from typing import Callable, Iterable, Iterator, Union

import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from ._checks import check_int, check_rank

__all__ = ["Simple", "ShardedIterable", "global_worker", "write_synthetic_cifar10",
           "is_synthetic_cifar10", "load_cifar10", "download_cifar10"]


class Simple(Dataset):
    """Toy map-style data set: sample ``i`` is ``np.full(n, i + 1)``, its label is 0
    or 1.

    The labels are drawn once, from ``numpy.random.default_rng(seed)`` with
    P(label=1) = 0.3, so every process that builds ``Simple(m, n, seed)`` sees the same
    labels. (The seed notebook draws them from NumPy's unseeded global RNG, so its two
    ranks disagree on the label of the same sample.)
    """

    def __init__(self, m: int = 100, n: int = 3, seed: int = 0):
        self.m = check_int("m", m, minimum=0)
        self.n = check_int("n", n, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self._x = np.repeat(np.arange(1, self.m + 1, dtype=np.int64)[:, None], self.n,
                            axis=1)
        self._y = np.random.default_rng(self.seed).choice([0, 1], size=self.m,
                                                          p=[0.7, 0.3])

    @property
    def labels(self) -> np.ndarray:
        """All labels, without loading any sample (samplers that need labels
        read this)."""
        return self._y

    def __len__(self) -> int:
        return self.m

    def __getitem__(self, idx: int):
        if isinstance(idx, bool):
            raise TypeError(f"index must be an integer, got {idx!r}")
        try:
            idx = operator.index(idx)  # ints, NumPy integers and 0-d integer tensors
        except TypeError:
            raise TypeError(f"index must be an integer, got {idx!r}") from None
        if not -self.m <= idx < self.m:
            raise IndexError(f"index {idx} is out of range for Simple(m={self.m})")
        return self._x[idx], self._y[idx]

    def __repr__(self) -> str:
        return f"Simple(m={self.m}, n={self.n}, seed={self.seed})"


def global_worker(rank: int, world_size: int, worker_id: int,
                  num_workers: int) -> tuple[int, int]:
    """``(global_id, total)``: this worker's number among all workers of all ranks, and
    their count.

    With ``num_workers=0`` the rank's main process loads the data and counts as
    one worker.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    rank = check_rank(rank, world_size)
    num_workers = max(check_int("num_workers", num_workers, minimum=0), 1)
    worker_id = check_int("worker_id", worker_id, minimum=0)
    if worker_id >= num_workers:
        raise ValueError(f"worker_id={worker_id} is out of range for "
                         f"num_workers={num_workers}")
    return rank * num_workers + worker_id, world_size * num_workers


class ShardedIterable(IterableDataset):
    """Wrap a re-iterable stream so each element is yielded exactly once across all
    ranks and workers.

    Worker ``w`` of rank ``r`` (of ``R`` ranks with ``W`` workers each) keeps the
    elements at positions ``g, g + R*W, g + 2*R*W, ...`` with ``g = r*W + w``. ``rank``
    and ``world_size`` default to the process group's (read when the data set is pickled
    for a spawned worker, which has no process group), or to a single process when there
    is none. Every worker reads (and skips) the whole stream, which is the price of
    sharding a stream without an index.
    """

    def __init__(
        self,
        source: Union[Iterable, Callable[[], Iterator]],
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not hasattr(source, "__iter__") and not callable(source):
            raise TypeError(
                "source must be iterable or a function returning an iterator, "
                f"got {type(source).__name__}"
            )
        if hasattr(source, "__iter__") and iter(source) is source:
            raise TypeError(
                "source is a one-shot iterator; every worker must read the stream from "
                "its start, so pass a re-iterable (a list, a range, a data set) or a "
                "function that returns a new iterator"
            )
        self.source = source
        if (rank is None) != (world_size is None):
            raise ValueError(
                "pass both rank and world_size, or neither (to use the process group's)"
            )
        if world_size is not None:
            world_size = check_int("world_size", world_size, minimum=1)
            rank = check_rank(rank, world_size)
        self.rank, self.world_size = rank, world_size

    def shard(
        self, rank: int, world_size: int, worker_id: int = 0, num_workers: int = 0
    ) -> Iterator:
        """The elements worker ``worker_id`` of ``num_workers`` on ``rank`` yields."""
        start, step = global_worker(rank, world_size, worker_id, num_workers)
        stream = (iter(self.source) if hasattr(self.source, "__iter__")
                  else self.source())
        return itertools.islice(stream, start, None, step)

    def __iter__(self) -> Iterator:
        if self.world_size is not None:
            rank, world_size = self.rank, self.world_size
        elif dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = 0, 1
        info = get_worker_info()
        worker_id, num_workers = ((info.id, info.num_workers) if info is not None
                                  else (0, 0))
        return self.shard(rank, world_size, worker_id, num_workers)

    def __getstate__(self) -> dict:
        # Pickled for a worker started with spawn or forkserver: that process has no
        # process group, so record this rank's place in it now, while still in the
        # rank's own process.
        state = self.__dict__.copy()
        if (state["world_size"] is None and dist.is_available()
                and dist.is_initialized()):
            state["rank"], state["world_size"] = dist.get_rank(), dist.get_world_size()
        return state


# --- CIFAR-10, real or generated in CIFAR-10's own on-disk format ---------------------

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                 "horse", "ship", "truck"]
SYNTHETIC_MARKER = "SYNTHETIC_DATA.json"


def write_synthetic_cifar10(root: str, n_train: int = 5000, n_test: int = 1000,
                            seed: int = 0) -> str:
    """Write a small, learnable, clearly synthetic data set in CIFAR-10's format
    under ``root/cifar-10-batches-py``.

    Each class is a coloured blob at a class-specific position on a noisy background,
    shifted at random: easy enough for a small CNN to learn in a few CPU epochs, hard
    enough that it is not solved by one pixel. Files: ``data_batch_1..5``,
    ``test_batch`` and ``batches.meta``, pickled as the real ones, plus
    ``SYNTHETIC_DATA.json`` (how it was made, and the files' MD5s, which
    ``load_cifar10`` checks exactly as torchvision checks the real ones).

    The files are written into a temporary folder that is then renamed into place, so a
    reader never sees half a data set, and several writers (one per node on a shared
    file system) may race: the first rename wins and the others, which wrote the same
    bytes, discard theirs. A folder that already holds other data is refused rather
    than overwritten.
    """
    import os
    import shutil
    import tempfile

    n_train = check_int("n_train", n_train, minimum=5)
    n_test = check_int("n_test", n_test, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    final = os.path.join(root, "cifar-10-batches-py")
    recipe = {"synthetic": True, "generator": "utils.data.write_synthetic_cifar10",
              "n_train": n_train, "n_test": n_test, "seed": seed}
    if os.path.isdir(final):
        return _keep_or_refuse(final, recipe)
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=".cifar-10-batches-py.", dir=root)
    _write_synthetic_batches(folder, n_train, n_test, seed)
    _write_synthetic_marker(folder, recipe)
    os.chmod(folder, 0o755)  # mkdtemp made it private
    try:
        os.rename(folder, final)  # atomic; fails if another writer got there first
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        return _keep_or_refuse(final, recipe)
    return final


def _keep_or_refuse(final: str, recipe: dict) -> str:
    """``final`` if it holds the synthetic data ``recipe`` describes; otherwise a
    ``FileExistsError``."""
    import json
    import os

    def existing_recipe():
        try:
            with open(os.path.join(final, SYNTHETIC_MARKER)) as f:
                return {k: v for k, v in json.load(f).items() if k != "md5"}
        except (OSError, ValueError):
            return None

    if existing_recipe() != recipe:
        raise FileExistsError(f"{final} already holds other data "
                              f"({existing_recipe() or 'not synthetic'}); "
                              f"remove it or write to another root")
    return final


def _synthetic_images(rng, n: int, palette) -> tuple[np.ndarray, list[int]]:
    """``n`` images in CIFAR-10's layout (rows of 3072 bytes, channel by channel) and
    their labels: each class's coloured blob at its position, shifted at random, on a
    noisy background."""
    # two columns, five rows
    centres = [(8 + 16 * (c % 2), 5 + 5.5 * (c // 2)) for c in range(10)]
    yy, xx = np.mgrid[0:32, 0:32]
    labels = rng.integers(0, 10, size=n)
    data = rng.normal(128, 40, size=(n, 32, 32, 3))
    for i, c in enumerate(labels):
        cy, cx = (centres[c][1] + rng.normal(0, 1.5),
                  centres[c][0] + rng.normal(0, 1.5))
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * 3.0**2))[..., None]
        data[i] = data[i] * (1 - blob) + palette[c] * blob
    data = np.clip(data, 0, 255).astype(np.uint8)
    return data.transpose(0, 3, 1, 2).reshape(n, 3072), labels.tolist()


def _write_synthetic_batches(folder: str, n_train: int, n_test: int,
                             seed: int) -> None:
    """``data_batch_1..5``, ``test_batch`` and ``batches.meta`` in ``folder``, pickled
    as the real ones."""
    import os
    import pickle

    rng = np.random.default_rng(seed)
    palette = rng.integers(40, 216, size=(10, 3))

    def dump(name, obj):
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(obj, f, protocol=2)

    train_data, train_labels = _synthetic_images(rng, n_train, palette)
    for b, part in enumerate(np.array_split(np.arange(n_train), 5), start=1):
        dump(f"data_batch_{b}", {"batch_label": f"synthetic training batch {b} of 5",
                                  "data": train_data[part],
                                  "labels": [train_labels[i] for i in part],
                                  "filenames": [f"synthetic_{i}.png" for i in part]})
    test_data, test_labels = _synthetic_images(rng, n_test, palette)
    dump("test_batch", {"batch_label": "synthetic testing batch 1 of 1",
                        "data": test_data, "labels": test_labels,
                        "filenames": [f"synthetic_test_{i}.png"
                                      for i in range(n_test)]})
    dump("batches.meta", {"label_names": CIFAR_CLASSES,
                          "num_cases_per_batch": n_train // 5, "num_vis": 3072})


def _write_synthetic_marker(folder: str, recipe: dict) -> None:
    """``SYNTHETIC_DATA.json``: the recipe and the MD5 of every file in ``folder``
    (``load_cifar10`` checks them)."""
    import hashlib
    import json
    import os

    md5 = {}
    for name in sorted(os.listdir(folder)):
        if name != SYNTHETIC_MARKER:
            with open(os.path.join(folder, name), "rb") as f:
                md5[name] = hashlib.md5(f.read()).hexdigest()
    with open(os.path.join(folder, SYNTHETIC_MARKER), "w") as f:
        json.dump({**recipe, "md5": md5}, f, indent=2)


def download_cifar10(root: str) -> str:
    """Download and check the real CIFAR-10 into ``root/cifar-10-batches-py`` (needs
    a network).

    torchvision downloads and extracts into a temporary folder that is renamed into
    place, so that several nodes downloading into one shared folder at once cannot leave
    a mix of half-written files: the first rename wins. Returns at once if the folder is
    already there.
    """
    import contextlib
    import os
    import shutil
    import tempfile

    from torchvision.datasets import CIFAR10

    final = os.path.join(root, "cifar-10-batches-py")
    if os.path.isdir(final):
        return final
    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".cifar10-download.", dir=root)
    try:
        # downloads, checks the MD5, extracts
        CIFAR10(scratch, train=True, download=True)
        with contextlib.suppress(OSError):
            os.rename(os.path.join(scratch, "cifar-10-batches-py"), final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not os.path.isdir(final):
        raise RuntimeError(f"downloading CIFAR-10 into {root} failed")
    return final


def is_synthetic_cifar10(root: str) -> bool:
    """Whether ``root`` holds the generated stand-in rather than the real CIFAR-10."""
    import os

    return os.path.exists(os.path.join(root, "cifar-10-batches-py", SYNTHETIC_MARKER))


def load_cifar10(root: str, train: bool, transform=None, download: bool = False):
    """``torchvision.datasets.CIFAR10`` for the real data; for the generated data the
    same class, checking the MD5s recorded when the files were written instead of the
    real files' MD5s."""
    import json
    import os

    from torchvision.datasets import CIFAR10

    if download or not is_synthetic_cifar10(root):
        return CIFAR10(root, train=train, transform=transform, download=download)
    with open(os.path.join(root, "cifar-10-batches-py", SYNTHETIC_MARKER)) as f:
        md5 = json.load(f)["md5"]

    class SyntheticCIFAR10(CIFAR10):
        train_list = [[f"data_batch_{b}", md5[f"data_batch_{b}"]] for b in range(1, 6)]
        test_list = [["test_batch", md5["test_batch"]]]
        meta = {"filename": "batches.meta", "key": "label_names",
                "md5": md5["batches.meta"]}

    return SyntheticCIFAR10(root, train=train, transform=transform, download=False)
