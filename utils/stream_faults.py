"""Faults and latency: what WebDataset and Hugging Face ``datasets`` do when the store
that serves their shards misbehaves, and what a reader can do about it (the appendix
"Faults and latency", after chapter 16).

- ``FAULTS``: a named shard answered with 404, its connection cut halfway, the server
  down for a few seconds, the shard cut short by a partial upload, its body stalled
  for a while or for good, each played by ``utils.streams.ShardServer``;
- ``fetch_shard`` / ``ShardFetcher`` / ``checked_webdataset``: WebDataset's tar
  expansion fed whole shards fetched with a timeout and retries and checked against
  the manifest (``utils.manifest``) before a sample is read, so that a retry can
  neither lose nor repeat a sample; failing at once, or skipping the shard and
  counting it;
- ``read_skipping``: that reader on every rank of a process group, the skipped shards
  all-reduced at each step so that every rank knows them and all stop at the same
  step (the rank with the fewest batches sets it);
- ``bounded_hf_stream``: ``datasets``' stream with a read timeout and fewer retries;
- ``measure``: every reader against every fault (each case in a process of its own,
  bounded by a limit), and a latency table (per-request latency x DataLoader
  workers): ``python -m utils.stream_faults --out book/results/stream_faults_cpu.json``;
  ``format_table`` and ``plot_latency`` show the results file.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import streams
from ._checks import check_bool, check_int
from .manifest import (MANIFEST, ShardMismatch, check_shard, load_manifest,
                       write_manifest)

__all__ = ["FAULTS", "READERS", "ShardFetchError", "fault_options", "fetch_shard",
           "ShardFetcher", "checked_webdataset", "curl_urls", "bounded_hf_stream",
           "read_skipping", "skip_epoch", "make_shards", "run_case", "measure",
           "format_table", "plot_latency"]

FAULTS = ("404", "cut", "down", "truncated", "stall", "stall forever")
READERS = {"webdataset": ("default", "curl flags", "checked fetch"),
           "parquet": ("default", "timeout + retries")}
FAULTED = 1          # the shard that misbehaves
SETTINGS = {"limit": 45.0, "down": 8.0, "stall": 20.0,   # seconds
            "timeout": 3.0, "retries": 5, "delay": 2.0}  # the remedies'


class ShardFetchError(OSError):
    """A shard that could not be fetched whole within the retries."""


def fault_options(fault: str, name: str, size: int, spans=None) -> dict:
    """``ShardServer``'s keywords that play ``fault`` on the shard ``name`` of ``size``
    bytes: the cut halfway, the truncation at the first byte of its middle sample
    (``spans``: the manifest's, for a tar; else halfway)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    middle = spans[len(spans) // 2][1] if spans else size // 2
    return {"404": {"missing": [name]}, "cut": {"cut": {name: size // 2}},
            "down": {"down": SETTINGS["down"]},
            "truncated": {"truncate": {name: middle}},
            "stall": {"stall": {name: SETTINGS["stall"]}},
            "stall forever": {"stall": {name: -1}}}[fault]


def fetch_shard(url: str, entry: dict | None = None, timeout: float = 3.0,
                retries: int = 5, delay: float = 2.0) -> bytes:
    """The whole shard at ``url``, read with ``timeout`` seconds per socket operation
    (a connection, a stalled read) and up to ``retries`` more tries ``delay`` seconds
    apart; checked against the manifest's ``entry`` (``check_shard``) when given.
    Raises ``FileNotFoundError`` on a 404 and ``ShardMismatch`` on bytes that differ
    from the manifest's at once (a retry would fetch the same), ``ShardFetchError``
    when every try failed."""
    import http.client
    import urllib.error
    import urllib.request

    retries = check_int("retries", retries, minimum=0)
    last = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(delay)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                data = response.read()
        except urllib.error.HTTPError as err:
            if err.code == 404:
                raise FileNotFoundError(f"{url}: 404 Not Found") from None
            last = err
        except (OSError, http.client.HTTPException) as err:  # refused, cut, timed out
            last = err
        else:
            if entry is not None:
                check_shard(entry, data)
            return data
    raise ShardFetchError(f"{url}: {retries + 1} tries failed; the last: "
                          f"{type(last).__name__}: {last}")


class ShardFetcher:
    """A WebDataset pipeline stage: ``{"url": ...}`` in, ``{"url", "stream"}`` out,
    each shard fetched whole by ``fetch_shard`` (and checked against ``manifest``,
    a ``load_manifest`` dict, when given). ``skip=False``: the first failure is
    raised; ``skip=True``: the shard is skipped and listed in ``skipped`` as
    ``(url, "Type: message")``."""

    def __init__(self, manifest: dict | None = None, skip: bool = False, **fetch):
        self.entries = {e["name"]: e for e in (manifest or {}).get("shards", [])}
        self.skip = check_bool("skip", skip)
        self.fetch = fetch
        self.skipped: list[tuple[str, str]] = []

    def __call__(self, src):
        for shard in src:
            url = shard["url"]
            entry = self.entries.get(url.rsplit("/", 1)[-1])
            try:
                data = fetch_shard(url, entry, **self.fetch)
            except (OSError, ShardMismatch) as err:
                if not self.skip:
                    raise
                self.skipped.append((url, f"{type(err).__name__}: {err}"))
                continue
            yield {**shard, "stream": io.BytesIO(data)}


def checked_webdataset(urls, fetcher: ShardFetcher):
    """WebDataset's own stages as ``webdataset_stream`` has them (``split_by_node``,
    ``split_by_worker``, tar expansion, samples grouped by key, decoding), the shards
    opened by ``fetcher`` instead of ``curl``. Yields ``(worker, index, image,
    label)``."""
    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander

    return wds.DataPipeline(
        wds.SimpleShardList(list(urls)), wds.split_by_node, wds.split_by_worker,
        fetcher, tar_file_expander, group_by_keys, wds.decode(),
        wds.map(streams._wds_sample))


def curl_urls(urls, timeout: float = 3.0, retries: int = 5,
              delay: float = 2.0) -> list[str]:
    """``pipe:curl`` URLs with a time limit per try and retries that also wait out a
    refused connection (WebDataset's ``http://`` opener, ``gopen_curl``, sets
    ``--connect-timeout 30 --retry 30 --retry-delay 2`` and no time limit)."""
    flags = (f"-fsSL --max-time {timeout:g} --retry {retries} --retry-connrefused "
             f"--retry-delay {delay:g}")
    return [f"pipe:curl {flags} {url}" for url in urls]


def bounded_hf_stream(urls, timeout: float = 3.0, retries: int = 5,
                      delay: float = 2.0):
    """``datasets``' Parquet stream (one rank) with aiohttp's connection and read
    timeouts set to ``timeout`` (its default: 300 s for a whole request) and
    ``retries`` tries ``delay`` s apart at opening and at each read (``datasets.config``
    ``STREAMING_OPEN_*`` and ``STREAMING_READ_*``; defaults 20 tries 5 s apart).
    The settings are module globals: they hold for this process."""
    import aiohttp
    import datasets

    for kind in ("OPEN", "READ"):
        setattr(datasets.config, f"STREAMING_{kind}_MAX_RETRIES", retries)
        setattr(datasets.config, f"STREAMING_{kind}_RETRY_INTERVAL", delay)
    limit = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    datasets.disable_progress_bars()
    return datasets.load_dataset(
        "parquet", data_files={"train": list(urls)}, split="train", streaming=True,
        storage_options={"http": {"client_kwargs": {"timeout": limit}}})


def read_skipping(urls, manifest_url: str, batch_size: int, all_reduce: bool = True,
                  **fetch) -> dict:
    """One rank's epoch of ``checked_webdataset`` with shards skipped and counted: at
    every step the ranks all-reduce ``[ranks out of samples, shards skipped]``, so all
    of them stop at the step where the first runs out, each knowing how many shards
    the job skipped. Run it on every rank (``skip_epoch``). Returns this rank's
    ``batches``, ``indices``, ``skipped`` (its own), ``skipped_total`` and
    ``failures`` (``(url, error)``)."""
    import torch
    import torch.distributed as dist

    fetcher = ShardFetcher(load_manifest(manifest_url), skip=True, **fetch)
    samples = iter(checked_webdataset(urls, fetcher))
    batches, indices = 0, []
    while True:
        batch = [index for _, (_, index, _, _) in zip(range(batch_size), samples)]
        counts = torch.tensor([int(not batch), len(fetcher.skipped)])
        if all_reduce:
            dist.all_reduce(counts)
        if counts[0] > 0 or not batch:  # a rank is out of samples: every rank stops
            break
        batches += 1
        indices.extend(batch)
    return {"batches": batches, "indices": indices, "skipped": len(fetcher.skipped),
            "skipped_total": int(counts[1]), "failures": fetcher.skipped}


def skip_epoch(urls, manifest_url: str, world_size: int = 2, batch_size: int = 8,
               timeout: float = 60.0, **fetch) -> list[dict]:
    """``read_skipping`` on ``world_size`` local ranks (``utils.launch``)."""
    from .launch import run_distributed

    batch_size = check_int("batch_size", batch_size, minimum=1)
    return run_distributed(_read_skipping_with, world_size, list(urls), manifest_url,
                           batch_size, fetch, timeout=timeout)


def _read_skipping_with(urls, manifest_url, batch_size, fetch):
    return read_skipping(urls, manifest_url, batch_size, **fetch)


def make_shards(root: str, n: int = 64, shards: int = 4) -> dict:
    """Both formats of the first ``n`` stand-in images (``utils.streams.stand_in``) in
    ``shards`` shards under ``root``, each folder with its manifest:
    ``{fmt: (folder, names)}``."""
    images, labels = streams.stand_in(os.path.join(root, "data"), n)
    out = {}
    for fmt, write in (("webdataset", streams.write_webdataset),
                       ("parquet", streams.write_parquet)):
        folder = os.path.join(root, fmt)
        names = write(folder, images, labels, shards)
        write_manifest(folder, names)
        out[fmt] = (folder, names)
    return out


def _reader(case: dict):
    """The indices ``case``'s reader yields, in order."""
    urls, fetch = case["urls"], {k: SETTINGS[k] for k in ("timeout", "retries",
                                                           "delay")}
    if case["library"] == "parquet":
        ds = (streams.hf_stream(urls, 0, 1) if case["reader"] == "default"
              else bounded_hf_stream(urls, **fetch))
        return (row["index"] for row in ds)
    if case["reader"] == "default":
        ds = streams.webdataset_stream(urls)
    elif case["reader"] == "curl flags":
        ds = streams.webdataset_stream(curl_urls(urls, **fetch))
    else:
        ds = checked_webdataset(urls, ShardFetcher(load_manifest(case["manifest"]),
                                                   **fetch))
    return (index for _, index, _, _ in ds)


def _play_case(case: dict) -> None:
    """Run one case (in this process, which ``run_case`` started) and print its
    outcome as one JSON line: at the end, at an error, or when ``limit`` s have
    passed (then the process exits at once, whatever it was waiting for)."""
    seen, start = [], time.monotonic()

    def report(**outcome) -> None:
        print(json.dumps({"read": len(seen), "distinct": len(set(seen)),
                          "seconds": round(time.monotonic() - start, 1), **outcome}),
              flush=True)

    def give_up() -> None:
        report(error=None, waiting=True)
        os._exit(0)

    threading.Timer(case["limit"], give_up).start()
    try:
        for index in _reader(case):
            seen.append(int(index))
    except Exception as err:  # what the reader raised is the measurement
        lines = str(err).strip().splitlines() or [""]
        report(error=f"{type(err).__name__}: {lines[0][:400]}", waiting=False)
    else:
        report(error=None, waiting=False)
    os._exit(0)


def _child(flag: str, spec: dict, limit: float) -> dict:
    """Run ``python -m utils.stream_faults FLAG SPEC`` in a session of its own; its
    last line of output as a dict; the whole session killed after ``limit`` s."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", "utils.stream_faults", flag,
                             json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # curl children too
        except ProcessLookupError:
            pass
        proc.wait()
    lines = out.strip().splitlines()
    return json.loads(lines[-1]) if lines else {"error": f"no answer in {limit} s"}


def run_case(library: str, reader: str, fault: str, shards: dict,
             limit: float | None = None) -> dict:
    """One reader of ``library`` (``READERS``) against ``fault`` on shard
    ``FAULTED`` of ``shards`` (``make_shards``), served by a ``ShardServer`` playing
    it: ``read`` (samples yielded), ``distinct``, ``expected``, ``seconds``,
    ``error`` (``"Type: first line"`` or None) and ``waiting`` (still waiting after
    ``limit`` s, default ``SETTINGS["limit"]``)."""
    if reader not in READERS.get(library, ()):
        raise ValueError(f"reader must be one of {READERS.get(library)} for "
                         f"library {library!r}, got {reader!r}")
    folder, names = shards[library]
    manifest = load_manifest(os.path.join(folder, MANIFEST))
    entry = manifest["shards"][FAULTED]
    options = fault_options(fault, entry["name"], entry["bytes"], entry.get("spans"))
    limit = SETTINGS["limit"] if limit is None else limit
    with streams.ShardServer(folder, **options) as server:
        case = {"library": library, "reader": reader, "urls": server.urls(names),
                "manifest": server.url(MANIFEST), "limit": limit}
        outcome = _child("--case", case, limit + 60)
    return {"library": library, "reader": reader, "fault": fault,
            "expected": manifest["samples"], **outcome}


def _time_epochs(spec: dict) -> None:
    """Print the seconds of each of ``spec["epochs"]`` epochs of one library's stream
    through a DataLoader of ``spec["workers"]`` workers, as a JSON list."""
    from torch.utils.data import DataLoader

    urls, times = spec["urls"], []
    for _ in range(spec["epochs"]):
        start = time.perf_counter()
        ds = (streams.webdataset_stream(urls) if spec["library"] == "webdataset"
              else streams.hf_stream(urls, 0, 1))
        n = sum(len(b["index"] if isinstance(b, dict) else b[1])
                for b in DataLoader(ds, batch_size=32, num_workers=spec["workers"]))
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": times, "samples": n}), flush=True)


def latency_table(shards: dict, latencies=(0.0, 0.25), workers=(0, 2, 4),
                  epochs: int = 2) -> list[dict]:
    """Seconds per epoch (the fastest of ``epochs``, DataLoader start included) and
    images per second, for each library x per-request latency x workers."""
    rows = []
    for library, (folder, names) in shards.items():
        for latency in latencies:
            with streams.ShardServer(folder, latency=latency) as server:
                for w in workers:
                    spec = {"library": library, "urls": server.urls(names),
                            "workers": w, "epochs": epochs}
                    out = _child("--epochs", spec, 300)
                    best = min(out["seconds"])
                    rows.append({"library": library, "latency_s": latency,
                                 "workers": w, "samples": out["samples"],
                                 "seconds": round(best, 3),
                                 "images_per_s": round(out["samples"] / best, 1)})
    return rows


def measure(root: str, parallel: int = 3) -> dict:
    """Every reader x fault (``parallel`` cases at a time: most of them wait) on 64
    samples in 4 shards, and the latency table on 256 samples in 8 shards."""
    shards = make_shards(os.path.join(root, "faults"), 64, 4)
    cases = [(lib, reader, fault) for lib, readers in READERS.items()
             for reader in readers for fault in FAULTS]
    with ThreadPoolExecutor(parallel) as pool:
        faults = list(pool.map(lambda c: run_case(*c, shards), cases))
    latency = latency_table(make_shards(os.path.join(root, "latency"), 256, 8))
    return {"settings": {**SETTINGS, "faulted_shard": FAULTED, "fault_shards": 4,
                         "fault_samples": 64, "latency_samples": 256,
                         "latency_shards": 8, "batch_size": 32},
            "faults": faults, "latency": latency, "versions": _versions()}


def _versions() -> dict:
    import aiohttp
    import datasets
    import webdataset

    curl = subprocess.run(["curl", "--version"], capture_output=True, text=True)
    return {"webdataset": webdataset.__version__, "datasets": datasets.__version__,
            "aiohttp": aiohttp.__version__, "curl": curl.stdout.split()[1],
            "cpus": len(os.sched_getaffinity(0))}


def outcome(row: dict) -> str:
    """One case's outcome in words: what was read, and how it ended."""
    read = f"{row['read']}/{row['expected']}"
    if row["distinct"] != row["read"]:
        read += f" ({row['read'] - row['distinct']} repeated)"
    if row.get("waiting"):
        return f"{read}, still waiting after {row['seconds']:g} s"
    return f"{read} in {row['seconds']:g} s, {_short(row['error'])}"


def _short(error: str | None) -> str:
    """An error as a table shows it: WebDataset's ``Pipe`` errors name the whole
    ``curl`` command; the table keeps its exit status."""
    import re

    if error is None:
        return "no error"
    status = re.search(r"\): exit (\d+)", error)
    if status:
        return f"{error.split(':')[0]}: curl exited with {status.group(1)}"
    return error


def format_table(result: dict, part: str = "both", width: int = 88) -> str:
    """The fault table (reader x fault: samples read of expected, seconds, the error)
    and/or (``part``: ``"faults"``, ``"latency"`` or ``"both"``) the latency table of
    a results file's ``result``."""
    if part not in ("faults", "latency", "both"):
        raise ValueError(f"part must be 'faults', 'latency' or 'both', got {part!r}")
    lines = []
    for row in result["faults"] if part != "latency" else []:
        head = f"{row['library']} {row['reader']}, {row['fault']}:"
        text = f"{head:<38} {outcome(row)}"
        lines.append(text if len(text) <= width else text[:width - 3] + "...")
    if part == "faults":
        return "\n".join(lines)
    lines += ["", f"{'library':<11} {'latency':>8} {'workers':>8} {'s/epoch':>8} "
              f"{'images/s':>9}"]
    for row in result["latency"]:
        lines.append(f"{row['library']:<11} {row['latency_s'] * 1000:>5.0f} ms "
                     f"{row['workers']:>8} {row['seconds']:>8.2f} "
                     f"{row['images_per_s']:>9.0f}")
    return "\n".join(lines).strip("\n")


def plot_latency(result: dict):
    """Images per second against DataLoader workers, one line per library and
    per-request latency; returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    keys = dict.fromkeys((r["library"], r["latency_s"]) for r in result["latency"])
    for library, latency in keys:
        rows = [r for r in result["latency"]
                if (r["library"], r["latency_s"]) == (library, latency)]
        ax.plot([r["workers"] for r in rows], [r["images_per_s"] for r in rows],
                marker="o", linestyle="-" if latency else "--",
                label=f"{library}, {latency * 1000:.0f} ms per request")
    ax.set_xlabel("DataLoader workers")
    ax.set_ylabel("images per second")
    ax.set_xticks(sorted({r["workers"] for r in result["latency"]}))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> None:
    import argparse

    from . import results

    parser = argparse.ArgumentParser(prog="python -m utils.stream_faults",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the results file to write")
    parser.add_argument("--case", help=argparse.SUPPRESS)    # run_case's child
    parser.add_argument("--epochs", help=argparse.SUPPRESS)  # latency_table's child
    args = parser.parse_args(argv)
    if args.case:
        return _play_case(json.loads(args.case))
    if args.epochs:
        return _time_epochs(json.loads(args.epochs))
    if not args.out:
        parser.error("--out is required")
    with tempfile.TemporaryDirectory(prefix="stream_faults_") as root:
        result = measure(root)
    result["command"] = ("python -m utils.stream_faults --out "
                         "book/results/stream_faults_cpu.json")
    results.write(args.out, result, ["utils/stream_faults.py", "utils/streams.py",
                                     "utils/manifest.py"])
    print(format_table(result))


if __name__ == "__main__":
    main()
