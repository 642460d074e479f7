"""Images per second from streams of shards: local files against HTTP on loopback.

``python -m utils.stream_bench --out book/results/stream_throughput_cpu.json`` (about
two minutes on 2 cores). One process reads one epoch through a ``DataLoader``
(batches of 256, each image decoded to a uint8 tensor, as training needs it) of:

- WebDataset tar shards (``utils.streams.webdataset_stream``) and Parquet shards read
  by Hugging Face ``datasets`` streaming (``utils.streams.hf_stream``);
- each from local files and over HTTP from ``utils.streams.ShardServer`` (Python's
  ``http.server`` on ``127.0.0.1``, answering Range requests as object stores do, a
  process of its own on the same cores);
- with 0, 1, 2 and 4 workers, started by ``utils.workers.worker_context``
  (``forkserver``: the reading process has threads, fsspec's for HTTP among them).

The same images (the CIFAR-10 stand-in of ``utils.data``) are written in both formats
to a temporary folder. "Local" is page-cache reads: every shard is read once before
timing, and every case runs one untimed warm-up epoch. Then ``repeats`` rounds each
time every case once, interleaved (a machine that gets busier slows all cases alike),
and each case reports its median. A timed epoch is one ``for batch in loader`` pass,
the start of its workers included, as every epoch of a loader without
``persistent_workers`` pays it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader

from . import results, streams
from ._checks import check_int

__all__ = ["FULL", "SOURCES", "run_stream_bench", "format_table", "plot_throughput",
           "main"]

FULL = {"images": 4096, "shards": 16, "batch_size": 256, "workers": (0, 1, 2, 4),
        "repeats": 5}
TRANSPORTS = ("local", "http")
# What the figures depend on: this file, the streams it reads and the start method of
# their workers. utils.data only generates the pixels (any bytes read alike).
SOURCES = ["utils/stream_bench.py", "utils/streams.py",
           "utils/workers.py::worker_context", "utils/workers.py::PRELOAD"]
_LABELS = {"webdataset": "WebDataset", "parquet": "Parquet (datasets)"}


def _decode_row(row: dict) -> dict:
    """A Parquet row's image bytes as a ``32 x 32 x 3`` uint8 tensor."""
    image = np.frombuffer(row["image"], dtype=np.uint8).reshape(32, 32, 3)
    return {"index": row["index"], "image": torch.from_numpy(image.copy()),
            "label": row["label"]}


def _stream(fmt: str, urls: list[str]):
    """One process's stream of ``fmt`` over ``urls``, images decoded to tensors."""
    if fmt == "webdataset":
        return streams.webdataset_stream(urls)  # yields (worker, index, image, label)
    return streams.hf_stream(urls, rank=0, world_size=1, transform=_decode_row)


def _batch_images(fmt: str, batch) -> int:
    """How many images ``batch`` holds, checked to be uint8 ``32 x 32 x 3``."""
    images = batch[2] if fmt == "webdataset" else batch["image"]
    if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (32, 32, 3):
        raise TypeError(f"{fmt}: images are {images.dtype} {tuple(images.shape)}")
    return len(images)


def _epoch(case: dict, batch_size: int, context) -> tuple[float, int]:
    """One timed epoch of ``case``: ``(seconds, images read)``."""
    images, workers = 0, case["workers"]
    with warnings.catch_warnings():  # more workers than cores: asked for, on purpose
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = DataLoader(_stream(case["format"], case["urls"]),
                            batch_size=batch_size, num_workers=workers,
                            multiprocessing_context=context if workers else None)
        start = time.perf_counter()
        for batch in loader:
            images += _batch_images(case["format"], batch)
        return time.perf_counter() - start, images


def _write_shards(folder: str, images: int, shards: int) -> dict:
    """Both formats' shards of the first ``images`` stand-in images in ``folder``:
    ``{format: (paths relative to folder, bytes of each shard)}``. Each shard is
    read once, so that local reads come from the page cache."""
    data, labels = streams.stand_in(os.path.join(folder, "data"), images)
    written = {}
    for fmt, write in (("webdataset", streams.write_webdataset),
                       ("parquet", streams.write_parquet)):
        names = write(os.path.join(folder, fmt), data, labels, shards)
        paths = [f"{fmt}/{name}" for name in names]
        sizes = []
        for path in paths:
            with open(os.path.join(folder, path), "rb") as f:
                sizes.append(len(f.read()))
        written[fmt] = (paths, sizes)
    return written


def _cases(folder: str, server, written: dict, images: int, workers) -> list[dict]:
    """Every format x transport x worker count to time, with what it reads."""
    cases = []
    for fmt, (paths, sizes) in written.items():
        for transport in TRANSPORTS:
            urls = ([os.path.join(folder, p) for p in paths] if transport == "local"
                    else server.urls(paths))
            for w in workers:
                cases.append({"format": fmt, "transport": transport, "workers": w,
                              "urls": urls, "shards": len(paths), "images": images,
                              "bytes_per_shard": round(sum(sizes) / len(sizes)),
                              "bytes": sum(sizes), "seconds": [], "images_read": []})
    return cases


def _name(case: dict) -> str:
    return f"{case['format']:<10} {case['transport']:<5} workers={case['workers']}"


def _run_round(cases: list[dict], batch_size: int, context, log, timed: bool) -> None:
    """Each case that has not failed read once; timed: its time and count kept.
    A case whose epoch raises keeps the error and is not run again."""
    for case in cases:
        if "error" in case:
            continue
        try:
            seconds, images = _epoch(case, batch_size, context)
        except Exception as err:  # kept in the results, and shown by format_table
            case["error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            log(f"{_name(case)}: FAILED {case['error']}")
            continue
        if timed:
            seconds = round(seconds, 4)
            case["seconds"].append(seconds)
            case["images_read"].append(images)
            log(f"{_name(case)}: {images:,} images in {seconds:.2f} s, "
                f"{images / seconds:,.0f} images/s")


def _summary(case: dict) -> dict:
    """A case as the results file keeps it: its rates and median, no URLs."""
    out = {k: v for k, v in case.items() if k != "urls"}
    if case["seconds"]:
        rates = [n / s for n, s in zip(case["images_read"], case["seconds"])]
        out["images_per_s_rounds"] = [round(r) for r in rates]
        out["images_per_s"] = round(statistics.median(rates))
    return out


def run_stream_bench(images: int = FULL["images"], shards: int = FULL["shards"],
                     batch_size: int = FULL["batch_size"], workers=FULL["workers"],
                     repeats: int = FULL["repeats"], log=print) -> dict:
    """Time every case (module docstring) on ``images`` stand-in images in ``shards``
    shards per format: one warm-up round, then ``repeats`` timed rounds."""
    from .workers import worker_context

    images = check_int("images", images, minimum=1)
    shards = check_int("shards", shards, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    repeats = check_int("repeats", repeats, minimum=1)
    workers = [check_int("workers", w, minimum=0) for w in workers]
    # the stream libraries imported once in the fork server, not by every worker (not
    # this module: a worker imports it as its __main__ under python -m, and runpy
    # warns of a __main__ module that was imported before)
    context = worker_context("utils.streams", "webdataset", "datasets")
    with tempfile.TemporaryDirectory(prefix="stream_bench_") as folder:
        written = _write_shards(folder, images, shards)
        with streams.ShardServer(folder) as server:
            cases = _cases(folder, server, written, images, workers)
            log(f"{len(cases)} cases: a warm-up round, then {repeats} timed round(s)")
            _run_round(cases, batch_size, context, log, timed=False)
            for r in range(repeats):
                log(f"round {r + 1} of {repeats}")
                _run_round(cases, batch_size, context, log, timed=True)
    return {"benchmark": "images/s of one process reading one epoch of shards through "
                         "a DataLoader, images decoded to uint8 tensors; median of "
                         "rounds",
            "settings": {"images": images, "shards": shards, "batch_size": batch_size,
                         "workers": workers, "repeats": repeats, "warmup_rounds": 1,
                         "page_cache": "warm: every shard read once before timing, "
                                       "and a warm-up epoch per case",
                         "worker_start_method": context.get_start_method(),
                         "http_server": "utils.streams.ShardServer: http.server "
                                        "with Range requests, on 127.0.0.1"},
            "results": [_summary(c) for c in cases]}


def format_table(result: dict) -> str:
    """images/s (median of rounds) per format and transport (rows) and worker count
    (columns); a failed case shows its error under the table."""
    workers = result["settings"]["workers"]
    rows, errors = {}, []
    for r in result["results"]:
        key = f"{_LABELS[r['format']]}, {r['transport']}"
        cell = f"{r['images_per_s']:,}" if "images_per_s" in r else "failed"
        rows.setdefault(key, {})[r["workers"]] = cell
        if "error" in r:
            errors.append(f"{key}, workers={r['workers']}: {r['error']}")
    lines = [f"{'images/s':<28}" + "".join(f"{f'workers={w}':>11}" for w in workers)]
    for key, cells in rows.items():
        lines.append(f"{key:<28}" + "".join(f"{cells.get(w, ''):>11}" for w in workers))
    return "\n".join(lines + sorted(set(errors)))


def plot_throughput(result: dict):
    """images/s against DataLoader workers, one line per format x {local, HTTP}
    (median of rounds; the bars span the rounds' lowest and highest). Returns the
    Figure."""
    import matplotlib.pyplot as plt

    from .viz import MAX_WIDTH_IN, MIN_FONT_PT

    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 3.4))
    for colour, fmt in zip(("C0", "C1"), _LABELS):
        for style, transport in zip(("-", "--"), TRANSPORTS):
            rows = sorted((r for r in result["results"] if r["format"] == fmt
                           and r["transport"] == transport and "images_per_s" in r),
                          key=lambda r: r["workers"])
            if not rows:
                continue
            median = np.array([r["images_per_s"] for r in rows])
            low = median - [min(r["images_per_s_rounds"]) for r in rows]
            high = [max(r["images_per_s_rounds"]) for r in rows] - median
            ax.errorbar([r["workers"] for r in rows], median, yerr=[low, high],
                        color=colour, linestyle=style, marker="o", capsize=3,
                        label=f"{_LABELS[fmt]}, "
                              f"{'local files' if transport == 'local' else 'HTTP'}")
    s, env = result["settings"], result.get("environment", {})
    ax.set_yscale("log")
    ax.set_xticks(s["workers"])
    ax.set_xlabel("DataLoader workers", fontsize=MIN_FONT_PT + 1)
    ax.set_ylabel("images / s (median)", fontsize=MIN_FONT_PT + 1)
    ax.set_title(f"{s['images']:,} images in {s['shards']} shards, batch "
                 f"{s['batch_size']}, {env.get('cpu_count', '?')} cores", fontsize=10)
    ax.legend(fontsize=MIN_FONT_PT)
    fig.tight_layout()
    return fig


def environment() -> dict:
    """utils.bench's description of the machine, plus the stream libraries'
    versions."""
    from importlib.metadata import version

    from .bench import environment as bench_environment

    return {**bench_environment(),
            **{name: version(name) for name in ("webdataset", "datasets", "pyarrow",
                                                "fsspec", "aiohttp")}}


def _workers_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected worker counts separated by commas, like 0,2,4; got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    """``python -m utils.stream_bench``: run, print the table, save ``--out``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m utils.stream_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="save the result as JSON here")
    parser.add_argument("--workers", type=_workers_list, default=list(FULL["workers"]),
                        help="worker counts, e.g. 0,2 (default 0,1,2,4)")
    for name, what in [("--images", "stand-in images, written in each format"),
                       ("--shards", "shards per format"),
                       ("--batch-size", "images per batch"),
                       ("--repeats", "timed rounds")]:
        default = FULL[name[2:].replace("-", "_")]
        parser.add_argument(name, type=int, default=default,
                            help=f"{what} (default {default})")
    args = parser.parse_args(argv)
    try:
        result = run_stream_bench(args.images, args.shards, args.batch_size,
                                  args.workers, args.repeats,
                                  log=lambda s: print(s, flush=True))
    except ValueError as err:
        parser.error(str(err))
    result["environment"] = environment()
    result["command"] = "python -m utils.stream_bench " + " ".join(argv)
    result["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    print(format_table(result))
    if args.out:
        results.write(args.out, result, SOURCES)
    return result


if __name__ == "__main__":
    main()
