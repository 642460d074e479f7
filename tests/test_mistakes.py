"""utils.mistakes: a hang reported as a fact, DETAIL checks in a rank, torch's mismatch error trimmed."""

import pytest
import torch
import torch.distributed as dist

from utils.audit import audit_shards
from utils.launch import run_distributed
from utils.mistakes import audit_summary, detail_group, hangs, mismatch_report


def _one_rank_waits():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))   # rank 1 never joins
    return dist.get_rank()


def _all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_hangs_reports_the_waiting_ranks_and_a_finished_run():
    assert hangs(_one_rank_waits, 2, timeout=3) == (True, [0])
    assert hangs(_all_reduce, 2, timeout=30) == (False, [])


def _shapes_differ():
    group = detail_group()
    try:
        dist.all_reduce(torch.ones(3 if dist.get_rank() == 0 else 1), group=group)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_detail_group_turns_a_shape_mismatch_into_an_error_on_every_rank():
    errors = run_distributed(_shapes_differ, 2)
    assert all("Detected mismatch between collectives" in e for e in errors)
    report = mismatch_report(errors[0])
    assert report.splitlines() == [
        "Detected mismatch between collectives on ranks.",
        "  rank 0: SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[3], TensorDtypes=Float",
        "  rank 1: SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float",
        "  differ in: Tensor Tensor shapes: 3vs 1",
    ]


def test_detail_group_refuses_an_unknown_level():
    with pytest.raises(ValueError, match="TORCH_DISTRIBUTED_DEBUG level"):
        detail_group("LOUD")


def test_mismatch_report_refuses_other_errors():
    with pytest.raises(ValueError, match="not a collective-mismatch error"):
        mismatch_report("Connection closed by peer")


def test_audit_summary_counts_and_truncates():
    padded = audit_shards([[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]], 10)
    assert audit_summary(padded) == (
        "per rank [3, 3, 3, 3] | never seen 0 | repeated 2: [0, 1] | partition: False")
    whole = audit_shards([list(range(16))] * 2, 16)
    assert audit_summary(whole) == ("per rank [16, 16] | never seen 0 | repeated 16: "
                                    "[0, 1, 2, 3, ...] | partition: False")
    assert audit_summary(audit_shards([[0, 2], [1]], 3)).endswith("partition: True")
