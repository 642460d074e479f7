"""examples/slurm/train_cifar10.sbatch on a real two-node Slurm 22.05 cluster (utils.slurm_cluster:
munge, slurmctld and two slurmd, each node in a network namespace of its own with its own address,
64 CPUs and 8 GPUs a node as counts), submitted with sbatch as its header stands; each node runs one
process on the CPU (GPUS_PER_NODE=1, --device cpu, gloo), with DataLoader workers. The data is staged
first, as on a login node.

Where Slurm cannot run (not Linux, not root, slurm-wlm not installed) these tests skip with the reason;
with CI=true they fail instead. The cluster holds a requeued job 10 s, not 120 (cred_expire), before the
scheduler's next pass starts it (utils.slurm_cluster.CRED_EXPIRE)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from utils import slurm_cluster
from utils.slurm_cluster import NODES, Cluster
from utils.slurm_job import (EPOCHS, ROOT, TIMEOUT, batch_log, ended, final_weights, job_env, node_log, requeued,
                             same_weights, slow_job_env, stage, submit, uninterrupted_job, warned_job)

# one cluster for the module, and its jobs start torchruns and ranks
pytestmark = pytest.mark.xdist_group("ranks")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, and no Slurm here: {reason}")
        pytest.skip(reason)
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
    except slurm_cluster.SlurmError as error:
        if "namespaces" not in str(error):
            raise
        cluster = Cluster(tmp_path_factory.mktemp("cluster"), namespaces=False)
        cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return stage(tmp_path_factory.mktemp("staged"))


# --- the cluster itself --------------------------------------------------------------------------------

def test_a_cluster_starts_over_the_network_a_killed_run_left_and_keeps_a_live_ones(tmp_path):
    """Before the module's cluster starts: a run killed before its stop() (SIGKILL, a session's end)
    leaves its bridge with the controller's address and its namespaces; the next cluster removes
    them. A network whose owner still runs is kept."""
    reason = slurm_cluster.unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, and no Slurm here: {reason}")
        pytest.skip(reason)
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = subprocess.Popen(["sleep", "60"])
    dead_bridge, dead_ns, live_bridge = f"slbr{gone.pid}", f"sl{gone.pid}node1", f"slbr{live.pid}"
    ip = Cluster._ip
    try:
        ip("link", "add", dead_bridge, "type", "bridge")
        ip("addr", "add", f"{slurm_cluster.CONTROLLER_ADDR}/24", "dev", dead_bridge)
        ip("netns", "add", dead_ns)
        ip("link", "add", live_bridge, "type", "bridge")
        stale = slurm_cluster.stale_networks()
        assert (dead_bridge, [dead_ns]) in stale and live_bridge not in [bridge for bridge, _ in stale]
        cluster = Cluster(tmp_path)
        try:
            cluster._network()
        finally:
            cluster.stop()
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f" {dead_bridge}:" not in links and dead_ns not in spaces
        assert f" {live_bridge}:" in links and f" {cluster.bridge}:" not in links
    finally:
        live.kill()
        live.wait()
        slurm_cluster.remove_network(dead_bridge, [dead_ns])
        slurm_cluster.remove_network(live_bridge, [])


# --- the script's own checks, before anything trains ------------------------------------------------

def test_without_staged_data_the_job_stops_before_starting_anything(cluster, tmp_path):
    job = submit(cluster, tmp_path, job_env(cluster, tmp_path, tmp_path / "nowhere"))
    assert ended(cluster, job)["JobState"] == "FAILED"
    log = batch_log(tmp_path, job)
    assert f"no CIFAR-10 in DATA={tmp_path / 'nowhere'}" in log and "--prepare-only --download" in log
    assert not (tmp_path / "out").exists()


def test_a_head_node_whose_name_is_a_loopback_address_is_refused_before_training(cluster, staged, tmp_path):
    """As on a node installed by Debian, whose /etc/hosts gives its own name 127.0.1.1, without
    SOCKET_IFNAME: the other node would dial its own loopback and wait for the rendezvous until it
    timed out, with every GPU allocated."""
    if not cluster.namespaces:
        pytest.skip("both nodes are this machine's loopback: no namespaces here")
    with cluster.loopback_names():
        job = submit(cluster, tmp_path, job_env(cluster, tmp_path, staged, SOCKET_IFNAME=None))
        assert ended(cluster, job)["JobState"] == "FAILED"
    log = batch_log(tmp_path, job)
    assert "resolves its own name to 127.0.1.1, a loopback address" in log, log
    assert not (tmp_path / "out" / "logs" / f"cifar10-{job}-node1.out").exists()  # no training step


# stands in for python (PYTHON) in the job: notes its arguments, starts nothing, says
# nothing (so torchrun has no --shutdown-timeout: a warning, no matter)
FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$FAKE_PYTHON_LOG"
"""


def dry_job(cluster, tmp_path, *options, **variables):
    """The recipe submitted with sbatch ``options``, to the end of its training step, with a PYTHON
    that only notes its arguments: the batch script's output, and each node's training command
    (torchrun's arguments, then the module's). A variable given as None is left out."""
    data = tmp_path / "data"
    (data / "cifar-10-batches-py").mkdir(parents=True, exist_ok=True)
    python, log = tmp_path / "python", tmp_path / "python.log"
    log.unlink(missing_ok=True)  # a job before, in the same test
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = job_env(cluster, tmp_path, data, PYTHON=str(python), FAKE_PYTHON_LOG=str(log), GPUS_PER_NODE=None,
                  TRAIN_ARGS=None)
    env.update(variables)
    job = submit(cluster, tmp_path, {k: v for k, v in env.items() if v is not None}, *options)
    assert ended(cluster, job)["JobState"] == "FAILED"  # no done.json: the job ends as a failed one
    out = batch_log(tmp_path, job)
    assert "error: training failed" in out, out
    lines = log.read_text().splitlines() if log.exists() else []
    return out, [line for line in lines if "-m utils.train_cifar10" in line]


@pytest.mark.parametrize("options, gpus, workers, why, batch", [
    ((), 8, 5, "64 CPUs a node / 8 GPUs - 1 - 2, at least 1", "2048 (128 x 2 node(s) x 8 GPUs)"),  # as is
    (("--cpus-per-task=32", "--gpus-per-node=4"), 4, 5, "32 CPUs a node / 4 GPUs - 1 - 2, at least 1",
     "1024 (128 x 2 node(s) x 4 GPUs)"),
    (("--cpus-per-task=16", "--nodes=1"), 8, 1, "16 CPUs a node / 8 GPUs - 1 - 2, at least 1",
     "1024 (128 x 1 node(s) x 8 GPUs)"),
])
def test_workers_and_the_global_batch_follow_what_slurm_gave(cluster, tmp_path, options, gpus, workers, why,
                                                             batch):
    out, commands = dry_job(cluster, tmp_path, *options)
    assert f"per process: --workers {workers} ({why}); --global-batch {batch}\n" in out, out
    nodes = 1 if "--nodes=1" in options else 2
    assert len(commands) == nodes  # a torchrun per node, each with a process per GPU
    for command in commands:
        assert f"--nproc-per-node={gpus} " in command and f" --workers {workers} " in command
        assert f"--rdzv-id={out.split('job ')[1].split()[0]} " in command
        assert ",read_timeout=600 " in command
    if options:
        return
    # the default command leaves the learning rate (the linear rule's) and the loader (auto) to the
    # script
    for command in commands:
        assert command.endswith(" --resume --no-progress --global-batch 2048 --workers 5"
                                " --model resnet18 --loader auto --checkpoint-every 50")
        assert "--lr" not in command.split()
    # each node's torchrun is reached at its own address
    addresses = sorted(c.split("--local-addr=")[1].split()[0] for c in commands)
    assert addresses == sorted(cluster.addr[node] for node in NODES)


def test_workers_and_global_batch_given_are_kept(cluster, tmp_path):
    out, commands = dry_job(cluster, tmp_path, WORKERS="7", GLOBAL_BATCH="96", TRAIN_ARGS="--device cpu")
    assert "per process: --workers 7 (WORKERS); --global-batch 96 (GLOBAL_BATCH)\n" in out
    assert all(c.endswith(" --global-batch 96 --workers 7 --device cpu") for c in commands)
    # TRAIN_ARGS' own come last, and argparse takes the last
    out, commands = dry_job(cluster, tmp_path, TRAIN_ARGS="--global-batch 64 --workers 0")
    assert "; TRAIN_ARGS sets its own --global-batch --workers" in out
    assert all(c.endswith(" --global-batch 64 --workers 0") for c in commands)


# --- jobs that train ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(cluster, staged, tmp_path_factory):
    """A job that runs to its end: (folder, job id, its final weights)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    job = uninterrupted_job(cluster, folder, staged)
    return folder, job, final_weights(folder / "out")


def test_a_job_runs_to_its_end_on_two_nodes_at_their_own_addresses(cluster, uninterrupted):
    tmp_path, job, _ = uninterrupted
    out = tmp_path / "out"
    log = batch_log(tmp_path, job)
    assert f"done: {out / 'model_final.pt'}" in log
    assert json.loads((out / "done.json").read_text())["slurm_job_id"] == job
    head = cluster.addr["node1"]
    assert f"rendezvous at {head}:" in log and "on node1;" in log
    # each node's log its own (%N: the node's name)
    node1, node2 = (node_log(tmp_path, job, node) for node in NODES)
    assert f"== node1: node 0 of 2, job {job}, 64 CPUs" in node1 and "== node2" not in node1
    assert f"== node2: node 1 of 2, job {job}, 64 CPUs" in node2 and "== node1" not in node2
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["world_size"] == 2 and last["step"] == 10 * int(EPOCHS)


def test_a_refused_run_with_an_earlier_jobs_final_weights_in_out_fails(cluster, staged, uninterrupted,
                                                                       tmp_path):
    """OUT holds model_final.pt and done.json of an earlier job (the default OUT is a fixed folder); this
    job's ranks refuse its global batch (63 does not split over 2 processes): the job fails. On main it
    printed "done:" and exited 0."""
    shutil.copytree(uninterrupted[0] / "out", tmp_path / "out")
    env = job_env(cluster, tmp_path, staged, MAX_RESTARTS="0",
                  TRAIN_ARGS="--device cpu --global-batch 63 --workers 0")
    job = submit(cluster, tmp_path, env)
    assert ended(cluster, job)["JobState"] == "FAILED"
    log = batch_log(tmp_path, job)
    assert "error: training failed" in log and "done:" not in log, log


def test_warned_by_slurms_time_limit_signal_the_job_saves_requeues_itself_and_ends_as_an_uninterrupted_one(
        cluster, staged, uninterrupted, tmp_path):
    """--time=2 --signal=B:USR1@60: Slurm warns the batch script about a minute before the limit; the
    script has Slurm send SIGTERM to every process of the training step, every rank stops after one
    agreed step with one checkpoint, and the script requeues the job. Requeued, rank 1 raises in its
    first step with its workers running (on main the rank never exited, and the job hung until its time
    limit); torchrun restarts the ranks, they resume, and the job ends with the weights of the job that
    was never stopped. What utils.slurm_job records for chapter 13."""
    record = warned_job(cluster, tmp_path, staged, uninterrupted[0] / "out")
    log = "\n".join(record["batch_log"])
    assert record["state"] == "COMPLETED", log
    assert "SIGUSR1 (the time limit is near)" in log and "requeueing job <job>" in log, log
    assert "job <job> (restart 1)" in log and "done:" in log
    stopped = record["stopped_step"]
    assert stopped % 10 == 0 and 0 < stopped < 10 * EPOCHS, record["node1"]
    # warned about a minute before the limit (Slurm checks its timers every 30 s or so)
    assert 20 <= record["warned_after_s"] <= record["limit_s"] - 30, record
    assert "RuntimeError: rank 1 fails in its first step after the requeue" in "\n".join(record["node2"])
    assert (f"resumed from <work>/out/checkpoint.pt: epoch {stopped // 10 + 1}, step 0 of the epoch "
            f"({stopped} in all)") in "\n".join(record["node1"])
    assert record["same_weights_as_uninterrupted"]
    states = [(state, restarts) for _, state, restarts, _ in record["timeline"]]
    assert states[-1] == ("COMPLETED", record["runs"] - 1) and ("PENDING", 1) in states
    assert ("RUNNING", 0) in states and ("RUNNING", 1) in states


def test_scancel_ends_the_job_without_a_requeue(cluster, staged, tmp_path):
    """scancel (as a time limit or a preemption without a grace time) sends SIGTERM to the batch script
    and to every process of the job; a job script that requeued then would undo a scancel."""
    job = submit(cluster, tmp_path, slow_job_env(cluster, tmp_path, staged))
    out = tmp_path / "out"
    cluster.wait(job, lambda j: (out / "checkpoint.pt").exists(), TIMEOUT)
    cluster.command(["scancel", job])
    assert ended(cluster, job)["JobState"] == "CANCELLED"
    time.sleep(2)
    log = batch_log(tmp_path, job)
    assert "SIGTERM from Slurm" in log and "requeueing" not in log, log
    assert cluster.job(job).get("Restarts") == "0"


def test_a_preempted_job_saves_in_its_grace_time_and_slurm_requeues_it(cluster, staged, uninterrupted,
                                                                       tmp_path):
    """A job of partition low, preempted by one of partition high (PreemptMode=REQUEUE, GraceTime=20):
    Slurm sends SIGTERM to the job, waits the grace time, then requeues it. The ranks stop after an
    agreed step and save; requeued, the job resumes and ends as one that was never stopped."""
    job = submit(cluster, tmp_path, slow_job_env(cluster, tmp_path, staged), "--partition=low")
    out = tmp_path / "out"
    states = []
    cluster.wait(job, lambda j: (out / "checkpoint.pt").exists(), TIMEOUT, states)
    high = cluster.sbatch(["--partition=high", "--nodes=2", "--exclusive", "--output", str(tmp_path / "high.out"),
                           "--wrap", "sleep 1"])
    requeued(cluster, job, 1, states)
    log = batch_log(tmp_path, job)
    node1 = node_log(tmp_path, job, "node1")
    assert ended(cluster, high)["JobState"] == "COMPLETED"
    record = ended(cluster, job, restarts=1, states=states)
    assert record["JobState"] == "COMPLETED", batch_log(tmp_path, job)
    assert "every rank stopped after step" in node1, log + node1
    assert same_weights(final_weights(out), uninterrupted[2])


# stopped at once, every run, by a signal (preempted.json of this run, exit 75), with a checkpoint that
# has advanced by 10 steps in runs 0 and 1, and not in later runs
PREEMPTED_AT_ONCE = """
import json, os, sys
import torch
out = sys.argv[sys.argv.index("--out") + 1]
restart = int(os.environ.get("SLURM_RESTART_COUNT", 0))
if os.environ["RANK"] == "0":
    torch.save({"step": 10 * min(restart + 1, 2)}, os.path.join(out, "checkpoint.pt"))
    with open(os.path.join(out, "preempted.json"), "w") as f:
        json.dump({"step": 0, "signal": "SIGTERM", "slurm_job_id": os.environ["SLURM_JOB_ID"],
                   "slurm_restart": restart}, f)
sys.exit(75)
"""


def test_requeues_are_capped_only_when_they_make_no_progress(cluster, staged, tmp_path):
    """MAX_REQUEUES=1: runs 0 and 1 advance and are requeued; run 2 does not advance, and is not requeued
    (the one requeue before it made no progress). On main the cap counted every requeue: run 1 was
    refused although it had advanced."""
    (tmp_path / "preempted_at_once.py").write_text(PREEMPTED_AT_ONCE)
    env = job_env(cluster, tmp_path, staged, MAX_REQUEUES="1", MAX_RESTARTS="0", TRAIN_MODULE="preempted_at_once")
    job = submit(cluster, tmp_path, env)
    requeued(cluster, job, 2)
    assert ended(cluster, job, restarts=2)["JobState"] == "FAILED"
    log = batch_log(tmp_path, job)
    assert log.count("requeueing job") == 2, log
    assert "not requeued: the last 1 requeue(s) made no progress (the checkpoint is still at step 20;" in log


# --- several nodes without Slurm ---------------------------------------------------------------------

# launch 1: rank 1 receives SIGTERM in step 9 (as from a scheduler); launch 2, with the same --rdzv-id:
# rank 0 fails before it resumes, in its node's first attempt, and torchrun restarts the ranks
RELAUNCHED = """
import os, signal
import utils.train_cifar10 as train

steps = train.steps
step, build_data = steps.train_step, steps.build_data

def train_step(args, job, training, model, x, y):
    if os.environ["LAUNCH"] == "1" and job.rank == 1 and training.step == 8:
        os.kill(os.getpid(), signal.SIGTERM)
    return step(args, job, training, model, x, y)

def failing_build_data(args, job):
    if (os.environ["LAUNCH"] == "2" and job.rank == 0
            and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
        raise RuntimeError("rank 0 fails before it resumes")
    return build_data(args, job)

if __name__ == "__main__":
    steps.build_data = failing_build_data  # main calls it from steps
    train.run(step=train_step)
"""


def test_two_nodes_without_slurm_meet_at_their_own_addresses_and_a_relaunch_with_the_same_id_resumes(
        cluster, staged, tmp_path):
    """Chapter 13's torchrun command for several nodes, on each node of the cluster (its network
    namespace) without Slurm: --rdzv-endpoint at the head's address, --local-addr, read_timeout=600; the
    head's torchrun starts 90 s after the other's (which joins with torch's default read_timeout, 60 s,
    too: a run without the option passed). Launch
    1 is stopped by a signal (exit 75, preempted.json); launch 2 reuses --rdzv-id (as a relaunch by hand
    or by Kubernetes does), and its first attempt fails before it resumes: torchrun's restart resumes and
    trains to the end. On main the restart read launch 1's preempted.json as its own and stopped with
    exit code 75 at every restart."""
    if not cluster.namespaces:
        pytest.skip("both nodes are this machine's loopback: no namespaces here")
    from utils.launch import free_port
    from utils.hangs import communicate

    (tmp_path / "relaunched.py").write_text(RELAUNCHED)
    env = job_env(cluster, tmp_path, staged, GLOO_SOCKET_IFNAME="slurm0")
    port = free_port()

    def launch(number, head_late=0):
        procs = []
        for node in reversed(NODES):  # the head's torchrun last, head_late seconds after the other's
            if node == "node1":
                time.sleep(head_late)
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={cluster.addr['node1']}:{port}",
                    "--rdzv-id=cifar10-run1", "--rdzv-conf=read_timeout=600",
                    f"--local-addr={cluster.addr[node]}", "--max-restarts=1", "-m", "relaunched",
                    "--data", str(staged), "--out", str(tmp_path / "out"), "--epochs", "2", "--resume",
                    "--no-progress", "--device", "cpu", "--global-batch", "64", "--workers", "0"]
            procs.append(subprocess.Popen(cluster.on_node(node, argv), cwd=ROOT, env={**env, "LAUNCH": number},
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = communicate(procs[::-1], TIMEOUT)
        return [p.returncode for p in procs[::-1]], [out for out, _ in outputs]

    # the other node waits 90 s for the head
    codes, outputs = launch("1", head_late=90)
    assert codes != [0, 0] and "SIGTERM: every rank stopped after step 10" in outputs[0], outputs
    codes, outputs = launch("2")
    assert codes == [0, 0], outputs
    assert "RuntimeError: rank 0 fails before it resumes" in "".join(outputs)
    assert "resumed from" in outputs[0] and "a restart does not go on" not in "".join(outputs), outputs
    assert (tmp_path / "out" / "model_final.pt").exists()
