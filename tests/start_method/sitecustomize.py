"""Put this folder on PYTHONPATH with BOOK_START_METHOD=spawn (or forkserver) and every Python process
started from then on, Jupyter kernels and DataLoader workers included, uses that start method: how
`make test` checks the notebooks as macOS and Windows run them, on Linux.

With forkserver, each process's fork server imports torch, torch.distributed, cloudpickle and utils
before it forks any worker (utils.workers.PRELOAD): every worker still gets only what it imports and
unpickles, as under spawn, but costs a fork instead of an interpreter that imports torch.

With BOOK_PROCESS_LOG=FILE as well, each such process appends one line to FILE (its pid, its
parent's, whether multiprocessing started it, its command line): how many interpreters a chapter
starts, each importing torch again under spawn (the pass's main cost)."""

import os

_method = os.environ.get("BOOK_START_METHOD")
if _method:
    import multiprocessing

    multiprocessing.set_start_method(_method, force=True)
    if _method == "forkserver":
        # utils.workers.PRELOAD, written out: importing utils here would slow every interpreter
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", "utils"])

_log = os.environ.get("BOOK_PROCESS_LOG")
if _log:
    import sys

    _child = "--multiprocessing-fork" in sys.argv or "-c" in sys.orig_argv[:2]
    with open(_log, "a") as _f:
        _f.write(f"{os.getpid()} {os.getppid()} {'mp' if _child else 'exe'} "
                 f"{' '.join(sys.orig_argv[:4])[:200]}\n")
