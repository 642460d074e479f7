"""How well a shuffle buffer shuffles a stream of shards, measured on the libraries' own
shuffles (chapter 16).

A stream cannot jump: it reads shards one after the other, and shuffles with a buffer of
``k`` samples, from which each sample it yields is drawn. The orders measured here are
those the libraries produce over ``n`` indices in ``shards`` shards of consecutive
indices (``utils.streams.shard_bounds``), without reading any data:

- ``"webdataset"``: WebDataset's own stages in a ``DataPipeline``: the shard list,
  ``detshuffle(100)`` of the shard order (what ``WebDataset(shardshuffle=100,
  detshuffle=True)`` adds) when ``shard_shuffle``, and ``shuffle(k)``, its buffer;
- ``"datasets"``: Hugging Face ``IterableDataset.from_generator`` over the same
  shards, then ``shuffle(seed, buffer_size=k)``, which always shuffles the shard order
  too;
- ``"torch.randperm"``: the map-style shuffle a sampler draws, for reference.

The statistics are computed the same way for every kind, one row per seed:
``position_correlation`` (where an index comes out against where it was stored: 1.0
for no shuffle, about 0 for a permutation), ``shards_per_batch`` (how many shards a
batch mixes) and ``neighbours`` (``utils.shuffle_quality``'s count of adjacent positions
holding adjacent indices).
"""

from __future__ import annotations

import numpy as np

from ._checks import check_int
from .shuffle_quality import neighbours
from .streams import shard_bounds

__all__ = ["BUFFER_KINDS", "buffer_orders", "position_correlation",
           "shards_per_batch", "buffer_table"]

BUFFER_KINDS = ("webdataset", "datasets", "torch.randperm")


def _expand(bounds):
    def stage(src):
        for shard in src:
            yield from range(*bounds[int(shard["url"])])
    return stage


def _webdataset_order(bounds, k: int, seed: int, shard_shuffle: bool) -> list[int]:
    import webdataset as wds

    stages = [wds.SimpleShardList([str(s) for s in range(len(bounds))])]
    if shard_shuffle:
        stages.append(wds.detshuffle(100, seed=seed))
    stages.append(_expand(bounds))
    if k:
        stages.append(wds.shuffle(k, seed=seed))
    return list(wds.DataPipeline(*stages))


def _shard_rows(shards, bounds):
    for s in shards:
        for i in range(*bounds[s]):
            yield {"index": i}


def _datasets_order(bounds, k: int, seed: int) -> list[int]:
    import datasets

    ds = datasets.IterableDataset.from_generator(
        _shard_rows, gen_kwargs={"shards": list(range(len(bounds))),
                                     "bounds": tuple(bounds)})  # a list would be split
    if k:
        ds = ds.shuffle(seed=seed, buffer_size=k)
    return [row["index"] for row in ds]


def buffer_orders(kind: str, n: int, shards: int, k: int, seeds,
                  shard_shuffle: bool = True) -> np.ndarray:
    """One order of ``[0, n)`` per seed, as ``kind`` (one of ``BUFFER_KINDS``) yields
    it from ``shards`` shards with a buffer of ``k`` samples (0: none).
    ``shard_shuffle=False`` is WebDataset only (``datasets`` always shuffles the
    shard order with its buffer)."""
    n = check_int("n", n, minimum=1)
    k = check_int("k", k, minimum=0)
    bounds = shard_bounds(n, shards)
    rows = []
    for seed in seeds:
        if kind == "webdataset":
            rows.append(_webdataset_order(bounds, k, seed, shard_shuffle))
        elif kind == "datasets":
            if not shard_shuffle and k:
                raise ValueError("datasets' shuffle() always shuffles the shard order; "
                                 "shard_shuffle=False is for webdataset only")
            rows.append(_datasets_order(bounds, k, seed))
        elif kind == "torch.randperm":
            import torch

            g = torch.Generator().manual_seed(seed)
            rows.append(torch.randperm(n, generator=g).tolist())
        else:
            raise ValueError(f"kind must be one of {BUFFER_KINDS}, got {kind!r}")
    return np.asarray(rows, dtype=np.int64)


def position_correlation(rows: np.ndarray) -> float:
    """Mean, over rows, of the correlation between an index and the position it comes
    out at (1.0: stored order; about 0: a permutation)."""
    positions = np.arange(rows.shape[1])
    return float(np.mean([np.corrcoef(positions, row)[0, 1] for row in rows]))


def shards_per_batch(rows: np.ndarray, n: int, shards: int, batch: int) -> float:
    """Mean count of distinct shards among each batch of ``batch`` consecutive
    samples."""
    shard_of = np.empty(n, dtype=np.int64)
    for s, (first, stop) in enumerate(shard_bounds(n, shards)):
        shard_of[first:stop] = s
    usable = rows.shape[1] // batch * batch
    batches = shard_of[rows[:, :usable]].reshape(rows.shape[0], -1, batch)
    return float(np.mean([len(np.unique(b)) for row in batches for b in row]))


def buffer_table(n: int = 10_000, shards: int = 100, ks=(0, 100, 1000, 5000),
                 seeds=range(5), batch: int = 64) -> list[dict]:
    """One row per (kind, shard shuffle, k): the three statistics over ``seeds``."""
    cases = [("torch.randperm", False, 0)]
    cases += [("webdataset", False, k) for k in ks]
    cases += [("webdataset", True, k) for k in ks]
    cases += [("datasets", True, k) for k in ks if k]
    table = []
    for kind, shard_shuffle, k in cases:
        rows = buffer_orders(kind, n, shards, k, seeds, shard_shuffle)
        assert all(np.array_equal(np.sort(r), np.arange(n)) for r in rows)
        table.append({"kind": kind, "shard shuffle": shard_shuffle, "k": k,
                      "position r": position_correlation(rows),
                      "shards per batch": shards_per_batch(rows, n, shards, batch),
                      "neighbours": float(np.mean(neighbours(rows)))})
    return table
