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
shard has no index, so each rank counts the samples of its own shards once, at the
start (a read of its share of the data), and the ranks sum the counts into one table
of every shard's count (``shard_counts``). From that table every rank computes the
same ``steps_per_epoch`` (``steps_per_epoch``): the least number of whole batches of
any rank (its workers' samples // the per-process batch, summed over the workers:
each worker's last partial batch is dropped), and every rank ends its epoch there
(``EpochBatches``). The dealing is the same every epoch, so the number is too, and the
one-cycle schedule knows it from the start. The shard count must be a multiple of
``R x W`` (``check_dealing``), so every reader gets as many shards: with shards of
equal size an epoch trains on every sample but each worker's last partial batch; a
rank that holds more samples than the least loses its excess every epoch. The run's
first lines say how many images an epoch trains on, of how many.

Augmentation: ``KeyedAugment``'s, keyed by the index in the sample's ``__key__``
(``StreamAugment``): a sample becomes the same image as in the CIFAR format.

Resuming. A stream has no position to restart from: a run resumes from a checkpoint
written at an epoch's end, with the same number of processes and ``--workers`` (the
same steps per epoch; ``check_resume`` refuses others, and a checkpoint written
mid-epoch). ``--checkpoint-every`` is refused up front, and a stop mid-epoch
(``--stop-at-step``, a signal) writes no checkpoint: the last epoch's stays.
"""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..devices import collective_device
from ..seeding import derive_seed
from .augment import KeyedAugment

if TYPE_CHECKING:
    from .steps import Job


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


def shard_counts(urls: list[str], job: Job) -> list[int]:
    """Every shard's sample count, on every rank: each rank counts ``urls[rank::world
    size]`` and the ranks sum the table (the ranks must name as many shards)."""
    device = collective_device() if job.ddp else "cpu"
    if job.ddp:
        sizes = torch.tensor([len(urls), -len(urls)], dtype=torch.int64, device=device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        if int(sizes[0]) != -int(sizes[1]):
            raise SystemExit(f"error: --shards names {-int(sizes[1])} to "
                             f"{int(sizes[0])} shards on different ranks; give every "
                             f"node the same --shards")
    counts = torch.zeros(len(urls), dtype=torch.int64)
    for i in range(job.rank, len(urls), job.world_size):
        counts[i] = count_samples(urls[i])
    counts = counts.to(device)
    if job.ddp:
        dist.all_reduce(counts)
    return counts.tolist()


def steps_per_epoch(counts: list[int], world_size: int, workers: int,
                    batch_size: int) -> int:
    """The least number of whole batches of ``batch_size`` that any rank's workers
    yield in an epoch (each worker batches its own samples and drops its last partial
    batch): the steps every rank runs."""
    readers = max(workers, 1)
    return min(sum(sum(deal(counts, rank, world_size, w, readers)) // batch_size
                   for w in range(readers))
               for rank in range(world_size))


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
    DataLoader worker, that worker's share (``deal``). ``len``: the samples of every
    shard, all ranks together."""

    def __init__(self, urls: list[str], counts: list[int], seed: int, job: Job,
                 workers: int):
        self.urls, self.counts, self.seed = urls, counts, seed
        self.rank, self.world_size, self.workers = job.rank, job.world_size, workers
        self.steps_per_epoch = steps_per_epoch(counts, job.world_size, workers,
                                               job.batch_size)
        self.augment = StreamAugment(seed)
        self.epoch = 0

    def __len__(self) -> int:
        return sum(self.counts)

    def set_epoch(self, epoch: int, step_in_epoch: int = 0) -> None:
        if step_in_epoch:  # check_resume refuses such a checkpoint before
            raise RuntimeError("a stream of shards cannot start mid-epoch")
        self.epoch = epoch

    def __iter__(self):
        import webdataset as wds

        info = get_worker_info()
        worker = 0 if info is None else info.id
        seed = derive_seed(self.seed, self.epoch, self.rank, worker)
        urls = deal(self.urls, self.rank, self.world_size, worker,
                    max(self.workers, 1))
        random.Random(seed).shuffle(urls)  # this epoch's order of this reader's shards
        samples = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None,
                                  workersplitter=None, empty_check=False)
                   .shuffle(SHUFFLE_BUFFER, seed=seed).decode("rgb8")
                   .to_tuple("__key__", IMAGE_KEYS, "cls"))
        for key, image, label in samples:
            yield self.augment(self.epoch, sample_index(key), image, label)


class EpochBatches:
    """The first ``steps`` batches of ``loader``: this rank's epoch, as long as every
    other rank's. Fewer is an error, not a shorter epoch (which would hang the
    others)."""

    def __init__(self, loader: DataLoader, steps: int):
        self.loader, self.steps = loader, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        batches = iter(self.loader)  # dropped after the last step: its workers stop
        for step in range(self.steps):
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(f"the shards gave {step} batches of the "
                                   f"{self.steps} counted at the start: did they "
                                   f"change during the run?")
            yield batch


def open_shards(args, job: Job) -> tuple[ShardStream, str]:
    """``(stream, why)``: the shards of ``--shards``, checked, counted and dealt;
    ``why`` says how, and how many images an epoch trains on."""
    urls = expand_shards(args.shards)
    check_dealing(len(urls), job.world_size, args.workers)
    stream = ShardStream(urls, shard_counts(urls, job), args.seed, job, args.workers)
    total = len(stream)
    if stream.steps_per_epoch == 0:
        raise SystemExit(f"error: the {total} images of {len(urls)} shards give some "
                         f"rank's workers not one whole batch of {job.batch_size} "
                         f"(--global-batch {args.global_batch}); use fewer "
                         f"--workers or a smaller --global-batch")
    trained = stream.steps_per_epoch * job.batch_size * job.world_size
    why = (f"--data-format webdataset: {len(urls)} shards dealt to "
           f"{job.world_size} process(es) x {max(args.workers, 1)} reader(s); "
           f"{trained} of {total} images an epoch")
    return stream, why


def stream_loader(stream: ShardStream, job: Job, loader_kwargs: dict) -> EpochBatches:
    """A DataLoader over the stream, cut to the steps every rank runs. Its workers
    start anew each epoch: each takes the stream with the epoch it is set to."""
    loader = DataLoader(stream, batch_size=job.batch_size, drop_last=True,
                        **{**loader_kwargs, "persistent_workers": False})
    return EpochBatches(loader, stream.steps_per_epoch)


def check_resume(state: dict, steps: int, path: str) -> None:
    """Refuse a checkpoint that a stream of shards cannot go on from: one written
    mid-epoch, or by a run with another number of steps per epoch."""
    if state["step_in_epoch"]:
        raise SystemExit(
            f"error: cannot resume {path} with --data-format webdataset: it was "
            f"written mid-epoch (step {state['step_in_epoch']} of epoch "
            f"{state['epoch']}), and a stream of shards has no position to restart "
            f"from (it would repeat or skip samples). Resume from a checkpoint "
            f"written at an epoch's end, or start a new run with another --out")
    if state["step"] != state["epoch"] * steps:
        raise SystemExit(
            f"error: cannot resume {path}: its run had "
            f"{state['step'] // max(state['epoch'], 1)} steps an epoch, this one has "
            f"{steps} (the shards are dealt to processes x --workers); resume on "
            f"{state.get('world_size', 'its')} processes with its --workers")
