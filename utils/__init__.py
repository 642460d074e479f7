"""Helpers for the book *Distributed Data Loading in PyTorch*.

Each module has one job:

- ``utils.data``      the toy ``Simple`` data set used throughout Part I;
- ``utils.samplers``  ``ShardSampler``, a from-scratch ``DistributedSampler``;
- ``utils.launch``    ``run_distributed``: run a function on N local ranks from a
                      notebook;
- ``utils.audit``     ``audit_shards``: coverage, duplicates, padding and overlap of
                      shards;
- ``utils.viz``       shard pictures and the interactive shard explorer;
- ``utils.bench``     benchmarks that are run by hand, not timed in tests.

Modules are imported lazily by the chapters (``from utils.samplers import
ShardSampler``) so that importing ``utils`` itself stays cheap.
"""

import inspect as _inspect

__all__ = ["show_source"]


def show_source(obj) -> None:
    """Show the source of a utils function or class, so a chapter can show what it uses.

    In Jupyter (and in the built book) the code is shown as a highlighted Python block;
    elsewhere it is printed.
    """
    source = _inspect.getsource(obj).rstrip()
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(source)
        return
    display(Markdown(f"```python\n{source}\n```"))
