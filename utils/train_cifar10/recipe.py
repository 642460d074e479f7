"""The model and the training recipe of chapter 11.

``SimpleCNN`` and the CIFAR ResNet-18, the global batch split over the processes, and
the one-cycle learning rate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SimpleCNN(nn.Module):
    """The seed tutorial's network: two conv layers and two linear ones."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


# The peak learning rate of each model per 256 images: the linear rule's reference point
# (chapter 11), which --lr's default scales to --global-batch. ResNet-18 has BatchNorm
# and takes the usual 0.1; SimpleCNN has none, and at 0.1 some runs diverged (issue 43):
# it takes 0.05.
BASE_LR = {"simplecnn": 0.05, "resnet18": 0.1}
CHANCE = 0.1  # ten classes
# a run of at least this many optimizer steps whose last epoch scores below twice chance
# did not learn; shorter runs are not judged (a healthy 2-epoch CPU run may end there)
JUDGED_FROM_STEPS = 100


def linear_rule_lr(model: str, global_batch: int) -> float:
    """The peak learning rate for ``global_batch``: the model's rate per 256 images,
    scaled linearly."""
    return BASE_LR[model] * global_batch / 256


def did_not_learn(loss: float, accuracy: float, last_epoch: bool,
                  steps: int) -> str | None:
    """Why a run failed to learn, or ``None``: a training loss that is not finite (at
    any epoch), or a last epoch's test accuracy below twice chance after at least
    ``JUDGED_FROM_STEPS`` optimizer steps."""
    import math

    if math.isfinite(loss) and not (last_epoch and steps >= JUDGED_FROM_STEPS
                                    and accuracy < 2 * CHANCE):
        return None
    return (f"failed: the run did not learn (loss {loss:.4f}, accuracy {accuracy:.4f})"
            f": lower --lr or more --epochs")


def make_model(name: str) -> nn.Module:
    if name == "simplecnn":
        return SimpleCNN()
    from torchvision.models import resnet18

    # CIFAR stem: 3x3 convolution, no max-pool, for 32x32 images
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    # same function; its backward has no atomics, so it is deterministic
    model.avgpool = GlobalAvgPool()
    return model


class GlobalAvgPool(nn.Module):
    """``AdaptiveAvgPool2d(1)`` as a mean: CUDA has no deterministic kernel for the
    former's backward."""

    def forward(self, x):
        return x.mean((2, 3), keepdim=True)


def per_process_batch(global_batch: int, world_size: int) -> int:
    """The batch of one process: the global batch split evenly, or an error that lists
    the numbers of processes it splits over."""
    if global_batch % world_size:
        counts = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        listed = ", ".join(map(str, counts[:-1])) + f" or {counts[-1]}"
        below = global_batch // world_size * world_size
        nearest = f"{below} or {below + world_size}" if below else f"{world_size}"
        raise SystemExit(f"error: --global-batch {global_batch} does not split evenly "
                         f"over {world_size} processes; it splits over {listed} "
                         f"processes. Run on one of those, or (a new run, not a "
                         f"resumed one) take a multiple of {world_size}, "
                         f"e.g. {nearest}")
    return global_batch // world_size


def one_cycle(optimizer: torch.optim.Optimizer, peak_lr: float, total_steps: int):
    """The schedule: warm-up from ``peak_lr / 25`` to ``peak_lr`` over the first
    quarter, then down to ~0.

    ``--lr`` is the peak for ``--global-batch``, whatever the number of processes
    (chapter 11). cycle_momentum=False: OneCycleLR would otherwise overwrite --momentum
    with its own 0.85-0.95 cycle. A run of fewer than 8 steps warms up over 2 of them
    (a quarter of 4 steps would be a warm-up of none, and OneCycleLR divides by it).
    """
    if total_steps < 3:
        raise SystemExit(f"error: {total_steps} optimizer step(s) in all (--epochs x "
                         f"training images // --global-batch); the one-cycle schedule "
                         f"needs at least 3: more --epochs or a smaller --global-batch")
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak_lr,
                                               total_steps=total_steps,
                                               pct_start=max(0.25, 2 / total_steps),
                                               cycle_momentum=False)
