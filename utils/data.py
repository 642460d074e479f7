"""Data sets used by the chapters.

``Simple`` is the toy data set of the seed notebook on ``DistributedSampler``: sample ``i`` is the
vector ``[i + 1] * n`` with a 0/1 label, so that printing a batch shows which indices it holds.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

from ._checks import check_int

__all__ = ["Simple"]


class Simple(Dataset):
    """Toy map-style data set: sample ``i`` is ``np.full(n, i + 1)``, its label is 0 or 1.

    The labels are drawn once, from ``numpy.random.default_rng(seed)`` with P(label=1) = 0.3,
    so every process that builds ``Simple(m, n, seed)`` sees the same labels. (The seed notebook
    draws them from NumPy's unseeded global RNG, so its two ranks disagree on the label of the
    same sample.)
    """

    def __init__(self, m: int = 100, n: int = 3, seed: int = 0):
        self.m = check_int("m", m, minimum=0)
        self.n = check_int("n", n, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self._x = np.repeat(np.arange(1, self.m + 1, dtype=np.int64)[:, None], self.n, axis=1)
        self._y = np.random.default_rng(self.seed).choice([0, 1], size=self.m, p=[0.7, 0.3])

    @property
    def labels(self) -> np.ndarray:
        """All labels, without loading any sample (samplers that need labels read this)."""
        return self._y

    def __len__(self) -> int:
        return self.m

    def __getitem__(self, idx: int):
        if isinstance(idx, bool) or not isinstance(idx, (int, np.integer)):
            raise TypeError(f"index must be an integer, got {idx!r}")
        if not -self.m <= idx < self.m:
            raise IndexError(f"index {idx} is out of range for Simple(m={self.m})")
        return self._x[idx], self._y[idx]

    def __repr__(self) -> str:
        return f"Simple(m={self.m}, n={self.n}, seed={self.seed})"
