"""`make gpu-check`: the CUDA paths of the book, checked on every local GPU, with a
results file.

    python -m utils.gpu_check                # the checks below, then the results file
    python -m utils.gpu_check --make-test    # ... and `make test` on this machine too

On a machine with CUDA it runs, and records in ``book/results/gpu_check_<gpu>.json``
(hardware, driver, torch, CUDA, cuDNN and NCCL versions, the command, the date, every
check's result):

1. ``collectives``: ``sum_over_ranks``, ``gather_by_index``, ``NaiveDDP``,
   ``BucketedDDP`` (several buckets) and ``utils.ddp.SyncBatchNorm`` on CUDA tensors
   under ``nccl``, one rank per GPU, each compared with the same computation done on
   one process;
2. ``training``: ``utils.train_cifar10`` under ``torchrun`` on all GPUs with ``nccl``,
   ResNet-18, ``--amp``, ``--sync-bn`` and checkpoints, once uninterrupted and once with
   a rank killed mid-epoch and restarted by ``torchrun --max-restarts=1``; with
   ``--deterministic`` (deterministic algorithms, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
   DDP buckets that stay fixed) the two must end bit-identical; the file names the ops
   that had no deterministic kernel; plus images/s of a third run
   without ``--deterministic``;
3. ``make test`` (with ``--make-test``).

It exits 1 if a check fails. Without CUDA it says so and exits 0: there is nothing to
check. The collective checks are plain functions, also run on the CPU with gloo
by ``tests/test_gpu_check.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- 1. collectives on the group's device ---------------------------------------------

def _tiny_net(device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 3)).to(device)


def collective_checks(device_type: str) -> dict[str, bool]:
    """Run on every rank of an initialised group; ``device_type`` is where the data
    lives ("cuda" or "cpu")."""
    from .ddp import BucketedDDP, NaiveDDP, SyncBatchNorm
    from .metrics import gather_by_index, sum_over_ranks

    rank, world = dist.get_rank(), dist.get_world_size()
    device = (torch.device(device_type, torch.cuda.current_device())
              if device_type == "cuda" else torch.device("cpu"))
    results = {}

    total, count = sum_over_ranks(rank + 1, 1)
    results["sum_over_ranks"] = (total, count) == (world * (world + 1) / 2, world)

    n = 10 * world + 3  # uneven shards
    mine = torch.arange(rank, n, world, device=device)
    gathered = gather_by_index(mine, (mine * 2).float(), n)
    results["gather_by_index"] = gathered.device == device and torch.equal(
        gathered, torch.arange(n, device=device).float() * 2)

    # DDP wrappers: gradients of a rank's shard, averaged, equal the full batch's
    # gradient on one process
    g = torch.Generator().manual_seed(1)
    x_all, y_all = (torch.randn(16 * world, 8, generator=g),
                    torch.randint(0, 3, (16 * world,), generator=g))
    x, y = x_all[rank::world].to(device), y_all[rank::world].to(device)
    reference = _tiny_net(device)
    nn.functional.cross_entropy(reference(x_all.to(device)),
                                y_all.to(device)).backward()
    for name, wrap in (("NaiveDDP", NaiveDDP),
                       ("BucketedDDP", lambda m: BucketedDDP(m, bucket_cap_mb=0.004))):
        model = wrap(_tiny_net(device))
        nn.functional.cross_entropy(model(x), y).backward()
        close = all(torch.allclose(p.grad, q.grad, atol=1e-5)
                    for p, q in zip(model.module.parameters(), reference.parameters()))
        buckets = len(getattr(model, "buckets", [None]))
        results[name] = close and (name == "NaiveDDP" or buckets > 1)

    # SyncBatchNorm: the global batch's statistics, as BatchNorm2d on all of it
    torch.manual_seed(2)
    images = torch.randn(4 * world, 5, 6, 6).to(device)
    synced, plain = SyncBatchNorm(5).to(device), nn.BatchNorm2d(5).to(device)
    out = synced(images[rank * 4:(rank + 1) * 4])
    expected = plain(images)[rank * 4:(rank + 1) * 4]
    results["SyncBatchNorm"] = (
        out.device == device and torch.allclose(out, expected, atol=1e-4)
        and torch.allclose(synced.running_var, plain.running_var, atol=1e-4))
    return results


# --- 2. the training script under torchrun --------------------------------------------

def _torchrun(nproc: int, script_args: list[str], extra: list[str] = (),
              timeout: float = 1800) -> tuple[int, str, str]:
    """Run the script under torchrun in its own session, so that a timeout can stop
    every worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *extra,
           "-m", "utils.train_cifar10", *script_args]
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        # torchrun and all its workers: nothing keeps the GPUs
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -9, out, err + f"\n(gpu-check: stopped after {timeout:g} s)"


def training_checks(nproc: int, work: str) -> dict:
    """Uninterrupted vs killed-and-restarted (bit-identical under --deterministic),
    and images/s."""
    data = os.path.join(work, "data")
    global_batch = 128 * nproc  # splits evenly over any number of GPUs
    common = ["--data", data, "--synthetic", "--synthetic-size", str(40 * global_batch),
              "2048", "--model", "resnet18", "--amp", "--sync-bn", "--epochs", "2",
              "--global-batch", str(global_batch), "--workers", "4", "--no-progress",
              "--checkpoint-every", "10", "--device", "cuda"]
    runs = {}
    for name, extra_args, extra_launch in (
        ("uninterrupted", ["--deterministic"], []),
        ("killed_and_restarted",
         ["--deterministic", "--resume", "--fail-at-step", "25"], ["--max-restarts=1"]),
        ("speed", [], []),
    ):
        out = os.path.join(work, name)
        t0 = time.perf_counter()
        code, stdout, stderr = _torchrun(nproc, common + ["--out", out] + extra_args,
                                         extra_launch)
        runs[name] = {"returncode": code, "seconds": round(time.perf_counter() - t0, 1),
                      "resumed": "resumed from" in stdout,
                      "stdout_tail": stdout[-1500:],
                      "stderr_tail": stderr[-1500:] if code else "",
                      # ops that ran without a deterministic kernel (torch warns and
                      # names them)
                      "nondeterministic_ops": sorted(set(re.findall(
                          r"(\S+) does not have a deterministic", stderr)))}
        metrics = os.path.join(out, "metrics.jsonl")
        if os.path.exists(metrics):
            with open(metrics) as f:
                runs[name]["metrics"] = [json.loads(line) for line in f]
    pair = ("uninterrupted", "killed_and_restarted")
    identical, max_abs_diff = False, None
    if all(runs[n]["returncode"] == 0 for n in pair):
        a, b = (torch.load(os.path.join(work, n, "model_final.pt"), weights_only=True)
                for n in pair)
        identical = all(torch.equal(a[k], b[k]) for k in a)
        max_abs_diff = max(float((a[k].double() - b[k].double()).abs().max())
                           for k in a)
    speed = runs["speed"].get("metrics", [{}])[-1].get("images_per_s")
    return {"command": "torchrun --standalone --nproc_per_node=%d "
                       "-m utils.train_cifar10 %s" % (nproc, " ".join(common)),
            "runs": runs,
            "restarted_run_resumed": runs["killed_and_restarted"]["resumed"],
            "bit_identical_after_restart": identical,
            "max_abs_diff_after_restart": max_abs_diff,
            "train_images_per_s_last_epoch": speed,
            "passed": (identical and runs["killed_and_restarted"]["resumed"]
                       and runs["speed"]["returncode"] == 0)}


# --- the check as a whole -------------------------------------------------------------

def environment() -> dict:
    props = [torch.cuda.get_device_properties(i)
             for i in range(torch.cuda.device_count())]
    driver = ""
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                "--format=csv,noheader"],
                               capture_output=True, text=True)
        driver = (query.stdout.strip().splitlines()[0]
                  if query.returncode == 0 and query.stdout.strip() else "")
    return {"gpus": [p.name for p in props],
            "gpu_memory_gib": [round(p.total_memory / 2**30, 1) for p in props],
            "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "nccl": (".".join(map(str, torch.cuda.nccl.version()))
                     if dist.is_nccl_available() else None),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "platform": platform.platform()}


def main(argv=None) -> int:
    # the docstring's first paragraph (argparse re-flows it onto one line)
    p = argparse.ArgumentParser(prog="python -m utils.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "book", "results"),
                   help="folder for the results file")
    p.add_argument("--make-test", action="store_true",
                   help="also run `make test` and record its result")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: torch.cuda.is_available() is False on this machine; "
              "there is no CUDA path to check "
              "(`make test` covers the CPU). Nothing written.")
        return 0
    from .launch import run_distributed

    nproc = torch.cuda.device_count()
    report = {"check": "make gpu-check",
              "command": " ".join([os.path.basename(sys.executable), "-m",
                                   "utils.gpu_check",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              "environment": environment(), "world_size": nproc, "checks": {}}
    print(f"gpu-check on {nproc} x {report['environment']['gpus'][0]}", flush=True)
    try:
        per_rank = run_distributed(collective_checks, nproc, "cuda", backend="nccl",
                                   device="cuda", timeout=600)
        report["checks"]["collectives"] = {
            "per_rank": per_rank, "passed": all(all(r.values()) for r in per_rank)}
    except Exception as exc:  # recorded, not hidden: the file says what failed
        report["checks"]["collectives"] = {
            "error": f"{type(exc).__name__}: {exc}"[:3000], "passed": False}
    print("collectives:", report["checks"]["collectives"].get("passed"), flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        try:
            report["checks"]["training"] = training_checks(nproc, work)
        except Exception as exc:
            # recorded in the file, which is written whatever happens
            report["checks"]["training"] = {
                "error": f"{type(exc).__name__}: {exc}"[:3000], "passed": False}
    print("training:", report["checks"]["training"]["passed"], flush=True)
    if args.make_test:
        t0 = time.perf_counter()
        done = subprocess.run(["make", "test"], cwd=ROOT, capture_output=True,
                              text=True)
        summary = [line for line in (done.stdout + done.stderr).splitlines()
                   if re.search(r"\d+ (passed|failed)", line)]
        report["checks"]["make_test"] = {
            "returncode": done.returncode, "summary": summary[-4:],
            "minutes": round((time.perf_counter() - t0) / 60, 1),
            "passed": done.returncode == 0,
            "tail": ("" if done.returncode == 0
                     else (done.stdout + done.stderr)[-3000:])}
        print("make test:", report["checks"]["make_test"]["passed"], flush=True)
    report["passed"] = all(c["passed"] for c in report["checks"].values())
    slug = re.sub(r"[^a-z0-9]+", "_",
                  report["environment"]["gpus"][0].lower()).strip("_")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu_check_{slug}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"{'PASSED' if report['passed'] else 'FAILED'}; results in {path}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
