"""Pictures of shards and orders, and the interactive shard explorer.

Every picture is the same kind of grid: one row per rank (or epoch), one column per
position, each cell showing the sample index it holds, coloured by that index so the
same sample has the same colour everywhere. Padded duplicates are hatched and outlined
in red.

Figures are at most ``MAX_WIDTH_IN`` inches wide, so that at matplotlib's 100 dpi they
fit the book's column (about 690 CSS pixels in a 1280-pixel window) without being
shrunk, and every text in them is at least ``MIN_FONT_PT`` points.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from matplotlib.transforms import offset_copy

from .audit import audit_shards

__all__ = ["plot_index_rows", "plot_shards", "plot_epoch_orders", "shard_explorer",
           "explorer_picture", "MAX_WIDTH_IN", "MIN_FONT_PT"]

_PAD_COLOUR = "#d62728"
MAX_WIDTH_IN = 6.8  # the book's column at 100 dpi
MIN_FONT_PT = 9
# a cell shows its index only if two digits at MIN_FONT_PT fit in it (with a margin)
_MIN_CELL_PT = 1.6 * MIN_FONT_PT


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
    value_offset: int = 0,
):
    """Draw labelled rows of indices as a grid, hatching the ``marked`` (row, position).

    Each cell is coloured by its index and shows ``index + value_offset``: the sample's
    value for a data set whose sample ``i`` holds ``i + value_offset``. With
    ``categories`` (one int per cell, e.g. the worker that loaded it) cells are
    coloured by category instead of by index, with a legend under the grid.
    """
    labels = list(rows)
    width = max((len(r) for r in rows.values()), default=0)
    if ax is None:
        fig_w = min(max(5.0, 0.45 * width + 2.0), MAX_WIDTH_IN)
        legend_h = 0.3 if categories is not None else 0.0
        _, ax = plt.subplots(figsize=(fig_w, 0.5 * len(labels) + 1.0 + legend_h))
    shades = _draw_cells(ax, rows, dataset_len, marked, cmap, categories)
    if batch_size:
        for x in range(batch_size, width, batch_size):
            ax.axvline(x, color="black", linewidth=2)
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(len(labels), 0)
    ax.set_yticks(np.arange(len(labels)) + 0.5, labels)
    ax.set_xticks([0.5], ["0"])  # the real ticks are set once the axes' width is known
    ax.set_xlabel("position" + (f" (thick lines: batches of {batch_size})"
                                if batch_size else ""))
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if categories is not None:
        _category_legend(ax, categories, category_name)
    if marked:
        note = "hatched red cells: padding (repeated samples)"
        title = f"{title}\n{note}" if title else note
    if title:
        ax.set_title(title, fontsize=10)
    fig = ax.figure
    fig.tight_layout()
    _number_cells_and_positions(ax, rows, shades, width, value_offset)
    fig.tight_layout()
    return fig


def _draw_cells(ax, rows, dataset_len, marked, cmap, categories) -> dict:
    """One square per (row, position), coloured by its index (or its category);
    ``marked`` ones hatched and outlined in red. The colour of each, by (row,
    position)."""
    colours = plt.get_cmap(cmap)
    palette = plt.get_cmap("tab10")
    shades = {}
    for r, label in enumerate(rows):
        for p, index in enumerate(rows[label]):
            if categories is not None:
                shade = palette(categories[label][p] % 10)
            else:
                shade = colours(index / max(dataset_len - 1, 1))
            shades[r, p] = shade
            pad = (r, p) in marked
            ax.add_patch(Rectangle((p, r), 1, 1, facecolor=shade,
                                   edgecolor=_PAD_COLOUR if pad else "white",
                                   linewidth=2.5 if pad else 1,
                                   hatch="//" if pad else None))
    return shades


def _category_legend(ax, categories, category_name) -> None:
    """A legend of the categories' colours under the grid, in one row."""
    palette = plt.get_cmap("tab10")
    found = sorted({c for row in categories.values() for c in row})
    ax.legend(handles=[Rectangle((0, 0), 1, 1, facecolor=palette(c % 10))
                       for c in found],
              labels=[f"{category_name} {c}" for c in found], loc="upper center",
              # under the tick labels and the axis label
              # one row; two for many categories, to stay within the column
              bbox_to_anchor=(0.5, 0), ncol=len(found) if len(found) <= 6
              else -(-len(found) // 2), frameon=False,
              bbox_transform=offset_copy(ax.transAxes, ax.figure, y=-36,
                                         units="points"),
              fontsize=MIN_FONT_PT)


def _number_cells_and_positions(ax, rows, shades, width, value_offset) -> None:
    """Each cell's ``index + value_offset``, where cells are wide enough at
    ``MIN_FONT_PT``, and position ticks at least 20 points apart; needs the laid-out
    axes' width."""
    labels = list(rows)
    fig = ax.figure
    # the width of one cell in points, now that the row labels have taken their share
    cell_pt = ax.get_position().width * fig.get_figwidth() * 72 / max(width, 1)
    if cell_pt >= _MIN_CELL_PT:
        for (r, p), shade in shades.items():
            lum = 0.299 * shade[0] + 0.587 * shade[1] + 0.114 * shade[2]
            ax.text(p + 0.5, r + 0.5, str(rows[labels[r]][p] + value_offset),
                    ha="center", va="center",
                    fontsize=MIN_FONT_PT, color="black" if lum > 0.5 else "white")
    # tick labels (up to three digits at 10 pt) at least 20 points apart
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
                if s * cell_pt >= 20 or s == 5000)
    ticks = range(0, width, step)
    ax.set_xticks(np.array(ticks) + 0.5, [str(i) for i in ticks])


def plot_shards(shards: Sequence[Sequence[int]], dataset_len: int, *,
                batch_size: int | None = None, title: str | None = None, ax=None):
    """One row per rank, one column per position; padding (``audit_shards``) hatched."""
    audit = audit_shards(shards, dataset_len)
    rows = {f"rank {r}": list(map(int, s)) for r, s in enumerate(shards)}
    marked = {(r, p) for r, p, _ in audit.padding}
    return plot_index_rows(rows, dataset_len, marked=marked, batch_size=batch_size,
                           title=title, ax=ax)


def plot_epoch_orders(orders: Mapping[str, Sequence[int]], dataset_len: int, *,
                      batch_size: int | None = None, title: str | None = None, ax=None,
                      value_offset: int = 0):
    """One row per epoch (or any label): how the order a rank sees changes by epoch."""
    rows = {label: list(map(int, order)) for label, order in orders.items()}
    return plot_index_rows(rows, dataset_len, batch_size=batch_size, title=title, ax=ax,
                           value_offset=value_offset)


def explorer_picture(dataset_len: int = 25, world_size: int = 3, shuffle: bool = True,
                     seed: int = 0, epoch: int = 0, drop_last: bool = False,
                     batch_size: int = 4):
    """What the shard explorer draws for one setting of its controls: (figure, audit).

    The defaults are the explorer's own, so the book can show its first picture as a
    static figure.
    """
    from .samplers import ShardSampler

    shards = []
    for rank in range(world_size):
        sampler = ShardSampler(range(dataset_len), world_size, rank, shuffle=shuffle,
                               seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    fig = plot_shards(shards, dataset_len, batch_size=batch_size,
                      title=f"ShardSampler: {dataset_len} samples, {world_size} ranks, "
                            f"epoch {epoch}")
    return fig, audit_shards(shards, dataset_len)


def shard_explorer(dataset_len: int = 25, world_size: int = 3, batch_size: int = 4):
    """An ipywidgets explorer of ShardSampler's shards; it needs a running kernel."""
    import ipywidgets as widgets
    from IPython.display import display

    controls = {
        "dataset_len": widgets.IntSlider(value=dataset_len, min=0, max=64,
                                         description="dataset size"),
        "world_size": widgets.IntSlider(value=world_size, min=1, max=8,
                                        description="world size"),
        "shuffle": widgets.Checkbox(value=True, description="shuffle"),
        "seed": widgets.IntSlider(value=0, min=0, max=20, description="seed"),
        "epoch": widgets.IntSlider(value=0, min=0, max=10, description="epoch"),
        "drop_last": widgets.Checkbox(value=False, description="drop_last"),
        "batch_size": widgets.IntSlider(value=batch_size, min=1, max=16,
                                        description="batch size"),
    }

    def draw(**settings):
        _, audit = explorer_picture(**settings)
        plt.show()
        print(audit)

    out = widgets.interactive_output(draw, controls)
    boxes = list(controls.values())
    ui = widgets.VBox([widgets.HBox(boxes[:4]), widgets.HBox(boxes[4:]), out])
    display(ui)
    return ui
