"""A value of a results file in book/results/, shown as a literal block at build time,
loaded by _config.yml (sphinx: local_extensions):

    ```{results-text} failures_cpu.json port_in_use.output
    ```

The first argument names a JSON file in book/results/, the second the keys to the
value, joined by dots (a number picks an item of a list). A string is shown as it is,
anything else as indented JSON. A page shows what the file holds, so that it cannot
drift from what was measured: a missing file or key is an error of the build, which
names both; the page is rebuilt when the file changes.
"""

from __future__ import annotations

import json
import os

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "results")


def results_text(name: str, keys: str, folder: str = RESULTS) -> str:
    """The value at ``keys`` (``a.b.0``) in the results file ``name`` of ``folder``, as
    text; ``LookupError`` saying what is missing where."""
    path = os.path.join(folder, name)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise LookupError(f"no results file {name} in {folder}") from None
    done = []
    for key in keys.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            where = ".".join(done) or "the top level"
            there = (f"its keys there: {', '.join(value)}" if isinstance(value, dict)
                     else f"a {type(value).__name__} there")
            raise LookupError(f"{name} has no {key!r} in {where} ({there})")
        done.append(key)
    return value if isinstance(value, str) else json.dumps(value, indent=2)


class ResultsText(SphinxDirective):
    """``{results-text} FILE KEYS``: the value as a literal (text) block."""

    required_arguments = 2
    option_spec = {"language": str}

    def run(self) -> list[nodes.Node]:
        name, keys = self.arguments
        self.env.note_dependency(os.path.join(RESULTS, name))
        try:
            text = results_text(name, keys)
        except LookupError as missing:
            raise self.error(f"results-text: {missing}") from None
        block = nodes.literal_block(text, text)
        block["language"] = self.options.get("language", "text")
        self.set_source_info(block)
        return [block]


def setup(app) -> dict:
    """Register the directive."""
    app.add_directive("results-text", ResultsText)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
