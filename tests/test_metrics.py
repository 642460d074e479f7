import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from utils.audit import audit_shards
from utils.launch import run_distributed
from utils.metrics import (EvalShardSampler, even_batch_shards, gather_by_index,
                           kept_by_gather_for_metrics, sum_over_ranks)


@pytest.mark.parametrize("n, world", [(0, 3), (1, 4), (10, 4), (25, 3), (24, 3)])
def test_eval_shards_partition_without_padding(n, world):
    shards = [list(EvalShardSampler(n, world, r)) for r in range(world)]
    assert audit_shards(shards, n).is_partition
    assert [len(EvalShardSampler(n, world, r)) for r in range(world)] == [len(s) for s in shards]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def _exact_metrics(n):
    rank, world = dist.get_rank(), dist.get_world_size()
    truth = (torch.arange(n) % 3 == 0)  # sample i is "correct" when i % 3 == 0
    mine = list(EvalShardSampler(n))
    correct, count = sum_over_ranks(int(truth[mine].sum()), len(mine))
    padded = torch.tensor(list(DistributedSampler(range(n), shuffle=False)), dtype=torch.int64)
    gathered = gather_by_index(padded, truth[padded].to(torch.int64), n)
    return correct / count, float(gathered.double().mean()), float(truth.double().mean())


@pytest.mark.parametrize("n", [10, 11, 3])
def test_both_exact_methods_equal_the_single_process_value(n):
    for by_sum, by_gather, single in run_distributed(_exact_metrics, 4, n):
        assert by_sum == single and by_gather == single


def test_gather_by_index_checks():
    assert gather_by_index(torch.tensor([1, 0, 1]), torch.tensor([5, 6, 5]), 2).tolist() == [6, 5]
    with pytest.raises(ValueError, match="evaluated by no rank"):
        gather_by_index(torch.tensor([0]), torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="differ in length"):
        gather_by_index(torch.tensor([0, 1]), torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="out of range"):
        gather_by_index(torch.tensor([2]), torch.tensor([1]), 2)
    with pytest.raises(ValueError):
        sum_over_ranks()
    assert sum_over_ranks(1, 2.5) == (1.0, 2.5)  # no process group: the local values


@pytest.mark.parametrize("n, batch, world", [(0, 8, 4), (30, 8, 4), (33, 8, 4), (40, 8, 4),
                                             (10, 8, 4), (101, 8, 3), (10_000, 512, 8)])
def test_even_batch_shards_pad_whole_rounds_and_truncation_restores_the_data_set(n, batch, world):
    shards = even_batch_shards(n, batch, world)
    round_size = batch * world
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) % batch == 0  # equal full batches
    audit = audit_shards(shards, n)
    slots = sum(audit.counts)
    assert slots == -(-n // round_size) * round_size and audit.coverage == 1.0
    assert sum(c - 1 for c in audit.duplicates.values()) == slots - n < round_size
    # what accelerate's gather_for_metrics returns: every sample once, in order
    kept = kept_by_gather_for_metrics(shards, batch, n)
    assert kept == list(range(n))


def test_even_batch_shards_match_accelerate():
    # accelerate 1.15.0: BatchSamplerShard(BatchSampler(SequentialSampler(range(33)), 8, False),
    # 4, r, even_batches=True) yields these (read off the library when this test was written)
    shards = even_batch_shards(33, 8, 4)
    assert shards[0] == list(range(8)) + [32] + list(range(7))
    assert shards[3] == list(range(24, 32)) + list(range(23, 31))
    with pytest.raises(ValueError, match="batch_size"):
        even_batch_shards(10, 0, 2)
