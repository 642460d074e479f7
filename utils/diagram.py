"""The picture of a training job that chapter 0 opens with, drawn from its parameters.

A launcher (``torchrun``) starts one process per GPU, a *rank*; each rank holds a
``DistributedSampler`` that picks its shard of the data, DataLoader worker processes
that load the samples of that shard, and a replica of the model; after each backward
pass the ranks' gradients are averaged with an all-reduce. Every label comes from the
arguments, so the picture cannot disagree with the numbers the chapter runs.

The figure is at most ``MAX_WIDTH_IN`` inches wide and no text in it is smaller than
``MIN_FONT_PT`` points, as in ``utils.viz``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

from ._checks import check_int
from .viz import MAX_WIDTH_IN, MIN_FONT_PT

__all__ = ["draw_job", "job_labels", "MAX_WORKER_BOXES"]

# colours of the boxes: the launcher, a rank, its sampler, its workers, its model,
# the all-reduce
_FILL = {"launcher": "#dddddd", "rank": "#f4f4f4", "sampler": "#c6dbef",
         "worker": "#fdd0a2", "model": "#c7e9c0", "all_reduce": "#dadaeb"}
_HEIGHT_IN = 4.7
# worker boxes side by side across the page that still hold "worker 0" legibly
MAX_WORKER_BOXES = 6


def job_labels(world_size: int = 2, workers_per_rank: int = 2) -> dict[str, str]:
    """The text of every box ``draw_job`` draws, keyed by the box's name."""
    world_size = check_int("world_size", world_size, minimum=1, maximum=4)
    workers_per_rank = check_int("workers_per_rank", workers_per_rank, minimum=0,
                                 maximum=4)
    if world_size * max(workers_per_rank, 1) > MAX_WORKER_BOXES:
        raise ValueError(f"world_size={world_size} with workers_per_rank="
                         f"{workers_per_rank} needs {world_size * workers_per_rank} "
                         f"worker boxes side by side; at most {MAX_WORKER_BOXES} fit "
                         f"the page")
    labels = {"launcher": f"launcher: torchrun --nproc_per_node={world_size}",
              "all_reduce": f"all_reduce: gradients averaged over {world_size} "
                            f"rank{'s' if world_size > 1 else ''}"}
    for r in range(world_size):
        labels[f"rank {r}"] = f"rank {r}\na process (GPU {r})"
        labels[f"sampler {r}"] = f"DistributedSampler\nshard {r} of {world_size}"
        for w in range(workers_per_rank):
            labels[f"worker {r}.{w}"] = f"worker {w}\n(process)"
        if workers_per_rank == 0:
            labels[f"worker {r}.main"] = "num_workers=0:\nloads in\nthe rank"
        labels[f"model {r}"] = "model replica\n(DDP)"
    return labels


def _box(ax, x, y, w, h, labels, name, kind, **text_kw):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.06",
                                facecolor=_FILL[kind], edgecolor="#555555", lw=1,
                                gid=name))
    ax.text(x + w / 2, y + h / 2, labels[name], ha="center", va="center",
            fontsize=MIN_FONT_PT, gid=name, **text_kw)


def _arrow(ax, start, end, both=False):
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle="<|-|>" if both else "-|>", color="#444444",
                                lw=1.1, shrinkA=0, shrinkB=0))


def draw_job(world_size: int = 2, workers_per_rank: int = 2):
    """Draw a job of ``world_size`` ranks with ``workers_per_rank`` DataLoader workers
    each; return the matplotlib Figure.

    Each box is a patch and a text that share a ``gid``, the box's name in
    ``job_labels``, so a test can find them.
    """
    labels = job_labels(world_size, workers_per_rank)
    width = MAX_WIDTH_IN
    fig = plt.figure(figsize=(width, _HEIGHT_IN))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, _HEIGHT_IN)
    ax.set_axis_off()

    _box(ax, width / 2 - 1.9, 4.2, 3.8, 0.4, labels, "launcher", "launcher")
    _box(ax, 0.1, 0.12, width - 0.2, 0.42, labels, "all_reduce", "all_reduce")
    margin, gap = 0.1, 0.12
    column = (width - 2 * margin - (world_size - 1) * gap) / world_size
    for r in range(world_size):
        left = margin + r * (column + gap)
        middle = left + column / 2
        ax.add_patch(FancyBboxPatch((left, 0.8), column, 3.05,
                                    boxstyle="round,pad=0,rounding_size=0.1",
                                    facecolor=_FILL["rank"], edgecolor="#222222",
                                    lw=1.4, gid=f"rank {r}"))
        ax.text(middle, 3.62, labels[f"rank {r}"], ha="center", va="center",
                fontsize=MIN_FONT_PT, fontweight="bold", gid=f"rank {r}")
        _arrow(ax, (width / 2, 4.2), (middle, 3.85))
        _box(ax, left + 0.1, 2.85, column - 0.2, 0.5, labels, f"sampler {r}",
             "sampler")
        workers = ([f"worker {r}.{w}" for w in range(workers_per_rank)]
                   or [f"worker {r}.main"])
        slot = (column - 0.2) / len(workers)
        for k, name in enumerate(workers):
            x = left + 0.1 + k * slot + 0.03
            centre = x + slot / 2 - 0.03
            _box(ax, x, 1.75, slot - 0.06, 0.65, labels, name, "worker")
            _arrow(ax, (centre, 2.85), (centre, 2.4))
            _arrow(ax, (centre, 1.75), (middle, 1.45))
        _box(ax, left + 0.1, 0.95, column - 0.2, 0.5, labels, f"model {r}", "model")
        _arrow(ax, (middle, 0.95), (middle, 0.54), both=True)
    for y, what in ((2.62, "indices"), (1.6, "batches"), (0.69, "gradients")):
        ax.text(margin + 0.06, y, what, ha="left", va="center",
                fontsize=MIN_FONT_PT, style="italic", color="#333333")
    return fig
