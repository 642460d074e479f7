"""Named in a fork server's preload list by
``utils.workers.worker_context(detach=True)``: imported there, it moves the server into
a process group of its own, so that a signal sent to its parent's group (torchrun's
agent signals each rank's group) leaves the server, and the DataLoader workers it forks,
running until the rank stops them. Imported anywhere else it does nothing."""

import os
import sys

_SERVER = "from multiprocessing.forkserver import main"

if hasattr(os, "setpgrp") and any(_SERVER in arg
                                  for arg in getattr(sys, "orig_argv", ())):
    os.setpgrp()
