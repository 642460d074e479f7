"""Part I in one file: DistributedSampler shards a data set; set_epoch reshuffles it.

    torchrun --standalone --nproc_per_node=2 examples/part1_sharding.py --samples 11

Each rank loads its shard through a DataLoader; rank 0 prints every rank's indices of
every epoch (gathered: in rank order). Checked: the shards partition the data set (pads
or drops counted) and each epoch's order is new; exit status 1 if not."""
import argparse
import os
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: sizes and counts are 1 or more."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=10)  # the data set's size N
    p.add_argument("--batch-size", type=int, default=2)  # per rank
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)  # the sampler's: equal on all ranks
    p.add_argument("--drop-last", action="store_true")  # cut the tail; else pad it
    args = p.parse_args(argv)
    for name in ("samples", "batch_size", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    return args


def check_epoch(shards: list[list[int]], n: int, drop_last: bool) -> tuple[list, str]:
    """(the global order, a summary) of one epoch's shards, rank by rank; ValueError if
    they do not partition range(n) as DistributedSampler should."""
    world, counts = len(shards), [len(s) for s in shards]
    if len(set(counts)) != 1:  # unequal shares: a DDP step would hang
        raise ValueError(f"the ranks got unequal shares {counts}")
    order = [s[k] for k in range(counts[0]) for s in shards]  # rank r: r, r + W, ...
    seen = Counter(order)
    if not set(seen) <= set(range(n)):
        raise ValueError(f"indices outside 0..{n - 1}: {sorted(seen)}")
    missing = sorted(set(range(n)) - set(seen))
    repeats = sorted((seen - Counter(set(order))).elements())  # each second, third use
    if drop_last:  # each index at most once; the n % W left over are cut
        if repeats or len(missing) != n % world:
            raise ValueError(f"repeated {repeats}, missing {missing} (expected "
                             f"none repeated, {n % world} cut)")
        return order, f"{len(order)} of {n} samples once each, cut {missing}"
    if missing or repeats != sorted(order[n:]) or len(repeats) != -n % world:
        raise ValueError(f"missing {missing}, repeated {repeats} (expected none "
                         f"missing, {-n % world} padded at the end: {order[n:]})")
    return order, f"all {n} samples once each, plus {len(repeats)} padded {repeats}"


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...
        raise SystemExit(f"torchrun --standalone --nproc_per_node=2 {__file__}, please")
    dist.init_process_group("gloo")  # CPU processes; torchrun's environment says where
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = TensorDataset(torch.arange(args.samples))  # sample i is the number i
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed,  # the group's
                                 drop_last=args.drop_last)  # rank and world size
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    if rank == 0:
        print(f"{args.samples} samples on {world} ranks, drop_last={args.drop_last}: "
              f"{len(sampler)} per rank per epoch, in {len(loader)} batches of at most "
              f"{args.batch_size}", flush=True)
    previous, failure = None, None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # first thing: a new order, the same on every rank
        batches = [batch.tolist() for (batch,) in loader]
        shards = [None] * world
        dist.all_gather_object(shards, batches)  # every rank gets all and checks alike
        if rank == 0:
            for r, rank_batches in enumerate(shards):
                print(f"epoch {epoch} rank {r}: "
                      + " ".join(str(b).replace(" ", "") for b in rank_batches))
        try:
            order, summary = check_epoch([sum(b, []) for b in shards], args.samples,
                                         args.drop_last)  # one list per rank
            if order == previous and args.samples >= 10:  # by chance: 1 in 10! or less
                raise ValueError(f"the same order as epoch {epoch - 1}: is "
                                 "sampler.set_epoch(epoch) called every epoch?")
        except ValueError as error:
            failure = f"failed: epoch {epoch}: {error}"
            break
        previous = order
        if rank == 0:
            print(f"epoch {epoch}: partition ok: {summary}", flush=True)
    dist.destroy_process_group()
    if failure:  # every rank saw the same shards: all of them exit with status 1
        raise SystemExit(1 if rank else failure)
    if rank == 0:
        new = ", each order new" if args.epochs > 1 and args.samples >= 10 else ""
        print(f"ok: {args.epochs} epoch(s), each a partition{new}", flush=True)


if __name__ == "__main__":
    main()
