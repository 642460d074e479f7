"""Preemption (chapter 13): an agreed checkpoint, exit code 75.

A scheduler's signal becomes one stop that every rank agrees on, one checkpoint,
``preempted.json`` and exit code 75; a restart of the same run after it stops again."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import torch
import torch.distributed as dist

from ..workers import STOP_SIGNALS
from .checkpoints import write_atomically
from .per_node import from_rank_0


PREEMPTED = "preempted.json"  # rank 0 writes it when a signal stopped the run
DONE = "done.json"  # rank 0 writes it with model_final.pt: this run is complete


# the exit code of every rank stopped by SIGTERM or SIGUSR1 after its checkpoint:
# sysexits' EX_TEMPFAIL, "a temporary failure: try again later" (with --resume)
EXIT_PREEMPTED = 75


# steps between two agreements on the stop flag: each is a blocking all-reduce between
# the ranks' hosts (a round trip between them, longer across nodes), which every
# step would pay; a signal stops the run at most this many steps later (and after an
# epoch's last step at the latest), and at most ``--stop-check-seconds`` later where
# that many steps take longer (``Preemption.due``)
STOP_CHECK_EVERY = 10
STOP_CHECK_SECONDS = 10.0


class Preemption:
    """SIGTERM, SIGUSR1 (what a scheduler sends before it kills a job) and SIGINT (a
    Ctrl-C, or ``scancel --signal=INT``) set a flag; every ``STOP_CHECK_EVERY`` steps,
    and after an epoch's last step, the ranks agree on it, so that all stop after the
    same step, write one checkpoint and exit with ``EXIT_PREEMPTED``. A second SIGINT
    at least a second after the first raises ``KeyboardInterrupt`` at once, as Python's
    default does (one ``scancel --signal=INT`` reaches a rank twice within milliseconds:
    from SLURM, and from torchrun's agent; a terminal's Ctrl-C reaches torchrun alone,
    which starts each rank in a session of its own, and then the rank once, from the
    agent: ``book/results/failures_cpu.json``).

    The handlers are installed in the main thread (where Python allows them), and the
    previous ones restored after the run, unless a signal stopped it or, under
    torchrun, an exception ends it: then they stay, so that a SIGTERM that torchrun's
    agent sends once the first rank has exited does not kill the others before they
    exit with ``EXIT_PREEMPTED`` too, or before ``@record`` has written their error
    file."""

    def __init__(self, check_seconds: float = STOP_CHECK_SECONDS):
        self.signal = 0
        self.check_seconds = check_seconds
        self._first_sigint = None
        self._previous = {}
        self._last = None  # (step, time) of the last scheduled agreement
        self._next = 0  # the step of the next one

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:  # no SIGUSR1 on Windows
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.signal:
            return
        if exc_type is not None and os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # a rank leaving on an exception under torchrun: ``@record`` writes its
            # error file next, and the agent, which has seen another rank fail,
            # may SIGTERM this one meanwhile; with the default handler back, the
            # file would be cut short and the agent die reading it
            # (JSONDecodeError) instead of restarting the ranks
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is None:
                self._first_sigint = now
            elif now - self._first_sigint >= 1.0:
                raise KeyboardInterrupt  # Ctrl-C again: no wait for the agreed step
        self.signal = self.signal or signum

    def due(self, step: int) -> bool:
        """Whether the ranks agree on the flag after ``step`` (the steps done): every
        ``STOP_CHECK_EVERY`` steps (multiples of it), or every k < ``STOP_CHECK_EVERY``
        where that many steps of the slowest rank took longer than
        ``check_seconds``. Every rank learns the slowest rank's time in the agreement
        (``agreed``), so all keep the same schedule."""
        if self._last is None:  # this process's first step (a resume starts anywhere)
            self._last = (step - 1, time.monotonic())
            self._next = (step - 1) // STOP_CHECK_EVERY * STOP_CHECK_EVERY
            self._next += STOP_CHECK_EVERY
        return step >= self._next

    def agreed(self, ddp: bool, group=None, step: int | None = None) -> int:
        """The signal any rank has received (0 if none), the same on every rank (an
        all-reduce over ``group`` when ``ddp``); with ``step``, a scheduled agreement
        (``due``), which sets the next one."""
        elapsed = time.monotonic() - self._last[1] if self._last else 0.0
        flag = torch.tensor([self.signal, int(elapsed * 1000)], dtype=torch.int64)
        if ddp:  # on the CPU: gloo
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if step is not None:
            slowest_ms = max(int(flag[1]), 1)
            fit = int(self.check_seconds * 1000 * (step - self._last[0]) // slowest_ms)
            self._next = step + max(1, min(STOP_CHECK_EVERY, fit))
            self._last = (step, time.monotonic())
        return int(flag[0])


def refuse_restart_after_preemption(args, master: bool, ddp: bool) -> None:
    """A signal stopped this run (its ``preempted.json`` names this run), and torchrun
    restarted the ranks, as it does when the signal reached them but not its agent:
    stop again with ``EXIT_PREEMPTED`` instead of training on (a new job, after a
    requeue, resumes).

    "This run" is the same torchrun run id, SLURM job id *and* SLURM restart count (a
    requeued job keeps its job id, and torchrun's run id is the job id in the SLURM
    recipe), and "restarted" is the attempt number the ranks agreed on through the
    store (``attempt_store``), not ``TORCHELASTIC_RESTART_COUNT``, which counts only
    the restarts of this node's agent: so a requeued job whose first attempt fails is
    restarted and resumes, instead of reading the last job's file as its own."""
    found = None
    path = os.path.join(args.out, PREEMPTED)
    if master and int(os.environ.get("TRAIN_CIFAR10_ATTEMPT", 0)) > 0:
        try:
            with open(path) as f:
                found = json.load(f)
        except (OSError, ValueError):
            found = None
        if found and any(found.get(key) != value
                         for key, value in this_run().items()):
            found = None
    found = from_rank_0(found, ddp)
    if found:
        print(f"{found['signal']} stopped this job after step {found['step']} "
              f"({path}); a restart does not go on: run the job again with --resume",
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED)


def this_run() -> dict:
    """What names this run in ``preempted.json`` and ``done.json``: torchrun's run id
    and launch (``init_process_group``: a relaunch that reuses the run id is another
    run), SLURM's job id and restart (requeue) count, where set."""
    env = os.environ.get
    return {"torchrun_run_id": env("TORCHELASTIC_RUN_ID"),
            "launch": env("TRAIN_CIFAR10_LAUNCH"),
            "slurm_job_id": env("SLURM_JOB_ID"),
            "slurm_restart": int(env("SLURM_RESTART_COUNT", 0))}


def write_preempted(args, step: int, stop_signal: int) -> None:
    """``preempted.json``: the step after which the ranks stopped and the signal
    (``stop_signal``), and which run wrote it (``this_run``),
    with torchrun's restart count and the agreed attempt, so that a job script can tell
    a file of its own run from an older one."""
    env = os.environ.get
    record = {"step": step, "signal": signal.Signals(stop_signal).name,
              **this_run(),
              "torchrun_restart": int(env("TORCHELASTIC_RESTART_COUNT", 0)),
              "attempt": int(env("TRAIN_CIFAR10_ATTEMPT", 0))}
    write_atomically(os.path.join(args.out, PREEMPTED),
                     lambda f: f.write(json.dumps(record).encode()))
