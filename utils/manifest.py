"""A manifest of shards: what a writer wrote, kept beside the shards (chapter 16).

A stream of tar shards has no index: a reader learns how many samples a shard holds
only by reading it, and cannot tell a shard cut short by a partial upload from a
short one. The manifest, written once when the shards are written, says it:

- ``write_manifest(folder, names)``: ``manifest.json`` in ``folder``, one entry per
  shard in ``names`` order: its ``name``, ``bytes``, ``sha256`` and ``samples``; for a
  tar shard also ``spans``, each sample's ``[key, first byte, stop byte]`` (from its
  first member's header to the end of its last member's padded data), so that a
  reader can fetch one sample with an HTTP Range request (``utils.shard_index``);
- ``load_manifest(where)``: a manifest from a path or an ``http(s)://`` URL;
- ``check_shard(entry, data)``: raises ``ShardMismatch`` when the bytes read are not
  the bytes written (length first, then the SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile

__all__ = ["MANIFEST", "ShardMismatch", "write_manifest", "load_manifest",
           "check_shard", "shard_entry"]

MANIFEST = "manifest.json"
_BLOCK = 512  # tar's block: every member's data is padded to a multiple of it


class ShardMismatch(ValueError):
    """A shard's bytes differ from what the manifest recorded at write time."""


def _tar_spans(path: str) -> list[list]:
    """``[key, first, stop]`` per sample of a WebDataset tar shard, in stored order:
    the members sharing a key (the name up to its first dot) are one sample."""
    spans: list[list] = []
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            key = os.path.basename(member.name).split(".", 1)[0]
            stop = member.offset_data + -(-member.size // _BLOCK) * _BLOCK
            if spans and spans[-1][0] == key:
                spans[-1][2] = stop
            else:
                spans.append([key, member.offset, stop])
    return spans


def _parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def shard_entry(path: str) -> dict:
    """The manifest's entry for one shard file (``.tar`` or ``.parquet``)."""
    with open(path, "rb") as f:
        data = f.read()
    entry = {"name": os.path.basename(path), "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest()}
    if path.endswith(".tar"):
        entry["spans"] = _tar_spans(path)
        entry["samples"] = len(entry["spans"])
    elif path.endswith(".parquet"):
        entry["samples"] = _parquet_rows(path)
    else:
        raise ValueError(f"{path}: a manifest lists .tar or .parquet shards")
    return entry


def write_manifest(folder: str, names) -> str:
    """Write ``folder/manifest.json`` for the shards ``names`` (file names in
    ``folder``, in the order readers list them); returns its path. Written to a
    temporary name and renamed, so a reader never sees half a manifest."""
    names = list(names)
    if not names:
        raise ValueError("names is empty: a manifest lists at least one shard")
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise FileNotFoundError(f"no shard {missing[0]!r} in {folder!r}")
    shards = [shard_entry(os.path.join(folder, n)) for n in names]
    manifest = {"shards": shards, "samples": sum(s["samples"] for s in shards)}
    path = os.path.join(folder, MANIFEST)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, path)
    return path


def load_manifest(where: str, timeout: float = 30.0) -> dict:
    """The manifest at ``where``: a path, or an ``http://``/``https://`` URL."""
    if where.startswith(("http://", "https://")):
        import urllib.request

        with urllib.request.urlopen(where, timeout=timeout) as response:
            manifest = json.load(response)
    else:
        with open(where) as f:
            manifest = json.load(f)
    if not isinstance(manifest, dict) or "shards" not in manifest:
        raise ValueError(f"{where} is not a manifest (no 'shards' list)")
    return manifest


def check_shard(entry: dict, data: bytes) -> None:
    """Raise ``ShardMismatch`` unless ``data`` is the shard ``entry`` describes."""
    if len(data) != entry["bytes"]:
        raise ShardMismatch(f"{entry['name']}: read {len(data):,} bytes, the manifest "
                            f"says {entry['bytes']:,} (a partial upload or a cut "
                            "connection)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise ShardMismatch(f"{entry['name']}: SHA-256 {digest[:12]}... differs from "
                            f"the manifest's {entry['sha256'][:12]}...")
