"""The one writer of ``book/results/``: every results file records the source of the
code its figures depend on, so that a stale file is found by a test, not by a reader.

    write(path, result, sources)   # atomically; adds "sources" and "date"
    stale(path)                    # the sources that changed since the file was written

``sources`` are paths relative to the repository root (``utils/gpu_loader.py``; every
module of a package: ``package_sources``), or one definition in a file
(``utils/bench.py::bench_ddp``); each is recorded with the
SHA-256 of its code (the syntax tree without docstrings and comments). A writer lists
what its figures depend on, and says in its code why it leaves out anything else it
runs (a chapter it only times, say). ``tests/test_results.py`` fails when a CPU
results file is stale: run its ``command`` again. A file measured on a GPU (``"gpu":
true``) cannot be remade on the machine the tests run on; the chapter that shows it
prints which of its sources have changed since.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "book", "results")


def source_hash(source: str, root: str = ROOT, text: str | None = None) -> str | None:
    """SHA-256, as hex, of the code of ``source``: a file (``utils/gpu_loader.py``), or
    one top-level function, class or assignment in it (``utils/bench.py::bench_ddp``),
    where a file holds several benchmarks; its syntax tree without docstrings, so that
    rewording or rewrapping is no change (a file that is not Python: its text).
    ``None``: no such file or name. ``text``: the file's text, if not read from
    ``root``."""
    relative, _, name = source.partition("::")
    if text is None:
        try:
            with open(os.path.join(root, relative), encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return None
    if not relative.endswith(".py"):  # a shell script, say: its whole text
        return hashlib.sha256(text.encode()).hexdigest()
    tree = ast.parse(text)
    if name:
        tree = _definition(tree, name)
        if tree is None:
            return None
    return hashlib.sha256(_code_only(tree).encode()).hexdigest()


def package_sources(package: str, root: str = ROOT) -> list[str]:
    """Every module of a package folder (``utils/train_cifar10``) as a source: its
    ``.py`` files, relative to ``root``, sorted."""
    folder = os.path.join(root, package)
    return sorted(f"{package}/{name}" for name in os.listdir(folder)
                  if name.endswith(".py"))


def _code_only(tree: ast.AST) -> str:
    """The syntax tree without its docstrings, as text: what the code does, not how it
    is worded, wrapped or commented (comments are not in the tree)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return _dump(tree)


def _dump(node) -> str:
    """``ast.dump`` without the fields that are empty or ``None``: the same text on
    every Python the book runs on (3.12 adds ``type_params=[]`` to each function and
    class, 3.13 leaves empty fields out), so a file measured on a GPU machine's Python
    is judged by the same hash as on the tests' one."""
    if isinstance(node, ast.AST):
        fields = ", ".join(f"{name}={_dump(value)}"
                           for name, value in ast.iter_fields(node)
                           if value is not None and value != [])
        return f"{type(node).__name__}({fields})"
    if isinstance(node, list):
        return "[" + ", ".join(_dump(item) for item in node) + "]"
    return repr(node)


def _definition(tree: ast.Module, name: str) -> ast.AST | None:
    """The top-level ``def``, ``class`` or assignment ``name`` in ``tree``, or
    ``None``."""
    for node in tree.body:
        names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                  ast.AsyncFunctionDef))
                 else [t.id for t in getattr(node, "targets", [])
                       if isinstance(t, ast.Name)])
        if name in names:
            return node
    return None


def write(path: str, result: dict, sources: list[str], gpu: bool = False,
          root: str = ROOT) -> None:
    """``result`` as JSON at ``path``, written to a temporary file and renamed (never
    half a file), with ``sources`` (their hashes now), ``gpu`` and a ``date`` if it
    has none; say so."""
    missing = [s for s in sources if source_hash(s, root) is None]
    if missing or not sources:
        raise ValueError(f"sources must name files (or definitions in them) of this "
                         f"repository, relative to {root}; not found: "
                         f"{missing or 'none given'}")
    result = {**result, "sources": {s: source_hash(s, root) for s in sorted(sources)},
              "gpu": gpu}
    result.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    print(f"saved {path}")


def stale(path: str, root: str = ROOT) -> list[str]:
    """The sources of the results file at ``path`` that differ from the files in this
    repository now (changed or gone); ``["(no sources recorded)"]`` for a file that
    does not say what it measured."""
    with open(path) as f:
        recorded = json.load(f).get("sources")
    if not recorded:
        return ["(no sources recorded)"]
    return [s for s, digest in sorted(recorded.items())
            if source_hash(s, root) != digest]


def environment() -> dict:
    """Hardware and software the measurement ran on (torch imported here: reading
    results files does not need it)."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
    }
