"""Put this folder on PYTHONPATH with BOOK_START_METHOD=spawn (or forkserver) and every Python process
started from then on, Jupyter kernels and DataLoader workers included, uses that start method: how
`make test` checks the notebooks as macOS and Windows run them (spawn), on Linux.

With BOOK_PROCESS_LOG=FILE as well, each such process appends one line to FILE (its pid, its
parent's, whether multiprocessing started it, its command line): how many interpreters a chapter
starts, each importing torch again under spawn (the pass's main cost)."""

import os

_method = os.environ.get("BOOK_START_METHOD")
if _method:
    import multiprocessing

    multiprocessing.set_start_method(_method, force=True)

_log = os.environ.get("BOOK_PROCESS_LOG")
if _log:
    import sys

    _child = "--multiprocessing-fork" in sys.argv or "-c" in sys.orig_argv[:2]
    with open(_log, "a") as _f:
        _f.write(f"{os.getpid()} {os.getppid()} {'mp' if _child else 'exe'} "
                 f"{' '.join(sys.orig_argv[:4])[:200]}\n")
