"""utils.concepts.processes: the DDP step draws the buckets BucketedDDP made, each
all-reduce starting when its last gradient is ready; the restart figure follows the
chapter's torchrun command and its resumed line; the Slurm figure says what the
recipe's lines say; every text legible, inside its box, overlapping no other."""

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from utils.concepts.processes import (  # noqa: E402
    RECIPE, bucket_layout, ddp_step_bars, draw_ddp_step, draw_slurm_signals,
    draw_torchrun_restart, restart_events, slurm_signal_labels)
from utils.ddp import BucketedDDP  # noqa: E402
from utils.viz import MAX_WIDTH_IN, MIN_FONT_PT  # noqa: E402

# chapter 13's killed run: run_small(..., "--resume", "--fail-at-step", "6", restarts=1)
COMMAND = ["python", "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "--max-restarts=1", "-m", "utils.train_cifar10",
           "--data", "small", "--epochs", "2", "--global-batch", "64", "--workers", "0",
           "--checkpoint-every", "4", "--device", "cpu", "--no-progress",
           "--out", "killed", "--resume", "--fail-at-step", "6"]
RESUMED = ("resumed from $WORK/killed/checkpoint.pt: epoch 1, step 4 of the epoch "
           "(4 in all)")


def six_layers():
    """Chapter 10's model of "Proving the overlap": one Linear(32, 32) per bucket."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh())
                           for _ in range(6)])


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_bars_are_the_buckets_bucketed_ddp_made(one_rank):
    model = six_layers()
    wrapped = BucketedDDP(model, bucket_cap_mb=0.004)
    layout = bucket_layout(wrapped)
    names = {p: n for n, p in model.named_parameters()}
    assert layout == [(tuple(names[p] for p in b.params), 4 * b.numel)
                      for b in wrapped.buckets]
    assert layout[0] == (("5.0.bias", "5.0.weight"), 4224)  # the last layer first
    links = [b for b in ddp_step_bars(layout) if b.lane == "link"]
    bucketed = [b for b in links if b.row == "bucketed"]
    assert [b.label for b in bucketed] == [f"b{k}" for k in range(6)]
    assert [b.end - b.start for b in bucketed] == [size for _, size in layout]
    # a cap that puts the three-layer MLP's gradients in uneven buckets
    mlp = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                        nn.Linear(32, 3))
    assert bucket_layout(BucketedDDP(mlp, bucket_cap_mb=0.0001)) == [
        (("4.bias", "4.weight"), 396), (("2.bias",), 128), (("2.weight",), 4096),
        (("0.bias",), 128), (("0.weight",), 768)]


@pytest.mark.parametrize("sizes", [[4224] * 6, [396, 128, 4096, 128, 768]])
def test_all_reduces_start_when_their_gradients_are_ready(sizes):
    bars = ddp_step_bars([((f"p{k}",), s) for k, s in enumerate(sizes)])
    get = {(b.row, b.name): b for b in bars}
    backward = get["bucketed", "backward"]
    assert backward == get["one", "backward"]._replace(row="bucketed")
    one = get["one", "all buckets"]
    assert one.start == one.ready == backward.end == get["one", "backward"].end
    ready = backward.start
    for k, size in enumerate(sizes):
        ready += size
        bar = get["bucketed", f"bucket {k}"]
        assert bar.ready == ready and bar.start >= ready
        if k == 0 or bar.ready >= get["bucketed", f"bucket {k - 1}"].end:
            assert bar.start == ready  # the link is free: it starts at once
    for row, last in (("one", one), ("bucketed", get["bucketed", f"bucket {k}"])):
        assert get[row, "step"].start == last.end  # the step waits for the gradients
    assert get["bucketed", "step"].end <= get["one", "step"].end


def test_restart_events_follow_the_command_and_the_resumed_line():
    events = restart_events(COMMAND, RESUMED)
    assert events == [
        (0, "agent", "starts 2 ranks"),
        (0, "agent", "rank 1 failed:\nstops the others"),
        (1, "agent", "restart 1 of --max-restarts=1:\nstarts 2 ranks again"),
        (0, "rank 0", "joins;\nsteps 1-5 done"), (0, "rank 0", "stopped by\nthe agent"),
        (1, "rank 0", "joins again; loads the\nstep-4 checkpoint, redoes step 5, runs on"),
        (0, "rank 1", "joins;\nsteps 1-5 done"),
        (0, "rank 1", "fails at the\nstart of step 6"),
        (1, "rank 1", "joins again; loads the\nstep-4 checkpoint, redoes step 5, runs on")]
    three = [c.replace("--nproc_per_node=2", "--nproc_per_node=3")
             .replace("--max-restarts=1", "--max-restarts=3") for c in COMMAND]
    three[-1] = "9"
    events = restart_events(three, RESUMED.replace("(4 in all)", "(8 in all)"))
    assert (0, "rank 2", "fails at the\nstart of step 9") in events
    assert (1, "agent", "restart 1 of --max-restarts=3:\nstarts 3 ranks again") in events
    assert (1, "rank 0", "joins again; loads the\nstep-8 checkpoint, goes on at step 9, "
            "runs on") in events


def test_the_slurm_labels_say_what_the_recipe_says():
    labels = slurm_signal_labels()
    assert "#SBATCH --signal=B:USR1@120" in RECIPE.read_text().splitlines()
    assert labels["script signal"] == "SIGUSR1, 120 s\nbefore --time=04:00:00"
    assert labels["agent does"].endswith("still alive 90 s later (--shutdown-timeout)")
    assert labels["rank does"].endswith("exit 75")
    changed = (RECIPE.read_text().replace("--signal=B:USR1@120", "--signal=B:USR2@300")
               .replace("trap on_warning USR1", "trap on_warning USR2")
               .replace("SHUTDOWN_TIMEOUT:-90", "SHUTDOWN_TIMEOUT:-200"))
    labels = slurm_signal_labels(changed)
    assert labels["script signal"] == "SIGUSR2, 300 s\nbefore --time=04:00:00"
    assert labels["agent does"].endswith("still alive 200 s later (--shutdown-timeout)")


@pytest.mark.parametrize("recipe, match", [
    ("#SBATCH --time=1\n#SBATCH --requeue\n", "no #SBATCH --signal="),
    ("#SBATCH --signal=USR1@60\n#SBATCH --time=1\n", "batch script alone"),
    ("#SBATCH --signal=B:USR1@60\n#SBATCH --time=1\ntrap on_warning USR2\n",
     "traps USR2 but asks Slurm for USR1"),
])
def test_a_recipe_the_figure_cannot_draw_is_refused(recipe, match):
    with pytest.raises(ValueError, match=match):
        slurm_signal_labels(recipe)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="got 9 buckets; expected 1 to 8"):
        ddp_step_bars([(("p",), 4)] * 9)
    with pytest.raises(TypeError, match="expected a utils.ddp.BucketedDDP"):
        bucket_layout(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no --fail-at-step"):
        restart_events(COMMAND[:-2], RESUMED)
    with pytest.raises(ValueError, match="expected a torchrun command"):
        restart_events(["python", "train.py"], RESUMED)
    with pytest.raises(ValueError, match="expected the restarted rank's line"):
        restart_events(COMMAND, "starting from step 0")


def check_legible(fig):
    """Every box's text inside its patch, no two texts overlapping, all on the page."""
    ax = fig.axes[0]
    assert fig.get_size_inches()[0] <= MAX_WIDTH_IN
    renderer = fig.canvas.get_renderer()
    patches = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    texts = [t for t in ax.texts if t.get_text()]
    extents = [t.get_window_extent(renderer) for t in texts]
    for text, extent in zip(texts, extents):
        assert text.get_fontsize() >= MIN_FONT_PT, text.get_gid()
        inside = (patches[text.get_gid()].get_window_extent(renderer)
                  if text.get_gid() in patches else fig.bbox)
        assert (inside.x0 <= extent.x0 and extent.x1 <= inside.x1
                and inside.y0 <= extent.y0 and extent.y1 <= inside.y1), text.get_gid()
    for i, a in enumerate(extents):
        for b, other in zip(extents[i + 1:], texts[i + 1:]):
            assert not a.overlaps(b), (texts[i].get_gid(), other.get_gid())
    assert set(patches) <= {t.get_gid() for t in texts}  # every box has its text
    plt.close(fig)


def test_every_figure_is_legible(one_rank):
    check_legible(draw_ddp_step(bucket_layout(BucketedDDP(six_layers(), 0.004))))
    check_legible(draw_torchrun_restart(COMMAND, RESUMED))
    check_legible(draw_slurm_signals())
