"""Run a function on N local ranks that share a process group, from a notebook cell or
a script.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises
a ``gloo`` (or other) process group in each, calls ``fn(*args)`` on every rank and
returns the per-rank results as a list. It is built for teaching and testing:

* ``fn`` is shipped by value with cloudpickle, so a function defined in the
  notebook works;
* the rendezvous store lives in the calling process on a port the OS picks, so two calls
  in a row, or two notebooks at once, never collide on a port;
* a rank that raises makes the call raise :class:`RankError` at once, with that rank's
  number and traceback; a rank that hangs makes it raise :class:`RankTimeoutError` at
  the timeout, with the Python stack the hung rank was blocked in;
* every rank runs in its own process group (``setpgrp``), and the call kills those
  groups before it returns, so no rank and no DataLoader worker of a rank outlives it;
* what a rank prints is captured and printed after the call, rank by rank, in rank
  order, so the output of a cell is the same every time it runs; the caller's warning
  filters apply on every rank;
* ranks run on the CPU by default (``device="cpu"`` hides the GPUs from them), so a cell
  gives the same result on a laptop and on a GPU server; ``device="cuda"`` (with
  ``backend="nccl"``) gives rank ``r`` the GPU ``r % device_count``;
* DataLoader workers started by a rank use the caller's start method (``spawn`` or
  ``forkserver``), so a notebook meets the same pickling rules inside ranks as outside;
  where the caller's is ``fork``, a rank's workers start from a fork server of the
  rank's (``utils.workers``): a rank has gloo's threads, and a fork of a process with
  threads can hang.

Ranks are forked from a ``forkserver`` that imported torch once, so a call costs a
fraction of a second after the first one
(see ``tests/test_launch.py::test_call_overhead``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from ._checks import check_int
from .workers import exit_when_orphaned, worker_context

__all__ = ["run_distributed", "RankError", "RankTimeoutError", "free_port"]

_HOST = "127.0.0.1"


class RankError(RuntimeError):
    """A rank raised an exception (or died) inside ``run_distributed``."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"rank {rank} failed with {exc_type}: {message}\n\n"
            f"--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        )


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish within the timeout; ``stacks`` holds where each
    was blocked."""

    def __init__(self, timeout: float, pending: list[int], finished: list[int],
                 stacks: dict[int, str]):
        self.timeout = timeout
        self.pending = pending
        self.finished = finished
        self.stacks = stacks
        where = "".join(
            f"\n\n--- rank {r} was blocked here ---\n{stacks[r].rstrip()}"
            for r in pending if stacks.get(r)
        )
        super().__init__(
            f"ranks {pending} did not finish within timeout={timeout:g} s "
            f"(ranks {finished} had finished); all ranks were stopped{where}"
        )


# Where the OS takes the local ports of connections and of bind(port 0) when
# /proc/sys/net/ipv4/ip_local_port_range does not say (Linux's default is 32768-60999;
# macOS, Windows and the IANA range: 49152-65535).
_EPHEMERAL_DEFAULT = (32768, 65535)
_LOWEST_PORT = 20000


def ephemeral_ports() -> tuple[int, int]:
    """``(first, last)``: the ports this machine assigns of its own choice."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port(host: str = _HOST, tries: int = 200) -> int:
    """A TCP port that is free on ``host`` now and that the OS does not hand out by
    itself, for a process started next to bind: ``MASTER_PORT`` of a two-node
    ``torchrun``, say.

    The usual recipe, bind to port 0 and pass on the port the OS picked, has a race:
    that port comes from the range the OS takes every connection's local port from,
    and in the seconds before the launcher binds it (``torchrun`` imports torch first)
    any connection on the machine may get it. Node 0 then stops with ``EADDRINUSE``
    and node 1 goes on waiting for node 0. A port outside that
    range is only ever taken by a program that asks for it by number. Where the OS
    keeps every port for itself (a range of 1024-65535), the usual recipe's port is
    returned, with a ``RuntimeWarning``."""
    first, last = ephemeral_ports()
    if first - 1 >= _LOWEST_PORT:
        low, high = _LOWEST_PORT, first - 1
    elif last < 65535:
        low, high = last + 1, 65535
    else:
        warnings.warn(f"every port from {first} to {last} is the OS's to assign: a "
                      "connection may take this one before it is bound",
                      RuntimeWarning, stacklevel=2)
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    chooser = random.SystemRandom()  # leaves the random module's own stream alone
    for _ in range(tries):
        port = chooser.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use: try another
                continue
            return port
    raise RuntimeError(f"no free port found on {host} in {tries} tries "
                       f"between {low} and {high}")


def _set_rank_env(rank: int, world_size: int, port: int) -> None:
    # The variables torchrun sets, so code that reads them (RANK, LOCAL_RANK,
    # WORLD_SIZE) works on these ranks. The default process group is already
    # initialised: fn must not call init_process_group again (use dist.new_group
    # for sub-groups).
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
    )


def _rank_main(rank, world_size, port, backend, device, start_method, timeout_s,
               threads, sys_path, environ, payload, conn, files, parent):
    """Entry point of one rank (runs in the child process)."""
    # own process group: the parent kills this rank and its workers in one call
    os.setpgrp()
    # The fork server was started with the environment of the first call; use the
    # caller's now.
    os.environ.clear()
    os.environ.update(environ)
    if device == "cpu":
        # Before CUDA is initialised in this process: torch.cuda.is_available() is now
        # False here.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Forkserver children inherit 'forkserver' as their start method; give DataLoader
    # workers the caller's instead (spawn on macOS and Windows), except fork: from
    # init_process_group on a rank has gloo's threads, and a fork of a process with
    # threads can hang (utils.workers). Its workers start from a fork server of its own.
    if start_method == "fork":
        start_method = worker_context().get_start_method()
    elif start_method == "forkserver":
        worker_context()  # the fork server this rank starts preloads torch
    mp.set_start_method(start_method, force=True)
    threading.Thread(target=exit_when_orphaned, args=(*parent, True),
                     daemon=True).start()
    sys.path[:] = sys_path
    stack_out = open(files["stack"], "w")
    # SIGUSR1 may land on any thread (gloo has its own), so dump them all.
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
    open(files["ready"], "w").close()  # from now on the parent may ask for a stack dump
    _set_rank_env(rank, world_size, port)
    torch.set_num_threads(threads)
    if device == "cuda":
        # before the group, as torchrun scripts do
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # What the rank prints goes to a file, so the caller can show it even if the
    # rank hangs.
    captured = open(files["output"], "w", buffering=1, encoding="utf-8")
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            # Collectives time out well after the caller's deadline, so that a hang is
            # always reported the same way: by the caller, with the stack each hung rank
            # is blocked in.
            pg_timeout = timedelta(seconds=timeout_s + 60)
            store = dist.TCPStore(_HOST, port, world_size + 1, False, pg_timeout)
            dist.init_process_group(backend, store=store, rank=rank,
                                    world_size=world_size, timeout=pg_timeout)
            fn, args, warning_filters = cloudpickle.loads(payload)
            # the caller's warning filters apply on every rank
            warnings.filters[:] = warning_filters
            value = fn(*args)
        message = ("ok", value)
    except BaseException as exc:
        # report everything, KeyboardInterrupt and SystemExit too
        message = ("error", type(exc).__name__, str(exc), traceback.format_exc())
    captured.flush()
    try:
        conn.send_bytes(cloudpickle.dumps(message))
    except Exception as exc:  # e.g. a return value that cannot be pickled
        conn.send_bytes(cloudpickle.dumps(
            ("error", type(exc).__name__, f"could not send the result back: {exc}",
             traceback.format_exc())))
    # Keep the process group alive until the parent says every rank is done, so that a
    # rank that finishes early does not tear down connections the others still use.
    with contextlib.suppress(EOFError, OSError):
        conn.recv_bytes()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    captured.flush()
    # do not wait for threads or atexit handlers that fn may have left behind
    os._exit(0)


def _context() -> mp.context.BaseContext:
    if sys.platform == "linux":
        ctx = mp.get_context("forkserver")
        # Import torch once in the fork server; every rank is then a cheap fork of it.
        # The fork server is a child of the calling process that lives as long as
        # it does.
        # torch._dynamo too: a rank's first optimizer imports it (1.3 CPU-s per rank)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                    "cloudpickle", "utils.launch"])
        return ctx
    return mp.get_context("spawn")


def _kill_rank(proc) -> None:
    if proc.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the rank and everything it started
    with contextlib.suppress(Exception):
        proc.kill()


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _read_stack(proc, files: dict[str, str]) -> str:
    if not os.path.exists(files["ready"]):
        return "(the rank had not started running Python code yet)"
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if _read_file(files["stack"]):
            time.sleep(0.2)  # let the dump finish
            return _read_file(files["stack"])
        time.sleep(0.02)
    return ""


def _print_outputs(all_files: list[dict[str, str]]) -> None:
    for rank, files in enumerate(all_files):
        for line in _read_file(files["output"]).splitlines():
            print(f"[rank {rank}] {line}")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    threads_per_rank: int = 1,
    show_output: bool = True,
    device: str = "cpu",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local ranks sharing a process group; return
    each rank's result.

    ``fn`` finds its rank with ``torch.distributed.get_rank()``. Results come back in
    rank order (tensors included). Raises :class:`RankError` as soon as a rank fails and
    :class:`RankTimeoutError` if ranks are still running after ``timeout`` seconds; in
    every case all rank processes are gone when the call returns. ``device="cpu"`` (the
    default) hides the GPUs from the ranks; ``device="cuda"`` puts rank ``r`` on
    GPU ``r % device_count``.
    """
    world_size, threads_per_rank = _check_arguments(fn, world_size, backend, timeout,
                                                    threads_per_rank, device)
    payload = cloudpickle.dumps((fn, args, list(warnings.filters)))
    # The rendezvous store listens in this process on a port the OS picks: no races
    # for ports.
    store = dist.TCPStore(_HOST, 0, world_size + 1, True, timedelta(seconds=timeout),
                          wait_for_workers=False)
    tmpdir = tempfile.TemporaryDirectory(prefix="run_distributed_")
    files = [{kind: os.path.join(tmpdir.name, f"{kind}{rank}")
              for kind in ("stack", "ready", "output")}
             for rank in range(world_size)]
    procs, conns = [], []
    try:
        settings = (world_size, store.port, backend, device, mp.get_start_method(),
                    float(timeout), threads_per_rank)
        _start_ranks(settings, payload, files, procs, conns)
        results = _collect_results(procs, conns, files, timeout)
        _release_ranks(procs, conns)
    finally:
        _stop_ranks(procs, conns)
        if show_output:
            # also when a rank failed or hung: its prints help most then
            _print_outputs(files)
        tmpdir.cleanup()
    return results


def _check_arguments(fn, world_size, backend, timeout, threads_per_rank,
                     device) -> tuple[int, int]:
    """Refuse bad arguments before any process starts; ``(world_size,
    threads_per_rank)`` as ints."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    world_size = check_int("world_size", world_size, minimum=1)
    threads_per_rank = check_int("threads_per_rank", threads_per_rank, minimum=1)
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, "
                         f"got {timeout!r}")
    if not isinstance(backend, str) or not dist.is_backend_available(backend):
        raise ValueError(f"backend={backend!r} is not available in this torch build; "
                         f"use 'gloo' on CPU")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; "
                         f"expected 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False here; "
                         "use device='cpu'")
    if device == "cpu" and backend == "nccl":
        raise ValueError("backend='nccl' moves CUDA tensors only; "
                         "use device='cuda' with it, or backend='gloo'")
    return world_size, threads_per_rank


def _start_ranks(settings: tuple, payload: bytes, files: list[dict[str, str]],
                 procs: list, conns: list) -> None:
    """Start one process per rank, appending each to ``procs`` and its end of a pipe
    to ``conns`` as soon as it runs (the caller stops them whatever happens)."""
    world_size, port, backend, device, start_method, timeout_s, threads = settings
    ctx = _context()
    me = psutil.Process()
    parent = (me.pid, me.create_time())
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, backend, device, start_method, timeout_s,
                  threads, list(sys.path), dict(os.environ), payload, child_end,
                  files[rank], parent),
            name=f"rank{rank}",
            daemon=False,  # a rank must be able to start DataLoader workers
        )
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)


def _collect_results(procs, conns, files, timeout: float) -> list[Any]:
    """Each rank's result, in rank order, as the ranks finish; raise at the first
    failure, or at the timeout with the stacks of the ranks still running."""
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stacks = {r: _read_stack(procs[r], files[r]) for r in sorted(pending)}
            raise RankTimeoutError(timeout, sorted(pending),
                                   sorted(set(range(world_size)) - pending), stacks)
        watch = {conns[r]: r for r in pending}
        watch.update({procs[r].sentinel: r for r in pending})
        for ready in wait(list(watch), timeout=remaining):
            rank = watch[ready]
            if rank not in pending:
                continue
            try:
                results[rank] = _receive_result(rank, procs[rank], conns[rank])
            except RankError as err:
                raise _first_cause(err, procs, conns, pending - {rank}) from None
            pending.discard(rank)
    return results


def _first_cause(err: RankError, procs, conns, others, grace: float = 1.0) -> RankError:
    """The error to report: a rank that died without a word, if one did, else ``err``.

    A rank that dies (``os._exit``, a signal, a crash in C) closes its sockets, and the
    ranks waiting for it in a collective fail with a reset connection. Which of the two
    reaches the parent first is a race; the death is the cause, so it is preferred.
    """
    if err.exc_type == "ProcessExit":
        return err
    deadline = time.monotonic() + grace
    for other in sorted(others):
        procs[other].join(max(0.0, deadline - time.monotonic()))
        if procs[other].exitcode is None:
            continue
        try:
            _receive_result(other, procs[other], conns[other])
        except RankError as died:
            if died.exc_type == "ProcessExit":
                return died
    return err


def _receive_result(rank: int, proc, conn) -> Any:
    """What a rank that is done sent back; a :class:`RankError` if it failed or died
    without a word."""
    message = None
    if conn.poll():
        with contextlib.suppress(EOFError):
            message = cloudpickle.loads(conn.recv_bytes())
    if message is None:
        proc.join(1.0)
        raise RankError(rank, "ProcessExit",
                        f"the process exited with code "
                        f"{proc.exitcode} before returning a result",
                        "(no Python traceback: the process died)")
    if message[0] == "error":
        _, exc_type, text, tb = message
        raise RankError(rank, exc_type, text, tb)
    return message[1]


def _release_ranks(procs, conns) -> None:
    """Every rank is done: let them tear down the process group and exit."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(b"done")
    # one shared deadline, whatever the number of ranks
    shutdown = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, shutdown - time.monotonic()))


def _stop_ranks(procs, conns) -> None:
    """Kill every rank's process group (the rank and its DataLoader workers) and
    close the pipes."""
    for proc in procs:
        _kill_rank(proc)
    for proc in procs:
        proc.join(5.0)
    for conn in conns:
        conn.close()
