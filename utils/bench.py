"""Benchmarks that are run by hand (``python -m utils.bench sampler``), never as
timed tests.

Each benchmark measures the things it compares in one run, alternating them, and reports
the ratio, because absolute times on a shared machine are noisy. ``--out FILE`` saves
the result as JSON with the hardware, software versions, command and date, for a chapter
to show.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from . import results
from .results import environment  # re-exported: the benchmarks' files name it
from .samplers import (PermutationShardSampler, ShardSampler, _legacy_feistel,
                       cycle_walk)

__all__ = ["bench_sampler", "bench_samplers", "bench_ddp", "bench_restart",
           "environment"]


def _time_once(sampler) -> float:
    start = time.perf_counter()
    indices = list(sampler)
    elapsed = time.perf_counter() - start
    assert len(indices) == len(sampler)
    return elapsed


def bench_sampler(n: int = 10**7, num_replicas: int = 8, repeats: int = 5,
                  seed: int = 0) -> dict:
    """Time ``list(sampler)`` for torch's DistributedSampler and ShardSampler,
    alternating; best of ``repeats``."""
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
        "speedup_ours_vs_torch": round(
            best["DistributedSampler"] / best["ShardSampler"], 2),
    }


def _make_sampler(kind: str, n: int, num_replicas: int):
    """Rank 0's sampler of ``kind``: "torch" (``DistributedSampler``) or "ours"
    (``PermutationShardSampler``)."""
    if kind == "torch":
        return DistributedSampler(range(n), num_replicas=num_replicas, rank=0)
    return PermutationShardSampler(n, num_replicas, 0)


# The loop bodies timed, by name: each takes one rank's whole epoch and returns how
# many indices it got.
def _plain_loop(sampler) -> int:
    for _ in sampler:
        pass
    return len(sampler)


def _count_loop(sampler) -> int:
    count = 0
    for _ in sampler:
        count += 1
    return count


def _batch_sampler_loop(sampler) -> int:
    batches = BatchSampler(sampler, 256, False)
    for _ in batches:
        pass
    return len(sampler)


def _index_batches_loop(sampler) -> int:
    for _ in sampler.index_batches(256):
        pass
    return sampler.yielded()


_LOOPS = {"for i in sampler: pass": _plain_loop,
          "for i in sampler: count += 1": _count_loop,
          "BatchSampler(sampler, 256, False) (what a DataLoader does)":
              _batch_sampler_loop,
          "sampler.index_batches(256) (NumPy)": _index_batches_loop}
_OURS_ONLY = ("sampler.index_batches(256) (NumPy)",)


def _sampler_case(kind: str, n: int, num_replicas: int) -> dict:
    """One rank's epoch of ``kind`` ("torch" or "ours") at ``n``, in this process:
    time to the first index, time for the whole epoch with ``for i in sampler: pass``,
    peak memory added; then the rate of each loop body of ``_LOOPS``, over the whole
    epoch of a fresh sampler (the process warmed up by the first epoch)."""
    import resource

    def peak_bytes() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    before = peak_bytes()
    start = time.perf_counter()
    sampler = _make_sampler(kind, n, num_replicas)
    it = iter(sampler)
    next(it)
    first = time.perf_counter() - start
    for _ in it:
        pass
    epoch = time.perf_counter() - start
    count = len(sampler)
    case = {"first_index_s": first, "epoch_s": epoch, "indices": count,
            "indices_per_s": count / epoch,
            "peak_added_mb": (peak_bytes() - before) / 1e6}
    del it
    rates = {}
    for name, loop in _LOOPS.items():
        if kind == "torch" and name in _OURS_ONLY:
            continue
        start = time.perf_counter()
        got = loop(_make_sampler(kind, n, num_replicas))
        rates[name] = count / (time.perf_counter() - start)
        assert got == count, f"{name}: {got} indices, expected {count}"
    return dict(case, rates_per_s=rates)


class _LegacySampler(PermutationShardSampler):
    """``PermutationShardSampler`` as it drew the Feistel order before issue 48: the
    same chunks, with the uint64 network (``_legacy_feistel``) and that version's
    lookup (``permute``'s range check, a copy to int64). Only for measuring the new
    network against it in one process; its orders are no longer the sampler's."""

    def _lookup(self):
        if self.shuffle != "feistel":
            return super()._lookup()
        keys, n = self.keys(), self.n

        def legacy_permute(positions) -> np.ndarray:
            x = np.asarray(positions, dtype=np.uint64)
            if x.size and int(x.max()) >= n:
                raise ValueError(f"positions must lie in [0, {n})")
            return cycle_walk(x, n, keys, _legacy_feistel).astype(np.int64)

        return legacy_permute


# the loop bodies the new network is compared on with the legacy one
_COMPARED = ("for i in sampler: pass",
             "BatchSampler(sampler, 256, False) (what a DataLoader does)")


def _legacy_comparison(n: int, num_replicas: int, rounds: int = 2) -> dict:
    """Rank 0's whole epoch at ``n`` through each loop body of ``_COMPARED``, with the
    new network and the legacy one (``exact_max_n=0``: the network at every ``n``),
    alternating, ``rounds`` times, in this process; rates in indices per second of
    this thread's CPU time (``time.thread_time``), which other processes' load on a
    shared machine does not count."""
    samplers = {"new": PermutationShardSampler, "legacy": _LegacySampler}
    rates = {kind: {body: [] for body in _COMPARED} for kind in samplers}
    count = len(PermutationShardSampler(n, num_replicas, 0))
    for _ in range(rounds):
        for body in _COMPARED:
            for kind, make in samplers.items():
                sampler = make(n, num_replicas, 0, exact_max_n=0)
                start = time.thread_time()
                got = _LOOPS[body](sampler)
                rates[kind][body].append(count / (time.thread_time() - start))
                assert got == count, f"{kind} {body}: {got} indices, expected {count}"
    best = {kind: {body: max(r) for body, r in by_body.items()}
            for kind, by_body in rates.items()}
    return {"n": n, "num_replicas": num_replicas, "rank": 0, "indices": count,
            "rounds": rounds, "clock": "time.thread_time",
            "rates_per_thread_cpu_s": rates,
            "best_rates_per_thread_cpu_s": best,
            "new_over_legacy": {body: best["new"][body] / best["legacy"][body]
                                for body in _COMPARED}}


_METHOD = (
    "one run; each case in a fresh Python process, rank 0 of num_replicas (torch: "
    "DistributedSampler(range(n), num_replicas, rank=0); ours: "
    "PermutationShardSampler(n, num_replicas, 0)). first_index_s: building the "
    "sampler, iter(), next(), the process's first epoch. epoch_s: building the sampler "
    "to the end of that first epoch, the rank's whole epoch taken with a plain `for i "
    "in sampler: pass` (first index included); indices_per_s = indices / epoch_s. "
    "peak_added_mb: ru_maxrss after that epoch minus before, in that process. "
    "rates_per_s: then, in the same process, each loop body once over the rank's "
    "whole epoch (indices), from building a fresh sampler to the end of the loop, "
    "one body after the other, each loop inside a function (local variables): "
    "'for i in sampler: pass' (the same loop as epoch_s, timed again, warm); 'for i "
    "in sampler: count += 1' (a counter per index); 'BatchSampler(sampler, 256, "
    "False) (what a DataLoader does)': `for batch in BatchSampler(sampler, 256, "
    "False): pass`, lists of 256 Python ints, as a DataLoader with batch_size=256 "
    "makes them; 'sampler.index_batches(256) (NumPy)': `for batch in "
    "sampler.index_batches(256): pass`, int64 arrays of 256, no Python int per "
    "index (ours only). The loop body changes the rate: compare rates of one body. "
    "index_batches_over_for_loop: ours' rates_per_s of 'sampler.index_batches(256) "
    "(NumPy)' over its 'for i in sampler: pass'. legacy_comparison: at the largest n, "
    "in one more fresh process, rank 0's whole epoch through 'for i in sampler: pass' "
    "and 'BatchSampler(sampler, 256, False)' with the Feistel network of this version "
    "('new': PermutationShardSampler(n, num_replicas, 0, exact_max_n=0)) and with the "
    "one before issue 48 ('legacy': the same sampler with the uint64 network, "
    "utils.bench._LegacySampler), alternating new and legacy, each from building a "
    "fresh sampler to the end of the loop, 'rounds' times; rates in indices per "
    "second of the loop's thread-CPU time (time.thread_time), new_over_legacy the "
    "ratio of the best rates")


def _in_fresh_process(call: str):
    """What ``utils.bench``'s function call ``call`` (Python source) returns, run in
    a fresh Python process, as JSON."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import json; import utils.bench as b; print(json.dumps(b.{call}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def bench_samplers(sizes=(10**6, 10**7, 10**8, 10**9), num_replicas: int = 8,
                   torch_max: int = 10**8, compare_rounds: int = 2) -> dict:
    """``DistributedSampler`` against ``PermutationShardSampler``: for each ``n``, one
    rank's epoch in a fresh process per case (so peak memory is the case's own); then
    the Feistel network against the one before issue 48 at the largest ``n``
    (:func:`_legacy_comparison`), in a fresh process too."""
    cases = {}
    for n in sizes:
        for kind in ("torch", "ours"):
            if kind == "torch" and n > torch_max:
                continue
            case = _in_fresh_process(f"_sampler_case({kind!r}, {n}, {num_replicas})")
            cases[f"{kind} {n}"] = dict(case, kind=kind, n=n)
            _print_case(cases[f"{kind} {n}"])
    comparison = _in_fresh_process(
        f"_legacy_comparison({max(sizes)}, {num_replicas}, {compare_rounds})")
    _print_comparison(comparison)
    ratios = {n: cases[f"torch {n}"]["first_index_s"] / cases[f"ours {n}"][
        "first_index_s"] for n in sizes if f"torch {n}" in cases}
    rates = {n: cases[f"ours {n}"]["rates_per_s"] for n in sizes}
    speedups = {str(n): r[_OURS_ONLY[0]] / r["for i in sampler: pass"]
                for n, r in rates.items()}
    return {"num_replicas": num_replicas, "rank": 0, "cases": list(cases.values()),
            "first_index_ratio_torch_over_ours": {str(n): r for n, r in ratios.items()},
            "index_batches_over_for_loop": speedups,
            "torch_skipped": {str(n): (
                f"torch.randperm(n).tolist() needs about {n * 50 / 1e9:.0f} GB "
                f"(a list of n Python ints, ~28 B each plus an 8 B pointer, plus "
                f"the int64 tensor): more than this machine's memory")
                for n in sizes if n > torch_max},
            "legacy_comparison": comparison,
            "method": _METHOD}


def _print_comparison(c: dict) -> None:
    print(f"n={c['n']}, rank 0 of {c['num_replicas']}, per second of thread-CPU "
          f"time, best of {c['rounds']}:", flush=True)
    for body, ratio in c["new_over_legacy"].items():
        best = c["best_rates_per_thread_cpu_s"]
        print(f"{'':18}{best['new'][body] / 1e6:6.1f} M/s new, "
              f"{best['legacy'][body] / 1e6:6.1f} M/s legacy: {ratio:.2f}x  {body}",
              flush=True)


def _print_case(c: dict) -> None:
    print(f"{c['kind']:>5} n={c['n']:>10}: first index "
          f"{1000 * c['first_index_s']:9.3f} ms, epoch {c['epoch_s']:7.2f} s, "
          f"peak +{c['peak_added_mb']:7.1f} MB", flush=True)
    for name, rate in c["rates_per_s"].items():
        print(f"{'':18}{rate / 1e6:6.1f} M/s  {name}", flush=True)


def _ddp_wrappers(make_model, bucket_cap_mb: float) -> dict:
    """The wrappers the DDP benchmark compares, each around a fresh model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .ddp import BucketedDDP, NaiveDDP

    cap = bucket_cap_mb
    return {
        "NaiveDDP": NaiveDDP(make_model()),
        "BucketedDDP": BucketedDDP(make_model(), bucket_cap_mb=cap),
        "BucketedDDP, overlap=False": BucketedDDP(make_model(), bucket_cap_mb=cap,
                                                  overlap=False),
        "BucketedDDP, one bucket": BucketedDDP(make_model(),
                                               bucket_cap_mb=float("inf")),
        "torch DDP": DDP(make_model(), bucket_cap_mb=cap),
    }


def _torch_ddp_buckets(make_model, bucket_cap_mb: float, x: torch.Tensor) -> int:
    """Buckets torch's DDP all-reduces per step once it has rebuilt them (step 2 on)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(make_model(), bucket_cap_mb=bucket_cap_mb)
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_hook)
    for _ in range(2):
        calls.clear()
        ddp(x).square().mean().backward()
    return len(calls)


def _ddp_step_times(layers: int, width: int, batch: int, steps: int, rounds: int,
                    bucket_cap_mb: float) -> dict:
    """Runs on every rank: median step time of each wrapper, in alternating rounds."""
    import statistics

    import torch.distributed as dist
    from torch import nn

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                               for _ in range(layers)])

    wrappers = _ddp_wrappers(make_model, bucket_cap_mb)
    optimizers = {k: torch.optim.SGD(w.parameters(), lr=1e-3)
                  for k, w in wrappers.items()}
    x = torch.randn(batch, width)
    times = {k: [] for k in wrappers}

    def step(name):
        optimizers[name].zero_grad()
        wrappers[name](x).square().mean().backward()
        optimizers[name].step()

    for name in wrappers:  # warm-up (torch's DDP rebuilds its buckets after step 1)
        for _ in range(3):
            step(name)
    for _ in range(rounds):
        for name in wrappers:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(name)
            times[name].append((time.perf_counter() - start) / steps)
    buckets = {k: len(w.buckets) for k, w in wrappers.items() if hasattr(w, "buckets")}
    buckets["torch DDP"] = _torch_ddp_buckets(make_model, bucket_cap_mb, x)
    buckets["NaiveDDP"] = 2 * layers  # one all-reduce per parameter tensor
    return {"seconds": {k: statistics.median(v) for k, v in times.items()},
            "rounds": times, "buckets": buckets}


def bench_ddp(layers: int = 100, width: int = 64, batch: int = 32, steps: int = 20,
              rounds: int = 5, world_size: int = 2,
              bucket_cap_mb: float = 0.25) -> dict:
    """Step time of NaiveDDP, BucketedDDP (overlapped, not overlapped, one bucket)
    and torch DDP on ``world_size`` CPU ranks, in one run, with buckets of
    ``bucket_cap_mb``."""
    from .launch import run_distributed

    per_rank = run_distributed(_ddp_step_times, world_size, layers, width, batch, steps,
                               rounds, bucket_cap_mb, timeout=1200)
    # a step ends when the slowest rank is done: take the slower rank's median
    names = list(per_rank[0]["seconds"])
    seconds = {k: max(r["seconds"][k] for r in per_rank) for k in names}
    per_round = {k: [max(r["rounds"][k][i] for r in per_rank) for i in range(rounds)]
                 for k in names}
    overlap_ratios = [a / b for a, b in zip(per_round["BucketedDDP, overlap=False"],
                                            per_round["BucketedDDP"])]
    megabytes = layers * (width * width + width) * 4 / 2**20
    return {
        "benchmark": "median seconds per training step (forward, backward with "
                     "gradient sync, SGD step)",
        "model": f"{layers} x (Linear({width}, {width}) + Tanh): {2 * layers} "
                 f"parameter tensors, {megabytes:.2f} MiB of gradients",
        "gradient_mib": round(megabytes, 3),
        "bucket_cap_mb": bucket_cap_mb,
        "all_reduces_per_step": per_rank[0]["buckets"],
        "batch_per_rank": batch,
        "world_size": world_size,
        "backend": "gloo",
        "steps_per_round": steps,
        "rounds": rounds,
        "seconds_per_step": {k: round(v, 6) for k, v in seconds.items()},
        "seconds_per_step_each_round": {k: [round(t, 6) for t in v]
                                        for k, v in per_round.items()},
        "ratio_to_torch_ddp": {k: round(v / seconds["torch DDP"], 3)
                               for k, v in seconds.items()},
        "ratio_overlap_false_to_overlap": round(
            seconds["BucketedDDP, overlap=False"] / seconds["BucketedDDP"], 3),
        "ratio_overlap_false_to_overlap_each_round": [round(r, 3)
                                                      for r in overlap_ratios],
    }


RESTART_DEMO = """
import os, sys, datetime, torch.distributed as dist
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
timeout = datetime.timedelta(seconds=60)   # the same for both ways
if sys.argv[1] == "prefix":   # what utils.train_cifar10.init_process_group does
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
else:
    dist.init_process_group("gloo", timeout=timeout)
dist.barrier()
if attempt == 0 and dist.get_rank() == 1:
    os._exit(1)               # rank 1 dies; torchrun restarts both ranks
dist.barrier()
print(f"attempt {attempt}, rank {dist.get_rank()}: connected", flush=True)
"""


# how long one run of the restart demo may take: its collectives' timeout (60 s), twice,
# and the start-up; a run still going then is killed and counted as hung
RESTART_RUN_LIMIT = 150


def bench_restart(runs: int = 5) -> dict:
    """How often ranks restarted by ``torchrun --max-restarts=1`` reconnect, with the
    default ``init_process_group`` and with a store prefix per attempt, both with the
    same 60 s timeout (the demo script is stored in the result). Each run ends
    connected, in gloo's ``connectFullMesh failed``, in another failure, or hung: still
    running after ``RESTART_RUN_LIMIT`` seconds, when its processes are killed."""
    import tempfile

    from . import hangs

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "restart_demo.py")
        with open(path, "w") as f:
            f.write(RESTART_DEMO)
        for mode in ("default", "prefix"):
            connected = mesh_errors = hung = 0
            for _ in range(runs):
                try:
                    done = hangs.run([sys.executable, "-m", "torch.distributed.run",
                                      "--standalone", "--nproc_per_node=2",
                                      "--max-restarts=1", path, mode],
                                     env=env, timeout=RESTART_RUN_LIMIT)
                except hangs.Hang:
                    hung += 1
                    continue
                connected += ("attempt 1, rank 0: connected" in done.stdout
                              and "attempt 1, rank 1: connected" in done.stdout)
                mesh_errors += "connectFullMesh failed" in done.stdout + done.stderr
            counts[mode] = {"runs": runs, "restarted_ranks_connected": connected,
                            "gloo_connect_errors": mesh_errors,
                            f"hung_past_{RESTART_RUN_LIMIT}_s": hung}
    return {"benchmark": "torchrun --standalone --nproc_per_node=2 --max-restarts=1, "
                         "rank 1 dies after the first barrier",
            "script": RESTART_DEMO.strip(), "results": counts}


# what each benchmark's figures depend on (utils.results records their hashes): the
# code it measures and this file, which runs it
SOURCES = {"sampler": ["utils/samplers.py", "utils/bench.py::bench_sampler",
                       "utils/bench.py::_time_once"],
           "samplers": ["utils/samplers.py", "utils/bench.py::bench_samplers",
                        "utils/bench.py::_sampler_case",
                        "utils/bench.py::_make_sampler",
                        "utils/bench.py::_LOOPS", "utils/bench.py::_plain_loop",
                        "utils/bench.py::_count_loop", "utils/bench.py::_METHOD",
                        "utils/bench.py::_batch_sampler_loop",
                        "utils/bench.py::_index_batches_loop",
                        "utils/bench.py::_in_fresh_process",
                        "utils/bench.py::_LegacySampler",
                        "utils/bench.py::_COMPARED",
                        "utils/bench.py::_legacy_comparison"],
           "ddp": ["utils/ddp.py", "utils/launch.py", "utils/bench.py::bench_ddp",
                   "utils/bench.py::_ddp_step_times", "utils/bench.py::_ddp_wrappers",
                   "utils/bench.py::_torch_ddp_buckets"],
           "restart": ["utils/bench.py::RESTART_DEMO", "utils/bench.py::bench_restart",
                       "utils/bench.py::RESTART_RUN_LIMIT"]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["loader"]:  # its own options: utils/loader_bench.py
        from .loader_bench import main as loader_main

        loader_main(argv[1:])
        return
    # the docstring's first paragraph (argparse re-flows it onto one line)
    parser = argparse.ArgumentParser(prog="python -m utils.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("what",
                        choices=["sampler", "samplers", "ddp", "restart", "loader"],
                        help="which benchmark to run (loader: its own options, see "
                             "python -m utils.bench loader --help)")
    parser.add_argument("--n", type=int, default=10**7,
                        help="data set size (default 10^7)")
    parser.add_argument("--num-replicas", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5,
                        help="repeats (sampler, restart) or rounds (ddp); default 5")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25,
                        help="ddp: BucketedDDP's and torch DDP's bucket size, MiB "
                             "(default 0.25)")
    parser.add_argument("--out", help="save the result as JSON here")
    args = parser.parse_args(argv)
    if args.n < 1 or args.num_replicas < 1 or args.repeats < 1:
        parser.error("--n, --num-replicas and --repeats must be at least 1")
    if not args.bucket_cap_mb > 0:
        parser.error("--bucket-cap-mb must be positive")
    if args.what == "sampler":
        result = bench_sampler(args.n, args.num_replicas, args.repeats)
        for name, t in result["best_seconds"].items():
            print(f"{name:>20}: {t:.3f} s")
        print("ratio DistributedSampler / ShardSampler = "
              f"{result['speedup_ours_vs_torch']:.2f} (>= 1.0 means ours is no slower)")
    elif args.what == "samplers":
        result = bench_samplers(num_replicas=args.num_replicas)
    elif args.what == "restart":
        result = bench_restart(args.repeats)
        for mode, c in result["results"].items():
            print(f"{mode:>8}: restarted ranks connected in "
                  f"{c['restarted_ranks_connected']} of {c['runs']} runs, "
                  f"gloo connect errors in {c['gloo_connect_errors']}, hung in "
                  f"{c[f'hung_past_{RESTART_RUN_LIMIT}_s']}")
    else:
        result = bench_ddp(rounds=args.repeats, bucket_cap_mb=args.bucket_cap_mb)
        for name, t in result["seconds_per_step"].items():
            print(f"{name:>26}: {1000 * t:7.2f} ms per step, "
                  f"{result['ratio_to_torch_ddp'][name]:.2f}x torch DDP, "
                  f"{result['all_reduces_per_step'][name]} all-reduces")
    result["environment"] = environment()
    result["command"] = "python -m utils.bench " + " ".join(argv)
    result["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if args.out:
        results.write(args.out, result, SOURCES[args.what])


if __name__ == "__main__":
    main()
