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
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

from ._checks import check_int

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

    Use it as a context manager, or call ``close()``: the server process is stopped
    and waited for. ``url(name)`` is the address of one file."""

    def __init__(self, folder: str, timeout: float = 30.0):
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"no folder {folder!r} to serve")
        self.folder = folder
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "utils.streams", "serve", folder],
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


def webdataset_shard_orders(urls, persistent: bool, epochs: int = 2) -> list[list[int]]:
    """The shards (``sample_shard``) one DataLoader worker reads in each of ``epochs``
    epochs of WebDataset's own shard shuffle, ``WebDataset(urls, shardshuffle=100,
    detshuffle=True, seed=0)``, with ``persistent_workers=persistent``."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    from .workers import worker_context

    ds = wds.WebDataset(urls, shardshuffle=100, detshuffle=True, seed=0).map(
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


class RangeRequestHandler(http.server.SimpleHTTPRequestHandler):
    """``http.server``'s file handler, answering one byte range (``Range: bytes=a-b``,
    ``a-`` or ``-n``) with ``206 Partial Content``, as object stores and CDNs do;
    anything else as ``http.server`` does."""

    def send_head(self):
        match = re.fullmatch(r"bytes=(\d*)-(\d*)",
                             (self.headers.get("Range") or "").strip())
        path = self.translate_path(self.path)
        if not match or match.groups() == ("", "") or not os.path.isfile(path):
            return super().send_head()
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first, last = match.groups()
            if first == "":
                start, stop = max(size - int(last), 0), size
            else:
                start, stop = int(first), min(int(last) + 1 if last else size, size)
            if start >= stop:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            f.seek(start)
            body = f.read(stop - start)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return io.BytesIO(body)

    def log_message(self, *args) -> None:  # one line per request is noise here
        pass


def serve(folder: str, port: int = 0) -> None:
    """Serve ``folder`` on ``127.0.0.1:port`` (0: a free one) until stopped; prints
    ``Serving HTTP on 127.0.0.1 port N ...`` first, as ``python -m http.server``."""
    import functools

    http.server.test(HandlerClass=functools.partial(RangeRequestHandler,
                                                    directory=folder),
                     ServerClass=http.server.ThreadingHTTPServer, port=port,
                     bind="127.0.0.1")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit("usage: python -m utils.streams serve FOLDER")
    serve(sys.argv[2])
