from collections import Counter

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from utils.data import ShardedIterable, global_worker
from utils.launch import run_distributed


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 2000), world_size=st.integers(1, 8), num_workers=st.integers(0, 4))
def test_every_element_exactly_once_across_ranks_and_workers(n, world_size, num_workers):
    stream = ShardedIterable(range(n))
    seen = Counter()
    for rank in range(world_size):
        for worker in range(max(num_workers, 1)):
            seen.update(stream.shard(rank, world_size, worker, num_workers))
    assert sorted(seen) == list(range(n))
    assert all(c == 1 for c in seen.values())


@pytest.mark.parametrize("context", [None, "spawn"])
def test_with_real_ranks_and_workers(context):
    # A spawned worker has no process group: the rank must travel with the pickled data set.
    def load():
        loader = DataLoader(ShardedIterable(range(103)), batch_size=5, num_workers=2,
                            multiprocessing_context=context)
        return [i for batch in loader for i in batch.tolist()]

    per_rank = run_distributed(load, 2)
    everything = sorted(per_rank[0] + per_rank[1])
    assert everything == list(range(103))


def test_explicit_rank_and_callable_source():
    stream = ShardedIterable(lambda: iter("abcdefg"), rank=1, world_size=3)
    assert list(stream) == ["b", "e"]


def test_a_one_shot_iterator_is_refused():
    with pytest.raises(TypeError, match="one-shot iterator"):
        ShardedIterable(iter(range(5)))


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"rank": 0}, ValueError, "both rank and world_size"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank=2 is out of range"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size=0"),
    ],
)
def test_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text):
        ShardedIterable(range(4), **kwargs)


def test_global_worker_checks():
    assert global_worker(1, 2, 1, 3) == (4, 6)
    assert global_worker(1, 2, 0, 0) == (1, 2)
    with pytest.raises(ValueError, match="worker_id=3 is out of range for num_workers=3"):
        global_worker(0, 1, 3, 3)
    with pytest.raises(TypeError):
        ShardedIterable(42)
