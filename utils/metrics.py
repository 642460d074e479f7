"""Exact distributed evaluation: every sample counted once, whatever the world size.

``DistributedSampler`` pads the evaluation set to a multiple of the world size, so a metric averaged
over ranks counts up to ``world_size - 1`` samples twice. The exact recipe used by the book:

    sampler = EvalShardSampler(test_set)               # uneven shards, no padding
    ... each rank: correct, count over its shard (no collective inside the loop) ...
    correct, count = sum_over_ranks(correct, count)    # one all-reduce at the end
    accuracy = correct / count

``gather_by_index`` is the alternative when the shards are padded (the padded copies are dropped by
index), e.g. when every rank must run the same number of steps.
"""

from __future__ import annotations

from typing import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ._checks import check_int
from .devices import collective_device
from .samplers import resolve_world

__all__ = ["EvalShardSampler", "sum_over_ranks", "gather_by_index"]


class EvalShardSampler(Sampler[int]):
    """Rank ``r`` gets indices ``r, r + R, r + 2R, ... < n``: no padding, no shuffling.

    Shards differ in length by at most one, so ranks run different numbers of steps: safe only when
    the evaluation loop has no collective (no DDP forward with gradients enabled, no per-step
    all-reduce).
    """

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None, rank: int | None = None) -> None:
        self.dataset_len = check_int("dataset_len", dataset if isinstance(dataset, int) else len(dataset), minimum=0)
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_len, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_len, self.num_replicas))


def sum_over_ranks(*values: float) -> tuple[float, ...]:
    """Sum each value over all ranks with one all-reduce (float64, so counts stay exact).

    The tensor lives on :func:`~utils.devices.collective_device`: the CPU for ``gloo``, this
    rank's current GPU for ``nccl``.
    """
    if not values:
        raise ValueError("sum_over_ranks needs at least one value")
    totals = torch.tensor([float(v) for v in values], dtype=torch.float64, device=collective_device())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    return tuple(totals.tolist())


def gather_by_index(indices: torch.Tensor, values: torch.Tensor, dataset_len: int) -> torch.Tensor:
    """Collect ``values[i]`` for sample ``indices[i]`` from every rank; return one value per sample, in index order.

    Duplicated indices (the padding of ``DistributedSampler``) keep one copy. Every rank gets the
    full result, on the device ``values`` came on. Raises if some index in ``range(dataset_len)`` was
    evaluated by no rank.
    """
    dataset_len = check_int("dataset_len", dataset_len, minimum=0)
    values = torch.as_tensor(values)
    home = values.device
    indices = torch.as_tensor(indices, dtype=torch.int64, device=home).reshape(-1)
    if len(values) != len(indices):
        raise ValueError(f"indices and values differ in length: {len(indices)} != {len(values)}")
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        device = collective_device()  # nccl moves CUDA tensors only, gloo CPU tensors only
        indices, values = indices.to(device), values.to(device)
        length = torch.tensor([len(indices)], device=device)
        lengths = [torch.zeros_like(length) for _ in range(world)]
        dist.all_gather(lengths, length)
        longest = int(max(lengths))
        # all_gather needs equal shapes: pad with index -1 and drop it after gathering
        pad = longest - len(indices)
        padded_idx = torch.cat([indices, indices.new_full((pad,), -1)])
        padded_val = torch.cat([values, values.new_zeros((pad,) + tuple(values.shape[1:]))])
        all_idx = [torch.empty_like(padded_idx) for _ in range(world)]
        all_val = [torch.empty_like(padded_val) for _ in range(world)]
        dist.all_gather(all_idx, padded_idx)
        dist.all_gather(all_val, padded_val)
        indices, values = torch.cat(all_idx), torch.cat(all_val)
        keep = indices >= 0
        indices, values = indices[keep].to(home), values[keep].to(home)
    if len(indices) and (indices.min() < 0 or indices.max() >= dataset_len):
        raise ValueError(f"an index is out of range for dataset_len={dataset_len}")
    result = values.new_zeros((dataset_len,) + tuple(values.shape[1:]))
    seen = torch.zeros(dataset_len, dtype=torch.bool, device=home)
    result[indices] = values  # duplicates write the same sample's value again
    seen[indices] = True
    if not bool(seen.all()):
        missing = torch.nonzero(~seen).reshape(-1)[:10].tolist()
        raise ValueError(f"{int((~seen).sum())} samples were evaluated by no rank, e.g. {missing}")
    return result
