"""The CIFAR-10 script on WebDataset tar shards (`--data-format webdataset --shards URLS`): its
refusals, the shards' counts from their manifest (no read at the start) or else a counting
read, 2 CPU ranks training from shards served over HTTP, each sample of an epoch trained on
exactly once (as the image KeyedAugment makes of it), the same steps on every rank when the
ranks' shards hold different numbers of samples, and a resume mid-epoch by seeded replay
that ends with the weights of a run that never stopped."""

import hashlib
import json
import os
from collections import Counter

import numpy as np
import pytest
import torch

import utils.train_cifar10 as train
from utils import forkrun
from utils.data import load_cifar10, write_synthetic_cifar10
from utils.manifest import write_manifest
from utils.streams import ShardServer, write_webdataset
from utils.train_cifar10 import (KeyedAugment, batches_taken, check_dealing,
                                 expand_shards, parse_args, steps_per_epoch)
from test_train_cifar10 import in_process  # main(argv) in this process

# the runs start 2 ranks, each with DataLoader workers (tests/conftest.py's group)
pytestmark = pytest.mark.xdist_group("ranks")

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT = 300
N_TRAIN, SHARDS, GLOBAL_BATCH = 512, 8, 64
RUN = ["--data-format", "webdataset", "--device", "cpu", "--no-progress"]
BATCH = ["--global-batch", str(GLOBAL_BATCH)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cifar"))
    write_synthetic_cifar10(root, n_train=N_TRAIN, n_test=256, seed=0)
    return root


@pytest.fixture(scope="module")
def served(data, tmp_path_factory):
    """The stand-in's training images as 8 WebDataset shards of 64 and their manifest,
    served over HTTP: (server, the --shards brace pattern of their URLs)."""
    train = load_cifar10(data, train=True)
    folder = str(tmp_path_factory.mktemp("shards"))
    names = write_webdataset(folder, train.data, np.asarray(train.targets), SHARDS)
    write_manifest(folder, names)
    with ShardServer(folder) as server:
        assert server.urls(names)[-1] == server.url(f"train-{SHARDS - 1:06d}.tar")
        yield server, server.url(f"train-{{000000..{SHARDS - 1:06d}}}.tar")


def metrics_lines(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def ok(done):
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


# --- refusals: the command line alone, no process group ---------------------------------

@pytest.mark.parametrize("args, message", [
    (["--data-format", "webdataset"], "--data-format webdataset needs --shards URLS"),
    (["--data-format", "webdataset", "--shards", " , "], "needs --shards URLS"),
    (["--shards", "a.tar"], "--shards is for --data-format webdataset"),
    (["--data-format", "webdataset", "--shards", "a.tar", "--loader", "gpu"],
     "--loader gpu keeps a CIFAR-format training set on the device"),
    (["--manifest", "m.json"], "--manifest is for --data-format webdataset"),
])
def test_the_command_line_refuses_what_a_stream_of_shards_cannot_do(args, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(args)
    assert message in capsys.readouterr().err


def test_shards_are_a_brace_pattern_or_a_comma_list():
    assert expand_shards("http://h:1/t-{000..002}.tar") == [
        "http://h:1/t-000.tar", "http://h:1/t-001.tar", "http://h:1/t-002.tar"]
    assert expand_shards("a.tar, b-{0..1}.tar,{c,d}.tar") == [
        "a.tar", "b-0.tar", "b-1.tar", "c.tar", "d.tar"]
    args = parse_args(["--data-format", "webdataset", "--shards", "s-{0..3}.tar"])
    assert (args.data_format, args.loader) == ("webdataset", "auto")
    args = parse_args(["--data-format", "webdataset", "--shards", "a.tar",
                       "--checkpoint-every", "4", "--manifest", "http://h:1/m.json"])
    assert (args.checkpoint_every, args.manifest) == (4, "http://h:1/m.json")
    assert parse_args([]).data_format == "cifar"


def test_a_shard_count_that_does_not_deal_evenly_is_refused_with_the_numbers_and_fixes():
    check_dealing(8, 2, 2)
    check_dealing(8, 4, 0)  # no workers: the rank reads its shards itself
    with pytest.raises(SystemExit) as refused:
        check_dealing(8, 2, 3)
    assert ("8 shards do not deal evenly to 2 process(es) x 3 DataLoader worker(s) "
            "(6 readers)" in str(refused.value))
    assert "use --workers 1 or 2 or 4, or a shard count that is a multiple of 6" in str(
        refused.value)
    with pytest.raises(SystemExit, match="use a shard count that is a multiple of 3"):
        check_dealing(8, 3, 1)  # no --workers helps


def test_every_rank_runs_the_least_number_of_whole_batches_of_any_rank():
    # rank 0 gets shards 0, 2, 4, 6 (64 samples each), rank 1 shards 1, 3, 5, 7 (32 each);
    # worker w of a rank takes [w::2] of its shards: 128 or 64 samples, 4 or 2 batches
    counts = [64, 32] * 4
    assert steps_per_epoch(counts, 2, 2, 32) == 2 * (64 // 32)
    assert steps_per_epoch(counts, 1, 2, 32) == 2 * (192 // 32)
    # each worker drops its last partial batch: 127 // 32 + 126 // 32, not 253 // 32
    assert steps_per_epoch([64, 63, 63, 63], 1, 2, 32) == 6


def test_after_s_steps_each_worker_has_given_its_turns_of_them_passing_over_ended_ones():
    # torch's in-order DataLoader asks its workers in turn: batch i from worker i % W
    assert batches_taken([4, 4], 0) == ([0, 0], 0)
    assert batches_taken([4, 4], 3) == ([2, 1], 1)
    assert batches_taken([4, 4, 4], 7) == ([3, 2, 2], 1)
    # worker 0 ends after 1 batch: from then on the others take their turns
    assert batches_taken([1, 3, 2], 5) == ([1, 2, 2], 1)
    assert batches_taken([1, 3, 2], 6) == ([1, 3, 2], 2)  # all ended
    with pytest.raises(ValueError, match="steps=7 is out of range"):
        batches_taken([1, 3, 2], 7)


def open_shards(*argv):
    """open_shards for one process of batch 64, in this process: (stream, why, said)."""
    import contextlib
    import io

    job = train.Job(False, 0, 0, 1, torch.device("cpu"), 64, False)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        stream, why = train.open_shards(parse_args([*RUN, *argv]), job)
    return stream, why, said.getvalue()


def test_counts_come_from_the_manifest_beside_the_shards_without_reading_them(
        served, monkeypatch):
    def no_read(url):
        raise AssertionError(f"{url} was read to count its samples")
    monkeypatch.setattr(train.shards, "count_samples", no_read)
    stream, why, said = open_shards("--shards", served[1])
    assert stream.counts == [64] * SHARDS and stream.steps_per_epoch == 8
    assert why.endswith(f"counts from {served[0].url('manifest.json')}") and said == ""


def test_without_a_manifest_the_shards_are_read_to_count_and_the_run_says_how_to_write_one(
        data, tmp_path):
    train_set = load_cifar10(data, train=True)
    folder = tmp_path / "shards"
    names = write_webdataset(str(folder), train_set.data[:128],
                             np.asarray(train_set.targets[:128]), 2)
    stream, why, said = open_shards("--shards", str(folder / "train-{000000..000001}.tar"))
    assert stream.counts == [64, 64] and why.endswith("counts read from the shards")
    assert said.startswith(f"--data-format webdataset: no manifest at {folder}/manifest.json: "
                           f"reading every shard to count its samples; write one")
    command = said.split("python -c ", 1)[1].strip()[1:-1]  # the quoted program
    exec(command, {})  # as written, it writes the manifest of these shards
    assert [e["name"] for e in json.load(open(folder / "manifest.json"))["shards"]] == names
    _, why, said = open_shards("--shards", str(folder / "train-{000000..000001}.tar"))
    assert why.endswith(f"counts from {folder}/manifest.json") and said == ""


def test_a_manifest_that_does_not_list_a_shard_or_is_not_there_is_refused_naming_it(
        data, served, tmp_path):
    train_set, other = load_cifar10(data, train=True), tmp_path / "other"
    write_manifest(str(other), write_webdataset(str(other), train_set.data[:8],
                                                np.asarray(train_set.targets[:8]), 1))
    with pytest.raises(SystemExit) as refused:
        open_shards("--shards", served[1], "--manifest", str(other / "manifest.json"))
    assert str(refused.value).startswith(
        f"error: shard train-000001.tar ({served[0].url('train-000001.tar')}) is not in "
        f"the manifest {other}/manifest.json, which lists 1 shard(s) (train-000000.tar)")
    missing = served[0].url("no-manifest.json")  # named with --manifest: required
    with pytest.raises(SystemExit, match=f"error: --manifest {missing}: HTTP Error 404"):
        open_shards("--shards", served[1], "--manifest", missing)


# --- 2 ranks x 2 workers, shards over HTTP ------------------------------------------------

# runs the script as `python -m utils.train_cifar10` would, noting the bytes of each image
# (and its label) that each step trains on, per rank and epoch
RECORDS = """
import hashlib, json, os, sys
import utils.train_cifar10 as train
step = train.train_step
seen = []
def train_step(args, job, training, model, x, y):
    seen.append((training.epoch, [hashlib.sha1(row.numpy().tobytes()).hexdigest()
                                  for row in x], y.tolist()))
    return step(args, job, training, model, x, y)
if __name__ == "__main__":  # not in DataLoader workers
    train.run(step=train_step)
    out = sys.argv[sys.argv.index("--out") + 1]
    with open(os.path.join(out, f"seen{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f)
"""


@pytest.fixture(scope="module")
def two_ranks(data, served, tmp_path_factory):
    """2 epochs on 2 ranks with 2 workers each, every step's images recorded."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    script, out = tmp / "records.py", str(tmp / "out")
    script.write_text(RECORDS)
    done = ok(forkrun.run(str(script), ["--data", data, "--out", out, "--shards", served[1],
                                        "--epochs", "2", "--workers", "2", *RUN, *BATCH],
                          nproc=2, env=ENV, timeout=TIMEOUT))
    seen = [json.load(open(os.path.join(out, f"seen{rank}.json"))) for rank in (0, 1)]
    return out, done, seen


def test_two_ranks_train_two_epochs_from_shards_over_http(two_ranks):
    out, done, _ = two_ranks
    assert ("512 train images in 8 WebDataset shards; synthetic CIFAR-10 in" in done.stdout
            and "256 test images; 2 process(es)" in done.stdout)
    assert ("8 shards dealt to 2 process(es) x 2 reader(s); 512 of 512 images an epoch; "
            "counts from http://127.0.0.1:" in done.stdout)
    lines = metrics_lines(out)
    assert [(m["epoch"], m["step"], m["loader"]) for m in lines] == [
        (1, 8, "webdataset"), (2, 16, "webdataset")]  # 8 x 64 = 512 images an epoch
    assert all(0.0 <= m["test_accuracy"] <= 1.0 for m in lines)
    assert os.path.exists(os.path.join(out, "model_final.pt"))


def expected_images(data, epoch):
    """{sha1 of an image that KeyedAugment makes in epoch: [(index, label), ...]} (a few
    of the stand-in's images are alike after their crop and flip)."""
    train = KeyedAugment(load_cifar10(data, train=True), seed=0, train=True)
    expected = {}
    for index in range(len(train)):
        image, label = train[(epoch, index)]
        digest = hashlib.sha1(image.numpy().tobytes()).hexdigest()
        expected.setdefault(digest, []).append((index, label))
    assert len(expected) > 0.99 * len(train)
    return expected


def test_each_sample_of_an_epoch_is_trained_on_once_by_the_rank_that_holds_its_shard(
        data, two_ranks):
    _, _, seen = two_ranks
    for rank in (0, 1):
        assert [epoch for epoch, _, _ in seen[rank]] == [0] * 8 + [1] * 8  # 8 steps each
        assert all(len(hashes) == GLOBAL_BATCH // 2 for _, hashes, _ in seen[rank])
    trained = {}  # (epoch, rank): the indices trained, in order
    for epoch in (0, 1):
        expected = expected_images(data, epoch)  # this epoch's augmentation
        images = Counter()
        for rank in (0, 1):
            for _, hashes, labels in (s for s in seen[rank] if s[0] == epoch):
                for digest, label in zip(hashes, labels):
                    assert digest in expected, "not an image KeyedAugment makes"
                    assert label in {lab for _, lab in expected[digest]}
                    images[digest] += 1
                    trained.setdefault((epoch, rank), []).append(
                        expected[digest][0][0])
        # each image as often as the epoch's samples make it: every sample once
        assert images == Counter({d: len(s) for d, s in expected.items()})
        for rank in (0, 1):  # rank r's shards are r, r + 2, ... (64 samples each)
            assert {i // 64 % 2 for i in trained[(epoch, rank)]} == {rank}
    for rank in (0, 1):  # the shards' order and the buffer shuffled anew each epoch
        assert trained[(0, rank)] != trained[(1, rank)]
        assert trained[(0, rank)] != sorted(trained[(0, rank)])


def test_ranks_whose_shards_hold_different_numbers_of_samples_run_the_same_steps(
        data, tmp_path):
    """Rank 0's shards hold 64 samples each and rank 1's 32: rank 0's workers could give
    8 batches of 32 an epoch, rank 1's only 4; every rank runs 4 steps (a rank that ran
    more would wait for the others in its 5th step's collectives)."""
    train = load_cifar10(data, train=True)
    images, labels = train.data, np.asarray(train.targets)
    big = write_webdataset(str(tmp_path / "big"), images[:256], labels[:256], 4)
    small = write_webdataset(str(tmp_path / "small"), images[256:384], labels[256:384], 4)
    urls = [f"{folder}/{name}" for pair in zip(big, small)
            for folder, name in zip(("big", "small"), pair)]
    out = str(tmp_path / "out")
    with ShardServer(str(tmp_path)) as server:
        done = ok(forkrun.run("utils.train_cifar10", [
            "--data", data, "--out", out, "--shards", ",".join(server.urls(urls)),
            "--epochs", "1", "--workers", "2", "--step-timeout", "30", *RUN, *BATCH],
            nproc=2, env=ENV, timeout=TIMEOUT))
    assert "256 of 384 images an epoch" in done.stdout
    assert [m["step"] for m in metrics_lines(out)] == [4]


# --- resuming mid-epoch: a seeded replay ------------------------------------------------

def test_a_run_stopped_mid_epoch_with_workers_resumes_by_replay_to_the_weights_of_one_that_never_stopped(
        data, served, tmp_path):
    """One process, 2 workers of 4 shards (4 batches of 64 each, over HTTP): 8 steps an
    epoch, 2 epochs. Stopped after step 11 (step 3 of epoch 2: worker 0 has given 2
    batches, worker 1 one, and worker 1 gives the next), with a checkpoint every step."""
    one = ["--data", data, "--shards", served[1], "--epochs", "2", "--workers", "2",
           *RUN, *BATCH]
    whole, stopped = str(tmp_path / "whole"), str(tmp_path / "stopped")
    assert in_process(*one, "--out", whole)[1] is None
    _, error = in_process(*one, "--out", stopped, "--checkpoint-every", "1",
                          "--stop-at-step", "11")
    assert error is None
    path = os.path.join(stopped, "checkpoint.pt")
    state = torch.load(path, weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["step"]) == (1, 3, 11)
    # another split of the shards cannot replay the epoch: refused, with the fix
    _, error = in_process(*one, "--out", stopped, "--resume", "--workers", "1")
    assert error is not None and (
        "it was written mid-epoch (step 3 of epoch 1) by 1 process(es) x 2 reader(s) "
        "(--workers), and this run has 1 x 1" in error)
    said, error = in_process(*one, "--out", stopped, "--resume")
    assert error is None and "resumed from" in said and "epoch 2, step 3" in said
    final = [torch.load(os.path.join(out, "model_final.pt"), weights_only=True)
             for out in (whole, stopped)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0]), (
        "the resumed run's weights differ from the uninterrupted run's")
    assert metrics_lines(stopped)[-1]["train_loss"] == metrics_lines(whole)[-1]["train_loss"]
    # a checkpoint of a run with another number of steps an epoch is refused too
    state.update(step_in_epoch=0, step=2)
    torch.save(state, path)
    _, error = in_process(*one, "--out", stopped, "--resume")
    assert error is not None and "its run had 2 steps an epoch, this one has 8" in error
