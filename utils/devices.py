"""What a device takes: which device a collective's tensors must live on (one answer,
used by every collective in utils), and whether ``torch.compile`` can work on it.

``nccl`` only moves CUDA tensors
(``RuntimeError: No backend type associated with device type cpu`` otherwise); ``gloo``
moves CPU tensors. A group made with ``"cpu:gloo,cuda:nccl"`` takes both, and small
bookkeeping tensors (counts, metrics) are cheapest on the CPU there. So:

* no process group, or a group that supports the CPU: ``cpu``;
* a group that supports only an accelerator: that accelerator's *current* device, the
  one this rank selected with ``torch.cuda.set_device(local_rank)``, never ``cuda:0`` on
  every rank.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig

import torch
import torch.distributed as dist

__all__ = ["collective_device", "group_device_types", "compile_problem"]


def group_device_types(group=None) -> list[str]:
    """The device types ``group`` (default: the default group) runs collectives on."""
    group = group if group is not None else dist.group.WORLD
    # torch >= 2.2: a backend per device type
    devices = getattr(group, "_device_types", None)
    if devices is not None:
        return [torch.device(d).type for d in devices]
    # older: "gloo", "nccl" or "cpu:gloo,cuda:nccl"
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return [part.split(":")[0] for part in backend.split(",")]
    return ["cuda"] if backend == "nccl" else ["cpu"]


def collective_device(group=None) -> torch.device:
    """The device for a collective's tensors on ``group`` (see the module docstring)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")  # no process group: nothing to move anywhere
    types = group_device_types(group)
    if not types or "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "current_device"):
        return torch.device(kind)
    return torch.device(kind, module.current_device())


def compile_problem(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot work on ``device`` here, or ``None``: an unsupported
    Python; on the CPU no C++ compiler (inductor's: ``$CXX``, else g++, clang++ on
    macOS); on CUDA no Triton, or no C compiler or ``Python.h`` for the launcher Triton
    builds for each kernel. The text ends with what to do."""
    try:
        import torch._dynamo

        supported = torch._dynamo.is_dynamo_supported()
    except Exception:  # an old or partial torch
        supported = False
    if not supported:
        return (f"--compile: torch.compile does not support this Python "
                f"({sys.version.split()[0]}) with torch {torch.__version__}; leave out "
                f"--compile")
    if torch.device(device).type == "cpu":
        default = "clang++" if sys.platform == "darwin" else "g++"
        compiler = os.environ.get("CXX", default)
        if shutil.which(compiler) is None:
            return (f"--compile on the CPU needs a C++ compiler, and {compiler!r} "
                    f"(from $CXX or the default {default}) is not found; install one, "
                    f"set CXX, or leave out --compile")
        return None
    if importlib.util.find_spec("triton") is None:
        return ("--compile on CUDA needs Triton (pip install triton); leave out "
                "--compile")
    compiler = os.environ.get("CC") or next(
        (c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None or shutil.which(compiler) is None:
        return (f"--compile on CUDA needs a C compiler for Triton's launchers, and "
                f"{compiler or 'none'!s} (from $CC, else cc, gcc, clang) is not found; "
                f"install one, set CC, or leave out --compile")
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.exists(os.path.join(include, "Python.h")):
        return (f"--compile on CUDA needs Python's headers for Triton's launchers, and "
                f"Python.h is not in {include!r} (a python3-dev package, or a Python "
                f"built with them); or leave out --compile")
    return None
