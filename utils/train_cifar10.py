"""Train a CNN on CIFAR-10 with DistributedDataParallel: one script for a laptop, a GPU
server and a cluster.

    # one process
    python -m utils.train_cifar10 --data data --synthetic
    # one node, N processes
    torchrun --standalone --nproc_per_node=N -m utils.train_cifar10 ...
    # M nodes
    torchrun --nnodes=M --nproc_per_node=N --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:PORT -m utils.train_cifar10 ...

``RANK`` in the environment (set by torchrun) makes it a distributed run: ``nccl`` with
CUDA, ``gloo`` without (or with ``--device cpu``), one GPU per local rank. Local rank 0
of each node prepares the data. Rank 0 alone logs (a progress bar with images/s, and a
JSON-lines metrics file), writes checkpoints (atomically) and decides whether to resume,
for everyone. ``--global-batch`` is split over the processes and every global batch is
the same block of the epoch's order whatever their number, so a run may resume on
another number of processes. Every random choice is a function of the seed, the epoch
and the sample index (augmentations), or of the seed, step and rank (anything a model
draws), so a run killed and resumed from a checkpoint, on any number of workers, ends
with the same parameters as one that never stopped. Under torchrun's restarts each
attempt gets a store of its own (``attempt_store``); SIGTERM or SIGUSR1 makes every rank
stop after the same step (the ranks agree on it every ``STOP_CHECK_EVERY`` steps and
after an epoch's last step), with one checkpoint, ``preempted.json`` and exit code 75
(``EXIT_PREEMPTED``); ``examples/slurm/train_cifar10.sbatch`` runs it under SLURM.

Feeding the GPU: ``--loader gpu`` keeps the uint8 training set on the device and
augments whole batches there (``utils.gpu_loader.GPULoader``: the same sample order
as ``--loader workers``, other augmentation draws, also keyed by the seed, the epoch
and the index); ``--loader auto``, the default, takes it with CUDA when the training
set fits (see ``choose_loader``), else the DataLoader with worker processes. On CUDA
the model and its inputs use ``channels_last``. The training loop waits for the GPU only
where it must: the loss is summed on the device and read every ``--log-every`` steps
(progress bar) and at the end of each epoch, and a checkpoint (``--checkpoint-every``,
each epoch's end) copies the weights off it. ``--sync-bn`` (torch's SyncBatchNorm, off
by default) adds a collective to every BatchNorm layer's forward and backward, and
``--amp fp16``'s loss scaler reads its overflow flag every step: both make the host wait
for the GPU. ``--compile`` compiles the model.

Each epoch rank 0 writes one JSON line to ``OUT/metrics.jsonl``: ``epoch``, ``step``,
``train_loss`` (the mean over the epoch's steps and ranks), ``test_accuracy``,
``images_per_s``, ``epoch_seconds``, ``world_size``, ``data``, ``model``,
``device``, and ``loader`` (``gpu`` or ``workers``; added with ``--loader``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from .data import (download_cifar10, is_synthetic_cifar10, load_cifar10,
                   write_synthetic_cifar10)
from .devices import collective_device
from .devices import compile_problem
from .gpu_loader import CIFAR_MEAN, CIFAR_STD, GPULoader, resident_bytes
from .metrics import EvalShardSampler, sum_over_ranks
from .samplers import ShardSampler
from .seeding import derive_seed, sample_generator, seed_everything
from .workers import STOP_SIGNALS, WatchParent, ignore_stop_signals, worker_context

CHECKPOINT = "checkpoint.pt"
PREEMPTED = "preempted.json"  # rank 0 writes it when a signal stopped the run
# the exit code of every rank stopped by SIGTERM or SIGUSR1 after its checkpoint:
# sysexits' EX_TEMPFAIL, "a temporary failure: try again later" (with --resume)
EXIT_PREEMPTED = 75


def parse_args(argv=None) -> argparse.Namespace:
    # the docstring's first paragraph (argparse re-flows it onto one line)
    p = argparse.ArgumentParser(prog="python -m utils.train_cifar10",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data",
                   help="folder holding cifar-10-batches-py (default: data)")
    p.add_argument("--download", action="store_true",
                   help="download the real CIFAR-10 into --data (needs a network)")
    p.add_argument("--synthetic", action="store_true",
                   help="if --data holds no CIFAR-10, write the small generated "
                        "stand-in there (no network needed)")
    p.add_argument("--synthetic-size", type=int, nargs=2, default=[5000, 1000],
                   metavar=("TRAIN", "TEST"))
    p.add_argument("--prepare-only", action="store_true",
                   help="download (--download) or write (--synthetic) the data into "
                        "--data, then stop: stages it before a cluster job whose "
                        "nodes have no network (one process, no torchrun)")
    p.add_argument("--model", choices=["simplecnn", "resnet18"], default="simplecnn")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=256,
                   help="images per optimizer step over all processes; each process "
                        "takes global-batch / world size")
    p.add_argument("--lr", type=float, default=0.05,
                   help="peak learning rate (one-cycle schedule)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers per process (training with --loader "
                        "workers; the test set always)")
    p.add_argument("--loader", choices=["auto", "gpu", "workers"], default="auto",
                   help="training data: gpu: the uint8 set on the device, augmented "
                        "there in whole batches (on the CPU too: the same tensor "
                        "code); "
                        "workers: a DataLoader with worker processes; auto: gpu with "
                        "CUDA if the set takes at most 1/4 of the free GPU memory on "
                        "every rank, else workers")
    p.add_argument("--channels-last", choices=["auto", "yes", "no"], default="auto",
                   help="channels_last memory format for the model and its inputs "
                        "(auto: yes with CUDA)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model and the GPU loader's augmentation "
                        "(g++ or $CXX on the CPU; Triton, cc and Python.h on CUDA)")
    p.add_argument("--log-every", type=int, default=50,
                   help="read the loss from the device every N steps for the "
                        "progress bar (the only reads during an epoch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA (nccl) when available, else CPU (gloo); "
                        "cpu: gloo even on a GPU machine")
    p.add_argument("--amp", nargs="?", const="bf16", choices=["bf16", "fp16"],
                   help="mixed precision on CUDA: bf16 autocast (--amp alone; A100, "
                        "H100 and later), or fp16 with a gradient scaler, saved in "
                        "checkpoints (V100, T4: bf16 is emulated there)")
    p.add_argument("--sync-bn", action="store_true",
                   help="SyncBatchNorm across GPUs (CUDA only; off by default: a "
                        "collective in every BatchNorm layer, forward and backward, "
                        "for statistics over the global batch, not the local one)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms and fixed DDP buckets: "
                        "bit-identical restarts (slower)")
    add_run_arguments(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Where the run writes, how it resumes and stops, how long collectives may wait."""
    p.add_argument("--out", default="runs/cifar10",
                   help="folder for metrics.jsonl and checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save every N steps (0: at epoch ends)")
    p.add_argument("--keep-checkpoints", type=int, default=1, metavar="K",
                   help="keep the last K checkpoints: checkpoint.pt and K-1 older "
                        "ones, checkpoint-step<N>.pt (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint.pt if rank 0 finds it")
    p.add_argument("--fail-at-step", type=int, default=-1,
                   help="(testing) the last rank dies at the start of this step "
                        "(from 1), in its node's first attempt: no rank completes it")
    p.add_argument("--stop-at-step", type=int, default=-1,
                   help="stop after this step with a checkpoint, as a job whose time "
                        "is up (resume with --resume)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (logs only)")
    p.add_argument("--init-timeout", type=float, default=1800, metavar="SECONDS",
                   help="how long a collective may wait until every rank's first step "
                        "is done: joining the group, data prepared per node, the first "
                        "step (default 1800)")
    p.add_argument("--step-timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective may wait after the first step, before "
                        "the rank fails (a hang becomes a restart): more than a "
                        "checkpoint's write, which the other ranks wait for "
                        "(default 300)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop with argparse's usage and a message on a value out of range."""
    for name in ("epochs", "global_batch", "log_every", "keep_checkpoints"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, "
                    f"got {getattr(args, name)}")
    for name in ("workers", "seed", "checkpoint_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be 0 or more, "
                    f"got {getattr(args, name)}")
    for name in ("lr", "init_timeout", "step_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive, "
                    f"got {getattr(args, name)}")
    if min(args.synthetic_size) < 5:
        p.error(f"--synthetic-size needs two numbers of at least 5, "
                f"got {args.synthetic_size}")


def check_gpus(local_world_size: int, device_count: int) -> None:
    """One GPU per process: refuse to start more processes on a node than it
    has GPUs."""
    if local_world_size > device_count:
        raise SystemExit(f"error: {local_world_size} processes on this node "
                         f"but only {device_count} GPUs; "
                         f"use --nproc_per_node={device_count} or fewer, "
                         f"or --device cpu")


def per_process_batch(global_batch: int, world_size: int) -> int:
    """The batch of one process: the global batch split evenly, or an error that lists
    the numbers of processes it splits over."""
    if global_batch % world_size:
        counts = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        listed = ", ".join(map(str, counts[:-1])) + f" or {counts[-1]}"
        below = global_batch // world_size * world_size
        nearest = f"{below} or {below + world_size}" if below else f"{world_size}"
        raise SystemExit(f"error: --global-batch {global_batch} does not split evenly "
                         f"over {world_size} processes; it splits over {listed} "
                         f"processes. Run on one of those, or (a new run, not a "
                         f"resumed one) take a multiple of {world_size}, "
                         f"e.g. {nearest}")
    return global_batch // world_size


FIT_FRACTION = 0.25  # of the free GPU memory: the rest is for the model and its work


def choose_loader(choice: str, device: torch.device, nbytes: int,
                  free_bytes: int | None) -> tuple[str, str]:
    """``(loader, why)``: ``"gpu"`` or ``"workers"`` for ``--loader choice``.

    ``nbytes``: what the GPU loader keeps on the device (``resident_bytes``);
    ``free_bytes``: this GPU's free memory (``None`` on the CPU). ``auto`` takes
    ``gpu`` with CUDA when the set takes at most ``FIT_FRACTION`` of the free memory,
    leaving the rest to the model, its activations and the workspace of its kernels.
    ``gpu`` on a GPU too small for the set is refused.
    """
    size = f"the training set's {nbytes / 2**30:.2f} GiB"
    if choice == "workers":
        return "workers", "--loader workers"
    if device.type != "cuda":
        if choice == "gpu":
            return "gpu", "--loader gpu, on the CPU: the same tensor code"
        return "workers", "--loader auto without CUDA"
    free = f"{free_bytes / 2**30:.2f} GiB free on {device}"
    if choice == "gpu":
        if nbytes > free_bytes:
            raise SystemExit(f"error: --loader gpu: {size} do not fit in the {free}; "
                             f"use --loader workers")
        return "gpu", f"--loader gpu: {size}, {free}"
    if nbytes <= FIT_FRACTION * free_bytes:
        return "gpu", f"--loader auto: {size} <= 1/4 of the {free}"
    return "workers", f"--loader auto: {size} > 1/4 of the {free}"


def check_compile(device: torch.device) -> None:
    """Refuse ``--compile`` where ``torch.compile`` cannot work, before any work is
    done (``utils.devices.compile_problem``)."""
    problem = compile_problem(device)
    if problem is not None:
        raise SystemExit(f"error: {problem}")


def agreed_free_memory(device: torch.device, ddp: bool) -> int | None:
    """The least free memory of any rank's GPU (``None`` on the CPU), so that every
    rank makes the same ``--loader auto`` choice."""
    if device.type != "cuda":
        return None
    free = torch.tensor(torch.cuda.mem_get_info(device)[0], dtype=torch.int64,
                        device=collective_device() if ddp else "cpu")
    if ddp:
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return int(free)


def eval_workers(workers: int) -> int:
    """DataLoader workers of the test loader: at most 2 (a small set), persistent like
    the training ones.

    They sit idle while the training workers run, but they are processes: a node runs
    ``processes per node x (1 + workers + eval_workers(workers))`` of them (chapter 12's
    CPU budget).
    """
    return min(workers, 2)


def one_cycle(optimizer: torch.optim.Optimizer, peak_lr: float, total_steps: int):
    """The schedule: warm-up from ``peak_lr / 25`` to ``peak_lr`` over the first
    quarter, then down to ~0.

    ``--lr`` is the peak for ``--global-batch``, whatever the number of processes
    (chapter 11). cycle_momentum=False: OneCycleLR would otherwise overwrite --momentum
    with its own 0.85-0.95 cycle. A run of fewer than 8 steps warms up over 2 of them
    (a quarter of 4 steps would be a warm-up of none, and OneCycleLR divides by it).
    """
    if total_steps < 3:
        raise SystemExit(f"error: {total_steps} optimizer step(s) in all (--epochs x "
                         f"training images // --global-batch); the one-cycle schedule "
                         f"needs at least 3: more --epochs or a smaller --global-batch")
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak_lr,
                                               total_steps=total_steps,
                                               pct_start=max(0.25, 2 / total_steps),
                                               cycle_momentum=False)


def init_process_group(backend: str, device: torch.device | None = None,
                       timeout: timedelta | None = None) -> None:
    """``init_process_group`` on a store of this attempt's own, hosted by its rank 0,
    with ``timeout`` for its collectives (torch's default: 10 minutes for ``nccl``, 30
    for ``gloo``), until ``shorten_timeouts``.

    torchrun (2.14) keeps the store at ``MASTER_ADDR:MASTER_PORT`` across restarts, so
    restarted ranks that share it can read the addresses of the processes that died and
    dial them (chapter 12 shows it). Numbering the attempts does not fix that for good:
    ``TORCHELASTIC_RESTART_COUNT`` differs between nodes (only the agent whose worker
    failed counts a restart), and a count kept in the store is shifted for ever by a
    process that dies before it adds its 1. So every attempt gets a fresh store
    (``attempt_store``), and nothing of a dead attempt can be read.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the store is rank 0's to host, unless torchrun's agent hosts it
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           world_size, hosts_store)
    # the attempt counter lives in the shared store, which outlives a restart only when
    # it is torchrun's agent's; otherwise rank 0 hosts a new one each attempt, and the
    # agent's own count of restarts (of rank 0's node) is the best there is
    floor = (0 if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
             else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    store, attempt = attempt_store(shared, os.environ["MASTER_ADDR"], rank, world_size,
                                   floor)
    os.environ["TRAIN_CIFAR10_ATTEMPT"] = str(attempt)
    # device_id binds this rank's GPU to the group: barriers use it
    extra = {"device_id": device} if backend == "nccl" else {}
    if timeout is not None:
        extra["timeout"] = timeout
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            **extra)


FIND_STORE_SECONDS = 600  # how long ranks wait for their rank 0's store


def shorten_timeouts(job, seconds: float) -> None:
    """After this process's first step: a collective that waits ``seconds`` has hung
    (a rank stuck in a file system, a dead peer that never reached it), and the rank
    fails instead of waiting for the long start-up timeout, so that torchrun restarts
    the job (torchtitan, too, shortens its timeout after the first step). On the group
    of the training and on the preemption flag's."""
    if not job.ddp:
        return
    set_timeout = (getattr(dist, "set_timeout", None)  # torch >= 2.10
                   or getattr(dist.distributed_c10d, "_set_pg_timeout", None))
    if set_timeout is None:  # an older torch
        if job.master:
            print(f"warning: this torch cannot change a process group's timeout; "
                  f"--step-timeout is ignored, --init-timeout applies throughout",
                  file=sys.stderr, flush=True)
        return
    set_timeout(timedelta(seconds=seconds))  # the default group
    if job.control is not None:
        set_timeout(timedelta(seconds=seconds), job.control)


def attempt_store(shared, host: str, rank: int, world_size: int, floor: int = 0):
    """``(store, attempt)``: a store that only this attempt's processes know, and the
    attempt's number (rank 0's count in the shared store, at least ``floor``).

    Rank 0 starts a new store on a free port and publishes ``host:port:token`` in the
    shared store, with a random token that it also writes into the new store. Every
    other rank reads what is published, connects, and reads the token back. What a dead
    attempt published names a store whose process is gone (or a port since reused by
    another store, with another token): the rank waits for this attempt's rank 0 to
    publish. Rank 0 also checks that the world size has not changed between attempts
    (an elastic ``--nnodes``); its refusal reaches every rank.
    """
    if rank == 0:
        own = dist.TCPStore(host, 0, world_size, True, wait_for_workers=False)
        attempt = max(shared.add("train_cifar10/attempts", 1) - 1, floor)
        token = f"{attempt}-{os.urandom(8).hex()}"
        own.set("token", token)
        first = shared.compare_set("train_cifar10/world_size", "", str(world_size))
        published = f"{host}:{own.port}:{token}"
        if first.decode() != str(world_size):
            published = (f"error: the world size changed between attempts of this "
                         f"torchrun job, from {first.decode()} to {world_size} "
                         f"processes: an elastic --nnodes MIN:MAX? Start torchrun "
                         f"with a fixed --nnodes (resume on another number of "
                         f"processes with a new job and --resume)")
        shared.set("train_cifar10/store", published)
        if published.startswith("error:"):
            raise SystemExit(published)
        return own, attempt
    shared.set_timeout(timedelta(seconds=FIND_STORE_SECONDS))  # a slow rank 0
    deadline = time.monotonic() + FIND_STORE_SECONDS
    while time.monotonic() < deadline:
        published = shared.get("train_cifar10/store").decode()
        if published.startswith("error:"):
            raise SystemExit(published)
        address, port, token = published.rsplit(":", 2)
        try:
            # a quiet look first: a dead attempt's port refuses at once, where a
            # TCPStore client would retry, and log each try
            socket.create_connection((address, int(port)), timeout=2).close()
            store = dist.TCPStore(address, int(port), world_size, False,
                                  timeout=timedelta(seconds=2))
            if store.get("token").decode() == token:
                store.set_timeout(timedelta(seconds=FIND_STORE_SECONDS))
                return store, int(token.split("-")[0])
        except (OSError, RuntimeError):  # no store there, or not ours
            pass
        time.sleep(0.2)
    raise SystemExit(f"error: rank {rank} found no store from this attempt's rank 0 "
                     f"in {FIND_STORE_SECONDS} s (last published: {published}); did "
                     f"rank 0 start?")


def setup_distributed(device_choice: str, timeout: timedelta | None = None
                      ) -> tuple[bool, int, int, int, torch.device]:
    """``(ddp, rank, local_rank, world_size, device)``; ``RANK`` in the environment
    means torchrun started us. ``timeout``: the group's, until the first step."""
    cuda_available = torch.cuda.is_available()
    if device_choice == "cuda" and not cuda_available:
        raise SystemExit("error: --device cuda, but torch.cuda.is_available() is False "
                         "here; use --device cpu or auto")
    cuda = device_choice == "cuda" or (device_choice == "auto" and cuda_available)
    ddp = "RANK" in os.environ
    if not ddp:
        refuse_srun_without_torchrun(os.environ)
    else:
        refuse_elastic_nnodes(launcher_args())
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if ddp else 0
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not ddp:
        return False, 0, 0, 1, device
    if cuda:
        check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                   torch.cuda.device_count())
        # one GPU per process, before anything touches CUDA
        torch.cuda.set_device(device)
    init_process_group("nccl" if cuda else "gloo", device, timeout)
    return True, dist.get_rank(), local_rank, dist.get_world_size(), device


def refuse_srun_without_torchrun(env) -> None:
    """Started by SLURM's ``srun`` as one of several tasks, but not by torchrun: every
    task would train alone, as rank 0 on the first GPU, writing the same ``--out``."""
    tasks = int(env.get("SLURM_NTASKS", "1") or 1)
    if tasks > 1:
        raise SystemExit(
            f"error: started by srun as task {env.get('SLURM_PROCID', '?')} of {tasks} "
            "without torchrun (no RANK in the environment): each task would train "
            "alone as rank 0 on the first GPU and write the same --out. Start one "
            "torchrun per node instead: srun --ntasks-per-node=1 torchrun "
            "--nnodes=$SLURM_NNODES --nproc_per_node=<GPUs per node> ... "
            "-m utils.train_cifar10 ...")


def launcher_args() -> list[str]:
    """The command line of the process that started this one (torchrun's agent), where
    ``/proc`` shows it (Linux); ``[]`` elsewhere."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def refuse_elastic_nnodes(argv: list[str]) -> None:
    """``torchrun --nnodes=MIN:MAX`` with ``MIN < MAX``: an elastic job, whose world
    size may change at a restart (a node lost or added), and with it each process's
    share of ``--global-batch``, mid-epoch. This script resumes on another number of
    processes only from a checkpoint, in a new job: refuse at once."""
    value = os.environ.get("PET_NNODES")  # torchrun's options from the environment
    for i, arg in enumerate(argv):
        if arg == "--nnodes" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
    if value and ":" in value and len(set(value.split(":"))) > 1:
        raise SystemExit(f"error: torchrun --nnodes={value} starts an elastic job, "
                         f"whose number of processes may change between attempts; this "
                         f"script needs a fixed one: --nnodes=N (to go on with another "
                         f"number, start a new job with --resume)")


def prepare_data(args, local_rank: int, ddp: bool) -> None:
    """Local rank 0 of *each node* downloads or writes the data; everyone waits for
    all nodes.

    Nodes may not share a disk, so preparing it on global rank 0 alone would leave the
    other nodes without data. On a shared file system the nodes race to the same folder,
    which is safe: both writers put their files in a temporary folder and rename it into
    place, and the first wins.
    """
    folder = os.path.join(args.data, "cifar-10-batches-py")
    if not os.path.isdir(folder) and not args.download and not args.synthetic:
        raise SystemExit(f"error: no CIFAR-10 in {args.data!r}; "
                         "pass --download (needs a network) "
                         "or --synthetic (writes a small generated stand-in)")
    if local_rank == 0 and not os.path.isdir(folder):
        if args.download:
            download_cifar10(args.data)
        else:
            write_synthetic_cifar10(args.data, *args.synthetic_size, seed=args.seed)
    if ddp:
        dist.barrier()  # every node's local rank 0 has prepared its copy


def check_same_data(train_set, test_set, synthetic: bool, ddp: bool) -> None:
    """Stop every rank with a message if the nodes' copies of the data differ.

    A node-local ``--data`` may hold leftovers (another ``--synthetic-size``, or the
    real data on one node and the stand-in on another); different lengths would give
    ranks different numbers of steps, and a hang at the first collective one rank does
    not reach.
    """
    if not ddp:
        return
    fingerprint = [len(train_set), len(test_set), int(synthetic),
                   int(train_set.data[:: max(1, len(train_set) // 97)].sum()),
                   int(sum(train_set.targets))]
    mine = torch.tensor(fingerprint, dtype=torch.int64, device=collective_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    differ = [r for r, other in enumerate(everyone)
              if not torch.equal(other, everyone[0])]
    if differ:
        raise SystemExit(f"error: the data differs between ranks 0 and {differ} "
                         f"(train images, test images, synthetic, "
                         f"checksums: {everyone[0].tolist()} against "
                         f"{everyone[differ[0]].tolist()}); give every node "
                         "the same --data (or remove a node's stale copy)")


# --- models ---------------------------------------------------------------------------

class SimpleCNN(nn.Module):
    """The seed tutorial's network: two conv layers and two linear ones."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def make_model(name: str) -> nn.Module:
    if name == "simplecnn":
        return SimpleCNN()
    from torchvision.models import resnet18

    # CIFAR stem: 3x3 convolution, no max-pool, for 32x32 images
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    # same function; its backward has no atomics, so it is deterministic
    model.avgpool = GlobalAvgPool()
    return model


class GlobalAvgPool(nn.Module):
    """``AdaptiveAvgPool2d(1)`` as a mean: CUDA has no deterministic kernel for the
    former's backward."""

    def forward(self, x):
        return x.mean((2, 3), keepdim=True)


# --- data: augmentation keyed by (seed, epoch, index) ---------------------------------

class KeyedAugment(Dataset):
    """Random crop (padding 4) and horizontal flip drawn from a generator keyed by
    (seed, epoch, index).

    Indices arrive as ``(epoch, index)`` pairs from ``EpochSampler``, so the same sample
    gets the same augmentation in a given epoch whichever worker, rank or restarted
    process loads it.
    """

    def __init__(self, base, seed: int, train: bool):
        # Keep the arrays, not torchvision's object: workers started with spawn (macOS,
        # Windows) receive this data set pickled, and a plain array pickles anywhere.
        self.data, self.targets = base.data, list(base.targets)
        self.seed, self.train = seed, train
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image = torch.from_numpy(self.data[index]).permute(2, 0, 1).float().div_(255)
        if self.train:
            g = sample_generator(self.seed, epoch, index)
            dy, dx = torch.randint(0, 9, (2,), generator=g).tolist()
            image = F.pad(image, (4, 4, 4, 4))[:, dy:dy + 32, dx:dx + 32]
            if torch.rand((), generator=g) < 0.5:
                image = image.flip(2)
        return (image - self.mean) / self.std, self.targets[index]


class EpochSampler(ShardSampler):
    """ShardSampler that yields ``(epoch, index)`` for this rank's positions ``start``
    to ``stop``.

    ShardSampler deals the epoch's order round robin, so with a per-rank batch ``b``
    step ``k`` of every rank together covers positions ``[k*G, (k+1)*G)`` of the order,
    ``G = b * world_size``: a global batch does not depend on the number of processes,
    and a run can resume on another number of them. ``stop`` cuts the epoch at a whole
    number of global batches (no padded copies).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start, self.stop = 0, self.num_samples

    def set_epoch(self, epoch: int, start: int = 0, stop: int | None = None) -> None:
        super().set_epoch(epoch)
        self.start, self.stop = start, self.num_samples if stop is None else stop

    def __iter__(self):
        return iter([(self.epoch, i)
                     for i in self.indices()[self.start:self.stop].tolist()])

    def __len__(self):
        return max(0, min(self.stop, self.num_samples) - self.start)


# --- checkpoints ----------------------------------------------------------------------

def save_checkpoint(path: str, state: dict) -> None:
    """``torch.save`` to ``path`` atomically (``write_atomically``)."""
    write_atomically(path, lambda f: torch.save(state, f))


def write_atomically(path: str, write) -> None:
    """``write(f)`` into a temporary file, flush it to disk, then rename it over
    ``path``.

    The old file survives a crash at any point, and once this returns the new one
    survives a power cut: the folder is flushed too, so the rename itself is on disk."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_folder(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _fsync_folder(folder: str) -> None:
    """Flush a folder's entries (a rename) to disk, where the system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


FORMAT = "utils.train_cifar10/2"
# What a resumed run must repeat: each decides the model, the schedule of optimizer
# steps, or the images of each step (the loaders draw different augmentations).
RUN_SETTINGS = ("model", "epochs", "global_batch", "lr", "momentum", "weight_decay",
                "seed", "data_size", "loader")
# settings added since checkpoints of this format were first written, with the value
# every older run had
LEGACY_SETTINGS = {"loader": "workers"}


def run_config(args, data_size: int | None = None, loader: str | None = None) -> dict:
    """What a resumed run must repeat (without the data's size or the loader, before
    they are known: what the command line alone says)."""
    config = {"model": args.model, "epochs": args.epochs,
              "global_batch": args.global_batch, "lr": args.lr,
              "momentum": args.momentum, "weight_decay": args.weight_decay,
              "seed": args.seed, "data_size": data_size, "loader": loader}
    return {k: v for k, v in config.items() if v is not None}


def load_checkpoint(path: str, config: dict) -> dict:
    """Load with ``weights_only=True``; refuse files that are unreadable, not ours, or
    from another run.

    A resumed run must continue the same schedule: the one-cycle learning rate is laid
    out over ``epochs x steps per epoch`` steps and the sample order follows the seed,
    so a different ``--epochs``, ``--lr``, ``--global-batch``, ``--seed``, model or
    loader (``gpu`` or ``workers``: their augmentations differ) is refused with the
    differences listed. ``--workers``, ``--device``, ``--channels-last``,
    ``--compile`` and the number of processes may change.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SystemExit(f"error: cannot read checkpoint {path}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    expected = {"format", "model", "optimizer", "scheduler", "epoch", "step_in_epoch",
                "step", "config"}
    if (not isinstance(state, dict) or not expected <= set(state)
            or not str(state["format"]).startswith("utils.train_cifar10/")):
        raise SystemExit(f"error: {path} is not a checkpoint written by "
                         f"utils.train_cifar10")
    if state["format"] != FORMAT:
        raise SystemExit(f"error: {path} was written by another version of this script "
                         f"({state['format']}, this one reads {FORMAT}); "
                         f"start a new run with another --out")
    saved = {**LEGACY_SETTINGS, **state["config"]}
    changed = [f"--{k.replace('_', '-')} {config[k]} (checkpoint: {saved.get(k)})"
               for k in RUN_SETTINGS if k in config and saved.get(k) != config[k]]
    if changed:
        raise SystemExit(f"error: cannot resume {path}: "
                         + ", ".join(changed).replace("--data-size", "data set size")
                         + ". A resumed run continues the same schedule; repeat the "
                         "checkpoint's values, or start"
                         " a new run with another --out")
    return state


def from_rank_0(value, ddp: bool):
    """Rank 0's ``value`` on every rank (any picklable object): what rank 0 alone
    found on disk becomes every rank's decision."""
    if not ddp:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=collective_device())
    return box[0]


def agree_on_resume(path: str, config: dict, rank: int, ddp: bool) -> dict | None:
    """Rank 0 alone looks for the checkpoint and reads it; every rank gets what
    it found.

    Deciding on each rank would let a node that cannot see the file (a node-local --out,
    or a stale NFS attribute cache) start from scratch while the others resume, and the
    job would train on mismatched states or hang. A refusal on rank 0 stops every rank
    with the same message.
    """
    found = None
    if rank == 0 and os.path.exists(path):
        try:
            found = ("state", load_checkpoint(path, config))
        except SystemExit as exc:
            found = ("error", str(exc))
    found = from_rank_0(found, ddp)
    if found is not None and found[0] == "error":
        raise SystemExit(found[1])
    return None if found is None else found[1]


# --- training -------------------------------------------------------------------------

def evaluate(model: nn.Module, loader, device) -> float:
    """Exact test accuracy of rank 0's model: uneven shards, no padding (chapter 9).

    Every rank first takes rank 0's buffers (BatchNorm's running statistics): without
    --sync-bn each rank's follow its own last batch, and scoring each shard on its own
    rank's buffers would score a mixture of models, none of them the one rank 0 saves.
    """
    if dist.is_available() and dist.is_initialized():
        for buffer in model.buffers():  # on the group's device (a GPU per rank)
            dist.broadcast(buffer, src=0)
    model.eval()
    correct = count = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            correct += int((model(x).argmax(1) == y).sum())
            count += len(y)
    correct, count = sum_over_ranks(correct, count)
    model.train()
    return correct / count


# --- the run, step by step ------------------------------------------------------------

def main(argv=None) -> None:
    """The whole run, one named step after another."""
    args = parse_args(argv)
    if args.prepare_only:
        prepare_only(args)
        return
    if args.deterministic:
        use_deterministic_algorithms()
    with Preemption() as preemption:  # SIGTERM, SIGUSR1, SIGINT: an agreed stop
        job = set_up_job(args)
        job.preemption = preemption
        data = build_data(args, job)
        model, optimizer, scheduler = build_model(args, data.steps_per_epoch)
        training = resume_or_start(args, job, data, model, optimizer, scheduler)
        model = wrap_model(args, job, training)
        metrics = start_log(args, job, data)
        train(args, job, data, training, model, metrics)
        finish(args, job, training, metrics)
    if training.stop_signal and training.epoch < args.epochs:
        raise SystemExit(EXIT_PREEMPTED)


def prepare_only(args) -> None:
    """``--prepare-only``: the data into ``--data`` (as one node's local rank 0 would
    prepare it), and nothing else."""
    if "RANK" in os.environ:
        raise SystemExit("error: --prepare-only runs as one process, without torchrun "
                         "(once per disk that the nodes read --data from)")
    prepare_data(args, local_rank=0, ddp=False)
    kind = "synthetic" if is_synthetic_cifar10(args.data) else "real"
    print(f"{kind} CIFAR-10 ready in {args.data}", flush=True)


def use_deterministic_algorithms() -> None:
    """``--deterministic``: kernels that give the same bits every run."""
    # before CUDA starts: cuBLAS needs it
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op with no deterministic CUDA kernel warns (and names itself)
    # instead of stopping
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


@dataclass
class Job:
    """This process's place in the run (``setup_distributed``'s answer), and what
    follows from it."""
    ddp: bool
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    batch_size: int  # this process's share of --global-batch
    channels_last: bool
    control: object = None  # the group preemption flags go over (None: the default)
    preemption: Preemption | None = None  # its flag; None: never stop for a signal

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def master(self) -> bool:
        return self.rank == 0  # rank 0 alone logs and saves

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


def set_up_job(args) -> Job:
    """The process group and the device, then the checks that need them."""
    init_timeout = timedelta(seconds=args.init_timeout)
    ddp, rank, local_rank, world_size, device = setup_distributed(args.device,
                                                                  init_timeout)
    cuda = device.type == "cuda"
    if (args.amp or args.sync_bn) and not cuda:
        raise SystemExit("error: --amp and --sync-bn need CUDA; this run is on the CPU")
    if args.compile:
        check_compile(device)
    if cuda and not args.deterministic:
        # the fastest convolution algorithms for these shapes (every batch has the same
        # shape), timed once; they may differ from run to run, so not with
        # --deterministic
        torch.backends.cudnn.benchmark = True
    if args.resume and args.global_batch % world_size:
        # a resume whose settings differ from its checkpoint's is refused for that
        # first: the global batch to split is the checkpoint's
        agree_on_resume(os.path.join(args.out, CHECKPOINT), run_config(args), rank, ddp)
    batch_size = per_process_batch(args.global_batch, world_size)
    channels_last = args.channels_last == "yes" or (args.channels_last == "auto"
                                                    and cuda)
    # preemption flags are agreed on over gloo: a CPU tensor, no wait for the GPU
    control = (dist.new_group(backend="gloo", timeout=init_timeout) if ddp and cuda
               else None)
    return Job(ddp, rank, local_rank, world_size, device, batch_size, channels_last,
               control)


@dataclass
class Data:
    """The data sets and their loaders."""
    train_set: KeyedAugment
    test_set: KeyedAugment
    synthetic: bool
    steps_per_epoch: int
    loader: str  # "gpu" or "workers"
    why: str  # why that loader (choose_loader)
    train_loader: GPULoader | DataLoader
    sampler: EpochSampler | None  # the workers loader's
    test_loader: DataLoader

    def set_epoch(self, epoch: int, step_in_epoch: int, batch_size: int) -> None:
        """Start the training loader at step ``step_in_epoch`` of ``epoch``."""
        if self.loader == "gpu":
            self.train_loader.set_epoch(epoch, start_batch=step_in_epoch)
        else:
            self.sampler.set_epoch(epoch, start=step_in_epoch * batch_size,
                                   stop=self.steps_per_epoch * batch_size)


def build_data(args, job: Job) -> Data:
    """The data sets, the training loader (``--loader``) and the test loader."""
    # prepared once per node; every process reads its own copy
    prepare_data(args, job.local_rank, job.ddp)
    synthetic = is_synthetic_cifar10(args.data)
    train_set = KeyedAugment(load_cifar10(args.data, train=True), args.seed, train=True)
    test_set = KeyedAugment(load_cifar10(args.data, train=False), args.seed,
                            train=False)
    check_same_data(train_set, test_set, synthetic, job.ddp)
    # whole global batches: the same on any world size
    steps_per_epoch = len(train_set) // args.global_batch
    if steps_per_epoch == 0:
        raise SystemExit(f"error: {len(train_set)} training images is less than one "
                         f"global batch of {args.global_batch}")
    loader, why = choose_loader(args.loader, job.device,
                                resident_bytes(train_set.data, dtype=batch_dtype(args),
                                               num_replicas=job.world_size),
                                agreed_free_memory(job.device, job.ddp))
    loader_kwargs = dict(num_workers=args.workers, pin_memory=job.cuda,
                         persistent_workers=args.workers > 0,
                         worker_init_fn=WatchParent(shield_worker),
                         multiprocessing_context=worker_start(args.workers))
    train_loader, sampler = make_train_loader(args, job, train_set, loader,
                                              loader_kwargs)
    test_loader = DataLoader(test_set, batch_size=512,
                             sampler=EvalShardSampler(test_set, job.world_size,
                                                      job.rank),
                             **{**loader_kwargs,
                                "num_workers": eval_workers(args.workers)})
    return Data(train_set, test_set, synthetic, steps_per_epoch, loader, why,
                train_loader, sampler, test_loader)


def worker_start(workers: int):
    """How DataLoader workers start: never by a fork of this process, which has gloo's
    (or NCCL's) threads from ``init_process_group`` on (``utils.workers``), but from a
    fork server with torch imported, in a process group of its own so that a signal for
    the rank's group leaves it alone (``shield_worker``). ``None`` without workers.

    Not this module in the preload: under ``python -m utils.train_cifar10`` each worker
    imports the main module again by its name (multiprocessing's ``__mp_main__``), and
    ``runpy`` warns when that name is already imported (a RuntimeWarning per worker).
    """
    return worker_context(detach=True) if workers > 0 else None


def shield_worker(worker_id: int) -> None:
    """A DataLoader worker leaves the signals to its rank (``Preemption``).

    torchrun's agent passes a signal on to each rank's whole process group, and SLURM
    sends its signals to every process of a job step, workers included; a worker killed
    by one makes its rank fail before the checkpoint ("DataLoader worker ... exited
    unexpectedly"). In a process group of its own and ignoring SIGTERM, SIGINT and
    SIGUSR1 (``utils._detach``: its fork server ignores them before it forks, and
    torch's worker loop puts its own SIGTERM handler back before this runs), the worker
    goes on until its rank stops it, or its ``WatchParent`` sees the rank gone."""
    if hasattr(os, "setpgrp"):  # not on Windows
        os.setpgrp()
    ignore_stop_signals()


def batch_dtype(args) -> torch.dtype:
    """The GPU loader's batches: in the autocast dtype with ``--amp`` (autocast would
    round the float32 images to it before the first convolution: the same values,
    one pass fewer), else float32."""
    return {None: torch.float32, "bf16": torch.bfloat16,
            "fp16": torch.float16}[args.amp]


def make_train_loader(args, job: Job, train_set: KeyedAugment, loader: str,
                      loader_kwargs: dict) -> tuple[GPULoader | DataLoader,
                                                    EpochSampler | None]:
    """``(train_loader, sampler)``: the GPU loader (no sampler), or a DataLoader
    over an ``EpochSampler``."""
    if loader == "gpu":
        # ShardSampler's order cut to whole global batches, as EpochSampler's
        return GPULoader(train_set.data, train_set.targets, job.batch_size,
                         num_replicas=job.world_size, rank=job.rank, seed=args.seed,
                         drop_last=True, drop_last_batch=True,
                         channels_last=job.channels_last, device=job.device,
                         dtype=batch_dtype(args), compile=args.compile), None
    sampler = EpochSampler(train_set, job.world_size, job.rank, shuffle=True,
                           seed=args.seed)
    return DataLoader(train_set, batch_size=job.batch_size, sampler=sampler,
                      drop_last=True, **loader_kwargs), sampler


def build_model(args, steps_per_epoch: int):
    """``(model, optimizer, scheduler)``, the same initial weights on every rank."""
    torch.manual_seed(args.seed)  # one seed where ranks must agree: the initial weights
    model = make_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    scheduler = one_cycle(optimizer, args.lr, args.epochs * steps_per_epoch)
    return model, optimizer, scheduler


@dataclass
class Training:
    """What a checkpoint holds: the unwrapped model, the optimizer, the schedule and
    where the run stands; and where the checkpoint goes."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    path: str
    config: dict  # run_config: what a resumed run must repeat
    epoch: int = 0
    step_in_epoch: int = 0
    step: int = 0  # over all epochs
    scaler: object = None  # --amp fp16's GradScaler (disabled otherwise)
    # the epoch's loss so far: before this process started (from the checkpoint: the
    # sum of the global batches' mean losses, and their number), and this rank's since
    loss_before: float = 0.0
    steps_before: int = 0
    loss_sum: torch.Tensor | None = None  # on the device
    steps_run: int = 0
    saved_step: int | None = None  # the step of the checkpoint at ``path``
    stop_signal: int = 0  # the signal the ranks agreed to stop on (0: none)
    # reseed before every step (None: not known before this process's first step, which
    # reseeds and looks whether anything drew random numbers)
    reseed: bool | None = None
    stepped: bool = False  # this process has done a step: short timeouts from then on

    def epoch_loss(self, world_size: int) -> tuple[float, int]:
        """``(sum of the global batches' mean losses, their number)`` for the epoch so
        far, on every rank (a collective)."""
        mine = 0.0 if self.loss_sum is None else float(self.loss_sum)
        (total,) = sum_over_ranks(mine)
        return (self.loss_before + total / world_size,
                self.steps_before + self.steps_run)


def resume_or_start(args, job: Job, data: Data, model: nn.Module, optimizer,
                    scheduler) -> Training:
    """The checkpoint rank 0 found (with ``--resume``), loaded before the DDP wrap;
    else step 0. The model ends on the device."""
    os.makedirs(args.out, exist_ok=True)
    training = Training(model, optimizer, scheduler,
                        os.path.join(args.out, CHECKPOINT),
                        run_config(args, len(data.train_set), data.loader),
                        scaler=grad_scaler(args.amp == "fp16"))
    refuse_restart_after_preemption(args, job)
    state = (agree_on_resume(training.path, training.config, job.rank, job.ddp)
             if args.resume else None)
    if job.master and os.path.exists(os.path.join(args.out, PREEMPTED)):
        os.remove(os.path.join(args.out, PREEMPTED))  # this run goes on from it
    if args.resume and state is None and job.master:
        print(f"--resume: rank 0 found no checkpoint at {training.path}; "
              f"starting from step 0", flush=True)
    if state is not None:
        model.load_state_dict(state["model"])
        training.epoch, training.step_in_epoch, training.step = (
            state["epoch"], state["step_in_epoch"], state["step"])
        training.saved_step = state["step"]
        # (checkpoints written before the epoch's loss was saved: from here on only)
        training.loss_before, training.steps_before = state.get("epoch_loss", (0.0, 0))
        if args.amp == "fp16" and state.get("scaler"):
            training.scaler.load_state_dict(state["scaler"])
    training.model = model.to(job.device, memory_format=job.memory_format)
    if state is not None:
        # after .to(device): moves its buffers there too
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if job.master:
            print(f"resumed from {training.path}: epoch {training.epoch}, step "
                  f"{training.step_in_epoch} of the epoch ({training.step} in all)",
                  flush=True)
    return training


def refuse_restart_after_preemption(args, job: Job) -> None:
    """A signal stopped this run (its ``preempted.json`` names this run), and torchrun
    restarted the ranks, as it does when the signal reached them but not its agent:
    stop again with ``EXIT_PREEMPTED`` instead of training on (a new job, after a
    requeue, resumes).

    "This run" is the same torchrun run id, SLURM job id *and* SLURM restart count (a
    requeued job keeps its job id, and torchrun's run id is the job id in the SLURM
    recipe), and "restarted" is the attempt number the ranks agreed on through the
    store (``attempt_store``), not ``TORCHELASTIC_RESTART_COUNT``, which counts only
    the restarts of this node's agent: so a requeued job whose first attempt fails is
    restarted and resumes, instead of reading the last job's file as its own."""
    found = None
    path = os.path.join(args.out, PREEMPTED)
    if job.master and int(os.environ.get("TRAIN_CIFAR10_ATTEMPT", 0)) > 0:
        try:
            with open(path) as f:
                found = json.load(f)
        except (OSError, ValueError):
            found = None
        if found and any(found.get(key) != value
                         for key, value in this_run().items()):
            found = None
    found = from_rank_0(found, job.ddp)
    if found:
        print(f"{found['signal']} stopped this job after step {found['step']} "
              f"({path}); a restart does not go on: run the job again with --resume",
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED)


def this_run() -> dict:
    """What names this run in ``preempted.json``: torchrun's run id, SLURM's job id and
    restart (requeue) count, where set."""
    env = os.environ.get
    return {"torchrun_run_id": env("TORCHELASTIC_RUN_ID"),
            "slurm_job_id": env("SLURM_JOB_ID"),
            "slurm_restart": int(env("SLURM_RESTART_COUNT", 0))}


def grad_scaler(enabled: bool):
    """``--amp fp16``'s loss scaler: fp16 gradients underflow without it. Disabled, its
    calls pass through."""
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):  # torch >= 2.3
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def wrap_model(args, job: Job, training: Training) -> nn.Module:
    """SyncBatchNorm, DDP and ``torch.compile`` as asked: the model the steps run.
    ``training.model`` stays the unwrapped one, which is evaluated and saved."""
    if args.sync_bn:
        training.model = nn.SyncBatchNorm.convert_sync_batchnorm(training.model)
    model = training.model
    if job.ddp:
        # DDP regroups gradients into new buckets after its first step, so a restarted
        # process's first step would sum them over 3 or more ranks in another order than
        # the uninterrupted run did, and differ in the last bits. DDP does not regroup
        # when it looks for unused parameters: --deterministic pays that (a graph
        # traversal per step) for exact restarts.
        fixed_buckets = {"find_unused_parameters": True} if args.deterministic else {}
        model = DDP(model, device_ids=[job.local_rank] if job.cuda else None,
                    **fixed_buckets)
    if args.compile:
        model = torch.compile(model)  # after the DDP wrap: compiled per bucket
    return model


def save(args, training: Training, job: Job) -> None:
    """Rank 0 writes the checkpoint (unless this step's is written already: a stop
    agreed at a periodic save's step) and, after a stop, ``preempted.json``; every rank
    waits for it."""
    if training.saved_step != training.step:
        # mid-epoch, the epoch's loss so far (a collective: on every rank)
        epoch_loss = (training.epoch_loss(job.world_size) if training.step_in_epoch
                      else (0.0, 0))
        if job.master:
            keep_older(args, training)
            save_checkpoint(training.path, {
                "format": FORMAT, "model": training.model.state_dict(),
                "optimizer": training.optimizer.state_dict(),
                # a bound method in OneCycleLR's state before torch 2.4: not loadable
                # with weights_only=True, and the new scheduler has its own
                "scheduler": {k: v for k, v in training.scheduler.state_dict().items()
                              if not callable(v)},
                "scaler": training.scaler.state_dict(), "epoch": training.epoch,
                "step_in_epoch": training.step_in_epoch, "step": training.step,
                "epoch_loss": list(epoch_loss), "world_size": job.world_size,
                "config": training.config})
        training.saved_step = training.step  # on every rank: they decide alike
    if job.master and training.stop_signal and training.epoch < args.epochs:
        write_preempted(args, training)  # before the barrier: no rank exits first
    if job.ddp:
        # nobody runs ahead of a checkpoint that may be needed to restart them
        dist.barrier()


def write_preempted(args, training: Training) -> None:
    """``preempted.json``: the step and signal, and which run wrote it (``this_run``),
    with torchrun's restart count and the agreed attempt, so that a job script can tell
    a file of its own run from an older one."""
    env = os.environ.get
    record = {"step": training.step,
              "signal": signal.Signals(training.stop_signal).name,
              **this_run(),
              "torchrun_restart": int(env("TORCHELASTIC_RESTART_COUNT", 0)),
              "attempt": int(env("TRAIN_CIFAR10_ATTEMPT", 0))}
    write_atomically(os.path.join(args.out, PREEMPTED),
                     lambda f: f.write(json.dumps(record).encode()))


def keep_older(args, training: Training) -> None:
    """With ``--keep-checkpoints K > 1``, keep the checkpoint about to be replaced as
    ``checkpoint-step<N>.pt`` (a hard link: no copy), and only the K-1 newest of
    those."""
    if (args.keep_checkpoints < 2 or training.saved_step in (None, training.step)
            or not os.path.exists(training.path)):
        return
    folder = os.path.dirname(training.path)
    older = os.path.join(folder, f"checkpoint-step{training.saved_step}.pt")
    if not os.path.exists(older):
        try:
            os.link(training.path, older)
        except OSError:  # a file system without hard links
            shutil.copyfile(training.path, older)
    kept = sorted((int(name[len("checkpoint-step"):-3]), name)
                  for name in os.listdir(folder)
                  if re.fullmatch(r"checkpoint-step\d+\.pt", name))
    for _, name in kept[:max(0, len(kept) - (args.keep_checkpoints - 1))]:
        os.remove(os.path.join(folder, name))


def start_log(args, job: Job, data: Data):
    """Rank 0 opens ``metrics.jsonl`` and says what runs where; others get ``None``."""
    if not job.master:
        return None
    metrics = open(os.path.join(args.out, "metrics.jsonl"), "a" if args.resume else "w")
    print(f"{'synthetic' if data.synthetic else 'real'} CIFAR-10 in {args.data}: "
          f"{len(data.train_set)} train, "
          f"{len(data.test_set)} test images; {job.world_size} process(es), "
          f"{job.device.type}, "
          f"{dist.get_backend() if job.ddp else 'no process group'}; "
          f"global batch {args.global_batch} = {job.batch_size} x {job.world_size}",
          flush=True)
    print(f"loader: {data.loader} ({data.why}); "
          f"channels_last: {'yes' if job.channels_last else 'no'}; "
          f"compile: {'yes' if args.compile else 'no'}", flush=True)
    return metrics


def train(args, job: Job, data: Data, training: Training, model: nn.Module,
          metrics) -> None:
    """Epochs until ``--epochs``, ``--stop-at-step``, or a signal the ranks agreed on
    (``training.stop_signal``)."""
    # --fail-at-step kills a rank in its node's first attempt only
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    while training.epoch < args.epochs:
        data.set_epoch(training.epoch, training.step_in_epoch, job.batch_size)
        totals = train_epoch(args, job, data, training, model, restarts)
        if totals is None:
            # stopped mid-epoch, as a job whose time ran out: save where it stands
            save(args, training, job)
        else:
            end_epoch(args, job, data, training, metrics, *totals)
        if totals is None or training.step == args.stop_at_step or training.stop_signal:
            break
    if training.stop_signal and job.master:
        name = signal.Signals(training.stop_signal).name
        if training.epoch < args.epochs:
            print(f"{name}: every rank stopped after step {training.step}, saved in "
                  f"{training.path}; exit code {EXIT_PREEMPTED}: resume with --resume",
                  flush=True)
        else:  # nothing left to resume: a requeue would be for nothing
            print(f"{name} after the last step ({training.step}): the run is complete",
                  flush=True)


def train_epoch(args, job: Job, data: Data, training: Training, model: nn.Module,
                restarts: int) -> tuple[int, float] | None:
    """The rest of this epoch: ``(images, seconds)``, or ``None`` if
    ``--stop-at-step`` or a signal stopped it mid-epoch."""
    bar = progress_bar(args, job, data, training)
    t0, seen = time.perf_counter(), 0
    # summed on the device (float64: the same sum as in Python floats); reading it
    # would make the host wait for the GPU, so it is read every --log-every steps
    training.loss_sum = torch.zeros((), dtype=torch.float64, device=job.device)
    training.steps_run = 0
    logged = (0.0, 0)  # the sum and the number of steps when last read
    for x, y in data.train_loader:
        if (training.step + 1 == args.fail_at_step and job.rank == job.world_size - 1
                and restarts == 0):
            # a crash during this step, for the fault-tolerance test: no cleanup
            os._exit(1)
        loss = train_step(args, job, training, model, x, y)
        if not training.stepped:
            shorten_timeouts(job, args.step_timeout)
            training.stepped = True
        training.step, training.step_in_epoch = (training.step + 1,
                                                 training.step_in_epoch + 1)
        training.steps_run += 1
        seen += len(x) * job.world_size
        training.loss_sum += loss.detach()
        if bar is not None:
            logged = show_progress(args, data, training, bar, logged, seen, t0)
        if (args.checkpoint_every and training.step % args.checkpoint_every == 0
                and training.step_in_epoch < data.steps_per_epoch):
            save(args, training, job)
        if job.preemption and (training.step % STOP_CHECK_EVERY == 0
                               or training.step_in_epoch == data.steps_per_epoch):
            training.stop_signal = job.preemption.agreed(job)
        if training.step == args.stop_at_step or training.stop_signal:
            break
    if bar is not None:
        bar.close()
    if training.step_in_epoch < data.steps_per_epoch:
        return None
    training.loss_sum.item()  # waits for the epoch's last step: then time it
    return seen, time.perf_counter() - t0


def show_progress(args, data: Data, training: Training, bar, logged, seen: int,
                  t0: float) -> tuple[float, int]:
    """Advance the bar; every ``--log-every`` steps (and at the epoch's end) read the
    loss from the device and show its mean since the last read, and images/s."""
    if (training.steps_run % args.log_every == 0
            or training.step_in_epoch == data.steps_per_epoch):
        total = float(training.loss_sum)  # waits for the GPU: every N steps only
        bar.set_postfix(
            loss=f"{(total - logged[0]) / (training.steps_run - logged[1]):.3f}",
            img_s=f"{seen / (time.perf_counter() - t0):.0f}")
        logged = (total, training.steps_run)
    bar.update(1)
    return logged


# steps between two agreements on the stop flag: each is a blocking all-reduce between
# the ranks' hosts (a round trip between them, longer across nodes), which every
# step would pay; a signal stops the run at most this many steps later (and after an
# epoch's last step at the latest)
STOP_CHECK_EVERY = 10


class Preemption:
    """SIGTERM, SIGUSR1 (what a scheduler sends before it kills a job) and SIGINT (a
    Ctrl-C, or ``scancel --signal=INT``) set a flag; every ``STOP_CHECK_EVERY`` steps,
    and after an epoch's last step, the ranks agree on it, so that all stop after the
    same step, write one checkpoint and exit with ``EXIT_PREEMPTED``. A second SIGINT
    at least a second after the first raises ``KeyboardInterrupt`` at once, as Python's
    default does (one Ctrl-C or ``scancel --signal=INT`` reaches a rank twice within
    milliseconds: from SLURM or the terminal, and from torchrun's agent).

    The handlers are installed in the main thread (where Python allows them), and the
    previous ones restored after the run, unless a signal stopped it: then they stay,
    so that a SIGTERM that torchrun's agent sends once the first rank has exited does
    not kill the others before they exit with ``EXIT_PREEMPTED`` too."""

    def __init__(self):
        self.signal = 0
        self._first_sigint = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:  # no SIGUSR1 on Windows
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        if self.signal:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is None:
                self._first_sigint = now
            elif now - self._first_sigint >= 1.0:
                raise KeyboardInterrupt  # Ctrl-C again: no wait for the agreed step
        self.signal = self.signal or signum

    def agreed(self, job) -> int:
        """The signal any rank has received (0 if none), the same on every rank."""
        if not job.ddp:
            return self.signal
        flag = torch.tensor([self.signal], dtype=torch.int64)  # on the CPU: gloo
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=job.control)
        return int(flag)


def progress_bar(args, job: Job, data: Data, training: Training):
    """Rank 0's progress bar for this epoch (``None`` elsewhere or with
    ``--no-progress``)."""
    if not job.master or args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=data.steps_per_epoch, initial=training.step_in_epoch,
                desc=f"epoch {training.epoch}", unit="step", file=sys.stdout,
                mininterval=1.0)


def train_step(args, job: Job, training: Training, model: nn.Module, x, y):
    """One optimizer step on this rank's batch; returns its loss (on the device)."""
    # a seed per rank and step where ranks must differ (dropout, if a model had it),
    # also after a resume; not again once a step has shown that nothing draws any
    if training.reseed is not False:
        seed_everything(derive_seed(args.seed, training.step), job.rank)
        before = rng_states(job) if training.reseed is None else None
    # no-ops for the GPU loader's batches, already there in this format
    x = x.to(job.device, non_blocking=True, memory_format=job.memory_format)
    y = y.to(job.device, non_blocking=True)
    dtype = torch.float16 if args.amp == "fp16" else torch.bfloat16
    with torch.autocast(job.device.type, dtype=dtype, enabled=args.amp is not None):
        loss = F.cross_entropy(model(x), y)
    training.optimizer.zero_grad(set_to_none=True)
    # the scaler (--amp fp16) multiplies the loss so that small gradients survive in
    # fp16, and divides them again before the step (which it skips on inf or NaN)
    training.scaler.scale(loss).backward()
    training.scaler.step(training.optimizer)
    training.scaler.update()
    training.scheduler.step()
    if training.reseed is None:  # this process's first step: did it draw any?
        training.reseed = not all(map(torch.equal, before, rng_states(job)))
    return loss


def rng_states(job: Job) -> list[torch.Tensor]:
    """The state of torch's generators that a step could draw from: the CPU's and this
    process's GPU's (kept on the host: reading it does not wait for the GPU)."""
    return [torch.get_rng_state(),
            *([torch.cuda.get_rng_state(job.device)] if job.cuda else [])]


def end_epoch(args, job: Job, data: Data, training: Training, metrics, seen: int,
              elapsed: float) -> None:
    """Test accuracy, a checkpoint at the epoch's end, and rank 0's metrics line."""
    # the mean over the epoch's global batches, those before a resume included
    loss, steps = training.epoch_loss(job.world_size)
    training.loss_before, training.steps_before = 0.0, 0
    accuracy = evaluate(training.model, data.test_loader, job.device)
    training.epoch, training.step_in_epoch = training.epoch + 1, 0
    save(args, training, job)
    if job.master:
        record = {"epoch": training.epoch, "step": training.step,
                  "train_loss": round(loss / max(steps, 1), 4),
                  "test_accuracy": round(accuracy, 4),
                  "images_per_s": round(seen / elapsed, 1),
                  "epoch_seconds": round(elapsed, 2), "world_size": job.world_size,
                  "data": "synthetic" if data.synthetic else "cifar10",
                  "model": args.model, "device": job.device.type,
                  "loader": data.loader}
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        print(json.dumps(record), flush=True)


def finish(args, job: Job, training: Training, metrics) -> None:
    """Rank 0 closes the log and, if every epoch ran, saves the final weights; the
    process group ends."""
    if job.master:
        metrics.close()
        if training.epoch == args.epochs:
            # loads anywhere, GPU or not, in the default memory format
            final = {k: v.cpu().contiguous()
                     for k, v in training.model.state_dict().items()}
            save_checkpoint(os.path.join(args.out, "model_final.pt"), final)
    if job.ddp:
        dist.destroy_process_group()


def run() -> None:
    """The command line's entry point: ``main`` under torchelastic's ``@record``, so
    that under torchrun a rank's exception and traceback reach its error file and
    torchrun prints them (instead of ``error_file: <N/A>``). ``main`` itself, which
    notebooks and tests call in-process, goes without: ``@record`` also sets up a fault
    handler on the process's stderr."""
    record(main)()


if __name__ == "__main__":
    # This module's own copy, not this __main__ one, runs: its classes then pickle as
    # utils.train_cifar10.KeyedAugment, which a worker started by a fork server or spawn
    # imports, whoever ran the module as __main__ (python -m, torchrun -m, runpy).
    from utils.train_cifar10 import run as _run

    _run()
