import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from utils.data import Simple


def test_sample_i_is_i_plus_one_repeated():
    ds = Simple(m=10, n=4)
    assert len(ds) == 10
    for i in range(10):
        x, y = ds[i]
        assert x.tolist() == [i + 1] * 4
        assert y in (0, 1)


def test_labels_are_seeded_and_shared_between_instances():
    a, b, c = Simple(m=200, seed=3), Simple(m=200, seed=3), Simple(m=200, seed=4)
    assert np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.labels, c.labels)
    # about 30 % ones, as in the seed notebook's p=[0.7, 0.3]
    assert 0.2 < Simple(m=5000).labels.mean() < 0.4


def test_default_collate_makes_tensors():
    x, y = next(iter(DataLoader(Simple(m=8), batch_size=4)))
    assert x.shape == (4, 3) and x.dtype == torch.int64
    assert x[:, 0].tolist() == [1, 2, 3, 4]
    assert y.shape == (4,)


def test_empty_dataset_is_allowed():
    assert len(Simple(m=0)) == 0


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"m": -1}, ValueError, "m=-1"),
        ({"n": 0}, ValueError, "n=0"),
        ({"m": 2.5}, TypeError, "m must be an integer"),
        ({"seed": -3}, ValueError, "seed=-3"),
    ],
)
def test_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text):
        Simple(**kwargs)


def test_bad_index():
    ds = Simple(m=3)
    with pytest.raises(IndexError, match="out of range"):
        ds[3]
    with pytest.raises(TypeError):
        ds["0"]


def test_tensor_and_numpy_indices():
    ds = Simple(m=5)
    assert ds[torch.tensor(2)][0].tolist() == [3, 3, 3]
    assert ds[np.int64(4)][0].tolist() == [5, 5, 5]
    assert sorted(int(x[0]) for x, _ in (ds[i] for i in torch.randperm(5))) == [1, 2, 3, 4, 5]
