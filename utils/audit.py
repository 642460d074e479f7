"""Audit per-rank index lists: the book proves its claims about shards with this, not
with prose."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ._checks import check_int

__all__ = ["ShardAudit", "audit_shards"]


@dataclass(frozen=True)
class ShardAudit:
    """What a set of per-rank shards covers, repeats and shares.

    ``padding`` lists ``(rank, position, index)`` for the slots beyond the data set's
    size in the order ``DistributedSampler`` deals indices in (position 0 of rank 0, 1,
    ..., then position 1 of every rank, ...): slot ``position`` of ``rank`` is global
    slot ``position * world_size + rank``, and global slots ``>= dataset_len`` can only
    hold repeats. Other repeated indices show up in ``duplicates`` only.
    """

    dataset_len: int
    counts: tuple[int, ...]
    missing: tuple[int, ...]
    duplicates: dict[int, int]
    padding: tuple[tuple[int, int, int], ...]
    overlap: tuple[tuple[int, ...], ...]
    out_of_range: tuple[int, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return len(self.counts)

    @property
    def covered(self) -> int:
        """How many distinct valid indices appear on at least one rank."""
        return self.dataset_len - len(self.missing)

    @property
    def coverage(self) -> float:
        """Fraction of ``range(dataset_len)`` that appears on some rank (1.0 for an
        empty data set)."""
        return 1.0 if self.dataset_len == 0 else self.covered / self.dataset_len

    @property
    def disjoint(self) -> bool:
        """No index appears on two different ranks."""
        return all(
            self.overlap[a][b] == 0
            for a in range(self.world_size)
            for b in range(self.world_size)
            if a != b
        )

    @property
    def balanced(self) -> bool:
        """Every rank has the same number of indices."""
        return len(set(self.counts)) <= 1

    @property
    def is_partition(self) -> bool:
        """Every index appears exactly once over all ranks: nothing missing, repeated
        or invalid."""
        return not self.missing and not self.duplicates and not self.out_of_range

    def __repr__(self) -> str:
        def short(items, limit=12):
            items = list(items)
            text = ", ".join(map(str, items[:limit]))
            return f"[{text}{', ...' if len(items) > limit else ''}]"

        dup = ", ".join(
            f"{i}x{c}" for i, c in list(sorted(self.duplicates.items()))[:12]
        )
        if len(self.duplicates) > 12:
            dup += ", ..."
        lines = [
            f"ShardAudit: {self.world_size} ranks, dataset_len={self.dataset_len}",
            f"  per-rank counts : {list(self.counts)} (balanced={self.balanced})",
            f"  coverage        : {self.covered}/{self.dataset_len} indices "
            f"({self.coverage:.1%}), missing {len(self.missing)}: "
            f"{short(self.missing)}",
            f"  duplicates      : {len(self.duplicates)} indices seen more than once"
            + (f": {{{dup}}}" if self.duplicates else ""),
            f"  padding         : {len(self.padding)} slots beyond dataset_len "
            f"(rank, pos, index): {short(self.padding, 6)}",
            f"  disjoint ranks  : {self.disjoint}",
            f"  is partition    : {self.is_partition}",
        ]
        if self.world_size > 1 and not self.disjoint:
            pairs = [
                f"{a}&{b}: {self.overlap[a][b]}"
                for a in range(self.world_size)
                for b in range(a + 1, self.world_size)
                if self.overlap[a][b]
            ]
            lines.insert(-1, f"  shared indices  : {short(pairs, 8)}")
        if self.out_of_range:
            lines.append(f"  out of range    : {short(self.out_of_range)}")
        return "\n".join(lines)


def _as_int_list(shard, rank: int) -> list[int]:
    if isinstance(shard, torch.Tensor):
        if shard.is_floating_point() or shard.is_complex() or shard.dtype == torch.bool:
            raise TypeError(
                f"shards[{rank}] must hold integer indices, "
                f"got a tensor of dtype {shard.dtype}"
            )
        if shard.dim() > 1:
            raise ValueError(
                f"shard of rank {rank} must be one-dimensional, "
                f"got shape {tuple(shard.shape)}"
            )
        return shard.tolist()
    try:
        return [check_int(f"shards[{rank}][{i}]", v) for i, v in enumerate(shard)]
    except TypeError as exc:
        raise TypeError(
            f"shards[{rank}] must be a sequence of integer indices: {exc}"
        ) from None


def audit_shards(shards: Sequence[Sequence[int]], dataset_len: int) -> ShardAudit:
    """Audit ``shards[r]``, the indices rank ``r`` visits,
    against ``range(dataset_len)``."""
    dataset_len = check_int("dataset_len", dataset_len, minimum=0)
    if isinstance(shards, (str, bytes)) or not hasattr(shards, "__len__"):
        raise TypeError("shards must be a sequence with one list of indices per rank")
    if len(shards) == 0:
        raise ValueError(
            "shards is empty; "
            "expected one list of indices per rank (at least one rank)"
        )
    lists = [_as_int_list(s, r) for r, s in enumerate(shards)]
    world = len(lists)

    counts = tuple(len(s) for s in lists)
    total = Counter(i for s in lists for i in s)
    out_of_range = tuple(sorted(i for i in total if not 0 <= i < dataset_len))
    missing = tuple(i for i in range(dataset_len) if i not in total)
    duplicates = {i: c for i, c in sorted(total.items()) if c > 1}

    # Padding, in DistributedSampler's layout: slot `pos` of rank `r` is global position
    # pos * world + r, and slots at positions >= dataset_len exist only to even out
    # the ranks.
    padding = [
        (r, pos, lists[r][pos])
        for pos in range(max(counts, default=0))
        for r in range(world)
        if pos < counts[r] and pos * world + r >= dataset_len
    ]

    sets = [set(s) for s in lists]
    overlap = tuple(
        tuple(len(sets[a] & sets[b]) for b in range(world)) for a in range(world)
    )
    return ShardAudit(
        dataset_len=dataset_len,
        counts=counts,
        missing=missing,
        duplicates=duplicates,
        padding=tuple(padding),
        overlap=overlap,
        out_of_range=out_of_range,
    )
