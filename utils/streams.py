"""Streams of shards: the CIFAR-10 stand-in written by WebDataset's and Hugging Face
``datasets``' own writers, served over HTTP on loopback, and read back by ranks and
workers through each library's remote path (chapter 16).

- ``write_webdataset`` / ``write_parquet``: ``shards`` shards of consecutive indices
  (``numpy.array_split``'s sizes), each sample carrying its index, so that what a
  reader saw can be audited (``utils.audit``);
- ``ShardServer``: Python's ``http.server`` on ``127.0.0.1`` and a port the OS picks,
  in its own process, answering Range requests, as a stand-in for S3, GCS or a CDN;
- ``webdataset_stream`` / ``hf_stream``: each library's stream as a reader writes it
  (WebDataset: ``split_by_node`` and ``split_by_worker``; ``datasets``:
  ``split_dataset_by_node``), yielding ``(index, image, label)``;
- ``read_epoch``: one epoch on ``world_size`` local ranks (``utils.launch``) with
  ``workers`` DataLoader workers each; what every worker of every rank read.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from ._checks import check_bool, check_int

__all__ = ["FORMATS", "stand_in", "shard_bounds", "write_webdataset", "write_parquet",
           "ShardServer", "RangeRequestHandler", "serve", "webdataset_stream",
           "hf_stream", "read_epoch", "resume_epoch", "Read", "assignment_table",
           "captured_log", "sample_shard", "webdataset_shard_orders"]

FORMATS = ("webdataset", "parquet")
_PATTERNS = {"webdataset": "train-{:06d}.tar", "parquet": "train-{:06d}.parquet"}


def stand_in(root: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` training images (uint8, ``n x 32 x 32 x 3``) and labels of the
    generated CIFAR-10 stand-in under ``root`` (written there if missing, with the
    sizes ``python -m utils.train_cifar10 --synthetic`` writes by default while ``n``
    is at most 5,000, so that the script can use the same folder)."""
    from .data import load_cifar10, write_synthetic_cifar10

    n = check_int("n", n, minimum=1)
    write_synthetic_cifar10(root, n_train=max(n, 5000), n_test=1000)
    train = load_cifar10(root, train=True)
    if len(train) < n:
        raise ValueError(f"{root} holds {len(train)} training images; asked for {n}")
    return train.data[:n], np.asarray(train.targets[:n], dtype=np.int64)


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """``(first, stop)`` of each shard's indices: ``numpy.array_split``'s sizes, the
    first ``n % shards`` shards one longer."""
    n = check_int("n", n, minimum=1)
    shards = check_int("shards", shards, minimum=1)
    if shards > n:
        raise ValueError(f"shards={shards} is more than the {n} samples to split")
    sizes = [len(a) for a in np.array_split(np.arange(n), shards)]
    stops = np.cumsum(sizes).tolist()
    return [(stop - size, stop) for size, stop in zip(sizes, stops)]


def _check_images(images, labels) -> None:
    if images.ndim != 4 or images.shape[1:] != (32, 32, 3) or images.dtype != np.uint8:
        raise ValueError("images must be uint8 of shape (n, 32, 32, 3), got "
                         f"{images.dtype} {tuple(images.shape)}")
    if len(labels) != len(images):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")


def write_webdataset(folder: str, images: np.ndarray, labels, shards: int) -> list[str]:
    """WebDataset tar shards in ``folder``, written by ``webdataset.TarWriter``: one
    sample per image, keyed by its index (``__key__`` ``"000042"``), the image as
    ``.npy``, its label as ``.cls``. Returns the shards' file names."""
    import webdataset as wds

    _check_images(images, labels)
    os.makedirs(folder, exist_ok=True)
    names = []
    for s, (first, stop) in enumerate(shard_bounds(len(images), shards)):
        names.append(_PATTERNS["webdataset"].format(s))
        with wds.TarWriter(os.path.join(folder, names[-1])) as sink:
            for i in range(first, stop):
                sink.write({"__key__": f"{i:06d}", "npy": images[i],
                            "cls": int(labels[i])})
    return names


def write_parquet(folder: str, images: np.ndarray, labels, shards: int) -> list[str]:
    """Parquet shards in ``folder``, written by ``datasets.Dataset.to_parquet``: columns
    ``index``, ``image`` (the 3,072 bytes of one image) and ``label``. Returns the
    shards' file names."""
    import datasets

    _check_images(images, labels)
    os.makedirs(folder, exist_ok=True)
    datasets.disable_progress_bars()
    names = []
    for s, (first, stop) in enumerate(shard_bounds(len(images), shards)):
        names.append(_PATTERNS["parquet"].format(s))
        part = datasets.Dataset.from_dict({
            "index": list(range(first, stop)),
            "image": [images[i].tobytes() for i in range(first, stop)],
            "label": [int(v) for v in labels[first:stop]]})
        part.to_parquet(os.path.join(folder, names[-1]))
    return names


class ShardServer:
    """Python's ``http.server`` serving ``folder`` on ``127.0.0.1``, on a port the OS
    picks, in a process of its own (a reader's S3 bucket, GCS or CDN in miniature),
    answering HTTP Range requests as those do (``RangeRequestHandler``): a Parquet
    reader fetches a file's footer first, then the parts it needs.

    Faults, to see what a reader does when the store misbehaves (keywords; shard
    names are file names in ``folder``):

    - ``latency``: seconds slept before every response's head (a round trip);
    - ``missing``: names answered with ``404 Not Found``;
    - ``cut``: ``{name: n}``: the connection is shut down after ``n`` bytes of the
      body of a response for ``name`` that is longer than ``n``;
    - ``stall``: ``{name: seconds}``: the body stops halfway and the server waits
      ``seconds`` before sending the rest (``-1``: forever, on every request);
    - ``once``: ``True`` (the default): ``cut`` and a finite ``stall`` hit the first
      response for that name only (a transient fault: a retry succeeds); ``False``:
      every response (a broken path);
    - ``down``: seconds: from the first request on, the server stops accepting
      (connections are refused) for that long, then serves again on the same port
      (the first request itself is answered);
    - ``truncate``: ``{name: n}``: the file is served as if only its first ``n``
      bytes had been uploaded (a partial upload; honest ``Content-Length``).

    Use it as a context manager, or call ``close()``: the server process is stopped
    (killed if it does not stop within 5 s, a stall forever included) and waited
    for. ``url(name)`` is the address of one file."""

    def __init__(self, folder: str, timeout: float = 30.0, *, latency: float = 0.0,
                 missing=(), cut: dict | None = None, stall: dict | None = None,
                 once: bool = True, down: float | None = None,
                 truncate: dict | None = None):
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"no folder {folder!r} to serve")
        self.folder = folder
        self.options = _Faults.check(dict(
            latency=latency, missing=list(missing), cut=cut or {}, stall=stall or {},
            once=once, down=down, truncate=truncate or {}))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "utils.streams", "serve", folder,
             "--options", json.dumps(self.options)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self._first_line(timeout)
        # "Serving HTTP on 127.0.0.1 port 41234 (http://127.0.0.1:41234/) ..."
        self.port = int(line.split(" port ")[1].split()[0])
        self.base = f"http://127.0.0.1:{self.port}"

    def _first_line(self, timeout: float) -> str:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.close()
                raise TimeoutError(f"http.server did not start within {timeout} s")
        line = self._proc.stdout.readline()
        if " port " not in line:
            self.close()
            raise RuntimeError(f"http.server did not start: {line!r}")
        return line

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def urls(self, names) -> list[str]:
        return [self.url(n) for n in names]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc.wait()
        self._proc.stdout.close()

    def __enter__(self) -> "ShardServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self._proc.poll() is None else "stopped"
        return f"ShardServer({self.folder!r}, {self.base}, {state})"


def _worker_id() -> int:
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return 0 if info is None else info.id


def _wds_sample(sample: dict) -> tuple:
    """``(worker, index, image, label)`` of one decoded WebDataset sample."""
    import torch

    return (_worker_id(), int(sample["__key__"]), torch.from_numpy(sample["npy"]),
            int(sample["cls"]))


def webdataset_stream(urls, shuffle: int = 0, seed: int = 0, epoch: int = 0,
                      resampled: bool = False, epoch_samples: int | None = None):
    """WebDataset's stream over ``urls`` as its documentation writes it for several
    nodes: shards dealt to ranks by ``split_by_node`` (``urls[rank::world_size]``,
    rank and world size from the ``RANK`` and ``WORLD_SIZE`` environment variables,
    which torchrun and ``utils.launch`` set, else from the process group), then to a
    rank's workers by ``split_by_worker`` (``[worker::num_workers]``).
    ``shuffle=k``: the order of each worker's shards shuffled and a buffer of ``k``
    samples, both seeded by ``seed`` and ``epoch`` (pass the epoch: WebDataset's
    ``detshuffle`` counts epochs in each worker's copy of the data set, which a worker
    that is not persistent loses). ``resampled=True``: WebDataset's fix for uneven
    shards (each worker draws shards with replacement, forever), cut to
    ``epoch_samples`` per worker with ``with_epoch``. Yields ``(worker, index, image,
    label)``."""
    import webdataset as wds

    from .seeding import derive_seed  # not at the top: the server imports this module

    seeded = derive_seed(seed, epoch)
    if resampled:
        if epoch_samples is None:
            raise ValueError("resampled=True streams forever: pass epoch_samples, "
                             "the samples each worker yields per epoch")
        # WebDataset(resampled=True) as a pipeline, to seed it: each worker of each
        # rank draws shards on its own (seeded by seed, rank and worker), nothing split
        stages = [wds.ResampledShards(urls, seed=seeded, deterministic=True),
                  wds.tarfile_to_samples()]
        if shuffle:
            stages.append(wds.shuffle(shuffle, seed=seeded))
        return wds.DataPipeline(*stages, wds.decode(), wds.map(_wds_sample)).with_epoch(
            epoch_samples)
    ds = wds.WebDataset(urls, nodesplitter=wds.split_by_node,
                        workersplitter=wds.split_by_worker,
                        shardshuffle=100 if shuffle else False,
                        detshuffle=True, seed=seeded, empty_check=False)
    if shuffle:
        ds = ds.shuffle(shuffle, seed=seeded)
    return ds.decode().map(_wds_sample)


def sample_shard(sample: dict, per_shard: int = 8) -> int:
    """The shard a raw WebDataset sample of ``per_shard``-sample shards came from (its
    ``__key__`` is its index): for a picklable ``.map`` in tests and the chapter."""
    return int(sample["__key__"]) // per_shard


def webdataset_shard_orders(urls, persistent: bool, epochs: int = 2,
                            detshuffle: bool = True) -> list[list[int]]:
    """The shards (``sample_shard``) one DataLoader worker reads in each of ``epochs``
    epochs of WebDataset's own shard shuffle, ``WebDataset(urls, shardshuffle=100,
    detshuffle=detshuffle, seed=0)`` (its default is ``detshuffle=False``), with
    ``persistent_workers=persistent``."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    from .workers import worker_context

    ds = wds.WebDataset(urls, shardshuffle=100, detshuffle=detshuffle, seed=0).map(
        sample_shard)
    loader = DataLoader(ds, batch_size=None, num_workers=1,
                        persistent_workers=persistent,
                        multiprocessing_context=worker_context())
    return [list(dict.fromkeys(loader)) for _ in range(epochs)]


def _hf_worker(row: dict) -> dict:
    """The worker that read ``row``, as a column (for ``read_epoch``)."""
    return {"worker": _worker_id()}


def hf_stream(urls, rank: int, world_size: int, shuffle: int = 0, seed: int = 0,
              epoch: int = 0, strategy: str = "auto", transform=None):
    """Hugging Face ``datasets``' stream over the Parquet ``urls``, as its
    documentation writes it for several nodes: ``load_dataset("parquet", ...,
    streaming=True)``, then ``split_dataset_by_node`` (``strategy="auto"``: whole
    shards per rank when the shard count divides by ``world_size``, else every
    ``world_size``-th example of every shard; ``"shards"``: whole shards always),
    ``shuffle(seed, buffer_size=k)`` and ``set_epoch(epoch)`` when ``shuffle=k``.
    DataLoader workers get whole shards of the rank's part. Yields dicts of
    ``index``, ``image`` (bytes) and ``label``, with ``transform``'s columns added
    (``datasets.IterableDataset.map``). The epoch is set last: a ``.map`` after
    ``set_epoch`` returns a data set at epoch 0 again (datasets 5.2.0), which would
    shuffle every epoch in epoch 0's order."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("parquet", data_files={"train": list(urls)},
                               split="train", streaming=True)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world_size, strategy=strategy)
    if transform is not None:
        ds = ds.map(transform)
    if shuffle:
        ds = ds.shuffle(seed=seed, buffer_size=shuffle)
    ds.set_epoch(epoch)
    return ds


@dataclass(frozen=True)
class Read:
    """What one epoch's readers saw: ``seen[rank][worker]`` lists the indices in the
    order that worker yielded them; ``batches[rank]`` counts the rank's batches."""

    seen: tuple
    batches: tuple

    def per_rank(self) -> list[list[int]]:
        return [[i for w in rank for i in w] for rank in self.seen]

    def per_worker(self) -> list[list[int]]:
        return [w for rank in self.seen for w in rank]


def _make_loader(fmt: str, urls, workers: int, batch_size: int, options: dict,
                 state: dict | None = None):
    """This rank's loader: a ``DataLoader``, or with ``state`` (``{}``: a fresh start)
    torchdata's ``StatefulDataLoader``, which saves and loads its place."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    rank, world = dist.get_rank(), dist.get_world_size()
    if fmt == "webdataset":
        ds = webdataset_stream(urls, **options)
    else:
        ds = hf_stream(urls, rank, world, transform=_hf_worker, **options)
    if state is None:
        # workers start as run_distributed arranges (the caller's start method)
        return DataLoader(ds, batch_size=batch_size, num_workers=workers)
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(ds, batch_size=batch_size, num_workers=workers)
    if state:
        loader.load_state_dict(state)
    return loader


def _read_rank(fmt: str, urls, workers: int, batch_size: int, options: dict,
               state: dict | None = None, stop_after: int | None = None):
    """One rank's epoch, or its first ``stop_after`` batches: ``(indices each worker
    yielded, batches, the loader's state_dict or None)``."""
    loader = _make_loader(fmt, urls, workers, batch_size, options, state)
    seen = [[] for _ in range(max(workers, 1))]
    batches = 0
    for batch in loader:
        worker, index = _worker_and_index(fmt, batch)
        seen[worker].extend(index)
        batches += 1
        if batches == stop_after:
            break
    return seen, batches, (None if state is None else loader.state_dict())


def _worker_and_index(fmt: str, batch) -> tuple[int, list[int]]:
    if fmt == "webdataset":
        worker, index = batch[0], batch[1]
    else:
        worker, index = batch["worker"], batch["index"]
    return int(worker[0]), [int(i) for i in index]


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def _as_read(out) -> "Read":
    return Read(seen=tuple(tuple(tuple(w) for w in s) for s, _, _ in out),
                batches=tuple(b for _, b, _ in out))


def read_epoch(fmt: str, urls, world_size: int, workers: int, batch_size: int = 1,
               timeout: float = 120.0, **options) -> Read:
    """One epoch of ``fmt`` (``"webdataset"`` or ``"parquet"``) over ``urls`` on
    ``world_size`` local ranks with ``workers`` DataLoader workers each and batches of
    ``batch_size``; ``options`` go to ``webdataset_stream`` or ``hf_stream``."""
    from .launch import run_distributed

    _check_format(fmt)
    out = run_distributed(_read_rank, world_size, fmt, list(urls), workers, batch_size,
                          options, timeout=timeout)
    return _as_read(out)


def resume_epoch(fmt: str, urls, world_size: int, workers: int, batch_size: int,
                 stop_after: int, timeout: float = 120.0,
                 **options) -> tuple[Read, Read]:
    """One epoch read through torchdata's ``StatefulDataLoader``, stopped after
    ``stop_after`` batches on every rank, its ``state_dict`` kept, and finished by
    fresh processes that load it: ``(before the stop, after the resume)``."""
    from .launch import run_distributed

    _check_format(fmt)
    stop_after = check_int("stop_after", stop_after, minimum=1)
    args = (fmt, list(urls), workers, batch_size, options)
    first = run_distributed(_read_rank, world_size, *args, {}, stop_after,
                            timeout=timeout)
    states = [state for _, _, state in first]
    rest = run_distributed(_resume_rank, world_size, *args, states, timeout=timeout)
    return _as_read(first), _as_read(rest)


def _resume_rank(fmt, urls, workers, batch_size, options, states):
    import textwrap

    import torch.distributed as dist

    with captured_log("torchdata") as said:
        out = _read_rank(fmt, urls, workers, batch_size, options,
                         states[dist.get_rank()])
    for message in dict.fromkeys(said):  # once each, wrapped to fit a page
        print(textwrap.fill(f"StatefulDataLoader: {message}", 76))
    return out


@contextlib.contextmanager
def captured_log(name: str):
    """The messages logger ``name`` (and its children) emits inside the block, as a list
    of strings, instead of on stderr."""
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger(name)
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers[:], logger.propagate = [Keep()], False
    try:
        yield records
    finally:
        logger.handlers[:], logger.propagate = handlers, propagate


def assignment_table(read: Read, n: int, shards: int) -> str:
    """Which shards each worker of each rank read (``3:10`` is 10 samples of shard 3;
    ``3:5/10`` is 5 of its 10), and each rank's samples and batches."""
    bounds = shard_bounds(n, shards)
    starts = np.array([first for first, _ in bounds])
    lines = []
    for rank, workers in enumerate(read.seen):
        for w, seen in enumerate(workers):
            shard_of = np.searchsorted(starts, np.asarray(seen, dtype=np.int64),
                                       side="right") - 1
            cells = []
            for s, count in zip(*np.unique(shard_of, return_counts=True)):
                size = bounds[s][1] - bounds[s][0]
                cells.append(f"{s}:{count}" if count == size else f"{s}:{count}/{size}")
            lines.append(f"rank {rank} worker {w}: {' '.join(cells) or '(nothing)'}")
        lines.append(f"rank {rank}: {sum(map(len, workers))} samples in "
                     f"{read.batches[rank]} batches")
    return "\n".join(lines)


class _Faults:
    """The faults one server process plays (``ShardServer``'s keywords), and what it
    has played so far: which names have had their one cut or stall, and whether the
    outage has begun. Shared by the handler threads, under a lock."""

    def __init__(self, options: dict | None = None):
        self.options = self.check(options or {})
        self._lock = threading.Lock()
        self._hit: set = set()
        self.down_started = False
        self.stopped = threading.Event()  # the listening socket is closed

    @staticmethod
    def check(options: dict) -> dict:
        """``options`` with every key and value checked, and defaults filled in."""
        known = {"latency": 0.0, "missing": [], "cut": {}, "stall": {}, "once": True,
                 "down": None, "truncate": {}}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown server options {unknown}; allowed: "
                             f"{sorted(known)}")
        out = {**known, **options}
        for key in ("latency", "down"):
            if out[key] is not None and not (isinstance(out[key], (int, float))
                                             and out[key] >= 0):
                raise ValueError(f"{key} must be a number of seconds >= 0, got "
                                 f"{out[key]!r}")
        for key in ("cut", "truncate"):
            out[key] = {str(k): check_int(f"{key}[{k!r}]", v, minimum=0)
                        for k, v in dict(out[key]).items()}
        for name, seconds in dict(out["stall"]).items():
            if not (isinstance(seconds, (int, float)) and (seconds > 0
                                                           or seconds == -1)):
                raise ValueError(f"stall[{name!r}] must be seconds > 0 or -1 "
                                 f"(forever), got {seconds!r}")
        out["missing"] = [str(n) for n in out["missing"]]
        out["once"] = check_bool("once", out["once"])
        return out

    def first_request(self) -> bool:
        """True for the first request this server gets (which starts ``down``)."""
        with self._lock:
            first, self.down_started = not self.down_started, True
            return first

    def plan(self, name: str, size: int) -> tuple[int, float]:
        """``(bytes to send before the fault, seconds to stall there)`` for a body of
        ``size`` bytes of ``name``: ``(size, 0)`` when no fault hits it; a cut is a
        stall of ``0`` seconds followed by a shutdown (``cut_after`` > 0 says so)."""
        cut = self.options["cut"].get(name)
        stall = self.options["stall"].get(name)
        with self._lock:
            if (self.options["once"] and name in self._hit and stall != -1):
                return size, 0.0
            if cut is not None and size > cut:
                self._hit.add(name)
                return cut, -2.0  # -2: shut the connection down there
            if stall is not None and size > 1:
                self._hit.add(name)
                return size // 2, float(stall)
        return size, 0.0

    def release(self, name: str) -> None:
        """``name``'s fault did not reach a reader: play it again on the next."""
        with self._lock:
            self._hit.discard(name)


class RangeRequestHandler(http.server.SimpleHTTPRequestHandler):
    """``http.server``'s file handler, answering one byte range (``Range: bytes=a-b``,
    ``a-`` or ``-n``) with ``206 Partial Content``, as object stores and CDNs do,
    and a whole file with ``200``; anything else (a folder, a missing file) as
    ``http.server`` does. ``faults`` (a ``_Faults``): the faults it plays."""

    def __init__(self, *args, faults: _Faults | None = None, **kwargs):
        self.faults = faults or _Faults()
        super().__init__(*args, **kwargs)  # handles the request

    def send_head(self):
        options = self.faults.options
        if options["latency"]:
            time.sleep(options["latency"])
        if options["down"] is not None and self.faults.first_request():
            self.server.go_down()  # returns once the port refuses connections
        path = self.translate_path(self.path)
        name = os.path.basename(path)
        if name in options["missing"]:
            self.send_error(404, "File not found")
            return None
        if not os.path.isfile(path):
            return super().send_head()
        with open(path, "rb") as f:
            data = f.read(options["truncate"].get(name, -1))
        return self._send_part(path, data)

    def _send_part(self, path: str, data: bytes):
        """The head for ``data`` (all of it, or the requested range); its body."""
        size = len(data)
        match = re.fullmatch(r"bytes=(\d*)-(\d*)",
                             (self.headers.get("Range") or "").strip())
        start, stop = 0, size
        if match and match.groups() != ("", ""):
            first, last = match.groups()
            if first == "":
                start = max(size - int(last), 0)
            else:
                start, stop = int(first), min(int(last) + 1 if last else size, size)
            if start >= stop:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Length", str(stop - start))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self._name = os.path.basename(path)
        return io.BytesIO(data[start:stop])

    def copyfile(self, source, outputfile) -> None:
        """The body, cut or stalled where ``faults`` says. A client that closes the
        connection at the fault, within 0.2 s of a cut or 0.5 s of a stall
        (``fsspec``'s ``_exists`` reads the head of a ``GET`` and closes), has not
        met it: a fault played once stays for the next response. A stall ends when
        its client closes."""
        body = source.read()
        name = getattr(self, "_name", "")
        sent, stall = self.faults.plan(name, len(body))
        outputfile.write(body[:sent])
        outputfile.flush()
        if stall == -2.0:
            if self._client_gone(0.2):
                self.faults.release(name)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        began = time.monotonic()
        end = began + (float("inf") if stall == -1.0 else stall)
        while time.monotonic() < end:
            if self._client_gone(min(0.1, end - time.monotonic())):
                if time.monotonic() - began < 0.5:  # gone at once: never met it
                    self.faults.release(name)
                return
        outputfile.write(body[sent:])

    def _client_gone(self, wait: float) -> bool:
        """Whether the client closed its end within ``wait`` seconds (it sends
        nothing after its request, so a readable socket with no data is its close)."""
        import select

        if not select.select([self.connection], [], [], max(wait, 0))[0]:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def finish(self) -> None:
        with contextlib.suppress(OSError):  # a connection this handler shut down
            super().finish()

    def log_message(self, *args) -> None:  # one line per request is noise here
        pass


class _Server(http.server.ThreadingHTTPServer):
    """``ThreadingHTTPServer`` that ``go_down`` stops from a handler's thread."""

    daemon_threads = True
    # http.server's default of 5 waiting connections makes a 6th concurrent client
    # wait about a second (an index over shards sends a batch's requests at once)
    request_queue_size = 128

    def go_down(self) -> None:
        """Stop accepting: ``serve`` closes the socket; wait until it has (2 s)."""
        threading.Thread(target=self.shutdown, daemon=True).start()
        self.faults.stopped.wait(2.0)


def serve(folder: str, port: int = 0, options: dict | None = None) -> None:
    """Serve ``folder`` on ``127.0.0.1:port`` (0: a free one) until stopped, playing
    the faults in ``options`` (``ShardServer``'s keywords); prints ``Serving HTTP on
    127.0.0.1 port N ...`` first, as ``python -m http.server``. With ``down``: the
    listening socket is closed for ``down`` seconds, then opened on the same port."""
    import functools

    faults = _Faults(options)
    handler = functools.partial(RangeRequestHandler, directory=folder, faults=faults)
    server = _Server(("127.0.0.1", port), handler)
    server.faults = faults
    port = server.server_address[1]
    print(f"Serving HTTP on 127.0.0.1 port {port} (http://127.0.0.1:{port}/) ...",
          flush=True)
    while True:
        server.serve_forever(poll_interval=0.05)
        server.server_close()  # connections are refused from here
        faults.stopped.set()
        time.sleep(faults.options["down"])
        server = _Server(("127.0.0.1", port), handler)
        server.faults = faults


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m utils.streams",
                                     description="Serve FOLDER on 127.0.0.1.")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("folder")
    parser.add_argument("--options", default="{}",
                        help="faults, as JSON: ShardServer's keywords")
    cli = parser.parse_args()
    serve(cli.folder, options=json.loads(cli.options))
