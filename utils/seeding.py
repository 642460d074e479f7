"""Seeding for reproducible, non-repeating randomness across ranks, workers, epochs
and restarts.

Three rules, each backed by a demonstration in chapter 7 (notebooks/07_seeding.ipynb):

1. The *sampler's* seed is shared by all ranks (so shards partition the data); the seed
   of everything else (augmentations, dropout) differs per
   rank: ``seed_everything(seed, rank)``.
2. DataLoader workers get ``base_seed + worker_id`` from torch (for torch and
   ``random``; NumPy gets a 128-bit seed mixed from both); an RNG *object* the data set
   built before the workers started is copied into every worker and must be re-seeded
   there: ``worker_init_fn=seed_worker`` does it for data sets with a ``reseed(seed)``
   method, and leaves torch's seeding alone.
3. Randomness that must not depend on the number of workers, on ``persistent_workers``
   or on a restart is drawn from a generator keyed by
   ``(seed, epoch, index)``: ``sample_generator``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ._checks import check_int

__all__ = ["derive_seed", "seed_everything", "seed_worker", "loader_seed_kwargs",
           "sample_generator"]


def derive_seed(*keys: int) -> int:
    """A 63-bit seed mixed from non-negative integer keys, so nearby keys give
    unrelated streams.

    ``derive_seed(seed, rank)`` instead of ``seed + rank``: with plain addition, seed 1
    on rank 0 and seed 0 on rank 1 would share a stream.
    """
    if not keys:
        raise ValueError("derive_seed needs at least one key")
    checked = [check_int(f"keys[{i}]", k, minimum=0) for i, k in enumerate(keys)]
    state = np.random.SeedSequence(checked).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed ``random``, NumPy's global RNG and torch (CPU and CUDA) for this rank.

    Each rank gets its own stream (``derive_seed(seed, rank)``, returned), so
    augmentations and dropout differ between ranks; samplers keep their shared seed.
    """
    seed = check_int("seed", seed, minimum=0)
    rank = check_int("rank", rank, minimum=0)
    rank_seed = derive_seed(seed, rank)
    random.seed(rank_seed)
    np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)  # seeds every CUDA device too
    return rank_seed


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn``: re-seed the data set's own RNG from this worker's torch seed.

    torch seeds each worker's ``random`` (64-bit ``base_seed + worker_id``) and NumPy's
    global RNG (128 bits mixed from both) before this runs; re-seeding them from
    ``torch.initial_seed() % 2**32``, as the ``seed_worker`` of PyTorch's
    reproducibility notes does, cuts that to 32 bits.
    What torch cannot reach is an RNG object the data set made in ``__init__``, which
    every worker inherits as an identical copy: a ``reseed(seed)`` method of the data
    set is called with this worker's 64-bit seed.
    """
    info = get_worker_info()
    dataset = getattr(info, "dataset", None)
    if dataset is not None and callable(getattr(dataset, "reseed", None)):
        dataset.reseed(torch.initial_seed())  # base_seed + worker_id, set by torch


def loader_seed_kwargs(seed: int, rank: int = 0) -> dict[str, Any]:
    """DataLoader keyword arguments for a reproducible loader: ``generator``
    and ``worker_init_fn``.

    The generator decides the workers' base seed (and the order, for ``shuffle=True``);
    it is seeded per rank, so that rank r's worker k and rank s's worker k draw
    different streams.
    """
    return {"generator": torch.Generator().manual_seed(derive_seed(seed, rank)),
            "worker_init_fn": seed_worker}


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A torch generator keyed by ``(seed, epoch, index)``: the same draws for a sample
    in an epoch, whichever worker, rank or restarted process loads it."""
    return torch.Generator().manual_seed(derive_seed(seed, epoch, index))
