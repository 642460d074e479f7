"""An index over shards: WebDataset tar shards over HTTP read as a map-style data set
(appendix "An index over shards").

A stream of shards (``utils.streams``) is read front to back, so its readers deal whole
shards and shuffle in a buffer. The manifest (``utils.manifest``) records each
sample's byte span in its shard, which makes the same shards an indexable data set:

- ``IndexedShards(manifest_url)``: a ``torch.utils.data.Dataset`` whose length comes
  from the manifest and whose item ``i`` is the ``i``-th sample in the manifest's order,
  fetched with an HTTP Range request; ``__getitems__`` (which a ``DataLoader`` calls
  once per batch) merges adjacent spans of a shard into one request and sends a
  batch's requests from a few threads at once. Items are ``(index, image, label)``, as
  ``utils.streams.webdataset_stream`` decodes them (``.npy`` and ``.cls``);
- ``fetch_range``: one checked Range request: an HTTP error, a short body or a server
  that ignores the range raises ``ShardReadError`` naming the URL and the bytes;
- ``read_rank`` / ``read_ranks``: an epoch, or part of one, through chapter 15's
  ``PermutationShardSampler`` and ``CountingLoader`` on one or several local ranks,
  with the state to resume from;
- ``measure_cost`` / ``format_cost``: seconds per epoch of the index against the
  stream, over ``utils.streams.ShardServer`` with and without latency;
  ``python -m utils.shard_index --out book/results/shard_index_cpu.json`` (about a
  minute on 2 cores) saves them.
"""

from __future__ import annotations

import http.client
import io
import os
import sys
import tarfile
import time

import numpy as np
import torch.utils.data

from ._checks import check_int
from .manifest import load_manifest

__all__ = ["ShardReadError", "fetch_range", "parse_sample", "IndexedShards",
           "read_rank", "read_ranks", "measure_cost", "format_cost", "SOURCES", "main"]

# What measure_cost's figures depend on: this file, the manifest, the server and the
# stream (utils/streams.py), the sampler's order and the workers' start method.
# utils.data only generates the pixels (any bytes read alike).
SOURCES = ["utils/shard_index.py", "utils/manifest.py", "utils/streams.py",
           "utils/samplers.py::PermutationShardSampler",
           "utils/workers.py::worker_context", "utils/workers.py::PRELOAD"]


class ShardReadError(OSError):
    """A Range request for part of a shard failed or did not return the bytes asked."""


def fetch_range(url: str, first: int, stop: int, timeout: float = 30.0) -> bytes:
    """Bytes ``first`` to ``stop - 1`` of ``url``, by one HTTP Range request. Raises
    ``ShardReadError`` naming the URL and the range when the request fails (a 404, a
    refused connection, a timeout), the answer is not ``206 Partial Content``, or it
    holds fewer or more bytes than asked."""
    import urllib.error
    import urllib.request

    first = check_int("first", first, minimum=0)
    stop = check_int("stop", stop, minimum=first + 1)
    where = f"{url} bytes {first}-{stop - 1}"
    request = urllib.request.Request(url,
                                     headers={"Range": f"bytes={first}-{stop - 1}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as err:
        raise ShardReadError(f"{where}: HTTP {err.code} {err.reason}") from None
    except (OSError, http.client.HTTPException) as err:
        raise ShardReadError(f"{where}: {type(err).__name__}: {err}") from err
    if status != 206:
        raise ShardReadError(f"{where}: HTTP {status}, not 206 Partial Content (the "
                             "server ignored the Range header)")
    if len(body) != stop - first:
        raise ShardReadError(f"{where}: {len(body):,} bytes came back for the "
                             f"{stop - first:,} asked (the shard is not the one the "
                             "manifest describes)")
    return body


def parse_sample(data: bytes) -> dict:
    """The tar members in ``data`` (one sample's span) as WebDataset's raw sample:
    ``{"__key__": key, extension: bytes, ...}``."""
    sample: dict = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        for member in tar:
            if member.isfile():
                key, ext = os.path.basename(member.name).split(".", 1)
                sample["__key__"] = key
                sample[ext] = tar.extractfile(member).read()
    return sample


class IndexedShards(torch.utils.data.Dataset):
    """WebDataset tar shards served over HTTP, as a map-style data set.

    ``manifest_url`` is the ``manifest.json`` that ``utils.manifest.write_manifest``
    wrote beside the shards; the shards are fetched from the same folder. Nothing but
    the manifest is read at start-up: ``len`` is its sample count, and index ``i`` is
    the ``i``-th sample in its order (shard 0's samples, then shard 1's, ...).
    ``threads``: the concurrent requests of one batch; ``timeout``: seconds per
    request. ``requests`` counts the Range requests this copy of the data set sent
    (each DataLoader worker has its own copy)."""

    def __init__(self, manifest_url: str, threads: int = 4, timeout: float = 30.0):
        if not manifest_url.startswith(("http://", "https://")):
            raise ValueError(f"manifest_url must be an http:// or https:// URL, got "
                             f"{manifest_url!r}")
        self.threads = check_int("threads", threads, minimum=1)
        self.timeout = float(timeout)
        manifest = load_manifest(manifest_url, timeout=self.timeout)
        base = manifest_url.rsplit("/", 1)[0]
        for entry in manifest["shards"]:
            if "spans" not in entry:
                raise ValueError(f"{entry['name']}: the manifest has no byte spans for "
                                 "it; IndexedShards reads tar shards whose manifest "
                                 "utils.manifest.write_manifest wrote")
        self.urls = [f"{base}/{entry['name']}" for entry in manifest["shards"]]
        self.spans = [entry["spans"] for entry in manifest["shards"]]
        # the global index of each shard's first sample, and one past the last
        self.starts = np.cumsum([0] + [len(s) for s in self.spans]).tolist()
        self.requests = 0

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index) -> tuple[int, list]:
        """``(shard, [key, first byte, stop byte])`` of sample ``index``."""
        index = check_int("index", index, minimum=0, maximum=len(self) - 1)
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return shard, self.spans[shard][index - self.starts[shard]]

    def plan(self, indices) -> list[tuple[int, int, int, list]]:
        """The requests that fetch ``indices``: ``(shard, first, stop, [(position in
        indices, span), ...])``, adjacent (or repeated) spans of a shard merged."""
        places = sorted(((*self.locate(i), pos) for pos, i in enumerate(indices)),
                        key=lambda p: (p[0], p[1][1], p[2]))  # shard, first byte
        runs: list[tuple[int, int, int, list]] = []
        for shard, span, pos in places:
            if runs and runs[-1][0] == shard and span[1] <= runs[-1][2]:
                last = runs[-1]
                runs[-1] = (shard, last[1], max(last[2], span[2]), last[3])
            else:
                runs.append((shard, span[1], span[2], []))
            runs[-1][3].append((pos, span))
        return runs

    def __getitems__(self, indices) -> list[tuple]:
        """The samples at ``indices``, in that order; a batch's requests are sent
        from up to ``threads`` threads at once."""
        runs = self.plan(indices)
        self.requests += len(runs)
        args = [(self.urls[shard], first, stop) for shard, first, stop, _ in runs]
        if len(args) == 1 or self.threads == 1:
            bodies = [self._fetch(a) for a in args]
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(self.threads, len(args))) as pool:
                bodies = list(pool.map(self._fetch, args))
        out: list = [None] * len(indices)
        for (shard, first, _, members), body in zip(runs, bodies):
            for pos, (key, a, b) in members:
                out[pos] = self._decode(shard, key, body[a - first:b - first])
        return out

    def __getitem__(self, index) -> tuple:
        return self.__getitems__([index])[0]

    def _fetch(self, args: tuple) -> bytes:
        return fetch_range(*args, timeout=self.timeout)

    def _decode(self, shard: int, key: str, data: bytes) -> tuple:
        """``(index, image, label)`` of one sample's bytes, decoded as
        ``utils.streams.webdataset_stream`` decodes them."""
        from webdataset.autodecode import Decoder

        from .streams import _wds_sample

        sample = parse_sample(data)
        if sample.get("__key__") != key:
            raise ShardReadError(f"{self.urls[shard]}: the span of sample {key!r} "
                                 f"holds {sample.get('__key__')!r}: the shard changed "
                                 "since its manifest was written")
        return _wds_sample(Decoder([]).decode(sample))[1:]

    def __repr__(self) -> str:
        return f"IndexedShards({len(self)} samples in {len(self.urls)} shards)"


def read_rank(manifest_url: str, global_batch: int = 8, workers: int = 0,
              seed: int = 0, epoch: int = 0, stop_after: int | None = None,
              state: dict | None = None, num_replicas: int | None = None,
              rank: int | None = None, context=None) -> tuple[list[int], dict]:
    """One rank's epoch of ``IndexedShards(manifest_url)`` through chapter 15's
    ``PermutationShardSampler`` (``num_replicas`` and ``rank``: the process group's
    unless given) and ``CountingLoader``: batches of ``global_batch // num_replicas``
    from ``workers`` DataLoader workers (started by ``context``). ``stop_after``: stop
    after that many batches; ``state``: a ``state_dict`` to resume from, saved on any
    number of ranks with the same global batch. Returns ``(the indices this rank
    received, in order, the loader's state_dict after them)``."""
    from torch.utils.data import DataLoader

    from .samplers import CountingLoader, PermutationShardSampler, resolve_world

    num_replicas, rank = resolve_world(num_replicas, rank)
    global_batch = check_int("global_batch", global_batch, minimum=1)
    if global_batch % num_replicas:
        raise ValueError(f"global_batch={global_batch} does not divide by "
                         f"{num_replicas} ranks")
    batch = global_batch // num_replicas
    data = IndexedShards(manifest_url)
    sampler = PermutationShardSampler(len(data), num_replicas, rank, seed=seed,
                                      batch_size=batch)
    sampler.set_epoch(epoch)
    loader = CountingLoader(DataLoader(data, batch_size=batch, sampler=sampler,
                                       num_workers=workers,
                                       multiprocessing_context=context))
    if state is not None:
        loader.load_state_dict(state)
    seen: list[int] = []
    for batches, (index, _, _) in enumerate(loader, 1):
        seen.extend(index.tolist())
        if batches == stop_after:
            break
    return seen, loader.state_dict()


def read_ranks(manifest_url: str, world_size: int, global_batch: int = 8,
               workers: int = 0, seed: int = 0, epoch: int = 0,
               stop_after: int | None = None, state: dict | None = None,
               timeout: float = 120.0) -> list[tuple[list[int], dict]]:
    """``read_rank`` on ``world_size`` local ranks (``utils.launch.run_distributed``),
    each with ``workers`` DataLoader workers: each rank's ``(indices, state)``."""
    from .launch import run_distributed

    world_size = check_int("world_size", world_size, minimum=1)
    return run_distributed(read_rank, world_size, manifest_url, global_batch, workers,
                           seed, epoch, stop_after, state, timeout=timeout)



def _epoch(data, batch_size: int, workers: int, sampler, context) -> tuple[float, int]:
    """One timed epoch of ``data`` through a DataLoader: ``(seconds, samples)``, the
    start of its workers included, as every epoch of a non-persistent loader pays."""
    import warnings

    from torch.utils.data import DataLoader

    with warnings.catch_warnings():  # more workers than cores: asked for, on purpose
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = DataLoader(data, batch_size=batch_size, sampler=sampler,
                            num_workers=workers,
                            multiprocessing_context=context if workers else None)
        start, samples = time.perf_counter(), 0
        for batch in loader:
            samples += len(batch[-1])  # the labels
        return time.perf_counter() - start, samples


def _requests(data: IndexedShards, batch_size: int) -> int:
    """The Range requests one epoch of ``data`` in the sampler's batches sends."""
    from .samplers import PermutationShardSampler

    sampler = PermutationShardSampler(len(data), 1, 0)
    return sum(len(data.plan(b)) for b in sampler.index_batches(batch_size))


def _time_cases(cases: dict, folder: str, names: list, settings: dict, latency: float,
                context) -> None:
    """Each reader and worker count timed once over a server with ``latency``; the
    seconds appended to ``cases[reader, workers, latency]`` (made if missing)."""
    from .samplers import PermutationShardSampler
    from .streams import ShardServer, webdataset_stream

    batch_size = settings["batch_size"]
    with ShardServer(folder, latency=latency) as server:
        data = IndexedShards(server.url("manifest.json"), threads=settings["threads"])
        readers = {"stream": (lambda: webdataset_stream(server.urls(names)),
                              lambda: None, len(names)),
                   "index": (lambda: data,
                             lambda: PermutationShardSampler(len(data), 1, 0),
                             _requests(data, batch_size))}
        for w in settings["workers"]:
            for reader, (make, sampler, requests) in readers.items():
                seconds, samples = _epoch(make(), batch_size, w, sampler(), context)
                case = cases.setdefault((reader, w, latency), {
                    "reader": reader, "workers": w, "latency_s": latency,
                    "requests": requests, "samples": samples, "seconds": []})
                case["seconds"].append(round(seconds, 3))


def measure_cost(images: np.ndarray, labels, shards: int = 8, batch_size: int = 32,
                 workers=(0, 4), latencies=(0.0, 0.05), threads: int = 4,
                 repeats: int = 3, log=print) -> dict:
    """Seconds per epoch of ``images`` (uint8, ``n x 32 x 32 x 3``) and ``labels``
    written as ``shards`` WebDataset shards with a manifest, served by
    ``utils.streams.ShardServer`` with each of ``latencies`` (seconds before every
    response), read in batches of ``batch_size`` with each of ``workers`` DataLoader
    workers: by the stream (``webdataset_stream``: one request per shard) and by
    ``IndexedShards`` in the sampler's shuffle (one request per sample or merged
    span, ``threads`` at a time per process). An untimed round first (it starts the
    workers' fork server), then ``repeats`` rounds each time every case once; each
    case reports the median."""
    import statistics
    import tempfile

    from .manifest import write_manifest
    from .streams import write_webdataset
    from .workers import worker_context

    settings = {"samples": len(images),
                "shards": check_int("shards", shards, minimum=1),
                "batch_size": check_int("batch_size", batch_size, minimum=1),
                "workers": [check_int("workers", w, minimum=0) for w in workers],
                "latencies_s": [float(s) for s in latencies],
                "threads": check_int("threads", threads, minimum=1),
                "repeats": check_int("repeats", repeats, minimum=1)}
    if any(s < 0 for s in settings["latencies_s"]):
        raise ValueError(f"latencies are seconds >= 0, got {list(latencies)}")
    # the stream's modules imported once in the fork server (not this module: a
    # worker imports it as its __main__ under python -m, and runpy warns of that)
    context = worker_context("utils.streams", "webdataset")
    cases: dict = {}
    with tempfile.TemporaryDirectory(prefix="shard_index_") as folder:
        names = write_webdataset(folder, images, labels, shards)
        write_manifest(folder, names)
        for r in range(repeats + 1):
            log("warm-up round" if r == 0 else f"round {r} of {repeats}")
            for latency in settings["latencies_s"]:
                _time_cases(cases, folder, names, settings, latency, context)
    for case in cases.values():
        case["seconds"] = case["seconds"][1:]  # the warm-up round's left out
        case["median_s"] = round(statistics.median(case["seconds"]), 3)
    return {"settings": settings, "results": list(cases.values())}


def format_cost(result: dict) -> str:
    """Seconds per epoch (median) per reader and worker count (rows) and latency
    (columns), with the Range requests (or shard reads) of an epoch."""
    s = result["settings"]
    latencies = s["latencies_s"]
    lines = [f"{s['samples']} samples in {s['shards']} shards, batches of "
             f"{s['batch_size']}, {s['threads']} threads per index reader: seconds "
             "per epoch", "reader  workers  requests" + "".join(
                 f"  {t * 1000:>4.0f} ms" for t in latencies)]
    cases = {(c["reader"], c["workers"], c["latency_s"]): c for c in result["results"]}
    for reader, w in dict.fromkeys((c["reader"], c["workers"])
                                   for c in result["results"]):
        row = [cases[reader, w, t] for t in latencies]
        lines.append(f"{reader:<7} {w:>7} {row[0]['requests']:>9}"
                     + "".join(f"  {c['median_s']:>5.2f} s" for c in row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """``python -m utils.shard_index``: measure, print the table, save ``--out``."""
    import argparse
    import tempfile
    from importlib.metadata import version

    from . import results
    from .bench import environment
    from .streams import stand_in

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m utils.shard_index",
                                     description="Seconds per epoch: an index over "
                                                 "shards against their stream.")
    parser.add_argument("--out", help="save the result as JSON here")
    parser.add_argument("--samples", type=int, default=384,
                        help="stand-in images (default 384)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds (default 3)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shard_index_data_") as folder:
        images, labels = stand_in(folder, args.samples)
    try:
        result = measure_cost(images, labels, repeats=args.repeats,
                              log=lambda line: print(line, flush=True))
    except ValueError as err:
        parser.error(str(err))
    result["environment"] = {**environment(), "webdataset": version("webdataset")}
    result["command"] = " ".join(["python -m utils.shard_index", *argv])
    print(format_cost(result))
    if args.out:
        results.write(args.out, result, SOURCES)
    return result


if __name__ == "__main__":
    main()
