"""Data and Training: the loaders, and what a checkpoint holds.

``Data``: the data sets and their loaders; ``Training``: the model, the optimizer, the
schedule and where the run stands.

Their fields' types come from the modules below (``augment``, ``checkpoints``,
``shards``), none of which imports this one: the functions there take plain values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..gpu_loader import GPULoader
from ..metrics import sum_over_ranks
from .augment import KeyedAugment
from .checkpoints import EpochSampler
from .shards import EpochBatches, ShardStream


@dataclass
class Data:
    """The data sets and their loaders."""
    train_set: KeyedAugment | ShardStream
    test_set: KeyedAugment
    synthetic: bool
    steps_per_epoch: int
    loader: str  # "gpu", "workers" or "webdataset" (--data-format)
    why: str  # why that loader (choose_loader, open_shards)
    train_loader: GPULoader | DataLoader | EpochBatches
    sampler: EpochSampler | None  # the workers loader's
    test_loader: DataLoader

    def set_epoch(self, epoch: int, step_in_epoch: int, batch_size: int) -> None:
        """Start the training loader at step ``step_in_epoch`` of ``epoch``."""
        if self.loader == "gpu":
            self.train_loader.set_epoch(epoch, start_batch=step_in_epoch)
        elif self.loader == "webdataset":
            self.train_set.set_epoch(epoch, step_in_epoch)
        else:
            self.sampler.set_epoch(epoch, start=step_in_epoch * batch_size,
                                   stop=self.steps_per_epoch * batch_size)


@dataclass
class Training:
    """What a checkpoint holds: the unwrapped model, the optimizer, the schedule and
    where the run stands; and where the checkpoint goes."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    path: str
    config: dict  # run_config: what a resumed run must repeat
    epoch: int = 0
    step_in_epoch: int = 0
    step: int = 0  # over all epochs
    scaler: object = None  # --amp fp16's GradScaler (disabled otherwise)
    # the epoch's loss so far: before this process started (from the checkpoint: the
    # sum of the global batches' mean losses, and their number), and this rank's since
    loss_before: float = 0.0
    steps_before: int = 0
    loss_sum: torch.Tensor | None = None  # on the device
    steps_run: int = 0
    saved_step: int | None = None  # the step of the checkpoint at ``path``
    stop_signal: int = 0  # the signal the ranks agreed to stop on (0: none)
    failed: str | None = None  # why the run did not learn (recipe.did_not_learn)
    # reseed before every step (None: not known before this process's first step, which
    # reseeds and looks whether anything drew random numbers)
    reseed: bool | None = None
    stepped: bool = False  # this process has done a step: short timeouts from then on

    def epoch_loss(self, world_size: int) -> tuple[float, int]:
        """``(sum of the global batches' mean losses, their number)`` for the epoch so
        far, on every rank (a collective)."""
        mine = 0.0 if self.loss_sum is None else float(self.loss_sum)
        (total,) = sum_over_ranks(mine)
        return (self.loss_before + total / world_size,
                self.steps_before + self.steps_run)

