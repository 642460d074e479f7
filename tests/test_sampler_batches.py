"""``PermutationShardSampler.index_batches``: the sampler's own indices as NumPy
batches, counted for resume as ``__iter__``'s are; and the loop-body rates that
``utils.bench.bench_samplers`` reports."""

import itertools

import numpy as np
import pytest
from torch.utils.data import BatchSampler

from utils.samplers import PermutationShardSampler

EXACT, FEISTEL = 2**20, 0  # exact_max_n: the exact order, or the network forced


def batched(indices, batch_size, drop_last=False):
    return list(BatchSampler(indices, batch_size, drop_last))


def as_lists(batches):
    out = []
    for batch in batches:
        assert isinstance(batch, np.ndarray) and batch.dtype == np.int64
        assert batch.ndim == 1
        out.append(batch.tolist())
    return out


@pytest.mark.parametrize("exact_max_n", [EXACT, FEISTEL])
@pytest.mark.parametrize("n,num_replicas", [(0, 2), (1, 1), (7, 3), (100, 8),
                                            (1000, 1), (1001, 4), (70_001, 3)])
@pytest.mark.parametrize("batch_size", [1, 5, 256])
def test_index_batches_are_the_iteration_batched(n, num_replicas, batch_size,
                                                 exact_max_n):
    for rank in sorted({0, num_replicas - 1}):
        for drop_last in (False, True):
            sampler = PermutationShardSampler(n, num_replicas, rank, seed=11,
                                              drop_last=drop_last,
                                              exact_max_n=exact_max_n)
            sampler.set_epoch(2)
            expected = batched(list(sampler), batch_size)
            assert as_lists(sampler.index_batches(batch_size)) == expected
            # and again: a finished epoch starts over, as __iter__ does
            assert as_lists(sampler.index_batches(batch_size)) == expected


@pytest.mark.parametrize("exact_max_n", [EXACT, FEISTEL])
def test_index_batches_drop_last_leaves_out_the_short_tail(exact_max_n):
    sampler = PermutationShardSampler(1003, 4, 3, seed=5, exact_max_n=exact_max_n)
    whole = list(sampler)
    for batch_size in (1, 7, 251, 300):
        got = as_lists(sampler.index_batches(batch_size, drop_last=True))
        assert got == batched(whole, batch_size, drop_last=True)
        assert sampler.yielded() == len(whole)  # the tail was taken, as BatchSampler
    assert as_lists(sampler.index_batches(1000, drop_last=True)) == []


@pytest.mark.parametrize("exact_max_n", [EXACT, FEISTEL])
def test_index_batches_cross_chunk_boundaries(exact_max_n):
    """Batch sizes that do not divide the chunks ``__iter__`` computes (1024,
    2048, ... up to 2**16), and one larger than a chunk."""
    sampler = PermutationShardSampler(300_000, 2, 1, seed=1, exact_max_n=exact_max_n)
    whole = list(sampler)
    for batch_size in (1000, 3000, 70_000):
        assert as_lists(sampler.index_batches(batch_size)) == batched(whole,
                                                                      batch_size)


@pytest.mark.parametrize("exact_max_n", [EXACT, FEISTEL])
@pytest.mark.parametrize("consumed", [0, 5, 600, 999, 1000])
def test_index_batches_start_at_the_resume_point(exact_max_n, consumed):
    n, R = 1000, 3
    saving = PermutationShardSampler(n, 4, 0, seed=2, exact_max_n=exact_max_n)
    saving.set_epoch(1)
    state = dict(saving.state_dict(), consumed=consumed)
    for rank in range(R):
        by_iter = PermutationShardSampler(n, R, rank, seed=2, exact_max_n=exact_max_n)
        by_batches = PermutationShardSampler(n, R, rank, seed=2,
                                             exact_max_n=exact_max_n)
        by_iter.load_state_dict(state)
        by_batches.load_state_dict(state)
        assert len(by_batches) == len(by_iter)
        expected = batched(list(by_iter), 16)
        assert as_lists(by_batches.index_batches(16)) == expected
        assert by_batches.state_dict()["consumed"] == n
        # the epoch is over: the next iteration starts it from the beginning
        fresh = PermutationShardSampler(n, R, rank, seed=2, exact_max_n=exact_max_n)
        fresh.set_epoch(1)
        assert as_lists(by_batches.index_batches(16)) == batched(list(fresh), 16)


@pytest.mark.parametrize("exact_max_n", [EXACT, FEISTEL])
@pytest.mark.parametrize("batch_size", [1, 10, 64, 300])
def test_yielded_and_state_count_the_batches_taken(exact_max_n, batch_size):
    n, R = 2003, 4
    sampler = PermutationShardSampler(n, R, 1, seed=9, exact_max_n=exact_max_n)
    whole = list(sampler)
    reference = PermutationShardSampler(n, R, 1, seed=9, exact_max_n=exact_max_n)
    batches = sampler.index_batches(batch_size)
    assert sampler.yielded() == 0
    assert sampler.state_dict()["consumed"] == 0
    taken = 0
    for k, batch in enumerate(batches, start=1):
        taken += len(batch)
        assert sampler.yielded() == taken == min(k * batch_size, len(whole))
        # the same state __iter__ gives after as many indices
        it = iter(reference)
        list(itertools.islice(it, taken))
        assert sampler.state_dict() == reference.state_dict()
    assert taken == len(whole)


@pytest.mark.parametrize("exact_max_n", [EXACT, FEISTEL])
def test_a_state_saved_mid_batches_resumes_the_rest(exact_max_n):
    n, R, B = 5000, 2, 100
    samplers = [PermutationShardSampler(n, R, r, seed=4, exact_max_n=exact_max_n)
                for r in range(R)]
    whole = [list(s) for s in samplers]
    iterators = [s.index_batches(B) for s in samplers]
    for _ in range(7):
        for it in iterators:
            next(it)
    state = samplers[0].state_dict()
    assert state["consumed"] == R * 7 * B
    resumed = PermutationShardSampler(n, 1, 0, seed=4, exact_max_n=exact_max_n)
    resumed.load_state_dict(state)
    rest = np.concatenate(list(resumed.index_batches(B))).tolist()
    seen = [i for w in whole for i in w[:7 * B]]
    assert sorted(seen + rest) == list(range(n))


def test_set_epoch_and_a_new_iteration_reset_the_count():
    sampler = PermutationShardSampler(1000, 2, 0, seed=1)
    batches = sampler.index_batches(10)
    next(batches)
    assert sampler.yielded() == 10
    sampler.set_epoch(1)
    assert sampler.yielded() == 0
    batches = sampler.index_batches(10)
    next(batches)
    iter(sampler)  # a new iteration: the batches' count is not its own
    assert sampler.yielded() == 0


@pytest.mark.parametrize("batch_size,error", [
    (0, ValueError), (-3, ValueError), (2.0, TypeError), ("8", TypeError),
    (True, TypeError), (None, TypeError)])
def test_a_bad_batch_size_is_refused_at_the_call(batch_size, error):
    sampler = PermutationShardSampler(100, 2, 0)
    with pytest.raises(error, match="batch_size"):
        sampler.index_batches(batch_size)
    with pytest.raises(TypeError, match="drop_last"):
        sampler.index_batches(4, drop_last=1)
    assert sampler.generation == 0  # refused before an iteration started


def test_bench_samplers_reports_each_loop_body():
    from utils.bench import bench_samplers

    result = bench_samplers(sizes=(2000,), num_replicas=4)
    bodies = ["for i in sampler: pass", "for i in sampler: count += 1",
              "BatchSampler(sampler, 256, False) (what a DataLoader does)"]
    numpy = "sampler.index_batches(256) (NumPy)"
    torch_case, ours = result["cases"]
    assert list(torch_case["rates_per_s"]) == bodies
    assert list(ours["rates_per_s"]) == bodies + [numpy]
    assert all(rate > 0 for c in (torch_case, ours) for rate in
               c["rates_per_s"].values())
    assert ours["indices_per_s"] == ours["indices"] / ours["epoch_s"]
    speedup = result["index_batches_over_for_loop"]["2000"]
    rates = ours["rates_per_s"]
    assert speedup == pytest.approx(rates[numpy] / rates["for i in sampler: pass"])
    for name in bodies + [numpy]:
        assert name in result["method"]
