"""utils.concepts.data: each conceptual figure draws what the chapter's own samplers
give (torch's DistributedSampler and BatchSampler, the DataLoader's workers,
utils.train_cifar10's EpochSampler and linear rule, WebDataset's split), legibly, each
label inside its box and no text over another."""

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler  # noqa: E402

from utils.audit import audit_shards  # noqa: E402
from utils.concepts import data  # noqa: E402
from utils.examples import WhoLoaded  # noqa: E402
from utils.train_cifar10.checkpoints import EpochSampler  # noqa: E402
from utils.train_cifar10.recipe import linear_rule_lr  # noqa: E402
from utils.viz import MAX_WIDTH_IN, MIN_FONT_PT  # noqa: E402
from utils.workers import worker_context  # noqa: E402

FIGURES = ["index_path", "stride_and_chunk", "global_batch", "shards_dealt",
           "checkpoint_position"]


@pytest.fixture(scope="module")
def figures():
    """Each figure with its chapter's defaults, drawn once for the whole module."""
    drawn = {name: getattr(data, f"draw_{name}")() for name in FIGURES}
    yield drawn
    for fig in drawn.values():
        plt.close(fig)


def shard(n, world, rank, shuffle=True, seed=0, epoch=0):
    sampler = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def boxes(fig):
    """{gid: (patch, text)} of every box and grid cell, found by their shared gid."""
    found = {}
    for ax in fig.axes:
        texts = {t.get_gid(): t for t in ax.texts if t.get_gid()}
        for p in ax.patches:
            if p.get_gid():
                found[p.get_gid()] = (p, texts[p.get_gid()])
    return found


def texts_by_gid(fig):
    return {t.get_gid(): t.get_text() for ax in fig.axes for t in ax.texts
            if t.get_gid()}


def cells(fig):
    """{(row, position): index} of a figure's sparse grid (gid ``cell row pos``)."""
    return {tuple(map(int, gid.split()[1:])): int(text)
            for gid, text in texts_by_gid(fig).items() if gid.startswith("cell ")}


def index_grid(ax):
    """({(row, column): index}, {hatched (row, column)}) of a plot_index_rows grid."""
    numbers = {(int(t.get_position()[1]), int(t.get_position()[0])): int(t.get_text())
               for t in ax.texts}
    hatched = {(int(p.get_y()), int(p.get_x())) for p in ax.patches if p.get_hatch()}
    return numbers, hatched


def test_the_index_path_draws_the_samplers_batches():
    for n, world, rank, batch in [(12, 2, 0, 2), (12, 2, 1, 2), (10, 3, 2, 1)]:
        path = data.index_path(n, world, rank, batch, num_workers=2, seed=3)
        real = list(BatchSampler(DistributedSampler(range(n), world, rank, seed=3),
                                 batch, drop_last=False))
        assert path["batches"] == real
        fig = data.draw_index_path(n, world, rank, batch, num_workers=2, seed=3)
        drawn = texts_by_gid(fig)
        plt.close(fig)
        assert [drawn[f"batch {i}"] for i in range(len(real))] == [
            f"batch {i}\n{b}" for i, b in enumerate(real)]
        assert drawn["sampler"].endswith(
            ", ".join(str(i) for b in real for i in b))
        assert f"cuda:{rank}" in drawn["device"]


def test_each_batch_is_drawn_going_to_the_worker_that_loads_it(figures):
    sampler = BatchSampler(DistributedSampler(range(12), 2, 0, seed=0), 2, False)
    loader = DataLoader(WhoLoaded(), batch_sampler=sampler, num_workers=2,
                        multiprocessing_context=worker_context("utils.examples"))
    loaded_by = [int(worker[0]) for _, worker in loader]
    assert data.index_path()["worker"] == loaded_by == [0, 1, 0]
    fig = figures["index_path"]
    drawn = texts_by_gid(fig)
    assert drawn["worker 0"].startswith("worker 0: batches 0, 2\n")
    assert drawn["worker 1"].startswith("worker 1: batch 1\n")
    # each arrow from a batch (its tail on the batches' row) ends on its worker's box
    found = boxes(fig)
    centre = {name: found[name][0].get_x() + found[name][0].get_width() / 2
              for name in found}
    arrows = {round(a.xyann[0], 6): a.xy[0] for a in fig.axes[0].texts
              if isinstance(a, Annotation) and a.xyann[1] == 2.9}
    for b, worker in enumerate(loaded_by):
        assert arrows[round(centre[f"batch {b}"], 6)] == centre[f"worker {worker}"]


@pytest.mark.parametrize("n, world", [(10, 3), (7, 2), (12, 4), (5, 5)])
def test_stride_is_distributed_samplers_and_chunks_cut_the_same_order(n, world):
    split = data.stride_and_chunk(n, world)
    assert split["stride"] == [shard(n, world, r, shuffle=False) for r in range(world)]
    per_rank = len(split["stride"][0])
    # the padded order, read back from the stride: position p of rank r is p*R + r
    padded = [split["stride"][g % world][g // world] for g in range(per_rank * world)]
    assert [i for c in split["chunk"] for i in c] == padded
    assert all(len(c) == per_rank for c in split["chunk"])
    assert split["stride padding"] == {(r, p) for r, p, _ in
                                       audit_shards(split["stride"], n).padding}
    # the padded cells are exactly the repeats: those beyond the data set's n
    beyond = {g for g in range(per_rank * world) if g >= n}
    assert {p * world + r for r, p in split["stride padding"]} == beyond
    assert {r * per_rank + p for r, p in split["chunk padding"]} == beyond


def test_the_stride_and_chunk_figure_draws_those_cells(figures):
    split = data.stride_and_chunk()
    numbers, hatched = index_grid(figures["stride_and_chunk"].axes[0])
    rows = split["stride"] + split["chunk"]
    assert numbers == {(r, p): i for r, row in enumerate(rows)
                       for p, i in enumerate(row)}
    assert hatched == split["stride padding"] | {
        (r + 3, p) for r, p in split["chunk padding"]} == {(1, 3), (2, 3), (5, 2),
                                                           (5, 3)}


def test_the_global_batch_is_the_ranks_batches_and_the_lr_the_scripts():
    for world, G, step, model in [(4, 16, 0, "simplecnn"), (2, 8, 3, "resnet18")]:
        fig = data.draw_global_batch(64, G, world, step, model, seed=1, epoch=2)
        grid, drawn = cells(fig), texts_by_gid(fig)
        plt.close(fig)
        order = {pos: i for (row, pos), i in grid.items() if row == 0}
        assert sorted(order) == list(range(step * G, (step + 1) * G))
        for r in range(world):
            batch = list(BatchSampler(shard(64, world, r, seed=1, epoch=2),
                                      G // world, True))[step]
            mine = sorted((pos, i) for (row, pos), i in grid.items() if row == r + 1)
            assert [i for _, i in mine] == batch
            # each rank's cell sits where its index is in the epoch's order
            assert all(order[pos] == i for pos, i in mine)
        lr = float(drawn["lr"].split("\n= ")[1].split(";")[0])
        assert lr == linear_rule_lr(model, G)
        assert drawn["global"].startswith(f"global batch = {world} ranks x "
                                          f"{G // world} samples = {G} samples")


@pytest.mark.parametrize("shards, world, workers", [(8, 2, 2), (7, 4, 2), (9, 3, 1)])
def test_shards_are_dealt_as_webdataset_splits_them(shards, world, workers,
                                                    monkeypatch):
    import webdataset as wds

    urls = [str(s) for s in range(shards)]
    for reshuffle in (False, True):
        dealt = data.deal_shards(shards, world, workers, 3, reshuffle, seed=5)
        for epoch in range(3):
            for r in range(world):
                for w in range(workers):
                    for name, value in dict(RANK=r, WORLD_SIZE=world, WORKER=w,
                                            NUM_WORKERS=workers).items():
                        monkeypatch.setenv(name, str(value))
                    listed = wds.SimpleShardList(
                        urls, seed=5 + epoch if reshuffle else None)
                    split = wds.DataPipeline(listed, wds.split_by_node,
                                             wds.split_by_worker)
                    assert dealt[epoch][r][w] == [int(s["url"]) for s in split]


def test_the_shards_figure_draws_both_deals(figures):
    for ax, reshuffle in zip(figures["shards_dealt"].axes, (False, True)):
        dealt = data.deal_shards(reshuffle=reshuffle)
        numbers, _ = index_grid(ax)
        assert numbers == {(e, k): s for e, ranks in enumerate(dealt) for k, s in
                           enumerate(s for rank in ranks for mine in rank
                                     for s in mine)}
    assert data.deal_shards()[0] == data.deal_shards()[2] != data.deal_shards(
        reshuffle=True)[0]


def test_the_checkpoint_figure_draws_epoch_samplers_before_and_after(figures):
    grid, drawn = cells(figures["checkpoint_position"]), texts_by_gid(
        figures["checkpoint_position"])
    order = {pos: i for (row, pos), i in grid.items() if row == 0}
    assert list(order.values()) == shard(24, 1, 0, epoch=1)
    rows = [(2, r, 0, 6) for r in range(2)] + [(3, r, 4, 8) for r in range(3)]
    seen = []
    for row, (world, r, start, stop) in enumerate(rows, start=1):
        sampler = EpochSampler(range(24), world, r, shuffle=True, seed=0)
        sampler.set_epoch(1, start=start, stop=stop)
        mine = sorted((pos, i) for (k, pos), i in grid.items() if k == row)
        assert [(1, i) for _, i in mine] == list(sampler)
        assert all(order[pos] == i for pos, i in mine)
        assert all((pos < 12) == (world == 2) for pos, _ in mine)
        seen += [pos for pos, _ in mine]
    # before and after together: every position of the epoch exactly once
    assert sorted(seen) == list(range(24))
    assert drawn["checkpoint"].startswith("checkpoint: epoch 1, step_in_epoch 2, "
                                          "seed 0, global batch 6")


@pytest.mark.parametrize("name", FIGURES)
def test_every_text_is_legible_inside_its_box_and_clear_of_the_others(name, figures):
    fig = figures[name]
    assert fig.get_size_inches()[0] <= MAX_WIDTH_IN
    renderer = fig.canvas.get_renderer()
    for gid, (patch, text) in boxes(fig).items():
        inside, label = patch.get_window_extent(renderer), text.get_window_extent(
            renderer)
        assert (inside.x0 <= label.x0 and label.x1 <= inside.x1
                and inside.y0 <= label.y0 and label.y1 <= inside.y1), (gid, label)
    texts = [t for ax in fig.axes for t in [*ax.texts, ax.title]
             if t.get_text() and not isinstance(t, Annotation)]
    extents = [t.get_window_extent(renderer) for t in texts]
    for k, (text, extent) in enumerate(zip(texts, extents)):
        assert text.get_fontsize() >= MIN_FONT_PT, text.get_text()
        assert fig.bbox.x0 <= extent.x0 and extent.x1 <= fig.bbox.x1, text.get_text()
        assert fig.bbox.y0 <= extent.y0 and extent.y1 <= fig.bbox.y1, text.get_text()
        for other, theirs in zip(texts[k + 1:], extents[k + 1:]):
            assert not extent.overlaps(theirs), (text.get_text(), other.get_text())


@pytest.mark.parametrize("call, error, match", [
    (lambda: data.index_path(rank=2), ValueError, "rank=2 is out of range"),
    (lambda: data.index_path(n=40), ValueError, "at most 5"),
    (lambda: data.stride_and_chunk(num_replicas=0), ValueError, "num_replicas=0"),
    (lambda: data.global_batch(global_batch_size=10), ValueError,
     "does not split over world_size=4"),
    (lambda: data.global_batch(model="vgg"), ValueError, "model must be one of"),
    (lambda: data.deal_shards(reshuffle=1), TypeError, "reshuffle must be True"),
    (lambda: data.checkpoint_position(after=4), ValueError, "does not split over "
     "after=4"),
    (lambda: data.checkpoint_position(stop_step=4), ValueError, "stop_step=4"),
])
def test_settings_that_cannot_be_drawn_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()
