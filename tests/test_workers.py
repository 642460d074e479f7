"""No DataLoader worker is forked from a process that has threads (utils.workers): a rank's workers
start from a fork server, many starts in a row do not hang, a detached server and its workers end
with the process that started them, and a hung command reports every process's stack
(utils.hangs)."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader

from utils import hangs
from utils.launch import run_distributed
from utils.train_cifar10 import worker_start
from utils.workers import PRELOAD, WatchParent, worker_context
from worker_parent import WorkerParent

HERE = os.path.dirname(os.path.abspath(__file__))


def _workers_of_a_rank():
    threads = psutil.Process().num_threads()  # gloo's among them, after init_process_group
    rows = [tuple(map(int, row)) for row in DataLoader(WorkerParent(), num_workers=2)]
    parents = {parent for _, _, parent in rows}
    servers = [psutil.Process(p) for p in parents]
    return {"rank": os.getpid(), "threads": threads, "group": dist.is_initialized(),
            "method": mp.get_start_method(), "parents": parents,
            "parent_threads": [s.num_threads() for s in servers],
            "parent_commands": [" ".join(s.cmdline()) for s in servers]}


def test_a_rank_with_a_process_group_does_not_fork_its_workers():
    for seen in run_distributed(_workers_of_a_rank, 2):
        assert seen["group"] and seen["threads"] > 2, seen  # torch's own, and gloo's
        assert seen["method"] != "fork", seen
        if seen["method"] == "forkserver":  # under spawn a worker is an exec'd child
            assert seen["rank"] not in seen["parents"], seen
            assert all("multiprocessing.forkserver" in c for c in seen["parent_commands"]), seen
            assert all(n < seen["threads"] for n in seen["parent_threads"]), seen


def _start_workers_again_and_again(times):
    for _ in range(times):
        rows = [tuple(map(int, row)) for row in DataLoader(WorkerParent(), num_workers=2)]
        assert [i for i, _, _ in rows] == [0, 1, 2, 3]
    return times


def test_many_worker_starts_in_ranks_with_a_process_group_do_not_hang():
    # 2 ranks x 30 loaders x 2 workers: 120 worker starts (tests/hang_loop.py repeats this and
    # the chapters); the test above proves that none is a fork of a rank
    assert run_distributed(_start_workers_again_and_again, 2, 30, timeout=240) == [30, 30]


def test_worker_context_preloads_torch_and_the_given_modules_where_there_is_a_fork_server(
        monkeypatch):
    ctx = worker_context("utils.examples", detach=True)
    assert ctx.get_start_method() == "forkserver"
    from multiprocessing import forkserver
    # the detaching module first: the server ignores the stop signals while it imports torch
    assert forkserver._forkserver._preload_modules == ["utils._detach", *PRELOAD,
                                                       "utils.examples"]
    with pytest.raises(TypeError, match="module names"):
        worker_context("")
    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])  # Windows
    assert worker_context().get_start_method() == "spawn"


def test_the_training_script_starts_workers_from_a_detached_preloaded_server():
    assert worker_start(0) is None  # no workers, no context (DataLoader refuses one)
    from multiprocessing import forkserver
    assert worker_start(2).get_start_method() == "forkserver"
    preload = set(forkserver._forkserver._preload_modules)
    # not the training script: a worker imports what unpickling its data set needs
    assert {"torch", "utils._detach"} <= preload and "utils.train_cifar10" not in preload


DETACHED = """
import sys, time
from torch.utils.data import DataLoader
from worker_parent import WorkerParent
from utils.workers import WatchParent, worker_context
loader = DataLoader(WorkerParent(), num_workers=2, persistent_workers=True,
                    multiprocessing_context=worker_context(detach=True),
                    worker_init_fn=WatchParent())
rows = [tuple(map(int, row)) for row in loader]
print(sorted({w for _, w, _ in rows}), sorted({p for _, _, p in rows}), flush=True)
time.sleep(300)
"""


def test_a_detached_fork_server_and_its_workers_end_with_the_process_that_started_them():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", DETACHED], env=env, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        workers, servers = (eval(part + "]") for part in
                            proc.stdout.readline().strip().rstrip("]").split("] "))
        assert len(workers) == 2 and len(servers) == 1
        # the server left the group of the process that started it: a signal to that group
        # (torchrun's agent sends one) does not end it
        assert os.getpgid(servers[0]) != os.getpgid(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)  # the process and its group, not the server
        proc.wait(10)
        deadline = time.monotonic() + 15
        left = [p for p in workers + servers if psutil.pid_exists(p)]
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [p for p in left if psutil.pid_exists(p)
                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not left, f"still running 15 s after their parent was killed: {left}"
    finally:
        proc.kill()
        proc.wait()


def test_a_command_that_hangs_reports_the_stack_of_every_process_it_started():
    assert hangs.py_spy(), "py-spy is in requirements.txt"
    code = ("import subprocess, sys, time\n"
            "def parent_waits(): time.sleep(60)\n"
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import time\\ndef child_waits(): time.sleep(60)\\nchild_waits()'])\n"
            "print('started', flush=True)\n"
            "parent_waits()\n")
    start = time.monotonic()
    with pytest.raises(hangs.Hang) as hung:
        hangs.run([sys.executable, "-c", code], timeout=3)
    assert time.monotonic() - start < 60
    message = str(hung.value)
    assert "parent_waits" in message and "child_waits" in message, message
    assert "started" in message and hung.value.stacks.count("--- pid") == 2
    assert isinstance(hung.value, subprocess.TimeoutExpired)
    assert hangs.run([sys.executable, "-c", "print('done')"], timeout=60).stdout == "done\n"
