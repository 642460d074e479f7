"""Check, in seconds, that this machine can run the book's training scripts on its GPUs.

    python -m utils.env_check                  # exit 0 when the GPUs are usable
    python -m utils.env_check --cpu-ok         # a CPU run is what you want: exit 0 too
    python -m utils.env_check --no-all-reduce  # the facts only: start no processes

It needs only torch, torchvision and numpy (and the standard library): nothing else of
the book's, so it runs with the torch a GPU server already has. It prints one fact a
line (Python, torch, torchvision and whether they match, torch's CUDA or ROCm build, the
GPUs torch sees, ``nvidia-smi -L``'s count, NCCL), then a diagnosis and a verdict: the
last line says what to do. ``diagnose`` turns the facts (``Facts``) into the diagnosis
and touches nothing; the ``probe_*`` functions observe them.

Where GPUs are usable it starts one process per GPU (``torch.multiprocessing.spawn``,
``nccl`` on 127.0.0.1), each prints ``rank R of W: cuda:R NAME`` and all-reduces a
tensor; with ``--cpu-ok`` and no GPU, 2 ``gloo`` processes on the CPU do the same. A
group that has not finished after ``--timeout`` seconds is killed and reported as a
start-up hang, the commonest NCCL failure.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from typing import Any, Callable

WIDTH = 88  # no output line is longer
TIMEOUT = 60.0  # seconds the all-reduce group may take, start-up included
CPU_RANKS = 2  # gloo processes with --cpu-ok and no GPU
HANG_HELP = ("this is a start-up hang, the commonest NCCL failure: rerun with "
             "NCCL_DEBUG=INFO to see where it stops; NCCL_P2P_DISABLE=1 works "
             "around broken GPU peer-to-peer, NCCL_SOCKET_IFNAME=<interface> picks "
             "the network interface NCCL uses")


@dataclasses.dataclass
class Facts:
    """What was observed: the input of ``diagnose``."""

    cuda: str | None = None  # torch.version.cuda; None: not a CUDA build
    hip: str | None = None  # torch.version.hip; None: not a ROCm build
    torch_gpus: int = 0  # GPUs torch can use (0: torch.cuda.is_available() is False)
    smi_gpus: int | None = None  # nvidia-smi -L's count; None: no (working) nvidia-smi
    smi_error: str = ""  # what a failing nvidia-smi said
    driver_library: bool = False  # the driver's library (libcuda) loads
    visible: str | None = None  # CUDA_VISIBLE_DEVICES; None: unset
    messages: list[str] = dataclasses.field(default_factory=list)  # torch.cuda's
    library_problem: str = ""  # torch, torchvision or numpy is unusable: why


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Whether the GPUs are usable: ``name`` says what is wrong, ``fix`` what to do."""

    name: str
    why: str
    fix: str
    usable: bool = False


# --- the diagnosis: pure functions of the facts ----------------------------------
def diagnose(facts: Facts) -> Diagnosis:
    """The one diagnosis that explains whether torch can use this machine's GPUs."""
    if facts.torch_gpus > 0:
        return usable(facts)
    if facts.cuda is None and facts.hip is None:
        return Diagnosis("CPU-only build of torch",
                         "torch was built without CUDA (torch.version.cuda is None)",
                         "install a CUDA build of torch: pytorch.org's selector")
    if driver_too_old(facts.messages):
        return Diagnosis("driver too old for this torch's CUDA",
                         f"torch is built for CUDA {facts.cuda}; torch.cuda says "
                         f"so above",
                         f"update the NVIDIA driver for CUDA {facts.cuda}, or "
                         f"install torch for an older CUDA")
    if facts.hip is None and no_driver(facts):
        return Diagnosis("no NVIDIA driver",
                         f"torch is built for CUDA {facts.cuda}, but there is no "
                         f"nvidia-smi and no driver library (libcuda)",
                         "install the NVIDIA driver (a container: run it with "
                         "--gpus all)")
    # after the driver: with no driver, an empty CUDA_VISIBLE_DEVICES is not the cause
    if hides_all(facts.visible, facts.smi_gpus):
        return hidden(facts.visible, "lists no device")
    if facts.visible is not None and facts.smi_gpus:
        return hidden(facts.visible, f"names none of the {facts.smi_gpus} GPUs "
                                     f"nvidia-smi lists")
    return unexplained(facts)


def usable(facts: Facts) -> Diagnosis:
    """GPUs torch can use; ``why`` notes GPUs nvidia-smi lists that it does not."""
    why = f"torch sees {facts.torch_gpus} GPU(s)"
    if facts.smi_gpus and facts.smi_gpus != facts.torch_gpus:
        why += f" of the {facts.smi_gpus} nvidia-smi lists"
    if facts.visible is not None:
        why += f" (CUDA_VISIBLE_DEVICES={facts.visible!r})"
    run = f"torchrun --nproc-per-node={facts.torch_gpus} runs the training scripts"
    return Diagnosis("GPUs usable", why, f"{run} on them", True)


def hidden(visible: str | None, what: str) -> Diagnosis:
    """CUDA_VISIBLE_DEVICES set to a value that leaves torch no GPU."""
    return Diagnosis("CUDA_VISIBLE_DEVICES hides the GPUs",
                     f"CUDA_VISIBLE_DEVICES={visible!r} {what}",
                     "unset CUDA_VISIBLE_DEVICES, or set it to GPUs that exist "
                     "(0,1,...)")


def unexplained(facts: Facts) -> Diagnosis:
    """Torch sees no GPU for none of the known reasons."""
    if facts.hip is not None:
        return Diagnosis("ROCm build of torch sees no GPU",
                         f"torch is built for ROCm (HIP {facts.hip})",
                         "check rocm-smi, HIP_VISIBLE_DEVICES and "
                         "ROCR_VISIBLE_DEVICES")
    if facts.smi_gpus == 0 and not facts.smi_error:
        return Diagnosis("no GPU: nvidia-smi lists 0 GPUs", "the driver finds no GPU",
                         "run on a machine with NVIDIA GPUs, or use --cpu-ok")
    listed = ("nvidia-smi fails" if facts.smi_error else "no nvidia-smi"
              if facts.smi_gpus is None else f"nvidia-smi lists {facts.smi_gpus} GPUs")
    return Diagnosis(f"{listed} but torch sees {facts.torch_gpus}",
                     "torch.cuda's messages above say why, where it gave any",
                     "a container: run it with --gpus all; else reinstall the driver")


def hides_all(visible: str | None, smi_gpus: int | None) -> bool:
    """Whether CUDA_VISIBLE_DEVICES's first entry is invalid, which hides every GPU.

    CUDA reads the list up to its first invalid entry: "", "-1", "none", or an index
    past the GPUs nvidia-smi lists. (A GPU-/MIG- UUID is not checked here.)
    """
    if visible is None:
        return False
    first = visible.split(",")[0].strip()
    if first.lower().startswith(("gpu-", "mig-")):
        return False
    if not re.fullmatch(r"-?\d+", first):
        return True
    return int(first) < 0 or bool(smi_gpus and int(first) >= smi_gpus)


def driver_too_old(messages: list[str]) -> bool:
    """Whether torch.cuda said the driver is older than torch's CUDA."""
    pattern = r"too old|insufficient|found version \d+"
    return any(re.search(pattern, m, re.IGNORECASE) and "driver" in m.lower()
               for m in messages)


def no_driver(facts: Facts) -> bool:
    """Whether there is no NVIDIA driver: torch says so, or nothing of it is found."""
    said = any("no nvidia driver" in m.lower() for m in facts.messages)
    smi_no_driver = "driver" in facts.smi_error.lower()
    nothing = facts.smi_gpus is None and not facts.driver_library
    return said or smi_no_driver or nothing


def verdict(facts: Facts, diagnosis: Diagnosis, cpu_ok: bool,
            group_problem: str = "") -> tuple[int, str]:
    """The exit code and the last line: what to do."""
    if facts.library_problem:
        return 1, f"FAIL: {facts.library_problem}"
    if group_problem:
        return 1, f"FAIL: {group_problem}"
    if diagnosis.usable:
        return 0, f"OK: {diagnosis.fix}"
    if cpu_ok:
        return 0, "OK for a CPU run (--cpu-ok): the scripts run on the CPU with gloo"
    return 1, f"FAIL: {diagnosis.fix}"


def expected_torchvision(torch_version: str) -> str | None:
    """The torchvision minor version built for a torch 2.x (2.m: 0.m+15), else None."""
    found = re.match(r"2\.(\d+)", torch_version)
    return f"0.{int(found[1]) + 15}" if found else None


def torchvision_mismatch(torch_version: str, vision_version: str) -> str:
    """Why torchvision ``vision_version`` is not the one for this torch; "" if it is."""
    expected = expected_torchvision(torch_version)
    got = re.match(r"(\d+\.\d+)", vision_version)
    if expected and got and got[1] != expected:
        return f"torch {torch_version} goes with torchvision {expected}.x"
    torch_tag, vision_tag = torch_version.partition("+")[2], vision_version.partition(
        "+")[2]
    if torch_tag and vision_tag and torch_tag != vision_tag:
        return f"torch is a +{torch_tag} build, torchvision a +{vision_tag} one"
    return ""


# --- output ----------------------------------------------------------------------
def show(key: str, value: str) -> None:
    """Print ``key value``, wrapped to WIDTH characters."""
    head = f"{key:<12} "
    for line in textwrap.wrap(value, WIDTH, initial_indent=head,
                              subsequent_indent=" " * 13) or [head.rstrip()]:
        print(line, flush=True)


def show_verdict(code: int, line: str) -> int:
    """Print the verdict, its end (what to do) on the last line; return ``code``."""
    lines = textwrap.wrap(line, WIDTH, subsequent_indent="  ")
    print(*lines, sep="\n", flush=True)
    return code


# --- probing: what this machine has ----------------------------------------------
def probe_libraries() -> tuple[Any, str]:
    """Import torch, show python/torch/torchvision/numpy; (torch or None, problem)."""
    show("python", f"{platform.python_version()} ({sys.executable})")
    try:
        import torch
    except Exception as error:  # ImportError, or a broken install's OSError
        show("torch", f"cannot be imported: {error}")
        return None, "install torch: pytorch.org's selector"
    show("torch", torch.__version__)
    vision, problem = probe_torchvision(torch)
    show("torchvision", vision)
    try:
        import numpy
        show("numpy", numpy.__version__)
    except Exception as error:
        show("numpy", f"cannot be imported: {error}")
        problem = problem or "numpy is missing: pip install numpy"
    return torch, problem


def probe_torchvision(torch: Any) -> tuple[str, str]:
    """(torchvision's line, the problem or ""): it imports, nms works, it fits."""
    try:
        import torchvision
        from torchvision.ops import nms
        boxes = torch.tensor([[0.0, 0, 2, 2], [0, 0, 2, 2.1], [3, 3, 4, 4]])
        kept = nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist()
    except Exception as error:  # e.g. "operator torchvision::nms does not exist"
        return (f"does not work: {error}",
                "install the torchvision built for this torch (pytorch.org's selector)")
    mismatch = torchvision_mismatch(torch.__version__, torchvision.__version__)
    if kept != [0, 2]:
        mismatch = mismatch or f"torchvision.ops.nms kept boxes {kept}, not [0, 2]"
    if mismatch:
        return (f"{torchvision.__version__}: does not match: {mismatch}",
                f"install the torchvision for torch {torch.__version__} "
                f"(pytorch.org's selector)")
    return f"{torchvision.__version__}: matches torch; torchvision.ops.nms works", ""


def probe_cuda(torch: Any) -> tuple[int, list[str]]:
    """(GPUs torch can use, torch.cuda's warnings and errors, verbatim)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    messages = [str(w.message) for w in caught]
    if not count and (torch.version.cuda or getattr(torch.version, "hip", None)):
        try:
            torch.cuda.init()
        except Exception as error:
            messages.append(str(error))
    return count, list(dict.fromkeys(messages))


def probe_nvidia_smi() -> tuple[int | None, str]:
    """(``nvidia-smi -L``'s GPU count or None without a working one, its error)."""
    if shutil.which("nvidia-smi") is None:
        return None, ""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"nvidia-smi -L failed: {error}"
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines() or ["(nothing)"]
        return None, said[0]
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()), ""


def probe_driver_library() -> bool:
    """Whether the NVIDIA driver's library (libcuda / nvcuda.dll) loads."""
    names = {"win32": ["nvcuda.dll"]}.get(sys.platform, ["libcuda.so.1", "libcuda.so"])
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def probe(torch: Any, problem: str) -> Facts:
    """Observe the facts, showing each; ``problem`` is probe_libraries's."""
    facts = Facts(cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
                  visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                  library_problem=problem)
    build = (f"CUDA {facts.cuda}" if facts.cuda else
             f"ROCm (HIP {facts.hip})" if facts.hip else "CPU-only (no CUDA, no ROCm)")
    show("torch build", build)
    facts.torch_gpus, facts.messages = probe_cuda(torch)
    facts.smi_gpus, facts.smi_error = probe_nvidia_smi()
    facts.driver_library = probe_driver_library()
    show_gpus(torch, facts)
    show_nccl(torch)
    return facts


def show_gpus(torch: Any, facts: Facts) -> None:
    """Show the GPUs torch sees, nvidia-smi's count, the variable, torch's messages."""
    show("GPUs (torch)", str(facts.torch_gpus))
    for i in range(facts.torch_gpus):
        props = torch.cuda.get_device_properties(i)
        show(f"  cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB")
    smi = ("not found" if facts.smi_gpus is None and not facts.smi_error else
           facts.smi_error or f"nvidia-smi -L lists {facts.smi_gpus} GPU(s)")
    show("nvidia-smi", smi)
    show("libcuda", "loads" if facts.driver_library else "not found (no NVIDIA driver)")
    if facts.visible is not None:
        show("CUDA_VISIBLE_DEVICES", repr(facts.visible))
    for message in facts.messages:
        show("torch.cuda", message)


def show_nccl(torch: Any) -> None:
    """Show whether torch has NCCL, and its version."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        show("NCCL", "not available in this torch (gloo only)")
        return
    try:
        version = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as error:
        version = f"version unknown ({error})"
    show("NCCL", f"available, {version}")


# --- the all-reduce: one process per GPU (nccl), or 2 on the CPU (gloo) ----------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, backend: str, world: int, port: int, timeout: float) -> None:
    """One rank: join the group, say who it is, all-reduce rank + 1, check the sum."""
    import torch
    import torch.distributed as dist

    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    where = (f"cuda:{rank} {torch.cuda.get_device_name(device)}" if cuda
             else "cpu (gloo)")
    print(f"rank {rank} of {world}: {where}", flush=True)
    try:
        total = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(total)
        if not bool((total == world * (world + 1) / 2).all()):
            raise RuntimeError(f"rank {rank}: the all-reduce gave {total.tolist()}")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], backend: str, world: int,
              timeout: float) -> str:
    """Run ``fn(rank, backend, world, port, timeout)`` on ``world`` processes: "" when
    all finish in ``timeout`` seconds, else what went wrong (a hang: "hang")."""
    import torch.multiprocessing as mp

    # gloo on Linux: fork, no second import of torch; CUDA needs spawn
    method = "fork" if backend == "gloo" and sys.platform == "linux" else "spawn"
    group = mp.start_processes(fn, args=(backend, world, free_port(), timeout),
                               nprocs=world, join=False, start_method=method)
    deadline = time.monotonic() + timeout
    try:
        while not group.join(timeout=0.2):
            if time.monotonic() > deadline:
                for process in group.processes:
                    process.kill()
                    process.join()
                return "hang"
    except Exception as error:  # a rank raised or died: the others are stopped
        said = [line for line in str(error).splitlines() if line.strip()]
        return said[-1] if said else type(error).__name__
    return ""


def all_reduce(diagnosis: Diagnosis, facts: Facts, args: argparse.Namespace) -> str:
    """Run the all-reduce if asked and possible; "" when it passed or did not run."""
    if args.all_reduce is False:
        return ""
    if not diagnosis.usable and not args.cpu_ok:
        show("all-reduce", "skipped: no usable GPU (--cpu-ok runs it on 2 CPU "
                           "processes)")
        return ""
    backend, world = ("nccl", facts.torch_gpus) if diagnosis.usable else ("gloo",
                                                                           CPU_RANKS)
    show("all-reduce", f"{backend} on {world} processes, {args.timeout:.0f} s at most")
    start = time.monotonic()
    problem = run_ranks(rank_main, backend, world, args.timeout)
    if problem == "hang":
        show("all-reduce", f"no result after {args.timeout:.0f} s: {HANG_HELP}")
        return f"{backend} start-up hang: rerun with NCCL_DEBUG=INFO (see above)"
    if problem:
        show("all-reduce", f"failed: {problem}")
        return f"the {backend} all-reduce failed: {problem}"[:WIDTH - 6]
    seconds = time.monotonic() - start
    show("all-reduce", f"every rank got the right sum ({seconds:.1f} s)")
    return ""


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m utils.env_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--cpu-ok", action="store_true",
                   help="a CPU run is what you want: exit 0 without GPUs")
    p.add_argument("--all-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help="all-reduce over one process per GPU (default: on; on the CPU "
                        "only with --cpu-ok, 2 gloo processes)")
    p.add_argument("--timeout", type=float, default=TIMEOUT,
                   help=f"seconds the all-reduce may take (default {TIMEOUT:.0f})")
    return p


def main(argv: list[str] | None = None) -> int:
    """Probe, diagnose, optionally all-reduce; the exit code (0: good to go)."""
    args = parser().parse_args(argv)
    torch, problem = probe_libraries()
    if torch is None:
        return show_verdict(1, f"FAIL: {problem}")
    facts = probe(torch, problem)
    diagnosis = diagnose(facts)
    show("diagnosis", f"{diagnosis.name}: {diagnosis.why}")
    group_problem = all_reduce(diagnosis, facts, args)
    return show_verdict(*verdict(facts, diagnosis, args.cpu_ok, group_problem))


if __name__ == "__main__":
    sys.exit(main())
