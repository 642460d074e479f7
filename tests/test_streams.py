"""Streams of shards read over HTTP by ranks and workers (utils.streams; chapter 16):
each library's shard assignment audited for exactly-once, its behaviour on uneven shards
and on a resume pinned as measured, and the shuffle buffers' statistics."""

import os

import numpy as np
import pytest

from utils import streams
from utils.audit import audit_shards
from utils.shuffle_buffers import (buffer_orders, buffer_resume_losses, buffer_table,
                                   reader_table, resumed_read, shard_owners)

LIBRARIES = ("webdataset", "parquet")
WRITERS = {"webdataset": streams.write_webdataset, "parquet": streams.write_parquet}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Both formats in 8 shards of 8 (64 samples) and in 7 shards of 10 (70 samples),
    each served over HTTP on loopback: ``served[fmt, shards]`` is the list of URLs."""
    root = tmp_path_factory.mktemp("streams")
    images, labels = streams.stand_in(str(root / "data"), 70)
    servers, urls = [], {}
    try:
        for fmt, write in WRITERS.items():
            for n, shards in ((64, 8), (70, 7)):
                folder = str(root / f"{fmt}{shards}")
                names = write(folder, images[:n], labels[:n], shards)
                servers.append(streams.ShardServer(folder))
                urls[fmt, shards] = servers[-1].urls(names)
        yield urls
    finally:
        for server in servers:
            server.close()


@pytest.mark.parametrize("fmt", LIBRARIES)
def test_each_library_reads_every_sample_once_per_epoch_on_2_ranks_x_2_workers(
        served, fmt):
    read = streams.read_epoch(fmt, served[fmt, 8], world_size=2, workers=2)
    audit = audit_shards(read.per_worker(), 64)
    assert audit.is_partition, audit
    assert read.batches == (32, 32)
    # whole shards: every worker read 2 of the 8, all of each
    assert all(len(w) == 16 for w in read.per_worker())


def test_webdataset_on_7_shards_and_4_ranks_x_2_workers_reads_each_once_but_unevenly(
        served):
    """split_by_node deals urls[rank::4]: ranks 0-2 get 2 shards, rank 3 one; rank
    3's second worker gets none and yields nothing (no error: empty_check=False)."""
    read = streams.read_epoch("webdataset", served["webdataset", 7], 4, 2)
    assert audit_shards(read.per_worker(), 70).is_partition
    assert read.batches == (20, 20, 20, 10)
    assert read.seen[3][1] == ()


def test_datasets_on_7_shards_and_4_ranks_reads_each_once_in_unequal_counts(served):
    """7 shards do not divide by 4 ranks: split_dataset_by_node keeps every 4th
    example of every shard on each rank, so each rank reads all 7 shards."""
    read = streams.read_epoch("parquet", served["parquet", 7], 4, 2)
    assert audit_shards(read.per_rank(), 70).is_partition
    assert read.batches == (18, 18, 17, 17)
    # each rank keeps every 4th example of what it reads: it reads all 7 shards
    assert [len({i // 10 for i in seen}) for seen in read.per_rank()] == [7] * 4


def test_webdataset_resampled_gives_every_rank_the_same_count_with_repeats(served):
    """WebDataset's fix for uneven shards: shards drawn with replacement, cut to a
    fixed number of samples per worker: equal batches, but not exactly once."""
    read = streams.read_epoch("webdataset", served["webdataset", 7], 4, 2,
                              resampled=True, epoch_samples=9)
    assert read.batches == (18, 18, 18, 18)
    audit = audit_shards(read.per_rank(), 70)
    assert audit.duplicates or audit.missing


def resumed(fmt, urls, stop_after, **options):
    """(lost, repeated) of one epoch on 2 ranks x 2 workers, batches of 4, stopped
    after ``stop_after`` batches and resumed in fresh processes."""
    before, after = streams.resume_epoch(fmt, urls, 2, 2, 4, stop_after, **options)
    audit = audit_shards([a + b for a, b in zip(before.per_rank(), after.per_rank())],
                         64)
    return len(audit.missing), sum(c - 1 for c in audit.duplicates.values())


@pytest.mark.parametrize("fmt", LIBRARIES)
def test_a_resume_after_3_batches_loses_and_repeats_nothing_without_a_buffer(
        served, fmt):
    assert resumed(fmt, served[fmt, 8], 3) == (0, 0)


def test_webdataset_resumed_with_a_buffer_is_exact_since_it_is_replayed(served):
    """WebDataset has no state: StatefulDataLoader re-reads the stream up to the
    place it stopped, and a seeded buffer draws the same order again."""
    assert resumed("webdataset", served["webdataset", 8], 3, shuffle=16) == (0, 0)


def test_datasets_resumed_with_a_buffer_and_workers_cannot_load_its_state(served):
    """With a buffer and 2 workers, the fresh workers fail to load the state
    (measured with datasets 5.2.0; chapter 16 says so)."""
    from utils.launch import RankError

    with pytest.raises(RankError, match="IndexError"):
        streams.resume_epoch("parquet", served["parquet", 8], 1, 2, 4, 3, shuffle=16)


def test_datasets_resumed_with_a_buffer_in_one_process_loses_the_buffer(served):
    """datasets saves where its shards were read, not the buffer's contents: of what
    the buffer held at the stop, 9 samples are never yielded and one comes twice
    (measured with datasets 5.2.0; chapter 16 shows it)."""
    seen = resumed_read(served["parquet", 8], k=16, stop=3, batch=4)
    audit = audit_shards([seen], 64)
    assert (len(audit.missing), audit.duplicates) == (9, {10: 2})


def test_shuffle_buffers_measured():
    rows = {(r["kind"], r["shard shuffle"], r["k"]): r
            for r in buffer_table(n=2000, shards=20, ks=(0, 100, 1000), seeds=range(3))}
    spread = [rows["webdataset", True, k]["shards per batch"] for k in (0, 100, 1000)]
    assert spread == sorted(spread) and spread[0] < 3
    assert rows["torch.randperm", False, 0]["shards per batch"] > 15
    assert rows["webdataset", False, 0]["position r"] == pytest.approx(1.0)
    assert abs(rows["webdataset", True, 0]["position r"]) < 0.5
    assert rows["webdataset", False, 0]["neighbours"] == 1999


def test_buffer_orders_are_permutations_and_seeded():
    a = buffer_orders("webdataset", 100, 10, 20, [1, 1, 2])
    assert np.array_equal(a[0], a[1]) and not np.array_equal(a[0], a[2])
    assert all(np.array_equal(np.sort(r), np.arange(100)) for r in a)
    with pytest.raises(ValueError, match="always shuffles the shard order"):
        buffer_orders("datasets", 100, 10, 20, [0], shard_shuffle=False)
    with pytest.raises(ValueError, match="kind must be one of"):
        buffer_orders("tfrecord", 100, 10, 20, [0])


def test_bad_input_is_refused_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no folder"):
        streams.ShardServer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="more than the 5 samples"):
        streams.shard_bounds(5, 6)
    with pytest.raises(ValueError, match="uint8 of shape"):
        streams.write_webdataset(str(tmp_path), np.zeros((2, 3)), [0, 1], 1)
    with pytest.raises(ValueError, match="fmt must be one of"):
        streams.read_epoch("tfrecord", [], 1, 0)
    with pytest.raises(ValueError, match="pass epoch_samples"):
        streams.webdataset_stream(["x.tar"], resampled=True)


def test_the_server_serves_files_and_byte_ranges_and_stops(tmp_path):
    import urllib.error
    import urllib.request

    (tmp_path / "a.txt").write_text("shard")
    with streams.ShardServer(str(tmp_path)) as server:
        with urllib.request.urlopen(server.url("a.txt"), timeout=10) as reply:
            assert reply.read() == b"shard"
        # byte ranges, as an object store answers them (a Parquet reader needs them)
        for spec, body, status in (("bytes=1-3", b"har", 206), ("bytes=2-", b"ard", 206),
                                   ("bytes=-2", b"rd", 206)):
            ask = urllib.request.Request(server.url("a.txt"), headers={"Range": spec})
            with urllib.request.urlopen(ask, timeout=10) as reply:
                assert (reply.status, reply.read()) == (status, body)
                assert reply.headers["Content-Range"].endswith("/5")
        ask = urllib.request.Request(server.url("a.txt"), headers={"Range": "bytes=9-"})
        with pytest.raises(urllib.error.HTTPError, match="416"):
            urllib.request.urlopen(ask, timeout=10)
        pid = server._proc.pid
    assert server._proc.poll() is not None
    assert not os.path.exists(f"/proc/{pid}") or "zombie" not in open(
        f"/proc/{pid}/status").read().lower()


def test_datasets_strategy_shards_deals_whole_shards_even_when_they_do_not_divide(
        served):
    read = streams.read_epoch("parquet", served["parquet", 7], 4, 2, strategy="shards")
    assert audit_shards(read.per_worker(), 70).is_partition
    assert read.batches == (20, 20, 20, 10)


def test_webdatasets_shard_shuffle_repeats_each_epoch_unless_workers_persist(served):
    """detshuffle counts epochs in the worker's copy of the data set: a worker started
    anew each epoch starts from the same count, and draws the same shard order."""
    first, second = streams.webdataset_shard_orders(served["webdataset", 8],
                                                    persistent=False)
    assert first == second and first != sorted(first)
    first, second = streams.webdataset_shard_orders(served["webdataset", 8],
                                                    persistent=True)
    assert first != second
    # the default, detshuffle=False: a seed fixed at construction, the same order always
    first, second = streams.webdataset_shard_orders(served["webdataset", 8],
                                                    persistent=True, detshuffle=False)
    assert first == second != sorted(first)


def test_a_buffer_mixes_only_what_feeds_it():
    """datasets' buffer fed from 1 shard at a time mixes fewer shards than from its
    default 10; a reader of 4 holds a quarter of the shards and mixes only those."""
    many, one = (buffer_orders("datasets", 2000, 20, 100, [0], input_shards=i)
                 for i in (10, 1))
    bounds = streams.shard_bounds(2000, 20)
    mixed = [len({s for s, (a, b) in enumerate(bounds) for i in row[:64] if a <= i < b})
             for row in (many[0], one[0])]
    assert mixed[0] > mixed[1] + 3
    mine = buffer_orders("webdataset", 2000, 20, 1000, [0], readers=4)[0]
    assert sorted(mine) == [i for s in range(0, 20, 4) for i in range(*bounds[s])]
    rows = reader_table(n=2000, shards=20, readers=(1, 4), ks=(1000,), seeds=[0])
    assert rows[0]["shards per batch"] > rows[1]["shards per batch"] + 5
    assert rows[1]["shards held"] == 5


def test_who_reads_which_shard_across_epochs(served):
    """WebDataset's shard shuffle follows the split (owners fixed all run); the shard list
    seeded by the epoch before the split, and datasets with a seed, deal anew and stay
    partitions; datasets with seed=None lets ranks overlap."""
    def partitions(owners):
        return all(sorted(a + b) == list(range(8)) for a, b in owners)

    fixed = shard_owners("webdataset", served["webdataset", 8], 64, 2, epochs=2)
    assert fixed[0] == fixed[1] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for way, fmt in (("webdataset list seeded by epoch", "webdataset"),
                     ("datasets", "parquet")):
        owners = shard_owners(way, served[fmt, 8], 64, 2, epochs=3)
        assert partitions(owners) and len({str(epoch) for epoch in owners}) > 1, way
    # three epochs, each 1 in 70 to come out disjoint by chance
    assert not partitions(shard_owners("datasets seed=None", served["parquet", 8], 64, 2))
    assert "RANK" not in os.environ


def test_a_resumed_buffer_loses_nothing_before_it_fills_and_about_a_buffer_after(served):
    rows = buffer_resume_losses(served["parquet", 8], 64, ks=(16,), stops=(1, 3))
    assert [(r["lost"], r["repeated"]) for r in rows] == [(0, 0), (9, 1)]


def test_webdataset_stream_shuffles_by_seed_and_epoch(served):
    def order(epoch):
        stream = streams.webdataset_stream(served["webdataset", 8][:2], shuffle=8,
                                           seed=3, epoch=epoch)
        return [index for _, index, _, _ in stream]

    assert order(0) == order(0) != order(1)
    assert sorted(order(1)) == list(range(16))


def test_datasets_shuffle_follows_the_epoch_through_the_readers_map(served):
    """read_epoch adds a column with .map; the epoch must survive it (issue: a .map after
    set_epoch gave epoch 1 epoch 0's order)."""
    def order(epoch):
        read = streams.read_epoch("parquet", served["parquet", 8], 1, 0, shuffle=16,
                                  seed=3, epoch=epoch)
        return read.per_rank()[0]

    first, second = order(0), order(1)
    assert sorted(first) == sorted(second) == list(range(64))
    assert first != second


def test_a_manifest_lists_each_samples_byte_span_and_refuses_what_is_not_there(tmp_path):
    import io
    import tarfile

    from utils.manifest import ShardMismatch, check_shard, load_manifest, write_manifest

    images = np.arange(16 * 3072, dtype=np.int64).astype(np.uint8).reshape(16, 32, 32, 3)
    folder = tmp_path / "tars"
    names = streams.write_webdataset(str(folder), images, list(range(16)), 2)
    manifest = load_manifest(write_manifest(str(folder), names))
    assert [s["samples"] for s in manifest["shards"]] == [8, 8] and manifest["samples"] == 16
    data = (folder / names[1]).read_bytes()
    key, first, stop = manifest["shards"][1]["spans"][3]
    with tarfile.open(fileobj=io.BytesIO(data[first:stop]), mode="r|") as tar:
        assert [m.name for m in tar] == [f"{key}.cls", f"{key}.npy"] and key == "000011"
    check_shard(manifest["shards"][1], data)
    with pytest.raises(ShardMismatch, match="partial upload"):
        check_shard(manifest["shards"][1], data[:-512])
    with pytest.raises(FileNotFoundError, match="no shard 'x.tar'"):
        write_manifest(str(folder), ["x.tar"])
    with pytest.raises(ValueError, match="names is empty"):
        write_manifest(str(folder), [])
