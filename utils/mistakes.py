"""Finding a mismatch of collectives (chapter 4): DETAIL checks in a rank, torch's
error trimmed.

- ``detail_group()`` gives this rank a process group checked as
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks the default group of a ``torchrun`` job;
- ``mismatch_report(message)`` keeps the lines of torch's "Detected mismatch between
  collectives" error that do not depend on the machine.
"""

from __future__ import annotations

import os
import re

import torch.distributed as dist

__all__ = ["detail_group", "mismatch_report"]


def detail_group(level: str = "DETAIL"):
    """A new group over all ranks, created with ``TORCH_DISTRIBUTED_DEBUG=level``.

    torch reads the variable when ``torch.distributed`` is imported, and at ``DETAIL``
    wraps every group created afterwards: each collective first compares its operation,
    shapes and dtypes across the ranks. Under ``torchrun`` the variable is set before
    Python starts, so the default group is wrapped. ``run_distributed``'s ranks were
    forked from a process that imported torch earlier, so this re-reads the variable
    and makes a group with it.
    """
    if level not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"level={level!r} is not a TORCH_DISTRIBUTED_DEBUG level; "
                         "expected 'OFF', 'INFO' or 'DETAIL'")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
    dist.set_debug_level_from_env()
    return dist.new_group()


_FINGERPRINT = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\("
    r"(SequenceNumber=\d+, OpType=\w+(?:, TensorShape=\[[^\]]*\])?"
    r"(?:, TensorDtypes=\w+)?)")


def mismatch_report(message: str) -> str:
    """The stable lines of torch's collective-mismatch error
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

    Keeps the first sentence, each rank's fingerprint (sequence number, operation,
    shape, dtype; not the long tensor options) and what differs. Raises ``ValueError``
    for any other message, so a changed error text is noticed rather than printed as
    a mismatch.
    """
    if "Detected mismatch between collectives" not in message:
        raise ValueError(f"not a collective-mismatch error: {message[:200]!r}")
    lines = ["Detected mismatch between collectives on ranks."]
    lines += [f"  rank {rank}: {fields}"
              for rank, fields in _FINGERPRINT.findall(message)]
    differ = message.partition("Collectives differ in the following aspects:")[2]
    if differ:
        lines.append("  differ in: " + " ".join(differ.split()))
    return "\n".join(lines)

