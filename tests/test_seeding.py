import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from utils.seeding import derive_seed, loader_seed_kwargs, sample_generator, seed_everything, seed_worker


def test_derive_seed_is_deterministic_and_mixes():
    assert derive_seed(1, 0) == derive_seed(1, 0)
    assert derive_seed(1, 0) != derive_seed(0, 1)
    assert all(0 <= derive_seed(s, r) < 2**63 for s in range(5) for r in range(5))
    assert len({derive_seed(0, r) for r in range(1000)}) == 1000


@pytest.mark.parametrize("keys, error", [((), ValueError), ((-1,), ValueError), ((1.5,), TypeError)])
def test_derive_seed_rejects_bad_keys(keys, error):
    with pytest.raises(error):
        derive_seed(*keys)


def test_seed_everything_reproduces_and_differs_per_rank():
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    seed_everything(7, rank=0)
    a = draws()
    seed_everything(7, rank=0)
    assert draws() == a
    seed_everything(7, rank=1)
    assert all(x != y for x, y in zip(draws(), a))
    with pytest.raises(ValueError, match="rank=-1"):
        seed_everything(7, rank=-1)


class CopiedRng(Dataset):
    """A data set that makes the classic mistake: one NumPy Generator built in __init__."""

    def __init__(self, n=32):
        self.n = n
        self.rng = np.random.default_rng(0)

    def reseed(self, seed):
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.rng.random()


def _draws(loader):
    return torch.cat([b for b in loader]).tolist()


def test_seed_worker_reseeds_the_datasets_own_rng():
    ds = CopiedRng()
    plain = _draws(DataLoader(ds, batch_size=4, num_workers=2))
    assert len(set(plain)) == 16  # two workers, identical copies: every draw appears twice
    fixed = _draws(DataLoader(ds, batch_size=4, num_workers=2, **loader_seed_kwargs(0)))
    assert len(set(fixed)) == 32


def test_loader_seed_kwargs_reproduce_and_differ_per_rank():
    ds = CopiedRng()
    run = lambda rank: _draws(DataLoader(ds, batch_size=4, num_workers=2, shuffle=True, **loader_seed_kwargs(3, rank)))
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_sample_generator_is_keyed():
    draw = lambda *k: torch.rand(3, generator=sample_generator(*k)).tolist()
    assert draw(0, 1, 5) == draw(0, 1, 5)
    assert draw(0, 1, 5) != draw(0, 2, 5) != draw(0, 1, 6)


def test_seed_worker_outside_a_worker_changes_nothing():
    np.random.seed(5)
    random.seed(5)
    seed_worker(0)  # no worker info: nothing to re-seed
    after = random.random(), float(np.random.rand())
    np.random.seed(5)
    random.seed(5)
    assert after == (random.random(), float(np.random.rand()))


class GlobalDraws(Dataset):
    """What a worker's random, NumPy and torch global generators draw first."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seed_worker_keeps_torchs_per_worker_seeding_of_random_and_numpy():
    def draws(**kwargs):
        loader = DataLoader(GlobalDraws(), batch_size=None, num_workers=2,
                            generator=torch.Generator().manual_seed(0), **kwargs)
        return list(loader)

    assert draws(worker_init_fn=seed_worker) == draws()
