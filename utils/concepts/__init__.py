"""Conceptual figures of the book, each drawn by code from the objects its chapter runs.

A measurement (a shard grid, a benchmark plot) lives in ``utils.viz``; a figure here
shows an idea a reader has to hold in their head: an index's path to a device, stride
against chunk sharding, the global batch and the learning-rate rule, a DDP step's
overlapping all-reduces, torchrun through a restart, shards dealt to ranks and workers,
what a checkpoint records of an epoch, where each signal goes in a Slurm job. Each
function takes its data from the code the chapter uses (the sampler's own indices, the
real bucket sizes), so the figure cannot drift from it, and returns a matplotlib Figure
whose parts carry a ``gid`` that a test can find.

The figures about data are in ``utils.concepts.data``, those about processes in
``utils.concepts.processes``; the chapters import them from here.
"""

from .data import (checkpoint_position, deal_shards, draw_checkpoint_position,
                   draw_global_batch, draw_index_path, draw_shards_dealt,
                   draw_stride_and_chunk, global_batch, index_path, stride_and_chunk)
from .processes import (bucket_layout, ddp_step_bars, draw_ddp_step,
                        draw_slurm_signals, draw_torchrun_restart, restart_events,
                        slurm_signal_labels)

__all__ = ["index_path", "draw_index_path", "stride_and_chunk", "draw_stride_and_chunk",
           "global_batch", "draw_global_batch", "deal_shards", "draw_shards_dealt",
           "checkpoint_position", "draw_checkpoint_position", "bucket_layout",
           "ddp_step_bars", "draw_ddp_step", "restart_events", "draw_torchrun_restart",
           "slurm_signal_labels", "draw_slurm_signals"]
