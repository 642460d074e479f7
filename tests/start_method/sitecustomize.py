"""Put this folder on PYTHONPATH with BOOK_START_METHOD=spawn (or forkserver) and every Python process
started from then on, Jupyter kernels and DataLoader workers included, uses that start method: how
`make test` checks the notebooks as macOS and Windows run them (spawn), on Linux."""

import os

_method = os.environ.get("BOOK_START_METHOD")
if _method:
    import multiprocessing

    multiprocessing.set_start_method(_method, force=True)
