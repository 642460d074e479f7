import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from utils.audit import audit_shards
from utils.launch import run_distributed
from utils.metrics import EvalShardSampler, gather_by_index, sum_over_ranks


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
