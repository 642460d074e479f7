"""``python -m module args`` and ``torchrun --standalone --nproc_per_node=N -m module
args`` for the tests, each process forked from a fork server that imported torch once.

A torchrun launch of the training script costs a fresh interpreter for torchrun's agent
and one per rank, each importing torch (about 3 CPU-seconds here), and each rank then
``torch._dynamo``, which building the first optimizer imports (2 more). Most launches in
the tests are about what the script does on N ranks, not about how torchrun starts
them; :func:`run` forks each process from the fork server of :mod:`utils.launch`
(torch, ``torch.distributed`` and ``torch._dynamo`` imported), gives it the environment
torchrun gives a rank of a one-node job (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a store this process holds, as
torchrun's agent holds it, ``TORCHELASTIC_*`` of a first attempt with no restarts), and
runs the module or file as ``__main__``, as ``python -m``/``python file`` would. What
torchrun itself does (restarts, signals to the agent, several nodes, its options) is
tested with torchrun.

Each process's stdout and stderr (its file descriptors 1 and 2, so native code's output
too) go to files, returned in rank order as one ``subprocess.CompletedProcess``; its
``returncode`` is that of the first process to fail, else 0. When one process fails the
others are stopped ``grace`` seconds later, as torchrun stops them. At ``timeout``
every process's Python stack is taken and :class:`utils.hangs.Hang` raised.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Sequence

import psutil

from . import hangs
from .launch import _context, _read_file as _read  # _read: "" where nothing was written
from .workers import exit_when_orphaned

__all__ = ["run"]

_HOST = "localhost"  # as torchrun --standalone says it


def _exit_code(exc: SystemExit) -> int:
    """The exit status Python gives ``raise SystemExit(code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _main(target: str, args: list[str], env: dict[str, str], cwd: str, out: str,
          err: str, threads: int | None, parent: tuple[int, float]) -> None:
    """One process (runs in the child): ``target`` as ``__main__``, then exit with its
    status."""
    os.setsid()  # as torchrun starts each rank: a session (a process group) of its own
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    threading.Thread(target=exit_when_orphaned, args=(*parent, True),
                     daemon=True).start()
    code = 0
    try:
        if target.endswith(".py"):
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = ["-m", *args]
            sys.path[0] = cwd
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    # multiprocessing then runs its finalizers (a DataLoader's queues and their
    # semaphores), flushes stdout and stderr, and exits with this status
    sys.exit(code)


def _rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    local = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": nproc,
             "LOCAL_WORLD_SIZE": nproc, "GROUP_RANK": 0, "GROUP_WORLD_SIZE": 1,
             "ROLE_RANK": rank, "ROLE_WORLD_SIZE": nproc, "ROLE_NAME": "default",
             "MASTER_ADDR": _HOST, "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
             "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": "none",
             "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return {**env, **{k: str(v) for k, v in local.items()}}


def run(target: str, args: Sequence[str] = (), nproc: int | None = None,
        env: dict[str, str] | None = None, timeout: float = 300.0, grace: float = 30.0,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    """``target`` (a module name, or a path ending in ``.py``) with ``args``: as one
    plain process where ``nproc`` is None, else as ``nproc`` ranks of a one-node
    torchrun job. ``env``: the processes' environment (default: this one's)."""
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int)
                              or nproc < 1):
        raise ValueError(f"nproc must be None (one plain process) or an int >= 1, "
                         f"got {nproc!r}")
    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be a module name or a .py path, got {target!r}")
    import torch.distributed as dist

    env = dict(os.environ if env is None else env)
    if (nproc or 0) > 1:  # torchrun's default for more than one rank a node
        env.setdefault("OMP_NUM_THREADS", "1")
    # torch read the server's environment when it started; None: leave its default
    threads = int(env["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in env else None
    me = psutil.Process()
    parent = (me.pid, me.create_time())
    store = None
    if nproc is not None:  # the agent's store, in this process, on a port the OS picks
        store = dist.TCPStore(_HOST, 0, nproc, True, timedelta(seconds=timeout),
                              wait_for_workers=False)
    count = 1 if nproc is None else nproc
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="forkrun_") as tmp:
        files = [(os.path.join(tmp, f"out{r}"), os.path.join(tmp, f"err{r}"))
                 for r in range(count)]
        procs = []
        try:
            for rank in range(count):
                rank_env = (env if nproc is None
                            else _rank_env(env, rank, nproc, store.port))
                proc = ctx.Process(target=_main, name=f"forkrun{rank}", args=(
                    target, list(args), rank_env, cwd or os.getcwd(), *files[rank],
                    threads, parent))
                proc.start()
                procs.append(proc)
            returncode = _wait(procs, files, timeout, grace, target)
        finally:
            for proc in procs:
                _kill(proc)
        stdout = "".join(_read(out) for out, _ in files)
        stderr = "".join(_read(err) for _, err in files)
    cmd = [target, *args] if nproc is None else [f"forkrun --nproc={nproc}", target,
                                                 *args]
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def _wait(procs, files, timeout: float, grace: float, target: str) -> int:
    """The first nonzero exit status (a signal's as 128 + its number), else 0; the rest
    are stopped ``grace`` seconds after a failure."""
    deadline = time.monotonic() + timeout
    failed, stop_at, terminated = 0, None, False
    pending = list(procs)
    while pending:
        now = time.monotonic()
        if now >= deadline:
            stacks = "\n".join(hangs.python_stacks(p.pid) for p in pending)
            raise hangs.Hang(target, timeout, stacks,
                             "".join(_read(out) for out, _ in files),
                             "".join(_read(err) for _, err in files))
        if stop_at is not None and now >= stop_at:
            if terminated:  # SIGTERM was not enough: the caller kills them
                break
            for proc in pending:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            terminated, stop_at = True, now + 10.0
        until = deadline if stop_at is None else min(deadline, stop_at)
        wait([p.sentinel for p in pending], timeout=max(0.01, until - now))
        for proc in [p for p in pending if p.exitcode is not None]:
            pending.remove(proc)
            code = proc.exitcode if proc.exitcode >= 0 else 128 - proc.exitcode
            if code and not failed:
                failed, stop_at = code, time.monotonic() + grace
    return failed


def _kill(proc) -> None:
    """The process's whole session (it and its DataLoader workers), if still there."""
    if proc.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.join(5.0)
