"""Conceptual figures about data: each drawn from the samplers its chapter runs.

- ``draw_index_path`` (chapter 6): an index's path from ``DistributedSampler`` through
  ``BatchSampler``, the DataLoader's workers, ``collate_fn`` and ``pin_memory`` to the
  rank's device;
- ``draw_stride_and_chunk`` (chapter 2): ``DistributedSampler``'s stride against the
  chunks a reader might expect, padding marked;
- ``draw_global_batch`` (chapter 11): one step's global batch as the ranks' batches,
  and the learning rate ``utils.train_cifar10`` scales to it;
- ``draw_shards_dealt`` (chapter 16): shard files dealt to ranks and workers, the same
  every epoch (WebDataset's ``split_by_node``, ``split_by_worker``) or dealt anew by the
  epoch's seed;
- ``draw_checkpoint_position`` (chapter 12): what a checkpoint records of an epoch, and
  how a run on another number of ranks deals the rest of it.

Each ``draw_*`` function has a pure twin that returns what it draws (``index_path``,
``stride_and_chunk``, ``global_batch``, ``deal_shards``, ``checkpoint_position``), so a
test can compare the figure with the samplers themselves. Boxes and grid cells are a
patch and a text sharing a ``gid``, as in ``utils.diagram``.
"""

from __future__ import annotations

import math
import random

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle
from torch.utils.data import BatchSampler, DistributedSampler

from .._checks import check_bool, check_int, check_rank
from ..diagram import _arrow, _box, _canvas
from ..viz import MAX_WIDTH_IN, MIN_FONT_PT, plot_index_rows

__all__ = ["index_path", "draw_index_path", "stride_and_chunk",
           "draw_stride_and_chunk", "global_batch", "draw_global_batch",
           "deal_shards", "draw_shards_dealt", "checkpoint_position",
           "draw_checkpoint_position"]

# boxes side by side in one row of draw_index_path that still hold their text
_MAX_BATCH_BOXES = 5
_LABEL_IN = 1.45  # the column of row labels in the figures drawn here
_CELL_H = 0.3  # the height of a grid row, in inches
_MIN_CELL_IN = 1.6 * MIN_FONT_PT / 72  # two digits at MIN_FONT_PT, with a margin


def _two_notes(ax, labels, upper: tuple[str, str], lower: tuple[str, str]) -> None:
    """Two full-width boxes under a grid: (name in ``labels``, fill kind) each."""
    for y, (name, kind) in ((0.75, upper), (0.1, lower)):
        _box(ax, 0.1, y, MAX_WIDTH_IN - 0.2, 0.55, labels, name, kind)


def _rank_shard(n: int, num_replicas: int, rank: int, shuffle: bool, seed: int,
                epoch: int) -> list[int]:
    """Rank ``rank``'s indices from torch's own ``DistributedSampler``."""
    sampler = DistributedSampler(range(n), num_replicas, rank, shuffle=shuffle,
                                 seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def index_path(n: int = 12, num_replicas: int = 2, rank: int = 0, batch_size: int = 2,
               num_workers: int = 2, shuffle: bool = True, seed: int = 0) -> dict:
    """The indices ``draw_index_path`` draws: rank ``rank``'s ``indices``, the
    ``batches`` ``BatchSampler`` makes of them and the ``worker`` each batch goes to."""
    n = check_int("n", n, minimum=1)
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    rank = check_rank(rank, num_replicas)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    num_workers = check_int("num_workers", num_workers, minimum=1, maximum=3)
    shuffle, seed = check_bool("shuffle", shuffle), check_int("seed", seed, minimum=0)
    indices = _rank_shard(n, num_replicas, rank, shuffle, seed, 0)
    batches = list(BatchSampler(indices, batch_size, drop_last=False))
    if len(batches) > _MAX_BATCH_BOXES:
        raise ValueError(f"n={n} over num_replicas={num_replicas} in batches of "
                         f"{batch_size} gives rank {rank} {len(batches)} batches; the "
                         f"figure holds at most {_MAX_BATCH_BOXES}: use a smaller n "
                         f"or a larger batch_size")
    # the loader hands batch b to worker b % num_workers (in_order=True)
    return {"indices": indices, "batches": batches,
            "worker": [b % num_workers for b in range(len(batches))],
            "num_workers": num_workers, "rank": rank, "num_replicas": num_replicas,
            "batch_size": batch_size, "n": n, "seed": seed}


def _index_path_labels(path: dict) -> dict[str, str]:
    """The text of every box and row label of ``draw_index_path``, keyed by gid."""
    r, b, workers = path["rank"], path["batch_size"], path["num_workers"]
    in_order = ", ".join(map(str, range(len(path["batches"]))))
    labels = {
        "row sampler": f"DistributedSampler\nrank {r} of {path['num_replicas']}",
        "row batches": f"BatchSampler\nbatch_size={b}\n(main process)",
        "row workers": f"DataLoader workers\nnum_workers={workers}",
        "row pin": "main process\npin_memory=True",
        "row device": f"rank {r}'s GPU",
        "sampler": f"rank {r}'s indices of range({path['n']}), seed {path['seed']}:\n"
                   + ", ".join(map(str, path["indices"])),
        "pin": "a thread pins each batch as it arrives (page-locked memory);\n"
               f"the main process hands them out in order {in_order}",
        "device": "batch.to(f'cuda:{LOCAL_RANK}', non_blocking=True); "
                  f"here cuda:{r}"}
    for i, batch in enumerate(path["batches"]):
        labels[f"batch {i}"] = f"batch {i}\n{batch}"
    for w in range(workers):
        mine = ", ".join(str(i) for i, k in enumerate(path["worker"]) if k == w)
        labels[f"worker {w}"] = (f"worker {w}: batch{'es' if ',' in mine else ''} "
                                 f"{mine or 'none'}\ndataset[i] for each i,\n"
                                 f"collate_fn: {b} samples -> 1 batch")
    return labels


def draw_index_path(n: int = 12, num_replicas: int = 2, rank: int = 0,
                    batch_size: int = 2, num_workers: int = 2, shuffle: bool = True,
                    seed: int = 0):
    """Draw rank ``rank``'s indices on their way from the sampler to its GPU; return
    the Figure."""
    path = index_path(n, num_replicas, rank, batch_size, num_workers, shuffle, seed)
    labels = _index_path_labels(path)
    fig, ax = _canvas(4.4)
    left, right = _LABEL_IN + 0.1, MAX_WIDTH_IN - 0.1
    rows = {"sampler": 3.75, "batches": 2.9, "workers": 1.85, "pin": 0.95,
            "device": 0.15}
    for row, y in rows.items():
        ax.text(0.1, y + 0.27, labels[f"row {row}"], ha="left", va="center",
                fontsize=MIN_FONT_PT, style="italic", gid=f"row {row}")
    _box(ax, left, 3.75, right - left, 0.55, labels, "sampler", "sampler")
    batch_x = _row_of_boxes(ax, left, right, 2.9, 0.55, labels,
                            [f"batch {i}" for i in range(len(path["batches"]))],
                            "data")
    worker_x = _row_of_boxes(ax, left, right, 1.85, 0.75, labels,
                             [f"worker {w}" for w in range(num_workers)], "worker")
    for i, x in enumerate(batch_x):
        _arrow(ax, (x, 3.75), (x, 3.45))
        _arrow(ax, (x, 2.9), (worker_x[path["worker"][i]], 2.6))
    _box(ax, left, 0.95, right - left, 0.55, labels, "pin", "launcher")
    for x in worker_x:
        _arrow(ax, (x, 1.85), (x, 1.5))
    _box(ax, left, 0.15, right - left, 0.5, labels, "device", "model")
    _arrow(ax, ((left + right) / 2, 0.95), ((left + right) / 2, 0.65))
    return fig


def _row_of_boxes(ax, left: float, right: float, y: float, h: float, labels: dict,
                  names: list[str], kind: str) -> list[float]:
    """Boxes ``names`` side by side between ``left`` and ``right``; their centres."""
    gap = 0.12
    w = (right - left - gap * (len(names) - 1)) / len(names)
    centres = []
    for k, name in enumerate(names):
        x = left + k * (w + gap)
        _box(ax, x, y, w, h, labels, name, kind)
        centres.append(x + w / 2)
    return centres


def stride_and_chunk(n: int = 10, num_replicas: int = 3) -> dict:
    """``{"stride": rows, "chunk": rows, "stride padding": cells, "chunk padding":
    cells}``: each rank's indices of ``range(n)`` (no shuffling) as
    ``DistributedSampler`` deals them and as contiguous chunks of the same padded
    order; the padded cells ``(rank, position)`` are those at global positions
    ``>= n``."""
    n = check_int("n", n, minimum=1, maximum=40)
    num_replicas = check_int("num_replicas", num_replicas, minimum=1, maximum=6)
    stride = [_rank_shard(n, num_replicas, r, False, 0, 0)
              for r in range(num_replicas)]
    per_rank = math.ceil(n / num_replicas)
    # the order DistributedSampler pads: range(n) repeated from its start
    padded = [p % n for p in range(per_rank * num_replicas)]
    chunk = [padded[r * per_rank:(r + 1) * per_rank] for r in range(num_replicas)]
    cells = [(r, p) for r in range(num_replicas) for p in range(per_rank)]
    return {"stride": stride, "chunk": chunk,
            "stride padding": {(r, p) for r, p in cells
                               if p * num_replicas + r >= n},
            "chunk padding": {(r, p) for r, p in cells if r * per_rank + p >= n}}


def draw_stride_and_chunk(n: int = 10, num_replicas: int = 3):
    """Draw each rank's indices as ``DistributedSampler`` deals them (a stride) and as
    contiguous chunks, padding hatched; return the Figure."""
    split = stride_and_chunk(n, num_replicas)
    rows = {f"stride: rank {r}": s for r, s in enumerate(split["stride"])}
    rows.update({f"chunk: rank {r}": c for r, c in enumerate(split["chunk"])})
    marked = split["stride padding"] | {(r + num_replicas, p)
                                        for r, p in split["chunk padding"]}
    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 0.42 * 2 * num_replicas + 1.5))
    plot_index_rows(rows, n, marked=marked, ax=ax,
                    title=f"range({n}), shuffle=False, {num_replicas} ranks: "
                          f"stride (top), chunks (bottom)")
    ax.axhline(num_replicas, color="black", linewidth=2)
    ax.set_xlabel("position in the rank's list")
    return fig


def global_batch(n: int = 64, global_batch_size: int = 16, world_size: int = 4,
                 step: int = 0, model: str = "simplecnn", seed: int = 0,
                 epoch: int = 0) -> dict:
    """What ``draw_global_batch`` draws: the epoch's ``order`` over the step's
    positions, each rank's ``batches`` (``{rank: [(position, index)]}``) from
    ``DistributedSampler``, the per-rank batch and the ``lr`` of
    ``utils.train_cifar10``'s linear rule."""
    from ..train_cifar10.recipe import BASE_LR, linear_rule_lr, per_process_batch

    n = check_int("n", n, minimum=1)
    world_size = check_int("world_size", world_size, minimum=1, maximum=8)
    global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1,
                                  maximum=24)
    if global_batch_size % world_size:
        raise ValueError(f"global_batch_size={global_batch_size} does not split over "
                         f"world_size={world_size}; expected a multiple of it")
    steps = n // global_batch_size
    step = check_int("step", step, minimum=0, maximum=max(steps - 1, 0))
    if model not in BASE_LR:
        raise ValueError(f"model must be one of {sorted(BASE_LR)}, got {model!r}")
    per_rank = per_process_batch(global_batch_size, world_size)
    first = step * global_batch_size
    order = _rank_shard(n, 1, 0, True, seed, epoch)
    batches = {}
    for r in range(world_size):
        shard = _rank_shard(n, world_size, r, True, seed, epoch)
        batch = list(BatchSampler(shard, per_rank, drop_last=True))[step]
        # position j of rank r's shard is position r + world_size * j of the order
        batches[r] = [(r + world_size * (step * per_rank + j), i)
                      for j, i in enumerate(batch)]
    return {"order": [(p, order[p]) for p in range(first, first + global_batch_size)],
            "batches": batches, "per_rank": per_rank, "base_lr": BASE_LR[model],
            "lr": linear_rule_lr(model, global_batch_size), "model": model,
            "lr twice": linear_rule_lr(model, 2 * global_batch_size),
            "global_batch_size": global_batch_size, "step": step, "n": n}


def _grid(ax, rows: dict[str, list[tuple[int, int]]], n: int, first: int, top: float,
          cell_w: float) -> None:
    """One row per entry of ``rows``, each ``(position, index)`` a cell in column
    ``position - first``, coloured by its index; gid ``cell <row> <position>``."""
    colours = plt.get_cmap("viridis")
    for k, (label, cells) in enumerate(rows.items()):
        y = top - (k + 1) * _CELL_H
        ax.text(_LABEL_IN, y + _CELL_H / 2, label, ha="right", va="center",
                fontsize=MIN_FONT_PT)
        for position, index in cells:
            x = _LABEL_IN + 0.1 + (position - first) * cell_w
            shade = colours(index / max(n - 1, 1))
            gid = f"cell {k} {position}"
            ax.add_patch(Rectangle((x, y), cell_w, _CELL_H, facecolor=shade,
                                   edgecolor="white", gid=gid))
            light = 0.299 * shade[0] + 0.587 * shade[1] + 0.114 * shade[2] > 0.5
            ax.text(x + cell_w / 2, y + _CELL_H / 2, str(index), ha="center",
                    va="center", fontsize=MIN_FONT_PT, gid=gid,
                    color="black" if light else "white")


def _cell_width(columns: int) -> float:
    """The width of a grid cell when ``columns`` of them fill the page, or an error
    when two digits would not fit."""
    cell_w = min(0.34, (MAX_WIDTH_IN - _LABEL_IN - 0.2) / columns)
    if cell_w < _MIN_CELL_IN:
        raise ValueError(f"{columns} cells do not fit the page's width legibly; at "
                         f"most {int((MAX_WIDTH_IN - _LABEL_IN - 0.2) / _MIN_CELL_IN)}")
    return cell_w


def draw_global_batch(n: int = 64, global_batch_size: int = 16, world_size: int = 4,
                      step: int = 0, model: str = "simplecnn", seed: int = 0,
                      epoch: int = 0):
    """Draw one step's global batch as the ranks' batches, and the learning rate the
    linear rule gives it; return the Figure."""
    data = global_batch(n, global_batch_size, world_size, step, model, seed, epoch)
    G, b = global_batch_size, data["per_rank"]
    cell_w = _cell_width(G)
    height = 1.9 + _CELL_H * (world_size + 1)
    fig, ax = _canvas(height)
    rows = {f"epoch {epoch}'s order": data["order"]}
    rows.update({f"rank {r}'s batch": cells for r, cells in data["batches"].items()})
    top = height - 0.45
    ax.text(MAX_WIDTH_IN / 2, height - 0.22,
            f"step {step}: positions {step * G}-{step * G + G - 1} of the order "
            f"(cells: sample indices)", ha="center", va="center",
            fontsize=MIN_FONT_PT, gid="title")
    _grid(ax, rows, data["n"], step * G, top, cell_w)
    labels = {"global": f"global batch = {world_size} ranks x {b} samples = {G} "
                        f"samples per optimizer step;\nDDP averages the ranks' "
                        f"gradients: the gradient of all {G}",
              "lr": f"linear rule: lr = {data['base_lr']} ({model}'s rate for 256 "
                    f"images) x {G} / 256\n= {data['lr']:g}; "
                    f"{2 * world_size} ranks x {b} = {2 * G} would double it: "
                    f"{data['lr twice']:g}"}
    _two_notes(ax, labels, ("global", "sampler"), ("lr", "model"))
    return fig


def deal_shards(num_shards: int = 8, world_size: int = 2, workers: int = 2,
                epochs: int = 3, reshuffle: bool = False,
                seed: int = 0) -> list[list[list[int]]]:
    """``dealt[epoch][rank][worker]``: the shards each reader opens, as WebDataset's
    ``split_by_node`` then ``split_by_worker`` deal them (``urls[r::R][w::W]``), from
    the list in order or, with ``reshuffle``, shuffled first by ``seed + epoch``
    (``SimpleShardList(urls, seed=seed + epoch)``)."""
    num_shards = check_int("num_shards", num_shards, minimum=1, maximum=16)
    world_size = check_int("world_size", world_size, minimum=1, maximum=4)
    workers = check_int("workers", workers, minimum=1, maximum=4)
    epochs = check_int("epochs", epochs, minimum=1, maximum=4)
    reshuffle = check_bool("reshuffle", reshuffle)
    seed = check_int("seed", seed, minimum=0)
    dealt = []
    for epoch in range(epochs):
        shards = list(range(num_shards))
        if reshuffle:  # as SimpleShardList shuffles its list
            random.Random(seed + epoch).shuffle(shards)
        dealt.append([[shards[r::world_size][w::workers] for w in range(workers)]
                      for r in range(world_size)])
    return dealt


def draw_shards_dealt(num_shards: int = 8, world_size: int = 2, workers: int = 2,
                      epochs: int = 3, seed: int = 0):
    """Draw the shards each rank's workers open over ``epochs`` epochs, dealt the same
    every epoch and dealt anew; return the Figure."""
    readers = world_size * workers
    fig, axes = plt.subplots(2, 1, figsize=(MAX_WIDTH_IN, 0.9 * epochs + 2.4))
    titles = {False: "WebDataset's split_by_node, then split_by_worker: the same "
                     "shards every epoch",
              True: f"shard list shuffled by seed + epoch (seed={seed}), then split: "
                    f"a new deal\neach epoch, each shard still read once"}
    for ax, reshuffle in zip(axes, (False, True)):
        dealt = deal_shards(num_shards, world_size, workers, epochs, reshuffle, seed)
        rows = {f"epoch {e}": [s for rank in ranks for mine in rank for s in mine]
                for e, ranks in enumerate(dealt)}
        equal = num_shards % readers == 0
        plot_index_rows(rows, num_shards, ax=ax, title=titles[reshuffle],
                        batch_size=num_shards // readers if equal else None)
        ax.set_xlabel("")
        if equal:  # one tick under each reader's shards
            per = num_shards // readers
            ax.set_xticks([per * k + per / 2 for k in range(readers)],
                          [f"rank {k // workers}, worker {k % workers}"
                           for k in range(readers)], fontsize=MIN_FONT_PT)
    axes[-1].set_xlabel("cells: the shards each reader opens", fontsize=MIN_FONT_PT)
    fig.tight_layout()
    return fig


def checkpoint_position(n: int = 24, global_batch_size: int = 6, before: int = 2,
                        after: int = 3, stop_step: int = 2, epoch: int = 1,
                        seed: int = 0) -> dict:
    """What ``draw_checkpoint_position`` draws: the epoch's ``order``, the cells
    ``(position, index)`` each rank read ``before`` the stop and ``after`` the resume,
    from ``utils.train_cifar10``'s ``EpochSampler``, and the ``checkpoint``'s record."""
    from ..train_cifar10.checkpoints import EpochSampler
    from ..train_cifar10.recipe import per_process_batch

    n = check_int("n", n, minimum=1)
    global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
    for name, size in (("before", before), ("after", after)):
        check_int(name, size, minimum=1, maximum=4)
        if global_batch_size % size:
            raise ValueError(f"global_batch_size={global_batch_size} does not split "
                             f"over {name}={size} ranks; expected a divisor of it")
    steps = n // global_batch_size
    stop_step = check_int("stop_step", stop_step, minimum=1, maximum=max(steps - 1, 1))
    epoch, seed = check_int("epoch", epoch, minimum=0), check_int("seed", seed,
                                                                  minimum=0)
    ranks = {}
    for part, size in (("before", before), ("after", after)):
        b = per_process_batch(global_batch_size, size)
        start, stop = (0, stop_step * b) if part == "before" else (stop_step * b,
                                                                   steps * b)
        for r in range(size):
            sampler = EpochSampler(range(n), size, r, shuffle=True, seed=seed)
            sampler.set_epoch(epoch, start=start, stop=stop)
            # the j-th index from ``start`` is position r + size * (start + j)
            ranks[part, r] = [(r + size * (start + j), i)
                              for j, (_, i) in enumerate(sampler)]
    order = _rank_shard(n, 1, 0, True, seed, epoch)
    return {"order": list(enumerate(order[:steps * global_batch_size])),
            "ranks": ranks, "checkpoint": {"epoch": epoch, "step_in_epoch": stop_step,
                                           "seed": seed,
                                           "global_batch": global_batch_size},
            "consumed": stop_step * global_batch_size, "n": n}


def draw_checkpoint_position(n: int = 24, global_batch_size: int = 6, before: int = 2,
                             after: int = 3, stop_step: int = 2, epoch: int = 1,
                             seed: int = 0):
    """Draw an epoch's order, what ``before`` ranks read of it up to a stop, what the
    checkpoint records, and how ``after`` ranks deal the rest; return the Figure."""
    data = checkpoint_position(n, global_batch_size, before, after, stop_step, epoch,
                               seed)
    columns, consumed = len(data["order"]), data["consumed"]
    cell_w = _cell_width(columns)
    rows = {f"epoch {epoch}'s order": data["order"]}
    rows.update({f"{part}: rank {r} of {before if part == 'before' else after}": cells
                 for (part, r), cells in data["ranks"].items()})
    height = 1.95 + _CELL_H * len(rows)
    fig, ax = _canvas(height)
    top = height - 0.45
    ax.text(MAX_WIDTH_IN / 2, height - 0.22,
            f"{before} ranks stop after {stop_step} steps (positions "
            f"0-{consumed - 1}); {after} ranks resume (cells: sample indices)",
            ha="center", va="center",
            fontsize=MIN_FONT_PT, gid="title")
    _grid(ax, rows, data["n"], 0, top, cell_w)
    x_stop = _LABEL_IN + 0.1 + consumed * cell_w
    ax.plot([x_stop, x_stop], [top - _CELL_H * len(rows) - 0.08, top + 0.04],
            color="#d62728", linewidth=2.5, gid="stop")
    record = data["checkpoint"]
    b_after = global_batch_size // after
    labels = {"checkpoint": f"checkpoint: epoch {record['epoch']}, step_in_epoch "
                            f"{stop_step}, seed {seed}, global batch "
                            f"{global_batch_size}\n-> positions 0-{consumed - 1} of "
                            f"the order are done (red line)",
              "resume": f"{after} ranks: set_epoch({epoch}, start="
                        f"{stop_step * b_after}): {stop_step} steps x {b_after} per "
                        f"rank;\nrank r goes on at position {consumed} + r, then every "
                        f"{after} positions: each of the rest once"}
    _two_notes(ax, labels, ("checkpoint", "launcher"), ("resume", "sampler"))
    return fig
