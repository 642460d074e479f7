"""Conceptual figures of processes: a DDP step's overlapping all-reduces, torchrun
through a restart, and where each signal goes in a Slurm job.

Each ``draw_*`` function draws what a pure function beside it returns, and that
function takes its data from the book's own code: the buckets a ``BucketedDDP`` made,
the command and output of the chapter's torchrun run, the ``#SBATCH`` lines of the
Slurm recipe. Every box is a patch and a text sharing a ``gid``, as in
``utils.diagram``; figures are at most ``MAX_WIDTH_IN`` wide, texts at least
``MIN_FONT_PT``.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import NamedTuple, Sequence

from .._checks import check_int
from ..diagram import _arrow, _box, _canvas
from ..viz import MAX_WIDTH_IN, MIN_FONT_PT

__all__ = ["bucket_layout", "ddp_step_bars", "draw_ddp_step", "restart_events",
           "draw_torchrun_restart", "slurm_signal_labels", "draw_slurm_signals",
           "RECIPE", "MAX_BUCKETS"]

RECIPE = Path(__file__).resolve().parents[2] / "examples/slurm/train_cifar10.sbatch"
MAX_BUCKETS = 8  # bucket boxes side by side that still hold "b7" legibly
# schematic durations, in units of one gradient byte's backward
_FORWARD, _STEP, _LINK = 0.5, 0.3, 1.0  # x total bytes; all-reduce per byte


class Bar(NamedTuple):
    """One bar of the DDP timeline: its row, lane, name, start, end and label."""
    row: str
    lane: str
    name: str
    start: float
    end: float
    label: str
    ready: float | None = None  # an all-reduce's: when its last gradient is ready


def _note(ax, x, y, text, gid=None, **kw):
    ax.text(x, y, text, fontsize=MIN_FONT_PT, gid=gid, **kw)


# --- 1. a DDP step --------------------------------------------------------------------

def bucket_layout(wrapped) -> list[tuple[tuple[str, ...], int]]:
    """The buckets of a ``utils.ddp.BucketedDDP``: (parameter names, bytes) each,
    in the order it all-reduces them."""
    buckets = getattr(wrapped, "buckets", None)
    if buckets is None or not hasattr(wrapped, "module"):
        raise TypeError("expected a utils.ddp.BucketedDDP, "
                        f"got {type(wrapped).__name__}")
    names = {p: n for n, p in wrapped.module.named_parameters()}
    return [(tuple(names[p] for p in b.params),
             sum(p.numel() * p.element_size() for p in b.params)) for b in buckets]


def ddp_step_bars(buckets: Sequence[tuple[Sequence[str], int]]) -> list[Bar]:
    """The bars ``draw_ddp_step`` draws for these buckets, in schematic time units
    (one gradient byte's backward): one all-reduce after backward, against one per
    bucket started when its last gradient is ready."""
    if not 1 <= len(buckets) <= MAX_BUCKETS:
        raise ValueError(f"got {len(buckets)} buckets; expected 1 to {MAX_BUCKETS} "
                         "(more do not fit the page)")
    sizes = [check_int("bucket bytes", size, minimum=1) for _, size in buckets]
    total = sum(sizes)
    forward = _FORWARD * total
    bars = []
    for row in ("one", "bucketed"):
        bars.append(Bar(row, "compute", "forward", 0.0, forward, "forward"))
        bars.append(Bar(row, "compute", "backward", forward, forward + total,
                        "backward"))
    link = ready = forward  # when the link is free; when a bucket's last grad is
    for k, size in enumerate(sizes):
        ready += size
        start = max(ready, link)  # one all-reduce at a time on the link
        link = start + _LINK * size
        bars.append(Bar("bucketed", "link", f"bucket {k}", start, link, f"b{k}",
                        ready))
    one_end = forward + total + _LINK * total
    bars.append(Bar("one", "link", "all buckets", forward + total, one_end,
                    f"all-reduce: all {total:,} bytes", forward + total))
    for row, end in (("one", one_end), ("bucketed", link)):
        bars.append(Bar(row, "compute", "step", end, end + _STEP * total, "step"))
    return bars


def draw_ddp_step(buckets: Sequence[tuple[Sequence[str], int]]):
    """Draw a DDP step without and with bucketed overlap (from ``bucket_layout``);
    return the matplotlib Figure."""
    bars = ddp_step_bars(buckets)
    fig, ax = _canvas(2.7)
    left, end = 1.45, max(b.end for b in bars)
    scale = (MAX_WIDTH_IN - left - 0.1) / end
    y = {("one", "compute"): 2.0, ("one", "link"): 1.6,
         ("bucketed", "compute"): 1.0, ("bucketed", "link"): 0.6}
    kinds = {"compute": "model", "link": "sampler"}
    labels = {f"{b.row} {b.name}": b.label for b in bars}
    for b in bars:
        _box(ax, left + b.start * scale, y[b.row, b.lane], (b.end - b.start) * scale,
             0.32, labels, f"{b.row} {b.name}", kinds[b.lane])
    for b in bars:  # an all-reduce starts when its last gradient is ready
        if b.ready is not None:
            x = left + b.ready * scale
            top = y[b.row, "compute"]
            _arrow(ax, (x, top), (x, y[b.row, "link"] + 0.32))
    rows = {"one": "one all-reduce\nafter backward",
            "bucketed": f"BucketedDDP:\n{len(buckets)} buckets,\nall-reduce when full"}
    for row, top in (("one", 2.32), ("bucketed", 1.32)):
        _note(ax, 0.08, top - 0.36, rows[row], va="center", gid=f"row {row}")
    _note(ax, 0.08, 0.28, f"buckets in the order backward fills them (b0 first): "
          f"{', '.join(f'{s:,}' for _, s in buckets)} bytes", gid="sizes")
    _note(ax, 0.08, 2.5, "time →  (schematic, not measured: lengths follow the "
          "gradient bytes; step: the optimizer step)", gid="scale", style="italic")
    return fig


# --- 2. torchrun through a restart ----------------------------------------------------

def _torchrun_options(command: Sequence[str]) -> tuple[int, int, list[str]]:
    """(--nproc_per_node, --max-restarts, the script's arguments) of a torchrun
    command (``python -m torch.distributed.run ...``)."""
    words = list(command)
    if "torch.distributed.run" not in words:
        raise ValueError("expected a torchrun command (python -m torch.distributed.run "
                         f"...), got {shlex.join(words)[:120]!r}")
    run = words.index("torch.distributed.run") + 1
    found = {}
    for n, word in enumerate(words[run:], run):
        if not word.startswith("--"):
            return found.get("nproc", 1), found.get("restarts", 0), words[n:]
        key, _, value = word[2:].replace("-", "_").partition("=")
        if key in ("nproc_per_node", "max_restarts"):
            found["nproc" if key == "nproc_per_node" else "restarts"] = int(value)
    raise ValueError("the torchrun command names no script or module to run")


def restart_events(command: Sequence[str],
                   resumed_line: str) -> list[tuple[int, str, str]]:
    """(round, actor, what) of each box ``draw_torchrun_restart`` draws: from the
    chapter's torchrun command (``--fail-at-step``) and the line its restarted rank 0
    printed (``resumed from ...: epoch E, step S of the epoch (N in all)``)."""
    from ..train_cifar10.settings import parse_args

    nproc, restarts, script = _torchrun_options(command)
    nproc = check_int("--nproc_per_node", nproc, minimum=2, maximum=4)
    check_int("--max-restarts", restarts, minimum=1)
    args = parse_args(script[2:] if script[0] == "-m" else script[1:])
    if args.fail_at_step < 1:
        raise ValueError("the command has no --fail-at-step: no rank fails, nothing "
                         "restarts")
    found = re.search(r"\((\d+) in all\)", resumed_line)
    if not resumed_line.startswith("resumed from") or not found:
        raise ValueError("expected the restarted rank's line 'resumed from ...: epoch "
                         f"E, step S of the epoch (N in all)', got {resumed_line!r}")
    fail, last = args.fail_at_step, nproc - 1  # the last rank fails (steps.py)
    done = f"steps 1-{fail - 1}" if fail > 2 else ("step 1" if fail == 2 else "no step")
    events = [(0, "agent", f"starts {nproc} ranks"),
              (0, "agent", f"rank {last} failed:\nstops the others"),
              (1, "agent", f"restart 1 of --max-restarts={restarts}:\n"
                         f"starts {nproc} ranks again")]
    saved = int(found.group(1))
    redo = (f"goes on at step {saved + 1}" if saved + 1 >= fail else
            f"redoes step {saved + 1}" if saved + 2 == fail else
            f"redoes steps {saved + 1}-{fail - 1}")
    for r in range(nproc):
        events.append((0, f"rank {r}", f"joins;\n{done} done"))
        events.append((0, f"rank {r}", f"fails at the\nstart of step {fail}"
                       if r == last else "stopped by\nthe agent"))
        events.append((1, f"rank {r}", f"joins again; loads the\nstep-{saved} "
                                       f"checkpoint, {redo}, runs on"))
    return events


def draw_torchrun_restart(command: Sequence[str], resumed_line: str):
    """Draw torchrun's agent, its store and the ranks through one restart (from
    ``restart_events``); return the matplotlib Figure."""
    events = restart_events(command, resumed_line)
    actors = ["agent", "store"] + sorted({a for _, a, _ in events if a != "agent"})
    height = 0.55 + 0.6 * len(actors)
    fig, ax = _canvas(height)
    left, half = 0.75, (MAX_WIDTH_IN - 0.75 - 0.1) / 2
    lane = {a: height - 0.95 - 0.6 * n for n, a in enumerate(actors)}
    for n in range(2):  # torchrun tells the ranks as TORCHELASTIC_RESTART_COUNT
        _note(ax, left + n * half + half / 2, height - 0.2,
              f"round {n}: restart count {n}", ha="center", va="center",
              fontweight="bold", gid=f"round {n}")
    for actor in actors:
        _note(ax, 0.06, lane[actor] + 0.24, actor, va="center", gid=f"lane {actor}")
    labels = {"store": "the agent's rendezvous store: kept across the restart"}
    _box(ax, left + 0.05, lane["store"], 2 * half - 0.1, 0.48, labels, "store", "data")
    kinds = {"agent": "launcher"}
    for (rnd, actor), slots in _slots(events).items():
        width = (half - 0.1) / len(slots)
        for k, (name, text) in enumerate(slots):
            labels[name] = text
            kind = "worker" if "fails" in text else kinds.get(actor, "sampler")
            _box(ax, left + rnd * half + 0.05 + k * width, lane[actor],
                 width - 0.05, 0.48, labels, name, kind)
    ax.axvline(left + half, color="#888888", lw=1, linestyle=":", zorder=0.5)
    return fig


def _slots(events) -> dict[tuple[int, str], list[tuple[str, str]]]:
    """Events grouped by (round, actor), each with a unique box name."""
    slots: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for rnd, actor, text in events:
        mine = slots.setdefault((rnd, actor), [])
        mine.append((f"{actor} {rnd}.{len(mine)}", text))
    return slots


# --- 3. signals in a Slurm job --------------------------------------------------------

def _recipe_setting(text: str, pattern: str, what: str) -> str:
    found = re.search(pattern, text, re.MULTILINE)
    if not found:
        raise ValueError(f"the recipe has no {what} (looked for {pattern!r})")
    return found.group(1)


def slurm_signal_labels(recipe: str | Path = RECIPE) -> dict[str, str]:
    """The text of every box ``draw_slurm_signals`` draws, keyed by its name: from
    the recipe's ``#SBATCH`` lines and its shell (``recipe``: a path or the text)."""
    from ..train_cifar10.preemption import EXIT_PREEMPTED

    text = recipe.read_text() if isinstance(recipe, Path) else str(recipe)
    where, name, lead = re.fullmatch(r"(?:([BR]):)?([A-Z0-9]+)@(\d+)", _recipe_setting(
        text, r"^#SBATCH --signal=(\S+)", "#SBATCH --signal=")).groups()
    limit = _recipe_setting(text, r"^#SBATCH --time=(\S+)", "#SBATCH --time=")
    if where != "B":
        raise ValueError(f"the recipe's --signal={where or ''}:{name}@{lead} does not "
                         "go to the batch script alone (B:); this figure draws "
                         "that case")
    trapped = _recipe_setting(text, r"^trap on_warning (\S+)", "trap on_warning SIG")
    if trapped != name:
        raise ValueError(f"the recipe traps {trapped} but asks Slurm for {name}")
    term = _recipe_setting(text, r"scancel --signal=(\w+)", "scancel --signal=")
    grace = _recipe_setting(text, r"^SHUTDOWN_TIMEOUT=\$\{SHUTDOWN_TIMEOUT:-(\d+)\}",
                            "SHUTDOWN_TIMEOUT default")
    _recipe_setting(text, r"^#SBATCH (--requeue)", "#SBATCH --requeue")
    sig = f"SIG{term}"
    return {
        "head process": "process", "head signal": "the signal it gets",
        "head does": "what it does",
        "script": "batch script\n(sbatch)", "script signal":
            f"SIG{name}, {lead} s\nbefore --time={limit}",
        "script does": f"its trap runs scancel --signal={term}; once srun\nreturns, "
                       "finds preempted.json: scontrol requeue",
        "srun": "srun\n(the job step)", "srun signal": "none: scancel\nspares it",
        "srun does": "waits for its step's tasks, one torchrun per node",
        "agent": "torchrun agent\n(one per node)", "agent signal": f"{sig}\n(scancel)",
        "agent does": f"passes {sig} on to its ranks; SIGKILL to any\n"
                      f"still alive {grace} s later (--shutdown-timeout)",
        "rank": "ranks\n(one per GPU)", "rank signal": f"{sig}\n(scancel, agent)",
        "rank does": f"set a flag; agree on a step, save one checkpoint;\n"
                     f"rank 0 writes preempted.json; exit {EXIT_PREEMPTED}",
        "workers": "DataLoader workers\n(own process group)",
        "workers signal": f"{sig}\n(scancel)",
        "workers does": f"ignore {sig}; end when their rank ends\n"
                        "(each watches its rank)",
    }


def draw_slurm_signals(recipe: str | Path = RECIPE):
    """Draw where each signal of the Slurm recipe goes and what each process does
    with it; return the matplotlib Figure."""
    labels = slurm_signal_labels(recipe)
    rows = ("script", "srun", "agent", "rank", "workers")
    height = 0.55 + 0.62 * len(rows)
    fig, ax = _canvas(height)
    columns = ((0.08, 1.35, "", "rank"), (1.7, 1.55, " signal", "sampler"),
               (3.5, 3.22, " does", "data"))
    for x, width, suffix, _ in columns:
        name = "head " + {"": "process", " signal": "signal", " does": "does"}[suffix]
        _note(ax, x + width / 2, height - 0.2, labels[name], ha="center", va="center",
              fontweight="bold", gid=name)
    for n, row in enumerate(rows):
        y = height - 0.95 - 0.62 * n
        for x, width, suffix, kind in columns:
            _box(ax, x, y, width, 0.5, labels, row + suffix, kind)
        _arrow(ax, (1.43, y + 0.25), (1.7, y + 0.25))
        _arrow(ax, (3.25, y + 0.25), (3.5, y + 0.25))
        if n:  # the process above started this one
            _arrow(ax, (0.75, y + 0.62), (0.75, y + 0.5))
    return fig
