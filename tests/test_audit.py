import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from utils.audit import audit_shards
from utils.samplers import ShardSampler


def test_distributed_sampler_padding_is_found():
    # 25 samples over 3 ranks: 27 slots, the 2 extra slots repeat the first two indices.
    shards = [list(ShardSampler(range(25), 3, r, shuffle=False)) for r in range(3)]
    a = audit_shards(shards, 25)
    assert a.counts == (9, 9, 9)
    assert a.missing == ()
    assert a.duplicates == {0: 2, 1: 2}
    assert a.padding == ((1, 8, 0), (2, 8, 1))
    assert a.coverage == 1.0 and a.balanced
    assert not a.disjoint and not a.is_partition
    assert a.overlap[0][1] == 1 and a.overlap[1][2] == 1 and a.overlap[0][2] == 0


def test_drop_last_misses_the_tail():
    shards = [list(ShardSampler(range(25), 3, r, shuffle=False, drop_last=True)) for r in range(3)]
    a = audit_shards(shards, 25)
    assert a.counts == (8, 8, 8) and a.missing == (24,)
    assert a.disjoint and not a.duplicates and a.padding == ()


def test_partition_and_tensors_and_out_of_range():
    assert audit_shards([torch.tensor([0, 2]), torch.tensor([1, 3])], 4).is_partition
    a = audit_shards([[0, 5], [1]], 3)
    assert a.out_of_range == (5,) and a.missing == (2,) and not a.is_partition
    assert "out of range" in repr(a)


def test_disagreeing_seeds_overlap_without_padding():
    shards = [list(ShardSampler(range(100), 2, r, seed=r)) for r in range(2)]
    a = audit_shards(shards, 100)
    assert not a.disjoint and a.missing and a.duplicates
    assert a.padding == ()  # 100 splits evenly: the repeats are duplicates, not padding


def test_repr_is_readable():
    text = repr(audit_shards([[0, 1], [2, 0]], 4))
    assert "per-rank counts : [2, 2]" in text
    assert "missing 1: [3]" in text
    assert "padding         : 0 slots beyond dataset_len" in text
    assert "duplicates      : 1 indices seen more than once: {0x2}" in text
    assert "padding         : 1 slots" in repr(audit_shards([[0, 1], [2, 0]], 3))


@given(n=st.integers(0, 300), world=st.integers(1, 9), seed=st.integers(0, 99))
def test_shard_sampler_without_drop_last_covers_everything_once_plus_padding(n, world, seed):
    shards = [list(ShardSampler(range(n), world, r, seed=seed)) for r in range(world)]
    a = audit_shards(shards, n)
    assert a.coverage == 1.0
    assert len(a.padding) == sum(a.counts) - n
    assert a.balanced


@pytest.mark.parametrize(
    "shards, n, error",
    [([], 3, ValueError), ("abc", 3, TypeError), ([[0.5]], 3, TypeError), ([[0]], -1, ValueError),
     ([torch.zeros(2, 2, dtype=torch.long)], 4, ValueError), ([torch.tensor([0.0, 1.0])], 4, TypeError)],
)
def test_bad_input(shards, n, error):
    with pytest.raises(error):
        audit_shards(shards, n)
