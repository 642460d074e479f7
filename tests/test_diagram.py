"""utils.diagram: the job picture of chapter 0 draws every box and note it names, each
label inside its box (the notes inside the figure), legibly, for every size it accepts;
it shows the whole data set on every rank, the rendezvous, the broadcast of rank 0's
weights and the all-reduce as arrows between the ranks, not as a box they report to."""

import itertools

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from utils.diagram import MAX_WORKER_BOXES, draw_job, job_labels  # noqa: E402
from utils.viz import MAX_WIDTH_IN, MIN_FONT_PT  # noqa: E402

SIZES = [(w, k) for w, k in itertools.product(range(1, 5), range(5))
         if w * max(k, 1) <= MAX_WORKER_BOXES]


NOTES = {"all_reduce", "broadcast"}  # texts under the ranks, not boxes


def boxes(fig):
    """{name: (patch, text)} of every box in the figure, found by their shared gid."""
    ax = fig.axes[0]
    patches = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    texts = {t.get_gid(): t for t in ax.texts if t.get_gid()}
    assert set(texts) - set(patches) == NOTES and set(patches) <= set(texts)
    return {name: (patches[name], texts[name]) for name in patches}


def drawn_texts(fig):
    return {t.get_gid(): t.get_text() for t in fig.axes[0].texts if t.get_gid()}


def test_the_chapter_picture_draws_the_named_boxes():
    fig = draw_job(world_size=2, workers_per_rank=2)
    drawn = drawn_texts(fig)
    assert set(boxes(fig)) == set(drawn) - NOTES
    plt.close(fig)
    assert drawn == job_labels(2, 2)
    assert drawn["launcher"] == ("launcher: torchrun --nproc_per_node=2\n"
                                 "rendezvous: the ranks meet at one address")
    assert sorted(n for n in drawn if n.startswith("rank ")) == ["rank 0", "rank 1"]
    # every rank holds the whole data set; the sampler splits the indices
    assert drawn["data 0"] == drawn["data 1"] == "whole data set\n(every rank)"
    assert drawn["sampler 1"] == "DistributedSampler\nthe indices of\nshard 1 of 2"
    assert sorted(n for n in drawn if n.startswith("worker ")) == [
        "worker 0.0", "worker 0.1", "worker 1.0", "worker 1.1"]
    assert drawn["worker 1.1"] == "worker 1\n(process)"
    assert drawn["model 0"] == drawn["model 1"] == "model replica\n(DDP)"
    assert drawn["all_reduce"].startswith("all_reduce (solid): after each backward, the 2 "
                                          "ranks exchange gradients")
    assert drawn["broadcast"].startswith("broadcast (dashed): at the start, rank 0's")


def test_the_all_reduce_and_the_broadcast_are_arrows_between_neighbouring_replicas():
    for world_size in (1, 2, 4):
        fig = draw_job(world_size, 1)
        arrows = [a.arrow_patch for a in fig.axes[0].texts if hasattr(a, "arrow_patch")
                  and a.arrow_patch is not None]
        styles = [a.get_linestyle() for a in arrows]
        plt.close(fig)
        # between replicas: one solid double arrow and one dashed one per neighbour pair
        assert styles.count("--") == world_size - 1, styles
        assert "all_reduce" not in {p.get_gid() for p in fig.axes[0].patches}


def test_without_workers_the_rank_loads_its_own_samples():
    labels = job_labels(3, 0)
    assert [n for n in labels if n.startswith("worker ")] == [
        "worker 0.main", "worker 1.main", "worker 2.main"]
    assert "the 3 ranks exchange" in labels["all_reduce"]
    assert job_labels(1, 1)["all_reduce"] == "all_reduce over 1 rank: its own gradients"


@pytest.mark.parametrize("world_size, workers", SIZES)
def test_every_label_fits_its_box_and_is_legible(world_size, workers):
    fig = draw_job(world_size, workers)
    assert fig.get_size_inches()[0] <= MAX_WIDTH_IN
    renderer = fig.canvas.get_renderer()
    for name, (patch, text) in boxes(fig).items():
        assert text.get_fontsize() >= MIN_FONT_PT, name
        inside = patch.get_window_extent(renderer)
        label = text.get_window_extent(renderer)
        assert (inside.x0 <= label.x0 and label.x1 <= inside.x1
                and inside.y0 <= label.y0 and label.y1 <= inside.y1), (name, label,
                                                                       inside)
    assert all(t.get_fontsize() >= MIN_FONT_PT for t in fig.axes[0].texts)
    page = fig.bbox  # the notes under the ranks fit the figure's width
    for text in fig.axes[0].texts:
        extent = text.get_window_extent(renderer)
        assert page.x0 <= extent.x0 and extent.x1 <= page.x1, (text.get_gid(), extent)
    plt.close(fig)


@pytest.mark.parametrize("args, error, match", [
    ((0, 2), ValueError, "world_size=0 is out of range"),
    ((5, 1), ValueError, "world_size=5 is out of range"),
    ((2, -1), ValueError, "workers_per_rank=-1 is out of range"),
    ((4, 2), ValueError, "at most 6 fit the page"),
    ((2.0, 2), TypeError, "world_size must be an integer"),
])
def test_sizes_that_would_not_fit_are_refused(args, error, match):
    with pytest.raises(error, match=match):
        draw_job(*args)
