"""How fast can data reach the model? Every way of feeding CIFAR-sized images, measured
in one run (``python -m utils.bench loader [--quick] --out FILE``).

The data is CIFAR-10 in its own on-disk format, loaded through torchvision's
``CIFAR10``: the synthetic stand-in of ``utils.data`` (written to a temporary folder)
unless ``--data`` names a folder that holds a data set. The methods:

- ``pil_dataloader``: RandomCrop(32, 4) + flip + ToTensor + Normalize on PIL images in a
  DataLoader, over ``num_workers`` from 0 to the core count, with and without
  ``persistent_workers`` (the time to the first batch of every epoch is recorded), with
  several ``prefetch_factor`` values, and with ``pin_memory`` where there is CUDA;
- ``tensor_aug_dataloader``: the same augmentation as whole-batch uint8 tensor
  operations on the batches a DataLoader of uint8 images yields (no PIL);
- ``resident_pipeline``: the whole data set as one uint8 tensor, shuffled by a
  permutation and augmented by whole-batch tensor operations, no workers; on the CPU
  here, on the GPU where there is one;
- on CUDA only: a plain ``.to(device)`` loop against ``prefetch_to_device`` (pinned
  memory, a side stream, ``wait_stream``, ``record_stream``), both feeding a small
  training step, and the step alone on data already on the GPU.

Every configuration is warmed up once, then timed ``repeats`` times in interleaved
rounds (each round times every configuration once, so a machine that gets busier slows
all of them alike); the median is reported, with each method's ratio to the best
DataLoader configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler
from torch.utils.data._utils.collate import default_collate

from ._checks import check_int
from . import results
from .results import environment as bench_environment
from .data import is_synthetic_cifar10, load_cifar10, write_synthetic_cifar10
from .gpu_loader import CIFAR_MEAN, CIFAR_STD, GPULoader, augment_batch, count_ops

__all__ = ["cifar10_pil", "pil_transform", "UInt8Images", "augment_loaded_batch",
           "round_ratios",
           "prefetch_to_device", "stage_times", "copy_bandwidth", "run_loader_bench",
           "format_table", "main"]

PAD = 4  # RandomCrop(32, padding=4)
BYTES_PER_IMAGE = 32 * 32 * 3  # uint8


# --- the two ways of augmenting ------------------------------------------------------

def cifar10_pil(root: str):
    """torchvision's ``CIFAR10`` training set under ``root`` with ``pil_transform()``,
    as an object that workers started with ``spawn`` can unpickle."""
    from torchvision.datasets import CIFAR10

    dataset = load_cifar10(root, train=True, transform=pil_transform())
    # load_cifar10 checks the generated files through a subclass defined in a function,
    # which pickle cannot name; once loaded, the object is an ordinary CIFAR10
    dataset.__class__ = CIFAR10
    return dataset


def pil_transform():
    """The usual CIFAR-10 training transform: PIL crop and flip, then tensor and
    normalise."""
    from torchvision import transforms as T

    return T.Compose([T.RandomCrop(32, padding=PAD), T.RandomHorizontalFlip(),
                      T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])


class UInt8Images(Dataset):
    """CIFAR images as uint8 ``(32, 32, 3)`` tensors, no PIL: sample ``i`` is
    ``(image, label, i)``; the index travels with the batch, so that the augmentation
    after the DataLoader can draw each image's crop from ``(seed, epoch, index)``.

    The images are one tensor, so workers started with ``spawn`` receive them through
    shared memory instead of a pickled copy each.
    """

    def __init__(self, data: np.ndarray, targets):
        if data.ndim != 4 or data.shape[3] != 3 or data.dtype != np.uint8:
            raise ValueError(f"expected uint8 images of shape (N, H, W, 3), got "
                             f"{data.dtype} {data.shape}")
        self.images = torch.from_numpy(np.ascontiguousarray(data))
        self.targets = torch.as_tensor(targets, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index], self.targets[index], index


def augment_loaded_batch(images: torch.Tensor, indices: torch.Tensor, seed: int,
                         epoch: int) -> torch.Tensor:
    """``utils.gpu_loader``'s whole-batch augmentation (crop with zero padding, flip,
    /255, normalise) of a batch a DataLoader collated: ``images`` uint8
    ``(B, H, W, C)``, ``indices`` the data set indices of its images, whose
    ``(seed, epoch, index)`` keys draw the crops and flips. Float32 ``(B, C, H, W)``.
    """
    images = images.contiguous()
    positions = torch.arange(len(images), device=images.device)
    return augment_batch(images, positions, seed, epoch, keys=indices, padding=PAD,
                         mean=CIFAR_MEAN, std=CIFAR_STD)


# --- feeding a GPU: a side-stream prefetcher -----------------------------------------

def prefetch_to_device(batches: Iterable, device) -> Iterator[list[torch.Tensor]]:
    """The batches of ``batches`` (sequences of tensors) on ``device``, the next one's
    copy already under way while the current one is used.

    On CUDA the copy runs on a side stream from pinned memory (``non_blocking``); the
    consumer's stream waits for it (``wait_stream``) and ``record_stream`` tells the
    caching allocator that the consumer's stream uses the memory, so it is not handed
    out again before that stream is done with it. One iterator over ``batches`` per
    call: its workers, and their own read-ahead, stay the same all epoch. On other
    devices it moves each batch in turn: there is no copy engine to overlap.
    """
    device = torch.device(device)
    source = iter(batches)
    if device.type != "cuda":
        for batch in source:
            yield [t.to(device) for t in batch]
        return
    side = torch.cuda.Stream(device)

    def start_copy():
        batch = next(source, None)
        if batch is None:
            return None
        # a pageable tensor cannot be copied asynchronously: pin it (a CPU copy; a
        # DataLoader with pin_memory=True does it in a background thread instead)
        batch = [t if t.is_pinned() else t.pin_memory() for t in batch]
        with torch.cuda.stream(side):
            return [t.to(device, non_blocking=True) for t in batch]

    upcoming = start_copy()
    while upcoming is not None:
        consumer = torch.cuda.current_stream(device)
        consumer.wait_stream(side)  # this batch's copy is complete before any use
        for t in upcoming:
            t.record_stream(consumer)
        current, upcoming = upcoming, start_copy()  # next copy overlaps this step
        yield current


# --- where the time goes, per sample --------------------------------------------------

def stage_times(data: np.ndarray, samples: int = 2048, batch_size: int = 256,
                repeats: int = 3, device=None) -> dict:
    """Microseconds per sample spent in each stage of the PIL pipeline: ``decode``
    (the array to a PIL image, all that torchvision's CIFAR10 does to read one),
    ``pil_ops`` (crop with padding, flip), ``to_tensor``, ``normalize``, ``collate``
    (stacking a batch, per sample) and, on CUDA, ``pin`` and ``transfer`` (per sample of
    a pinned batch copied to the GPU). Median over ``repeats`` rounds.

    The CPU stages are timed in this thread's CPU time, which other processes on a busy
    machine do not inflate; ``pin`` and ``transfer`` in wall-clock time (the GPU's).
    """
    from PIL import Image
    from torchvision import transforms as T

    samples = check_int("samples", samples, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    repeats = check_int("repeats", repeats, minimum=1)
    device = torch.device(device or "cpu")
    crop, flip = T.RandomCrop(32, padding=PAD), T.RandomHorizontalFlip()
    to_tensor, normalize = T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)
    clock = time.thread_time
    rounds = []
    for _ in range(repeats):
        spent = dict.fromkeys(["decode", "pil_ops", "to_tensor", "normalize"], 0.0)
        tensors = []
        for i in range(samples):
            t0 = clock()
            image = Image.fromarray(data[i % len(data)])
            t1 = clock()
            image = flip(crop(image))
            t2 = clock()
            x = to_tensor(image)
            t3 = clock()
            x = normalize(x)
            t4 = clock()
            spent["decode"] += t1 - t0
            spent["pil_ops"] += t2 - t1
            spent["to_tensor"] += t3 - t2
            spent["normalize"] += t4 - t3
            tensors.append((x, 0))
        batches = [tensors[k:k + batch_size] for k in range(0, samples, batch_size)]
        t0 = clock()
        collated = [default_collate(b) for b in batches]
        spent["collate"] = clock() - t0
        if device.type == "cuda":
            t0 = time.perf_counter()
            pinned = [b[0].pin_memory() for b in collated]
            spent["pin"] = time.perf_counter() - t0
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for b in pinned:
                b.to(device, non_blocking=True)
            torch.cuda.synchronize(device)
            spent["transfer"] = time.perf_counter() - t0
        rounds.append({k: 1e6 * v / samples for k, v in spent.items()})
    return {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}


def copy_bandwidth(device="cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second that ``dst.copy_(src)`` moves on ``device`` (median): the
    memory system's own speed, a floor no loader goes below."""
    device = torch.device(device)
    n = check_int("megabytes", megabytes, minimum=1) * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return n / statistics.median(seconds[1:])


def _host_to_device_bandwidth(device, nbytes: int, repeats: int = 5) -> dict:
    """Seconds and bytes per second of one pinned and one pageable copy of
    ``nbytes`` to the GPU."""
    out = {}
    for kind in ("pinned", "pageable"):
        host = torch.ones(nbytes, dtype=torch.uint8)
        if kind == "pinned":
            host = host.pin_memory()
        seconds = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            host.to(device, non_blocking=kind == "pinned")
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        s = statistics.median(seconds[1:])
        out[kind] = {"seconds": round(s, 6), "bytes_per_s": round(nbytes / s)}
    return out


def _load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (runnable processes), where the OS
    reports them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- the benchmark --------------------------------------------------------------------

class _Case:
    """One configuration: its description, and ``run_pass(epoch)``, which runs one
    timed pass and returns (images, seconds to the first batch). Each pass records its
    wall time and the CPU time of this process (all its threads, not its workers)."""

    def __init__(self, info: dict, run_pass: Callable[[int], tuple[int, float]],
                 threads: int, device: torch.device):
        self.info, self.run_pass = info, run_pass
        self.threads, self.device = threads, device
        self.seconds, self.cpu_seconds, self.first_batch = [], [], []

    def timed(self) -> None:
        with _threads(self.threads):
            _sync(self.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            images, first = self.run_pass(len(self.seconds))
            _sync(self.device)
            self.seconds.append(time.perf_counter() - start)
            self.cpu_seconds.append(time.process_time() - cpu_start)
        self.images = images
        self.first_batch.append(first)

    def result(self, warmup: int) -> dict:
        median = statistics.median(self.seconds[warmup:])
        cpu_median = statistics.median(self.cpu_seconds[warmup:])
        timing = {"ms_per_pass": round(1000 * median, 3)}
        if "epoch_images" in self.info:  # a pass is one epoch of the data set
            timing["ms_per_epoch"] = timing["ms_per_pass"]
        return {**self.info, "threads": self.threads, "images_per_pass": self.images,
                "images_per_s": round(self.images / median, 1), **timing,
                # per second of this process's CPU time: a per-core rate that other
                # jobs on the machine do not dilute (with num_workers=0 and one thread)
                "images_per_main_cpu_s": round(self.images / max(cpu_median, 1e-9), 1),
                "pass_s": [round(s, 5) for s in self.seconds],
                "main_cpu_s": [round(s, 5) for s in self.cpu_seconds],
                "first_batch_s": [round(s, 5) for s in self.first_batch],
                "warmup_passes": warmup}


def _pass(batches: Callable[[int], Iterable], consume: Callable,
          device: torch.device | None = None) -> Callable:
    """``run_pass(epoch)``: iterate ``batches(epoch)``, hand each batch to
    ``consume(batch, epoch)``; (images, seconds to the first batch: ready on
    ``device``, not only queued)."""
    def run_pass(epoch):
        start = time.perf_counter()
        images, first = 0, None
        for batch in batches(epoch):
            if first is None:
                if device is not None:
                    _sync(device)
                first = time.perf_counter() - start
            consume(batch, epoch)
            images += len(batch[0])
        return images, first
    return run_pass


def _nothing(batch, epoch) -> None:
    pass


def _training_step(device: torch.device):
    """A small convolutional network's forward, backward and SGD step: GPU work for the
    copies to overlap with."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch, epoch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


# what the figures depend on (utils.results records their hashes)
SOURCES = ["utils/loader_bench.py", "utils/gpu_loader.py"]

QUICK = {"n_train": 2048, "batch_size": 256, "pass_images": 1024, "repeats": 2,
         "warmup": 1, "prefetch_factors": [1, 2]}
FULL = {"n_train": 50000, "batch_size": 512, "pass_images": 10240, "repeats": 5,
        "warmup": 1, "prefetch_factors": [1, 2, 4, 8]}


def run_loader_bench(root: str | None = None, quick: bool = False, device=None,
                     n_train: int | None = None, batch_size: int | None = None,
                     pass_images: int | None = None, repeats: int | None = None,
                     workers: list[int] | None = None, stages: bool = True,
                     log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the loader benchmark; returns ``{"meta": ..., "results": [...], ...}``.

    ``root`` holds (or receives) the data set; ``None`` writes the synthetic one into a
    temporary folder. Sizes default to ``QUICK`` or ``FULL``; ``workers`` defaults to
    ``0 .. os.cpu_count()`` (``[0, os.cpu_count()]`` with ``quick``).
    """
    preset = QUICK if quick else FULL
    n_train = check_int("n_train", preset["n_train"] if n_train is None else n_train,
                        minimum=5)
    batch_size = check_int("batch_size",
                           preset["batch_size"] if batch_size is None else batch_size,
                           minimum=1)
    pass_images = check_int(
        "pass_images", preset["pass_images"] if pass_images is None else pass_images,
        minimum=batch_size)
    repeats = check_int("repeats", preset["repeats"] if repeats is None else repeats,
                        minimum=1)
    cores = os.cpu_count() or 1
    if workers is None:
        workers = [0, cores] if quick else list(range(cores + 1))
    workers = sorted({check_int("num_workers", w, minimum=0) for w in workers})
    if 0 not in workers:
        raise ValueError(f"workers={workers} must include 0: the per-core comparison "
                         f"runs both pipelines in the main process")
    if pass_images % batch_size:
        raise ValueError(f"pass_images={pass_images} is not a multiple of "
                         f"batch_size={batch_size}; every timed batch must be full")
    if pass_images > n_train:
        raise ValueError(f"pass_images={pass_images} is more than the data set's "
                         f"n_train={n_train} images")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device} is not supported; expected cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was asked for, but torch sees no CUDA device")

    with contextlib.ExitStack() as stack:
        if root is None:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="loader_"))
        if not os.path.isdir(os.path.join(root, "cifar-10-batches-py")):
            write_synthetic_cifar10(root, n_train=n_train, n_test=1, seed=0)
        pil_set = cifar10_pil(root)
        if len(pil_set) < pass_images:
            raise ValueError(f"{root} holds {len(pil_set)} training images, fewer than "
                             f"pass_images={pass_images}")
        synthetic = is_synthetic_cifar10(root)
        log(f"data: {'synthetic' if synthetic else 'real'} CIFAR-10, "
            f"{len(pil_set)} training images")
        settings = {"quick": quick, "workers": workers, "batch_size": batch_size,
                    "pass_images": pass_images, "repeats": repeats,
                    "warmup": preset["warmup"],
                    "prefetch_factors": preset["prefetch_factors"]}
        load_before = _load_average()
        result = _measure(pil_set, device, settings, stages, log)
        # other processes on the machine slow every configuration; ratios measured in
        # one run are what to compare
        result["meta"]["load_average"] = {"before": load_before,
                                          "after": _load_average()}
        result["meta"]["data"] = {
            "source": ("synthetic CIFAR-10 (utils.data.write_synthetic_cifar10)"
                       if synthetic else "CIFAR-10"),
            "synthetic": synthetic, "train_images": len(pil_set),
            "image_shape": [32, 32, 3], "dtype": "uint8"}
    return result


def _measure(pil_set, device, settings, stages, log) -> dict:
    """Build every configuration, time them in interleaved rounds, and report: the
    results, the targets, the floors and (with ``stages``) the per-sample stages."""
    g = torch.Generator().manual_seed(0)  # the sample order of every DataLoader
    # the main process's few tensor operations per sample are too small for intra-op
    # threads: on the CPU it runs with one thread, as the workers do
    main_threads = torch.get_num_threads() if device.type == "cuda" else 1
    cases, skipped = _pil_cases(pil_set, device, settings, g, main_threads)
    cases += _tensor_aug_cases(pil_set, device, settings, g, main_threads)
    cases += _resident_cases(pil_set, device, settings["batch_size"])
    if device.type == "cuda":
        cases += _cuda_cases(pil_set, device, settings["batch_size"],
                             settings["pass_images"])
    results = _time_cases(cases, settings["warmup"], settings["repeats"], log)
    del cases  # persistent workers end with their loaders
    return _report(results, skipped, settings, pil_set, device, stages)


def _sampled_loader(dataset, settings: dict, generator: torch.Generator,
                    **kwargs) -> DataLoader:
    """A DataLoader over ``pass_images`` random samples of ``dataset``, in full
    batches."""
    sampler = RandomSampler(range(len(dataset)), num_samples=settings["pass_images"],
                            generator=generator)
    return DataLoader(dataset, batch_size=settings["batch_size"], sampler=sampler,
                      drop_last=True, **kwargs)


def _to_device(batch, epoch, device: torch.device, non_blocking: bool = False) -> None:
    """Copy a batch's tensors to the GPU (nothing to do on the CPU)."""
    if device.type == "cuda":
        for t in batch:
            t.to(device, non_blocking=non_blocking)


def _pil_cases(pil_set, device, settings, g, main_threads) -> tuple[list, list]:
    """``(cases, skipped)``: the PIL pipeline through a DataLoader, over the worker
    counts, with and without persistent workers, several prefetch factors, and pinned
    memory where there is CUDA."""
    workers, batch_size = settings["workers"], settings["batch_size"]
    max_w = max(workers)
    configs = [(w, w > 0, 2 if w > 0 else None, False) for w in workers]
    configs += [(w, False, 2, False) for w in workers if w > 0]
    configs += [(max_w, True, p, False) for p in settings["prefetch_factors"]
                if p != 2 and max_w > 0]
    skipped = []
    if device.type == "cuda":
        configs += [(w, w > 0, 2 if w > 0 else None, True) for w in workers]
    else:
        skipped.append({"method": "pil_dataloader", "pin_memory": True,
                        "reason": "no CUDA device: pinned memory only speeds up "
                                  "copies to a GPU, and torch ignores pin_memory=True "
                                  "(with a warning) when there is none"})
    cases = []
    for w, persistent, prefetch, pin in configs:
        kwargs = dict(num_workers=w, pin_memory=pin, persistent_workers=persistent)
        if w > 0:
            kwargs["prefetch_factor"] = prefetch
        batches = _sampled_loader(pil_set, settings, g, **kwargs)
        info = {"method": "pil_dataloader", "device": device.type, "num_workers": w,
                "batch_size": batch_size, "pin_memory": pin,
                "persistent_workers": persistent, "prefetch_factor": prefetch}
        consume = functools.partial(_to_device, device=device, non_blocking=pin)
        cases.append(_Case(info, _pass(lambda epoch, b=batches: b, consume),
                           main_threads, device))
    return cases, skipped


def _tensor_aug_cases(pil_set, device, settings, g, main_threads) -> list:
    """The same augmentation as whole-batch tensor operations after a uint8
    DataLoader."""
    cuda = device.type == "cuda"
    tensor_set = UInt8Images(pil_set.data, pil_set.targets)

    def augment_after(batch, epoch):
        images, _, indices = batch
        if cuda:
            images = images.to(device, non_blocking=True)
            indices = indices.to(device, non_blocking=True)
        augment_loaded_batch(images, indices, 0, epoch)

    cases = []
    for w in settings["workers"]:
        batches = _sampled_loader(tensor_set, settings, g, num_workers=w,
                                  pin_memory=cuda, persistent_workers=w > 0)
        info = {"method": "tensor_aug_dataloader", "device": device.type,
                "num_workers": w, "batch_size": settings["batch_size"],
                "pin_memory": cuda, "persistent_workers": w > 0,
                "prefetch_factor": 2 if w > 0 else None}
        cases.append(_Case(info, _pass(lambda epoch, b=batches: b, augment_after),
                           main_threads, device))
    return cases


def _resident_cases(pil_set, device, batch_size) -> list:
    """The whole data set resident as one uint8 tensor (``utils.gpu_loader.GPULoader``):
    on the CPU with one thread and with every core, and on the GPU."""
    cores = os.cpu_count() or 1
    resident = [("cpu", 1)] + ([("cpu", cores)] if cores > 1 else [])
    if device.type == "cuda":
        resident.append(("cuda", torch.get_num_threads()))
    cases = []
    for where, threads in resident:
        resident_loader = GPULoader(pil_set.data, pil_set.targets, batch_size,
                                    num_replicas=1, rank=0, drop_last_batch=True,
                                    device=where)

        def epoch_batches(epoch, r=resident_loader):
            r.set_epoch(epoch)
            return r
        ops = count_ops(epoch_batches(0))  # the same on every device
        info = {"method": "resident_pipeline", "device": where, "num_workers": 0,
                "batch_size": batch_size, "pin_memory": False,
                "persistent_workers": False, "prefetch_factor": None,
                "epoch_images": len(resident_loader) * batch_size,
                "ops_per_batch": max(ops[1:], default=ops[0]),
                "ops_per_epoch": sum(ops)}
        cases.append(_Case(info, _pass(epoch_batches, _nothing, torch.device(where)),
                           threads, torch.device(where)))
    return cases


def _time_cases(cases: list, warmup: int, repeats: int, log) -> list[dict]:
    """Warm every case up, then time each once per round, ``repeats`` rounds; each
    case's result."""
    log(f"{len(cases)} configurations, {warmup} warm-up and {repeats} timed "
        f"passes each, interleaved")
    for case in cases:
        for _ in range(warmup):
            case.timed()
    for r in range(repeats):
        for case in cases:
            case.timed()
        log(f"round {r + 1} of {repeats} done")
    return [c.result(warmup) for c in cases]


def _report(results, skipped, settings, pil_set, device, stages) -> dict:
    """The benchmark's result: every configuration against the best DataLoader, the
    targets, the memory copy floors and (with ``stages``) the per-sample stages."""
    cuda = device.type == "cuda"
    best = max((r for r in results if r["method"] == "pil_dataloader"),
               key=lambda r: r["images_per_s"])
    for r in results:
        r["ratio_to_best_dataloader"] = round(r["images_per_s"] / best["images_per_s"],
                                              3)
    out = {"meta": {}, "settings": settings, "results": results, "skipped": skipped,
           "best_dataloader": {k: best[k] for k in ("num_workers", "pin_memory",
                                                    "persistent_workers",
                                                    "prefetch_factor",
                                                    "images_per_s")}}
    out["targets"] = _targets(results, best, cuda)
    out["floors"] = {"cpu_copy_bytes_per_s": round(copy_bandwidth("cpu")),
                     "cpu_copy_threads": torch.get_num_threads(),
                     "bytes_per_image_uint8": BYTES_PER_IMAGE,
                     "bytes_per_image_float32": 4 * BYTES_PER_IMAGE}
    if cuda:
        epoch_bytes = len(pil_set) * BYTES_PER_IMAGE
        out["floors"]["gpu_copy_bytes_per_s"] = round(copy_bandwidth(device))
        out["floors"]["host_to_device_uint8_epoch"] = {
            "bytes": epoch_bytes, **_host_to_device_bandwidth(device, epoch_bytes)}
    if stages:
        with _threads(1):
            out["stages_us_per_sample"] = stage_times(
                pil_set.data, samples=min(2048, settings["pass_images"]),
                batch_size=settings["batch_size"], device=device)
    return out


def host_batches(pil_set, batch_size: int, pass_images: int) -> list:
    """The first ``pass_images`` images of ``pil_set``, augmented in batches on the CPU:
    ``[(float32 images, labels), ...]``, the source of the host-to-device cases."""
    # the set's array is a view in (N, H, W, C) order of CIFAR's (N, C*H*W) rows: copied
    # into that order once, as the resident loaders hold it
    data = torch.from_numpy(np.ascontiguousarray(pil_set.data))
    targets = torch.as_tensor(pil_set.targets)
    batches = []
    for start in range(0, pass_images, batch_size):
        index = torch.arange(start, start + batch_size)
        batches.append((augment_batch(data, index, 0, 0), targets[index]))
    return batches


def _cuda_cases(pil_set, device, batch_size, pass_images) -> list:
    """A plain ``.to(device)`` loop (pageable memory, blocking copies), the same from
    pinned memory with ``non_blocking`` copies on the compute stream (pinning without
    overlap: the control), and ``prefetch_to_device`` (pinned, on a side stream), all
    feeding the same training step; and the step alone on data already on the GPU."""
    pageable = host_batches(pil_set, batch_size, pass_images)
    pinned = [(x.pin_memory(), y.pin_memory()) for x, y in pageable]
    on_gpu = [(x.to(device), y.to(device)) for x, y in pageable]
    step = _training_step(device)
    common = {"device": "cuda", "num_workers": 0, "batch_size": batch_size,
              "persistent_workers": False, "prefetch_factor": None,
              "step": "2 x Conv2d(64, 3x3) + linear head, forward, backward, SGD",
              "source": "float32 batches already augmented, in host memory"}

    def plain(epoch):
        return ((x.to(device), y.to(device)) for x, y in pageable)

    def pinned_same_stream(epoch):
        return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                for x, y in pinned)
    threads = torch.get_num_threads()
    return [
        _Case({**common, "method": "h2d_plain", "pin_memory": False},
              _pass(plain, step), threads, device),
        _Case({**common, "method": "h2d_pinned_same_stream", "pin_memory": True},
              _pass(pinned_same_stream, step), threads, device),
        _Case({**common, "method": "h2d_prefetcher", "pin_memory": True},
              _pass(lambda epoch: prefetch_to_device(pinned, device), step),
              threads, device),
        _Case({**common, "method": "step_only", "pin_memory": False,
               "source": "the same batches, already on the GPU"},
              _pass(lambda epoch: on_gpu, step), threads, device),
    ]


def _targets(results, best, cuda) -> dict:
    def find(method, **match):
        return next(r for r in results if r["method"] == method
                    and all(r[k] == v for k, v in match.items()))

    pil0 = find("pil_dataloader", num_workers=0, pin_memory=False)
    tensor0 = find("tensor_aug_dataloader", num_workers=0)
    cpu_resident = find("resident_pipeline", device="cpu", threads=1)
    def per_core(fast, what):
        return {
            "ratio": round(fast["images_per_main_cpu_s"]
                           / pil0["images_per_main_cpu_s"], 2),
            "ratio_wall_clock": round(fast["images_per_s"] / pil0["images_per_s"], 2),
            "images_per_cpu_s": fast["images_per_main_cpu_s"],
            "pil_images_per_cpu_s": pil0["images_per_main_cpu_s"],
            "definition": f"{what} over pil_dataloader, both with num_workers=0 and 1 "
                          f"torch thread, in images per second of the process's CPU "
                          f"time (ratio_wall_clock: per second of wall-clock time)"}

    targets = {
        "cpu_tensor_aug_vs_pil_per_core": per_core(tensor0, "tensor_aug_dataloader"),
        "cpu_resident_vs_pil_per_core": per_core(cpu_resident,
                                                 "resident_pipeline on the CPU"),
        "cpu_resident_vs_tensor_aug_per_core": {
            "ratio": round(cpu_resident["images_per_main_cpu_s"]
                           / tensor0["images_per_main_cpu_s"], 2),
            "definition": "resident_pipeline on the CPU over tensor_aug_dataloader, "
                          "both with num_workers=0 and 1 torch thread, in images per "
                          "second of the process's CPU time"},
    }
    if cuda:
        gpu = find("resident_pipeline", device="cuda")
        targets["gpu_resident_vs_best_dataloader"] = {
            "ratio": round(gpu["images_per_s"] / best["images_per_s"], 1),
            "epoch_images": gpu["epoch_images"],
            "epoch_ms": round(1000 * gpu["epoch_images"] / gpu["images_per_s"], 3)}
        plain, pre = find("h2d_plain"), find("h2d_prefetcher")
        targets["prefetcher_vs_plain_to_device"] = {
            "ratio": round(pre["images_per_s"] / plain["images_per_s"], 2),
            "prefetcher_vs_pinned_same_stream": round(
                pre["images_per_s"]
                / find("h2d_pinned_same_stream")["images_per_s"], 2),
            "prefetcher_vs_step_only": round(
                pre["images_per_s"] / find("step_only")["images_per_s"], 3)}
    return targets


# --- the report -----------------------------------------------------------------------

def _label(r: dict) -> str:
    if r["method"] == "pil_dataloader":
        parts = [f"w={r['num_workers']}"]
        if r["num_workers"]:
            parts += [f"prefetch {r['prefetch_factor']}",
                      "persistent" if r["persistent_workers"] else "not persistent"]
        if r["pin_memory"]:
            parts.append("pinned")
        return "PIL DataLoader, " + ", ".join(parts)
    if r["method"] == "tensor_aug_dataloader":
        return f"uint8 DataLoader + batch aug, w={r['num_workers']}"
    if r["method"] == "resident_pipeline":
        return f"resident, {r['device']}, {r['threads']} thread(s)"
    return {"h2d_plain": "plain .to(device) + step",
            "h2d_pinned_same_stream": "pinned, non_blocking, one stream + step",
            "h2d_prefetcher": "prefetch_to_device + step",
            "step_only": "step alone, data on the GPU"}[r["method"]]


def round_ratios(r: dict, reference: dict) -> list[float]:
    """``r``'s images/s over ``reference``'s, round by round (the timed passes, warm-up
    left out): each ratio compares two passes run side by side, so a machine that got
    busier between rounds slows both."""
    def rates(x):
        return [x["images_per_pass"] / s for s in x["pass_s"][x["warmup_passes"]:]]
    return [a / b for a, b in zip(rates(r), rates(reference))]


def _reference(result: dict) -> dict:
    """The fixed configuration every ratio of the table is taken against: the PIL
    pipeline in the main process (``num_workers=0``), which every run measures."""
    return next(r for r in result["results"] if r["method"] == "pil_dataloader"
                and r["num_workers"] == 0 and not r["pin_memory"])


def format_table(result: dict) -> str:
    """The results as a table: images/s (the median pass), the first batch of the last
    timed pass, and images/s over the PIL pipeline with no workers, round by round:
    the lowest, median and highest ratio."""
    reference = _reference(result)
    lines = [f"{'':<67}{'images/s over PIL w=0':>21}",
             f"{'method':<48}{'images/s':>9}{'1st batch':>10}{'round by round':>21}",
             f"{'':<67}{'min':>7}{'median':>7}{'max':>7}"]
    for r in result["results"]:
        ratios = sorted(round_ratios(r, reference))
        lines.append(f"{_label(r):<48}{r['images_per_s']:>9,.0f}"
                     f"{1000 * r['first_batch_s'][-1]:>8.1f}ms"
                     f"{ratios[0]:>7.2f}{statistics.median(ratios):>7.2f}"
                     f"{ratios[-1]:>7.2f}")
    t = result["targets"]["cpu_tensor_aug_vs_pil_per_core"]
    lines.append(f"CPU, one core each: whole-batch tensor augmentation / PIL pipeline "
                 f"= {t['ratio']:.2f}")
    lines.append(f"  (images per CPU second of the process; per wall-clock second "
                 f"{t['ratio_wall_clock']:.2f})")
    gpu = result["targets"].get("gpu_resident_vs_best_dataloader")
    if gpu:
        lines.append(f"GPU-resident epoch of {gpu['epoch_images']} images: "
                     f"{gpu['epoch_ms']:.2f} ms, {gpu['ratio']:.0f}x the best "
                     f"DataLoader")
    for s in result["skipped"]:
        lines.append(f"skipped {s['method']} pin_memory={s['pin_memory']}: no CUDA")
    return "\n".join(lines)


def environment() -> dict:
    """utils.bench's description of the machine, plus torchvision's and PIL's
    versions."""
    import PIL
    import torchvision

    return {**bench_environment(), "torchvision": torchvision.__version__,
            "pillow": PIL.__version__,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None}


def _workers_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected worker counts separated by commas, like 0,2,4; got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    """``python -m utils.bench loader``: run, print the table, save ``--out``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m utils.bench loader",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and workers 0 and the core count only "
                             "(under a minute on 2 cores)")
    parser.add_argument("--out", help="save the results as JSON here")
    parser.add_argument("--data", help="a folder holding cifar-10-batches-py (default: "
                                       "synthetic data in a temporary folder)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--workers", type=_workers_list,
                        help="worker counts to try, e.g. 0,4,8 (default 0 .. cores)")
    for name, what in [("--n-train", "images in the generated data set"),
                       ("--batch-size", "images per batch"),
                       ("--pass-images", "images per timed DataLoader pass"),
                       ("--repeats", "timed passes per configuration")]:
        parser.add_argument(name, type=int,
                            help=f"{what} (default {FULL[name[2:].replace('-', '_')]},"
                                 f" --quick {QUICK[name[2:].replace('-', '_')]})")
    args = parser.parse_args(argv)
    for name in ("n_train", "batch_size", "pass_images", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.data and not os.path.isdir(os.path.join(args.data, "cifar-10-batches-py")):
        parser.error(f"--data {args.data}: no cifar-10-batches-py folder there")
    try:
        result = run_loader_bench(
            args.data, quick=args.quick,
            device=None if args.device == "auto" else args.device,
            n_train=args.n_train, batch_size=args.batch_size,
            pass_images=args.pass_images, repeats=args.repeats, workers=args.workers,
            log=lambda s: print(s, flush=True))
    except ValueError as err:
        parser.error(str(err))
    result["meta"] = {**environment(),
                      "command": "python -m utils.bench loader " + " ".join(argv),
                      "date": _dt.datetime.now(_dt.timezone.utc).isoformat(
                          timespec="seconds"),
                      **result["meta"]}
    print(format_table(result))
    if args.out:
        results.write(args.out, result, SOURCES)
    return result


if __name__ == "__main__":
    main()
