"""Distributed samplers written from scratch.

``ShardSampler`` yields exactly the indices that ``torch.utils.data.DistributedSampler``
yields, for every combination of arguments, but builds them with tensor operations and
converts only this rank's share to Python ints, so it is faster for large data sets.

The samplers torch lacks follow the same pattern: one global decision that every rank
computes identically from ``(seed, epoch)``, then a split that gives every rank the same
number of items.

- ``StratifiedShardSampler``: every rank gets each class in the same proportion;
- ``WeightedShardSampler``: one weighted draw, shared by the ranks
  (``WeightedRandomSampler`` for DDP);
- ``ShardedSampler``: distributes the output of any deterministic sampler;
- ``ClassBalancedBatchSampler``: batches of equal counts of a few classes, disjoint
  across ranks.
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
from typing import Iterator, Sequence, Sized

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ._checks import check_bool, check_int, check_rank
from .seeding import derive_seed

__all__ = [
    "ShardSampler",
    "StratifiedShardSampler",
    "WeightedShardSampler",
    "ShardedSampler",
    "ClassBalancedBatchSampler",
    "shard_indices",
    "stride_shard",
    "num_samples_per_rank",
    "PermutationShardSampler",
    "CountingLoader",
    "permute",
    "exact_order",
    "EXACT_MAX_N",
    "cycle_walk",
]

MAX_SEED = 2**64 - 1  # the largest value torch.Generator.manual_seed accepts


def check_seed_and_epoch(seed, epoch) -> tuple[int, int]:
    """Both non-negative integers whose sum is a valid generator seed."""
    seed = check_int("seed", seed, minimum=0, maximum=MAX_SEED)
    epoch = check_int("epoch", epoch, minimum=0, maximum=MAX_SEED)
    if seed + epoch > MAX_SEED:
        raise ValueError(f"seed + epoch = {seed + epoch} is out of range; "
                         f"the generator is seeded with "
                         f"seed + epoch, which must be <= 2**64 - 1")
    return seed, epoch


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator every rank builds for ``(seed, epoch)``, as
    ``DistributedSampler`` does."""
    seed, epoch = check_seed_and_epoch(seed, epoch)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return g


def num_samples_per_rank(dataset_len: int, num_replicas: int, drop_last: bool) -> int:
    """How many indices each rank gets: ``ceil(n / R)`` with padding,
    ``floor(n / R)`` without."""
    if drop_last:
        return dataset_len // num_replicas
    return math.ceil(dataset_len / num_replicas)


def stride_shard(order: torch.Tensor, num_replicas: int, rank: int,
                 drop_last: bool = False) -> torch.Tensor:
    """Rank ``rank``'s share of a global ``order``: positions ``rank, rank + R, ...``
    after padding or cutting.

    Padding repeats ``order`` from its start (padded position ``p`` holds
    ``order[p % n]``), so only this rank's positions are ever computed.
    """
    n = len(order)
    per_rank = num_samples_per_rank(n, num_replicas, drop_last)
    positions = rank + num_replicas * torch.arange(per_rank, dtype=torch.int64)
    if per_rank == 0:
        return order[:0]
    return order[positions % n] if per_rank * num_replicas > n else order[positions]


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
    """This rank's indices as an int64 tensor, exactly as ``DistributedSampler``
    orders them.

    The global order is a permutation of ``range(dataset_len)`` drawn from a generator
    seeded with ``seed + epoch`` (or the identity without shuffling). It is cut to a
    multiple of ``num_replicas`` (``drop_last``) or padded by repeating it from the
    start; rank ``r`` takes positions ``r, r + R, r + 2R, ...``.
    """
    n = check_int("dataset_len", dataset_len, minimum=0)
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    rank = check_rank(rank, num_replicas)
    shuffle = check_bool("shuffle", shuffle)
    drop_last = check_bool("drop_last", drop_last)
    seed, epoch = check_seed_and_epoch(seed, epoch)
    if shuffle and n:
        order = torch.randperm(n, generator=epoch_generator(seed, epoch))
    else:
        order = torch.arange(n, dtype=torch.int64)
    return stride_shard(order, num_replicas, rank, drop_last)


def resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``, defaulting to the initialised process
    group's, checked."""
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "num_replicas and rank default to the process group's world size and "
                "rank, but no process group is initialised: call "
                "torch.distributed.init_process_group() first or pass both explicitly"
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    return num_replicas, check_rank(rank, num_replicas)


def check_labels(labels) -> np.ndarray:
    """Labels as a 1-D int64 array; they are read as a sequence, never by
    loading samples."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    try:
        array = np.asarray(labels)
    except Exception as exc:
        raise TypeError(f"labels must be a sequence of integers: {exc}") from None
    if array.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"labels must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


class _EpochSampler(Sampler):
    """What every sampler here shares: ranks resolved and checked, a seed,
    and ``set_epoch``."""

    def __init__(self, num_replicas: int | None, rank: int | None, seed: int) -> None:
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self.seed, _ = check_seed_and_epoch(seed, 0)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``__iter__`` use the order of ``epoch``; call it with the same
        value on every rank."""
        _, self.epoch = check_seed_and_epoch(self.seed, epoch)

    def generator(self) -> torch.Generator:
        return epoch_generator(self.seed, self.epoch)


class ShardSampler(_EpochSampler):
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
                f"dataset must have a length (a map-style data set or any Sized "
                f"object), got {type(dataset).__name__} without __len__"
            ) from None
        super().__init__(num_replicas, rank, seed)
        self.shuffle = check_bool("shuffle", shuffle)
        self.drop_last = check_bool("drop_last", drop_last)
        self.num_samples = num_samples_per_rank(self.dataset_len, self.num_replicas,
                                                drop_last)
        self.total_size = self.num_samples * self.num_replicas

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
            f"ShardSampler(len(dataset)={self.dataset_len}, "
            f"num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )


class StratifiedShardSampler(_EpochSampler):
    """Every rank gets each class in the same proportion (per-class counts within one),
    every epoch reshuffled.

    Each class is shuffled with the ``(seed, epoch)`` generator; the classes are laid
    end to end and dealt round robin, so each rank gets ``floor`` or ``ceil`` of
    ``n_c / R`` of class ``c``. Ranks that come out one short get one repeated sample of
    a class they are short of (at most ``R - 1`` repeats per epoch, listed by
    :meth:`padding`), or with ``drop_last`` the longer ranks give one back (listed by
    :meth:`dropped`). Each rank's share is then shuffled on its own.
    """

    def __init__(self, labels: Sequence[int], num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        self.labels = check_labels(labels)
        super().__init__(num_replicas, rank, seed)
        self.shuffle = check_bool("shuffle", shuffle)
        self.drop_last = check_bool("drop_last", drop_last)
        self.num_samples = num_samples_per_rank(len(self.labels), self.num_replicas,
                                                self.drop_last)
        self.classes = np.unique(self.labels)

    def _plan(self) -> tuple[list[np.ndarray], list[list[int]], list[list[int]]]:
        """Every rank's share (the same computation on every rank), its padding and its
        dropped indices."""
        g = self.generator()
        blocks = []
        for c in self.classes:
            members = np.flatnonzero(self.labels == c)
            if self.shuffle:
                members = members[torch.randperm(len(members), generator=g).numpy()]
            blocks.append(members)
        order = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
        block_of = np.repeat(np.arange(len(blocks)), [len(b) for b in blocks])
        R = self.num_replicas
        shares = [list(order[r::R]) for r in range(R)]
        share_blocks = [list(block_of[r::R]) for r in range(R)]
        counts = np.array([np.bincount(share_blocks[r], minlength=len(blocks))
                           for r in range(R)]).reshape(R, -1)
        padding: list[list[int]] = [[] for _ in range(R)]
        dropped: list[list[int]] = [[] for _ in range(R)]
        # padding repeats each class from its start, like DistributedSampler
        next_repeat = [0] * len(blocks)
        for r in range(R):
            # A rank is one short (pad) or one long (drop): change a class where that
            # keeps the per-class counts within one of the other ranks, chosen with the
            # shared generator.
            if not self.drop_last and len(shares[r]) < self.num_samples:
                short = np.flatnonzero(counts[r] < counts.max(axis=0))
                c = int(short[int(torch.randint(len(short), (1,), generator=g))])
                repeat = int(blocks[c][next_repeat[c] % len(blocks[c])])
                next_repeat[c] += 1
                padding[r].append(repeat)
                shares[r].append(repeat)
                counts[r, c] += 1
            elif self.drop_last and len(shares[r]) > self.num_samples:
                long = np.flatnonzero(counts[r] > counts.min(axis=0))
                c = int(long[int(torch.randint(len(long), (1,), generator=g))])
                position = len(share_blocks[r]) - 1 - share_blocks[r][::-1].index(c)
                dropped[r].append(int(shares[r].pop(position)))
                share_blocks[r].pop(position)
                counts[r, c] -= 1
        return [np.asarray(s, dtype=np.int64) for s in shares], padding, dropped

    def _rank_share(self) -> tuple[np.ndarray, list[int], list[int]]:
        shares, padding, dropped = self._plan()
        share = shares[self.rank]
        if self.shuffle and len(share):
            local = torch.Generator().manual_seed(
                derive_seed(self.seed, self.epoch, self.rank))
            share = share[torch.randperm(len(share), generator=local).numpy()]
        return share, padding[self.rank], dropped[self.rank]

    def padding(self) -> list[int]:
        """The repeated indices this rank gets in the current epoch (empty
        with ``drop_last``)."""
        return self._rank_share()[1]

    def dropped(self) -> list[int]:
        """The indices this rank gave up in the current epoch (only
        with ``drop_last``)."""
        return self._rank_share()[2]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rank_share()[0].tolist())

    def __len__(self) -> int:
        return self.num_samples


class WeightedShardSampler(_EpochSampler):
    """``WeightedRandomSampler`` for several ranks: one weighted draw every rank agrees
    on, then sharded.

    Each epoch draws ``ceil(num_samples / R) * R`` indices with ``torch.multinomial``
    from the ``(seed, epoch)`` generator, identically on every rank, and rank ``r``
    keeps draws ``r, r + R, ...``. The union over ranks is therefore one correct
    weighted sample.
    """

    def __init__(self, weights: Sequence[float], num_samples: int,
                 replacement: bool = True, num_replicas: int | None = None,
                 rank: int | None = None, seed: int = 0) -> None:
        w = torch.as_tensor(weights, dtype=torch.double)
        if w.dim() != 1 or len(w) == 0:
            raise ValueError(f"weights must be a non-empty 1-D sequence, "
                             f"got shape {tuple(w.shape)}")
        if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ValueError("weights must be finite and non-negative, "
                             "with a positive sum")
        self.weights = w
        self.num_samples_total = check_int("num_samples", num_samples, minimum=1)
        self.replacement = check_bool("replacement", replacement)
        super().__init__(num_replicas, rank, seed)
        self.num_samples = math.ceil(self.num_samples_total / self.num_replicas)
        draws = self.num_samples * self.num_replicas
        nonzero = int((w > 0).sum())
        if not replacement and draws > nonzero:
            raise ValueError(
                f"without replacement the ranks draw {draws} indices in all "
                f"(num_samples rounded up to a multiple of "
                f"num_replicas={self.num_replicas}), but only {nonzero} weights are "
                f"positive"
            )

    def global_draw(self) -> torch.Tensor:
        """The draw of every rank together, in order (the same tensor on every rank)."""
        draws = self.num_samples * self.num_replicas
        return torch.multinomial(self.weights, draws, self.replacement,
                                 generator=self.generator())

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_draw()[self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples


class ShardedSampler(_EpochSampler):
    """Distribute any deterministic sampler: every rank iterates it, pads it like
    ``DistributedSampler`` and strides.

    The wrapped sampler must yield the same sequence on every rank (a seeded generator,
    or no randomness); an unseeded ``RandomSampler`` makes ranks overlap. ``set_epoch``
    is passed on to the wrapped sampler when it has one.
    """

    def __init__(self, sampler, num_replicas: int | None = None,
                 rank: int | None = None, drop_last: bool = False) -> None:
        if not hasattr(sampler, "__iter__"):
            raise TypeError(f"sampler must be iterable, got {type(sampler).__name__}")
        try:
            self.inner_len = len(sampler)
        except TypeError:
            raise TypeError("sampler must have a length, so every rank knows its share "
                            "before iterating") from None
        super().__init__(num_replicas, rank, 0)
        self.sampler = sampler
        self.drop_last = check_bool("drop_last", drop_last)
        self.num_samples = num_samples_per_rank(self.inner_len, self.num_replicas,
                                                self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = torch.as_tensor(list(self.sampler), dtype=torch.int64)
        if len(order) != self.inner_len:
            raise RuntimeError(f"the wrapped sampler yielded {len(order)} indices "
                               f"but its len() is {self.inner_len}")
        return iter(stride_shard(order, self.num_replicas, self.rank,
                                 self.drop_last).tolist())

    def __len__(self) -> int:
        return self.num_samples


class ClassBalancedBatchSampler(_EpochSampler):
    """Batches of ``classes_per_batch`` classes x ``samples_per_class`` samples each,
    disjoint across ranks.

    Each epoch, every class is shuffled and cut into chunks of ``samples_per_class`` (a
    class's remainder waits for a later epoch, when the shuffle puts other samples
    last). Batches are formed from chunks of distinct classes, always taking the classes
    with the most chunks left (ties broken by the shared generator), which forms as many
    batches as possible. The batches are shuffled and dealt round robin; every rank gets
    ``len(self)`` batches.
    """

    def __init__(self, labels: Sequence[int], classes_per_batch: int,
                 samples_per_class: int, num_replicas: int | None = None,
                 rank: int | None = None, seed: int = 0) -> None:
        self.labels = check_labels(labels)
        self.classes_per_batch = check_int("classes_per_batch", classes_per_batch,
                                           minimum=1)
        self.samples_per_class = check_int("samples_per_class", samples_per_class,
                                           minimum=1)
        super().__init__(num_replicas, rank, seed)
        self.classes, counts = np.unique(self.labels, return_counts=True)
        self.chunks_per_class = counts // self.samples_per_class
        usable = int((self.chunks_per_class > 0).sum())
        if usable < self.classes_per_batch:
            raise ValueError(
                f"classes_per_batch={self.classes_per_batch} needs that many classes "
                f"with at least samples_per_class={self.samples_per_class} samples, "
                f"but only {usable} have them"
            )
        self.num_batches_total = self._count_batches(self.chunks_per_class)
        self.num_batches = self.num_batches_total // self.num_replicas
        if self.num_batches == 0:
            raise ValueError(
                f"only {self.num_batches_total} batches can be formed, "
                f"fewer than num_replicas="
                f"{self.num_replicas}: use fewer classes or samples per batch"
            )

    def _count_batches(self, chunks: np.ndarray) -> int:
        heap = [-int(c) for c in chunks if c > 0]
        heapq.heapify(heap)
        k, batches = self.classes_per_batch, 0
        while len(heap) >= k:
            taken = [heapq.heappop(heap) for _ in range(k)]
            batches += 1
            for t in taken:
                if t + 1 < 0:
                    heapq.heappush(heap, t + 1)
        return batches

    def all_batches(self) -> list[list[int]]:
        """Every batch of the epoch, before dealing (the same list on every rank)."""
        g = self.generator()
        chunks: list[list[list[int]]] = []
        for c in self.classes:
            members = np.flatnonzero(self.labels == c)
            members = members[torch.randperm(len(members), generator=g).numpy()]
            n_chunks = len(members) // self.samples_per_class
            chunks.append([members[i * self.samples_per_class:
                                   (i + 1) * self.samples_per_class].tolist()
                           for i in range(n_chunks)])
        tiebreak = torch.rand(len(chunks), generator=g).tolist()
        heap = [(-len(ch), tiebreak[c], c) for c, ch in enumerate(chunks) if ch]
        heapq.heapify(heap)
        batches = []
        while len(heap) >= self.classes_per_batch:
            taken = [heapq.heappop(heap) for _ in range(self.classes_per_batch)]
            batches.append([i for _, _, c in taken for i in chunks[c].pop()])
            for left, tie, c in taken:
                if left + 1 < 0:
                    heapq.heappush(heap, (left + 1, tie, c))
        order = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in order]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.all_batches()
        return iter(batches[self.rank:self.num_batches * self.num_replicas:
                            self.num_replicas])

    def __len__(self) -> int:
        return self.num_batches


# --- PermutationShardSampler: the epoch's order as a keyed bijection -----------------

# n up to EXACT_MAX_N: an exact Fisher-Yates shuffle, held as an int64 array (8 MiB at
# 2**20, drawn in about 10 ms, once per epoch); above it, the Feistel network in O(1).
EXACT_MAX_N = 2**20
# Feistel rounds. Luby-Rackoff's 4 rounds bound only q**2 / 2**half queries of random
# round functions: nothing once a whole epoch (2**bits positions) is read; 4 rounds on
# small halves are visibly non-uniform (chi-square 2,768 at n = 8). Grain's and
# TensorFlow's index shuffles use 4 Simon rounds, on 16 bits at least. 8 rounds (FF3-1's
# count; FF1 has 10) pass every joint test in tests/test_permutation_sampler.py, down to
# n = 5.
_ROUNDS = 8
# The round function works on uint32: a half has at most 31 bits (n <= 2**62). Its
# multipliers are lowbias32's (Chris Wellons' hash-prospector), its key the round key's
# two 32-bit words, one XORed in, one added.
_M1 = np.uint32(0x7FEB352D)
_M2 = np.uint32(0x846CA68B)
_SHIFT = np.uint32(16)
_LOW32 = np.uint64(0xFFFFFFFF)
# splitmix64's multipliers and shifts: the network before issue 48 (_legacy_feistel)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SHIFTS = np.uint64(30), np.uint64(27), np.uint64(31)
# The Feistel order's version, in the sampler's states: 2 since issue 48 (uint32
# rounds); the states of version 1 (8 rounds on uint64) carry no "network"
_NETWORK = 2
_EXACT_TAG = 0x5045524D  # "PERM": the exact order's stream is no other sampler's
_FIRST_CHUNK = 1024  # small, so the first index comes quickly
_MAX_CHUNK = 1 << 16  # large enough to amortise NumPy's per-call cost


def feistel_bits(n: int) -> int:
    """Bits of the Feistel domain for ``[0, n)``: the smallest even number ``b >= 2``
    with ``2**b >= n``, so the domain holds at most ``4n`` values."""
    bits = max(2, (max(n, 1) - 1).bit_length())
    return bits + bits % 2


def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int: a bijection of 64-bit values."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def round_keys(seed: int, epoch: int, rounds: int = _ROUNDS) -> np.ndarray:
    """The round keys of ``(seed, epoch)``: ``rounds`` uint64 values mixed from both
    (and the round's number) with splitmix64, the same on every rank and every machine
    (plain Python ints: microseconds, so the first index comes at once)."""
    seed, epoch = check_seed_and_epoch(seed, epoch)
    state = _mix64(_mix64(seed) ^ _mix64(epoch + 0x9E3779B97F4A7C15))
    return np.array([_mix64(state + (i + 1) * 0x9E3779B97F4A7C15)
                     for i in range(rounds)], dtype=np.uint64)


def _fmix64(x: np.ndarray, scratch: np.ndarray) -> None:
    """splitmix64's finaliser on uint64 ``x``, in place (``scratch``: same shape)."""
    a, b, c = _SHIFTS
    np.right_shift(x, a, out=scratch)
    x ^= scratch
    x *= _MIX1
    np.right_shift(x, b, out=scratch)
    x ^= scratch
    x *= _MIX2
    np.right_shift(x, c, out=scratch)
    x ^= scratch


def _legacy_feistel(x: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    """The sampler's network before issue 48, kept only to measure the new one against
    (``utils.bench``, the speed test): 8 rounds on uint64, each round function
    ``fmix64(fmix64(right ^ key) + key) >> (64 - bits / 2)``, 20 NumPy passes a
    round. Its orders are no longer drawn."""
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    top = np.uint64(64 - bits // 2)
    left = x >> half
    right = x & mask
    f, scratch = np.empty_like(x), np.empty_like(x)
    for key in keys:
        np.bitwise_xor(right, key, out=f)
        _fmix64(f, scratch)
        f += key
        _fmix64(f, scratch)
        f >>= top
        left ^= f
        left, right = right, left
    left <<= half
    left |= right
    return left


def _rounds(left: np.ndarray, right: np.ndarray, half: int,
            keys: np.ndarray) -> np.ndarray:
    """The Feistel rounds on uint32 halves of ``half`` bits, one per key, in place
    (``left`` and ``right`` are overwritten); returns ``(left << half) | right``
    as uint32 when ``2 * half <= 32``, else as uint64. The round function takes the
    round key's low word ``a`` and high word ``b``:
    ``(xorshift16((right ^ a) * M1) + b) * M2 >> (32 - half)``, 8 uint32 passes."""
    lows = (keys & _LOW32).astype(np.uint32)
    highs = (keys >> np.uint64(32)).astype(np.uint32)
    top = np.uint32(32 - half)
    f, scratch = np.empty_like(right), np.empty_like(right)
    for a, b in zip(lows, highs):
        np.bitwise_xor(right, a, out=f)
        f *= _M1
        np.right_shift(f, _SHIFT, out=scratch)
        f ^= scratch
        f += b
        f *= _M2
        f >>= top
        left ^= f
        left, right = right, left
    if 2 * half <= 32:
        left <<= np.uint32(half)
        left |= right
        return left
    out = left.astype(np.uint64)
    out <<= np.uint64(half)
    out |= right
    return out


def _feistel(x: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    """One pass of the Feistel network on ``[0, 2**bits)`` (``x`` uint64, kept; the
    result uint64): one round per key (``keys``: one uint64 per round, or a row of
    them per element), each on uint32 halves of ``bits / 2`` bits (see
    :func:`_rounds`)."""
    half = bits // 2
    if bits <= 32:
        right = x.astype(np.uint32)
        left = right >> np.uint32(half)
        right &= np.uint32((1 << half) - 1)
    else:
        left = (x >> np.uint64(half)).astype(np.uint32)
        right = (x & np.uint64((1 << half) - 1)).astype(np.uint32)
    return _rounds(left, right, half, keys).astype(np.uint64, copy=False)


def permute(positions, n: int, keys: np.ndarray) -> np.ndarray:
    """Where each of ``positions`` (integers in ``[0, n)``) goes under the keyed
    bijection of ``[0, n)``: the Feistel network on ``[0, 2**bits)``, applied again to
    the values that land outside ``[0, n)`` (cycle walking) until all are inside.

    This is the sampler's order above ``EXACT_MAX_N``. Every pass is an even permutation
    of ``[0, 2**bits)`` (each round is, on halves of 2 bits or more), so at
    ``n = 2**bits`` (16, 64, 256, ...) only half of the ``n!`` orders can occur: whole
    orders cannot be uniform at tiny ``n``, which is one reason the sampler shuffles
    exactly below ``EXACT_MAX_N``."""
    x = np.asarray(positions, dtype=np.uint64)
    if x.size and int(x.max()) >= n:
        raise ValueError(f"positions must lie in [0, n) = [0, {n}), "
                         f"got {int(x.max())}")
    if not 0 <= n <= 2**62:
        raise ValueError(f"n must be between 0 and 2**62, got {n}: the network works "
                         f"on at most 64 bits, and indices must fit an int64")
    if x.size == 0:
        return x.astype(np.int64)
    return cycle_walk(x, n, keys).view(np.int64)  # a new array, all below 2**62


def cycle_walk(x: np.ndarray, n: int, keys: np.ndarray, network=None) -> np.ndarray:
    """``network`` (the Feistel pass, by default) on uint64 ``x`` in ``[0, n)``,
    applied again to the values that land outside until all are inside. ``keys``: one
    per round, or one per round and element (``rounds x len(x)``, many orders at once).
    """
    network = _feistel if network is None else network
    bits, per_element = feistel_bits(n), keys.ndim == 2
    x = network(x, bits, keys)
    outside = np.flatnonzero(x >= np.uint64(n))
    while outside.size:
        walking = keys[:, outside] if per_element else keys
        x[outside] = network(x[outside], bits, walking)
        outside = outside[x[outside] >= np.uint64(n)]
    return x


def exact_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The sampler's order up to ``EXACT_MAX_N``: a uniform random permutation of
    ``[0, n)`` (NumPy's Fisher-Yates), drawn from PCG64 seeded with ``(seed, epoch, n)``
    through a SeedSequence. The same on every rank and machine that runs the same NumPy
    version: SeedSequence and PCG64 are stable across versions, but NumPy does not
    promise that ``Generator.permutation`` draws the same way in every release
    (``test_exact_order_is_pinned`` notices if it changes)."""
    n = check_int("n", n, minimum=0, maximum=2**62)
    seed, epoch = check_seed_and_epoch(seed, epoch)
    sequence = np.random.SeedSequence([_EXACT_TAG, seed, epoch, n])
    return np.random.Generator(np.random.PCG64(sequence)).permutation(n)


class PermutationShardSampler(_EpochSampler):
    """``ShardSampler``'s contract in O(1) memory above ``2**20`` samples, with exact
    (and elastic) resume.

    The epoch's global order is a permutation of ``[0, n)`` keyed by ``(seed, epoch)``.
    Up to ``exact_max_n`` (``EXACT_MAX_N = 2**20``: at most 8 MiB) it is a uniform
    random permutation, :func:`exact_order`, drawn once per epoch and kept. Above it,
    position ``p`` holds index ``permute(p)``, an 8-round Feistel network with cycle
    walking, computed on demand in chunks, never as a list of ``n``
    (``exact_max_n=0`` forces the network at every ``n``). Rank ``r`` of
    ``R`` takes positions ``r, r + R, r + 2R, ...`` like ``DistributedSampler``, so
    every global batch of ``R x batch_size`` positions is a contiguous block of the
    order; the tail is padded by repeating the order from its start, or dropped with
    ``drop_last``.

    The state is ``(seed, epoch, consumed)``, where ``consumed`` counts the positions
    the training loop has received, over all ranks. After ``load_state_dict`` the next
    iteration yields positions ``consumed, consumed + 1, ...`` dealt over this
    sampler's ranks, whatever their number: with any ``num_replicas`` and any
    ``num_workers`` the ranks see exactly the unseen part of the epoch. Count with
    :class:`CountingLoader`: the sampler itself runs ahead of the loop by the
    DataLoader's prefetch. With ``drop_last`` each run drops what its own number of
    ranks cannot split, so an epoch resumed on fewer ranks may deliver tail samples
    that the wider run would have dropped (and one resumed on more may drop more).
    """

    def __init__(self, n, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0, drop_last: bool = False,
                 batch_size: int | None = None,
                 exact_max_n: int = EXACT_MAX_N) -> None:
        if not isinstance(n, numbers.Integral) and hasattr(n, "__len__"):
            n = len(n)
        self.n = check_int("n (the data set size, or a Sized data set)", n,
                           minimum=0, maximum=2**62)
        super().__init__(num_replicas, rank, seed)
        self.drop_last = check_bool("drop_last", drop_last)
        if batch_size is not None:
            batch_size = check_int("batch_size", batch_size, minimum=1)
        self.batch_size = batch_size
        exact_max_n = check_int("exact_max_n", exact_max_n, minimum=0)
        self.shuffle = "exact" if self.n <= exact_max_n else "feistel"
        self._order = None  # (seed, epoch, the exact order), kept for the epoch
        self.start = 0  # positions consumed before the next iteration begins
        self.iter_start = 0  # ``start`` of the iteration under way (or the last)
        # changes with every iteration, new epoch and load: what a CountingLoader
        # received belongs to the iteration it saw start
        self.generation = 0
        self._then_epoch = None  # see load_state_dict
        self._since_load = 0  # iterations begun since the last load
        # (generation, positions before the chunk being handed out, its length, its
        # iterator): how far the iteration under way has got, read without a counter
        self._progress = (0, 0, 0, iter(()))

    @property
    def global_batch_size(self) -> int | None:
        """``num_replicas x batch_size``, or None when no ``batch_size`` was given."""
        if self.batch_size is None:
            return None
        return self.num_replicas * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from now on; a new epoch starts from its
        beginning (and its state says so at once: nothing of it consumed), the same
        epoch keeps a loaded resume point. Called before a load of an earlier
        epoch's state, the epoch it names starts once the loaded one is finished."""
        old = self.epoch
        super().set_epoch(epoch)
        self._then_epoch = None  # the script has said which epoch comes
        if self.epoch != old:
            self.start = self.iter_start = 0
            self.generation += 1

    def keys(self) -> np.ndarray:
        return round_keys(self.seed, self.epoch)

    def _lookup(self):
        """The epoch's order as a function of positions in ``[0, n)``: the exact
        permutation (drawn on the first call of the epoch, then reused), or the
        Feistel network with the epoch's keys."""
        if self.shuffle == "feistel":
            keys, n = self.keys(), self.n
            return lambda p: permute(p, n, keys)
        if self._order is None or self._order[:2] != (self.seed, self.epoch):
            self._order = (self.seed, self.epoch,
                           exact_order(self.n, self.seed, self.epoch))
        order = self._order[2]
        return lambda p: order[p]

    def global_order(self, positions) -> np.ndarray:
        """The indices at ``positions`` of the epoch's global order (positions past
        ``n`` wrap to the start, as padding does)."""
        p = np.asarray(positions, dtype=np.int64)
        if self.n == 0:
            if p.size:
                raise ValueError("an empty data set has no positions")
            return p
        if p.size and int(p.min()) < 0:
            raise ValueError(f"positions must be >= 0, got {int(p.min())}")
        return self._lookup()(p % self.n)

    def _remaining(self, start: int) -> int:
        return max(self.n - start, 0)

    def _count(self, start: int) -> int:
        """This rank's share of the positions from ``start`` to the epoch's end."""
        left = self._remaining(start)
        if self.drop_last:
            return left // self.num_replicas
        return -(-left // self.num_replicas)

    def __len__(self) -> int:
        return self._count(self.start)

    def _arrays(self, start: int, count: int, size: int, most: int,
                generation: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """This rank's ``count`` indices from global position ``start``, computed
        chunk-wise as ``(generation, done, int64 array)``, ``done`` being the indices
        before the chunk: the first chunk holds ``size``, each next one twice as many,
        up to ``most``. Finishing the epoch resets ``start``; if ``set_epoch`` chose a
        later epoch before a load, that epoch follows in the same iteration, as a new
        generation (a loader that replays a snapshot to the loaded epoch's end goes
        on into the epoch the script asked for)."""
        R = self.num_replicas
        while True:
            lookup, n = self._lookup(), self.n
            first, done, k = start + self.rank, 0, size
            while done < count:
                k = min(k, count - done)
                p = np.arange(done, done + k, dtype=np.uint64)
                p *= np.uint64(R)
                p += np.uint64(first)
                if first + R * (done + k - 1) >= n:  # padding: wrap to the start
                    p %= np.uint64(n)
                yield generation, done, lookup(p)
                done += k
                k = min(2 * k, most)
            self.start = 0  # the epoch is finished: a new iteration starts it again
            if self._then_epoch is None:
                return
            self.epoch, self._then_epoch = self._then_epoch, None
            self.iter_start = start = 0
            self.generation += 1
            generation, count = self.generation, len(self)

    def _chunks(self, start: int, count: int, generation: int) -> Iterator:
        for generation, done, indices in self._arrays(start, count, _FIRST_CHUNK,
                                                      _MAX_CHUNK, generation):
            chunk = iter(indices.tolist())
            self._progress = (generation, done, len(indices), chunk)
            yield chunk

    def _begin(self) -> None:
        """Start an iteration at ``start``; an epoch chosen before a load begins once
        nothing of the loaded one is left for this run, or at the second iteration
        since the load (the first finished the loaded epoch)."""
        if self._then_epoch is not None and (self._count(self.start) == 0
                                             or self._since_load):
            self.epoch, self.start, self._then_epoch = self._then_epoch, 0, None
        self._since_load += 1
        self.iter_start = self.start
        self.generation += 1

    def __iter__(self) -> Iterator[int]:
        self._begin()
        return itertools.chain.from_iterable(
            self._chunks(self.start, len(self), self.generation))

    def index_batches(self, batch_size: int,
                      drop_last: bool = False) -> Iterator[np.ndarray]:
        """This rank's indices of the epoch from the resume point, as NumPy int64
        arrays of ``batch_size`` (the last one shorter, or left out with
        ``drop_last``): the batches ``BatchSampler(self, batch_size, drop_last)``
        makes, without a Python int per index. It starts an iteration as
        ``iter(self)`` does, and :meth:`yielded` and :meth:`state_dict` count the
        indices of the batches handed out (and, as with ``BatchSampler``, a tail
        left out once the epoch is over)."""
        batch_size = check_int("batch_size", batch_size, minimum=1)
        drop_last = check_bool("drop_last", drop_last)
        self._begin()
        return self._batches(self.start, len(self), batch_size, drop_last,
                             self.generation)

    def _batches(self, start: int, count: int, batch_size: int, drop_last: bool,
                 generation: int) -> Iterator[np.ndarray]:
        # every chunk but the last is a whole number of batches
        most = batch_size * max(1, _MAX_CHUNK // batch_size)
        for generation, done, indices in self._arrays(start, count, batch_size, most,
                                                      generation):
            for i in range(0, len(indices), batch_size):
                batch = indices[i:i + batch_size]
                self._progress = (generation, done + i + len(batch), 0, iter(()))
                if len(batch) == batch_size or not drop_last:
                    yield batch

    def yielded(self) -> int:
        """How many indices the iteration under way has handed out so far (0 before
        its first, and after ``set_epoch`` or a load). A DataLoader with workers takes
        them ahead of the training loop."""
        generation, done, k, chunk = self._progress
        if generation != self.generation:
            return 0
        return done + k - chunk.__length_hint__()

    def state_dict(self, received: int | None = None, finished: bool = False) -> dict:
        """``(seed, epoch, consumed)``: ``received`` is how many indices this rank's
        training loop got in the current iteration (:class:`CountingLoader` passes
        it); every rank has received as many, so ``consumed`` counts them ``R``
        times. Without it, the indices the sampler has handed out count
        (:meth:`yielded`): right where the sampler's state is taken in step with the
        batches, as torchdata's ``StatefulDataLoader`` does; ahead of the loop by the
        prefetch when read from a running plain DataLoader. ``finished`` says the
        loop has had the epoch's last batch (a DataLoader with ``drop_last`` leaves
        the sampler's tail untaken): :class:`CountingLoader` passes it."""
        if received is None:
            received = self.yielded()
        received = check_int("received", received, minimum=0)
        consumed = min(self.iter_start + self.num_replicas * received,
                       max(self.n, self.iter_start))
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch,
                "consumed": consumed,
                # nothing of the epoch left for the run that saves it
                "finished": bool(finished) or self._count(consumed) == 0,
                "global_batch_size": self.global_batch_size,
                "shuffle": self.shuffle, **self._network_version()}

    def _network_version(self) -> dict:
        """The Feistel order's version, in its states only: a state of the network
        drawn before (no "network") names other indices for the same positions."""
        return {"network": _NETWORK} if self.shuffle == "feistel" else {}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state``: the next iteration yields this rank's share of the
        positions after ``state["consumed"]``. ``num_replicas`` may differ from the
        saving run's; the global batch size (when both runs give one) may not. If
        ``set_epoch`` chose a later epoch before this load (StatefulDataLoader loads
        at the next iteration, after the script's ``set_epoch``), the next iteration
        finishes the state's epoch and the sampler then moves to that later epoch."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), "
                            f"got {type(state).__name__}")
        missing = {"n", "seed", "epoch", "consumed"} - set(state)
        if missing:
            raise ValueError(f"state lacks {sorted(missing)}; expected the dict "
                             f"state_dict() returns")
        if state["n"] != self.n:
            raise ValueError(f"state is for n={state['n']}, this sampler has "
                             f"n={self.n}: resume needs the same data set")
        saved_batch = state.get("global_batch_size")
        if None not in (saved_batch, self.global_batch_size) \
                and saved_batch != self.global_batch_size:
            raise ValueError(
                f"state was saved with a global batch of {saved_batch}, this sampler "
                f"has num_replicas x batch_size = {self.global_batch_size}: keep "
                f"the global batch size, so the batches stay the same blocks")
        if "shuffle" not in state:
            raise ValueError(
                "state has no 'shuffle': it was saved by the first version of "
                "PermutationShardSampler, whose order (a 4-round Feistel network) this "
                "version no longer draws, so resuming it would repeat some samples and "
                "skip others; finish that epoch with the version that saved it, or "
                "start it over (set_epoch(state['epoch']) without loading)")
        if state["shuffle"] != self.shuffle:
            raise ValueError(f"state was saved with the {state['shuffle']} order, this "
                             f"sampler uses the {self.shuffle} one: keep exact_max_n")
        if state.get("network") != self._network_version().get("network"):
            raise ValueError(
                f"state was saved with version {state.get('network', 1)} of the "
                f"Feistel order (version 1: 64-bit round functions, before issue 48), "
                f"this sampler draws version {_NETWORK}: resuming it would repeat "
                f"some samples and skip others; finish that epoch with the version "
                f"that saved it, or start it over (set_epoch(state['epoch']) without "
                f"loading)")
        seed, epoch = check_seed_and_epoch(state["seed"], state["epoch"])
        consumed = check_int("state['consumed']", state["consumed"], minimum=0)
        # set_epoch chose a later epoch before this load (a restarted script that sets
        # the next epoch, then loads; StatefulDataLoader, which loads at its next
        # iteration): an epoch the saving run had finished gives way at once; one
        # that is not (a snapshot taken before its end is replayed to the end) is
        # finished first, then that later epoch starts
        self._then_epoch = None
        if epoch < self.epoch and state.get("finished", False):
            epoch, consumed = self.epoch, 0
        elif epoch < self.epoch:
            self._then_epoch = self.epoch
        self.seed, self.epoch, self.start = seed, epoch, consumed
        self.iter_start, self._since_load = consumed, 0
        self.generation += 1

    def __repr__(self) -> str:
        return (f"PermutationShardSampler(n={self.n}, "
                f"num_replicas={self.num_replicas}, rank={self.rank}, "
                f"seed={self.seed}, drop_last={self.drop_last}, "
                f"batch_size={self.batch_size}, shuffle={self.shuffle!r}, "
                f"epoch={self.epoch}, "
                f"start={self.start})")


def batch_length(batch) -> int:
    """How many samples a collated batch holds, when its shape says so unambiguously.

    A tensor or array: its first dimension. A tuple, list or dict of fields (what
    ``default_collate`` makes of samples that are tuples or dicts): the count each field
    gives, which must agree; a field that is a list of tensors (a collate that keeps
    samples of different lengths apart) counts its items. Anything else, or fields that
    disagree, raises: pass ``count=`` to :class:`CountingLoader`.
    """
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        if batch.ndim == 0:
            raise TypeError("cannot count the samples of a 0-d tensor; pass count= "
                            "to CountingLoader")
        return len(batch)
    fields = list(batch.values()) if isinstance(batch, dict) else batch
    if not isinstance(fields, (tuple, list)) or not fields:
        raise TypeError(f"cannot count the samples of a batch of type "
                        f"{type(batch).__name__}; pass count= to CountingLoader")
    counts = {_field_length(field) for field in fields}
    counts.discard(None)
    if len(counts) != 1:
        raise ValueError(f"the batch's fields give {sorted(counts) or 'no'} sample "
                         f"counts; pass count= to CountingLoader")
    return counts.pop()


def _field_length(field) -> int | None:
    """One field's sample count: a tensor's first dimension, a list of tensors' length
    (``None`` for what says nothing: a number, a string)."""
    if isinstance(field, (torch.Tensor, np.ndarray)):
        return len(field) if field.ndim else None
    if isinstance(field, (tuple, list)):
        return len(field)
    if isinstance(field, dict):
        return batch_length(field)
    return None


class CountingLoader:
    """A DataLoader that counts what the training loop received, for exact resume.

    Iterate it instead of the DataLoader; ``state_dict()`` then gives the
    ``PermutationShardSampler`` state at the batch the loop has last received,
    however far the DataLoader's workers have prefetched.
    """

    def __init__(self, loader, count=batch_length) -> None:
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, PermutationShardSampler):
            raise TypeError(f"loader.sampler must be a PermutationShardSampler, got "
                            f"{type(sampler).__name__}")
        if not callable(count):
            raise TypeError("count must be a function of a batch")
        if getattr(loader, "in_order", True) is False \
                and getattr(loader, "num_workers", 0) > 0:
            raise ValueError("in_order=False hands batches to the loop as workers "
                             "finish them, not in the sampler's order, so the samples "
                             "received are not a prefix of the order: a resume would "
                             "repeat some and lose others; use in_order=True")
        if count is batch_length and getattr(loader, "batch_size", 1) is None \
                and getattr(loader, "batch_sampler", None) is None:
            count = _one  # no automatic batching: each item is one sample
        self.loader, self.sampler, self.count = loader, sampler, count
        self.received = 0
        self._generation = None  # the sampler's, when this iteration started
        self._batches_left = None  # batches of this iteration not yet received

    def __iter__(self):
        self.received, self._generation = 0, None
        for batch in self.loader:
            if self._generation is None:  # the sampler's iteration has started
                self._generation = self.sampler.generation
                self._batches_left = _length(self.loader)
            self.received += self.count(batch)
            if self._batches_left is not None:
                self._batches_left -= 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict:
        """The sampler's state after the batches received, if they belong to the
        sampler's current iteration; after ``set_epoch`` (a new epoch, nothing of it
        received yet) or a load, the sampler's own."""
        current = self._generation == self.sampler.generation
        if not current:
            return self.sampler.state_dict(received=0)
        return self.sampler.state_dict(received=self.received,
                                       finished=self._batches_left == 0)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self.received, self._generation = 0, None


def _one(batch) -> int:
    return 1


def _length(loader) -> int | None:
    """``len(loader)``, or None where it has none."""
    try:
        return len(loader)
    except TypeError:
        return None
