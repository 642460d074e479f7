"""Exact distributed evaluation: every sample counted once, whatever the world size.

``DistributedSampler`` pads the evaluation set to a multiple of the world size, so a
metric averaged over ranks counts up to ``world_size - 1`` samples twice. The exact
recipe used by the book:

    sampler = EvalShardSampler(test_set)               # uneven shards, no padding
    ... each rank: correct, count over its shard (no collective inside the loop) ...
    correct, count = sum_over_ranks(correct, count)    # one all-reduce at the end
    accuracy = correct / count

``gather_by_index`` is the alternative when the shards are padded (the padded copies are
dropped by index), e.g. when every rank must run the same number of steps.
``even_batch_shards`` reproduces the padding of Hugging Face Accelerate's
``even_batches=True`` (whole batches, completed from the start of the data set), so a
chapter can count the duplicates it adds.
"""

from __future__ import annotations

import math
from typing import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ._checks import check_int
from .devices import collective_device
from .samplers import resolve_world

__all__ = ["EvalShardSampler", "sum_over_ranks", "gather_by_index", "even_batch_shards",
           "kept_by_gather_for_metrics"]


class EvalShardSampler(Sampler[int]):
    """Rank ``r`` gets indices ``r, r + R, r + 2R, ... < n``: no padding, no shuffling.

    Shards differ in length by at most one, so ranks run different numbers of steps:
    safe only when the evaluation loop has no collective (no DDP forward with gradients
    enabled, no per-step all-reduce).
    """

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None,
                 rank: int | None = None) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        self.dataset_len = check_int("dataset_len", n, minimum=0)
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_len, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_len, self.num_replicas))


def sum_over_ranks(*values: float) -> tuple[float, ...]:
    """Sum each value over all ranks with one all-reduce (float64: counts stay exact).

    The tensor lives on :func:`~utils.devices.collective_device`: the CPU for ``gloo``,
    this rank's current GPU for ``nccl``.
    """
    if not values:
        raise ValueError("sum_over_ranks needs at least one value")
    totals = torch.tensor([float(v) for v in values], dtype=torch.float64,
                          device=collective_device())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    return tuple(totals.tolist())


def gather_by_index(indices: torch.Tensor, values: torch.Tensor,
                    dataset_len: int) -> torch.Tensor:
    """Collect ``values[i]`` for sample ``indices[i]`` from every rank, in index order.

    Duplicated indices (the padding of ``DistributedSampler``) keep one copy. Every rank
    gets the full result, on the device ``values`` came on. Raises if some index in
    ``range(dataset_len)`` was evaluated by no rank.
    """
    dataset_len = check_int("dataset_len", dataset_len, minimum=0)
    values = torch.as_tensor(values)
    home = values.device
    indices = torch.as_tensor(indices, dtype=torch.int64, device=home).reshape(-1)
    if len(values) != len(indices):
        raise ValueError(f"indices and values differ in length: "
                         f"{len(indices)} != {len(values)}")
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        device = collective_device()  # nccl: CUDA tensors only, gloo: CPU tensors only
        indices, values = indices.to(device), values.to(device)
        length = torch.tensor([len(indices)], device=device)
        lengths = [torch.zeros_like(length) for _ in range(world)]
        dist.all_gather(lengths, length)
        longest = int(max(lengths))
        # all_gather needs equal shapes: pad with index -1 and drop it after gathering
        pad = longest - len(indices)
        padded_idx = torch.cat([indices, indices.new_full((pad,), -1)])
        filler = values.new_zeros((pad,) + tuple(values.shape[1:]))
        padded_val = torch.cat([values, filler])
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
        raise ValueError(f"{int((~seen).sum())} samples were evaluated by no rank, "
                         f"e.g. {missing}")
    return result


def even_batch_shards(dataset_len: int, batch_size: int,
                      num_replicas: int) -> list[list[int]]:
    """Each rank's indices when whole batches are dealt round robin, all of them full.

    Batch ``b`` goes to rank ``b % R``; the last round is completed from the start of
    the data set, so there are ``ceil(n / (B * R)) * B * R`` slots and slot ``p`` holds
    sample ``p % n``. This is what Accelerate's ``BatchSamplerShard(even_batches=True)``
    yields for an unshuffled loader (``_iter_with_no_split``): up to ``B * R - 1``
    repeats.
    """
    n = check_int("dataset_len", dataset_len, minimum=0)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    round_size = batch_size * num_replicas
    slots = math.ceil(n / round_size) * round_size
    batches = (torch.arange(slots) % max(n, 1)).reshape(-1, batch_size)
    return [batches[rank::num_replicas].reshape(-1).tolist()
            for rank in range(num_replicas)]


def kept_by_gather_for_metrics(shards: list[list[int]], batch_size: int,
                               dataset_len: int) -> list[int]:
    """The indices Accelerate's ``gather_for_metrics`` returns over one epoch.

    Each step's batches are gathered in rank order; on the last step the result is cut
    to its first ``dataset_len % (batch_size * R)`` items (``gather_for_metrics`` with
    the ``remainder`` of ``DataLoaderStateMixin.begin``), which drops the repeats that
    :func:`even_batch_shards` adds at the end.
    """
    world = len(shards)
    round_size = batch_size * world
    steps = len(shards[0]) // batch_size if shards else 0
    gathered = [i for step in range(steps) for rank in range(world)
                for i in shards[rank][step * batch_size:(step + 1) * batch_size]]
    remainder = dataset_len % round_size
    return gathered[:len(gathered) - round_size + remainder] if remainder else gathered
