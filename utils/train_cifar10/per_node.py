"""Hardening step 3: data per node; rank 0 decides on resuming.

Each node's local rank 0 prepares its own copy, the ranks check that the copies agree,
and rank 0 alone decides whether to resume, for everyone."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..data import download_cifar10, is_synthetic_cifar10, write_synthetic_cifar10
from ..devices import collective_device
from .checkpoints import load_checkpoint


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
    if args.download and is_synthetic_cifar10(args.data):  # on every rank: all stop
        raise SystemExit(f"error: --data {args.data} holds the book's generated "
                         "stand-in, not CIFAR-10: --download would train on it; give "
                         "--download another --data")
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
