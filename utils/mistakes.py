"""Helpers of the common-mistakes appendix: catch a hang, turn on DETAIL checks,
trim errors.

- ``hangs(fn, world_size, *args)`` runs ``fn`` on local ranks and reports a hang as a
  fact (``True`` and the ranks still waiting) instead of a timing;
- ``detail_group()`` gives this rank a process group checked as
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks the default group of a ``torchrun`` job;
- ``mismatch_report(message)`` keeps the lines of torch's "Detected mismatch between
  collectives" error that do not depend on the machine;
- ``audit_summary(audit)`` prints an ``audit_shards`` result in one line.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import torch.distributed as dist

from .audit import ShardAudit
from .launch import RankTimeoutError, run_distributed

__all__ = ["hangs", "detail_group", "mismatch_report", "audit_summary"]


def hangs(fn: Callable[..., Any], world_size: int, *args: Any,
          timeout: float = 5.0) -> tuple[bool, list[int]]:
    """``(True, ranks still running)`` if ``fn`` on ``world_size`` ranks is not done in
    ``timeout`` seconds, else ``(False, [])``; the ranks are stopped either way."""
    try:
        run_distributed(fn, world_size, *args, timeout=timeout)
    except RankTimeoutError as err:
        return True, list(err.pending)
    return False, []


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


def audit_summary(audit: ShardAudit, limit: int = 4) -> str:
    """One line of an ``audit_shards`` result: per-rank counts, what was never seen
    or repeated."""
    def short(items):
        items = list(items)
        return ("[" + ", ".join(map(str, items[:limit]))
                + (", ...]" if len(items) > limit else "]"))

    return (f"per rank {list(audit.counts)} | never seen {len(audit.missing)} | "
            f"repeated {len(audit.duplicates)}"
            + (f": {short(audit.duplicates)}" if audit.duplicates else "")
            + f" | partition: {audit.is_partition}")
