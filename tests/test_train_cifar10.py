"""The CIFAR-10 script on CPU with gloo (`--device cpu`, so the same on machines with GPUs): DDP equals
one process; a killed rank is restarted and the run resumes exactly; two nodes with their own data and
output folders equal one node; a run stopped on 2 processes resumes exactly on 1 and on 4; a changed
schedule is refused with a message; checkpoints are atomic; bad input stops with a message."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from utils import forkrun, hangs
from utils.data import write_synthetic_cifar10
from utils.launch import free_port
from utils.train_cifar10 import check_gpus, load_checkpoint, save_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# No DataLoader workers where the test's subject is not them (each rank would start a fork server
# that imports torch); WITH_WORKERS where it is, compared with runs without: the same weights.
COMMON = ["--epochs", "2", "--workers", "0", "--no-progress", "--checkpoint-every", "4", "--device", "cpu",
          "--global-batch", "64"]
WITH_WORKERS = [*COMMON[:2], "--workers", "1", *COMMON[4:]]
TIMEOUT = 300


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_synthetic_cifar10(str(root), n_train=512, n_test=256, seed=0)
    return str(root)


def torchrun(*args, nproc=2, extra=(), timeout=TIMEOUT):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra,
           "-m", "utils.train_cifar10", *args]
    return hangs.run(cmd, env=ENV, timeout=timeout)


def single(*args, timeout=TIMEOUT):
    return hangs.run([sys.executable, "-m", "utils.train_cifar10", *args], env=ENV, timeout=timeout)


# Where the subject is what the script does, not how torchrun starts it: the same environment
# per rank, each process forked from a server that imported torch once (utils.forkrun)
def ranks(*args, nproc=2):
    return forkrun.run("utils.train_cifar10", args, nproc=nproc, env=ENV, timeout=TIMEOUT)


def alone(*args):
    return forkrun.run("utils.train_cifar10", args, env=ENV, timeout=TIMEOUT)


def two_nodes(node_args, timeout=TIMEOUT):
    """Two torchrun "nodes" on 127.0.0.1, one process each; node_args[i] are node i's script arguments.

    Static rendezvous with --node-rank, so node 0 holds global rank 0 every time."""
    port = free_port()
    nodes = []
    for node_rank, args in enumerate(node_args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "utils.train_cifar10", *args]
        nodes.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = hangs.communicate(nodes, timeout)
    finally:
        for n in nodes:
            n.kill()
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][1][-2500:] + outputs[1][1][-2500:]
    return outputs


def final_params(out):
    return torch.load(os.path.join(out, "model_final.pt"), weights_only=True)


def snapshot(folder):
    """Every file under folder, by relative path, with its bytes."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(folder) for f in files}


def max_diff(a, b):
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def relative_distance(a, b, model="simplecnn", seed=0):
    """||a - b|| over all parameters, as a fraction of how far training moved a from the
    initial weights (the script's: torch.manual_seed(seed), then make_model)."""
    from utils.train_cifar10 import make_model

    torch.manual_seed(seed)
    init = make_model(model).state_dict()
    flat = lambda params: torch.cat([params[k].float().flatten() for k in init])
    return float((flat(a) - flat(b)).norm() / (flat(a) - flat(init)).norm())


def ok(done):
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two_ranks"))
    done = ok(ranks("--data", data, "--out", out, *COMMON))
    # which data first; then every rank's line, gathered from each: all took part
    host = socket.gethostname()
    assert done.stdout.splitlines()[:4] == [
        f"synthetic CIFAR-10 in {data}: 512 train, 256 test images; 2 process(es), cpu, "
        "gloo; global batch 64 = 32 x 2", f"rank 0 of 2 (local rank 0) on {host}: cpu",
        f"rank 1 of 2 (local rank 1) on {host}: cpu",
        "peak lr 0.0125 (the linear rule: 0.05 per 256 images)"]
    return out


@pytest.fixture(scope="module")
def stopped_on_two(data, tmp_path_factory):
    """A run on 2 processes that stopped at step 6 of 16 (mid-epoch), leaving its checkpoint."""
    out = str(tmp_path_factory.mktemp("stopped"))
    ok(ranks("--data", data, "--out", out, "--stop-at-step", "6", *COMMON))
    assert not os.path.exists(os.path.join(out, "model_final.pt"))
    return out


def test_two_ranks_equal_one_process_on_the_same_global_batches(data, two_ranks, tmp_path):
    done = ok(alone("--data", data, "--out", str(tmp_path), *WITH_WORKERS))
    # python -m with workers: no worker warns that runpy found the script's module imported
    # (on main each did: the workers' fork server had preloaded it)
    assert "RuntimeWarning" not in done.stderr, done.stderr[-3000:]
    # The same global batches, but each forward pass sees 32 images, not 64: the CPU's
    # kernels may round differently for another shape, and once a ReLU or max-pool
    # decision near a tie falls the other way, training amplifies the difference. So the
    # weights agree up to that noise, not to 1e-5 everywhere: on an AVX-512 CPU, 9.5e-4
    # of the distance training moved them (519 of 2.1 M values off by more than 1e-5),
    # while a run that sees other augmentations of the same images ends 0.86 away.
    assert relative_distance(final_params(two_ranks), final_params(str(tmp_path))) < 1e-2
    with open(os.path.join(two_ranks, "metrics.jsonl")) as f:
        assert len(f.readlines()) == 2  # one line per epoch, written by rank 0 alone


# torchrun runs this file in place of the script: in its node's second attempt, rank 1 dies
# before it joins the group, as a rank whose GPU fails at set_device: late enough for rank 0 to
# have started (a rank that dies at once takes the others down before they start)
DIES_BEFORE_INIT = """
import os, runpy, time
if __name__ == "__main__":  # not in DataLoader workers that spawn starts (macOS, Windows)
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "1":
        import torch
        time.sleep(5)
        os._exit(1)
    runpy.run_module("utils.train_cifar10", run_name="__main__")
"""


def losses(out):
    """(train_loss, test_accuracy) of each epoch in out's metrics.jsonl."""
    return [(m["train_loss"], m["test_accuracy"]) for m in metrics_lines(out)]


def test_ranks_killed_after_and_before_init_are_restarted_and_the_run_ends_exactly_as_an_uninterrupted_one(
        data, two_ranks, tmp_path):
    """Attempt 0: the last rank dies at step 6 (after init). Attempt 1: rank 1 dies before it joins
    the group. Attempt 2 resumes from step 4. On main, attempt 2's ranks were numbered into
    different attempts by the store's counter, which rank 1's early death had shifted, and the
    group never formed (a hang); and the resumed epoch's train_loss averaged steps 5-8 only."""
    script = tmp_path / "dies_before_init.py"
    script.write_text(DIES_BEFORE_INIT)
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=2", str(script), "--data", data, "--out", out, "--resume", "--fail-at-step", "6",
           *WITH_WORKERS]
    done = ok(hangs.run(cmd, env=ENV, timeout=150))
    assert "resumed from" in done.stdout and "epoch 1, step 4 of the epoch" in done.stdout
    assert max_diff(final_params(two_ranks), final_params(out)) == 0.0
    assert losses(out) == losses(two_ranks)


# torchrun runs this file in place of the script: rank 1 alone receives SIGUSR1 during step 9 (the
# first of epoch 1: 8 steps an epoch), as from SLURM's --signal, in the run without --resume. The ranks
# compare their flags every STOP_CHECK_EVERY (10) steps and after an epoch's last step: they stop after
# step 10, mid-epoch.
SIGNALLED_IN_STEP_9 = """
import os, signal
import utils.train_cifar10 as train
step = train.train_step
def train_step(args, job, training, model, x, y):
    if job.rank == 1 and training.step == 8 and not args.resume:
        os.kill(os.getpid(), signal.SIGUSR1)
    return step(args, job, training, model, x, y)
if __name__ == "__main__":  # not in DataLoader workers that spawn starts (macOS, Windows)
    train.run(step=train_step)
"""


def test_a_signal_to_one_rank_stops_every_rank_after_one_agreed_checkpoint_and_the_run_resumes_exactly(
        data, two_ranks, tmp_path):
    """On main, SIGUSR1 killed rank 1 outright and SIGTERM lost every step since the last checkpoint."""
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED_IN_STEP_9)
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(script), "--data", data, "--out", out, *COMMON]
    done = hangs.run(cmd, env=ENV, timeout=TIMEOUT)
    assert done.returncode != 0 and "SIGUSR1: every rank stopped after step 10" in done.stdout, done.stderr[-3000:]
    # the signal reached the ranks, not torchrun's agent, which restarted them: on main they trained on
    assert "a restart does not go on" in done.stderr, done.stderr[-3000:]
    assert not os.path.exists(os.path.join(out, "model_final.pt"))
    # the ranks that torchrun saw exit, with 75 (it stops the others once one has exited: SIGTERM, -15)
    codes = set(re.findall(r"exitcode\s+: (-?\d+) \(pid", done.stderr))
    assert "75" in codes and codes <= {"75", "-15"}, done.stderr[-3000:]
    with open(os.path.join(out, "preempted.json")) as f:
        assert {"step": 10, "signal": "SIGUSR1", "attempt": 0, "torchrun_restart": 0}.items() <= json.load(f).items()
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["step"] == 10
    done = ok(hangs.run(cmd + ["--resume"], env=ENV, timeout=TIMEOUT))
    assert "epoch 2, step 2 of the epoch" in done.stdout
    assert not os.path.exists(os.path.join(out, "preempted.json"))
    assert max_diff(final_params(two_ranks), final_params(out)) == 0.0
    assert losses(out) == losses(two_ranks)


# rank 1 sends the signal during step 9 to every process of the run, as SLURM signals every process of
# a job step (with --signal, at a time limit, on preemption or scancel): torchrun's agent, the ranks, each
# rank's fork server and DataLoader workers
TO_EVERY_PROCESS = """
import os, signal, psutil
import utils.train_cifar10 as train
step = train.train_step
signalled = []
def alive(p):
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
def train_step(args, job, training, model, x, y):
    if signalled and training.step == 9:  # a step later: did the workers live through it?
        print(f"workers alive a step later: {sum(map(alive, signalled))} of {len(signalled)}", flush=True)
    if job.rank == 1 and training.step == 8 and not args.resume:
        agent = psutil.Process(os.getppid())
        processes = [agent, *agent.children(recursive=True)]
        servers = [p for p in processes if "forkserver" in " ".join(p.cmdline())]
        workers = [w for server in servers for w in server.children()]
        print(f"signalled {len(processes)} processes, {len(workers)} of them DataLoader workers",
              flush=True)
        for p in processes:
            p.send_signal(signal.SIGNAL)
        signalled.extend(workers)
    return step(args, job, training, model, x, y)
if __name__ == "__main__":
    train.run(step=train_step)
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_every_process_with_dataloader_workers_stops_at_the_agreed_step_and_resumes_exactly(
        data, two_ranks, tmp_path, name):
    """On main a SIGTERM or SIGUSR1 to every process killed the DataLoader workers (a worker of a fork
    server dies of either), and a rank that needed another batch from them failed before it could agree
    or save ("DataLoader worker ... exited unexpectedly"). The agent hears it as well (with SIGUSR1 in --signals-to-handle, as
    the SLURM recipe starts it) and passes it on to the ranks: the flag is set twice, the stop is one."""
    script = tmp_path / "every_process.py"
    script.write_text(TO_EVERY_PROCESS.replace("SIGNAL", name))
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1", str(script), "--data", data, "--out", out,
           *COMMON[:2], "--workers", "2", "--loader", "workers", *COMMON[4:]]
    done = hangs.run(cmd, env=ENV, timeout=TIMEOUT)
    # the agent, 2 ranks, each rank's fork server and resource tracker, and 2 training and 2 test
    # workers a rank, forked by its server
    assert "signalled 15 processes, 8 of them DataLoader workers" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.returncode != 0 and f"{name}: every rank stopped after step 10" in done.stdout, done.stderr[-3000:]
    # (the ranks would not notice dead workers before step 10: it takes batches prefetched before the signal)
    assert "workers alive a step later: 8 of 8" in done.stdout, done.stdout
    with open(os.path.join(out, "preempted.json")) as f:
        assert {"step": 10, "signal": name, "attempt": 0}.items() <= json.load(f).items()
    # the checkpoint is the stopped step's, and the resume starts there (not at the periodic one of step 8)
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["step"] == 10
    done = ok(hangs.run(cmd + ["--resume"], env=ENV, timeout=TIMEOUT))
    assert "epoch 2, step 2 of the epoch (10 in all)" in done.stdout
    assert max_diff(final_params(two_ranks), final_params(out)) == 0.0
    assert losses(out) == losses(two_ranks)


def test_an_elastic_nnodes_range_is_refused_by_every_rank(data, tmp_path):
    """On main, --nnodes=1:2 ran to exit 0 without a word; the world size of such a job may change
    at any restart."""
    done = torchrun("--data", data, "--out", str(tmp_path), *COMMON,
                    extra=["--nnodes=1:2", "--rdzv-conf=last_call_timeout=1"], timeout=120)
    assert done.returncode != 0
    assert "torchrun --nnodes=1:2 starts an elastic job" in done.stderr, done.stderr[-3000:]
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_with_three_ranks_a_restart_is_bit_identical_under_deterministic(data, tmp_path):
    """Over 3 ranks the order of a gradient sum matters in the last bits; DDP's regrouping of its
    buckets after the first step made a restarted run differ (by 1.5e-8 here) until --deterministic
    kept the buckets fixed."""
    three = [*COMMON, "--global-batch", "96", "--checkpoint-every", "2", "--deterministic"]
    ok(ranks("--data", data, "--out", str(tmp_path / "clean"), *three, nproc=3))
    done = ok(torchrun("--data", data, "--out", str(tmp_path / "killed"), "--resume", "--fail-at-step", "3", *three,
                       nproc=3, extra=["--max-restarts=1"]))
    assert "epoch 1, step 2 of the epoch" in done.stdout
    assert max_diff(final_params(str(tmp_path / "clean")), final_params(str(tmp_path / "killed"))) == 0.0


@pytest.mark.parametrize("nproc", [1, 4])
def test_a_run_stopped_on_two_processes_resumes_exactly_on_another_number(data, two_ranks, stopped_on_two,
                                                                          tmp_path, nproc):
    out = str(tmp_path / "out")
    shutil.copytree(stopped_on_two, out)
    run = alone if nproc == 1 else (lambda *a: ranks(*a, nproc=nproc))
    done = ok(run("--data", data, "--out", out, "--resume", *COMMON))
    assert "epoch 1, step 6 of the epoch" in done.stdout
    assert f"global batch 64 = {64 // nproc} x {nproc}" in done.stdout
    assert max_diff(final_params(two_ranks), final_params(out)) < 1e-5  # the same steps, summed in another order
    # the resumed epoch's loss counts the steps before the stop too (on main, only those after it)
    assert [loss for loss, _ in losses(out)] == [loss for loss, _ in losses(two_ranks)]


def test_two_nodes_with_their_own_disks_prepare_data_per_node_and_agree_on_resuming(two_ranks, tmp_path):
    """Each node has an empty --data (node-local disk) and its own --out: only node 0's holds the
    checkpoint. On main, node 1 found no data; and, resuming, node 1 started from scratch alone."""
    folders = [{"data": str(tmp_path / f"node{i}" / "data"), "out": str(tmp_path / f"node{i}" / "out")} for i in (0, 1)]

    def args(node, *extra):
        return ["--data", folders[node]["data"], "--synthetic", "--synthetic-size", "512", "256",
                "--out", folders[node]["out"], *COMMON, *extra]

    two_nodes([args(0, "--stop-at-step", "6"), args(1, "--stop-at-step", "6")])
    for node in (0, 1):  # each node wrote its own copy of the data
        assert os.path.isdir(os.path.join(folders[node]["data"], "cifar-10-batches-py"))
    assert os.path.exists(os.path.join(folders[0]["out"], "checkpoint.pt"))
    assert not os.path.exists(os.path.join(folders[1]["out"], "checkpoint.pt"))  # rank 0 alone saves

    (out0, _), _ = two_nodes([args(0, "--resume"), args(1, "--resume")])
    assert "epoch 1, step 6 of the epoch" in out0
    assert max_diff(final_params(two_ranks), final_params(folders[0]["out"])) < 1e-6


def test_resuming_with_another_schedule_is_refused_with_the_differences(data, stopped_on_two, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(stopped_on_two, out)
    changes = {"--epochs": ("3", "--epochs 3 (checkpoint: 2)"), "--lr": ("0.2", "--lr 0.2 (checkpoint: 0.0125)"),
               "--seed": ("1", "--seed 1 (checkpoint: 0)"),
               "--model": ("resnet18", "--model resnet18 (checkpoint: simplecnn)"),
               "--global-batch": ("32", "--global-batch 32 (checkpoint: 64)"),
               "--momentum": ("0.8", "--momentum 0.8 (checkpoint: 0.9)")}
    for flag, (value, message) in changes.items():  # one change at a time: each is named
        said = refusal("--data", data, "--out", out, "--resume", *COMMON, flag, value)
        assert "cannot resume" in said and message in said, said[-500:]
    assert snapshot(out) == snapshot(stopped_on_two)  # nothing written, nothing lost


def test_an_interrupted_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    config = {"model": "simplecnn", "epochs": 2, "global_batch": 64, "lr": 0.05, "momentum": 0.9,
              "weight_decay": 5e-4, "seed": 0, "data_size": 512}
    good = {"format": "utils.train_cifar10/2", "model": {"w": torch.ones(2)}, "optimizer": {}, "scheduler": {},
            "epoch": 1, "step_in_epoch": 0, "step": 8, "config": config}
    save_checkpoint(path, good)

    def crash_midway(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {**good, "step": 16})
    monkeypatch.undo()
    assert load_checkpoint(path, config)["step"] == 8
    assert os.listdir(tmp_path) == ["checkpoint.pt"]  # no temporary file left behind


@pytest.mark.parametrize("args, message", [
    (["--data", "/nonexistent/cifar"], "no CIFAR-10 in '/nonexistent/cifar'; pass --download"),
    (["--global-batch", "0"], "--global-batch must be at least 1, got 0"),
    (["--epochs", "-1"], "--epochs must be at least 1"),
    (["--amp"], "--amp and --sync-bn need CUDA"),
    (["--global-batch", "1024"], "512 training images is less than one global batch of 1024"),
])
def test_bad_input_stops_early_with_a_message(data, tmp_path, args, message):
    base = ["--data", data, "--out", str(tmp_path), "--no-progress", "--device", "cpu"]
    assert message in refusal(*(base + args))


def test_a_refusal_is_a_message_on_stderr_and_a_nonzero_exit_without_a_traceback(tmp_path):
    """The command line itself, once: what the in-process refusals above stand for."""
    done = single("--data", "/nonexistent/cifar", "--out", str(tmp_path), "--device", "cpu", timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "error: no CIFAR-10 in '/nonexistent/cifar'; pass --download" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_it_says_so(data, tmp_path):
    said = refusal("--data", data, "--out", str(tmp_path), "--device", "cuda")
    assert "--device cuda, but torch.cuda.is_available() is False" in said


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
    assert message in refusal("--data", data, "--out", str(tmp_path), "--resume", "--no-progress", "--device", "cpu")


def test_more_processes_than_gpus_is_refused():
    with pytest.raises(SystemExit, match="4 processes on this node but only 2 GPUs"):
        check_gpus(4, 2)
    check_gpus(2, 2)


ATTEMPT = """
import torch, torch.distributed as dist
from utils.train_cifar10 import init_process_group
init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print("attempt", __import__("os").environ["TRAIN_CIFAR10_ATTEMPT"], "sum", int(t))
dist.destroy_process_group()
"""


def test_restarted_ranks_agree_on_the_attempt_when_only_one_node_counted_a_restart():
    """torchrun's agents count restarts per node: after a failure on node 1, its ranks see
    TORCHELASTIC_RESTART_COUNT=1 while node 0's see 0. On main they used different store prefixes
    (and node 0's read the dead attempt's keys): the restarted group never formed."""
    from datetime import timedelta

    import torch.distributed as dist

    agent_store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)

    def attempt(restart_counts):
        procs = [subprocess.Popen([sys.executable, "-c", ATTEMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**ENV, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                  "MASTER_PORT": str(agent_store.port),
                                                  "TORCHELASTIC_USE_AGENT_STORE": "True",
                                                  "TORCHELASTIC_RESTART_COUNT": str(count)})
                 for r, count in enumerate(restart_counts)]
        try:
            outs = hangs.communicate(procs, 60)
        finally:
            for p in procs:
                p.kill()
        return [p.returncode for p in procs], [o for o, _ in outs], [e[-1500:] for _, e in outs]

    codes, outs, errs = attempt([0, 0])
    assert codes == [0, 0], errs
    codes, outs, errs = attempt([0, 1])  # node 1 counted a restart, node 0 did not
    assert codes == [0, 0], errs
    assert [o.strip() for o in outs] == ["attempt 1 sum 2"] * 2


# rank 1 stops responding in step 3 (a file system that never answers, a stuck kernel)
STUCK_IN_STEP_3 = """
import time
import utils.train_cifar10 as train
step = train.train_step
def train_step(args, job, training, model, x, y):
    if job.rank == 1 and training.step == 2:
        time.sleep(300)
    return step(args, job, training, model, x, y)
if __name__ == "__main__":
    train.run(step=train_step)
"""


def test_after_the_first_step_a_hung_rank_fails_the_others_within_the_step_timeout(data, tmp_path):
    """On main the group had torch's default timeout (30 minutes for gloo, 10 for nccl) all along, and
    --init-timeout/--step-timeout did not exist: rank 0 waited for rank 1 half an hour."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_IN_STEP_3)
    start = time.monotonic()
    done = forkrun.run(str(script), ["--data", data, "--out", str(tmp_path / "out"), *COMMON,
                                     "--init-timeout", "120", "--step-timeout", "4"],
                       nproc=2, env=ENV, timeout=TIMEOUT, grace=2)
    # rank 0's collective in step 3 timed out (gloo: "Timed out waiting 4000ms"), and forkrun, like
    # torchrun, stopped the other rank
    assert done.returncode != 0 and time.monotonic() - start < 60, done.stderr[-3000:]
    assert "4000ms" in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("args, message", [(["--step-timeout", "0"], "--step-timeout must be positive"),
                                           (["--init-timeout", "-1"], "--init-timeout must be positive")])
def test_timeouts_must_be_positive(args, message, capsys):
    from utils.train_cifar10 import parse_args

    with pytest.raises(SystemExit):
        parse_args(args)
    assert message in capsys.readouterr().err


def test_nodes_whose_data_differ_stop_with_a_message_instead_of_hanging(tmp_path):
    sizes = [["512", "256"], ["640", "256"]]  # node 1 holds a stale copy of another size
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "utils.train_cifar10", "--data", str(tmp_path / f"node{node}"), "--synthetic",
               "--synthetic-size", *sizes[node], "--out", str(tmp_path / f"out{node}"), *COMMON]
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = hangs.communicate(procs, 180)
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode != 0 for p in procs)
    assert "error: the data differs between ranks 0 and [1]" in outs[0][1] + outs[1][1]


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _evaluate_with_rank_1_buffers_shifted(images, labels):
    """Each rank: rank 0's model, except that rank 1's BatchNorm running statistics differ, as they
    do after a training step without --sync-bn. Returns evaluate()'s accuracy on this rank."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from utils.metrics import EvalShardSampler
    from utils.train_cifar10 import evaluate

    model = _bn_model()
    if dist.get_rank() == 1:
        model[1].running_mean += 2.0
        model[1].running_var *= 0.1
    test_set = TensorDataset(images, labels)
    loader = DataLoader(test_set, batch_size=8, sampler=EvalShardSampler(test_set, 2, dist.get_rank()))
    return evaluate(model, loader, torch.device("cpu"))


def test_the_exact_evaluation_scores_rank_0s_model_even_when_the_ranks_buffers_differ():
    """Before the fix each rank scored its shard on its own buffers: a mixture of two models."""
    from utils.launch import run_distributed

    images = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    model = _bn_model().eval()
    with torch.no_grad():
        labels = model(images).argmax(1)  # rank 0's model scores 1.0 on this set
        shifted = _bn_model()
        shifted[1].running_mean += 2.0
        shifted[1].running_var *= 0.1
        mixture = torch.cat([model(images[0::2]).argmax(1) == labels[0::2],
                             shifted.eval()(images[1::2]).argmax(1) == labels[1::2]]).float().mean()
    assert float(mixture) < 0.9  # what evaluating each shard on its own rank's buffers gave
    assert run_distributed(_evaluate_with_rank_1_buffers_shifted, 2, images, labels, timeout=120) == [1.0, 1.0]


# --- --loader gpu: utils.gpu_loader on the CPU (the same tensor code as on CUDA) ------

GPU_RUN = [*COMMON, "--loader", "gpu"]
RECORD_KEYS = ["epoch", "step", "train_loss", "test_accuracy", "images_per_s",
               "epoch_seconds", "eval_seconds", "save_seconds", "world_size", "data", "model",
               "device", "loader"]


def in_process(*argv, step=None):
    """main(argv, step) in this process (no interpreter start): (stdout, error message
    or None)."""
    import contextlib
    import io

    from utils.train_cifar10 import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(list(argv), step=step)
        except SystemExit as stop:
            return out.getvalue(), str(stop.code)
    return out.getvalue(), None


def refusal(*argv):
    """main(argv) in this process must stop with a message: a SystemExit, not a traceback (any
    other exception fails the test) and not a normal return. Its message and what it wrote to
    stderr (argparse's errors): what a user would read, without starting an interpreter (2-4 s)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _, error = in_process(*argv)
    assert error not in (None, "0"), "main ran instead of refusing"
    return err.getvalue() + error


def metrics_lines(out):
    import json

    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def gpu_uninterrupted(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpu_uninterrupted"))
    stdout, error = in_process("--data", data, "--out", out, *GPU_RUN)
    assert error is None, error
    assert "loader: gpu (--loader gpu, on the CPU: the same tensor code)" in stdout
    return out


@pytest.fixture(scope="module")
def gpu_stopped(data, tmp_path_factory):
    """A --loader gpu run stopped at step 6 of 16 (mid-epoch 0), with its checkpoint."""
    out = str(tmp_path_factory.mktemp("gpu_stopped"))
    _, error = in_process("--data", data, "--out", out, "--stop-at-step", "6",
                          *GPU_RUN)
    assert error is None, error
    assert not os.path.exists(os.path.join(out, "model_final.pt"))
    return out


def test_a_loader_gpu_run_stopped_mid_epoch_resumes_exactly(
        data, gpu_uninterrupted, gpu_stopped, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(gpu_stopped, out)
    # with the progress bar this time: the loss is read every 3 steps
    with_bar = [a for a in GPU_RUN if a != "--no-progress"]
    stdout, error = in_process("--data", data, "--out", out, "--resume", *with_bar,
                               "--log-every", "3")
    assert error is None, error
    assert "epoch 1, step 6 of the epoch (6 in all)" in stdout
    assert "loss=" in stdout and "img_s=" in stdout  # the bar's postfix
    assert max_diff(final_params(gpu_uninterrupted), final_params(out)) == 0.0
    for run in (gpu_uninterrupted, out):  # the same format, one line per epoch
        records = metrics_lines(run)
        assert [list(r) for r in records] == [RECORD_KEYS] * 2
        assert [r["loader"] for r in records] == ["gpu", "gpu"]
    # epoch 1's loss, summed on the device, is the uninterrupted run's (epoch 0's
    # covers the steps run since the resume)
    assert (metrics_lines(out)[1]["train_loss"]
            == metrics_lines(gpu_uninterrupted)[1]["train_loss"])


def test_two_ranks_with_loader_gpu_and_channels_last_equal_one_process(data, tmp_path):
    # --lr 0.05: the differences in rounding grow with the step size (3.1e-5 at the default
    # 0.1, on this test's 8 steps), and 1e-5 below is the stronger check of the loader
    one = str(tmp_path / "one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks' OMP_NUM_THREADS=1: each rank's sums in one order
    try:  # (with 2 threads an Intel Xeon's one process ended 1.6e-3 away from the two ranks)
        _, error = in_process("--data", data, "--out", one, *GPU_RUN, "--channels-last", "yes", "--lr", "0.05",
                              "--epochs", "1")
    finally:
        torch.set_num_threads(threads)
    assert error is None, error
    two = str(tmp_path / "two")
    done = ok(ranks("--data", data, "--out", two, *GPU_RUN, "--channels-last", "yes", "--lr", "0.05",
                    "--epochs", "1"))
    assert "loader: gpu" in done.stdout and "channels_last: yes" in done.stdout
    assert "global batch 64 = 32 x 2" in done.stdout
    # the same global batches in the same memory format: the two ranks' batches interleave
    # into the one process's, bit for bit
    import numpy as np

    from utils.gpu_loader import GPULoader
    images = np.random.default_rng(0).integers(0, 256, (256, 32, 32, 3), dtype=np.uint8)
    kwargs = dict(seed=0, drop_last=True, drop_last_batch=True, channels_last=True)
    whole = next(iter(GPULoader(images, list(range(256)), 64, num_replicas=1, rank=0, **kwargs)))
    for rank in range(2):
        part = next(iter(GPULoader(images, list(range(256)), 32, num_replicas=2, rank=rank, **kwargs)))
        assert torch.equal(whole[0][rank::2], part[0]) and torch.equal(whole[1][rank::2], part[1])
    # ... summed in another order, which rounds otherwise: on an AVX-512 CPU 1e-8 apart after
    # 2 steps, and once a decision near a tie falls the other way, 1e-5 after 4 to 1e-3 after
    # 16 (an Intel Xeon: 1.7e-5 after this run's 8); other batches would be 1e-2 apart and more
    assert max_diff(final_params(one), final_params(two)) < 1e-4


def test_resuming_with_the_other_loader_is_refused_and_auto_is_workers_on_the_cpu(
        data, gpu_stopped, stopped_on_two, two_ranks, tmp_path):
    assert [r["loader"] for r in metrics_lines(two_ranks)] == ["workers"] * 2  # auto
    for source, args, message in [
            (gpu_stopped, [*GPU_RUN[:-1], "workers"],
             "--loader workers (checkpoint: gpu)"),
            (gpu_stopped, GPU_RUN[:-2],  # --loader auto: workers on the CPU
             "--loader workers (checkpoint: gpu)"),
            (stopped_on_two, [*COMMON, "--loader", "gpu"],
             "--loader gpu (checkpoint: workers)")]:
        out = str(tmp_path / os.path.basename(source))
        shutil.copytree(source, out, dirs_exist_ok=True)
        _, error = in_process("--data", data, "--out", out, "--resume", *args)
        assert error is not None and "cannot resume" in error and message in error
        assert snapshot(out) == snapshot(source)  # nothing written


def test_a_checkpoint_from_before_loader_existed_counts_as_workers(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    config = {"model": "simplecnn", "epochs": 2, "global_batch": 64, "lr": 0.05,
              "momentum": 0.9, "weight_decay": 5e-4, "seed": 0, "data_size": 512}
    save_checkpoint(path, {"format": "utils.train_cifar10/2", "model": {},
                           "optimizer": {}, "scheduler": {}, "epoch": 0,
                           "step_in_epoch": 4, "step": 4, "config": config})
    assert load_checkpoint(path, {**config, "loader": "workers"})["step"] == 4
    with pytest.raises(SystemExit, match=r"--loader gpu \(checkpoint: workers\)"):
        load_checkpoint(path, {**config, "loader": "gpu"})


def test_choose_loader_takes_the_gpu_loader_with_cuda_when_the_set_fits():
    from utils.train_cifar10 import choose_loader

    cpu, cuda, gib = torch.device("cpu"), torch.device("cuda", 0), 2**30
    assert choose_loader("auto", cpu, gib, None)[0] == "workers"
    assert choose_loader("gpu", cpu, gib, None)[0] == "gpu"
    assert choose_loader("workers", cuda, gib, 80 * gib)[0] == "workers"
    loader, why = choose_loader("auto", cuda, gib, 4 * gib)
    assert loader == "gpu" and "1.00 GiB <= 1/4 of the 4.00 GiB free on cuda:0" in why
    loader, why = choose_loader("auto", cuda, gib, 4 * gib - 1)
    assert loader == "workers" and "> 1/4" in why
    assert choose_loader("gpu", cuda, gib, 2 * gib)[0] == "gpu"
    with pytest.raises(SystemExit, match="--loader gpu: the training set's 3.00 GiB do "
                                         "not fit in the 2.00 GiB free on cuda:0"):
        choose_loader("gpu", cuda, 3 * gib, 2 * gib)


def test_compile_is_accepted_and_refused_with_a_message_without_a_compiler(
        data, tmp_path, monkeypatch):
    """A CPU run with --compile takes about a minute here (the compilation), so it is
    not run; the check that stops it where it cannot work is."""
    from utils.train_cifar10 import check_compile, parse_args

    assert parse_args(["--compile"]).compile
    if shutil.which(os.environ.get("CXX", "g++")):
        check_compile(torch.device("cpu"))  # accepted: a compiler is there
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    _, error = in_process("--data", data, "--out", str(tmp_path), *GPU_RUN,
                          "--compile")
    assert error is not None and "--compile on the CPU needs a C++ compiler" in error
    assert "'/nonexistent/g++'" in error and os.listdir(tmp_path) == []


def test_log_every_below_one_is_refused(capsys):
    from utils.train_cifar10 import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--log-every", "0"])
    assert "--log-every must be at least 1, got 0" in capsys.readouterr().err


def one_step(model, seed_before, step=5, tmp="unused"):
    """The script's train_step at global step `step` on one process, after torch's generator was left
    at `seed_before` (another history): the loss, and the Training record."""
    import utils.train_cifar10 as script

    args = script.parse_args(["--device", "cpu", "--global-batch", "4"])
    job = script.Job(False, 0, 0, 1, torch.device("cpu"), 4, False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    training = script.Training(model, optimizer, script.one_cycle(optimizer, 0.1, 100), tmp, {}, step=step,
                               scaler=script.grad_scaler(False))
    x, y = torch.ones(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    torch.manual_seed(seed_before)
    return float(script.train_step(args, job, training, model, x, y)), training


def test_a_step_reseeds_only_where_the_model_draws_random_numbers_and_stays_exact():
    """The per-step reseed (two NumPy SeedSequences, every step) was paid by models that draw nothing; it
    stays where one does (dropout), so that a resumed step draws what the uninterrupted one drew."""
    from torch import nn

    from utils.train_cifar10 import make_model

    def dropout_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(3 * 32 * 32, 10))

    (a, first), (b, _) = one_step(dropout_model(), 1), one_step(dropout_model(), 2)
    assert first.reseed is True and a == b  # the same draws whatever came before
    torch.manual_seed(0)
    _, plain = one_step(make_model("simplecnn"), 1)
    assert plain.reseed is False  # nothing drew: no reseed from the next step on


def test_a_stop_at_a_periodic_save_writes_no_second_checkpoint_and_one_after_the_last_step_completes(
        data, tmp_path, monkeypatch):
    """On main a stop agreed at a step that a periodic save had just written saved it again (a second
    write in the seconds a scheduler leaves), and a signal during the last step wrote preempted.json
    and exited 75 although the run was complete: a job script would requeue it for nothing."""
    import signal

    import utils.train_cifar10 as train

    saved = []
    write = train.save_checkpoint
    monkeypatch.setattr(train.steps, "save_checkpoint", lambda path, state: (
        saved.append((os.path.basename(path), state.get("step"))), write(path, state)))
    step = train.train_step

    def signalled_in_step(at):
        def train_step(args, job, training, *rest):
            if training.step + 1 == at:
                os.kill(os.getpid(), signal.SIGUSR1)
            return step(args, job, training, *rest)
        return train_step

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        # 512 images, batches of 64: 8 steps an epoch, 16 in all; a save every 5 steps; the flag is
        # agreed every 10 steps: the stop comes at step 10, which the periodic save has written
        args = ["--data", data, "--workers", "0", "--loader", "workers", "--device", "cpu", "--no-progress",
                "--epochs", "2", "--global-batch", "64", "--checkpoint-every", "5"]
        out, error = in_process(*args, "--out", str(tmp_path / "stopped"), step=signalled_in_step(9))
        assert error == str(train.EXIT_PREEMPTED) and "SIGUSR1: every rank stopped after step 10" in out
        assert saved == [("checkpoint.pt", 5), ("checkpoint.pt", 8), ("checkpoint.pt", 10)]
        assert (tmp_path / "stopped" / "preempted.json").exists()

        # the signal during step 16, the last: the flag is agreed after it, and the run is complete
        saved.clear()
        out, error = in_process(*args, "--out", str(tmp_path / "last"), step=signalled_in_step(16))
        assert error is None and "SIGUSR1 after the last step (16): the run is complete" in out
        assert (tmp_path / "last" / "model_final.pt").exists()
        assert not (tmp_path / "last" / "preempted.json").exists()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_sigint_stops_at_the_agreed_step_and_only_a_later_second_one_interrupts(monkeypatch):
    """One Ctrl-C (or scancel --signal=INT) reaches a rank twice within milliseconds, from the terminal
    or SLURM and from torchrun's agent: that is one stop at the agreed step; a Ctrl-C a second or more
    later interrupts at once, as Python's default does."""
    import signal

    import utils.train_cifar10 as train

    clock = [100.0]
    monkeypatch.setattr(train.preemption.time, "monotonic", lambda: clock[0])
    preemption = train.Preemption()
    preemption._note(signal.SIGINT, None)
    clock[0] += 0.01
    preemption._note(signal.SIGINT, None)  # the agent's copy of the same Ctrl-C
    assert preemption.signal == signal.SIGINT
    clock[0] += 1.5
    with pytest.raises(KeyboardInterrupt):
        preemption._note(signal.SIGINT, None)
    other = train.Preemption()
    other._note(signal.SIGTERM, None)
    other._note(signal.SIGUSR1, None)
    assert other.signal == signal.SIGTERM  # the first one names the stop


SIGTERM_WHILE_RECORDING = """
import json, os, signal
import torch.distributed.elastic.multiprocessing.errors.error_handler as error_handler
from torch.distributed.elastic.multiprocessing.errors import record
from utils.train_cifar10 import Preemption

class SigtermMidWrite:  # the agent's SIGTERM, half-way through the error file
    def dump(self, data, fp):
        text = json.dumps(data)
        fp.write(text[:10]); fp.flush()
        os.kill(os.getpid(), signal.SIGTERM)
        fp.write(text[10:])

error_handler.json = SigtermMidWrite()

def main():
    with Preemption():
        raise RuntimeError("rank 1 failed")

record(main)()
"""


def test_a_rank_sigtermed_while_it_records_its_exception_still_writes_its_error_file(tmp_path):
    """Under torchrun, a rank that raises goes on with the stop signals' flag handlers while
    ``@record`` writes its error file: the SIGTERM that the agent sends the ranks once it has seen
    one fail does not cut the file short (the agent would die reading it, JSONDecodeError)."""
    error_file = tmp_path / "error.json"
    done = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_RECORDING], capture_output=True, text=True,
                          env={**ENV, "TORCHELASTIC_ERROR_FILE": str(error_file)}, timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "RuntimeError: rank 1 failed" in done.stderr
    report = json.loads(error_file.read_text())
    assert report["message"]["message"] == "RuntimeError: rank 1 failed"

# --- a run that did not learn says so, last, and fails (issue 43) -----------------------

def test_a_diverging_run_stops_with_its_verdict_and_keeps_no_diverged_weights(data,
                                                                               tmp_path):
    """--lr 1e4: the first epoch's loss is not finite; the run stops there, rank 0's
    last word is the verdict, nothing of the diverged weights is saved (no epoch-end
    checkpoint, no model_final.pt), and the exit is not 0."""
    out = str(tmp_path / "out")
    # COMMON saves every 4 steps mid-epoch too: none of those may hold diverged weights
    stdout, error = in_process("--data", data, "--out", out, *GPU_RUN, "--lr", "1e4")
    assert error is not None and re.fullmatch(
        r"failed: the run did not learn \(loss (nan|inf), accuracy 0\.\d+\): lower "
        r"--lr or more --epochs", error), error
    assert [r["epoch"] for r in metrics_lines(out)] == [1]
    assert not os.path.exists(os.path.join(out, "model_final.pt"))
    kept = os.path.join(out, "checkpoint.pt")
    if os.path.exists(kept):  # a mid-epoch one from before the loss left the floats
        state = torch.load(kept, weights_only=True)
        assert state["epoch"] == 0 and all(torch.isfinite(v).all()
                                           for v in state["model"].values())


@pytest.mark.parametrize("loss, accuracy, last, steps, failed", [
    (float("nan"), 0.9, False, 1, True),  # not finite: at any epoch, after any steps
    (float("inf"), 0.9, True, 500, True),
    (2.3, 0.19, True, 100, True),  # the last epoch at chance after 100 steps
    (2.3, 0.2, True, 100, False),  # twice chance: it learned something
    (2.3, 0.1, True, 99, False),  # too short to judge
    (2.3, 0.1, False, 500, False),  # not the last epoch
])
def test_the_verdict_on_learning(loss, accuracy, last, steps, failed):
    from utils.train_cifar10.recipe import did_not_learn

    assert (did_not_learn(loss, accuracy, last, steps) is not None) == failed


def test_the_default_lr_is_the_linear_rule_per_model():
    from utils.train_cifar10.settings import parse_args

    assert parse_args(["--global-batch", "1024", "--model", "resnet18"]).lr == 0.4
    assert parse_args(["--global-batch", "64"]).lr == 0.0125  # SimpleCNN: 0.05 per 256
    given = parse_args(["--global-batch", "64", "--lr", "0.3"])
    assert given.lr == 0.3 and not given.lr_from_rule


def test_download_refuses_a_folder_that_holds_the_stand_in(data, tmp_path):
    """Its recorded MD5s would pass for CIFAR-10's: --download must not train on it."""
    said = refusal("--data", data, "--download", "--out", str(tmp_path / "out"),
                   *COMMON)
    assert (f"--data {data} holds the book's generated stand-in, not CIFAR-10: "
            "--download would train on it") in said, said
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
