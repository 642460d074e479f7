"""Hardening step 2: checkpoints and an exact resume.

``EpochSampler`` (a global batch is the same block of the epoch's order on any number
of processes), checkpoints written atomically, and the settings a resumed run must
repeat."""

from __future__ import annotations

import os
import re
import shutil
import torch

from ..samplers import ShardSampler


CHECKPOINT = "checkpoint.pt"


class EpochSampler(ShardSampler):
    """ShardSampler that yields ``(epoch, index)`` for this rank's positions ``start``
    to ``stop``.

    ShardSampler deals the epoch's order round robin, so with a per-rank batch ``b``
    step ``k`` of every rank together covers positions ``[k*G, (k+1)*G)`` of the order,
    ``G = b * world_size``: a global batch does not depend on the number of processes,
    and a run can resume on another number of them. ``stop`` cuts the epoch at a whole
    number of global batches (no padded copies).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start, self.stop = 0, self.num_samples

    def set_epoch(self, epoch: int, start: int = 0, stop: int | None = None) -> None:
        super().set_epoch(epoch)
        self.start, self.stop = start, self.num_samples if stop is None else stop

    def __iter__(self):
        return iter([(self.epoch, i)
                     for i in self.indices()[self.start:self.stop].tolist()])

    def __len__(self):
        return max(0, min(self.stop, self.num_samples) - self.start)


def save_checkpoint(path: str, state: dict) -> None:
    """``torch.save`` to ``path`` atomically (``write_atomically``)."""
    write_atomically(path, lambda f: torch.save(state, f))


def write_atomically(path: str, write) -> None:
    """``write(f)`` into a temporary file, flush it to disk, then rename it over
    ``path``.

    The old file survives a crash at any point, and once this returns the new one
    survives a power cut: the folder is flushed too, so the rename itself is on disk."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_folder(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _fsync_folder(folder: str) -> None:
    """Flush a folder's entries (a rename) to disk, where the system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


FORMAT = "utils.train_cifar10/2"


# What a resumed run must repeat: each decides the model, the schedule of optimizer
# steps, or the images of each step (the loaders draw different augmentations).
RUN_SETTINGS = ("model", "epochs", "global_batch", "lr", "momentum", "weight_decay",
                "seed", "data_size", "loader")


# settings added since checkpoints of this format were first written, with the value
# every older run had
LEGACY_SETTINGS = {"loader": "workers"}


def run_config(args, data_size: int | None = None, loader: str | None = None) -> dict:
    """What a resumed run must repeat (without the data's size or the loader, before
    they are known: what the command line alone says)."""
    config = {"model": args.model, "epochs": args.epochs,
              "global_batch": args.global_batch, "lr": args.lr,
              "momentum": args.momentum, "weight_decay": args.weight_decay,
              "seed": args.seed, "data_size": data_size, "loader": loader}
    return {k: v for k, v in config.items() if v is not None}


def load_checkpoint(path: str, config: dict) -> dict:
    """Load with ``weights_only=True``; refuse files that are unreadable, not ours, or
    from another run.

    A resumed run must continue the same schedule: the one-cycle learning rate is laid
    out over ``epochs x steps per epoch`` steps and the sample order follows the seed,
    so a different ``--epochs``, ``--lr``, ``--global-batch``, ``--seed``, model or
    loader (``gpu`` or ``workers``: their augmentations differ) is refused with the
    differences listed. ``--workers``, ``--device``, ``--channels-last``,
    ``--compile`` and the number of processes may change.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SystemExit(f"error: cannot read checkpoint {path}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    expected = {"format", "model", "optimizer", "scheduler", "epoch", "step_in_epoch",
                "step", "config"}
    if (not isinstance(state, dict) or not expected <= set(state)
            or not str(state["format"]).startswith("utils.train_cifar10/")):
        raise SystemExit(f"error: {path} is not a checkpoint written by "
                         f"utils.train_cifar10")
    if state["format"] != FORMAT:
        raise SystemExit(f"error: {path} was written by another version of this script "
                         f"({state['format']}, this one reads {FORMAT}); "
                         f"start a new run with another --out")
    saved = {**LEGACY_SETTINGS, **state["config"]}
    changed = [f"--{k.replace('_', '-')} {config[k]} (checkpoint: {saved.get(k)})"
               for k in RUN_SETTINGS if k in config and saved.get(k) != config[k]]
    if changed:
        raise SystemExit(f"error: cannot resume {path}: "
                         + ", ".join(changed).replace("--data-size", "data set size")
                         + ". A resumed run continues the same schedule; repeat the "
                         "checkpoint's values, or start"
                         " a new run with another --out")
    return state


def keep_older(args, path: str, saved_step: int | None, step: int) -> None:
    """With ``--keep-checkpoints K > 1``, keep the checkpoint at ``path`` (of step
    ``saved_step``) that step ``step``'s is about to replace as
    ``checkpoint-step<N>.pt`` (a hard link: no copy), and only the K-1 newest of
    those."""
    if (args.keep_checkpoints < 2 or saved_step in (None, step)
            or not os.path.exists(path)):
        return
    folder = os.path.dirname(path)
    older = os.path.join(folder, f"checkpoint-step{saved_step}.pt")
    if not os.path.exists(older):
        try:
            os.link(path, older)
        except OSError:  # a file system without hard links
            shutil.copyfile(path, older)
    kept = sorted((int(name[len("checkpoint-step"):-3]), name)
                  for name in os.listdir(folder)
                  if re.fullmatch(r"checkpoint-step\d+\.pt", name))
    for _, name in kept[:max(0, len(kept) - (args.keep_checkpoints - 1))]:
        os.remove(os.path.join(folder, name))
