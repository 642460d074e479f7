"""Part II in one file: DataLoader workers, their seeds, an IterableDataset's shards.
Run: torchrun --standalone --nproc_per_node=2 examples/part2_workers.py --workers 2"""
import argparse
import multiprocessing as mp
import os
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset,
                              TensorDataset, get_worker_info)


class Augmented(TensorDataset):  # module level: a spawned worker imports the class
    """Sample i, its worker's id (0 if none) and a random draw (say, a crop's)."""
    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return i, getattr(get_worker_info(), "id", 0), int(torch.randint(2**62, ()))


class Stream(IterableDataset):
    """Samples 0..n-1 as a stream; each worker of each rank keeps its own share."""
    def __init__(self, n: int):  # runs in the rank: a worker is in no process group
        self.n, self.rank, self.world = n, dist.get_rank(), dist.get_world_size()

    def __iter__(self):
        info = get_worker_info()  # in a worker: its id and how many the rank has
        workers, worker = (info.num_workers, info.id) if info else (1, 0)  # global id:
        for i in range(self.rank * workers + worker, self.n, self.world * workers):
            yield i, worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; --batch-size and --workers are per rank."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    least = {"samples": 1, "batch_size": 1, "epochs": 1, "workers": 0, "seed": 0}
    for name, default in zip(least, (12, 2, 2, 2, 0)):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    args = p.parse_args(argv)
    for name, value in least.items():
        if getattr(args, name) < value:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} < {value}")
    args.loader = dict(batch_size=args.batch_size, num_workers=args.workers)
    start = [m for m in mp.get_all_start_methods() if m != "fork"][-1]  # forkserver
    if args.workers:  # or spawn; never fork a rank: it has threads (chapter 6)
        args.loader.update(persistent_workers=True, multiprocessing_context=start)
    return args


def gather(loader: DataLoader) -> list[tuple]:
    """(rank, *sample) of a pass over each rank's loader, rank by rank, on all ranks."""
    rows, every = [], [None] * dist.get_world_size()
    for batch in loader:  # a batch holds a tensor per field: back to a tuple per sample
        rows += [(dist.get_rank(), *row) for row in zip(*(f.tolist() for f in batch))]
    dist.all_gather_object(every, rows)
    return sum(every, [])


def draws(args, epochs: int):
    """Yields each epoch's (rank, index, worker, draw) samples, from a new loader."""
    rank, seeds = dist.get_rank(), torch.Generator().manual_seed(args.seed)
    seed = int(torch.randint(2**62, (rank + 1,), generator=seeds)[rank])  # not seed +
    torch.manual_seed(seed)  # rank (seed 1 rank 0 = seed 0 rank 1); for --workers 0
    dataset = Augmented(torch.arange(args.samples))
    sampler = DistributedSampler(dataset, seed=args.seed)  # one sampler seed for all
    loader = DataLoader(dataset, sampler=sampler, **args.loader,  # workers start with
                        generator=torch.Generator().manual_seed(seed))  # a base_seed
    for epoch in range(epochs):  # from the generator; torch seeds worker k with
        sampler.set_epoch(epoch)  # base_seed + k (persistent: once, for all epochs)
        yield gather(loader)


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...
        raise SystemExit(f"torchrun --standalone --nproc_per_node=2 {__file__}")
    dist.init_process_group("gloo")  # from torchrun's environment
    mp.set_forkserver_preload(["torch"])  # this rank's fork server imports torch once
    rank, world = dist.get_rank(), dist.get_world_size()
    epochs, again = list(draws(args, args.epochs)), list(draws(args, 1))  # 2 loaders
    read = gather(DataLoader(Stream(args.samples), **args.loader))  # (rank, i, worker)
    dist.destroy_process_group()  # every rank checks the same rows: all fail or none
    values = [draw for rows in epochs for *_, draw in rows]
    if len(set(values)) != len(values) or again[0] != epochs[0]:
        raise SystemExit(1 if rank else "failed: draws repeat across workers, ranks "
                         "or epochs, or a new loader draws anew: seed per rank")
    if (times := Counter(r[1] for r in read)) != Counter(range(args.samples)):
        raise SystemExit(1 if rank else f"failed: stream sample reads: {dict(times)}")
    if rank == 0:  # how many samples each (rank, worker) drew, and read from the stream
        drawn = Counter(f"r{r}w{w}" for rows in epochs for r, _, w, _ in rows)
        streamed = Counter(f"r{r}w{w}" for r, _, w in read)
        print(f"{world} ranks x {args.workers} workers",
              f"draws per (rank, worker): {dict(sorted(drawn.items()))}",
              f"draws: all {len(values)} distinct; a new loader repeats epoch 0's",
              f"stream reads per (rank, worker): {dict(sorted(streamed.items()))}",
              f"stream: each of the {args.samples} samples read exactly once",
              sep="\n", flush=True)


if __name__ == "__main__":  # workers may import this file (as __mp_main__): guard main
    main()
