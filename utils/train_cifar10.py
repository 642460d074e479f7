"""Train a CNN on CIFAR-10 with DistributedDataParallel: one script for a laptop, a GPU server and a cluster.

    python -m utils.train_cifar10 --data data --synthetic                    # one process
    torchrun --standalone --nproc_per_node=N -m utils.train_cifar10 ...      # one node, N processes
    torchrun --nnodes=M --nproc_per_node=N --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:PORT -m utils.train_cifar10 ...            # M nodes

``RANK`` in the environment (set by torchrun) makes it a distributed run: ``nccl`` with CUDA, ``gloo``
without, one GPU per local rank. Rank 0 alone logs (a progress bar with images/s, and a JSON-lines
metrics file) and writes checkpoints (atomically). Every random choice is a function of the seed,
the epoch and the sample index, so a run killed and resumed from a checkpoint, on any number of
workers, ends with the same parameters as one that never stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from .data import is_synthetic_cifar10, load_cifar10, write_synthetic_cifar10
from .metrics import EvalShardSampler, sum_over_ranks
from .samplers import ShardSampler
from .seeding import sample_generator

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CHECKPOINT = "checkpoint.pt"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.train_cifar10", description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data", help="folder holding cifar-10-batches-py (default: data)")
    p.add_argument("--download", action="store_true", help="download the real CIFAR-10 into --data (needs a network)")
    p.add_argument("--synthetic", action="store_true",
                   help="if --data holds no CIFAR-10, write the small generated stand-in there (no network needed)")
    p.add_argument("--synthetic-size", type=int, nargs=2, default=[5000, 1000], metavar=("TRAIN", "TEST"))
    p.add_argument("--model", choices=["simplecnn", "resnet18"], default="simplecnn")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="per process")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate (one-cycle schedule)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", action="store_true", help="bf16 autocast (CUDA only)")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across GPUs (CUDA only)")
    p.add_argument("--out", default="runs/cifar10", help="folder for metrics.jsonl and checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: at epoch ends)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt if it exists")
    p.add_argument("--fail-at-step", type=int, default=-1, help="(testing) the last rank dies at this step, once")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers < 0:
        p.error(f"--workers must be 0 or more, got {args.workers}")
    if args.lr <= 0:
        p.error(f"--lr must be positive, got {args.lr}")
    if min(args.synthetic_size) < 1:
        p.error("--synthetic-size needs two positive numbers")
    return args


def check_gpus(local_world_size: int, device_count: int) -> None:
    """One GPU per process: refuse to start more processes on a node than it has GPUs."""
    if local_world_size > device_count:
        raise SystemExit(f"error: {local_world_size} processes on this node but only {device_count} GPUs; "
                         f"use --nproc_per_node={device_count} or fewer")


def init_process_group(backend: str) -> None:
    """``init_process_group`` from torchrun's variables, with a store prefix per restart attempt.

    torchrun (2.14) keeps its key-value store across restarts, and without a fresh prefix the
    restarted ranks read the addresses of the processes that died and wait to connect to them
    (chapter 10 shows it). A prefix with ``TORCHELASTIC_RESTART_COUNT`` gives every attempt its own keys.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0  # else torchrun's agent does
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, hosts_store)
    dist.init_process_group(backend, store=dist.PrefixStore(f"train_cifar10/attempt_{attempt}", store),
                            rank=rank, world_size=world_size)


# --- models -------------------------------------------------------------------------------------

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

    model = resnet18(num_classes=10)  # CIFAR stem: 3x3 convolution, no max-pool, for 32x32 images
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


# --- data: augmentation keyed by (seed, epoch, index) ----------------------------------------------

class KeyedAugment(Dataset):
    """Random crop (padding 4) and horizontal flip drawn from a generator keyed by (seed, epoch, index).

    Indices arrive as ``(epoch, index)`` pairs from ``EpochSampler``, so the same sample gets the
    same augmentation in a given epoch whichever worker, rank or restarted process loads it.
    """

    def __init__(self, base, seed: int, train: bool):
        self.base, self.seed, self.train = base, seed, train
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image = torch.from_numpy(self.base.data[index]).permute(2, 0, 1).float().div_(255)
        if self.train:
            g = sample_generator(self.seed, epoch, index)
            dy, dx = torch.randint(0, 9, (2,), generator=g).tolist()
            image = F.pad(image, (4, 4, 4, 4))[:, dy:dy + 32, dx:dx + 32]
            if torch.rand((), generator=g) < 0.5:
                image = image.flip(2)
        return (image - self.mean) / self.std, self.base.targets[index]


class EpochSampler(ShardSampler):
    """ShardSampler that yields ``(epoch, index)`` and can start part-way through an epoch (for resuming)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return iter([(self.epoch, i) for i in self.indices()[self.start:].tolist()])

    def __len__(self):
        return self.num_samples - self.start


# --- checkpoints ------------------------------------------------------------------------------

def save_checkpoint(path: str, state: dict) -> None:
    """Write to a temporary file, flush it to disk, then rename: the old checkpoint survives any crash."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str, model_name: str) -> dict:
    """Load with ``weights_only=True``; refuse files that are unreadable or not ours, saying why."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SystemExit(f"error: cannot read checkpoint {path}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    expected = {"format", "model", "optimizer", "scheduler", "epoch", "step_in_epoch", "step", "config"}
    if not isinstance(state, dict) or state.get("format") != "utils.train_cifar10/1" or not expected <= set(state):
        raise SystemExit(f"error: {path} is not a checkpoint written by utils.train_cifar10")
    if state["config"]["model"] != model_name:
        raise SystemExit(f"error: {path} holds a {state['config']['model']} model, but --model is {model_name}")
    return state


# --- training -----------------------------------------------------------------------------------

def evaluate(model: nn.Module, loader, device) -> float:
    """Exact test accuracy: uneven shards, no padding, one all-reduce after the loop (chapter 8)."""
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


def main(argv=None) -> None:
    args = parse_args(argv)

    # --- distributed set-up: RANK in the environment means torchrun started us ---
    ddp = "RANK" in os.environ
    cuda = torch.cuda.is_available()
    if ddp:
        local_rank = int(os.environ["LOCAL_RANK"])
        if cuda:
            check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
            torch.cuda.set_device(local_rank)
        init_process_group("nccl" if cuda else "gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        local_rank, rank, world_size = 0, 0, 1
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    master = rank == 0
    if (args.amp or args.sync_bn) and not cuda:
        raise SystemExit("error: --amp and --sync-bn need CUDA; this machine has no GPU")
    torch.manual_seed(args.seed)  # the model's initialisation; DDP broadcasts rank 0's anyway
    random.seed(args.seed)

    # --- data ---
    folder = os.path.join(args.data, "cifar-10-batches-py")
    if not os.path.isdir(folder) and not args.download:
        if not args.synthetic:
            raise SystemExit(f"error: no CIFAR-10 in {args.data!r}; pass --download (needs a network) "
                             "or --synthetic (writes a small generated stand-in)")
        if master:
            write_synthetic_cifar10(args.data, *args.synthetic_size, seed=args.seed)
    if args.download and master:
        load_cifar10(args.data, train=True, download=True)
    if ddp:
        dist.barrier()  # rank 0 has written or downloaded the data
    synthetic = is_synthetic_cifar10(args.data)
    train_set = KeyedAugment(load_cifar10(args.data, train=True), args.seed, train=True)
    test_set = KeyedAugment(load_cifar10(args.data, train=False), args.seed, train=False)
    sampler = EpochSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)
    loader_kwargs = dict(num_workers=args.workers, pin_memory=cuda, persistent_workers=args.workers > 0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, **loader_kwargs)
    test_loader = DataLoader(test_set, batch_size=512, sampler=EvalShardSampler(test_set, world_size, rank),
                             **loader_kwargs)
    steps_per_epoch = len(sampler) // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"error: {len(sampler)} training samples per process is less than one batch of {args.batch_size}")

    # --- model, optimizer, schedule ---
    model = make_model(args.model).to(device)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    raw_model = model
    if ddp:
        model = DDP(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch,
                                                    pct_start=0.25)

    # --- resume ---
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, CHECKPOINT)
    epoch, step_in_epoch, step = 0, 0, 0
    if args.resume and os.path.exists(ckpt_path):
        state = load_checkpoint(ckpt_path, args.model)
        if state["config"]["global_batch"] != args.batch_size * world_size:
            raise SystemExit(f"error: the checkpoint was trained with a global batch of {state['config']['global_batch']}, "
                             f"this run has {args.batch_size} x {world_size} = {args.batch_size * world_size}")
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        epoch, step_in_epoch, step = state["epoch"], state["step_in_epoch"], state["step"]
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
            random.setstate(state["python_rng"])
        if cuda and state.get("cuda_rng"):
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        if master:
            print(f"resumed from {ckpt_path}: epoch {epoch}, step {step_in_epoch} of the epoch ({step} in all)", flush=True)

    def checkpoint():
        if master:
            save_checkpoint(ckpt_path, {
                "format": "utils.train_cifar10/1", "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "step_in_epoch": step_in_epoch, "step": step,
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                "cuda_rng": torch.cuda.get_rng_state_all() if cuda else [],
                "config": {"model": args.model, "global_batch": args.batch_size * world_size, "seed": args.seed}})
        if ddp:
            dist.barrier()  # nobody runs ahead of a checkpoint that may be needed to restart them

    metrics = open(os.path.join(args.out, "metrics.jsonl"), "a" if step else "w") if master else None
    if master:
        print(f"{'synthetic' if synthetic else 'real'} CIFAR-10 in {args.data}: {len(train_set)} train, "
              f"{len(test_set)} test images; {world_size} process(es), {device.type}, "
              f"{'nccl' if ddp and cuda else 'gloo' if ddp else 'no process group'}; "
              f"global batch {args.batch_size * world_size}", flush=True)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    # --- the loop ---
    while epoch < args.epochs:
        sampler.set_epoch(epoch, start=step_in_epoch * args.batch_size)
        bar = None
        if master and not args.no_progress:
            from tqdm import tqdm
            bar = tqdm(total=steps_per_epoch, initial=step_in_epoch, desc=f"epoch {epoch}", unit="step",
                       file=sys.stdout, mininterval=1.0)
        t0, seen, loss_sum = time.perf_counter(), 0, 0.0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step, step_in_epoch = step + 1, step_in_epoch + 1
            seen += len(x) * world_size
            loss_sum += loss.item()
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", img_s=f"{seen / (time.perf_counter() - t0):.0f}")
                bar.update(1)
            if step == args.fail_at_step and rank == world_size - 1 and restarts == 0:
                os._exit(1)  # a crash, for the fault-tolerance test: no cleanup, no checkpoint
            if args.checkpoint_every and step % args.checkpoint_every == 0 and step_in_epoch < steps_per_epoch:
                checkpoint()
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t0
        train_loss = sum_over_ranks(loss_sum, max(seen // world_size // args.batch_size, 1))
        accuracy = evaluate(raw_model, test_loader, device)
        epoch, step_in_epoch = epoch + 1, 0
        checkpoint()
        if master:
            record = {"epoch": epoch, "step": step, "train_loss": round(train_loss[0] / train_loss[1], 4),
                      "test_accuracy": round(accuracy, 4), "images_per_s": round(seen / elapsed, 1),
                      "epoch_seconds": round(elapsed, 2), "world_size": world_size, "data": "synthetic" if synthetic else "cifar10",
                      "model": args.model, "device": device.type}
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            print(json.dumps(record), flush=True)

    if master:
        metrics.close()
        torch.save(raw_model.state_dict(), os.path.join(args.out, "model_final.pt"))
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
