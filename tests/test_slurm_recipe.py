"""examples/slurm/train_cifar10.sbatch, run as Slurm would run it on two nodes, with the fake srun and
scontrol of tests/fake_slurm: every task runs on this machine, the two "nodes" meet on 127.0.0.1, and
train on the CPU (gloo), with DataLoader workers. The data is staged first, as on a login node. A job
with no staged data stops before it starts anything; a job that fails is not requeued, even with a
preempted.json of the same job's previous run; and one job's whole life: warned before its time limit,
it saves and requeues itself; requeued, its first attempt fails on rank 0's node, is restarted and
resumes; warned again, its save cannot finish, and it is requeued anyway; requeued again, it resumes
from the last complete checkpoint and trains to the end (a job that runs to its end costs as much as a
whole one, so the test of a whole job is that one). Slurm's own SIGTERM (time limit, preemption,
scancel), which reaches srun too, ends the job without a requeue. With a PYTHON that only
notes its arguments (no training, a second a job): the DataLoader workers per process
from the CPUs Slurm gave, the global batch from the GPUs, and the default command (no
--lr, --loader auto)."""

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
               SLURM_CPUS_PER_TASK="3", SLURM_SUBMIT_DIR=str(ROOT), OMP_NUM_THREADS="1",
               DATA=str(data), OUT=str(tmp_path / "out"), GPUS_PER_NODE="1", EPOCHS="1",
               TRAIN_ARGS="--device cpu --global-batch 64 --workers 0", RDZV_PORT=str(free_port()),
               PYTHON=sys.executable, LOOPBACK_OK="1")
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
    # from this job's previous run (the same job id, one requeue less), which was preempted; this run
    # fails before it could resume
    (out / "preempted.json").write_text(json.dumps({
        "step": 3, "signal": "SIGUSR1", "torchrun_run_id": "4242", "slurm_job_id": "4242",
        "slurm_restart": 0, "torchrun_restart": 0, "attempt": 0}))
    # 63 does not split over 2 processes: every rank stops with a message
    done = sbatch(job_env(tmp_path, staged, MAX_RESTARTS="0", SLURM_RESTART_COUNT="1",
                          TRAIN_ARGS="--device cpu --global-batch 63 --workers 0"))
    assert done.returncode != 0
    assert "error: training failed" in done.stderr and "not requeued" in done.stderr
    assert requeues(tmp_path) == [] and not (out / "model_final.pt").exists()
    assert "does not split evenly" in (out / "logs" / "cifar10-4242-node1.out").read_text()


# a task that starts a process in a session of its own (as torchrun starts its ranks), notes the
# signals each of the two gets, and ends when told to
TASK = """
trap 'echo task >> "$FAKE_LOG"' USR1
setsid bash -c 'trap "echo orphan >> \\"\\$FAKE_LOG\\"" USR1; while :; do sleep 0.1; done' &
echo $! > "$FAKE_PID"
while [ ! -e "$FAKE_GO" ]; do sleep 0.1; done
"""


def test_the_fake_srun_signals_every_process_of_the_step_and_kills_what_a_task_leaves(tmp_path):
    """As Slurm does (its cgroup holds every process of the step, whatever its session or parent), and
    as the recipe's tests need: a signal reaches torchrun's ranks directly, and a node whose torchrun
    has ended keeps none of its processes."""
    import psutil

    log, pid_file, go = tmp_path / "log", tmp_path / "pid", tmp_path / "go"
    env = {**job_env(tmp_path, tmp_path), "FAKE_LOG": str(log), "FAKE_PID": str(pid_file),
           "FAKE_GO": str(go)}
    srun = subprocess.Popen([str(FAKE_SLURM / "srun"), "--nodes=1", "bash", "-c", TASK], env=env)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline and srun.poll() is None
            time.sleep(0.05)
        orphan = int(pid_file.read_text())
        os.kill(srun.pid, signal.SIGUSR1)
        while sorted(log.read_text().split()) != ["orphan", "task"] if log.exists() else True:
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no signal arrived"
            time.sleep(0.05)
        go.touch()
        assert srun.wait(30) == 0
        deadline = time.monotonic() + 5
        while psutil.pid_exists(orphan) and psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the task's process outlived it"
            time.sleep(0.05)
    finally:
        srun.kill()
        if pid_file.exists() and pid_file.read_text().strip():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_loopback_head_address_with_two_nodes_stops_before_training(staged, tmp_path):
    env = job_env(tmp_path, staged)
    del env["LOOPBACK_OK"]
    done = sbatch(env, timeout=30)
    assert done.returncode == 1 and "a loopback address that the other nodes cannot reach" in done.stderr
    assert len(srun_calls(tmp_path)) == 1  # the address lookup only: no training step


# stands in for python (PYTHON) in the job: notes its arguments, starts nothing, says
# nothing (so torchrun has no --shutdown-timeout: a warning, no matter)
FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$FAKE_PYTHON_LOG"
"""


def dry_job(tmp_path, **variables):
    """The recipe to the end of its training step with a PYTHON that only notes its
    arguments, in a fraction of a second: the batch script's output, and each node's
    training command (torchrun's arguments, then the module's). A variable given as
    None is left out of the job's environment."""
    data = tmp_path / "data"
    (data / "cifar-10-batches-py").mkdir(parents=True, exist_ok=True)
    python, log = tmp_path / "python", tmp_path / "python.log"
    log.unlink(missing_ok=True)  # a job before, in the same test
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = job_env(tmp_path, data, PYTHON=str(python), FAKE_PYTHON_LOG=str(log))
    env.update(variables)
    env = {k: v for k, v in env.items() if v is not None}
    done = sbatch(env, timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    # no model_final.pt: the job ends as a failed one
    assert done.returncode == 1 and "error: training failed" in done.stderr, (
        done.stdout + done.stderr)
    return done.stdout, [line for line in lines if "-m utils.train_cifar10" in line]


@pytest.mark.parametrize("cpus_per_task, cpus_on_node, gpus_per_node, workers, why", [
    ("64", None, "8", 5, "64 CPUs a node / 8 GPUs - 1 - 2, at least 1"),  # the header
    ("32", None, "4", 5, "32 CPUs a node / 4 GPUs - 1 - 2, at least 1"),
    ("16", None, "8", 1, "16 CPUs a node / 8 GPUs - 1 - 2, at least 1"),
    # --exclusive without --cpus-per-task: all of the node's
    (None, "128", "8", 13, "128 CPUs a node / 8 GPUs - 1 - 2, at least 1"),
])
def test_workers_per_process_follow_the_cpus_slurm_gave(
        tmp_path, cpus_per_task, cpus_on_node, gpus_per_node, workers, why):
    stdout, commands = dry_job(
        tmp_path, SLURM_CPUS_PER_TASK=cpus_per_task, SLURM_CPUS_ON_NODE=cpus_on_node,
        GPUS_PER_NODE=gpus_per_node, TRAIN_ARGS=None)
    assert f"per process: --workers {workers} ({why});" in stdout
    assert len(commands) == 2  # a torchrun per node, each with a process per GPU
    for command in commands:
        assert f"--nproc-per-node={gpus_per_node} " in command
        assert f" --workers {workers} " in command


def test_workers_and_global_batch_given_are_kept(tmp_path):
    stdout, commands = dry_job(tmp_path, WORKERS="7", GLOBAL_BATCH="96",
                               TRAIN_ARGS="--device cpu")
    assert ("per process: --workers 7 (WORKERS); --global-batch 96 (GLOBAL_BATCH)\n"
            in stdout)
    assert all(c.endswith(" --global-batch 96 --workers 7 --device cpu")
               for c in commands)
    # TRAIN_ARGS' own come last, and argparse takes the last
    stdout, commands = dry_job(tmp_path, TRAIN_ARGS="--global-batch 64 --workers 0")
    assert "; TRAIN_ARGS sets its own --global-batch --workers" in stdout
    assert all(c.endswith(" --global-batch 64 --workers 0") for c in commands)


@pytest.mark.parametrize("nodes, gpus_per_node, global_batch", [
    ("2", "8", 2048),  # the header's
    ("1", "8", 1024),  # one node first
    ("2", "4", 1024),
])
def test_the_global_batch_is_128_per_gpu_unless_given(
        tmp_path, nodes, gpus_per_node, global_batch):
    stdout, commands = dry_job(
        tmp_path, SLURM_NNODES=nodes, SLURM_JOB_NODELIST=f"node[1-{nodes}]",
        GPUS_PER_NODE=gpus_per_node, TRAIN_ARGS=None)
    assert (f"--global-batch {global_batch} (128 x {nodes} node(s) x {gpus_per_node} "
            "GPUs)\n") in stdout
    assert len(commands) == int(nodes)
    assert all(f" --global-batch {global_batch} " in c for c in commands)


def test_the_default_command_leaves_the_lr_and_the_loader_to_the_script(tmp_path):
    """No --lr (utils.train_cifar10 derives it from the global batch by the linear
    rule), and --loader auto (the GPU loader where the data fits), not workers."""
    _, commands = dry_job(tmp_path, SLURM_CPUS_PER_TASK="64", GPUS_PER_NODE="8",
                          TRAIN_ARGS=None)
    assert len(commands) == 2
    for command in commands:
        assert command.endswith(
            " --resume --no-progress --global-batch 2048 --workers 5"
            " --model resnet18 --loader auto --checkpoint-every 50")
        assert "--lr" not in command.split() and "--loader workers" not in command
    # the site's partition and account: in the header, commented out
    header = SBATCH.read_text().split("\nset -euo pipefail", 1)[0].splitlines()
    assert "##SBATCH --partition=gpu" in header
    assert "##SBATCH --account=myproject" in header
    assert not [line for line in header if line.startswith(("#SBATCH --partition",
                                                            "#SBATCH --account"))]


# a training module that is stopped by a signal at once: it writes this run's preempted.json, exits 75
PREEMPTED_AT_ONCE = """
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
if os.environ["RANK"] == "0":
    with open(os.path.join(out, "preempted.json"), "w") as f:
        json.dump({"step": 0, "signal": "SIGUSR1", "slurm_job_id": os.environ["SLURM_JOB_ID"],
                   "slurm_restart": int(os.environ["SLURM_RESTART_COUNT"])}, f)
sys.exit(75)
"""


def test_slurms_own_sigterm_ends_the_job_without_a_requeue(staged, tmp_path):
    """At a time limit, a preemption or scancel, Slurm sends SIGTERM to the batch script and to every
    process of each step, srun included, which kills its step at once: nothing is saved, and a job
    script that requeued then would undo a scancel."""
    (tmp_path / "sleeper.py").write_text("import time\nprint('training', flush=True)\ntime.sleep(120)\n")
    env = job_env(tmp_path, staged, TRAIN_MODULE="sleeper", PYTHONPATH=str(tmp_path), MAX_RESTARTS="0")
    log = tmp_path / "out" / "logs" / "cifar10-4242-node1.out"
    stdout, stderr = signal_when(start_job(env), lambda: log.exists() and "training" in log.read_text(),
                                 [(signal.SIGTERM, "job"), (signal.SIGTERM, "step")])
    assert "SIGTERM from Slurm" in stdout and "not requeued by this script" in stderr, stdout + stderr
    assert requeues(tmp_path) == [] and not (tmp_path / "slurm" / "scancel").exists()


def test_a_job_requeued_max_requeues_times_is_not_requeued_again(staged, tmp_path):
    (tmp_path / "preempted_at_once.py").write_text(PREEMPTED_AT_ONCE)
    done = sbatch(job_env(tmp_path, staged, SLURM_RESTART_COUNT="2", MAX_REQUEUES="2", MAX_RESTARTS="0",
                          TRAIN_MODULE="preempted_at_once", PYTHONPATH=str(tmp_path)))
    assert done.returncode == 1 and "preempted (" in done.stderr, done.stdout + done.stderr
    assert "not requeued: this job has been requeued 2 times (MAX_REQUEUES=2)" in done.stderr
    assert requeues(tmp_path) == []


def training_srun(job_pid):
    """The fake srun of the job's training step (the one that runs TRAIN_MODULE)."""
    for pid in process_tree(job_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"fake_slurm/srun") for arg in argv) and b"node-task" in argv:
            return pid
    return None


# The job's training module in its requeued runs (SLURM_RESTART_COUNT 1 and 2): global rank 0 fails once
# the group has formed, before it resumes (as a bad GPU or a file system error would), in its node's
# first attempt; and in the first requeued run the save after a stop takes longer than torchrun's
# shutdown timeout (a slow shared file system).
FAULTY = """
import os, time
import utils.train_cifar10 as train

save, build_data = train.save, train.build_data

def failing_build_data(args, job):
    if job.rank == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        print("rank 0 fails before it resumes", flush=True)
        os._exit(1)
    return build_data(args, job)

def slow_save(args, training, job):
    if training.stop_signal:
        time.sleep(120)
    return save(args, training, job)

if __name__ == "__main__":
    if os.environ.get("SLURM_RESTART_COUNT") in ("1", "2"):
        train.build_data = failing_build_data
    if os.environ.get("SLURM_RESTART_COUNT") == "1":
        train.save = slow_save
    train.run()
"""


def start_job(env):
    return subprocess.Popen(["bash", str(SBATCH)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def signal_when(job, ready, signals):
    """Once ready() is true, each (signal, "job" or "step") in turn: to the batch script, or to every
    process of the training step (the fake srun passes it on to each, as Slurm sends it); then the job's
    (stdout, stderr)."""
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ready():
            assert job.poll() is None and time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        for sig, to in signals:
            os.kill(job.pid if to == "job" else training_srun(job.pid), sig)
        (stdout, stderr), = hangs.communicate([job], TIMEOUT)
    finally:
        if job.poll() is None:
            for pid in process_tree(job.pid):
                os.kill(pid, signal.SIGKILL)
    return stdout, stderr


def checkpoint_step(out):
    import torch

    return torch.load(out / "checkpoint.pt", weights_only=True)["step"]


def test_a_job_warned_restarted_and_killed_during_its_save_requeues_itself_and_trains_to_the_end(tmp_path):
    """One job's runs, with DataLoader workers (2 training, 2 test a rank) and a checkpoint every 5 steps.

    0. Slurm's warning (--signal=B:USR1@120) reaches the batch script, which passes SIGTERM to every
       process of the training step: every rank stops after one agreed step with its checkpoint, and
       the job requeues itself.
    1. Requeued (same job id, SLURM_RESTART_COUNT=1), its first attempt fails on rank 0's node before
       it resumes; torchrun restarts it and it resumes (on main, the restarted rank 0 read the
       previous run's preempted.json as its own, exited 75 at every restart, and the job failed for
       good). Then the warning again; the save after the stop cannot finish before torchrun's shutdown
       timeout, and the job is requeued anyway (on main: "training failed, not requeued").
    2. Requeued again, its first attempt fails the same way, and it restarts, resumes from the last
       complete checkpoint and trains to the end on two nodes, from node-local copies of the data, with
       a log per node and no third requeue."""
    data = stage(tmp_path / "data", train=2560)  # 40 steps an epoch: time for the signals to land
    local = tmp_path / "node-local"
    (tmp_path / "faulty_train.py").write_text(FAULTY)
    env = job_env(tmp_path, data, EPOCHS="2", LOCAL_DATA=str(local), SHUTDOWN_TIMEOUT="5",
                  TRAIN_MODULE="faulty_train", PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}",
                  TRAIN_ARGS="--device cpu --global-batch 64 --workers 2 --loader workers "
                             "--checkpoint-every 5")
    out = tmp_path / "out"

    # 0: warned once the first checkpoint (step 5) exists
    stdout, stderr = signal_when(start_job(env), (out / "checkpoint.pt").exists,
                                 [(signal.SIGUSR1, "job")])
    stopped = json.loads((out / "preempted.json").read_text())
    assert stopped["signal"] == "SIGTERM" and stopped["slurm_restart"] == 0, stdout + stderr
    # the checkpoint is the stopped step's (the ranks agree every 10 steps)
    assert stopped["step"] % 10 == 0 and checkpoint_step(out) == stopped["step"]
    assert "SIGUSR1 (the time limit is near)" in stdout and "preempted (" in stdout, stdout + stderr
    # Slurm sent SIGTERM to every process of the job's steps (not to srun: it would kill the step)
    assert (tmp_path / "slurm" / "scancel").read_text().splitlines() == ["signal TERM 4242"]
    assert requeues(tmp_path) == ["requeue 4242"] and not (out / "model_final.pt").exists()
    node1 = out / "logs" / "cifar10-4242-node1.out"
    assert f"SIGTERM: every rank stopped after step {stopped['step']}" in node1.read_text()

    # 1: requeued; signalled once it has saved a checkpoint of its own
    env1 = {**env, "SLURM_RESTART_COUNT": "1"}
    stdout, stderr = signal_when(start_job(env1), lambda: checkpoint_step(out) > stopped["step"],
                                 [(signal.SIGUSR1, "job")])
    log = node1.read_text()
    assert "rank 0 fails before it resumes" in log and (
        f"resumed from {out / 'checkpoint.pt'}: epoch {stopped['step'] // 40 + 1}, step "
        f"{stopped['step'] % 40} of the epoch") in log
    assert "SIGUSR1 (the time limit is near)" in stdout and "the save did not finish" in stdout, (
        stdout + stderr)
    assert requeues(tmp_path) == ["requeue 4242"] * 2 and not (out / "preempted.json").exists()
    last_good = checkpoint_step(out)
    assert stopped["step"] < last_good < 80 and last_good % 5 == 0

    # 2: requeued again, to the end
    done = sbatch({**env, "SLURM_RESTART_COUNT": "2"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "job 4242 (restart 2)" in done.stdout
    assert f"done: {out / 'model_final.pt'}" in done.stdout
    assert (out / "model_final.pt").exists() and not (out / "preempted.json").exists()
    assert requeues(tmp_path) == ["requeue 4242"] * 2
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["epoch"] == 2 and last["step"] == 80 and last["world_size"] == 2
    # the head node's address was looked up on the head node, and is where the ranks met
    assert "rendezvous at 127.0.0.1:" in done.stdout and "on node1;" in done.stdout
    lookup, copy, training = srun_calls(tmp_path)[-3:]  # this run's
    assert "-w node1 bash -c" in lookup and "hostname --ip-address" in lookup
    # each node's torchrun is reached at its own address (every fake node's: 127.0.0.1)
    assert "--local-addr=\"$local_addr\"" in training.replace("\\", "")
    assert "--ntasks-per-node=1" in copy and (local / "cifar-10-batches-py").is_dir()
    # the job's --cpus-per-task reaches each task (Slurm >= 22.05 needs SRUN_CPUS_PER_TASK for it)
    assert training.startswith("cpus-per-task=3 ") and "--kill-on-bad-exit=0 --wait=35" in training
    logs = out / "logs"
    node1, node2 = ((logs / f"cifar10-4242-{node}.out").read_text() for node in ("node1", "node2"))
    assert "== node1: node 0 of 2, job 4242, 3 CPUs" in node1
    assert "== node2: node 1 of 2, job 4242, 3 CPUs" in node2
    # in runs 1 and 2 (the log appends)
    assert node1.count("rank 0 fails before it resumes") == 2
    # rank 0 (on the head node) logs; the data came from the node-local copy
    assert f"resumed from {out / 'checkpoint.pt'}: epoch {last_good // 40 + 1}, step {last_good % 40} " in node1
    assert f"synthetic CIFAR-10 in {local}:" in node1 and "2 process(es), cpu, gloo" in node1
