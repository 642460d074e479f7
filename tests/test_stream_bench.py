"""utils.stream_bench at a tiny size: every case (format x local/HTTP x workers) reads
every image written, the results file says what it measured, and the chapter's plot
and table show every case."""

import itertools
import json

import matplotlib
import matplotlib.pyplot as plt
import pytest

from utils import results, stream_bench, streams

matplotlib.use("Agg")

WORKERS = [0, 2]
TINY = ["--images", "64", "--shards", "4", "--batch-size", "16", "--repeats", "1",
        "--workers", ",".join(map(str, WORKERS))]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream_bench") / "stream_throughput.json"
    stream_bench.main([*TINY, "--out", str(out)])
    with open(out) as f:
        return json.load(f) | {"path": str(out)}


def test_every_case_reads_every_image_it_wrote(record):
    cases = record["results"]
    assert sorted((c["format"], c["transport"], c["workers"]) for c in cases) == sorted(
        itertools.product(streams.FORMATS, stream_bench.TRANSPORTS, WORKERS))
    for c in cases:
        name = f"{c['format']} {c['transport']} workers={c['workers']}"
        assert "error" not in c, f"{name}: {c['error']}"
        assert (c["images"], c["shards"]) == (64, 4), name
        assert c["images_read"] == [64], f"{name} read {c['images_read']} of 64"
        assert len(c["seconds"]) == 1 and c["images_per_s"] > 0, name
        assert c["bytes"] > 64 * 3072 and c["bytes_per_shard"] == round(c["bytes"] / 4)


def test_the_file_says_what_it_measured_and_how(record):
    argv = [*TINY, "--out", record["path"]]
    assert record["command"] == "python -m utils.stream_bench " + " ".join(argv)
    assert record["date"] and record["environment"]["webdataset"]
    assert sorted(record["sources"]) == sorted(stream_bench.SOURCES)
    assert results.stale(record["path"]) == []
    assert record["settings"]["worker_start_method"] in ("forkserver", "spawn")


def test_the_plot_has_a_line_per_format_and_transport_and_the_table_a_row(record):
    fig = stream_bench.plot_throughput(record)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    plt.close(fig)
    assert labels == ["WebDataset, local files", "WebDataset, HTTP",
                      "Parquet (datasets), local files", "Parquet (datasets), HTTP"]
    table = stream_bench.format_table(record).splitlines()
    assert len(table) == 5 and "failed" not in "\n".join(table)


def test_sizes_are_checked():
    with pytest.raises(SystemExit):
        stream_bench.main(["--images", "0"])


def test_parquet_over_http_reads_shards_larger_than_a_footer_read():
    """fsspec reads a Parquet file's footer with a Range request first: a server that
    ignored Range (plain ``python -m http.server``) failed here on shards over 64 KiB."""
    result = stream_bench.run_stream_bench(images=128, shards=2, batch_size=64,
                                           workers=[0], repeats=1, log=lambda s: None)
    [case] = [c for c in result["results"]
              if (c["format"], c["transport"]) == ("parquet", "http")]
    assert case["bytes_per_shard"] > 64 * 1024
    assert case.get("error") is None and case["images_read"] == [128]
