"""The capstone's training loop against a bare one, in the same processes: how much host
work ``utils.train_cifar10`` adds to each step.

    torchrun --standalone --nproc_per_node=2 -m utils.step_bench --device cpu \\
        --synthetic --synthetic-size 2048 256 --global-batch 64 --workers 0 \\
        --data /tmp/step_data --out /tmp/step_out --result step.json

Each epoch of ``--rounds`` (default 5) runs twice, in turns (ABBA: the loop that goes
first alternates, so that neither always runs on a warmer or a cooler machine): once
through the script's
``train_epoch`` (its ``train_step``, the loss summed on the device, the stop flag the
ranks agree on, the per-step seed, a checkpoint if ``--checkpoint-every`` asks), once
through a bare DDP loop (move the batch, forward, loss, backward, optimizer step:
nothing else), over the same loader, the same epoch's batches and the same wrapped
model. A warm-up epoch of each comes first and is not counted. Each loop is timed from
a barrier to the end of its last step on the device, in wall time and in rank 0's
main thread's CPU time (``time.thread_time``: on the CPU what the host spent, not what
it waited for, the other rank and gloo; on CUDA the host spins while it waits, and that
counts). The figures are paired: each round's
ratio of the two rates, reported as min / median / max, so that a reader sees whether
the spread is narrower than the difference. With CUDA, one more epoch of each loop runs
under the profiler for its GPU-busy share (the time in which a kernel ran), and one of
the script's loop under ``torch.cuda.set_sync_debug_mode("warn")``, which counts the
host's waits for the GPU (the epoch's end reads the loss: 1). Last comes
the GPU-bound ceiling (``ceiling``; ``--no-ceiling`` skips it): one resident batch,
no loader, no DDP, CUDA graphs. Rank 0 prints the figures and, with ``--result``,
writes them as JSON. Every other option is the training script's
(``python -m utils.train_cifar10 --help``); ``--epochs`` is set here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import results
from . import train_cifar10 as script

# the loop that runs first in each round: alternating, ABBA
ORDERS = (("bare", "capstone"), ("capstone", "bare"))

# what the figures depend on (utils.results records their hashes)
SOURCES = ["utils/step_bench.py", *results.package_sources("utils/train_cifar10"),
           "utils/gpu_loader.py", "utils/ddp.py"]


def bare_epoch(model, optimizer, loader, job, amp: str | None) -> int:
    """A bare DDP step per batch of ``loader``; returns the number of steps."""
    steps = 0
    for x, y in loader:
        x = x.to(job.device, non_blocking=True, memory_format=job.memory_format)
        y = y.to(job.device, non_blocking=True)
        with torch.autocast(job.device.type, dtype=torch.bfloat16,
                            enabled=amp is not None):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps += 1
    return steps


def _settled(job) -> None:
    """Every rank here, with nothing left queued on its device."""
    if job.cuda:
        torch.cuda.synchronize(job.device)
    if job.ddp:
        dist.barrier()


def parse(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """``(own options, the script's options)``."""
    own = argparse.ArgumentParser(prog="python -m utils.step_bench", add_help=False)
    own.add_argument("--rounds", type=int, default=5)
    own.add_argument("--result", help="rank 0 writes the figures here, as JSON")
    own.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                     help="skip the GPU-bound ceiling (its compilation takes a minute "
                          "on a GPU)")
    mine, rest = own.parse_known_args(argv)
    if mine.rounds < 1:
        raise SystemExit(f"error: --rounds must be at least 1, got {mine.rounds}")
    args = script.parse_args(rest)
    if args.amp == "fp16":
        raise SystemExit("error: --amp fp16 needs a loss scaler, which the bare loop "
                         "does not have; use --amp (bf16) or no --amp")
    if args.resume or args.stop_at_step >= 0 or args.fail_at_step >= 0:
        raise SystemExit("error: --resume, --stop-at-step and --fail-at-step are not "
                         "for a benchmark")
    # the schedule must last for every step the script's loop runs (warm-up included)
    args.epochs = 2 * (mine.rounds + 1)
    args.no_progress = True
    return mine, args


def run_loop(name: str, args, job, data, training, model, optimizer) -> int:
    """One epoch of loop ``name`` (``bare``, ``capstone``) over the same batches: its
    number of steps."""
    data.set_epoch(0, 0, job.batch_size)  # the same batches for both
    if name == "bare":
        return bare_epoch(model, optimizer, data.train_loader, job, args.amp)
    training.step_in_epoch = 0
    script.train_epoch(args, job, data, training, model, restarts=1)
    return training.steps_run


def timed_rounds(mine, args, job, data, training, model, optimizer
                 ) -> tuple[dict, dict]:
    """``(wall seconds, main thread's CPU seconds)`` of each loop's epochs, in ABBA
    order, after a warm-up round."""
    seconds = {"bare": [], "capstone": []}
    cpu_seconds = {"bare": [], "capstone": []}
    for round_ in range(mine.rounds + 1):  # round 0: the warm-up
        for name in ORDERS[round_ % 2]:
            _settled(job)
            t0, c0 = time.perf_counter(), time.thread_time()
            steps = run_loop(name, args, job, data, training, model, optimizer)
            _settled(job)
            if round_:
                seconds[name].append(time.perf_counter() - t0)
                cpu_seconds[name].append(time.thread_time() - c0)
            if steps != data.steps_per_epoch:
                raise SystemExit(f"error: the {name} loop ran {steps} steps, not "
                                 f"{data.steps_per_epoch}")
    return seconds, cpu_seconds


def covered_fraction(busy: list[tuple[float, float]],
                     everything: list[tuple[float, float]]) -> float:
    """The share of the span of ``everything`` (``(start, end)`` intervals) that the
    union of the ``busy`` intervals covers."""
    start = min(s for s, _ in everything)
    end = max(e for _, e in everything)
    covered, reach = 0.0, start
    for s, e in sorted(busy):
        s, e = max(s, reach), min(e, end)
        if e > s:
            covered, reach = covered + e - s, e
    return covered / (end - start) if end > start else 0.0


def gpu_busy(run, job) -> float | None:
    """The share of one call of ``run`` in which this GPU ran something (the union of
    the profiler's CUDA intervals, kernels, copies and sets, over the span of
    everything it recorded); ``None`` without CUDA. Biased up where NCCL's kernels
    wait for another rank (they spin), and down by the profiler's own cost to each
    launch from the host."""
    if not job.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    _settled(job)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(job.device)
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return None
    return round(covered_fraction(kernels, [(e.time_range.start, e.time_range.end)
                                            for e in events]), 3)


def host_syncs(run, job) -> int | None:
    """How many times one call of ``run`` made the host wait for this GPU, as
    ``torch.cuda.set_sync_debug_mode("warn")`` sees them (a lower bound: torch says
    not every synchronising operation warns, torch.distributed's among them);
    ``None`` without CUDA."""
    if not job.cuda:
        return None
    import warnings

    _settled(job)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing" in str(w.message) for w in seen)


def ceiling(mine, args, job, data, training) -> dict:
    """The GPU-bound ceiling: forward, backward and the optimizer's step on one batch
    already on the device, again and again, with no loader and no DDP, compiled with
    CUDA as CUDA graphs (``mode="reduce-overhead"``): what the GPU alone allows (the
    loops run the model as the script does, eager unless ``--compile``: the ratio
    counts Inductor's fused kernels too).
    Its steps/s (the median of ``--rounds`` epochs, after a warm-up) and GPU-busy
    share."""
    model = training.model
    if job.cuda:
        model = torch.compile(model, mode="reduce-overhead")
    data.set_epoch(0, 0, job.batch_size)
    x, y = next(iter(data.train_loader))
    x = x.to(job.device, memory_format=job.memory_format)
    y = y.to(job.device)
    batches = [(x, y)] * data.steps_per_epoch

    def epoch():
        return bare_epoch(model, training.optimizer, batches, job, args.amp)

    seconds = []
    for round_ in range(mine.rounds + 1):
        _settled(job)
        t0 = time.perf_counter()
        epoch()
        _settled(job)
        if round_:
            seconds.append(time.perf_counter() - t0)
    return {"steps_per_s": round(len(batches) / statistics.median(seconds), 2),
            "gpu_busy": gpu_busy(epoch, job)}


def _inductor_counters() -> dict:
    """What torch.compile counted (``cudagraph_skips``: graphs that ran without CUDA
    graphs, which the log names with ``TORCH_LOGS=cudagraphs``); empty if nothing was
    compiled."""
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


def main(argv=None) -> dict | None:
    mine, args = parse(argv)
    if args.deterministic:
        script.use_deterministic_algorithms()
    with script.Preemption() as preemption:
        job = script.set_up_job(args)
        job.preemption = preemption
        data = script.build_data(args, job)
        model, optimizer, scheduler = script.build_model(args, data.steps_per_epoch,
                                                         fused=job.cuda)
        training = script.resume_or_start(args, job, data, model, optimizer, scheduler)
        model = script.wrap_model(args, job, training)
        loops = (args, job, data, training, model, optimizer)
        seconds, cpu_seconds = timed_rounds(mine, *loops)
        busy = {name: gpu_busy(lambda: run_loop(name, *loops), job)
                for name in ORDERS[0]}
        # the script's epoch reads its loss once, at its end: 1 expected
        syncs = host_syncs(lambda: run_loop("capstone", *loops), job)
        # last: each rank trains its own copy there, without DDP
        top = ceiling(mine, args, job, data, training) if mine.ceiling else None
        result = None
        if job.master:
            result = report(args, mine, job, data, seconds, cpu_seconds, argv)
            result.update(gpu_busy=busy, capstone_host_syncs_per_epoch=syncs,
                          ceiling=top, inductor_counters=_inductor_counters())
            if top:
                result["capstone_over_ceiling"] = round(
                    result["capstone_steps_per_s"] / top["steps_per_s"], 3)
            print(json.dumps({k: result.get(k) for k in (
                "bare_steps_per_s", "capstone_steps_per_s", "capstone_over_bare",
                "capstone_over_bare_per_round", "gpu_busy",
                "capstone_over_ceiling")}), flush=True)
            if mine.result:
                results.write(mine.result, result, SOURCES, gpu=job.cuda)
        if job.ddp:
            dist.destroy_process_group()
    return result


def paired(seconds: dict) -> dict:
    """Each round's capstone rate over the bare loop's (their seconds' inverse ratio),
    as ``min``, ``median``, ``max``."""
    ratios = [b / c for b, c in zip(seconds["bare"], seconds["capstone"])]
    return {"min": round(min(ratios), 3), "median": round(statistics.median(ratios), 3),
            "max": round(max(ratios), 3)}


def report(args, mine, job, data, seconds: dict, cpu_seconds: dict, argv) -> dict:
    steps = data.steps_per_epoch
    rate = {name: steps / statistics.median(s) for name, s in seconds.items()}
    cpu_rate = {name: steps / statistics.median(s) for name, s in cpu_seconds.items()}
    return {
        "benchmark": "utils.step_bench: the capstone's train_epoch against a bare DDP "
                     "loop, same processes, same batches, in turns",
        "command": "torchrun --standalone "
                   f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', 1)} "
                   "-m utils.step_bench " + " ".join(
                       sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "environment": {"torch": torch.__version__,
                        "python": platform.python_version(),
                        "cpu_count": os.cpu_count(),
                        "gpu": (torch.cuda.get_device_name(job.device)
                                if job.cuda else None)},
        "world_size": job.world_size, "device": job.device.type, "model": args.model,
        "amp": args.amp, "sync_bn": args.sync_bn, "loader": data.loader,
        "batch_per_rank": job.batch_size, "steps_per_epoch": steps,
        "checkpoint_every": args.checkpoint_every, "rounds": mine.rounds,
        "order": "ABBA: the bare loop first in even rounds (0: the warm-up), the "
                 "capstone first in odd ones",
        "seconds_per_epoch": {k: [round(t, 4) for t in v] for k, v in seconds.items()},
        "thread_cpu_seconds_per_epoch": {k: [round(t, 4) for t in v]
                                         for k, v in cpu_seconds.items()},
        "bare_steps_per_s": round(rate["bare"], 2),
        "capstone_steps_per_s": round(rate["capstone"], 2),
        "capstone_images_per_s": round(rate["capstone"] * args.global_batch, 1),
        "capstone_over_bare": paired(seconds)["median"],
        "capstone_over_bare_per_round": paired(seconds),
        "bare_steps_per_thread_cpu_s": round(cpu_rate["bare"], 2),
        "capstone_steps_per_thread_cpu_s": round(cpu_rate["capstone"], 2),
        "capstone_over_bare_thread_cpu_per_round": paired(cpu_seconds)}


if __name__ == "__main__":
    from utils.step_bench import main as _main  # this module's copy (see train_cifar10)

    _main()
