"""The CIFAR-10 script on WebDataset tar shards (`--data-format webdataset --shards URLS`): its
refusals, 2 CPU ranks training from shards served over HTTP, each sample of an epoch trained
on exactly once (as the image KeyedAugment makes of it), the same steps on every rank when
the ranks' shards hold different numbers of samples, and a resume at an epoch's end only."""

import hashlib
import json
import os
from collections import Counter

import numpy as np
import pytest
import torch

from utils import forkrun
from utils.data import load_cifar10, write_synthetic_cifar10
from utils.streams import ShardServer, write_webdataset
from utils.train_cifar10 import (KeyedAugment, check_dealing, expand_shards, parse_args,
                                 steps_per_epoch)
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
    """The stand-in's training images as 8 WebDataset shards of 64, served over HTTP:
    (server, the --shards brace pattern of their URLs)."""
    train = load_cifar10(data, train=True)
    folder = str(tmp_path_factory.mktemp("shards"))
    names = write_webdataset(folder, train.data, np.asarray(train.targets), SHARDS)
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
    (["--data-format", "webdataset", "--shards", "a.tar", "--checkpoint-every", "4"],
     "--checkpoint-every writes checkpoints mid-epoch, and --data-format webdataset "
     "cannot resume from one"),
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
    train.train_step = train_step
    train.run()
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
    assert ("8 shards dealt to 2 process(es) x 2 reader(s); 512 of 512 images an epoch"
            in done.stdout)
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


# --- resuming: at an epoch's end only ------------------------------------------------------

def test_a_stop_mid_epoch_keeps_the_epochs_checkpoint_which_resumes_exactly_and_a_mid_epoch_one_is_refused(
        data, tmp_path):
    """One process, no workers, 128 images in 2 local shards: 4 steps of 32 an epoch."""
    train = load_cifar10(data, train=True)
    write_webdataset(str(tmp_path / "shards"), train.data[:128],
                     np.asarray(train.targets[:128]), 2)
    one = ["--data", data, "--shards", str(tmp_path / "shards/train-{000000..000001}.tar"),
           "--epochs", "2", "--workers", "0", *RUN, "--global-batch", "32"]
    whole, stopped = str(tmp_path / "whole"), str(tmp_path / "stopped")
    assert in_process(*one, "--out", whole)[1] is None
    said, error = in_process(*one, "--out", stopped, "--stop-at-step", "6")  # in epoch 1
    assert error is None
    assert "no checkpoint mid-epoch" in said
    path = os.path.join(stopped, "checkpoint.pt")
    state = torch.load(path, weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["step"]) == (1, 0, 4)
    said, error = in_process(*one, "--out", stopped, "--resume")
    assert error is None and "resumed from" in said and "epoch 2, step 0" in said
    final = [torch.load(os.path.join(out, "model_final.pt"), weights_only=True)
             for out in (whole, stopped)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert metrics_lines(stopped)[-1]["train_loss"] == metrics_lines(whole)[-1]["train_loss"]
    # a checkpoint written mid-epoch (as --checkpoint-every would) is refused
    state.update(step_in_epoch=3, step=7)
    torch.save(state, path)
    _, error = in_process(*one, "--out", stopped, "--resume")
    assert error is not None and "it was written mid-epoch (step 3 of epoch 1)" in error
    # and so is one of a run with another number of steps an epoch (other processes or
    # --workers; another --global-batch is refused by the checkpoint's settings first)
    state.update(step_in_epoch=0, step=2)
    torch.save(state, path)
    _, error = in_process(*one, "--out", stopped, "--resume")
    assert error is not None and "its run had 2 steps an epoch, this one has 4" in error
