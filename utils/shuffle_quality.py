"""What a shuffle must be, measured: joint statistics of many seeds' orders, each
computed the same way for ``PermutationShardSampler`` and for ``torch.randperm``.

A per-element test (is each index equally likely at each position?) passes for
orders that are far from random permutations. These statistics look at orders jointly:

- the first two indices at ``n = 8``: a chi-square over the 56 ordered pairs;
- whole orders at ``n = 5``: how often the most frequent of the 120 comes up;
- neighbours: how many adjacent positions hold adjacent indices (``|a - b| == 1``),
  about 2 per order for a uniform permutation, more if the order keeps the data
  set's stored order in places;
- consecutive epochs: whether where an index sits in epoch ``e`` says anything of
  where it sits in ``e + 1``.

The orders compared (``KINDS``): the sampler's exact order (``n <= EXACT_MAX_N``),
its Feistel network forced at small ``n`` (what ``n > EXACT_MAX_N`` gets), the
4-round network of the sampler's first version (kept here only to measure it), and
``torch.randperm`` seeded as ``DistributedSampler`` seeds it. The tests in
``tests/test_permutation_sampler.py`` hold the first two to ``torch.randperm``'s
thresholds; chapter 15 prints the table.
"""

from __future__ import annotations

import math

import numpy as np

from .samplers import (_feistel, cycle_walk, exact_order, permute, round_keys,
                       shard_indices)

__all__ = ["KINDS", "orders", "first_pair_chi_square", "whole_orders",
           "whole_order_chi_square",
           "neighbours_per_order", "neighbours", "epoch_correlation",
           "first_version_feistel",
           "parity", "quality_table"]

KINDS = ("exact", "feistel", "first version", "torch.randperm")
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def first_version_feistel(x: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    """One pass of the first version's network (4 keys): a round function of one
    multiply-xorshift-multiply-xorshift cut to the half's width, the right half
    XORed with the key at its start. Kept only to measure it; the sampler no longer
    uses it."""
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    left, right = x >> half, x & mask
    t = np.empty_like(x)
    for key in keys:
        np.bitwise_xor(right, key, out=t)
        t *= _MIX1
        t ^= t >> np.uint64(31)
        t *= _MIX2
        t ^= t >> np.uint64(29)
        t &= mask
        left ^= t
        left, right = right, left
    left <<= half
    left |= right
    return left


def _networks(positions, n: int, seeds, epoch: int, first_version: bool) -> np.ndarray:
    """The network's indices at ``positions`` for many seeds at once, one row per
    seed, cycle-walked into ``[0, n)`` as ``permute`` does (and checked against it)."""
    rounds = 4 if first_version else None
    keys = np.stack([round_keys(s, epoch) if rounds is None
                     else round_keys(s, epoch, rounds) for s in seeds], axis=1)
    k = len(positions)
    keys = np.repeat(keys, k, axis=1)  # one key per element, per round
    network = first_version_feistel if first_version else _feistel
    x = np.tile(np.asarray(positions, dtype=np.uint64), len(seeds))
    x = cycle_walk(x, n, keys, network)
    out = x.astype(np.int64).reshape(len(seeds), k)
    if not first_version:
        for row, s in list(zip(out, seeds))[:2]:
            assert np.array_equal(row, permute(positions, n, round_keys(s, epoch)))
    return out


def orders(kind: str, n: int, k: int, seeds, epoch: int = 0) -> np.ndarray:
    """The first ``k`` indices of each seed's order of ``[0, n)`` in ``epoch``, one
    row per seed, for one of ``KINDS``."""
    seeds = list(seeds)
    if kind == "exact":
        return np.stack([exact_order(n, s, epoch)[:k] for s in seeds])
    if kind in ("feistel", "first version"):
        return _networks(np.arange(k), n, seeds, epoch, kind == "first version")
    if kind == "torch.randperm":
        return np.stack([shard_indices(n, 1, 0, seed=s, epoch=epoch)[:k].numpy()
                         for s in seeds])
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def first_pair_chi_square(kind: str, n: int = 8, seeds: int = 28000) -> float:
    """Chi-square of the first two indices' ordered pairs against uniform, over
    ``seeds`` seeds (df ``n(n - 1) - 1``: 55 at ``n = 8``, 99% of uniform draws
    below 82)."""
    pairs = orders(kind, n, 2, range(seeds))
    counts = np.zeros((n, n))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    off = ~np.eye(n, dtype=bool)
    expected = seeds / (n * (n - 1))
    return float(((counts[off] - expected) ** 2 / expected).sum())


def whole_orders(kind: str, n: int = 5, seeds: int = 20000) -> tuple[int, int]:
    """``(distinct orders seen, count of the most frequent)`` over ``seeds`` seeds."""
    _, counts = np.unique(orders(kind, n, n, range(seeds)), axis=0,
                          return_counts=True)
    return len(counts), int(counts.max())


def whole_order_chi_square(kind: str, n: int = 5, seeds: int = 20000) -> float:
    """Chi-square of the whole orders' counts against uniform over all ``n!`` orders
    (df ``n! - 1``: 119 at ``n = 5``, 99% of uniform draws below about 158)."""
    _, counts = np.unique(orders(kind, n, n, range(seeds)), axis=0,
                          return_counts=True)
    cells = math.factorial(n)
    expected = seeds / cells
    unseen = cells - len(counts)  # each contributes expected**2 / expected
    return float(((counts - expected) ** 2 / expected).sum() + unseen * expected)


def neighbours_per_order(kind: str, n: int, seeds: int) -> float:
    """Mean count of positions ``p`` with ``|order[p + 1] - order[p]| == 1``: about
    ``2 (n - 1) / n`` for a uniform permutation."""
    return float(neighbours(orders(kind, n, n, range(seeds))).mean())


def neighbours(rows: np.ndarray) -> np.ndarray:
    """For each row (an order), the count of positions ``p`` with
    ``|row[p + 1] - row[p]| == 1``."""
    return (np.abs(np.diff(rows, axis=1)) == 1).sum(axis=1)


def epoch_correlation(kind: str, n: int = 1000,
                      seeds: int = 100) -> tuple[float, float]:
    """``(mean, largest |r|)`` of the correlation between where each index sits in
    epoch 3 and in epoch 4, over ``seeds`` seeds: about 0 and ``3 / sqrt(n)``."""
    e3, e4 = orders(kind, n, n, range(seeds), 3), orders(kind, n, n, range(seeds), 4)
    r = [np.corrcoef(np.argsort(a), np.argsort(b))[0, 1] for a, b in zip(e3, e4)]
    return float(np.mean(r)), float(np.max(np.abs(r)))


def parity(order) -> int:
    """0 for an even permutation, 1 for an odd one (from its cycles)."""
    seen, cycles = np.zeros(len(order), dtype=bool), 0
    for i in range(len(order)):
        cycles += not seen[i]
        while not seen[i]:
            seen[i], i = True, order[i]
    return (len(order) - cycles) % 2


def quality_table(kinds=KINDS) -> dict[str, dict]:
    """The joint checks for each kind, as the chapter prints them."""
    table = {}
    for kind in kinds:
        distinct8, top8 = whole_orders(kind, 8, 20000)
        table[kind] = {
            "first pair chi-square, n = 8 (28,000 seeds)": first_pair_chi_square(kind),
            "most frequent order, n = 5 (20,000 seeds)": whole_orders(kind)[1],
            "whole-order chi-square, n = 5 (20,000 seeds)":
                whole_order_chi_square(kind),
            "distinct orders, n = 8 (20,000 seeds)": distinct8,
            "most frequent order, n = 8 (20,000 seeds)": top8,
            "neighbours per order, n = 1,000 (200 seeds)":
                neighbours_per_order(kind, 1000, 200),
            "neighbours per order, n = 10,000 (50 seeds)":
                neighbours_per_order(kind, 10000, 50),
        }
    return table
