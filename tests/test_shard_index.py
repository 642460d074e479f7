"""An index over shards (utils.shard_index): WebDataset tar shards served over HTTP,
read as a map-style data set through chapter 15's PermutationShardSampler: exactly once
per epoch on 2 ranks x 2 workers in the sampler's full shuffle, an exact resume on
another world size, and a missing or short shard named in the error."""

import os

import numpy as np
import pytest

from utils import streams
from utils.audit import audit_shards
from utils.manifest import load_manifest, write_manifest
from utils.samplers import exact_order
from utils.shard_index import IndexedShards, ShardReadError, read_rank, read_ranks

N, SHARDS = 70, 7  # 7 shards of 10: a count that 2 ranks cannot split by shards


def _write(folder):
    rng = np.random.default_rng(0)  # any pixels do: the tests check indices and bytes
    images = rng.integers(0, 256, size=(N, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=N)
    write_manifest(folder, streams.write_webdataset(folder, images, labels, SHARDS))
    return images, labels


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(manifest URL, images, labels)`` of the shards served over HTTP."""
    folder = str(tmp_path_factory.mktemp("shard_index"))
    images, labels = _write(folder)
    with streams.ShardServer(folder) as server:
        yield server.url("manifest.json"), images, labels


def test_items_are_the_written_samples_and_adjacent_spans_share_a_request(served):
    url, images, labels = served
    data = IndexedShards(url)
    assert len(data) == N
    asked = [12, 3, 4, 5, 69, 0, 3]
    got = data.__getitems__(asked)
    assert [index for index, _, _ in got] == asked
    for index, image, label in got:
        assert np.array_equal(image.numpy(), images[index]) and label == labels[index]
    # shard 0: {0}, {3, 4, 5} (3 twice); shard 1: {12}; shard 6: {69}
    assert data.requests == 4
    assert data[17][0] == 17 and data.requests == 5


def test_every_sample_once_on_2_ranks_x_2_workers_in_the_samplers_full_shuffle(
        served):
    out = read_ranks(served[0], world_size=2, global_batch=8, workers=2)
    seen = [indices for indices, _ in out]
    assert audit_shards(seen, N).is_partition
    # the epoch is the sampler's uniform permutation of all 70, dealt r::2: no buffer
    order = exact_order(N, seed=0, epoch=0)
    assert seen == [order[0::2].tolist(), order[1::2].tolist()]


def test_a_stop_on_2_ranks_resumed_on_1_rank_reads_exactly_the_rest(served):
    first = read_ranks(served[0], world_size=2, global_batch=8, workers=2,
                       stop_after=3)
    states = [state for _, state in first]
    assert states[0] == states[1] and states[0]["consumed"] == 24
    rest, state = read_rank(served[0], global_batch=8, state=states[0],
                            num_replicas=1, rank=0)
    assert audit_shards([seen for seen, _ in first] + [rest], N).is_partition
    assert rest == exact_order(N, seed=0, epoch=0)[24:].tolist()
    assert state["finished"]


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_a_missing_or_short_shard_raises_an_error_naming_url_and_bytes(
        tmp_path, damage):
    folder = str(tmp_path)
    _write(folder)
    shard = os.path.join(folder, "train-000002.tar")
    _, first, stop = load_manifest(os.path.join(folder, "manifest.json"))[
        "shards"][2]["spans"][-1]  # shard 2's last sample, index 29
    if damage == "missing":
        os.remove(shard)
    else:  # cut inside that sample: the server answers with what is left of it
        os.truncate(shard, stop - 512)
    with streams.ShardServer(folder) as server:
        data = IndexedShards(server.url("manifest.json"))  # reads no shard
        assert len(data) == N
        what = "HTTP 404" if damage == "missing" else "bytes came back"
        with pytest.raises(ShardReadError) as raised:
            data[29]
        message = str(raised.value)
        assert message.startswith(f"{server.url('train-000002.tar')} bytes "
                                  f"{first}-{stop - 1}: ")
        assert what in message
