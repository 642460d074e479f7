"""The picture of a training job that chapter 0 opens with, drawn from its parameters.

A launcher (``torchrun``) is where the ranks meet (the rendezvous) and starts one
process per GPU, a *rank*; each rank holds the whole data set, a ``DistributedSampler``
that picks the indices of its shard, DataLoader worker processes that load the samples
of those indices, and a replica of the model. At the start rank 0's weights are
broadcast to every rank; after each backward pass the ranks exchange their gradients
with each other (an all-reduce: no rank or server in the middle), and each ends with
the average. Every label comes from the arguments, so the picture cannot disagree with
the numbers the chapter runs.

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
_FILL = {"launcher": "#dddddd", "rank": "#f4f4f4", "data": "#ffffff",
         "sampler": "#c6dbef", "worker": "#fdd0a2", "model": "#c7e9c0"}
_HEIGHT_IN = 4.7
# worker boxes side by side across the page that still hold "worker 0" legibly
MAX_WORKER_BOXES = 6


def job_labels(world_size: int = 2, workers_per_rank: int = 2) -> dict[str, str]:
    """The text of every box and note ``draw_job`` draws, keyed by its name."""
    world_size = check_int("world_size", world_size, minimum=1, maximum=4)
    workers_per_rank = check_int("workers_per_rank", workers_per_rank, minimum=0,
                                 maximum=4)
    if world_size * max(workers_per_rank, 1) > MAX_WORKER_BOXES:
        raise ValueError(f"world_size={world_size} with workers_per_rank="
                         f"{workers_per_rank} needs {world_size * workers_per_rank} "
                         f"worker boxes side by side; at most {MAX_WORKER_BOXES} fit "
                         f"the page")
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    labels = {"launcher": f"launcher: torchrun --nproc_per_node={world_size}\n"
                          "rendezvous: the ranks meet at one address",
              "all_reduce": (f"all_reduce (solid): after each backward, the {ranks} "
                             "exchange gradients; each ends with their average"
                             if world_size > 1 else
                             "all_reduce over 1 rank: its own gradients"),
              "broadcast": ("broadcast (dashed): at the start, rank 0's weights go to "
                            "every rank: the replicas begin equal"
                            if world_size > 1 else
                            "broadcast: 1 rank, nothing to send")}
    for r in range(world_size):
        labels[f"rank {r}"] = f"rank {r}\na process (GPU {r})"
        labels[f"data {r}"] = "whole data set\n(every rank)"
        labels[f"sampler {r}"] = (f"DistributedSampler\nthe indices of\n"
                                  f"shard {r} of {world_size}")
        for w in range(workers_per_rank):
            labels[f"worker {r}.{w}"] = f"worker {w}\n(process)"
        if workers_per_rank == 0:
            labels[f"worker {r}.main"] = "num_workers=0:\nloads in\nthe rank"
        labels[f"model {r}"] = "model replica\n(DDP)"
    return labels


def _canvas(height: float):
    """A figure of the book's column width whose data coordinates are inches."""
    fig = plt.figure(figsize=(MAX_WIDTH_IN, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, MAX_WIDTH_IN)
    ax.set_ylim(0, height)
    ax.set_axis_off()
    return fig, ax


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
    ``job_labels``; the two notes at the bottom (the all-reduce and the broadcast,
    drawn as arrows between the ranks' replicas, not as a box of their own) are texts
    with their names as ``gid``, so a test can find them.
    """
    labels = job_labels(world_size, workers_per_rank)
    width = MAX_WIDTH_IN
    fig, ax = _canvas(_HEIGHT_IN)

    _box(ax, width / 2 - 2.2, 4.12, 4.4, 0.5, labels, "launcher", "launcher")
    for y, name in ((0.48, "all_reduce"), (0.2, "broadcast")):
        ax.text(width / 2, y, labels[name], ha="center", va="center",
                fontsize=MIN_FONT_PT, gid=name)
    margin, gap = 0.1, 0.15
    column = (width - 2 * margin - (world_size - 1) * gap) / world_size
    for r in range(world_size):
        left = margin + r * (column + gap)
        middle = left + column / 2
        ax.add_patch(FancyBboxPatch((left, 0.75), column, 3.15,
                                    boxstyle="round,pad=0,rounding_size=0.1",
                                    facecolor=_FILL["rank"], edgecolor="#222222",
                                    lw=1.4, gid=f"rank {r}"))
        ax.text(middle, 3.68, labels[f"rank {r}"], ha="center", va="center",
                fontsize=MIN_FONT_PT, fontweight="bold", gid=f"rank {r}")
        _arrow(ax, (width / 2, 4.12), (middle, 3.9))
        _box(ax, left + 0.1, 3.02, column - 0.2, 0.4, labels, f"data {r}", "data")
        _box(ax, left + 0.1, 2.3, column - 0.2, 0.58, labels, f"sampler {r}",
             "sampler")
        workers = ([f"worker {r}.{w}" for w in range(workers_per_rank)]
                   or [f"worker {r}.main"])
        slot = (column - 0.2) / len(workers)
        for k, name in enumerate(workers):
            x = left + 0.1 + k * slot + 0.03
            centre = x + slot / 2 - 0.03
            _box(ax, x, 1.6, slot - 0.06, 0.54, labels, name, "worker")
            _arrow(ax, (centre, 2.3), (centre, 2.14))
            _arrow(ax, (centre, 1.6), (middle, 1.4))
        _box(ax, left + 0.1, 0.9, column - 0.2, 0.5, labels, f"model {r}", "model")
        if r:  # between this replica and the one on its left
            _arrow(ax, (left - gap - 0.1, 1.27), (left + 0.1, 1.27), both=True)
            ax.annotate("", xy=(left + 0.1, 1.03), xytext=(left - gap - 0.1, 1.03),
                        arrowprops=dict(arrowstyle="-|>", color="#444444", lw=1.1,
                                        linestyle="--", shrinkA=0, shrinkB=0))
    for y, what in ((2.22, "indices"), (1.5, "batches")):
        ax.text(margin + 0.06, y, what, ha="left", va="center",
                fontsize=MIN_FONT_PT, style="italic", color="#333333")
    return fig
