"""run_distributed: results per rank, prompt errors naming the rank, timeouts, nothing left behind.
free_port: a port for another process to bind, which no connection can take in the meantime."""

import os
import random
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from utils import launch
from utils.launch import RankError, RankTimeoutError, free_port, run_distributed


def rank_and_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t


def test_results_come_back_per_rank_with_tensors():
    results = run_distributed(rank_and_sum, 3)
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    assert all(torch.equal(r[2], torch.tensor([6.0])) for r in results)


def test_args_closures_and_lambdas_are_shipped_by_value():
    offset = 10
    results = run_distributed(lambda a, b: a * b + offset + dist.get_rank(), 2, 3, 4)
    assert results == [22, 23]


def test_torchrun_variables_are_set():
    results = run_distributed(lambda: (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]), 2)
    assert results == [("0", "2", "0"), ("1", "2", "1")]


def test_prints_are_shown_in_rank_order(capsys):
    run_distributed(lambda: print("hello from", dist.get_rank()), 2)
    assert capsys.readouterr().out == "[rank 0] hello from 0\n[rank 1] hello from 1\n"


def _gone(pids):
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return not alive


def _raise_on_rank_1_while_others_hang(pid_dir):
    # Every rank records its pid and the pid of a DataLoader-like grandchild, then rank 1 raises
    # while the others wait in a collective that will never complete.
    import multiprocessing as mp

    rank = dist.get_rank()
    child = mp.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    with open(os.path.join(pid_dir, f"{rank}"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    if rank == 1:
        raise ValueError("bad batch on purpose")
    dist.barrier()


def test_a_rank_that_raises_is_named_promptly_and_nothing_survives(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(_raise_on_rank_1_while_others_hang, 3, str(tmp_path), timeout=120)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"the error took {elapsed:.1f} s"
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "rank 1 failed with ValueError: bad batch on purpose" in str(err)
    assert "_raise_on_rank_1_while_others_hang" in err.remote_traceback
    time.sleep(0.5)
    pids = [int(p) for f in tmp_path.iterdir() for p in f.read_text().split()]
    assert len(pids) >= 2  # rank 1 and its grandchild at least (the others may be killed before they write)
    assert _gone(pids), "a rank or a rank's child outlived run_distributed"


def test_a_hung_rank_ends_at_the_timeout_with_its_stack(tmp_path):
    def hang_on_rank_0():
        with open(os.path.join(str(tmp_path), str(dist.get_rank())), "w") as f:
            f.write(str(os.getpid()))
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1 never joins
        return "done"

    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_distributed(hang_on_rank_0, 2, timeout=3)
    assert 3 <= time.monotonic() - start < 15
    assert info.value.pending == [0] and info.value.finished == [1]
    assert "hang_on_rank_0" in info.value.stacks[0]
    time.sleep(0.5)
    assert _gone([int(f.read_text()) for f in tmp_path.iterdir()])


def test_a_rank_that_dies_without_python_is_reported():
    with pytest.raises(RankError, match="rank 1 failed with ProcessExit"):
        run_distributed(lambda: os._exit(3) if dist.get_rank() == 1 else dist.barrier(), 2, timeout=60)


def test_two_calls_in_a_row_and_in_parallel_do_not_collide():
    assert run_distributed(lambda: dist.get_rank(), 2) == [0, 1]
    assert run_distributed(lambda: dist.get_rank(), 2) == [0, 1]
    # Two independent Python processes (two notebooks) each calling at the same time.
    script = textwrap.dedent(
        """
        import torch.distributed as dist
        from utils.launch import run_distributed
        def f():
            return dist.get_world_size()
        if __name__ == "__main__":
            for _ in range(3):
                assert run_distributed(f, 2) == [2, 2]
            print("ok")
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all(o.strip() == "ok" for o in outs)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"world_size": 0}, ValueError, "world_size=0"),
        ({"world_size": 2, "timeout": 0}, ValueError, "timeout must be a positive"),
        ({"world_size": 2, "backend": "nope"}, ValueError, "backend='nope'"),
        ({"world_size": 2, "device": "tpu"}, ValueError, "device='tpu' is not supported"),
    ],
)
def test_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text):
        run_distributed(rank_and_sum, **kwargs)


def test_call_overhead():
    """What one call costs, stated here: after the first call the fork server has torch loaded."""
    run_distributed(lambda: None, 2)  # warm-up: starts the fork server
    start = time.monotonic()
    for _ in range(3):
        run_distributed(lambda: None, 2)
    per_call = (time.monotonic() - start) / 3
    print(f"\nrun_distributed(world_size=2) costs {per_call:.2f} s per call after the first")
    assert per_call < 5.0


def test_the_callers_warning_filters_apply_on_every_rank(capsys):
    import warnings

    def warn():
        warnings.warn("noisy but harmless", UserWarning)
        return True

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="noisy but harmless")
        assert run_distributed(warn, 2) == [True, True]
    assert "noisy" not in capsys.readouterr().out
    run_distributed(warn, 2)
    assert "noisy but harmless" in capsys.readouterr().out


def test_a_tiny_timeout_is_a_timeout_error_even_before_ranks_run():
    with pytest.raises(RankTimeoutError):
        run_distributed(lambda: time.sleep(5), 2, timeout=0.05)


def test_a_thread_left_running_does_not_delay_the_return():
    import threading

    def leave_a_thread():
        threading.Thread(target=time.sleep, args=(60,)).start()  # not a daemon
        return dist.get_rank()

    start = time.monotonic()
    assert run_distributed(leave_a_thread, 3, timeout=20) == [0, 1, 2]
    assert time.monotonic() - start < 10


def test_environment_set_after_the_first_call_reaches_the_ranks(monkeypatch):
    run_distributed(lambda: None, 1)
    monkeypatch.setenv("BOOK_TEST_SETTING", "late")
    assert run_distributed(lambda: os.environ.get("BOOK_TEST_SETTING"), 2) == ["late", "late"]


def test_every_ranks_output_is_shown_when_one_fails(capsys):
    def print_then_fail():
        print("rank", dist.get_rank(), "was here")
        # every rank has printed before rank 1 fails (on a loaded machine rank 0 could
        # otherwise still be starting when rank 1 fails, and have nothing to show)
        dist.barrier()
        if dist.get_rank() == 1:
            raise RuntimeError("boom")
        dist.barrier()

    with pytest.raises(RankError, match="rank 1 failed with RuntimeError: boom"):
        run_distributed(print_then_fail, 2, timeout=60)
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 was here" in out and "[rank 1] rank 1 was here" in out


def test_ranks_run_on_the_cpu_by_default_even_where_there_are_gpus():
    def where():
        return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()

    assert run_distributed(where, 2) == [("", False)] * 2


def test_ranks_give_their_dataloader_workers_the_callers_start_method_but_fork():
    """A rank has gloo's threads, and a fork of a process with threads can hang: where the
    caller forks, a rank's workers start from a fork server (utils.workers)."""
    import multiprocessing as mp

    def start_method():
        return mp.get_start_method()

    expected = "forkserver" if mp.get_start_method() == "fork" else mp.get_start_method()
    assert run_distributed(start_method, 2) == [expected] * 2


def test_free_port_is_bindable_and_outside_the_ports_the_os_assigns_by_itself():
    """The port of bind(0), handed on, is one the OS gives connections too: two-node torchrun in the
    test suite's busy lanes can lose it (node 0: EADDRINUSE, node 1 waits past the cell's timeout).
    free_port's ports are outside that range, so only a program asking for one by number gets it."""
    first, last = launch.ephemeral_ports()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # the usual recipe's port: inside the range
        assert first <= s.getsockname()[1] <= last
    state = random.getstate()
    ports = [free_port() for _ in range(50)]
    assert random.getstate() == state  # a notebook's random stream is left alone
    assert not any(first <= port <= last for port in ports) and len(set(ports)) > 1
    with socket.socket() as server:  # what node 0's torchrun does with it
        server.bind(("127.0.0.1", ports[0]))
        server.listen()


def test_free_port_skips_ports_in_use_and_warns_where_the_os_owns_every_port(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))  # outside the OS's range, and now in use
        port = taken.getsockname()[1]
        # two candidates: that port and the one below it (outside the OS's range too)
        monkeypatch.setattr(launch, "_LOWEST_PORT", port - 1)
        monkeypatch.setattr(launch, "ephemeral_ports", lambda: (port + 1, 65535))
        assert {free_port() for _ in range(20)} == {port - 1}
    monkeypatch.setattr(launch, "ephemeral_ports", lambda: (1024, 65535))
    with pytest.warns(RuntimeWarning, match="every port from 1024 to 65535 is the OS's"):
        assert 1024 <= free_port() <= 65535
