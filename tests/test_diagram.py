"""utils.diagram: the job picture of chapter 0 draws every box it names, with its label
inside the box, legibly, for every size it accepts."""

import itertools

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from utils.diagram import MAX_WORKER_BOXES, draw_job, job_labels  # noqa: E402
from utils.viz import MAX_WIDTH_IN, MIN_FONT_PT  # noqa: E402

SIZES = [(w, k) for w, k in itertools.product(range(1, 5), range(5))
         if w * max(k, 1) <= MAX_WORKER_BOXES]


def boxes(fig):
    """{name: (patch, text)} of every box in the figure, found by their shared gid."""
    ax = fig.axes[0]
    patches = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    texts = {t.get_gid(): t for t in ax.texts if t.get_gid()}
    assert set(patches) == set(texts)
    return {name: (patches[name], texts[name]) for name in patches}


def test_the_chapter_picture_draws_the_named_boxes():
    fig = draw_job(world_size=2, workers_per_rank=2)
    drawn = {name: text.get_text() for name, (_, text) in boxes(fig).items()}
    plt.close(fig)
    assert drawn == job_labels(2, 2)
    assert drawn["launcher"] == "launcher: torchrun --nproc_per_node=2"
    assert sorted(n for n in drawn if n.startswith("rank ")) == ["rank 0", "rank 1"]
    assert drawn["sampler 1"] == "DistributedSampler\nshard 1 of 2"
    assert sorted(n for n in drawn if n.startswith("worker ")) == [
        "worker 0.0", "worker 0.1", "worker 1.0", "worker 1.1"]
    assert drawn["worker 1.1"] == "worker 1\n(process)"
    assert drawn["model 0"] == drawn["model 1"] == "model replica\n(DDP)"
    assert drawn["all_reduce"] == "all_reduce: gradients averaged over 2 ranks"


def test_without_workers_the_rank_loads_its_own_samples():
    labels = job_labels(3, 0)
    assert [n for n in labels if n.startswith("worker ")] == [
        "worker 0.main", "worker 1.main", "worker 2.main"]
    assert labels["all_reduce"].endswith("over 3 ranks")
    assert job_labels(1, 1)["all_reduce"].endswith("over 1 rank")


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
