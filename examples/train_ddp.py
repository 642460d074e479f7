"""CIFAR-10 with DistributedDataParallel in one file (torch and torchvision only):

    torchrun --standalone --nproc_per_node=gpu examples/train_ddp.py --download
    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --device cpu \
        --synthetic  # offline: the book's generated stand-in, not CIFAR-10

Without torchrun: one process. Each epoch ends in --out/checkpoint.pt (--resume)."""
import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, models, transforms


class CIFAR10(datasets.CIFAR10):
    """torchvision's checks the real MD5s; the book's stand-in records its own."""
    def __init__(self, root, **kwargs):
        marker = os.path.join(root, self.base_folder, "SYNTHETIC_DATA.json")
        self.synthetic = os.path.exists(marker)
        if self.synthetic:
            with open(marker) as f:
                md5 = json.load(f)["md5"]
            self.train_list = [[name, md5[name]] for name, _ in self.train_list]
            self.test_list = [[name, md5[name]] for name, _ in self.test_list]
            self.meta = {**self.meta, "md5": md5[self.meta["filename"]]}
        super().__init__(root, **kwargs)


BASE_LR = {"simplecnn": 0.05, "resnet18": 0.1}  # peak lr per 256 images (chapter 11)


def simple_cnn():  # two convolutions, two linear layers (chapter 11's SimpleCNN)
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(3, 32, 3, padding=1), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(32, 64, 3, padding=1), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(), fc1=nn.Linear(64 * 8 * 8, 512), relu3=nn.ReLU(),
        fc2=nn.Linear(512, 10)))


@record  # under torchrun, a rank's error and traceback head its failure report
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data")  # holds cifar-10-batches-py
    p.add_argument("--download", action="store_true")  # the real one (a network)
    p.add_argument("--synthetic", action="store_true")  # else the book's stand-in
    p.add_argument("--model", choices=["simplecnn", "resnet18"], default="simplecnn")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=256)  # over all processes
    p.add_argument("--lr", type=float)  # peak; default: the linear rule, below
    p.add_argument("--workers", type=int, default=2)  # DataLoader workers per process
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-augment", action="store_true")  # to compare runs exactly
    p.add_argument("--out", default="runs/train_ddp")
    p.add_argument("--resume", action="store_true")  # the settings it was saved with
    p.add_argument("--stop-after-epoch", type=int)  # to fit a time limit (0: none)
    args = p.parse_args()

    # --- processes: one per GPU (or CPU share), started by torchrun ------------------
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    gpu = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if gpu and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count():
        p.error(f"one GPU per process: {torch.cuda.device_count()} GPUs visible here "
                "(torchrun --nproc_per_node=gpu starts one process per GPU)")
    if args.global_batch % world:
        raise SystemExit(f"--global-batch must be divisible by {world} processes")
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)  # before anything else touches the GPU
    if world > 1:  # (one process alone: no process group, no DDP)
        dist.init_process_group("nccl" if gpu else "gloo")

    # --- data: downloaded once per node (nodes sharing a disk: use rank == 0) -------
    normalize = [transforms.ToTensor(), transforms.Normalize(
        (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))]
    augment = [] if args.no_augment else [transforms.RandomCrop(32, padding=4),
                                          transforms.RandomHorizontalFlip()]
    folder = os.path.join(args.data, "cifar-10-batches-py")
    if args.download and os.path.exists(os.path.join(folder, "SYNTHETIC_DATA.json")):
        p.error(f"--data {args.data} holds the book's generated stand-in, not CIFAR-10"
                ": --download would train on it; give --download another --data")
    if local_rank == 0 and args.download:
        CIFAR10(args.data, download=True)  # one archive holds both halves
    elif local_rank == 0 and args.synthetic and not os.path.isdir(folder):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from utils.data import write_synthetic_cifar10  # the book's (needs numpy)
        write_synthetic_cifar10(args.data)  # 5,000 + 1,000 generated images
    if world > 1:
        dist.barrier(device_ids=[local_rank] if gpu else None)  # wait for the data
    if not os.path.isdir(folder):
        raise SystemExit(f"no CIFAR-10 in --data {args.data}: add --download (needs "
                         "a network), copy cifar-10-batches-py there from a machine "
                         "with one, or --synthetic (a generated stand-in, offline)")
    train_set = CIFAR10(args.data, train=True,
                        transform=transforms.Compose(augment + normalize))
    test_set = CIFAR10(args.data, train=False, transform=transforms.Compose(normalize))
    lr = args.lr or BASE_LR[args.model] * args.global_batch / 256  # the linear rule
    me = (f"rank {rank} of {world} (local {local_rank}) on {socket.gethostname()}: "
          f"{torch.cuda.get_device_name(device) + ' ' if gpu else ''}{device}, "
          f"{dist.get_backend() if world > 1 else 'no process group'}")
    ranks = [me] * world
    if world > 1:  # each rank's line, gathered: every process took part
        dist.all_gather_object(ranks, me)
    if rank == 0:  # which data first: the stand-in is no measure of CIFAR-10
        kind = "the generated stand-in" if train_set.synthetic else "CIFAR-10"
        rule = "" if args.lr else f" ({BASE_LR[args.model]} per 256 images)"
        print(f"data: {kind} in {args.data}, {len(train_set)}+{len(test_set)} images",
              *ranks, f"global batch {args.global_batch} = "
              f"{args.global_batch // world} x {world}, peak lr {lr:g}{rule}",
              sep="\n", flush=True)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank,
                                 seed=args.seed, drop_last=True)  # no padded copies
    # workers forked by a server that imported torch once, not by this process (ch. 5)
    start = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start == "forkserver":
        mp.get_context(start).set_forkserver_preload(["torch", "torchvision"])
    workers = dict(num_workers=args.workers, persistent_workers=True,
                   multiprocessing_context=start) if args.workers else {}
    train_loader = DataLoader(  # and a different base seed for each rank's workers
        train_set, batch_size=args.global_batch // world, sampler=sampler, **workers,
        drop_last=True, pin_memory=gpu,
        generator=torch.Generator().manual_seed(args.seed * 1000 + rank))
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=512, **workers)  # each image once

    # --- model: the same initial weights on every process ----------------------------
    torch.manual_seed(args.seed)
    raw = models.resnet18(num_classes=10) if args.model == "resnet18" else simple_cnn()
    if args.model == "resnet18":  # the usual stem for 32x32 images: 3x3, no max-pool
        raw.conv1, raw.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    raw = raw.to(device)
    model = DDP(raw, device_ids=[local_rank] if gpu else None) if world > 1 else raw
    torch.manual_seed(args.seed * 1000 + rank)  # per rank now (--workers 0 augments)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=5e-4, nesterov=True)
    steps = args.epochs * len(train_loader)  # the same on every rank
    if steps < 3:  # OneCycleLR: its peak at step 1 at the earliest, then a step more
        p.error(f"{steps} step(s) in all, 3 at least: more --epochs or data")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(  # warm-up: a quarter of the steps
        optimizer, lr, steps, pct_start=max(.25, 2 / steps), cycle_momentum=False)
    parts = {"model": raw, "optimizer": optimizer, "scheduler": scheduler}
    path, done = os.path.join(args.out, "checkpoint.pt"), 0  # epochs done
    if args.resume and os.path.exists(path):  # every process loads the same state
        state = torch.load(path, map_location=device, weights_only=True)
        for name, part in parts.items():  # momentum and the schedule's step too
            part.load_state_dict(state[name])
        done = state["epoch"]  # the next line printed is epoch done + 1's
    if args.resume and rank == 0:  # what it found: a wrong --out starts from scratch
        print(f"resumed from {path}: {done} epoch(s) done" if done else
              f"--resume: no {path} yet, starting at epoch 1", flush=True)

    # --- training --------------------------------------------------------------------
    for epoch in range(done, min(args.epochs, args.stop_after_epoch or args.epochs)):
        sampler.set_epoch(epoch)  # a new permutation each epoch, equal on all ranks
        model.train()
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP: gradients averaged over processes here
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()  # read once per epoch, not every step
        loss_sum = loss_sum.item()  # waits for the GPU: the epoch's steps are done
        seconds = time.perf_counter() - start
        model.eval()  # evaluate raw, not model: DDP's forward may sync buffers
        correct, count = 0, len(test_loader.dataset)  # this rank's share
        with torch.no_grad():
            for x, y in test_loader:
                correct += int((raw(x.to(device)).argmax(1) == y.to(device)).sum())
        totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64,
                              device=device)
        if world > 1:
            dist.all_reduce(totals)  # summed over all processes, in one all-reduce
        loss_total, correct, count = totals.tolist()
        loss, accuracy = loss_total / (len(train_loader) * world), correct / count
        if rank == 0:  # one process logs and saves
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {loss:.4f}, test "
                  f"accuracy {accuracy:.4f} ({int(count)} images); {seconds:.1f} s, "
                  f"{len(train_loader) * args.global_batch / seconds:.0f} images/s on "
                  f"{world} process{'es' if world > 1 else ''}", flush=True)
        if not math.isfinite(loss) or (epoch + 1 == args.epochs and steps >= 100
                                       and accuracy < 0.2):  # 2x chance: not learned
            raise SystemExit(1 if rank else f"failed: the run did not learn (loss "
                             f"{loss:.4f}, accuracy {accuracy:.4f}): lower --lr or "
                             "more --epochs")
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {name: part.state_dict() for name, part in parts.items()}
            torch.save({**state, "epoch": epoch + 1}, path + ".tmp")  # then renamed:
            os.replace(path + ".tmp", path)  # a process that dies leaves a whole file
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":  # every DataLoader worker imports this file (__mp_main__)
    main()
