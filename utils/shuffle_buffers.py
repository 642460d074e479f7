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

import contextlib
import os

import numpy as np

from ._checks import check_int
from .shuffle_quality import neighbours
from .streams import shard_bounds

__all__ = ["BUFFER_KINDS", "buffer_orders", "position_correlation",
           "shards_per_batch", "buffer_table", "reader_table", "OWNER_WAYS",
           "shard_owners", "no_shutdown_sleep", "rank_environment",
           "buffer_resume_losses", "resumed_read"]

BUFFER_KINDS = ("webdataset", "datasets", "torch.randperm")


def _expand(bounds):
    def stage(src):
        for shard in src:
            yield from range(*bounds[int(shard["url"])])
    return stage


def _webdataset_order(bounds, shards, k: int, seed: int,
                      shard_shuffle: bool) -> list[int]:
    import webdataset as wds

    stages = [wds.SimpleShardList([str(s) for s in shards])]
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


def _datasets_order(bounds, shards, k: int, seed: int, input_shards: int) -> list[int]:
    import datasets

    ds = datasets.IterableDataset.from_generator(
        _shard_rows, gen_kwargs={"shards": list(shards),
                                     "bounds": tuple(bounds)})  # a list would be split
    if k:
        ds = ds.shuffle(seed=seed, buffer_size=k, max_buffer_input_shards=input_shards)
    return [row["index"] for row in ds]


def buffer_orders(kind: str, n: int, shards: int, k: int, seeds,
                  shard_shuffle: bool = True, input_shards: int = 10,
                  readers: int = 1) -> np.ndarray:
    """One order per seed, as ``kind`` (one of ``BUFFER_KINDS``) yields it from
    ``shards`` shards of ``[0, n)`` with a buffer of ``k`` samples (0: none).
    ``shard_shuffle=False`` is WebDataset only (``datasets`` always shuffles the
    shard order with its buffer); ``input_shards`` is ``datasets``'
    ``max_buffer_input_shards`` (its default 10: the buffer is fed from that many
    shards at once). ``readers``: the order the first of ``readers`` readers (ranks x
    workers) yields from its share of the shards, ``[0::readers]``, which is where a
    library's buffer runs (``torch.randperm`` is of all ``n``)."""
    n = check_int("n", n, minimum=1)
    k = check_int("k", k, minimum=0)
    input_shards = check_int("input_shards", input_shards, minimum=1)
    readers = check_int("readers", readers, minimum=1)
    if readers > shards:
        raise ValueError(f"readers={readers} is more than the {shards} shards")
    bounds = shard_bounds(n, shards)
    mine = range(0, shards, readers)
    rows = []
    for seed in seeds:
        if kind == "webdataset":
            rows.append(_webdataset_order(bounds, mine, k, seed, shard_shuffle))
        elif kind == "datasets":
            if not shard_shuffle and k:
                raise ValueError("datasets' shuffle() always shuffles the shard order; "
                                 "shard_shuffle=False is for webdataset only")
            rows.append(_datasets_order(bounds, mine, k, seed, input_shards))
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


def _stats(rows: np.ndarray, n: int, shards: int, batch: int) -> dict:
    return {"position r": position_correlation(rows),
            "shards per batch": shards_per_batch(rows, n, shards, batch),
            "neighbours": float(np.mean(neighbours(rows)))}


def buffer_table(n: int = 10_000, shards: int = 100, ks=(0, 100, 1000, 5000),
                 seeds=range(5), batch: int = 64) -> list[dict]:
    """One row per (kind, shard shuffle, input shards, k): the three statistics over
    ``seeds``, for one reader that holds every shard; ``datasets`` with its default 10
    input shards and with 1."""
    cases = [("torch.randperm", False, 0, 10)]
    cases += [("webdataset", False, k, 10) for k in ks]
    cases += [("webdataset", True, k, 10) for k in ks]
    cases += [("datasets", True, k, inputs) for inputs in (10, 1) for k in ks if k]
    table = []
    for kind, shard_shuffle, k, inputs in cases:
        rows = buffer_orders(kind, n, shards, k, seeds, shard_shuffle, inputs)
        assert all(np.array_equal(np.sort(r), np.arange(n)) for r in rows)
        table.append({"kind": kind, "shard shuffle": shard_shuffle, "k": k,
                      "input shards": inputs, **_stats(rows, n, shards, batch)})
    return table


def reader_table(n: int = 10_000, shards: int = 100, readers=(1, 4, 16, 32),
                 ks=(1000, 5000), seeds=range(5), batch: int = 64) -> list[dict]:
    """Shards per batch in the first reader's batches when ``readers`` readers
    (ranks x workers) share the ``shards`` (WebDataset, shard order shuffled): a batch
    is built inside one reader, from its ``shards / readers`` shards only."""
    table = []
    for r in readers:
        for k in ks:
            rows = buffer_orders("webdataset", n, shards, k, seeds, readers=r)
            table.append({"readers": r, "k": k, "shards held": len(range(0, shards, r)),
                          "shards per batch": shards_per_batch(rows, n, shards, batch)})
    return table


OWNER_WAYS = ("webdataset", "webdataset detshuffle", "webdataset list seeded by epoch",
              "datasets", "datasets seed=None")


@contextlib.contextmanager
def no_shutdown_sleep():
    """``datasets`` 5.2.0 sleeps ``config.SLEEP_TIME_ON_THREADS_SHUTDOWN`` (5 s) at the
    end of every pass of a buffer fed from several shards at once (its threads'
    shutdown, apache/arrow#45214): set to 0 inside the block, which changes when a
    pass ends, not what it yields."""
    from datasets import config

    saved = config.SLEEP_TIME_ON_THREADS_SHUTDOWN
    config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    try:
        yield
    finally:
        config.SLEEP_TIME_ON_THREADS_SHUTDOWN = saved


@contextlib.contextmanager
def rank_environment(rank: int, world_size: int):
    """``RANK`` and ``WORLD_SIZE`` set as torchrun sets them, restored after."""
    saved = {v: os.environ.get(v) for v in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _wds_owner_stream(way: str, urls, seed: int, epoch: int):
    """One rank's WebDataset stream of raw samples in ``way``: the default shard shuffle
    (``shardshuffle=100``, a fixed seed), ``detshuffle=True`` (seed + an epoch count),
    or the shard list shuffled by ``(seed + epoch)`` *before* ``split_by_node``."""
    import webdataset as wds

    if way == "webdataset list seeded by epoch":
        return wds.DataPipeline(wds.SimpleShardList(urls, seed=seed + epoch),
                                wds.split_by_node, wds.tarfile_to_samples())
    return wds.WebDataset(urls, shardshuffle=100, seed=seed,
                          nodesplitter=wds.split_by_node,
                          detshuffle=way == "webdataset detshuffle")


def _shards_read(rows, n: int, shards: int) -> list[int]:
    starts = np.array([first for first, _ in shard_bounds(n, shards)])
    return sorted({int(s) for s in np.searchsorted(starts, rows, side="right") - 1})


def _rank_epochs(way: str, urls, rank: int, world_size: int, epochs: int, seed: int,
                 k: int):
    """The indices one rank reads in each epoch (``shard_owners``)."""
    from .streams import hf_stream

    wds_way = way.startswith("webdataset")
    kept = _wds_owner_stream(way, urls, seed, 0) if wds_way else None
    for epoch in range(epochs):
        if way == "webdataset list seeded by epoch":
            kept = _wds_owner_stream(way, urls, seed, epoch)
        if kept is not None:
            yield [int(sample["__key__"]) for sample in kept]
        else:
            stream = hf_stream(urls, rank, world_size, shuffle=k, epoch=epoch,
                               seed=None if way.endswith("None") else seed)
            yield [int(row["index"]) for row in stream]


def shard_owners(way: str, urls, n: int, world_size: int, epochs: int = 3,
                 seed: int = 0, k: int = 16) -> list[list[list[int]]]:
    """``owners[epoch][rank]``: the shards each of ``world_size`` ranks reads in each of
    ``epochs`` epochs of the ``n`` samples in ``urls`` (tar shards for the WebDataset
    ways, Parquet for the ``datasets`` ones; ``way`` one of ``OWNER_WAYS``). In this
    process, one rank after the other, with ``RANK`` and ``WORLD_SIZE`` set as torchrun
    sets them (WebDataset reads them); a WebDataset rank keeps its data set object
    across epochs, as a persistent worker does. ``datasets``:
    ``utils.streams.hf_stream`` with a buffer of ``k``, seeded by ``seed`` and
    ``set_epoch``, or unseeded (``shuffle(buffer_size=k)``, ``seed=None``)."""
    if way not in OWNER_WAYS:
        raise ValueError(f"way must be one of {OWNER_WAYS}, got {way!r}")
    world_size = check_int("world_size", world_size, minimum=1)
    urls = list(urls)
    owners = [[None] * world_size for _ in range(epochs)]
    with no_shutdown_sleep():
        for rank in range(world_size):
            with rank_environment(rank, world_size):
                for epoch, rows in enumerate(_rank_epochs(way, urls, rank, world_size,
                                                          epochs, seed, k)):
                    owners[epoch][rank] = _shards_read(rows, n, len(urls))
    return owners


def resumed_read(urls, k: int, stop: int, batch: int) -> list[int]:
    """The indices one reader (no workers) yields when a ``datasets`` stream with a
    buffer of ``k`` is stopped after ``stop`` batches and resumed from
    ``StatefulDataLoader``'s ``state_dict`` in a new loader."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from .streams import captured_log, hf_stream

    def loader(state=None):
        out = StatefulDataLoader(hf_stream(urls, 0, 1, shuffle=k), batch_size=batch)
        if state:
            out.load_state_dict(state)
        return out

    first, seen = loader(), []
    for step, rows in enumerate(first):
        seen += rows["index"].tolist()
        if step + 1 == stop:
            break
    with captured_log("datasets"):  # "... without the buffer content": said once here
        rest = loader(first.state_dict())
        seen += [i for rows in rest for i in rows["index"].tolist()]
    return seen


def buffer_resume_losses(urls, n: int, ks=(16, 32), stops=range(1, 13),
                         batch: int = 4) -> list[dict]:
    """For each buffer size ``k`` and stop point (batches read before the stop): the
    samples of ``n`` that a ``datasets`` stream over ``urls`` loses and reads twice
    when resumed from its ``state_dict`` (one reader, no workers)."""
    from .audit import audit_shards

    table = []
    with no_shutdown_sleep():
        for k in ks:
            for stop in stops:
                audit = audit_shards([resumed_read(urls, k, stop, batch)], n)
                repeated = sum(c - 1 for c in audit.duplicates.values())
                table.append({"k": k, "stop": stop, "lost": len(audit.missing),
                              "repeated": repeated})
    return table
