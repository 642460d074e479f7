"""utils.mistakes: DETAIL checks in a rank, torch's mismatch error trimmed."""

import pytest
import torch
import torch.distributed as dist

from utils.launch import run_distributed
from utils.mistakes import detail_group, mismatch_report


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

