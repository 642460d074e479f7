"""Sphinx extension: bibliography labels the book's chapters already use.

Each entry of ``book/references.bib`` carries a ``shorthand`` field (``S0`` .. ``S4`` for the
five source articles, short names for the rest); citations render as ``[S2]``, not as a
number that would change whenever an entry is added.
"""

from pybtex.plugin import register_plugin
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle


class ShorthandLabels(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        for entry in sorted_entries:
            label = entry.fields.get("shorthand")
            if not label:
                raise ValueError(
                    f"references.bib: entry {entry.key!r} has no 'shorthand' field; "
                    "every entry needs one (its label in the text, e.g. S0)"
                )
            yield str(label)


class SourcesFirst(BaseSortingStyle):
    """The five source articles (S0..S4) first, in order, then the rest by label."""

    def sorting_key(self, entry):
        label = str(entry.fields.get("shorthand", entry.key))
        is_source = len(label) == 2 and label[0] == "S" and label[1].isdigit()
        return (not is_source, label.lower())


class BookStyle(UnsrtStyle):
    default_label_style = "book-shorthand"
    default_sorting_style = "book-sources-first"


def setup(app):
    register_plugin("pybtex.style.labels", "book-shorthand", ShorthandLabels)
    register_plugin("pybtex.style.sorting", "book-sources-first", SourcesFirst)
    register_plugin("pybtex.style.formatting", "book", BookStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
