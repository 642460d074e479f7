"""The SLURM recipe's jobs on the test cluster (``utils.slurm_cluster``), for its tests
(``tests/test_slurm_recipe.py``) and chapter 13's record of one job's life:

    python -m utils.slurm_job --out book/results/slurm_job_cpu.json

``examples/slurm/train_cifar10.sbatch`` is submitted with ``sbatch`` as it is, from
the repository's root, with the variables for one process per node on the CPU
(``job_env``). ``warned_job``: a job whose steps are slow in its first run
(``SLOW_THEN_FAULTY``), submitted with ``--time=2 --signal=B:USR1@60``: Slurm warns
it about a minute before its limit, it saves and requeues itself; requeued, one rank
raises in its first step with its DataLoader workers running, torchrun restarts the
ranks, and they resume (a requeued run may be warned again, and requeued again). The
record: each Slurm state the job passed through with the seconds since its
submission, the batch script's lines and each node's main ones (what varies from run
to run replaced), the warning's time before the limit, how long the requeued job
waited, and whether the final weights equal an uninterrupted job's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import hangs
from .results import ROOT, package_sources, write
from .slurm_cluster import ENDED, INTERFACE, NODES, Cluster

SBATCH = Path(ROOT) / "examples" / "slurm" / "train_cifar10.sbatch"
TIMEOUT = 240
# 640 training images, a global batch of 64: 10 steps an epoch
TRAIN_ARGS = ("--device cpu --global-batch 64 --workers 2 --loader workers "
              "--checkpoint-every 5")
EPOCHS = 6
WARNING = ["--time=2", "--signal=B:USR1@60"]  # a 2-minute limit, warned 60 s before

# The job's training module. In the job's first run (SLURM_RESTART_COUNT 0) each step
# takes SLOW_STEP seconds longer (a slow GPU, say), so that Slurm's warning lands
# mid-run. In its second, rank 1 raises in its first step, in its node's first attempt
# (a CUDA out-of-memory error, say), with its DataLoader workers running: torchrun
# restarts the ranks, which resume.
SLOW_THEN_FAULTY = """
import os, time
import utils.train_cifar10 as train

step = train.train_step

def train_step(args, job, training, model, x, y):
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    if restart == "0":
        time.sleep(float(os.environ.get("SLOW_STEP", "1")))
    elif (restart == "1" and job.rank == 1
          and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
        raise RuntimeError("rank 1 fails in its first step after the requeue")
    return step(args, job, training, model, x, y)

if __name__ == "__main__":
    train.run(step=train_step)
"""


def stage(data, train: int = 640, test: int = 64):
    """What the recipe asks for before submitting: the data staged by one process."""
    done = hangs.run([sys.executable, "-m", "utils.train_cifar10", "--prepare-only",
                      "--synthetic", "--synthetic-size", str(train), str(test),
                      "--data", str(data)], cwd=ROOT, timeout=TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"staging the data failed: {done.stderr}")
    return Path(data)


def job_env(cluster: Cluster, folder, data, **variables) -> dict:
    """The submitting shell's environment (sbatch hands it to the job): the recipe's
    variables for one process per node on the CPU, the nodes' interface on the bridge
    (or LOOPBACK_OK where both nodes are this machine's loopback). A variable given as
    None is left out."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.update(DATA=str(data), OUT=str(Path(folder) / "out"), GPUS_PER_NODE="1",
               EPOCHS=str(EPOCHS), TRAIN_ARGS=TRAIN_ARGS, PYTHON=sys.executable,
               OMP_NUM_THREADS="1", PYTHONPATH=f"{folder}{os.pathsep}{ROOT}")
    env.update({"SOCKET_IFNAME": INTERFACE} if cluster.namespaces
               else {"LOOPBACK_OK": "1"})
    env.update(variables)
    return {k: v for k, v in env.items() if v is not None}


def slow_job_env(cluster: Cluster, folder, data, **variables) -> dict:
    """``job_env`` with ``SLOW_THEN_FAULTY`` as the training module."""
    (Path(folder) / "slow_then_faulty.py").write_text(SLOW_THEN_FAULTY)
    return job_env(cluster, folder, data, TRAIN_MODULE="slow_then_faulty",
                   **variables)


def submit(cluster: Cluster, folder, env: dict, *options: str) -> str:
    """sbatch from the repository's root, as the recipe's header says; the job id.
    The batch script's log: ``folder/cifar10-<job id>.out``."""
    return cluster.sbatch(["--output", f"{folder}/%x-%j.out", *options, str(SBATCH)],
                          env=env, cwd=ROOT)


def ended(cluster: Cluster, job: str, restarts: int = 0, timeout: float = TIMEOUT,
          states: list | None = None) -> dict:
    """The job's record once it has ended in run ``restarts``."""
    return cluster.wait(job, lambda j: j.get("JobState") in ENDED
                        and j.get("Restarts") == str(restarts), timeout, states)


def requeued(cluster: Cluster, job: str, restarts: int,
             states: list | None = None) -> dict:
    """The job's record once it is back in the queue after requeue ``restarts``."""
    return cluster.wait(job, lambda j: j.get("Restarts") == str(restarts)
                        and j.get("JobState") == "PENDING", TIMEOUT, states)


def batch_log(folder, job: str) -> str:
    return (Path(folder) / f"cifar10-{job}.out").read_text()


def node_log(folder, job: str, node: str) -> str:
    return (Path(folder) / "out" / "logs" / f"cifar10-{job}-{node}.out").read_text()


def final_weights(out):
    import torch

    return torch.load(Path(out) / "model_final.pt", weights_only=True)


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def uninterrupted_job(cluster: Cluster, folder, data) -> str:
    """A job that runs to its end; its id."""
    job = submit(cluster, folder, job_env(cluster, folder, data))
    record = ended(cluster, job)
    if record["JobState"] != "COMPLETED":
        raise RuntimeError(f"job {job}: {record['JobState']}: "
                           f"{batch_log(folder, job)}")
    return job


def warned_job(cluster: Cluster, folder, data, reference) -> dict:
    """One job's life (see the module's docstring), with the final weights compared
    with those in ``reference`` (an uninterrupted job's ``OUT``)."""
    env = slow_job_env(cluster, folder, data, SLOW_STEP="2")
    start = time.monotonic()
    job = submit(cluster, folder, env, *WARNING)
    timeline: list = []

    def seen(record: dict) -> None:  # each state once, with its time
        state = (record.get("JobState"), int(record.get("Restarts", 0)),
                 record.get("Reason"))
        if record and (not timeline or tuple(timeline[-1][1:]) != state):
            timeline.append([round(time.monotonic() - start, 1), *state])

    watch = _Watch(seen)
    running = cluster.wait(job, lambda j: watch(j) and j.get("JobState") == "RUNNING",
                           TIMEOUT)
    cluster.wait(job, lambda j: watch(j) and j.get("Restarts") == "1"
                 and j.get("JobState") == "PENDING", TIMEOUT)
    # (a requeued run may be warned and requeued again: Slurm may warn up to a minute
    # earlier than asked, and a loaded machine trains slowly)
    last = cluster.wait(job, lambda j: watch(j) and j.get("JobState") in ENDED
                        and j.get("Restarts") != "0", 2 * TIMEOUT)
    log = batch_log(folder, job)
    warned_at = _clock(re.search(r"^(\S+) SIGUSR1", log, re.M).group(1))
    # Slurm's hold of a requeued job (reason BeginTime), then its wait for the scheduler
    held = [i for i, (_, state, restarts, reason) in enumerate(timeline)
            if (state, restarts, reason) == ("PENDING", 1, "BeginTime")]
    requeued_at = timeline[held[0]][0] if held else None
    eligible_at = timeline[held[-1] + 1][0] if held else None
    started_at = next(t for t, state, restarts, _ in timeline
                      if (state, restarts) == ("RUNNING", 1))
    return {
        "job": job, "state": last["JobState"], "runs": int(last["Restarts"]) + 1,
        "timeline": timeline,
        "warned_after_s": round((warned_at
                                 - _clock(running["StartTime"])).total_seconds()),
        "limit_s": _seconds(running["TimeLimit"]),
        "eligible_after_requeue_s": (round(eligible_at - requeued_at) if held
                                     else None),
        "started_after_requeue_s": (round(started_at - requeued_at) if held
                                    else None),
        "batch_log": sanitize(log, folder, job).splitlines(),
        "node1": _main_lines(sanitize(node_log(folder, job, "node1"), folder, job)),
        "node2": _main_lines(sanitize(node_log(folder, job, "node2"), folder, job)),
        "stopped_step": _stopped_step(node_log(folder, job, "node1")),
        "same_weights_as_uninterrupted": same_weights(
            final_weights(Path(folder) / "out"), final_weights(reference)),
    }


class _Watch:
    """A predicate's wrapper that notes every record it is shown (and is true)."""

    def __init__(self, note):
        self.note = note

    def __call__(self, record: dict) -> bool:
        self.note(record)
        return True


def _clock(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text)


def _seconds(limit: str) -> int:
    """``scontrol``'s time limit (``00:02:00``, ``1-00:00:00``) in seconds."""
    days, _, clock = limit.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def _stopped_step(log: str) -> int | None:
    match = re.search(r"every rank stopped after step (\d+)", log)
    return int(match.group(1)) if match else None


# a node's log lines worth reading: its header, the run's decisions, failures
MAIN_LINES = [r"^== ", r"^resumed from", r"^--resume", r"stopped after step",
              r"RuntimeError: rank", r"^\{\"epoch\": 6", r"exitcode", r"Root Cause"]


def _main_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if any(re.search(pattern, line) for pattern in MAIN_LINES)]


def sanitize(text: str, folder, job: str) -> str:
    """What varies from run to run replaced: the folder, the job id, dates, process
    ids, the rendezvous port."""
    text = text.replace(str(folder), "<work>").replace(ROOT + os.sep, "")
    for pattern, placeholder in [
            (r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", "<time>"),
            (r"(?m)^([DIWEF])\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ", r"\1<time> <pid> "),
            (r"(?i)(pid[:=] ?|pid |process )\d+", r"\1<pid>"),
            (rf"(\bjob |\bJOB |JobId=|job_id\": \"|run_id\": \"|StepId=){job}\b",
             r"\1<job>"),
            (r"cifar10-\d+", "cifar10-<job>"), (r"(:)2\d{4}\b", r"\1<port>"),
            (r"\"launch\": \"\w+\"", "\"launch\": \"<id>\""),
            (r"[^\s\"']*/site-packages/", "<site-packages>/")]:
        text = re.sub(pattern, placeholder, text)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "book", "results",
                                                 "slurm_job_cpu.json"))
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="slurm_job_"))
    try:
        with Cluster(folder / "cluster") as cluster:
            data = stage(folder / "data")
            (folder / "uninterrupted").mkdir()
            uninterrupted_job(cluster, folder / "uninterrupted", data)
            (folder / "warned").mkdir()
            record = warned_job(cluster, folder / "warned", data,
                                folder / "uninterrupted" / "out")
            version = subprocess.run(["sinfo", "--version"], capture_output=True,
                                     text=True, env=cluster.env()).stdout.strip()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record = {"command": "python -m utils.slurm_job --out "
                         "book/results/slurm_job_cpu.json",
              "slurm": version, "nodes": list(NODES), "sbatch_options": WARNING,
              "epochs": EPOCHS, "train_args": TRAIN_ARGS, **record}
    write(args.out, record, ["utils/slurm_job.py", "utils/slurm_cluster.py",
                             "examples/slurm/train_cifar10.sbatch",
                             *package_sources("utils/train_cifar10")])


if __name__ == "__main__":
    main()
