"""Pictures of shards and orders, and the interactive shard explorer.

Every picture is the same kind of grid: one row per rank (or epoch), one column per position,
each cell showing the sample index it holds, coloured by that index so the same sample has the
same colour everywhere. Padded duplicates are hatched and outlined in red.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from .audit import audit_shards

__all__ = ["plot_index_rows", "plot_shards", "plot_epoch_orders", "shard_explorer"]

_PAD_COLOUR = "#d62728"


def plot_index_rows(
    rows: Mapping[str, Sequence[int]],
    dataset_len: int,
    *,
    marked: set[tuple[int, int]] = frozenset(),
    batch_size: int | None = None,
    title: str | None = None,
    ax=None,
    cmap: str = "viridis",
    categories: Mapping[str, Sequence[int]] | None = None,
    category_name: str = "worker",
):
    """Draw labelled rows of indices as a grid; cells in ``marked`` ((row, position) pairs) are hatched.

    With ``categories`` (one int per cell, e.g. the worker that loaded it) cells are coloured by
    category instead of by index, with a legend.
    """
    labels = list(rows)
    width = max((len(r) for r in rows.values()), default=0)
    if ax is None:
        fig_w = min(max(6.0, 0.45 * width + 2.0), 16.0)
        _, ax = plt.subplots(figsize=(fig_w, 0.5 * len(labels) + 1.0))
    colours = plt.get_cmap(cmap)
    palette = plt.get_cmap("tab10")
    show_text = width <= 40
    for r, label in enumerate(labels):
        for p, index in enumerate(rows[label]):
            if categories is not None:
                shade = palette(categories[label][p] % 10)
            else:
                shade = colours(index / max(dataset_len - 1, 1))
            pad = (r, p) in marked
            ax.add_patch(Rectangle((p, r), 1, 1, facecolor=shade, edgecolor=_PAD_COLOUR if pad else "white",
                                   linewidth=2.5 if pad else 1, hatch="//" if pad else None))
            if show_text:
                lum = 0.299 * shade[0] + 0.587 * shade[1] + 0.114 * shade[2]
                ax.text(p + 0.5, r + 0.5, str(index), ha="center", va="center", fontsize=8,
                        color="black" if lum > 0.5 else "white")
    if batch_size:
        for x in range(batch_size, width, batch_size):
            ax.axvline(x, color="black", linewidth=2)
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(len(labels), 0)
    ax.set_yticks(np.arange(len(labels)) + 0.5, labels)
    step = 1 if width <= 40 else max(1, width // 20)
    ax.set_xticks(np.arange(0, width, step) + 0.5, [str(i) for i in range(0, width, step)])
    ax.set_xlabel("position" + (f" (thick lines separate batches of {batch_size})" if batch_size else ""))
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if categories is not None:
        found = sorted({c for row in categories.values() for c in row})
        ax.legend(handles=[Rectangle((0, 0), 1, 1, facecolor=palette(c % 10)) for c in found],
                  labels=[f"{category_name} {c}" for c in found], loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  frameon=False, fontsize=8)
    if marked:
        title = (title + "\n" if title else "") + "hatched red cells: padding (repeated samples)"
    if title:
        ax.set_title(title)
    ax.figure.tight_layout()
    return ax.figure


def plot_shards(shards: Sequence[Sequence[int]], dataset_len: int, *, batch_size: int | None = None,
                title: str | None = None, ax=None):
    """One row per rank, one column per position; padded duplicates (as ``audit_shards`` finds them) hatched."""
    audit = audit_shards(shards, dataset_len)
    rows = {f"rank {r}": list(map(int, s)) for r, s in enumerate(shards)}
    marked = {(r, p) for r, p, _ in audit.padding}
    return plot_index_rows(rows, dataset_len, marked=marked, batch_size=batch_size, title=title, ax=ax)


def plot_epoch_orders(orders: Mapping[str, Sequence[int]], dataset_len: int, *, batch_size: int | None = None,
                      title: str | None = None, ax=None):
    """One row per epoch (or per any label): how the order a rank sees changes from epoch to epoch."""
    rows = {label: list(map(int, order)) for label, order in orders.items()}
    return plot_index_rows(rows, dataset_len, batch_size=batch_size, title=title, ax=ax)


def shard_explorer(dataset_len: int = 25, world_size: int = 3, batch_size: int = 4):
    """An ipywidgets explorer of ShardSampler's shards; needs a running kernel to be interactive."""
    import ipywidgets as widgets
    from IPython.display import display

    from .samplers import ShardSampler

    controls = {
        "dataset_len": widgets.IntSlider(value=dataset_len, min=0, max=64, description="dataset size"),
        "world_size": widgets.IntSlider(value=world_size, min=1, max=8, description="world size"),
        "shuffle": widgets.Checkbox(value=True, description="shuffle"),
        "seed": widgets.IntSlider(value=0, min=0, max=20, description="seed"),
        "epoch": widgets.IntSlider(value=0, min=0, max=10, description="epoch"),
        "drop_last": widgets.Checkbox(value=False, description="drop_last"),
        "batch_size": widgets.IntSlider(value=batch_size, min=1, max=16, description="batch size"),
    }

    def draw(dataset_len, world_size, shuffle, seed, epoch, drop_last, batch_size):
        shards = []
        for rank in range(world_size):
            sampler = ShardSampler(range(dataset_len), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        plot_shards(shards, dataset_len, batch_size=batch_size,
                    title=f"ShardSampler: {dataset_len} samples, {world_size} ranks, epoch {epoch}")
        plt.show()
        print(audit_shards(shards, dataset_len))

    out = widgets.interactive_output(draw, controls)
    ui = widgets.VBox([widgets.HBox(list(controls.values())[:4]), widgets.HBox(list(controls.values())[4:]), out])
    display(ui)
    return ui
