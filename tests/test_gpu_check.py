"""`make gpu-check`: its collective checks are real (they pass on CPU ranks with gloo, and fail when
the thing they check is broken); without CUDA it says so, writes nothing and exits 0."""

import pytest
import torch

import utils.metrics
from utils.gpu_check import collective_checks, main
from utils.launch import run_distributed


def test_the_collective_checks_pass_on_cpu_ranks_with_gloo():
    per_rank = run_distributed(collective_checks, 3, "cpu")
    assert per_rank == [{"sum_over_ranks": True, "gather_by_index": True, "NaiveDDP": True,
                         "BucketedDDP": True, "SyncBatchNorm": True}] * 3


def test_the_collective_checks_catch_a_broken_sum():
    def broken(device_type):
        dist = utils.metrics.dist
        real = dist.all_reduce

        def all_reduce_except_float64(tensor, *args, **kwargs):  # sum_over_ranks's tensor is float64
            return None if tensor.dtype == torch.float64 else real(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce_except_float64
        return collective_checks(device_type)

    assert [r["sum_over_ranks"] for r in run_distributed(broken, 2, "cpu")] == [False, False]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for machines without CUDA")
def test_without_cuda_it_says_so_and_exits_0(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert "torch.cuda.is_available() is False" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
