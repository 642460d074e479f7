"""Which device a collective's tensors must live on: one answer, used by every
collective in utils.

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

import torch
import torch.distributed as dist

__all__ = ["collective_device", "group_device_types"]


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
