import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from utils.samplers import ShardSampler  # noqa: E402
from utils.viz import plot_epoch_orders, plot_shards, shard_explorer  # noqa: E402


def _cells(fig):
    return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


def test_plot_shards_draws_one_cell_per_index_and_hatches_padding():
    shards = [list(ShardSampler(range(25), 3, r, shuffle=False)) for r in range(3)]
    fig = plot_shards(shards, 25, batch_size=4, title="t")
    cells = _cells(fig)
    assert len(cells) == 27
    hatched = [c for c in cells if c.get_hatch()]
    assert len(hatched) == 2
    assert sorted(t.get_text() for t in fig.axes[0].texts if t.get_text() in {"0", "1"}) == ["0", "0", "1", "1"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    plt.close(fig)


def test_plot_epoch_orders_rows_are_labelled():
    fig = plot_epoch_orders({"epoch 0": [3, 1, 2, 0], "epoch 1": [0, 2, 1, 3]}, 4)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["epoch 0", "epoch 1"]
    assert len(_cells(fig)) == 8 and not any(c.get_hatch() for c in _cells(fig))
    plt.close(fig)


def test_value_offset_writes_values_and_keeps_colours():
    rows = {"epoch 0": [3, 1, 2, 0]}
    plain, shifted = plot_epoch_orders(rows, 4), plot_epoch_orders(rows, 4, value_offset=1)
    assert [t.get_text() for t in plain.axes[0].texts] == ["3", "1", "2", "0"]
    assert [t.get_text() for t in shifted.axes[0].texts] == ["4", "2", "3", "1"]
    assert ([c.get_facecolor() for c in _cells(plain)]
            == [c.get_facecolor() for c in _cells(shifted)])
    plt.close(plain)
    plt.close(shifted)


def test_shard_explorer_builds_and_redraws():
    ui = shard_explorer(dataset_len=10, world_size=2, batch_size=3)
    sliders = [w for box in ui.children[:2] for w in box.children]
    assert [w.description for w in sliders] == ["dataset size", "world size", "shuffle", "seed", "epoch",
                                                 "drop_last", "batch size"]
    sliders[1].value = 4  # a new world size redraws without error
    plt.close("all")


def test_categories_colour_cells_and_add_a_legend():
    from utils.viz import plot_index_rows

    fig = plot_index_rows({"a": [0, 1, 2], "b": [3, 4, 5]}, 6, categories={"a": [0, 1, 0], "b": [1, 1, 0]})
    faces = [tuple(c.get_facecolor()) for c in _cells(fig)]
    assert faces[0] == faces[2] != faces[1]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["worker 0", "worker 1"]
    plt.close(fig)
