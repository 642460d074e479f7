"""CIFAR-10 in one process (torch and torchvision only): train_ddp.py without DDP.

    python examples/train_single.py --download
    python examples/train_single.py --synthetic --device cpu

Each epoch ends with --out/checkpoint.pt; --resume continues from it."""
import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data")  # holds cifar-10-batches-py
    p.add_argument("--download", action="store_true")  # the real one (a network)
    p.add_argument("--synthetic", action="store_true")  # else the book's stand-in
    p.add_argument("--model", choices=["simplecnn", "resnet18"], default="simplecnn")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float)  # peak; default: the linear rule, below
    p.add_argument("--workers", type=int, default=2)  # DataLoader workers
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-augment", action="store_true")  # to compare runs exactly
    p.add_argument("--out", default="runs/train_single")
    p.add_argument("--resume", action="store_true")  # the settings it was saved with
    p.add_argument("--stop-after-epoch", type=int)  # to fit a time limit (0: none)
    args = p.parse_args()

    gpu = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False here")
    device = torch.device("cuda") if gpu else torch.device("cpu")

    # --- data ------------------------------------------------------------------------
    normalize = [transforms.ToTensor(), transforms.Normalize(
        (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))]
    augment = [] if args.no_augment else [transforms.RandomCrop(32, padding=4),
                                          transforms.RandomHorizontalFlip()]
    folder = os.path.join(args.data, "cifar-10-batches-py")
    if args.download and os.path.exists(os.path.join(folder, "SYNTHETIC_DATA.json")):
        p.error(f"--data {args.data} holds the book's generated stand-in, not CIFAR-10"
                ": --download would train on it; give --download another --data")
    if args.download:
        CIFAR10(args.data, download=True)  # one archive holds both halves
    elif args.synthetic and not os.path.isdir(folder):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from utils.data import write_synthetic_cifar10  # the book's (needs numpy)
        write_synthetic_cifar10(args.data)  # 5,000 + 1,000 generated images
    if not os.path.isdir(folder):
        raise SystemExit(f"no CIFAR-10 in --data {args.data}: add --download (needs "
                         "a network), copy cifar-10-batches-py there from a machine "
                         "with one, or --synthetic (a generated stand-in, offline)")
    train_set = CIFAR10(args.data, train=True,
                        transform=transforms.Compose(augment + normalize))
    test_set = CIFAR10(args.data, train=False, transform=transforms.Compose(normalize))
    lr = args.lr or BASE_LR[args.model] * args.batch / 256  # the linear rule
    kind = "the generated stand-in" if train_set.synthetic else "CIFAR-10"
    rule = "" if args.lr else f" ({BASE_LR[args.model]} per 256 images)"
    print(f"data: {kind} in {args.data}, {len(train_set)}+{len(test_set)} images",
          f"one process on {device}, batch {args.batch}, peak lr {lr:g}{rule}",
          sep="\n", flush=True)
    # workers forked by a server that imported torch once, not by this process (ch. 5)
    start = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start == "forkserver":
        mp.get_context(start).set_forkserver_preload(["torch", "torchvision"])
    workers = dict(num_workers=args.workers, persistent_workers=True,
                   multiprocessing_context=start) if args.workers else {}
    train_loader = DataLoader(
        train_set, batch_size=args.batch, shuffle=True, **workers,
        drop_last=True, pin_memory=gpu,
        generator=torch.Generator().manual_seed(args.seed))
    test_loader = DataLoader(test_set,
                             batch_size=512, **workers)

    # --- model -----------------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = (models.resnet18(num_classes=10) if args.model == "resnet18"
             else simple_cnn())
    if args.model == "resnet18":  # the usual stem for 32x32 images: 3x3, no max-pool
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=5e-4, nesterov=True)
    steps = args.epochs * len(train_loader)
    if steps < 3:  # OneCycleLR: its peak at step 1 at the earliest, then a step more
        p.error(f"{steps} step(s) in all, 3 at least: more --epochs or data")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(  # warm-up: a quarter of the steps
        optimizer, lr, steps, pct_start=max(.25, 2 / steps), cycle_momentum=False)
    parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    path, done = os.path.join(args.out, "checkpoint.pt"), 0  # epochs done
    if args.resume and os.path.exists(path):
        state = torch.load(path, map_location=device, weights_only=True)
        for name, part in parts.items():  # momentum and the schedule's step too
            part.load_state_dict(state[name])
        done = state["epoch"]  # the next line printed is epoch done + 1's
    if args.resume:  # what it found: a wrong --out starts from scratch
        print(f"resumed from {path}: {done} epoch(s) done" if done else
              f"--resume: no {path} yet, starting at epoch 1", flush=True)

    # --- training --------------------------------------------------------------------
    for epoch in range(done, min(args.epochs, args.stop_after_epoch or args.epochs)):
        model.train()
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()  # read once per epoch, not every step
        loss_sum = loss_sum.item()  # waits for the GPU: the epoch's steps are done
        seconds = time.perf_counter() - start
        model.eval()
        correct, count = 0, len(test_loader.dataset)
        with torch.no_grad():
            for x, y in test_loader:
                correct += int((model(x.to(device)).argmax(1) == y.to(device)).sum())
        loss, accuracy = loss_sum / len(train_loader), correct / count
        print(f"epoch {epoch + 1}/{args.epochs}: train loss {loss:.4f}, test "
              f"accuracy {accuracy:.4f} ({int(count)} images); {seconds:.1f} s, "
              f"{len(train_loader) * args.batch / seconds:.0f} images/s on "
              f"1 process", flush=True)
        if not math.isfinite(loss) or (epoch + 1 == args.epochs and steps >= 100
                                       and accuracy < 0.2):  # 2x chance: not learned
            raise SystemExit(f"failed: the run did not learn (loss {loss:.4f}, "
                             f"accuracy {accuracy:.4f}): lower --lr or more --epochs")
        os.makedirs(args.out, exist_ok=True)
        state = {name: part.state_dict() for name, part in parts.items()}
        torch.save({**state, "epoch": epoch + 1}, path + ".tmp")  # then renamed:
        os.replace(path + ".tmp", path)  # a process that dies leaves a whole file


if __name__ == "__main__":  # every DataLoader worker imports this file (__mp_main__)
    main()
