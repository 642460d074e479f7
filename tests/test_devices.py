"""Collectives put their tensors on the process group's device (nccl: the current GPU; gloo: the CPU).

CUDA itself is exercised by `make gpu-check`; here the wiring is checked on the CPU: the helper's
answer for every kind of group, and that each collective in utils uses it (the `meta` device
stands in for a GPU, so a tensor left on the CPU shows up as a device mismatch)."""

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import utils.metrics as metrics
from utils.ddp import SyncBatchNorm, _Bucket
from utils.devices import collective_device, group_device_types
from utils.launch import run_distributed


def test_no_process_group_means_cpu():
    assert collective_device() == torch.device("cpu")


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:gloo"])
def test_a_group_that_supports_the_cpu_uses_the_cpu(backend):
    def probe(backend):
        group = dist.new_group(backend=backend)
        return str(collective_device()), str(collective_device(group)), group_device_types(group)

    default, sub, types_ = run_distributed(probe, 2, backend)[0]
    assert default == sub == "cpu" and "cpu" in types_


def test_an_accelerator_only_group_uses_this_ranks_current_device(monkeypatch):
    nccl_like = types.SimpleNamespace(_device_types=[torch.device("cuda")])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # as after torch.cuda.set_device(3)
    assert collective_device(nccl_like) == torch.device("cuda", 3)
    mixed = types.SimpleNamespace(_device_types=[torch.device("cuda"), torch.device("cpu")])
    assert collective_device(mixed) == torch.device("cpu")


class Seen(Exception):
    pass


@pytest.fixture
def fake_group_on_meta(monkeypatch):
    """A 'process group' of 2 whose collective device is `meta`; a collective reports its tensor's device."""
    def record(tensor_or_list, *args, **kwargs):
        tensor = tensor_or_list if isinstance(tensor_or_list, torch.Tensor) else args[0]
        raise Seen(tensor.device.type)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", record)
    monkeypatch.setattr(dist, "all_gather", record)
    monkeypatch.setattr(metrics, "collective_device", lambda group=None: torch.device("meta"))


def test_sum_over_ranks_and_gather_by_index_use_the_collective_device(fake_group_on_meta):
    with pytest.raises(Seen, match="meta"):
        metrics.sum_over_ranks(3, 4)
    with pytest.raises(Seen, match="meta"):
        metrics.gather_by_index(torch.arange(3), torch.ones(3), 3)


def test_bucket_flags_live_with_the_gradients():
    params = [nn.Parameter(torch.empty(4, device="meta")), nn.Parameter(torch.empty(2, device="meta"))]
    params[0].grad = torch.empty(4, device="meta")  # the second produced no gradient on this rank
    bucket = _Bucket(params)
    bucket.pack()  # on main: torch.cat of meta gradients and CPU flags fails
    assert bucket.buffer.device.type == "meta" and bucket.buffer.shape == (4 + 2 + 2,)


def test_sync_batchnorm_statistics_live_with_the_input(monkeypatch):
    """Every tensor SyncBatchNorm sends to a collective is on the input's device (meta
    stands in for CUDA): before the fix its count was made on the CPU."""
    sent = []
    def all_gather(parts, tensor, *a, **k):
        sent.append(tensor.device.type)
        for part in parts:
            part.copy_(tensor)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    bn = SyncBatchNorm(3).to("meta")
    n, mean, m2 = bn._global_moments(torch.empty(4, 3, 2, 2, device="meta"), [0, 2, 3])
    assert sent == ["meta"] and {n.device.type, mean.device.type, m2.device.type} == {"meta"}


def test_a_cuda_only_group_refuses_cpu_tensors_as_nccl_does():
    """gloo registered for CUDA only: the same refusal as nccl's, reproducible without a GPU."""
    def probe():
        group = dist.new_group(backend="cuda:gloo")
        try:
            dist.all_reduce(torch.ones(1), group=group)
            return group_device_types(group), "accepted"
        except RuntimeError as exc:
            return group_device_types(group), str(exc).splitlines()[0]

    assert run_distributed(probe, 2) == [(["cuda"], "No backend type associated with device type cpu")] * 2
