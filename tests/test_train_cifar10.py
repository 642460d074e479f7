"""The CIFAR-10 script on CPU with gloo: DDP equals one process, restarts resume exactly, checkpoints
are atomic, two nodes equal one, and bad input stops with a message."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from utils.data import write_synthetic_cifar10
from utils.train_cifar10 import check_gpus, load_checkpoint, save_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMON = ["--epochs", "2", "--workers", "1", "--no-progress", "--checkpoint-every", "4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_synthetic_cifar10(str(root), n_train=512, n_test=256, seed=0)
    return str(root)


def torchrun(*args, nproc=2, extra=(), timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra,
           "-m", "utils.train_cifar10", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def single(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "utils.train_cifar10", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def final_params(out):
    return torch.load(os.path.join(out, "model_final.pt"), weights_only=True)


def max_diff(a, b):
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two_ranks"))
    done = torchrun("--data", data, "--batch-size", "32", "--out", out, *COMMON)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_two_ranks_equal_one_process_on_the_same_global_batches(data, two_ranks, tmp_path):
    done = single("--data", data, "--batch-size", "64", "--out", str(tmp_path), *COMMON)
    assert done.returncode == 0, done.stderr[-3000:]
    assert max_diff(final_params(two_ranks), final_params(str(tmp_path))) < 1e-5
    with open(os.path.join(two_ranks, "metrics.jsonl")) as f:
        assert len(f.readlines()) == 2  # one line per epoch, written by rank 0 alone


def test_a_killed_rank_is_restarted_and_the_run_ends_exactly_as_an_uninterrupted_one(data, two_ranks, tmp_path):
    done = torchrun("--data", data, "--batch-size", "32", "--out", str(tmp_path), "--resume",
                    "--fail-at-step", "6", *COMMON, extra=["--max-restarts=1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "epoch 0, step 4 of the epoch" in done.stdout
    assert max_diff(final_params(two_ranks), final_params(str(tmp_path))) == 0.0


def test_two_nodes_on_one_machine_equal_one_node_with_two_processes(data, two_ranks, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=book-test",
           "-m", "utils.train_cifar10", "--data", data, "--batch-size", "32", "--out", str(tmp_path), *COMMON]
    nodes = [subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert max_diff(final_params(two_ranks), final_params(str(tmp_path))) < 1e-6


def test_an_interrupted_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    good = {"format": "utils.train_cifar10/1", "model": {"w": torch.ones(2)}, "optimizer": {}, "scheduler": {},
            "epoch": 1, "step_in_epoch": 0, "step": 8, "config": {"model": "simplecnn", "global_batch": 64, "seed": 0}}
    save_checkpoint(path, good)

    def crash_midway(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {**good, "step": 16})
    monkeypatch.undo()
    assert load_checkpoint(path, "simplecnn")["step"] == 8
    assert os.listdir(tmp_path) == ["checkpoint.pt"]  # no temporary file left behind


@pytest.mark.parametrize("args, message", [
    (["--data", "/nonexistent/cifar"], "no CIFAR-10 in '/nonexistent/cifar'; pass --download"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--epochs", "-1"], "--epochs must be at least 1"),
    (["--amp"], "--amp and --sync-bn need CUDA"),
])
def test_bad_input_stops_early_with_a_message(data, tmp_path, args, message):
    base = ["--data", data, "--out", str(tmp_path), "--no-progress"]
    done = single(*(base + args), timeout=120)
    assert done.returncode != 0
    assert message in done.stderr


@pytest.mark.parametrize("content, message", [
    (b"not a checkpoint at all", "cannot read checkpoint"),
    (None, "is not a checkpoint written by utils.train_cifar10"),
])
def test_unreadable_or_foreign_checkpoints_are_refused(data, tmp_path, content, message):
    path = tmp_path / "checkpoint.pt"
    if content is None:
        torch.save({"state_dict": {"w": torch.ones(1)}}, path)  # someone else's checkpoint
    else:
        path.write_bytes(content)
    done = single("--data", data, "--out", str(tmp_path), "--resume", "--no-progress", timeout=120)
    assert done.returncode != 0 and message in done.stderr


def test_more_processes_than_gpus_is_refused():
    with pytest.raises(SystemExit, match="4 processes on this node but only 2 GPUs"):
        check_gpus(4, 2)
    check_gpus(2, 2)
