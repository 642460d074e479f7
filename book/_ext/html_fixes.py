"""A fix for the book's HTML pages, loaded by _config.yml (sphinx: local_extensions).

Sphinx 7.4 writes an inline script that an extension registers after the builder has
started (sphinx-thebe's `const THEBE_JS_URL = ...`) into every page twice: once as
registered (file name None) and once from its registry (file name ''), which it does
not take for the same script. The second `const` is a SyntaxError in every page's
console. Here each page keeps the first of identical scripts.
"""


def _script_key(script):
    attributes = getattr(script, "attributes", {})
    return (getattr(script, "filename", script) or "", getattr(script, "priority", 0),
            tuple(sorted(attributes.items())))


def keep_first_of_identical_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for script in scripts:
        key = _script_key(script)
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


def setup(app):
    # after the other handlers of the event, which may add scripts of their own
    app.connect("html-page-context", keep_first_of_identical_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
