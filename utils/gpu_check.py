"""`make gpu-check`: the CUDA paths of the book, checked on every local GPU, with a
results file.

    python -m utils.gpu_check --quick        # the checks worth most: 6 min on one GPU
    python -m utils.gpu_check                # the full profile
    python -m utils.gpu_check --make-test    # ... and `make test` on this machine too
    python -m utils.gpu_check --quick --dry-run    # the plan and its timings only
    python -m utils.gpu_check --quick --rehearse   # the same plan on this CPU

It runs as it is, from a clone of the book, with the Python and torch (2.4 or later)
already on a CUDA machine: no ``.venv``, no network (``make gpu-check`` uses ``.venv``).
Without a GPU it exits 1 and says so (``--allow-no-gpu``: exit 0); where ``nvidia-smi``
lists GPUs that torch cannot use (a driver older than torch's CUDA, a container started
without its GPUs), it exits 1 and says that. Results go to
``book/results/gpu_check_[quick_]<gpu>.json``: hardware, driver, torch, CUDA, cuDNN and
NCCL versions, the command, the date, the commit, every check's result and seconds, and
``not_checked``: what this machine could not check, and why.

``--quick``, in order of what each is worth (``QUICK``; one process stops at
``QUICK_RUN_TIMEOUT``):

1. ``collectives``: ``sum_over_ranks``, ``gather_by_index``, ``NaiveDDP``,
   ``BucketedDDP`` (several buckets) and ``utils.ddp.SyncBatchNorm`` on CUDA tensors
   under ``nccl``, one rank per GPU, each compared with the same computation done on
   one process;
2. ``loader_no_sync``: the GPU loader's batches equal its CPU batches, and no epoch
   and no public augmentation function makes the host wait for the GPU
   (``torch.cuda.set_sync_debug_mode("error")``);
3. ``capstone``: ``utils.train_cifar10`` under ``torchrun`` on all GPUs (ResNet-18,
   synthetic data, 2 epochs of 40 steps, no SyncBN) in float32, and with bf16 autocast
   once uninterrupted and once with a rank killed mid-epoch and restarted by
   ``torchrun --max-restarts=1``: with ``--deterministic`` the two must end
   bit-identical;
4. ``loader_bench``: ``python -m utils.bench loader --quick`` on the GPU (chapter 14's
   loaders, the GPU-resident one among them);
5. ``throughput``: ``utils.step_bench``: the script's own epoch loop against a bare
   DDP loop in the same processes, over the same batches (no SyncBN, no mid-epoch
   checkpoint), in ABBA order, each loop's GPU-busy share, and the GPU-bound ceiling;
6. ``compiled_step``: the same with ``--compile --compile-mode reduce-overhead`` (CUDA
   graphs), without the ceiling;
7. ``scripts_speed``: what a reader may expect of the book's two training scripts,
   ``examples/train_ddp.py`` and ``utils.train_cifar10 --amp``, under ``torchrun`` on
   one GPU and on all (ResNet-18, 50,000 synthetic images): the seconds and images/s
   of their second epoch (``python -m utils.expected_results`` shows them).

The full profile adds, on the same runs' settings with SyncBN: ``training`` (the
restart pair with ``--sync-bn`` and checkpoints, and a run without
``--deterministic``), ``loader_workers`` (the pair with ``--loader workers``:
DataLoader workers, pinned memory), ``compile`` (a ``--compile`` run, not checked where
``torch.compile`` cannot work: no Triton, C compiler or ``Python.h``, an unsupported
Python), ``amp_fp16`` (the pair with ``--amp fp16``, whose gradient scaler the
checkpoint must hold), and on 2 GPUs or more ``resume_on_fewer_gpus`` (stopped on all
GPUs, resumed on fewer: compared within ``tolerance``) and ``two_nodes`` (two
torchruns as two nodes, static rendezvous on 127.0.0.1, the GPUs split with
``CUDA_VISIBLE_DEVICES``). Every check: ``nondeterministic_ops``, each op that warned
it has no deterministic kernel in a ``--deterministic`` run (any op not in
``ALLOWED_NONDETERMINISTIC_OPS`` fails); ``--deterministic`` pairs pin NCCL's algorithm
(``pinned_nccl``).

On one GPU nothing runs over several ranks, and ``not_checked`` says so. It exits 1 if
a check fails. The checks are plain functions that also run on the CPU with gloo
(``device="cpu"``: a small CNN): ``--rehearse`` runs the chosen plan so, with the same
timeouts, and ``tests/test_gpu_check.py`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from . import results

# what the checks import beyond torch: {module: pip name} (the training runs pass
# --no-progress, so tqdm is not needed); main() stops first, naming any that is missing
NEEDED = {"cloudpickle": "cloudpickle", "psutil": "psutil", "numpy": "numpy",
          "torchvision": "torchvision", "PIL": "pillow"}
try:
    from .hangs import kill_tree, python_stacks
    from .launch import free_port
except ModuleNotFoundError as missing:  # main()'s require_packages() names it
    if missing.name not in NEEDED:
        raise
    kill_tree = python_stacks = free_port = None


def require_packages(needed: dict[str, str] = NEEDED) -> None:
    """Stop with one line naming the ``needed`` packages that cannot be imported."""
    import importlib

    missing = []
    for module, pip_name in needed.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(pip_name)
    if missing:
        python = os.path.basename(sys.executable)
        sys.exit(f"gpu-check: error: missing {', '.join(missing)}; install them with: "
                 f"{python} -m pip install {' '.join(missing)}")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the checks run (utils.results records their hashes in the results file)
SOURCES = ["utils/gpu_check.py", *results.package_sources("utils/train_cifar10"),
           "utils/gpu_loader.py", "utils/step_bench.py", "utils/loader_bench.py",
           "utils/ddp.py", "utils/metrics.py", "utils/launch.py", "utils/samplers.py",
           "utils/workers.py", "examples/train_ddp.py"]
RUN_TIMEOUT = 600  # seconds for one torchrun (the runs take well under a minute)
FAILED_NODE_GRACE = 60  # seconds a node may run on after the other one failed
# relative_distance below which a run resumed on fewer GPUs, or run as two nodes,
# counts as the same training as the uninterrupted run: summing in another order ends
# ~1e-3 away on the CPU (tests/test_train_cifar10.py), a run that sees other
# augmentations of the same images ~0.9 away. Used where no run-to-run noise was
# measured (``tolerance``): on a GPU the full profile measures it (the distance between
# two runs that differ only by --deterministic, the noise of the kernels without fixed
# bits) and allows NOISE_FACTOR times that.
RESUME_TOLERANCE = 0.05
NOISE_FACTOR = 4
# ops that may warn "... does not have a deterministic implementation" in a
# --deterministic run without failing the check: {op name: why it is tolerated}.
# Empty: no op is known to need it (the script replaced AdaptiveAvgPool2d, whose CUDA
# backward had none); a new one fails the check until it is understood and listed.
ALLOWED_NONDETERMINISTIC_OPS: dict[str, str] = {}


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


def collectives_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """``collective_checks`` on one nccl rank per GPU (``device="cpu"``: gloo ranks)."""
    from .launch import run_distributed

    per_rank = run_distributed(collective_checks, nproc, device,
                               backend="nccl" if device == "cuda" else "gloo",
                               device=device, timeout=RUN_TIMEOUT)
    return {"backend": "nccl" if device == "cuda" else "gloo", "per_rank": per_rank,
            "passed": len(per_rank) == nproc and all(all(r.values()) for r in per_rank)}


def loader_sync(device: str) -> dict:
    """The GPU loader on ``device``: its batches equal the same loader's on the CPU,
    and on CUDA neither an epoch nor any public augmentation function makes the host
    wait for the GPU (``torch.cuda.set_sync_debug_mode("error")`` turns any such wait
    into an error). Run in a process of its own (``loader_sync_check``)."""
    from .gpu_loader import GPULoader, augment_batch, augment_draws, reference_augment

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (75, 32, 32, 3), dtype=torch.uint8, generator=g)
    labels = torch.arange(75)  # label = index
    cpu = GPULoader(data, labels, 16, seed=1, channels_last=True)
    on = GPULoader(data, labels, 16, seed=1, channels_last=True, device=device)
    cpu.set_epoch(2)
    on.set_epoch(2)
    cuda = torch.device(device).type == "cuda"
    images, index = data.to(device), torch.arange(5, device=device)
    augment_batch(images, index, 0, 0)  # the first call makes the constants: a copy
    error = None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = [(x, y) for x, y in on]
        for dtype in (torch.float32, torch.bfloat16):  # every public function
            augment_batch(images, index, 0, 0, keys=index, dtype=dtype)
            augment_draws(0, 0, index)
        augment_batch(images, torch.arange(5), 0, 0)  # CPU indices: a pinned copy
        reference_augment(images[0], 0, 0, 0)
    except RuntimeError as exc:  # "called a synchronizing CUDA operation"
        error, got = f"{type(exc).__name__}: {exc}"[:2000], []
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    expected = [(x.clone(), y.clone()) for x, y in cpu]
    equal = len(got) == len(expected) > 0 and all(
        torch.equal(y, gy.cpu()) and torch.allclose(x, gx.cpu(), atol=1e-6, rtol=0)
        for (x, y), (gx, gy) in zip(expected, got))
    return {"device": device, "batches": len(got), "host_syncs_checked": cuda,
            "host_sync_error": error, "batches_equal_cpu": equal,
            # the same arithmetic on the CPU and on a GPU: the same bits?
            "bit_identical_cpu": equal and all(
                torch.equal(x, gx.cpu()) for (x, _), (gx, _) in zip(expected, got)),
            "passed": equal and error is None}


def loader_sync_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """``loader_sync`` in a fresh process (the GPU set up there, not in this one)."""
    code = ("import json, sys; from utils.gpu_check import loader_sync; "
            "print(json.dumps(loader_sync(sys.argv[1])))")
    returncode, stdout, stderr = _run_processes(
        [([sys.executable, "-c", code, device], {})])[0]
    lines = stdout.strip().splitlines()
    result = json.loads(lines[-1]) if returncode == 0 and lines else {"passed": False}
    return {**result, "returncode": returncode,
            "stderr_tail": stderr[-1500:] if returncode else ""}


# --- 2. torchrun: command lines and processes -----------------------------------------

def torchrun_command(nproc: int, script_args: list[str],
                     launch: list[str] = ("--standalone",),
                     module: str = "utils.train_cifar10") -> list[str]:
    """The torchrun command line of ``module`` (the training script; a path ending in
    ``.py``: that file); ``launch``: torchrun's options besides ``--nproc_per_node``."""
    target = [module] if module.endswith(".py") else ["-m", module]
    return [sys.executable, "-m", "torch.distributed.run", *launch,
            f"--nproc_per_node={nproc}", *target, *script_args]


def visible_devices(env: dict, count: int) -> list[str]:
    """The first ``count`` GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names
    them (indices or UUIDs) for child processes: the parent's own list if it has one,
    so a check started on GPUs 4-7 splits GPUs 4-7."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    names = ([d.strip() for d in given.split(",") if d.strip()] if given
             else [str(i) for i in range(count)])
    return names[:count]


def gpus_per_node(nproc: int, global_batch: int) -> int | None:
    """GPUs per node for two nodes made of ``nproc`` GPUs: as many as an even split
    allows, with ``global_batch`` splitting evenly over all of them (``None``: below 2
    GPUs). 7 GPUs and a global batch of 896: 2 nodes of 2 (3 + 3 would be 6 ranks,
    which 896 does not split over)."""
    return next((k for k in range(nproc // 2, 0, -1) if global_batch % (2 * k) == 0),
                None)


def fewer_gpus(nproc: int, global_batch: int) -> int | None:
    """The most GPUs below ``nproc`` that ``global_batch`` splits evenly over
    (``None`` on one GPU): 8 GPUs, global batch 1024: 4."""
    return next((m for m in range(nproc - 1, 0, -1) if global_batch % m == 0), None)


def two_node_launches(devices: list[str], per_node: int, port: int,
                      node_args: list[list[str]]) -> list[tuple[list[str], dict]]:
    """``(command, environment)`` of each of two torchruns that form one job of
    ``2 x per_node`` ranks: static rendezvous on 127.0.0.1:``port``, node 0 (global
    ranks 0 to per_node-1) on the first ``per_node`` of ``devices``, node 1 on the
    next; ``node_args[i]``: node i's script arguments."""
    launches = []
    for node in (0, 1):
        launch = ["--nnodes=2", f"--node-rank={node}", "--master-addr=127.0.0.1",
                  f"--master-port={port}"]
        mine = devices[node * per_node:(node + 1) * per_node]
        launches.append((torchrun_command(per_node, node_args[node], launch),
                         {"CUDA_VISIBLE_DEVICES": ",".join(mine)}))
    return launches


def _run_processes(launches: list[tuple[list[str], dict]],
                   timeout: float | None = None) -> list[tuple[int, str, str]]:
    """Start every ``(command, environment)`` at once and wait for all:
    ``(returncode, stdout, stderr)`` each. At the timeout, or ``FAILED_NODE_GRACE``
    seconds after one of them failed (a node whose partner died waits for it), each
    one still running is killed with all its descendants (torchrun, its ranks, their
    workers: nothing keeps the GPUs). Output goes to files: a pipe left unread while
    another process is waited for could fill and stall a node that the other one
    waits for."""
    timeout = RUN_TIMEOUT if timeout is None else timeout
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
             for _ in launches]
    procs, killed = [], {}
    try:
        for (cmd, env), (out, err) in zip(launches, files):
            procs.append(subprocess.Popen(
                cmd, stdout=out, stderr=err, text=True, cwd=ROOT,
                env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                     # utils importable wherever it runs: no install needed
                     "PYTHONPATH": os.pathsep.join(
                         [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
                     **env}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() for p in procs):  # one failed: the others would wait for
                deadline = min(deadline, time.monotonic() + FAILED_NODE_GRACE)  # it
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                killed[proc.pid] = python_stacks(proc.pid)  # where it hung
                kill_tree(proc.pid)
            proc.wait()
    results = []
    for proc, (out, err) in zip(procs, files):
        out.seek(0), err.seek(0)
        note = ("\n(gpu-check: stopped, still running at the time limit; every "
                f"process's stack then:)\n{killed[proc.pid]}"
                if proc.pid in killed else "")
        results.append((proc.returncode, out.read(), err.read() + note))
        out.close(), err.close()
    return results


def _torchrun(nproc: int, script_args: list[str], extra: list[str] = (),
              timeout: float | None = None, env: dict | None = None,
              module: str = "utils.train_cifar10") -> tuple[int, str, str]:
    """One torchrun of ``module`` on this node (``--standalone``); ``extra``: more
    torchrun options; ``env``: more environment."""
    command = torchrun_command(nproc, script_args, ["--standalone", *extra], module)
    return _run_processes([(command, env or {})], timeout)[0]


def pinned_nccl(args: list[str]) -> dict:
    """The environment of a ``--deterministic`` run: NCCL's algorithm and protocol
    pinned (Ring, Simple), so that two runs sum gradients in the same order whatever
    NCCL's tuner would pick; a value already set here is kept. ``{}`` otherwise."""
    if "--deterministic" not in args:
        return {}
    return {"NCCL_ALGO": os.environ.get("NCCL_ALGO", "Ring"),
            "NCCL_PROTO": os.environ.get("NCCL_PROTO", "Simple")}


# --- 3. runs, their records and their weights -----------------------------------------

NO_DETERMINISTIC_KERNEL = " does not have a deterministic implementation"


def nondeterministic_ops(text: str) -> list[str]:
    """The ops that warned they ran without a deterministic kernel, as torch names them
    (``use_deterministic_algorithms(True, warn_only=True)``), from a run's stderr:
    ``...: UserWarning: <op> does not have a deterministic implementation, but ...``,
    whatever prefix torchrun or C++ puts before ``Warning:``."""
    ops = set()
    for line in text.splitlines():
        head, found, _ = line.partition(NO_DETERMINISTIC_KERNEL)
        if found:
            ops.add(head.rpartition("Warning: ")[2].strip())
    return sorted(ops)


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _with(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (``--data``, ``--amp``); a bare flag
    gets the value."""
    i = args.index(flag)
    bare = i + 1 == len(args) or args[i + 1].startswith("--")
    return args[:i + 1] + [value] + args[i + 1 + (not bare):]


def _without(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value."""
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def common_args(nproc: int, work: str, device: str = "cuda",
                sync_bn: bool = True) -> list[str]:
    """The script's arguments shared by every run on ``nproc`` GPUs: ResNet-18, bf16
    autocast, SyncBatchNorm (unless ``sync_bn=False``), synthetic data, 2 epochs of 40
    steps of 128 images per GPU. ``device="cpu"``: a small CNN on gloo ranks, 2 epochs
    of 8 steps of 32 images per rank (the tests, ``--rehearse``)."""
    cuda = device == "cuda"
    per_rank, steps = (128, 40) if cuda else (32, 8)
    global_batch = per_rank * nproc  # splits evenly over any number of GPUs
    return ["--data", os.path.join(work, "data"), "--synthetic", "--synthetic-size",
            str(steps * global_batch), "2048" if cuda else "256",
            "--model", "resnet18" if cuda else "simplecnn",
            *(["--amp"] if cuda else []), *(["--sync-bn"] if cuda and sync_bn else []),
            "--epochs", "2",
            "--global-batch", str(global_batch), "--workers", "4" if cuda else "0",
            "--no-progress", "--checkpoint-every", str(steps // 4), "--device", device]


def _steps_per_epoch(args: list[str]) -> int:
    return int(_arg(args, "--synthetic-size")) // int(_arg(args, "--global-batch"))


def break_step(args: list[str]) -> int:
    """Where runs are killed or stopped: 5/8 into the first epoch (step 25 of 40),
    after a checkpoint (every 10 steps)."""
    return _steps_per_epoch(args) * 5 // 8


def run_record(args: list[str], code: int, stdout: str, stderr: str,
               seconds: float, out: str) -> dict:
    """What the results file keeps of one run: its exit status, whether it resumed,
    the ops without a deterministic kernel, its metrics lines, the ends of its
    output."""
    record = {"returncode": code, "seconds": round(seconds, 1),
              "deterministic": "--deterministic" in args,
              "resumed": "resumed from" in stdout,
              # rank 0's lines on the split of the global batch, the loader,
              # channels_last and compile
              "setup": [line for line in stdout.splitlines()
                        if "; global batch " in line or line.startswith("loader: ")],
              "nondeterministic_ops": nondeterministic_ops(stderr),
              "stdout_tail": stdout[-1500:],
              "stderr_tail": stderr[-1500:] if code else ""}
    if pinned_nccl(args):
        record["nccl_pinned"] = pinned_nccl(args)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            record["metrics"] = [json.loads(line) for line in f]
    return record


def _train(work: str, name: str, args: list[str], nproc: int,
           extra: list[str] = ()) -> dict:
    """One torchrun of the script with its output in ``work/name``; its record."""
    out = os.path.join(work, name)
    t0 = time.perf_counter()
    code, stdout, stderr = _torchrun(nproc, args + ["--out", out], extra,
                                     env=pinned_nccl(args))
    return run_record(args, code, stdout, stderr, time.perf_counter() - t0, out)


def final_weights(work: str, name: str) -> dict | None:
    path = os.path.join(work, name, "model_final.pt")
    return torch.load(path, weights_only=True) if os.path.exists(path) else None


def compare_weights(a: dict, b: dict, model: str, seed: int = 0) -> dict:
    """``bit_identical``, ``max_abs_diff`` and ``relative_distance``: ``||a - b||`` over
    the floating-point tensors, as a fraction of how far training moved ``a`` from the
    initial weights (the script's: ``torch.manual_seed(seed)``, then ``make_model``),
    as tests/test_train_cifar10.py measures it."""
    from .train_cifar10 import make_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init = make_model(model).state_dict()
    keys = [k for k in init if init[k].is_floating_point()]

    def distance(x: dict, y: dict) -> float:  # over all the tensors, as one vector
        return math.sqrt(sum(
            float(torch.linalg.vector_norm(x[k].float() - y[k].float())) ** 2
            for k in keys))

    return {"bit_identical": a.keys() == b.keys()
            and all(torch.equal(a[k], b[k]) for k in a),
            "max_abs_diff": max(float((a[k].float() - b[k].float()).abs().max())
                                for k in keys),
            "relative_distance": distance(a, b) / distance(a, init)}


def _finished(record: dict, epochs: int) -> bool:
    """Exit status 0 and a finite training loss in a metrics line per epoch."""
    metrics = record.get("metrics", [])
    return (record["returncode"] == 0 and len(metrics) == epochs
            and all(math.isfinite(m["train_loss"]) for m in metrics))


# --- 4. the training checks -----------------------------------------------------------

def restart_pair(work: str, args: list[str], nproc: int, prefix: str = "") -> dict:
    """``args`` (with ``--deterministic``) run uninterrupted, then with the last rank
    killed at ``break_step`` and restarted by ``torchrun --max-restarts=1``: the second
    must resume from its checkpoint and end bit-identical to the first."""
    names = (f"{prefix}uninterrupted", f"{prefix}killed_and_restarted")
    runs = {names[0]: _train(work, names[0], args, nproc),
            names[1]: _train(work, names[1], args + ["--resume", "--fail-at-step",
                                                     str(break_step(args))],
                             nproc, ["--max-restarts=1"])}
    identical, max_abs_diff = False, None
    if all(runs[n]["returncode"] == 0 for n in names):
        a, b = (final_weights(work, n) for n in names)
        compared = compare_weights(a, b, _arg(args, "--model"))
        identical, max_abs_diff = (compared["bit_identical"],
                                   compared["max_abs_diff"])
    return {"runs": runs, "restarted_run_resumed": runs[names[1]]["resumed"],
            "bit_identical_after_restart": identical,
            "max_abs_diff_after_restart": max_abs_diff,
            "passed": identical and runs[names[1]]["resumed"]}


def _loaders(runs: dict) -> list[str]:
    """The training loaders the runs' metrics lines name (``gpu``, ``workers``)."""
    return sorted({m.get("loader") for r in runs.values()
                   for m in r.get("metrics", [])})


def training_checks(nproc: int, work: str, device: str = "cuda") -> dict:
    """Uninterrupted vs killed-and-restarted (bit-identical under --deterministic),
    and images/s of a run without --deterministic."""
    common = common_args(nproc, work, device)
    result = restart_pair(work, common + ["--deterministic"], nproc)
    speed = result["runs"]["speed"] = _train(work, "speed", common, nproc)
    noise = None
    if speed["returncode"] == 0 and result["max_abs_diff_after_restart"] is not None:
        noise = compare_weights(final_weights(work, "speed"),
                                final_weights(work, "uninterrupted"),
                                _arg(common, "--model"))["relative_distance"]
    return {"command": " ".join(["torchrun --standalone",
                                 f"--nproc_per_node={nproc}",
                                 "-m utils.train_cifar10", *common]),
            **result, "loaders": _loaders(result["runs"]),
            # how far kernels without fixed bits move the weights (no --deterministic)
            "relative_distance_speed_run_to_deterministic": noise,
            # not the speed of training: SyncBN's syncs and checkpoints are in it
            # (the throughput check measures that)
            "images_per_s_last_epoch_with_sync_bn_and_checkpoints":
                (speed.get("metrics") or [{}])[-1].get("images_per_s"),
            "passed": result["passed"] and speed["returncode"] == 0}


def loader_workers_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """The restart pair with ``--loader workers``: DataLoader worker processes and
    pinned host memory feeding the GPUs."""
    args = common_args(nproc, work, device) + ["--loader", "workers", "--deterministic"]
    result = restart_pair(work, args, nproc, "workers_")
    loaders = _loaders(result["runs"])
    return {**result, "loaders": loaders,
            "passed": result["passed"] and loaders == ["workers"]}


def amp_fp16_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """The restart pair with ``--amp fp16``: bit-identical only if the checkpoint
    holds the gradient scaler (its scale, and when it next grows), which it must."""
    args = _with(common_args(nproc, work, device), "--amp", "fp16")
    result = restart_pair(work, args + ["--deterministic"], nproc, "fp16_")
    checkpoint = os.path.join(work, "fp16_killed_and_restarted", "checkpoint.pt")
    state = (torch.load(checkpoint, map_location="cpu", weights_only=True)
             if os.path.exists(checkpoint) else {})
    scaler = state.get("scaler") or {}
    return {**result, "checkpoint_keys": sorted(state),
            "scaler_in_checkpoint": {k: v for k, v in scaler.items()
                                     if isinstance(v, (int, float))},
            "passed": result["passed"] and bool(scaler)}


def compile_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """One ``--compile`` run: it ends, with a finite loss every epoch; how far it ends
    from the same run not compiled (``speed``, where the training check left it) is
    recorded, not judged: compiled kernels round differently."""
    common = common_args(nproc, work, device)
    run = _train(work, "compiled", common + ["--compile"], nproc)
    compiled, plain = final_weights(work, "compiled"), final_weights(work, "speed")
    distance = (compare_weights(compiled, plain, _arg(common, "--model"))
                ["relative_distance"] if compiled and plain else None)
    return {"runs": {"compiled": run},
            "relative_distance_to_uncompiled_run": distance,
            "passed": (_finished(run, int(_arg(common, "--epochs")))
                       and any("compile: yes" in line for line in run["setup"]))}


def capstone_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """The quick profile's training check: the script on all GPUs without SyncBN, once
    in float32 (no ``--amp``) and as the restart pair with bf16 autocast
    (``--deterministic``): a rank killed mid-epoch, restarted by torchrun, must end
    bit-identical to the uninterrupted run."""
    amp = common_args(nproc, work, device, sync_bn=False)
    fp32 = [a for a in amp if a != "--amp"]  # on the CPU there is no --amp: the same
    result = restart_pair(work, amp + ["--deterministic"], nproc, "amp_")
    run = result["runs"]["fp32"] = _train(work, "fp32", fp32, nproc)
    epochs = int(_arg(amp, "--epochs"))
    return {"command": " ".join(torchrun_command(nproc, amp)[1:]).replace(
                "-m torch.distributed.run", "torchrun"),
            **result, "amp": "bf16" if "--amp" in amp else None,
            "loaders": _loaders(result["runs"]),
            "fp32_finished": _finished(run, epochs),
            "passed": result["passed"] and _finished(run, epochs)}


LOADER_BENCH_CPU = ["--workers", "0", "--n-train", "1024", "--pass-images", "512",
                    "--repeats", "1"]  # --rehearse: the quick benchmark, smaller


def loader_bench_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """``python -m utils.bench loader --quick`` on ``device``: every loader of chapter
    12 timed in one run; the whole result is kept."""
    path = os.path.join(work, "loader_bench.json")
    command = [sys.executable, "-m", "utils.bench", "loader", "--quick", "--device",
               device, "--out", path, *(LOADER_BENCH_CPU if device == "cpu" else [])]
    returncode, stdout, stderr = _run_processes([(command, {})])[0]
    result = None
    if returncode == 0 and os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    return {"command": " ".join(["python", *command[1:-len(LOADER_BENCH_CPU)]]
                                if device == "cpu" else ["python", *command[1:]]),
            "returncode": returncode, "table": stdout[-4000:],
            "stderr_tail": stderr[-1500:] if returncode else "", "result": result,
            "passed": bool(returncode == 0 and result and result.get("results"))}


def throughput_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """``utils.step_bench`` on all GPUs: the script's own epoch loop against a bare DDP
    loop in the same processes, over the same batches, without SyncBN and without
    mid-epoch checkpoints (ResNet-18, bf16 autocast, ``BENCH_BATCH`` images per GPU,
    60 steps an epoch, 5 timed epochs of each, in ABBA order), each loop's GPU-busy
    share, and the GPU-bound ceiling (one resident batch, no loader, no DDP, CUDA
    graphs)."""
    return _step_bench(nproc, work, device, "step_bench", [])


# images per GPU in the step benchmarks: the script's default global batch (256) on each
# GPU. At 128 an H100's forward and backward of ResNet-18 (about 2.8 ms) filled about a
# quarter of the 11 ms step (issue 48): the host set the pace.
BENCH_BATCH = 256


def compiled_step_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """``throughput``'s benchmark with the model compiled as CUDA graphs (``--compile
    --compile-mode reduce-overhead``): the step that launches least from the host,
    without the ceiling (``throughput`` measures it). Rehearsed on the CPU without
    ``--compile`` and with one round: its compilation there would take minutes, and
    proves nothing of CUDA graphs."""
    extra = ["--no-ceiling"]
    if device == "cuda":
        extra += ["--compile", "--compile-mode", "reduce-overhead"]
    else:  # the orchestration only: throughput's rehearsal has measured the rest
        extra += ["--rounds", "1"]
    return _step_bench(nproc, work, device, "step_bench_compiled", extra)


def _step_bench(nproc: int, work: str, device: str, name: str,
                extra: list[str]) -> dict:
    """``utils.step_bench`` under torchrun with the quick runs' settings and
    ``extra``; its results file's figures, or why there are none."""
    args = common_args(nproc, work, device, sync_bn=False)
    args = _without(_without(args, "--epochs"), "--checkpoint-every")  # set there, off
    steps = 60 if device == "cuda" else 8
    if device == "cuda":
        args = _with(args, "--global-batch", str(BENCH_BATCH * nproc))
    args = _with(args, "--synthetic-size",
                 str(steps * int(_arg(args, "--global-batch"))))
    args = _with(args, "--data", os.path.join(work, "bench_data"))
    args += ["--out", os.path.join(work, f"{name}_out"), *extra]
    path = os.path.join(work, f"{name}.json")
    t0 = time.perf_counter()
    returncode, stdout, stderr = _torchrun(nproc, args + ["--result", path],
                                           module="utils.step_bench")
    result = None
    if returncode == 0 and os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    return {"seconds": round(time.perf_counter() - t0, 1), "result": result,
            "returncode": returncode,
            "stderr_tail": stderr[-1500:] if returncode else "",
            "passed": bool(returncode == 0 and result)}


# --- 4b. the scripts' speed: what a newcomer may expect -------------------------------

TRAIN_DDP = "examples/train_ddp.py"  # chapter 11's script, as a file
TRAIN_CIFAR10 = "utils.train_cifar10"  # chapter 12's, as a module
# train and test images of the synthetic stand-in (written once, read by both scripts):
# CIFAR-10's sizes on a GPU, a tiny set for a SimpleCNN on the CPU (--rehearse)
SPEED_SIZE = {"cuda": (50_000, 10_000), "cpu": (128, 32)}
# images per process (the global batch grows with the processes, as in the book)
SPEED_BATCH = {"cuda": 128, "cpu": 16}
SPEED_EPOCHS = 2  # the last one's seconds and images/s are read: the first also starts
# the DataLoader workers and cuDNN's autotuning
SPEED_BUDGET = 150  # seconds for the whole check; a run not started by then is skipped
SPEED_RUN_TIMEOUT = 90  # seconds for one run (well under a minute each on an H100)
SPEED_MIN_RUN = 15  # seconds of the budget below which no run is started
DEADLINE = None  # --quick: time.perf_counter() when its QUICK_MINUTES are up


def speed_world_sizes(nproc: int) -> list[int]:
    """The numbers of GPUs each script is timed on: one, then all (one only, on one)."""
    return sorted({1, nproc})


def speed_args(script: str, device: str, data: str, out: str,
               world: int = 1) -> list[str]:
    """``script``'s arguments for scripts_speed: ResNet-18 (on the CPU a SimpleCNN, no
    DataLoader workers), ``SPEED_EPOCHS`` epochs of the stand-in in ``data``, the
    ``SPEED_BATCH`` images per process (128 a GPU, as the book's commands: a global
    batch of 128 x ``world``); utils.train_cifar10 with bf16 autocast (``--amp``)
    and ``--synthetic``, examples/train_ddp.py as it is (float32)."""
    cuda = device == "cuda"
    common = ["--data", data, "--model", "resnet18" if cuda else "simplecnn",
              "--epochs", str(SPEED_EPOCHS),
              "--global-batch", str(SPEED_BATCH[device] * world),
              *([] if cuda else ["--workers", "0"]), "--device", device, "--out", out]
    if script == TRAIN_DDP:
        return common
    return common + ["--synthetic", "--synthetic-size",
                     *map(str, SPEED_SIZE[device]), *(["--amp"] if cuda else []),
                     "--no-progress"]


# examples/train_ddp.py's epoch line: "epoch 2/2: train loss 1.2345, test accuracy
# 0.5678 (10000 images); 8.3 s, 6012 images/s[ on 1 process]"
DDP_EPOCH = re.compile(r"^epoch (\d+)/\d+: .*test accuracy ([0-9.]+) .*; ([0-9.]+) s, "
                       r"([0-9.]+) images/s")


def ddp_epoch_figures(stdout: str, epoch: int) -> dict | None:
    """Seconds, images/s and test accuracy of ``epoch`` as examples/train_ddp.py
    prints them, or ``None`` where it printed no such line."""
    for line in stdout.splitlines():
        found = DDP_EPOCH.match(line)
        if found and int(found[1]) == epoch:
            return {"seconds_per_epoch": float(found[3]),
                    "images_per_s": float(found[4]), "test_accuracy": float(found[2])}
    return None


def cifar10_epoch_figures(out: str, epoch: int) -> dict | None:
    """Seconds, images/s and test accuracy of ``epoch`` from utils.train_cifar10's
    ``out/metrics.jsonl`` (``epoch_seconds``, ``images_per_s``, ``test_accuracy``,
    ``world_size``), or ``None`` where it has no such line."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    for record in lines:
        if record.get("epoch") == epoch:
            return {"seconds_per_epoch": record["epoch_seconds"],
                    "images_per_s": record["images_per_s"],
                    "test_accuracy": record.get("test_accuracy"),
                    "world_size_reported": record["world_size"]}
    return None


def _speed_torchrun(nproc: int, script: str, args: list[str],
                    timeout: float) -> tuple[int, str, str]:
    """One torchrun of ``script`` for scripts_speed (the tests fork its ranks)."""
    return _torchrun(nproc, args, timeout=timeout, module=script)


def _shown(command: list[str]) -> str:
    """A torchrun command line as one would type it."""
    return " ".join(command[1:]).replace("-m torch.distributed.run", "torchrun")


def speed_run(script: str, nproc: int, args: list[str], timeout: float) -> dict:
    """One timed run of ``script`` on ``nproc`` GPUs: its epoch ``SPEED_EPOCHS``
    seconds and images/s (``None`` where it printed none), command and exit status."""
    t0 = time.perf_counter()
    code, stdout, stderr = _speed_torchrun(nproc, script, args, timeout)
    figures = (ddp_epoch_figures(stdout, SPEED_EPOCHS) if script == TRAIN_DDP
               else cifar10_epoch_figures(_arg(args, "--out"), SPEED_EPOCHS))
    return {"script": script, "world_size": nproc,
            "command": _shown(torchrun_command(nproc, args, module=script)),
            "epoch": SPEED_EPOCHS,
            **(figures or {"seconds_per_epoch": None, "images_per_s": None,
                           "test_accuracy": None}),
            "returncode": code, "run_seconds": round(time.perf_counter() - t0, 1),
            "timeout_s": round(timeout, 1),
            "stdout_tail": "" if figures else stdout[-1500:],
            "stderr_tail": stderr[-1500:] if code or not figures else ""}


def scripts_speed_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """Seconds per epoch and images/s of the book's two training scripts, as a
    newcomer runs them (``torchrun``), on one GPU and on all: examples/train_ddp.py
    (float32, DataLoader workers) and utils.train_cifar10 (bf16 autocast, the GPU
    loader), ResNet-18, the second of 2 epochs of 50,000 synthetic 32x32 images.
    Within ``SPEED_BUDGET`` seconds in all, writing the data included, and with
    ``--quick`` within its ``QUICK_MINUTES`` (``DEADLINE``): a run that would start
    later is skipped. Passed: every run printed its epoch's figures (its
    exit status, which a "did not learn" verdict after the last epoch may make 1, is
    recorded)."""
    from .data import write_synthetic_cifar10

    t0 = time.perf_counter()
    n_train, n_test = SPEED_SIZE[device]
    data = os.path.join(work, "speed_data")
    write_synthetic_cifar10(data, n_train=n_train, n_test=n_test)
    data_seconds, timings = round(time.perf_counter() - t0, 1), []
    for world in speed_world_sizes(nproc):
        for script in (TRAIN_DDP, TRAIN_CIFAR10):
            stem = script.removesuffix(".py").replace("/", ".").split(".")[-1]
            name = f"speed_{stem}_{world}"
            args = speed_args(script, device, data, os.path.join(work, name), world)
            left = min(SPEED_BUDGET - (time.perf_counter() - t0),
                       (DEADLINE or math.inf) - time.perf_counter())
            if left < SPEED_MIN_RUN:
                timings.append({
                    "script": script, "world_size": world, "seconds_per_epoch": None,
                    "images_per_s": None,
                    "command": _shown(torchrun_command(world, args, module=script)),
                    "skipped": f"the check's {SPEED_BUDGET} s, or --quick's "
                               f"{QUICK_MINUTES} minutes, were spent"})
                continue
            timings.append(speed_run(script, world, args,
                                     min(SPEED_RUN_TIMEOUT, left)))
    return {"model": "resnet18" if device == "cuda" else "simplecnn",
            "train_images": n_train, "test_images": n_test, "epochs": SPEED_EPOCHS,
            "images_per_gpu": SPEED_BATCH[device], "budget_s": SPEED_BUDGET,
            "data_seconds": data_seconds, "timings": timings,
            "passed": all(t["images_per_s"] is not None for t in timings)}


def _reference(work: str, args: list[str], nproc: int, runs: dict) -> dict | None:
    """The final weights of the uninterrupted ``--deterministic`` run on all GPUs: the
    training check's if it ran in ``work``, else run now and added to ``runs``."""
    if final_weights(work, "uninterrupted") is None:
        runs["uninterrupted"] = _train(work, "uninterrupted", args, nproc)
    return final_weights(work, "uninterrupted")


def _reference_name(runs: dict) -> str:
    return ("uninterrupted" if "uninterrupted" in runs
            else "uninterrupted, from an earlier check (training)")


def tolerance(work: str, model: str) -> tuple[float, str]:
    """``(tolerance, where it comes from)`` for a run that sums in another order than
    the reference: ``NOISE_FACTOR`` times this machine's run-to-run noise (the distance
    between the training check's ``speed`` run and its ``--deterministic`` one, the
    same training but for kernels without fixed bits), where that was measured in
    ``work``; else ``RESUME_TOLERANCE``, not calibrated."""
    speed, deterministic = final_weights(work, "speed"), final_weights(work,
                                                                      "uninterrupted")
    if speed is not None and deterministic is not None:
        noise = compare_weights(speed, deterministic, model)["relative_distance"]
        if noise > 0:
            return (NOISE_FACTOR * noise,
                    f"{NOISE_FACTOR} x the run-to-run noise measured here "
                    f"({noise:.3g})")
    return RESUME_TOLERANCE, "RESUME_TOLERANCE: no run-to-run noise measured here"


def _close_to(reference: dict | None, weights: dict | None, model: str,
              work: str) -> dict:
    """The comparison with the reference run, and whether it is within
    ``tolerance``."""
    limit, source = tolerance(work, model)
    if reference is None or weights is None:
        return {"within_tolerance": False, "tolerance": limit,
                "tolerance_from": source}
    compared = compare_weights(reference, weights, model)
    return {**compared, "tolerance": limit, "tolerance_from": source,
            "within_tolerance": compared["relative_distance"] < limit}


def fewer_gpus_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """A run stopped mid-epoch on ``nproc`` GPUs (``--stop-at-step``), resumed from its
    checkpoint on fewer (``fewer_gpus``): the same global batches, each split over
    fewer ranks and summed in another order, so it ends close to the uninterrupted
    run, not bit-identical."""
    common = common_args(nproc, work, device) + ["--deterministic"]
    fewer = fewer_gpus(nproc, int(_arg(common, "--global-batch")))
    runs = {}
    reference = _reference(work, common, nproc, runs)
    stopped, resumed = f"stopped_on_{nproc}", f"resumed_on_{fewer}"
    runs[stopped] = _train(work, stopped,
                           common + ["--stop-at-step", str(break_step(common))], nproc)
    if runs[stopped]["returncode"] == 0:
        shutil.copytree(os.path.join(work, stopped), os.path.join(work, resumed))
        runs[resumed] = _train(work, resumed, common + ["--resume"], fewer)
    done = runs.get(resumed, {"returncode": None, "resumed": False, "setup": []})
    split = f"global batch {_arg(common, '--global-batch')} = "
    split += f"{int(_arg(common, '--global-batch')) // fewer} x {fewer}"
    on_fewer = any(split in line for line in done["setup"])
    close = _close_to(reference, final_weights(work, resumed), _arg(common, "--model"),
                      work)
    return {"gpus": [nproc, fewer], "runs": runs,
            "reference_run": _reference_name(runs),
            "resumed": done["resumed"], "ran_on_fewer": on_fewer, **close,
            "passed": bool(done["returncode"] == 0 and done["resumed"] and on_fewer
                           and close["within_tolerance"])}


def two_nodes_check(nproc: int, work: str, device: str = "cuda") -> dict:
    """Two torchruns as the two nodes of one job (static rendezvous on 127.0.0.1),
    ``gpus_per_node`` GPUs each through ``CUDA_VISIBLE_DEVICES``, each with its own
    ``--data`` (written by its own local rank 0) and ``--out``: it ends close to the
    uninterrupted run on one node."""
    common = common_args(nproc, work, device) + ["--deterministic"]
    per_node = gpus_per_node(nproc, int(_arg(common, "--global-batch")))
    runs = {}
    reference = _reference(work, common, nproc, runs)
    folders = [os.path.join(work, "two_nodes", f"node{n}") for n in (0, 1)]
    node_args = [_with(common, "--data", os.path.join(f, "data"))
                 + ["--out", os.path.join(f, "out")] for f in folders]
    launches = [(cmd, {**env, **pinned_nccl(common)}) for cmd, env in
                two_node_launches(visible_devices(os.environ, nproc), per_node,
                                  free_port(), node_args)]
    t0 = time.perf_counter()
    results = _run_processes(launches)
    seconds = time.perf_counter() - t0
    for n in (0, 1):
        runs[f"node{n}"] = run_record(node_args[n], *results[n], seconds,
                                      os.path.join(folders[n], "out"))
    nodes = [runs["node0"], runs["node1"]]
    world = {m.get("world_size") for m in runs["node0"].get("metrics", [])}
    close = _close_to(reference, final_weights(folders[0], "out"),
                      _arg(common, "--model"), work)
    return {"gpus_per_node": per_node, "world_size": 2 * per_node,
            "cuda_visible_devices": [env["CUDA_VISIBLE_DEVICES"]
                                     for _, env in launches],
            "commands": [f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
                         + " ".join(["torchrun", *cmd[3:]]) for cmd, env in launches],
            "runs": runs, "reference_run": _reference_name(runs), **close,
            "passed": bool(all(r["returncode"] == 0 for r in nodes)
                           and world == {2 * per_node}
                           and close["within_tolerance"])}


# --- 5. ops without a deterministic kernel --------------------------------------------

def nondeterminism_verdict(checks: dict, allowed: dict[str, str] | None = None) -> dict:
    """Every op that warned in a ``--deterministic`` run of ``checks`` (by
    ``check/run``), the allowed ones with their reasons, and the unexpected ones: any
    fails the check."""
    allowed = ALLOWED_NONDETERMINISTIC_OPS if allowed is None else allowed
    seen: dict[str, list[str]] = {}
    for check, result in checks.items():
        for run, record in result.get("runs", {}).items():
            if not record.get("deterministic", True):
                continue  # without --deterministic nothing warns
            for op in record.get("nondeterministic_ops", []):
                seen.setdefault(op, []).append(f"{check}/{run}")
    unexpected = sorted(op for op in seen if op not in allowed)
    return {"seen": seen, "allowed": {op: allowed[op] for op in sorted(allowed)},
            "unexpected": unexpected, "passed": not unexpected}


# --- 6. what this machine can check ---------------------------------------------------

def compile_unavailable() -> str | None:
    """Why ``--compile`` cannot run on CUDA here (the script's own refusal: no Triton,
    an unsupported Python), or ``None``."""
    from .devices import compile_problem

    return compile_problem(torch.device("cuda"))


def amp_fp16_unavailable() -> str | None:
    """``None`` if this version of the script takes ``--amp fp16``, else why not."""
    from .train_cifar10 import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage message
            taken = parse_args(["--amp", "fp16"]).amp == "fp16"
    except SystemExit:
        taken = False
    return None if taken else "not in this version of utils.train_cifar10"


SEVERAL_MACHINES = ("nodes on separate machines: the two_nodes check runs two "
                    "torchruns on this one, which share its loopback network and "
                    "disk, and nccl may join them as GPUs of one node")
ONE_GPU = {
    "collectives": "collectives over several ranks: needs 2 GPUs (ran on 1 rank, "
                   "where nccl has nothing to exchange)",
    "training": "training over several ranks (DDP's gradient all-reduce, "
                "SyncBatchNorm across GPUs, one of several ranks killed): needs 2 "
                "GPUs (ran on 1 rank)",
    "resume_on_fewer_gpus": "resume on fewer GPUs: needs 2 GPUs",
    "two_nodes": "two nodes (two torchruns, static rendezvous on 127.0.0.1, the GPUs "
                 "split with CUDA_VISIBLE_DEVICES): needs 2 GPUs",
}
SPEED_ONE_GPU = ("scripts_speed on several GPUs: needs 2 GPUs (both scripts timed on "
                 "1)")
# --quick: the checks in order of what they are worth, within QUICK_MINUTES on one GPU
QUICK = ["collectives", "loader_no_sync", "capstone", "loader_bench", "throughput",
         "compiled_step", "scripts_speed"]
QUICK_MINUTES = 6
QUICK_RUN_TIMEOUT = 150  # seconds for one process of --quick (and of --rehearse)
QUICK_LEAVES = ("--quick leaves to the full profile: SyncBatchNorm, DataLoader workers "
                "feeding the GPUs, --compile's restart pair, --amp fp16, resume on "
                "fewer GPUs, two nodes, make test")
# seconds each check takes on one GPU, as --dry-run states them: {check: (seconds,
# where that figure comes from)}. Measured: the second --quick on one H100 (its
# check_seconds, rounded up; 149 s in all), book/results/gpu_check_quick_nvidia_h100_
# 80gb_hbm3.json as of 2026-11-26 (the first took 178 s).
H100 = "measured, 1 x H100 80GB, 2026-11-26"
STATED_SECONDS = {
    "collectives": (10, H100), "loader_no_sync": (5, H100), "capstone": (86, H100),
    "loader_bench": (18, H100),
    "throughput": (72, "32 s measured on 1 x H100 before the ceiling; + an estimated "
                       "40 s to compile the ceiling's forward and backward"),
    "compiled_step": (80, "estimate: throughput's run without the ceiling, + compiling "
                          "the DDP model as CUDA graphs"),
    # writing the data (~8 s), utils.train_cifar10 (~10 s to start, 2 epochs of ~5 s
    # at the ~10,700 images/s of throughput's run, and their test passes), and
    # examples/train_ddp.py in float32 (~10 s to start, 2 epochs at ~5,000 images/s)
    "scripts_speed": (75, "estimate from throughput's images/s on 1 x H100"),
    "training": (110, "estimate"), "loader_workers": (80, "estimate"),
    "compile": (90, "estimate"), "amp_fp16": (80, "estimate"),
    "resume_on_fewer_gpus": (60, "estimate"), "two_nodes": (40, "estimate"),
    "make_test": (1800, "estimate"),
}
# what a check adds on 2 GPUs or more: {check: (seconds, why)}
SEVERAL_GPUS_SECONDS = {"scripts_speed": (45, "+ the runs on all GPUs")}


def plan(gpus: int, compile_reason: str | None = None,
         fp16_reason: str | None = None, make_test: bool = False,
         profile: str = "full") -> tuple[list[str], list[str]]:
    """``(checks, not_checked)``: the checks of ``profile`` ("quick" or "full") to run
    on ``gpus`` GPUs, in order, and what is not checked here, each with its reason."""
    if profile == "quick":
        one_gpu = ([ONE_GPU["collectives"], ONE_GPU["training"], SPEED_ONE_GPU]
                   if gpus < 2 else [])
        return list(QUICK), [SEVERAL_MACHINES, QUICK_LEAVES, *one_gpu]
    checks = ["collectives", "loader_no_sync", "training", "loader_workers"]
    not_checked = [SEVERAL_MACHINES]
    for name, reason in (("compile", compile_reason), ("amp_fp16", fp16_reason)):
        if reason is None:
            checks.append(name)
        else:
            flag = "--compile" if name == "compile" else "--amp fp16"
            not_checked.append(f"{flag}: {reason}")
    if gpus >= 2:
        checks += ["resume_on_fewer_gpus", "two_nodes"]
    else:
        not_checked += list(ONE_GPU.values())
    checks += ["loader_bench", "throughput"]
    if make_test:
        checks.append("make_test")
    else:
        not_checked.append("make test: not asked (--make-test; make gpu-check asks)")
    return checks, not_checked


def nvidia_smi_gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (none where it is missing or fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines()
            if line.startswith("GPU ")]


def gpu_problem(listed: list[str], env, available: bool, count: int) -> str | None:
    """Why the GPUs here cannot be checked (``None``: they can): none at all, or GPUs
    that ``nvidia-smi`` lists (those ``CUDA_VISIBLE_DEVICES`` leaves) and torch cannot
    use."""
    expected = len(listed)
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        expected = min(expected, len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",")
                                      if d.strip()]))
    build = (f"torch {torch.__version__}, "
             + (f"built for CUDA {torch.version.cuda}" if torch.version.cuda
                else "a CPU-only build"))
    if not available or count == 0:
        if expected == 0:
            return ("no GPU here: nvidia-smi lists none and torch.cuda.is_available() "
                    "is False; --rehearse runs the same plan on the CPU")
        return (f"nvidia-smi lists {expected} GPU(s) ({listed[0]}), but torch cannot "
                f"use them: torch.cuda.is_available() is False ({build}; a driver "
                f"older than that CUDA needs, or a container started without its "
                f"GPUs, does this)")
    if count < expected:
        return (f"nvidia-smi lists {expected} GPU(s) this process may use, torch sees "
                f"{count} ({build})")
    return None


def stated_seconds(name: str, gpus: int) -> tuple[int, str]:
    """``(seconds, where that figure comes from)`` that check ``name`` is stated to
    take on ``gpus`` GPUs."""
    seconds, source = STATED_SECONDS[name]
    if gpus >= 2 and name in SEVERAL_GPUS_SECONDS:
        more, why = SEVERAL_GPUS_SECONDS[name]
        seconds, source = seconds + more, f"{source}; {why}"
    return seconds, source


def stated_plan(checks: list[str], gpus: int, minutes: float | None = None
                ) -> tuple[list[str], int]:
    """The plan's lines, with the seconds each check is stated to take, and the sum.
    ``minutes`` (--quick's): ``scripts_speed`` runs only what the checks before it
    leave of them (``DEADLINE``), and is stated so."""
    lines, total = [], 0
    for name in checks:
        seconds, source = stated_seconds(name, gpus)
        left = None if minutes is None else int(60 * minutes) - total
        if name == "scripts_speed" and left is not None and seconds > left:
            seconds, source = left, f"what --quick's {minutes} minutes leave; {source}"
        total += seconds
        lines.append(f"{name:<22} {seconds:>5} s  ({source})")
    return lines, total


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
    try:
        nccl = (".".join(map(str, torch.cuda.nccl.version()))
                if dist.is_nccl_available() else None)
    except Exception:  # a build without it
        nccl = None
    return {"gpus": [p.name for p in props],
            "gpu_memory_gib": [round(p.total_memory / 2**30, 1) for p in props],
            "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "nccl": nccl,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "platform": platform.platform()}


def git_commit(root: str = ROOT) -> str | None:
    """The commit checked out in ``root`` (``git rev-parse --short HEAD``), with
    ``+changes`` where tracked files differ from it; ``None`` without git or outside a
    repository (a copy of the files without ``.git``)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True,
                              text=True, timeout=60)

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode or changed.returncode:
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def make_test_check(nproc: int = 0, work: str = "", device: str = "cuda") -> dict:
    """``make test`` on this machine: its summary line, its time and its exit status."""
    t0 = time.perf_counter()
    done = subprocess.run(["make", "test"], cwd=ROOT, capture_output=True, text=True)
    summary = [line for line in (done.stdout + done.stderr).splitlines()
               if re.search(r"\d+ (passed|failed)", line)]
    return {"returncode": done.returncode, "summary": summary[-4:],
            "minutes": round((time.perf_counter() - t0) / 60, 1),
            "passed": done.returncode == 0,
            "tail": ("" if done.returncode == 0
                     else (done.stdout + done.stderr)[-3000:])}


CHECKS = {"collectives": collectives_check, "loader_no_sync": loader_sync_check,
          "capstone": capstone_check, "training": training_checks,
          "loader_workers": loader_workers_check, "compile": compile_check,
          "amp_fp16": amp_fp16_check, "resume_on_fewer_gpus": fewer_gpus_check,
          "two_nodes": two_nodes_check, "loader_bench": loader_bench_check,
          "throughput": throughput_check, "compiled_step": compiled_step_check,
          "scripts_speed": scripts_speed_check,
          "make_test": make_test_check}


def run_checks(names: list[str], nproc: int, device: str = "cuda") -> dict:
    """Each named check in turn (in one scratch folder, deleted after); a check that
    raises is recorded as failed with its error, and the others still run."""
    checks = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        for name in names:
            t0 = time.perf_counter()
            try:
                checks[name] = CHECKS[name](nproc, work, device)
            except Exception as exc:  # recorded, not hidden: the file says what failed
                checks[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000],
                                "passed": False}
            checks[name]["check_seconds"] = round(time.perf_counter() - t0, 1)
            print(f"{name}: {'passed' if checks[name]['passed'] else 'FAILED'} "
                  f"({checks[name]['check_seconds']:.0f} s)", flush=True)
    checks["nondeterministic_ops"] = nondeterminism_verdict(checks)
    print("nondeterministic_ops:", checks["nondeterministic_ops"]["seen"] or "none",
          flush=True)
    return checks


def results_name(profile: str, rehearse: bool, gpu: str) -> str:
    """``gpu_check_<gpu>.json``, ``gpu_check_quick_<gpu>.json``, or
    ``gpu_check_rehearsal_cpu[_quick].json``."""
    if rehearse:
        return f"gpu_check_rehearsal_cpu{'_quick' if profile == 'quick' else ''}.json"
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    return f"gpu_check_{'quick_' if profile == 'quick' else ''}{slug}.json"


def parser() -> argparse.ArgumentParser:
    # the docstring's first paragraph (argparse re-flows it onto one line)
    p = argparse.ArgumentParser(prog="python -m utils.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "book", "results"),
                   help="folder for the results file")
    p.add_argument("--quick", action="store_true",
                   help=f"the checks worth most, in at most {QUICK_MINUTES} minutes on "
                        f"one GPU: {', '.join(QUICK)}")
    p.add_argument("--make-test", action="store_true",
                   help="also run `make test` and record its result")
    p.add_argument("--rehearse", action="store_true",
                   help="run the same plan on this machine's CPU (2 gloo ranks, a "
                        "small CNN, the same timeouts): proves the orchestration, not "
                        "CUDA")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and the seconds each check is stated to take; "
                        "run nothing")
    p.add_argument("--allow-no-gpu", action="store_true",
                   help="exit 0, not 1, where there is no GPU at all")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    require_packages()
    profile = "quick" if args.quick else "full"
    if args.rehearse and args.make_test:
        p.error("--make-test runs make test on a GPU machine; leave it out of "
                "--rehearse (make test runs on the CPU anyway)")
    global RUN_TIMEOUT, DEADLINE
    DEADLINE = None
    if args.quick:
        RUN_TIMEOUT = QUICK_RUN_TIMEOUT
        DEADLINE = time.perf_counter() + 60 * QUICK_MINUTES
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    if args.dry_run:
        gpus = 2 if args.rehearse else max(count, 1)
        checks, not_checked = plan(gpus, make_test=args.make_test, profile=profile)
        lines, total = stated_plan(checks, gpus,
                                   QUICK_MINUTES if profile == "quick" else None)
        where = ("this CPU (--rehearse: 2 gloo ranks)" if args.rehearse else
                 f"{count} GPU(s)" if count else "1 GPU (none here)")
        print(f"gpu-check {profile} plan on {where}; {RUN_TIMEOUT} s at most per "
              f"process:", *lines, f"{'total':<22} {total:>5} s  "
              f"({total / 60:.1f} min)", "not checked:", *not_checked, sep="\n  ")
        return 0
    if args.rehearse:
        device, nproc = "cpu", 2
        reasons = ("the rehearsal runs on the CPU",) * 2
    else:
        problem = gpu_problem(nvidia_smi_gpus(), os.environ, available, count)
        if problem and args.allow_no_gpu and problem.startswith("no GPU here"):
            print(f"gpu-check: {problem}. --allow-no-gpu: nothing checked, nothing "
                  f"written.")
            return 0
        if problem:
            print(f"gpu-check: error: {problem}. Nothing checked.", file=sys.stderr)
            return 1
        device, nproc = "cuda", count
        reasons = ((compile_unavailable(), amp_fp16_unavailable())
                   if profile == "full" else (None, None))
    names, not_checked = plan(nproc, *reasons, args.make_test, profile)
    env = environment()
    report = {"check": f"python -m utils.gpu_check ({profile} profile"
                       f"{', rehearsed on the CPU' if args.rehearse else ''})",
              "command": " ".join([os.path.basename(sys.executable), "-m",
                                   "utils.gpu_check",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), "commit": git_commit(),
              "profile": profile, "rehearsal": args.rehearse,
              "environment": env, "world_size": nproc, "device": device,
              "run_timeout_s": RUN_TIMEOUT,
              "stated_seconds": {n: stated_seconds(n, nproc)[0] for n in names},
              "not_checked": not_checked, "checks": {}}
    where = "the CPU (rehearsal)" if args.rehearse else f"{nproc} x {env['gpus'][0]}"
    print(f"gpu-check {profile} on {where}: {', '.join(names)}; not checked here:",
          *not_checked, sep="\n  ", flush=True)
    t0 = time.perf_counter()
    report["checks"] = run_checks(names, nproc, device)
    report["total_seconds"] = round(time.perf_counter() - t0, 1)
    report["passed"] = all(c["passed"] for c in report["checks"].values())
    path = os.path.join(args.out, results_name(profile, args.rehearse,
                                               (env["gpus"] or ["cpu"])[0]))
    results.write(path, report, SOURCES, gpu=not args.rehearse)
    print(f"{'PASSED' if report['passed'] else 'FAILED'} in "
          f"{report['total_seconds']:.0f} s; results in {path}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
