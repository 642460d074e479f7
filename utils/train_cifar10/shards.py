"""Training from WebDataset shards: --data-format webdataset.

The shards (a brace pattern or a comma list of URLs or paths, ``expand_shards``) are
read by WebDataset's own pipeline (over HTTP with curl) in the DataLoader workers; the
test set stays the CIFAR-format one in ``--data``.

Dealing. Rank ``r`` of ``R`` takes ``urls[r::R]`` and its worker ``w`` of ``W`` takes
``[w::W]`` of those (``deal``), as WebDataset's ``split_by_node`` and
``split_by_worker`` do, from the rank and worker this process knows (not from the
environment), and in WebDataset's order: shards are dealt first, then each reader
shuffles its own, so a shard stays with one reader for the whole run. Each epoch a
reader shuffles its shards' order and passes their samples through a buffer of
``SHUFFLE_BUFFER``, both seeded by ``(seed, epoch, rank, worker)``: a run is
reproducible, and one resumed at an epoch's end goes on as if it never stopped.

Equal steps. Every rank must run the same number of steps in an epoch, or one that
runs more waits in a collective the others never reach: a hang (chapter 4). A tar
shard has no index; its count of samples comes from the shards' manifest
(``utils.manifest``: ``--manifest``, by default ``manifest.json`` beside the shards),
which every rank reads instead of the shards (``manifest_counts``). Without one, each
rank counts the samples of its own shards once, at the start (a read of its share of
the data), and the ranks sum the counts (``shard_counts``). From that table of every
shard's count every rank computes the same ``steps_per_epoch`` (``steps_per_epoch``):
the least number of whole batches of any rank (its workers' samples // the
per-process batch, summed over the workers: each worker's last partial batch is
dropped, ``reader_batches``), and every rank ends its epoch there (``EpochBatches``).
The dealing is the same every epoch, so the number is too, and the one-cycle schedule
knows it from the start. The shard count must be a multiple of ``R x W``
(``check_dealing``), so every reader gets as many shards: with shards of equal size an
epoch trains on every sample but each worker's last partial batch; a rank that holds
more samples than the least loses its excess every epoch. The run's first lines say
how many images an epoch trains on, of how many, and where the counts came from.

Augmentation: ``KeyedAugment``'s, keyed by the index in the sample's ``__key__``
(``StreamAugment``): a sample becomes the same image as in the CIFAR format.

Resuming, by a seeded replay. A stream has no position to restart from, but each
reader's order is a function of ``(seed, epoch, rank, worker)`` and of its fixed
shards, and torch's in-order DataLoader takes its batches from its workers in turn
(``0, 1, ..., W-1, 0, ...``, passing over a worker that has ended): after ``s`` steps
of an epoch reader ``w`` has given ``b_w`` batches (``batches_taken``). A run resumed
there rebuilds each reader's stream for that epoch and drops its first ``b_w x``
batch samples after the shuffle buffer, before they are decoded or augmented, and
the DataLoader's worker ``k`` plays reader ``(next + k) % W``, where ``next`` would
have given step ``s + 1``: the remaining ``steps_per_epoch - s`` batches come in the
order of a run that never stopped, so ``--checkpoint-every`` and a stop mid-epoch
(``--stop-at-step``, a signal) write checkpoints that resume exactly. The replay reads
the epoch's shards again up to there (their bytes, not their decoding). It needs the
same dealing: ``check_resume`` refuses a checkpoint written mid-epoch by another
number of processes or of ``--workers``, and one of a run with another number of
steps per epoch (at an epoch's end, another ``--workers`` with as many steps is let
through: the next epoch is dealt anew).
"""

from __future__ import annotations

import hashlib
import os
import random
import urllib.error
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..devices import collective_device
from ..manifest import MANIFEST, load_manifest
from ..seeding import derive_seed
from .augment import KeyedAugment

if TYPE_CHECKING:
    from .job import Job


SHUFFLE_BUFFER = 1000  # samples in each reader's shuffle buffer
IMAGE_KEYS = "npy;png;jpg;jpeg"  # the image of a sample: the first of these it has


def expand_shards(spec: str) -> list[str]:
    """The shards that ``--shards`` names: comma-separated parts (a comma inside
    braces belongs to the pattern), each brace-expanded:
    ``http://host:port/train-{000000..000007}.tar``, ``a.tar,b.tar``."""
    from braceexpand import braceexpand

    parts, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    parts.append(spec[start:])
    return [url for part in parts if part.strip()
            for url in braceexpand(part.strip())]


def deal(items, rank: int, world_size: int, worker: int, workers: int) -> list:
    """What reader ``worker`` of rank ``rank`` takes: ``items[rank::world_size]``, then
    ``[worker::workers]`` of that (``workers``: at least 1)."""
    return list(items)[rank::world_size][worker::workers]


def check_dealing(shards: int, world_size: int, workers: int) -> None:
    """Stop with a message unless every reader gets as many shards."""
    readers = world_size * max(workers, 1)
    if shards % readers:
        fits = [w for w in range(1, 9) if shards % (world_size * w) == 0]
        hint = (f"--workers {' or '.join(map(str, fits))}, or " if fits else "")
        raise SystemExit(
            f"error: --data-format webdataset: {shards} shards do not deal evenly to "
            f"{world_size} process(es) x {max(workers, 1)} DataLoader worker(s) "
            f"({readers} readers): each reader must get as many shards, or the ranks' "
            f"numbers of batches drift apart; use {hint}a shard count that is a "
            f"multiple of {readers}")


def count_samples(url: str) -> int:
    """The samples in one shard: a read of the whole tar (it has no index)."""
    import webdataset as wds

    shard = wds.WebDataset([url], shardshuffle=False, nodesplitter=None,
                           workersplitter=None, empty_check=False)
    return sum(1 for _ in shard)


def default_manifest(urls: list[str]) -> str:
    """``manifest.json`` beside the shards: their common URL or folder prefix (up to
    its last ``/``) + ``manifest.json``."""
    prefix = os.path.commonprefix(list(urls))
    return prefix[:prefix.rfind("/") + 1] + MANIFEST


def read_manifest(where: str, required: bool) -> dict | None:
    """The manifest at ``where`` (a path or an ``http(s)://`` URL); ``None`` if there
    is none (no file, 404), unless it is ``required`` (``--manifest`` named it)."""
    try:
        return load_manifest(where)
    except (FileNotFoundError, urllib.error.HTTPError) as exc:
        if getattr(exc, "code", 404) != 404:
            raise SystemExit(f"error: cannot read the manifest {where}: {exc}")
        if required:
            raise SystemExit(f"error: --manifest {where}: {exc}")
        return None
    except (OSError, ValueError) as exc:  # unreachable, or not a manifest
        raise SystemExit(f"error: cannot read the manifest {where}: "
                         f"{type(exc).__name__}: {exc}")


def manifest_counts(urls: list[str], manifest: dict, where: str) -> list[int]:
    """Each shard's ``samples`` in ``manifest``, matched by file name (the URL's or
    path's last part); a shard it does not list stops the run, named."""
    listed = {entry["name"]: entry["samples"] for entry in manifest["shards"]}
    for url in urls:
        name = url.rsplit("/", 1)[-1]
        if name not in listed:
            raise SystemExit(
                f"error: shard {name} ({url}) is not in the manifest {where}, which "
                f"lists {len(listed)} shard(s) ({', '.join(list(listed)[:3])}"
                f"{', ...' if len(listed) > 3 else ''}): write the manifest again "
                f"for these shards, or name theirs with --manifest")
    return [int(listed[url.rsplit("/", 1)[-1]]) for url in urls]


def no_manifest_line(urls: list[str], where: str) -> str:
    """What a run without a manifest says: that it reads the shards to count, and the
    command that writes one (run where the shards are files)."""
    folder = os.path.dirname(where) or "."
    if where.startswith(("http://", "https://")):
        folder = "FOLDER"  # the folder the server serves
    suffix = os.path.splitext(urls[0])[1] or ".tar"
    return (f"--data-format webdataset: no manifest at {where}: reading every shard "
            f"to count its samples; write one beside the shards once: python -c "
            f"\"import os; from utils.manifest import write_manifest as w; "
            f"d = '{folder}'; w(d, sorted(n for n in os.listdir(d) "
            f"if n.endswith('{suffix}')))\"")


def shard_counts(urls: list[str], job: Job, listed: list[int] | None = None
                 ) -> list[int]:
    """Every shard's sample count, on every rank: ``listed`` (the manifest's), or each
    rank counts ``urls[rank::world size]`` and the ranks sum the table. The ranks must
    name as many shards, and all have a manifest or none."""
    device = collective_device() if job.ddp else "cpu"
    if job.ddp:
        mine = [len(urls), int(listed is not None)]
        sizes = torch.tensor([*mine, *(-v for v in mine)], dtype=torch.int64,
                             device=device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        if int(sizes[0]) != -int(sizes[2]):
            raise SystemExit(f"error: --shards names {-int(sizes[2])} to "
                             f"{int(sizes[0])} shards on different ranks; give every "
                             f"node the same --shards")
        if int(sizes[1]) != -int(sizes[3]):
            raise SystemExit("error: some ranks found the shards' manifest and some "
                             "did not; give every node the same --manifest")
    if listed is not None:
        return list(listed)
    counts = torch.zeros(len(urls), dtype=torch.int64)
    for i in range(job.rank, len(urls), job.world_size):
        counts[i] = count_samples(urls[i])
    counts = counts.to(device)
    if job.ddp:
        dist.all_reduce(counts)
    return counts.tolist()


def reader_batches(counts: list[int], rank: int, world_size: int, workers: int,
                   batch_size: int) -> list[int]:
    """The whole batches of ``batch_size`` that each reader (DataLoader worker) of
    ``rank`` gives in an epoch: its shards' samples // ``batch_size``."""
    readers = max(workers, 1)
    return [sum(deal(counts, rank, world_size, w, readers)) // batch_size
            for w in range(readers)]


def steps_per_epoch(counts: list[int], world_size: int, workers: int,
                    batch_size: int) -> int:
    """The least number of whole batches of ``batch_size`` that any rank's workers
    yield in an epoch (each worker batches its own samples and drops its last partial
    batch): the steps every rank runs."""
    return min(sum(reader_batches(counts, rank, world_size, workers, batch_size))
               for rank in range(world_size))


def batches_taken(batches: list[int], steps: int) -> tuple[list[int], int]:
    """``(taken, next)`` after ``steps`` batches of an in-order DataLoader whose
    readers give ``batches[w]`` batches each: how many batches each has given, and the
    reader the DataLoader asks next. It asks its workers in turn, ``0, 1, ..., W-1, 0,
    ...``, passing over those that have ended (torch's
    ``_MultiProcessingDataLoaderIter``: ``_try_put_index``, ``_next_data``)."""
    if not 0 <= steps <= sum(batches):
        raise ValueError(f"steps={steps} is out of range; the readers give "
                         f"{sum(batches)} batches in all ({batches})")
    taken, reader = [0] * len(batches), 0
    for step in range(steps + 1):
        while taken[reader] == batches[reader] and step < sum(batches):
            reader = (reader + 1) % len(batches)  # ended: passed over
        if step == steps:
            return taken, reader
        taken[reader] += 1
        reader = (reader + 1) % len(batches)


def sample_index(key: str) -> int:
    """The index a sample's augmentation is keyed by: its ``__key__`` as a number
    (``"000042"``: 42), else a number drawn from the key's bytes."""
    if key.isascii() and key.isdigit():
        return int(key)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "big")


class StreamAugment(KeyedAugment):
    """``KeyedAugment`` for samples that arrive one at a time with their index: the
    same crop, flip and normalisation, keyed by ``(seed, epoch, index)``."""

    def __init__(self, seed: int):
        super().__init__(SimpleNamespace(data={}, targets=[]), seed, train=True)

    def __call__(self, epoch: int, index: int, image, label: int):
        # KeyedAugment reads data[index] and targets[index]: this sample
        self.data, self.targets = {index: image}, {index: int(label)}
        return self[(epoch, index)]


class ShardStream(IterableDataset):
    """This rank's share of the shards, as augmented ``(image, label)`` samples; in a
    DataLoader worker, that worker's share (``deal``), from the epoch's step
    ``start_step`` on (``set_epoch``). ``len``: the samples of every shard, all ranks
    together."""

    def __init__(self, urls: list[str], counts: list[int], seed: int, job: Job,
                 workers: int):
        self.urls, self.counts, self.seed = urls, counts, seed
        self.rank, self.world_size, self.workers = job.rank, job.world_size, workers
        self.batch_size = job.batch_size
        self.steps_per_epoch = steps_per_epoch(counts, job.world_size, workers,
                                               job.batch_size)
        self.augment = StreamAugment(seed)
        self.epoch = self.start_step = 0

    def __len__(self) -> int:
        return sum(self.counts)

    def set_epoch(self, epoch: int, step_in_epoch: int = 0) -> None:
        """Start at step ``step_in_epoch`` (from 0) of ``epoch``: the readers replay
        the epoch's seeded streams and drop what the steps before took."""
        if not 0 <= step_in_epoch < self.steps_per_epoch:
            raise ValueError(f"step_in_epoch={step_in_epoch} is out of range; an "
                             f"epoch has {self.steps_per_epoch} steps")
        self.epoch, self.start_step = epoch, step_in_epoch

    def reader_and_skip(self, worker: int) -> tuple[int, int]:
        """``(reader, samples)``: the reader DataLoader worker ``worker`` plays, and
        how many of its samples the epoch's steps before ``start_step`` took."""
        batches = reader_batches(self.counts, self.rank, self.world_size,
                                 self.workers, self.batch_size)
        taken, first = batches_taken(batches, self.start_step)
        reader = (first + worker) % len(batches)
        return reader, taken[reader] * self.batch_size

    def __iter__(self):
        import webdataset as wds

        info = get_worker_info()
        reader, skip = self.reader_and_skip(0 if info is None else info.id)
        seed = derive_seed(self.seed, self.epoch, self.rank, reader)
        urls = deal(self.urls, self.rank, self.world_size, reader,
                    max(self.workers, 1))
        random.Random(seed).shuffle(urls)  # this epoch's order of this reader's shards
        samples = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None,
                                  workersplitter=None, empty_check=False)
                   .shuffle(SHUFFLE_BUFFER, seed=seed)
                   .slice(skip, None)  # taken before a resume: not decoded again
                   .decode("rgb8").to_tuple("__key__", IMAGE_KEYS, "cls"))
        for key, image, label in samples:
            yield self.augment(self.epoch, sample_index(key), image, label)


class EpochBatches:
    """The batches of ``loader`` from the stream's ``start_step`` to its
    ``steps_per_epoch``: this rank's epoch, as long as every other rank's. Fewer is an
    error, not a shorter epoch (which would hang the others)."""

    def __init__(self, loader: DataLoader, stream: ShardStream):
        self.loader, self.stream = loader, stream

    def __len__(self) -> int:
        return self.stream.steps_per_epoch - self.stream.start_step

    def __iter__(self):
        steps, start = len(self), self.stream.start_step
        batches = iter(self.loader)  # dropped after the last step: its workers stop
        for step in range(steps):
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(f"the shards gave {start + step} batches of the "
                                   f"{start + steps} counted at the start: did they "
                                   f"change during the run?")
            yield batch


def open_shards(args, job: Job) -> tuple[ShardStream, str]:
    """``(stream, why)``: the shards of ``--shards``, checked, counted (from the
    manifest, else by a read) and dealt; ``why`` says how, and how many images an
    epoch trains on."""
    urls = expand_shards(args.shards)
    check_dealing(len(urls), job.world_size, args.workers)
    where = args.manifest or default_manifest(urls)
    manifest = read_manifest(where, required=args.manifest is not None)
    listed = None if manifest is None else manifest_counts(urls, manifest, where)
    if manifest is None and job.master:
        print(no_manifest_line(urls, where), flush=True)
    stream = ShardStream(urls, shard_counts(urls, job, listed), args.seed, job,
                         args.workers)
    total = len(stream)
    if stream.steps_per_epoch == 0:
        raise SystemExit(f"error: the {total} images of {len(urls)} shards give some "
                         f"rank's workers not one whole batch of {job.batch_size} "
                         f"(--global-batch {args.global_batch}); use fewer "
                         f"--workers or a smaller --global-batch")
    trained = stream.steps_per_epoch * job.batch_size * job.world_size
    why = (f"--data-format webdataset: {len(urls)} shards dealt to "
           f"{job.world_size} process(es) x {max(args.workers, 1)} reader(s); "
           f"{trained} of {total} images an epoch; counts "
           + ("read from the shards" if manifest is None else f"from {where}"))
    return stream, why


def stream_loader(stream: ShardStream, job: Job,
                  loader_kwargs: dict) -> EpochBatches:
    """A DataLoader over the stream, cut to the steps every rank runs. Its workers
    start anew each epoch: each takes the stream with the epoch (and the step) it is
    set to."""
    loader = DataLoader(stream, batch_size=job.batch_size, drop_last=True,
                        **{**loader_kwargs, "persistent_workers": False})
    return EpochBatches(loader, stream)


def check_resume(state: dict, steps: int, path: str, world_size: int,
                 workers: int) -> None:
    """Refuse a checkpoint that a stream of shards cannot go on from exactly: one of
    a run with another number of steps per epoch, or one written mid-epoch by another
    number of processes or ``--workers`` (another dealing: the replay would repeat or
    skip samples)."""
    epoch, step_in_epoch = state["epoch"], state["step_in_epoch"]
    before = state["step"] - step_in_epoch  # the steps of the epochs before
    if before != epoch * steps:
        raise SystemExit(
            f"error: cannot resume {path}: its run had "
            f"{before // max(epoch, 1)} steps an epoch, this one has "
            f"{steps} (the shards are dealt to processes x --workers); resume on "
            f"{state.get('world_size', 'its')} processes with its --workers")
    saved = (state.get("world_size"),  # None: a checkpoint that does not say
             None if state.get("workers") is None else max(state["workers"], 1))
    if step_in_epoch and saved != (world_size, max(workers, 1)):
        raise SystemExit(
            f"error: cannot resume {path} with --data-format webdataset: it was "
            f"written mid-epoch (step {step_in_epoch} of epoch {epoch}) by "
            f"{saved[0]} process(es) x {saved[1]} reader(s) (--workers), and this run "
            f"has {world_size} x {max(workers, 1)}: the shards are dealt to "
            f"processes x workers, so the epoch cannot be replayed to where it "
            f"stopped. Resume on {saved[0]} process(es) with --workers "
            f"{state.get('workers')}, or start a new run with another --out")
