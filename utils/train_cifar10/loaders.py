"""Hardening step 4: the training loader, GPU or workers.

Which training loader (``choose_loader``), DataLoader workers that a scheduler's signal
leaves alone, and the loader itself (the GPU loader, or a DataLoader over an
``EpochSampler``, or over WebDataset shards: ``shards``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..devices import collective_device
from ..gpu_loader import GPULoader
from ..metrics import EvalShardSampler
from ..workers import ignore_stop_signals, worker_context
from .augment import KeyedAugment
from .checkpoints import EpochSampler
from .shards import EpochBatches, ShardStream, stream_loader

if TYPE_CHECKING:
    from .job import Job


EVAL_BATCH = 512  # test images a batch: no gradients, so larger than training's
FIT_FRACTION = 0.25  # of the free GPU memory: the rest is for the model and its work


def choose_loader(choice: str, device: torch.device, nbytes: int,
                  free_bytes: int | None) -> tuple[str, str]:
    """``(loader, why)``: ``"gpu"`` or ``"workers"`` for ``--loader choice``.

    ``nbytes``: what the GPU loader keeps on the device (``resident_bytes``);
    ``free_bytes``: this GPU's free memory (``None`` on the CPU). ``auto`` takes
    ``gpu`` with CUDA when the set takes at most ``FIT_FRACTION`` of the free memory,
    leaving the rest to the model, its activations and the workspace of its kernels.
    ``gpu`` on a GPU too small for the set is refused.
    """
    size = f"the training set's {nbytes / 2**30:.2f} GiB"
    if choice == "workers":
        return "workers", "--loader workers"
    if device.type != "cuda":
        if choice == "gpu":
            return "gpu", "--loader gpu, on the CPU: the same tensor code"
        return "workers", "--loader auto without CUDA"
    free = f"{free_bytes / 2**30:.2f} GiB free on {device}"
    if choice == "gpu":
        if nbytes > free_bytes:
            raise SystemExit(f"error: --loader gpu: {size} do not fit in the {free}; "
                             f"use --loader workers")
        return "gpu", f"--loader gpu: {size}, {free}"
    if nbytes <= FIT_FRACTION * free_bytes:
        return "gpu", f"--loader auto: {size} <= 1/4 of the {free}"
    return "workers", f"--loader auto: {size} > 1/4 of the {free}"


def agreed_free_memory(device: torch.device, ddp: bool) -> int | None:
    """The least free memory of any rank's GPU (``None`` on the CPU), so that every
    rank makes the same ``--loader auto`` choice."""
    if device.type != "cuda":
        return None
    free = torch.tensor(torch.cuda.mem_get_info(device)[0], dtype=torch.int64,
                        device=collective_device() if ddp else "cpu")
    if ddp:
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return int(free)


def batch_dtype(args) -> torch.dtype:
    """The GPU loader's batches: in the autocast dtype with ``--amp`` (autocast would
    round the float32 images to it before the first convolution: the same values,
    one pass fewer), else float32."""
    return {None: torch.float32, "bf16": torch.bfloat16,
            "fp16": torch.float16}[args.amp]


def eval_workers(workers: int) -> int:
    """DataLoader workers of the test loader: at most 2 (a small set), persistent like
    the training ones.

    They sit idle while the training workers run, but they are processes: a node runs
    ``processes per node x (1 + workers + eval_workers(workers))`` of them (chapter 13's
    CPU budget).
    """
    return min(workers, 2)


def worker_start(workers: int):
    """How DataLoader workers start: never by a fork of this process, which has gloo's
    (or NCCL's) threads from ``init_process_group`` on (``utils.workers``), but from a
    fork server with torch imported, in a process group of its own so that a signal for
    the rank's group leaves it alone (``shield_worker``). ``None`` without workers.

    Nothing of this package in the preload: a worker imports the package (whose
    ``__init__`` imports every module) when it unpickles ``KeyedAugment`` and
    ``shield_worker``, and does not run the package's ``__main__`` again (under
    ``python -m`` and ``torchrun -m`` the main module's name ends with ``.__main__``,
    which multiprocessing does not import in its children).
    """
    return worker_context(detach=True) if workers > 0 else None


def shield_worker(worker_id: int) -> None:
    """A DataLoader worker leaves the signals to its rank (``Preemption``).

    torchrun's agent passes a signal on to each rank's whole process group, and SLURM
    sends its signals to every process of a job step, workers included; a worker killed
    by one makes its rank fail before the checkpoint ("DataLoader worker ... exited
    unexpectedly"). In a process group of its own and ignoring SIGTERM, SIGINT and
    SIGUSR1 (``utils._detach``: its fork server ignores them before it forks, and
    torch's worker loop puts its own SIGTERM handler back before this runs), the worker
    goes on until its rank stops it, or its ``WatchParent`` sees the rank gone."""
    if hasattr(os, "setpgrp"):  # not on Windows
        os.setpgrp()
    ignore_stop_signals()


def make_test_loader(args, job: Job, test_set: KeyedAugment, loader: str,
                     loader_kwargs: dict) -> DataLoader | list:
    """This rank's share of the test set (``EvalShardSampler``'s: uneven, no padding) in
    batches of ``EVAL_BATCH``. With the GPU loader it is held on the device, normalised
    once as ``KeyedAugment`` normalises it (float32, the same operations: the same
    values), and each batch is a slice of it: no copy and no kernel per batch (10,000
    test images: 123 MB over all ranks). Else a DataLoader (``eval_workers``)."""
    sampler = EvalShardSampler(test_set, job.world_size, job.rank)
    if loader != "gpu":
        return DataLoader(test_set, batch_size=EVAL_BATCH, sampler=sampler,
                          **{**loader_kwargs,
                             "num_workers": eval_workers(args.workers)})
    mine = list(sampler)
    x = torch.from_numpy(test_set.data[mine]).to(job.device).permute(0, 3, 1, 2)
    mean, std = (t.view(1, -1, 1, 1).to(job.device)
                 for t in (test_set.mean, test_set.std))
    # 255 as a tensor on the device: CUDA multiplies by the reciprocal of a Python
    # number (one bit off, for some values), and divides by a tensor
    full = torch.full((1, 1, 1, 1), 255.0, device=job.device)
    x = x.float().div_(full).sub_(mean).div_(std).contiguous(
        memory_format=job.memory_format)
    y = torch.tensor([test_set.targets[i] for i in mine], device=job.device)
    return [(x[i:i + EVAL_BATCH], y[i:i + EVAL_BATCH])
            for i in range(0, len(mine), EVAL_BATCH)]


def make_train_loader(args, job: Job, train_set: KeyedAugment | ShardStream,
                      loader: str, loader_kwargs: dict
                      ) -> tuple[GPULoader | DataLoader | EpochBatches,
                                 EpochSampler | None]:
    """``(train_loader, sampler)``: the GPU loader (no sampler), a DataLoader over an
    ``EpochSampler``, or with ``--data-format webdataset`` one over the shards, cut to
    the steps every rank runs (``shards``: no sampler)."""
    if loader == "webdataset":
        return stream_loader(train_set, job, loader_kwargs), None
    if loader == "gpu":
        # ShardSampler's order cut to whole global batches, as EpochSampler's
        return GPULoader(train_set.data, train_set.targets, job.batch_size,
                         num_replicas=job.world_size, rank=job.rank, seed=args.seed,
                         drop_last=True, drop_last_batch=True,
                         channels_last=job.channels_last, device=job.device,
                         dtype=batch_dtype(args), compile=args.compile), None
    sampler = EpochSampler(train_set, job.world_size, job.rank, shuffle=True,
                           seed=args.seed)
    return DataLoader(train_set, batch_size=job.batch_size, sampler=sampler,
                      drop_last=True, **loader_kwargs), sampler
