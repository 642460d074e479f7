"""Stratified, weighted, wrapped and class-balanced distributed samplers."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import RandomSampler, SequentialSampler

from utils.audit import audit_shards
from utils.samplers import (ClassBalancedBatchSampler, ShardedSampler, StratifiedShardSampler,
                            WeightedShardSampler)

labels_strategy = st.lists(st.integers(0, 5), min_size=0, max_size=300)


@settings(max_examples=150, deadline=None)
@given(labels=labels_strategy, world=st.integers(1, 8), seed=st.integers(0, 1000), epoch=st.integers(0, 5),
       drop_last=st.booleans())
def test_stratified_per_class_counts_within_one_and_every_index_covered(labels, world, seed, epoch, drop_last):
    y = np.array(labels, dtype=np.int64)
    shards, padding, dropped = [], [], []
    for r in range(world):
        s = StratifiedShardSampler(y, world, r, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        shards.append(list(s))
        padding += s.padding()
        dropped += s.dropped()
    assert len({len(sh) for sh in shards}) <= 1  # equal steps on every rank
    for c in np.unique(y):
        per_rank = [int((y[sh] == c).sum()) if sh else 0 for sh in shards]
        assert max(per_rank) - min(per_rank) <= 1
    a = audit_shards(shards, len(y))
    if drop_last:
        assert not a.duplicates and sorted(a.missing) == sorted(dropped) and len(dropped) < world
    else:
        assert a.coverage == 1.0 and len(padding) < world
        assert sum(a.counts) == len(y) + len(padding)


def test_stratified_reshuffles_each_epoch_and_reads_no_sample():
    y = [0] * 30 + [1] * 10
    s = StratifiedShardSampler(y, 2, 0, seed=0)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first and len(list(s)) == len(first) == 20  # a new order, the same share size
    with pytest.raises(ValueError, match="one-dimensional"):
        StratifiedShardSampler([[0, 1]], 2, 0)
    with pytest.raises(TypeError, match="integers"):
        StratifiedShardSampler([0.5, 1.0], 2, 0)


# --- the weighted sampler and the statistical test ------------------------------------------

WEIGHTS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
WORLD = 4
CHI2_999_DF7 = 24.32  # 99.9 % quantile of the chi-square distribution with 7 degrees of freedom


def chi_square(draws, weights=WEIGHTS):
    counts = torch.bincount(torch.as_tensor(draws), minlength=len(weights)).double()
    expected = weights.double() / weights.sum() * len(draws)
    return float(((counts - expected) ** 2 / expected).sum())


def union_is_one_weighted_sample(per_rank):
    """The check: the union fits the weights, and the ranks' draws are not copies of each other."""
    union = [i for r in per_rank for i in r]
    return chi_square(union) < CHI2_999_DF7 and len({tuple(r) for r in per_rank}) == len(per_rank)


def ours(num_samples, seed=0):
    return [list(WeightedShardSampler(WEIGHTS, num_samples, num_replicas=WORLD, rank=r, seed=seed)) for r in range(WORLD)]


def wrong_same_seed_on_every_rank(num_samples, seed=0):
    """Each rank draws num_samples / R on its own with the same seed: all ranks draw the same indices."""
    g = lambda: torch.Generator().manual_seed(seed)
    return [torch.multinomial(WEIGHTS, num_samples // WORLD, True, generator=g()).tolist() for _ in range(WORLD)]


def wrong_weights_within_shard(num_samples, seed=0):
    """Each rank samples by weight only inside its DistributedSampler shard (shard, then weight)."""
    out = []
    for r in range(WORLD):
        shard = torch.arange(r, len(WEIGHTS), WORLD)
        g = torch.Generator().manual_seed(seed + r)
        out.append(shard[torch.multinomial(WEIGHTS[shard], num_samples // WORLD, True, generator=g)].tolist())
    return out


def wrong_uniform(num_samples, seed=0):
    """Weights ignored."""
    g = torch.Generator().manual_seed(seed)
    draw = torch.randint(len(WEIGHTS), (num_samples,), generator=g)
    return [draw[r::WORLD].tolist() for r in range(WORLD)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_union_matches_the_weights(seed):
    assert union_is_one_weighted_sample(ours(80_000, seed))


@pytest.mark.parametrize("wrong", [wrong_same_seed_on_every_rank, wrong_weights_within_shard, wrong_uniform])
def test_the_statistical_check_catches_wrong_implementations(wrong):
    # The same check, with the same number of draws, rejects each wrong version:
    # - same seed on every rank: the ranks' draws are copies (and the union is over-dispersed,
    #   its chi-square about R times too large: 29.9 against the 24.3 threshold here);
    # - weights applied within each rank's shard: the classes' shares are wrong (chi-square ~5500);
    # - weights ignored: chi-square ~41000.
    assert not union_is_one_weighted_sample(wrong(80_000))


def test_weighted_ranks_agree_on_one_draw_and_respect_replacement():
    s = [WeightedShardSampler(WEIGHTS, 10, num_replicas=3, rank=r, seed=5) for r in range(3)]
    assert len(s[0]) == 4
    global_draw = s[0].global_draw()
    assert all(torch.equal(global_draw, x.global_draw()) for x in s)
    no_repl = [list(WeightedShardSampler(WEIGHTS, 8, replacement=False, num_replicas=2, rank=r)) for r in range(2)]
    assert audit_shards(no_repl, 8).is_partition
    with pytest.raises(ValueError, match="only 8 weights are positive"):
        WeightedShardSampler(WEIGHTS, 9, replacement=False, num_replicas=2, rank=0)
    for bad in ([], [-1.0, 2.0], [0.0, 0.0], [float("nan")]):
        with pytest.raises(ValueError, match="weights"):
            WeightedShardSampler(bad, 4, num_replicas=1, rank=0)


# --- ShardedSampler --------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 500), world=st.integers(1, 8), seed=st.integers(0, 10_000))  # RandomSampler refuses n=0
def test_sharded_seeded_sampler_partitions_its_output(n, world, seed):
    shards = []
    for r in range(world):
        inner = RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))
        shards.append(list(ShardedSampler(inner, world, r, drop_last=True)))
    a = audit_shards(shards, n)
    assert a.disjoint and not a.duplicates and len(a.missing) == n % world
    padded = [list(ShardedSampler(SequentialSampler(range(n)), world, r)) for r in range(world)]
    assert audit_shards(padded, n).coverage == 1.0


def test_sharded_unseeded_random_sampler_overlaps():
    torch.manual_seed(1)
    shards = [list(ShardedSampler(RandomSampler(range(200)), 2, r)) for r in range(2)]
    assert not audit_shards(shards, 200).disjoint


def test_sharded_sampler_checks_and_passes_set_epoch():
    class Epochal(SequentialSampler):
        epoch = None
        def set_epoch(self, e):
            self.epoch = e
    inner = Epochal(range(4))
    ShardedSampler(inner, 2, 0).set_epoch(3)
    assert inner.epoch == 3
    with pytest.raises(TypeError, match="iterable"):
        ShardedSampler(5, 2, 0)
    with pytest.raises(TypeError, match="length"):
        ShardedSampler(iter([1, 2]), 2, 0)


# --- ClassBalancedBatchSampler ---------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(labels=st.lists(st.integers(0, 6), min_size=20, max_size=400), world=st.integers(1, 4),
       k=st.integers(1, 3), m=st.integers(1, 4), seed=st.integers(0, 1000), epoch=st.integers(0, 3))
def test_class_balanced_batches_hold_the_promised_counts_and_ranks_are_disjoint(labels, world, k, m, seed, epoch):
    y = np.array(labels)
    try:
        samplers = [ClassBalancedBatchSampler(y, k, m, world, r, seed=seed) for r in range(world)]
    except ValueError:
        return  # too few classes or batches for this configuration: refused with a message
    seen = []
    for s in samplers:
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s) == len(samplers[0])
        for b in batches:
            per_class = Counter(y[b].tolist())
            assert len(per_class) == k and set(per_class.values()) == {m}
        seen.append([i for b in batches for i in b])
    a = audit_shards(seen, len(y))
    assert a.disjoint and not a.duplicates


def test_class_balanced_refuses_impossible_requests():
    with pytest.raises(ValueError, match="only 2 have them"):
        ClassBalancedBatchSampler([0] * 5 + [1] * 5 + [2], 3, 2, 1, 0)
    with pytest.raises(ValueError, match="fewer than num_replicas=4"):
        ClassBalancedBatchSampler([0] * 4 + [1] * 4, 2, 2, 4, 0)


def test_class_balanced_leaves_out_other_samples_in_later_epochs():
    # chapter 5: one epoch uses 64 of 101 samples; later epochs reshuffle and use the rest
    y = np.array([0] * 64 + [1] * 21 + [2] * 16)
    used_per_epoch = []
    for epoch in range(10):
        used = set()
        for r in range(2):
            s = ClassBalancedBatchSampler(y, 2, 4, num_replicas=2, rank=r, seed=0)
            s.set_epoch(epoch)
            used.update(i for batch in s for i in batch)
        used_per_epoch.append(used)
    assert all(len(u) == 64 for u in used_per_epoch)
    assert len({frozenset(u) for u in used_per_epoch}) > 1
    assert set().union(*used_per_epoch) == set(range(len(y)))
