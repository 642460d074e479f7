"""examples/slurm/train_cifar10.sbatch, run as Slurm would run it on two nodes, with the fake srun and
scontrol of tests/fake_slurm: every task runs on this machine, the two "nodes" meet on 127.0.0.1, and
train on the CPU (gloo). The data is staged first, as on a login node. A job with no staged data stops
before it starts anything; a job that fails is not requeued; a job signalled as Slurm does before its
time limit saves and requeues itself, and the requeued job trains to the end (one job that runs to its
end costs as much as a whole one without the signal, so the test of a whole job is that one)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from utils import hangs
from utils.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "train_cifar10.sbatch"
FAKE_SLURM = ROOT / "tests" / "fake_slurm"
TIMEOUT = 120

# each job starts two torchruns and their ranks at once
pytestmark = pytest.mark.xdist_group("ranks")


def stage(data, train=320, test=64):
    """What the recipe asks for before submitting: the data staged by one process."""
    done = hangs.run([sys.executable, "-m", "utils.train_cifar10", "--prepare-only", "--synthetic",
                      "--synthetic-size", str(train), str(test), "--data", str(data)],
                     cwd=ROOT, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return data


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return stage(tmp_path_factory.mktemp("staged"))


def job_env(tmp_path, data, **variables):
    """The environment of the batch script of job 4242 on node1 and node2 (the fake Slurm's), with
    the recipe's variables for one process per node on the CPU."""
    (tmp_path / "slurm").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "PET_", "TORCHELASTIC_"))}
    env.update(PATH=f"{FAKE_SLURM}{os.pathsep}{env['PATH']}", FAKE_SLURM_LOG=str(tmp_path / "slurm"),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="cifar10", SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2",
               SLURM_CPUS_PER_TASK="1", SLURM_SUBMIT_DIR=str(ROOT), OMP_NUM_THREADS="1",
               DATA=str(data), OUT=str(tmp_path / "out"), GPUS_PER_NODE="1", EPOCHS="1",
               TRAIN_ARGS="--device cpu --global-batch 64 --workers 0", RDZV_PORT=str(free_port()),
               PYTHON=sys.executable)
    env.update(variables)
    return env


def process_tree(pid):
    """pid and every process it started, from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def sbatch(env, timeout=TIMEOUT):
    """Run the recipe as Slurm starts a batch script: bash, in the folder it was submitted from."""
    return hangs.run(["bash", str(SBATCH)], cwd=ROOT, env=env, timeout=timeout)


def srun_calls(tmp_path):
    calls = tmp_path / "slurm" / "srun"
    return calls.read_text().splitlines() if calls.exists() else []


def requeues(tmp_path):
    calls = tmp_path / "slurm" / "scontrol"
    return calls.read_text().splitlines() if calls.exists() else []


def test_without_staged_data_the_job_stops_before_starting_anything(tmp_path):
    done = sbatch(job_env(tmp_path, tmp_path / "nowhere"), timeout=30)
    assert done.returncode != 0
    assert f"no CIFAR-10 in DATA={tmp_path / 'nowhere'}" in done.stderr
    assert "--prepare-only --download" in done.stderr
    assert srun_calls(tmp_path) == [] and not (tmp_path / "out").exists()


def test_a_failed_run_is_not_requeued_even_with_a_preemption_file_left_from_before(staged, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # from an earlier job that was preempted; this one fails before it could resume
    (out / "preempted.json").write_text('{"step": 3, "signal": "SIGUSR1"}')
    os.utime(out / "preempted.json", (1e9, 1e9))
    # 63 does not split over 2 processes: every rank stops with a message
    done = sbatch(job_env(tmp_path, staged, MAX_RESTARTS="0",
                          TRAIN_ARGS="--device cpu --global-batch 63 --workers 0"))
    assert done.returncode != 0
    assert "error: training failed" in done.stderr and "not requeued" in done.stderr
    assert requeues(tmp_path) == [] and not (out / "model_final.pt").exists()
    assert "does not split evenly" in (out / "logs" / "cifar10-4242-node1.out").read_text()


def training_srun(job_pid):
    """The fake srun of the job's training step (the one with --wait=120)."""
    for pid in process_tree(job_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"fake_slurm/srun") for arg in argv) and b"--wait=120" in argv:
            return pid
    return None


def test_a_signalled_job_saves_requeues_itself_and_the_requeued_job_trains_to_the_end_on_two_nodes(
        tmp_path):
    """Slurm's --signal=USR1@120: SIGUSR1 to the training step (here the fake srun, which passes it to
    each node's torchrun, which passes it to its ranks) stops every rank after one agreed step with a
    checkpoint; the job requeues itself; the requeued job (same job id) resumes and trains to the end
    on two nodes, from node-local copies of the data, with a log per node and no second requeue."""
    data = stage(tmp_path / "data", train=2560)  # 40 steps an epoch: time for the signal to land
    local = tmp_path / "node-local"
    env = job_env(tmp_path, data, EPOCHS="2", LOCAL_DATA=str(local),
                  TRAIN_ARGS="--device cpu --global-batch 64 --workers 0 --checkpoint-every 5")
    out = tmp_path / "out"
    job = subprocess.Popen(["bash", str(SBATCH)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (out / "checkpoint.pt").exists():  # after step 5
            assert job.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.05)
        os.kill(training_srun(job.pid), signal.SIGUSR1)
        (stdout, stderr), = hangs.communicate([job], TIMEOUT)
    finally:
        if job.poll() is None:
            for pid in process_tree(job.pid):
                os.kill(pid, signal.SIGKILL)
    assert job.returncode == 0, stdout + stderr
    stopped = json.loads((out / "preempted.json").read_text())
    assert stopped["signal"] == "SIGUSR1" and 5 <= stopped["step"] < 80
    assert "preempted (" in stdout and requeues(tmp_path) == ["requeue 4242"]
    assert not (out / "model_final.pt").exists()
    assert f"SIGUSR1: every rank stopped after step {stopped['step']}" in (
        out / "logs" / "cifar10-4242-node1.out").read_text()

    # Slurm starts the requeued job with the same id, on the same or other nodes
    done = sbatch({**env, "SLURM_RESTART_COUNT": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "job 4242 (restart 1)" in done.stdout
    assert f"done: {out / 'model_final.pt'}" in done.stdout
    assert (out / "model_final.pt").exists() and not (out / "preempted.json").exists()
    assert requeues(tmp_path) == ["requeue 4242"]  # the first job's only
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["epoch"] == 2 and last["step"] == 80 and last["world_size"] == 2
    # the head node's address was looked up on the head node, and is where the ranks met
    assert "rendezvous at 127.0.0.1:" in done.stdout and "on node1;" in done.stdout
    assert "loopback address" in done.stderr  # every fake node is this machine
    lookup, copy, training = srun_calls(tmp_path)[-3:]  # the requeued job's
    assert "-w node1 hostname --ip-address" in lookup
    assert "--ntasks-per-node=1" in copy and (local / "cifar-10-batches-py").is_dir()
    # the job's --cpus-per-task reaches srun (Slurm >= 22.05 needs SRUN_CPUS_PER_TASK for it)
    assert training.startswith("cpus-per-task=1 ") and "--kill-on-bad-exit=0 --wait=120" in training
    logs = out / "logs"
    node1, node2 = ((logs / f"cifar10-4242-{node}.out").read_text() for node in ("node1", "node2"))
    assert node1.startswith("== node1: node 0 of 2, job 4242")
    assert node2.startswith("== node2: node 1 of 2, job 4242")
    # rank 0 (on the head node) logs; the data came from the node-local copy
    assert f"resumed from {out / 'checkpoint.pt'}" in node1
    assert f"synthetic CIFAR-10 in {local}:" in node1 and "2 process(es), cpu, gloo" in node1
