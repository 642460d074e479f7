"""Start DataLoader workers in a way that cannot deadlock, from any process.

``fork`` copies the parent as it is at that instant, locks included, but only the thread
that called it. A process with threads can be forked while another of its threads holds
a lock; the child then waits for ever on a lock no thread of its own will release. Every
rank of a distributed job has threads (gloo's and NCCL's, the TCPStore client's), and
CPython itself has such a lock: the one that guards its list of thread states, held
while a thread state is made or deleted, as when a native thread calls into Python. A
child forked at that moment waits for ever right after the fork (CPython issue
gh-112275, fixed in later releases than 3.11.7, the Python this book is built with). A
``DataLoader`` with workers in a rank forks by default on Linux (up to Python 3.13), so
a training run can hang as it starts its workers: rarely, and at random.

``forkserver`` forks each worker from a server process that has a single thread: the
server is started once, by the first loader that needs it, and imports the modules named
in its preload list first, so each worker costs a fork rather than a fresh interpreter
that imports torch. Its workers have only what they import and unpickle, as under
``spawn``: data sets, ``worker_init_fn`` and ``collate_fn`` must be importable from a
module.

- :func:`worker_context` is the ``multiprocessing_context`` to give a ``DataLoader``:
  ``forkserver`` with torch preloaded where the platform has it, ``spawn`` elsewhere
  (Windows).
- :class:`WatchParent` is a ``worker_init_fn`` that ends the worker when the process
  that started its loader is gone: a worker of a fork server is the server's child, not
  the rank's, so the loader's own watch (of the worker's parent) does not see a rank
  killed with ``SIGKILL``.
- :func:`end_workers` ends a process's workers at once, for a process that is about to
  exit on an exception (see its docstring: otherwise such a process never exits).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Callable

import psutil

__all__ = ["PRELOAD", "STOP_SIGNALS", "worker_context", "WatchParent", "parent_alive",
           "exit_when_orphaned", "ignore_stop_signals", "end_workers"]

# What a fork server imports before it forks any worker: what every book data set needs.
PRELOAD = ("torch", "torch.distributed", "cloudpickle", "utils")
# What a scheduler or a terminal sends to stop a job (SLURM signals every process of a
# job step, workers included): a worker that leaves the stop to its rank ignores them.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1")
                     if hasattr(signal, name))


def ignore_stop_signals() -> None:
    """This process ignores ``STOP_SIGNALS``, as do the processes it forks later (a
    fork server's workers)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_workers(timeout: float = 5.0) -> None:
    """SIGKILL to every worker process this process started, then wait for them.

    For a process about to exit on an exception. Its traceback keeps the loaders'
    iterators alive into interpreter exit, where torch has turned their own shutdown
    into a no-op; multiprocessing's exit hook then sends its daemonic children SIGTERM,
    which workers that ignore ``STOP_SIGNALS`` ignore, and joins them with no timeout:
    the process never exits, and under torchrun or SLURM the whole job waits with it.
    torch's SIGCHLD handler, which would raise in this process for a worker it did not
    see end, is put back to the default first."""
    main_thread = threading.current_thread() is threading.main_thread()
    if hasattr(signal, "SIGCHLD") and main_thread:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    children = mp.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout)


def worker_context(*preload: str, detach: bool = False) -> mp.context.BaseContext:
    """The start method for DataLoader workers of a process that has (or will have)
    threads.

    ``forkserver`` where the platform has it (Linux, macOS), with :data:`PRELOAD` and
    ``preload`` (module names: the module that defines the data set, say) imported once
    in the server; ``spawn`` elsewhere. ``detach=True``: the server leaves this
    process's process group as it starts (``utils._detach``), so a signal sent to the
    group (torchrun's agent sends SIGTERM so) does not end it, and with it every worker,
    and it ignores ``STOP_SIGNALS``, as its workers do (SLURM signals every process);
    give such workers :class:`WatchParent`, since the group's ``SIGKILL`` no longer
    reaches them either. The preload list is the process's: it applies to the fork
    server this process starts next, and to none already running.
    """
    for name in preload:
        if not isinstance(name, str) or not name:
            raise TypeError(f"preload takes module names (non-empty str), got {name!r}")
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # utils._detach first: the server is shielded while it imports torch (seconds)
    detached = ("utils._detach",) if detach else ()
    ctx.set_forkserver_preload(list(dict.fromkeys((*detached, *PRELOAD, *preload))))
    return ctx


def parent_alive(pid: int, create_time: float) -> bool:
    """Whether process ``pid`` still runs: the same pid *and* the same process (a pid
    can be reused once its process has ended)."""
    try:
        return psutil.Process(pid).create_time() == create_time
    except psutil.NoSuchProcess:
        return False


def exit_when_orphaned(parent_pid: int, parent_create_time: float, group: bool = False,
                       interval: float = 1.0) -> None:
    """Loop until the parent is gone, then kill this process (``group=True``: its whole
    process group) with ``SIGKILL``. Run it in a daemon thread."""
    while True:
        time.sleep(interval)
        if not parent_alive(parent_pid, parent_create_time):
            if group:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class WatchParent:
    """A ``worker_init_fn`` that ends the worker when the process that built the loader
    is gone, then calls ``init(worker_id)`` if given.

    Build it in the process that builds the ``DataLoader`` (it records that process);
    ``init`` must be picklable by reference, like any ``worker_init_fn`` of a worker
    that is not forked from its loader's process.
    """

    def __init__(self, init: Callable[[int], None] | None = None):
        if init is not None and not callable(init):
            raise TypeError(f"init must be callable or None, got {type(init).__name__}")
        me = psutil.Process()
        self.parent = (me.pid, me.create_time())
        self.init = init

    def __call__(self, worker_id: int) -> None:
        threading.Thread(target=exit_when_orphaned, args=self.parent, daemon=True,
                         name="watch-parent").start()
        if self.init is not None:
            self.init(worker_id)
