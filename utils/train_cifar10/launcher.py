"""Launching (chapter 13): checks first; the process group.

What the launcher and the machine are checked for: one GPU per process, a fixed number
of nodes, no ``srun`` without torchrun, a ``--compile`` that can work."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..devices import compile_problem
from .restarts import init_process_group


def setup_distributed(device_choice: str, timeout: timedelta | None = None
                      ) -> tuple[bool, int, int, int, torch.device]:
    """``(ddp, rank, local_rank, world_size, device)``; ``RANK`` in the environment
    means torchrun started us. ``timeout``: the group's, until the first step."""
    cuda_available = torch.cuda.is_available()
    if device_choice == "cuda" and not cuda_available:
        raise SystemExit("error: --device cuda, but torch.cuda.is_available() is False "
                         "here; use --device cpu or auto")
    cuda = device_choice == "cuda" or (device_choice == "auto" and cuda_available)
    ddp = "RANK" in os.environ
    if not ddp:
        refuse_srun_without_torchrun(os.environ)
    else:
        refuse_elastic_nnodes(launcher_args())
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if ddp else 0
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not ddp:
        return False, 0, 0, 1, device
    if cuda:
        check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                   torch.cuda.device_count())
        # one GPU per process, before anything touches CUDA
        torch.cuda.set_device(device)
    init_process_group("nccl" if cuda else "gloo", device, timeout)
    return True, dist.get_rank(), local_rank, dist.get_world_size(), device


def check_gpus(local_world_size: int, device_count: int) -> None:
    """One GPU per process: refuse to start more processes on a node than it
    has GPUs."""
    if local_world_size > device_count:
        raise SystemExit(f"error: {local_world_size} processes on this node "
                         f"but only {device_count} GPUs; "
                         f"use --nproc_per_node={device_count} or fewer, "
                         f"or --device cpu")


def refuse_srun_without_torchrun(env) -> None:
    """Started by SLURM's ``srun`` as one of several tasks, but not by torchrun: every
    task would train alone, as rank 0 on the first GPU, writing the same ``--out``."""
    tasks = int(env.get("SLURM_NTASKS", "1") or 1)
    if tasks > 1:
        raise SystemExit(
            f"error: started by srun as task {env.get('SLURM_PROCID', '?')} of {tasks} "
            "without torchrun (no RANK in the environment): each task would train "
            "alone as rank 0 on the first GPU and write the same --out. Start one "
            "torchrun per node instead: srun --ntasks-per-node=1 torchrun "
            "--nnodes=$SLURM_NNODES --nproc_per_node=<GPUs per node> ... "
            "-m utils.train_cifar10 ...")


def launcher_args() -> list[str]:
    """The command line of the process that started this one (torchrun's agent), where
    ``/proc`` shows it (Linux); ``[]`` elsewhere."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def refuse_elastic_nnodes(argv: list[str]) -> None:
    """``torchrun --nnodes=MIN:MAX`` with ``MIN < MAX``: an elastic job, whose world
    size may change at a restart (a node lost or added), and with it each process's
    share of ``--global-batch``, mid-epoch. This script resumes on another number of
    processes only from a checkpoint, in a new job: refuse at once."""
    value = os.environ.get("PET_NNODES")  # torchrun's options from the environment
    for i, arg in enumerate(argv):
        if arg == "--nnodes" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
    if value and ":" in value and len(set(value.split(":"))) > 1:
        raise SystemExit(f"error: torchrun --nnodes={value} starts an elastic job, "
                         f"whose number of processes may change between attempts; this "
                         f"script needs a fixed one: --nnodes=N (to go on with another "
                         f"number, start a new job with --resume)")


def check_compile(device: torch.device) -> None:
    """Refuse ``--compile`` where ``torch.compile`` cannot work, before any work is
    done (``utils.devices.compile_problem``)."""
    problem = compile_problem(device)
    if problem is not None:
        raise SystemExit(f"error: {problem}")
