"""ShardSampler must yield exactly what torch's DistributedSampler yields."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from utils.samplers import ShardSampler, shard_indices


def torch_and_ours(n, world, rank, shuffle, seed, epoch, drop_last):
    data = range(n)
    theirs = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    ours = ShardSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    theirs.set_epoch(epoch)
    ours.set_epoch(epoch)
    return theirs, ours


@settings(max_examples=300, deadline=None)
@given(
    # small sizes hit the corner cases (n < world, n == 0); large ones the real arithmetic
    n=st.one_of(st.integers(0, 70), st.integers(0, 10_000), st.integers(9_000, 10_000)),
    world=st.integers(1, 64),
    shuffle=st.booleans(),
    seed=st.one_of(st.integers(0, 2**31), st.integers(2**63 - 10, 2**64 - 1001)),
    epoch=st.integers(0, 1000),
    drop_last=st.booleans(),
)
@example(n=10_000, world=64, shuffle=True, seed=0, epoch=0, drop_last=False)
@example(n=10_000, world=64, shuffle=True, seed=2**31, epoch=1000, drop_last=True)
@example(n=9_999, world=63, shuffle=False, seed=0, epoch=0, drop_last=False)
@example(n=9_973, world=64, shuffle=True, seed=7, epoch=3, drop_last=True)
@example(n=63, world=64, shuffle=True, seed=1, epoch=1, drop_last=False)
def test_equal_to_distributed_sampler_on_every_rank(n, world, shuffle, seed, epoch, drop_last):
    for rank in range(world):
        theirs, ours = torch_and_ours(n, world, rank, shuffle, seed, epoch, drop_last)
        expected = list(theirs)
        assert list(ours) == expected
        assert len(ours) == len(theirs) == len(expected)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 25, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 8, 13])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_equal_on_a_fixed_grid(n, world, drop_last, shuffle):
    """The corner cases spelled out: empty, smaller than the world, exact multiples."""
    for rank in range(world):
        for epoch in (0, 1, 5):
            theirs, ours = torch_and_ours(n, world, rank, shuffle, 0, epoch, drop_last)
            assert list(ours) == list(theirs)


def test_seed_notebook_configurations():
    # The shuffled split of the seed notebook: m=25, two ranks, seed 0 (values are index + 1).
    rank0 = [i + 1 for i in ShardSampler(range(25), num_replicas=2, rank=0)]
    assert rank0 == [20, 7, 6, 12, 15, 22, 16, 23, 14, 8, 4, 21, 1]
    rank1 = [i + 1 for i in ShardSampler(range(25), num_replicas=2, rank=1)]
    assert rank1 == [17, 18, 25, 9, 13, 3, 2, 11, 10, 19, 5, 24, 20]
    # Round robin without shuffling: m=25, three ranks.
    assert list(ShardSampler(range(25), 3, 2, shuffle=False)) == [2, 5, 8, 11, 14, 17, 20, 23, 1]


def test_shard_indices_returns_int64_tensor():
    t = shard_indices(10, 3, 1, shuffle=False)
    assert t.dtype == torch.int64 and t.tolist() == [1, 4, 7, 0]


def test_defaults_need_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardSampler(range(10))


class Unsized:
    def __getitem__(self, i):
        return i


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"num_replicas": 2, "rank": 2}, ValueError, r"rank=2 is out of range for num_replicas=2; expected 0 <= rank < 2"),
        ({"num_replicas": 2, "rank": -1}, ValueError, r"rank=-1 is out of range"),
        ({"num_replicas": 0, "rank": 0}, ValueError, r"num_replicas=0 is out of range; expected num_replicas >= 1"),
        ({"num_replicas": 2.0, "rank": 0}, TypeError, r"num_replicas must be an integer"),
        ({"num_replicas": 2, "rank": "0"}, TypeError, r"rank must be an integer"),
        ({"num_replicas": 2, "rank": True}, TypeError, r"rank must be an integer"),
        ({"num_replicas": 2, "rank": 0, "seed": -1}, ValueError, r"seed=-1 is out of range"),
        ({"num_replicas": 2, "rank": 0, "seed": 1.5}, TypeError, r"seed must be an integer"),
        ({"num_replicas": 2, "rank": 0, "seed": 2**64}, ValueError, r"seed=18446744073709551616 is out of range; expected seed <= 18446744073709551615"),
        ({"num_replicas": 2, "rank": 0, "shuffle": 1}, TypeError, r"shuffle must be True or False"),
        ({"num_replicas": 2, "rank": 0, "drop_last": None}, TypeError, r"drop_last must be True or False"),
    ],
)
def test_bad_arguments_name_the_argument_and_range(kwargs, error, text):
    with pytest.raises(error, match=text):
        ShardSampler(range(10), **kwargs)


def test_unsized_dataset_is_a_type_error():
    with pytest.raises(TypeError, match="dataset must have a length"):
        ShardSampler(Unsized(), num_replicas=2, rank=0)


@pytest.mark.parametrize("epoch, error", [(-1, ValueError), (1.0, TypeError), ("3", TypeError)])
def test_bad_epoch(epoch, error):
    s = ShardSampler(range(10), num_replicas=2, rank=0)
    with pytest.raises(error, match="epoch"):
        s.set_epoch(epoch)
    assert s.epoch == 0  # a rejected value changes nothing


def test_seed_plus_epoch_must_fit_a_generator_seed():
    s = ShardSampler(range(10), num_replicas=2, rank=0, seed=2**64 - 1)
    assert list(s) == list(DistributedSampler(range(10), num_replicas=2, rank=0, seed=2**64 - 1))
    with pytest.raises(ValueError, match=r"seed \+ epoch = 18446744073709551616 is out of range"):
        s.set_epoch(1)
    assert s.epoch == 0
