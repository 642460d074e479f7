"""Job: this process's rank, device and batch.

``steps.set_up_job`` makes it; ``shards``, ``loaders`` and ``steps`` take it, and this
module imports none of them: the package's imports go one way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .preemption import Preemption


@dataclass
class Job:
    """This process's place in the run (``setup_distributed``'s answer), and what
    follows from it."""
    ddp: bool
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    batch_size: int  # this process's share of --global-batch
    channels_last: bool
    control: object = None  # the group preemption flags go over (None: the default)
    preemption: Preemption | None = None  # its flag; None: never stop for a signal

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def master(self) -> bool:
        return self.rank == 0  # rank 0 alone logs and saves

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

