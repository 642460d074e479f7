"""Every data set in utils.examples loads through DataLoader workers that do not inherit the test's
state: that is what they are there for. A worker started by spawn, or by a fork server, imports the
class from its module, which it could not do for a class defined in a notebook. The workers here
start from a fork server with torch and utils.examples preloaded (utils.workers): spawn's rules at
the cost of a fork; one test keeps a real spawn, where pickling per worker is its subject.
"""

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler

import utils.examples as examples
from utils.launch import run_distributed
from utils.seeding import seed_worker
from utils.workers import worker_context

PORTABLE = dict(num_workers=2, multiprocessing_context=worker_context("utils.examples"))


def test_custom_dataset_gives_the_samplers_indices_plus_one():
    ds = examples.CustomDataset(16)
    sampler = SequentialSampler(ds)
    loaded = [x for batch in DataLoader(ds, batch_size=4, sampler=sampler, **PORTABLE) for x in batch.tolist()]
    assert loaded == [i + 1 for i in sampler]


def test_who_loaded_reports_the_index_and_the_worker():
    batches = list(DataLoader(examples.WhoLoaded(), batch_size=4, **PORTABLE))
    assert [i for index, _ in batches for i in index.tolist()] == list(range(24))
    # batch b goes to worker b % 2
    assert [worker.tolist() for _, worker in batches] == [[b % 2] * 4 for b in range(6)]


def test_what_workers_see_module_state_at_import_time():
    old = examples.SCALE
    examples.SCALE = 10
    try:
        ds = examples.WhatWorkersSee()
        loader = DataLoader(ds, batch_size=None, worker_init_fn=examples.report_worker_start, **PORTABLE)
        seen = list(loader)
    finally:
        examples.SCALE = old
    assert [s["worker_id"] for s in seen] == [0]
    assert seen[0]["module SCALE"] == 1 and seen[0]["dataset.scale"] == 10
    assert seen[0]["torch seed = info.seed"] is True and seen[0]["process group"] is False


def test_worker_seeds_are_base_seed_plus_worker_id():
    rows = [row for batch in DataLoader(examples.WorkerSeeds(), batch_size=1, **PORTABLE) for row in zip(*batch)]
    workers = [int(r[0]) for r in rows]
    seeds = [int(r[1]) for r in rows]
    assert workers == [0, 1, 0, 1]
    assert seeds[1] == seeds[0] + 1 and [int(r[2]) for r in rows] == seeds


def test_crop_offsets_repeat_per_worker_and_the_fix_does_not():
    broken = [int(o) for _, b in DataLoader(examples.CropOffsets(), batch_size=4, **PORTABLE) for o in b]
    assert len(set(broken)) == 32  # each of the 2 workers replays the same 32 draws
    fixed = DataLoader(examples.CropOffsetsFixed(), batch_size=4, worker_init_fn=seed_worker,
                       generator=torch.Generator().manual_seed(0), **PORTABLE)
    assert len({int(o) for _, b in fixed for o in b}) == 64


def test_article_worker_init_fn_repeats_every_epoch():
    loader = DataLoader(examples.TorchCrop(), batch_size=8, worker_init_fn=examples.article_worker_init_fn, **PORTABLE)
    epochs = [[int(o) for _, b in loader for o in b] for _ in range(2)]
    assert epochs[0] == epochs[1] and len(epochs[0]) == 64


@pytest.mark.parametrize("augment", ["worker_rng", "keyed"])
def test_augmented_samples_follow_the_sampler(augment):
    ds = examples.AugmentedSamples(augment)
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    order = list(sampler)
    sampler.generator.manual_seed(0)
    pairs = [(int(i), int(o)) for idx, off in DataLoader(ds, batch_size=4, sampler=sampler, **PORTABLE)
             for i, o in zip(idx, off)]
    assert [i for i, _ in pairs] == order
    if augment == "keyed":  # the same draw whoever loads it
        single = [(int(i), int(o)) for idx, off in DataLoader(ds, batch_size=4, sampler=order) for i, o in zip(idx, off)]
        assert pairs == single


def test_seed_recorder_and_py_random_crop():
    seeds = [int(s) for s in DataLoader(examples.SeedRecorder(), batch_size=1, **PORTABLE)]
    assert seeds[1] == seeds[0] + 1 and seeds[2:] == seeds[:2]
    offsets = [int(o) for _, b in DataLoader(examples.PyRandomCrop(), batch_size=4, **PORTABLE) for o in b]
    assert len(offsets) == 64 and len(set(offsets)) == 32


def _received(make):
    loader = DataLoader(make(20), batch_size=4, **PORTABLE)
    return [x for batch in loader for x in batch.tolist()]


@pytest.mark.parametrize("name, copies", [("Numbers", 4), ("ShardByWorker", 2), ("ShardByRank", 2)])
def test_iterable_examples_in_ranks_with_portable_workers(name, copies):
    per_rank = run_distributed(_received, 2, getattr(examples, name))
    counts = Counter(x for rank in per_rank for x in rank)
    assert sorted(counts) == list(range(20))
    assert set(counts.values()) == {copies}


def test_shard_by_rank_reads_the_rank_in_init():
    def ranks():
        ds = examples.ShardByRank(10)
        return ds.rank, ds.world_size, list(ds)

    assert run_distributed(ranks, 2) == [(0, 2, [0, 2, 4, 6, 8]), (1, 2, [1, 3, 5, 7, 9])]


def test_worker_pid_counts_one_process_per_worker():
    pids = {int(p) for _, b in DataLoader(examples.WorkerPid(), batch_size=2, **PORTABLE) for p in b}
    assert len(pids) == 2


@pytest.mark.parametrize("context, pickled, tensor", [("spawn", 2, [0, 7, 7, 0]), ("fork", 0, [0] * 4)])
def test_copied_or_shared_spawn_pickles_per_worker(context, pickled, tensor):
    if context not in torch.multiprocessing.get_all_start_methods():
        pytest.skip(f"{context} is not available here")
    ds = examples.CopiedOrShared(megabytes=1)
    examples.CopiedOrShared.pickled = 0
    seen = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context))
    assert examples.CopiedOrShared.pickled == pickled
    assert seen == [[0, 7, 0, 0], [0, 0, 7, 0]]       # each worker sees only its own write
    assert ds.array[:4].tolist() == [0] * 4             # the parent's array is never written
    assert ds.tensor.tolist() == tensor                 # torch's pickler shares tensors


def test_tutorial_seed_worker_cuts_numpys_seed_to_32_bits():
    loader = DataLoader(examples.WorkerSeeds(), batch_size=None, worker_init_fn=examples.tutorial_seed_worker,
                        generator=torch.Generator().manual_seed(0), **PORTABLE)
    firsts = {}
    for worker, seed, _, draw in loader:
        firsts.setdefault(worker, (seed, draw))  # each worker's first draw
    for seed, draw in firsts.values():
        np.random.seed(seed % 2**32)
        assert draw == np.random.randint(2**31)


def test_epoch_keyed_takes_epoch_index_pairs():
    ds = examples.EpochKeyed()
    assert ds[(1, 3)] != ds[(0, 3)] and ds[(1, 3)][0] == 3
    keyed = examples.AugmentedSamples("keyed")
    keyed.epoch = 1
    assert ds[(1, 3)] == keyed[3]


def test_split_range_per_worker_in_ranks_with_portable_workers():
    def batches():
        stream = examples.RangeStream(0, 20)
        loader = DataLoader(stream, batch_size=5, worker_init_fn=examples.split_range_per_worker, **PORTABLE)
        return [b.tolist() for b in loader], (stream.start, stream.end)

    per_rank = run_distributed(batches, 2)
    assert per_rank[0] == ([list(range(0, 5)), list(range(5, 10))], (0, 20))
    assert per_rank[1] == ([list(range(10, 15)), list(range(15, 20))], (0, 20))
