"""Hardening step 1: augmentation keyed by (seed, epoch, index).

Every crop and flip is drawn from a generator keyed by ``(seed, epoch, index)``, so the
images a sample becomes do not depend on the worker, the rank or the restart that loads
it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..gpu_loader import CIFAR_MEAN, CIFAR_STD
from ..seeding import sample_generator


class KeyedAugment(Dataset):
    """Random crop (padding 4) and horizontal flip drawn from a generator keyed by
    (seed, epoch, index).

    Indices arrive as ``(epoch, index)`` pairs from ``EpochSampler``, so the same sample
    gets the same augmentation in a given epoch whichever worker, rank or restarted
    process loads it.
    """

    def __init__(self, base, seed: int, train: bool):
        # Keep the arrays, not torchvision's object: workers started with spawn (macOS,
        # Windows) receive this data set pickled, and a plain array pickles anywhere.
        self.data, self.targets = base.data, list(base.targets)
        self.seed, self.train = seed, train
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image = torch.from_numpy(self.data[index]).permute(2, 0, 1).float().div_(255)
        if self.train:
            g = sample_generator(self.seed, epoch, index)
            dy, dx = torch.randint(0, 9, (2,), generator=g).tolist()
            image = F.pad(image, (4, 4, 4, 4))[:, dy:dy + 32, dx:dx + 32]
            if torch.rand((), generator=g) < 0.5:
                image = image.flip(2)
        return (image - self.mean) / self.std, self.targets[index]
