"""The capstone's training loop against a bare one, in the same processes: how much host
work ``utils.train_cifar10`` adds to each step.

    torchrun --standalone --nproc_per_node=2 -m utils.step_bench --device cpu \\
        --synthetic --synthetic-size 2048 256 --global-batch 64 --workers 0 \\
        --data /tmp/step_data --out /tmp/step_out --result step.json

Each epoch of ``--rounds`` (default 5) runs twice, in turns: once through the script's
``train_epoch`` (its ``train_step``, the loss summed on the device, the stop flag the
ranks agree on, the per-step seed, a checkpoint if ``--checkpoint-every`` asks), once
through a bare DDP loop (move the batch, forward, loss, backward, optimizer step:
nothing else), over the same loader, the same epoch's batches and the same wrapped
model. A warm-up epoch of each comes first and is not counted. Each loop is timed from
a barrier to the end of its last step on the device. Rank 0 prints the medians and,
with ``--result``, writes them as JSON. Every other option is the training script's
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


def main(argv=None) -> dict | None:
    mine, args = parse(argv)
    if args.deterministic:
        script.use_deterministic_algorithms()
    with script.Preemption() as preemption:
        job = script.set_up_job(args)
        job.preemption = preemption
        data = script.build_data(args, job)
        model, optimizer, scheduler = script.build_model(args, data.steps_per_epoch)
        training = script.resume_or_start(args, job, data, model, optimizer, scheduler)
        model = script.wrap_model(args, job, training)
        seconds = {"bare": [], "capstone": []}
        for round_ in range(mine.rounds + 1):  # round 0: the warm-up
            for name in ("bare", "capstone"):
                data.set_epoch(0, 0, job.batch_size)  # the same batches for both
                _settled(job)
                t0 = time.perf_counter()
                if name == "bare":
                    steps = bare_epoch(model, optimizer, data.train_loader, job,
                                       args.amp)
                else:
                    training.step_in_epoch = 0
                    script.train_epoch(args, job, data, training, model, restarts=1)
                    steps = training.steps_run
                _settled(job)
                if round_:
                    seconds[name].append(time.perf_counter() - t0)
                if steps != data.steps_per_epoch:
                    raise SystemExit(f"error: the {name} loop ran {steps} steps, not "
                                     f"{data.steps_per_epoch}")
        result = None
        if job.master:
            result = report(args, mine, job, data, seconds, argv)
            print(json.dumps({k: result[k] for k in (
                "bare_steps_per_s", "capstone_steps_per_s", "capstone_over_bare")}),
                flush=True)
            if mine.result:
                results.write(mine.result, result, SOURCES, gpu=job.cuda)
        if job.ddp:
            dist.destroy_process_group()
    return result


def report(args, mine, job, data, seconds: dict, argv) -> dict:
    steps = data.steps_per_epoch
    rate = {name: steps / statistics.median(s) for name, s in seconds.items()}
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
        "seconds_per_epoch": {k: [round(t, 4) for t in v] for k, v in seconds.items()},
        "bare_steps_per_s": round(rate["bare"], 2),
        "capstone_steps_per_s": round(rate["capstone"], 2),
        "capstone_images_per_s": round(rate["capstone"] * args.global_batch, 1),
        "capstone_over_bare": round(rate["capstone"] / rate["bare"], 3)}


if __name__ == "__main__":
    from utils.step_bench import main as _main  # this module's copy (see train_cifar10)

    _main()
