import inspect

import IPython
import IPython.display

import utils
from utils.audit import audit_shards


def test_prints_the_source_outside_ipython(capsys, monkeypatch):
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    utils.show_source(audit_shards)
    assert capsys.readouterr().out == inspect.getsource(audit_shards).rstrip() + "\n"


def test_shows_a_highlighted_python_block_in_jupyter(capsys, monkeypatch):
    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    monkeypatch.setattr(IPython.display, "display", shown.append)
    utils.show_source(audit_shards)
    assert capsys.readouterr().out == ""
    (block,) = shown
    assert isinstance(block, IPython.display.Markdown)
    source = inspect.getsource(audit_shards).rstrip()
    assert block.data == f"```python\n{source}\n```"
