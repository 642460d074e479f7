"""Benchmarks that are run by hand (``python -m utils.bench sampler``), never as timed tests.

Each benchmark measures the things it compares in one run, alternating them, and reports the
ratio, because absolute times on a shared machine are noisy. ``--out FILE`` saves the result as
JSON with the hardware, software versions, command and date, for a chapter to show.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time

import torch
from torch.utils.data import DistributedSampler

from .samplers import ShardSampler

__all__ = ["bench_sampler", "environment"]


def environment() -> dict:
    """Hardware and software the measurement ran on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
    }


def _time_once(sampler) -> float:
    start = time.perf_counter()
    indices = list(sampler)
    elapsed = time.perf_counter() - start
    assert len(indices) == len(sampler)
    return elapsed


def bench_sampler(n: int = 10**7, num_replicas: int = 8, repeats: int = 5, seed: int = 0) -> dict:
    """Time ``list(sampler)`` for torch's DistributedSampler and ShardSampler, alternating; best of ``repeats``."""
    data = range(n)
    theirs = DistributedSampler(data, num_replicas=num_replicas, rank=0, seed=seed)
    ours = ShardSampler(data, num_replicas=num_replicas, rank=0, seed=seed)
    assert list(theirs) == list(ours), "ShardSampler disagrees with DistributedSampler"
    times = {"DistributedSampler": [], "ShardSampler": []}
    for _ in range(repeats):
        times["DistributedSampler"].append(_time_once(theirs))
        times["ShardSampler"].append(_time_once(ours))
    best = {k: min(v) for k, v in times.items()}
    return {
        "benchmark": "list(sampler) for rank 0, shuffled, best of repeats",
        "n": n,
        "num_replicas": num_replicas,
        "repeats": repeats,
        "seconds": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "best_seconds": {k: round(t, 4) for k, t in best.items()},
        "speedup_ours_vs_torch": round(best["DistributedSampler"] / best["ShardSampler"], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m utils.bench", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["sampler"], help="which benchmark to run")
    parser.add_argument("--n", type=int, default=10**7, help="data set size (default 10^7)")
    parser.add_argument("--num-replicas", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="save the result as JSON here")
    args = parser.parse_args(argv)
    if args.n < 1 or args.num_replicas < 1 or args.repeats < 1:
        parser.error("--n, --num-replicas and --repeats must be at least 1")
    result = bench_sampler(args.n, args.num_replicas, args.repeats)
    result["environment"] = environment()
    result["command"] = "python -m utils.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    result["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    for name, t in result["best_seconds"].items():
        print(f"{name:>20}: {t:.3f} s")
    print(f"ratio DistributedSampler / ShardSampler = {result['speedup_ours_vs_torch']:.2f} (>= 1.0 means ours is no slower)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, args.out)
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
