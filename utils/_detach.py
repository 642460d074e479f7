"""Named in a fork server's preload list by
``utils.workers.worker_context(detach=True)``: imported there, it moves the server into
a process group of its own, so that a signal sent to its parent's group (torchrun's
agent signals each rank's group) leaves the server, and the DataLoader workers it forks,
running until the rank stops them; and it has the server ignore the signals a scheduler
sends to *every* process of a job (SLURM signals each process of a job step: SIGTERM at
a time limit, a preemption or ``scancel``, SIGUSR1 or another with ``--signal``), which
its workers inherit, so that they are left to the rank to stop. Imported anywhere else
it does nothing.

A worker that ignores SIGTERM is not ended by ``DataLoader``'s last resort for a worker
that does not exit (``Process.terminate``, a SIGTERM); ``utils.workers.WatchParent``
ends it with SIGKILL once its rank is gone."""

import os
import sys

from utils.workers import ignore_stop_signals

_SERVER = "from multiprocessing.forkserver import main"

if hasattr(os, "setpgrp") and any(_SERVER in arg
                                  for arg in getattr(sys, "orig_argv", ())):
    os.setpgrp()
    ignore_stop_signals()
