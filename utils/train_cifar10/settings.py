"""The command line and the checks of its values.

``python -m utils.train_cifar10 --help`` prints them all; ``parse_args`` stops with
argparse's usage and a message on a value out of range."""

from __future__ import annotations

import argparse
import sys

from .recipe import linear_rule_lr
from .shards import expand_shards


def parse_args(argv=None) -> argparse.Namespace:
    # the package's docstring's first paragraph (argparse re-flows it onto one line)
    p = argparse.ArgumentParser(prog="python -m utils.train_cifar10",
                                description=(sys.modules[__package__].__doc__
                                             or "").split("\n\n")[0])
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
    p.add_argument("--data-format", choices=["cifar", "webdataset"], default="cifar",
                   help="the training set: cifar: the python batches in --data; "
                        "webdataset: the tar shards of --shards, read by DataLoader "
                        "workers (the test set stays --data's)")
    p.add_argument("--shards", metavar="URLS",
                   help="--data-format webdataset's shards: a brace pattern or a "
                        "comma list of URLs or paths, e.g. "
                        "http://HOST:PORT/train-{000000..000007}.tar")
    p.add_argument("--manifest", metavar="PATH_OR_URL",
                   help="--data-format webdataset: the shards' manifest.json "
                        "(utils.manifest.write_manifest), whose sample counts spare "
                        "reading every shard at the start (default: manifest.json "
                        "beside the shards; if there is none, the shards are read)")
    p.add_argument("--model", choices=["simplecnn", "resnet18"], default="simplecnn")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=256,
                   help="images per optimizer step over all processes; each process "
                        "takes global-batch / world size")
    p.add_argument("--lr", type=float,
                   help="peak learning rate (one-cycle schedule) for --global-batch "
                        "(default: the linear rule, the model's rate per 256 images "
                        "x global batch / 256: 0.05 for simplecnn, 0.1 for resnet18)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers per process (training with --loader "
                        "workers; the test set always)")
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
    add_speed_arguments(p)
    add_run_arguments(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_speed_arguments(p: argparse.ArgumentParser) -> None:
    """How the data reaches the model, and how the model runs."""
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
    p.add_argument("--compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune",
                            "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode with --compile: reduce-overhead "
                        "replays each compiled graph's kernels as a CUDA graph, one "
                        "launch from the host instead of one per kernel (default: "
                        "default)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Where the run writes, how it resumes and stops, how long collectives may wait."""
    p.add_argument("--out", default="runs/cifar10",
                   help="folder for metrics.jsonl and checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also save every N steps (0: not mid-epoch)")
    p.add_argument("--checkpoint-epochs", type=int, default=1, metavar="K",
                   help="save at the end of every K-th epoch and of the last one "
                        "(default 1: every epoch; 0: at no epoch's end). A stop "
                        "(--stop-at-step, a signal) always saves")
    p.add_argument("--keep-checkpoints", type=int, default=1, metavar="K",
                   help="keep the last K checkpoints: checkpoint.pt and K-1 older "
                        "ones, checkpoint-step<N>.pt (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint.pt if rank 0 finds it")
    p.add_argument("--fail-at-step", type=int, default=-1,
                   help="(testing) the last rank raises an exception at the start of "
                        "this step (from 1), in its node's first attempt: no rank "
                        "completes it")
    p.add_argument("--stop-at-step", type=int, default=-1,
                   help="stop after this step with a checkpoint, as a job whose time "
                        "is up (resume with --resume)")
    p.add_argument("--stop-check-seconds", type=float, default=10.0,
                   metavar="SECONDS",
                   help="after a signal, stop within about this long (and within 10 "
                        "steps): the ranks agree on a stop more often than every 10 "
                        "steps where 10 steps take longer (default 10; the SLURM "
                        "recipe gives a third of its shutdown budget)")
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
    for name in ("workers", "seed", "checkpoint_every", "checkpoint_epochs"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be 0 or more, "
                    f"got {getattr(args, name)}")
    args.lr_from_rule = args.lr is None
    if args.lr_from_rule:
        args.lr = linear_rule_lr(args.model, args.global_batch)
    for name in ("lr", "init_timeout", "step_timeout", "stop_check_seconds"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive, "
                    f"got {getattr(args, name)}")
    if min(args.synthetic_size) < 5:
        p.error(f"--synthetic-size needs two numbers of at least 5, "
                f"got {args.synthetic_size}")
    check_data_format(p, args)


def check_data_format(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--data-format webdataset`` needs ``--shards`` and the workers loader;
    ``--shards`` and ``--manifest`` need it."""
    if args.data_format == "cifar":
        for name in ("shards", "manifest"):
            if getattr(args, name) is not None:
                p.error(f"--{name} is for --data-format webdataset: add that, or drop "
                        f"--{name} to train on the CIFAR-10 batches in --data")
        return
    if not args.shards or not expand_shards(args.shards):
        p.error("--data-format webdataset needs --shards URLS: a brace pattern or a "
                "comma list, e.g. http://HOST:PORT/train-{000000..000007}.tar")
    if args.loader == "gpu":
        p.error("--loader gpu keeps a CIFAR-format training set on the device; "
                "--data-format webdataset streams shards through DataLoader "
                "workers: use --loader workers (or auto)")
