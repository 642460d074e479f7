"""Distributed samplers written from scratch.

``ShardSampler`` yields exactly the indices that ``torch.utils.data.DistributedSampler`` yields,
for every combination of arguments, but builds them with tensor operations and converts only
this rank's share to Python ints, so it is faster for large data sets.
"""

from __future__ import annotations

import math
from typing import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ._checks import check_bool, check_int, check_rank

__all__ = ["ShardSampler", "shard_indices", "num_samples_per_rank"]

MAX_SEED = 2**64 - 1  # the largest value torch.Generator.manual_seed accepts


def check_seed_and_epoch(seed, epoch) -> tuple[int, int]:
    """Both non-negative integers whose sum is a valid generator seed."""
    seed = check_int("seed", seed, minimum=0, maximum=MAX_SEED)
    epoch = check_int("epoch", epoch, minimum=0, maximum=MAX_SEED)
    if seed + epoch > MAX_SEED:
        raise ValueError(f"seed + epoch = {seed + epoch} is out of range; the generator is seeded with "
                         f"seed + epoch, which must be <= 2**64 - 1")
    return seed, epoch


def num_samples_per_rank(dataset_len: int, num_replicas: int, drop_last: bool) -> int:
    """How many indices each rank gets: ``ceil(n / R)`` with padding, ``floor(n / R)`` without."""
    if drop_last:
        return dataset_len // num_replicas
    return math.ceil(dataset_len / num_replicas)


def shard_indices(
    dataset_len: int,
    num_replicas: int,
    rank: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> torch.Tensor:
    """This rank's indices as an int64 tensor, exactly as ``DistributedSampler`` orders them.

    The global order is a permutation of ``range(dataset_len)`` drawn from a generator seeded
    with ``seed + epoch`` (or the identity without shuffling). It is cut to a multiple of
    ``num_replicas`` (``drop_last``) or padded by repeating it from the start; rank ``r`` takes
    positions ``r, r + R, r + 2R, ...``.
    """
    n = check_int("dataset_len", dataset_len, minimum=0)
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    rank = check_rank(rank, num_replicas)
    shuffle = check_bool("shuffle", shuffle)
    drop_last = check_bool("drop_last", drop_last)
    seed, epoch = check_seed_and_epoch(seed, epoch)

    per_rank = num_samples_per_rank(n, num_replicas, drop_last)
    # Positions of this rank in the padded (or truncated) global order.
    positions = rank + num_replicas * torch.arange(per_rank, dtype=torch.int64)
    if per_rank == 0:
        return positions
    if not shuffle:
        return positions % n
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g)
    # Padding repeats the order from its start, so padded position p holds order[p % n].
    return order[positions % n] if per_rank * num_replicas > n else order[positions]


class ShardSampler(Sampler[int]):
    """Drop-in, from-scratch equivalent of ``torch.utils.data.DistributedSampler``.

    Same arguments, same indices, same ``set_epoch``; arguments are checked up front.
    ``num_replicas`` and ``rank`` default to the world size and rank of the initialised
    default process group.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.dataset = dataset
        try:
            self.dataset_len = len(dataset)
        except TypeError:
            raise TypeError(
                f"dataset must have a length (a map-style data set or any Sized object), "
                f"got {type(dataset).__name__} without __len__"
            ) from None
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "num_replicas and rank default to the process group's world size and rank, "
                    "but no process group is initialised: call "
                    "torch.distributed.init_process_group() first or pass both explicitly"
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        self.num_replicas = check_int("num_replicas", num_replicas, minimum=1)
        self.rank = check_rank(rank, self.num_replicas)
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed, _ = check_seed_and_epoch(seed, 0)
        self.drop_last = check_bool("drop_last", drop_last)
        self.epoch = 0
        self.num_samples = num_samples_per_rank(self.dataset_len, self.num_replicas, drop_last)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``__iter__`` use the order of ``epoch``; call it with the same value on every rank."""
        _, self.epoch = check_seed_and_epoch(self.seed, epoch)

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch, as an int64 tensor."""
        return shard_indices(
            self.dataset_len,
            self.num_replicas,
            self.rank,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (
            f"ShardSampler(len(dataset)={self.dataset_len}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )
