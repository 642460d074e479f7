"""The imports inside ``utils/`` go one way: no module imports, even only for type
checking or inside a function, a module that imports it back (through any number of
others). A circle makes a reader of one module meet the other first, and a type checker
(and Python, at import time) meet a module before it is defined."""

import ast
import os

import utils

ROOT = os.path.dirname(utils.__file__)


def module_name(path: str) -> str:
    parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, name: str, package: bool) -> set[str]:
    """The modules of ``utils`` that module ``name`` imports, anywhere in it."""
    base = name.split(".") if package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            stem = (base[:len(base) - node.level + 1] if node.level else [])
            module = ".".join(stem + ([node.module] if node.module else []))
            found.add(module)
            # ``from . import x`` and ``from .pkg import mod``: x may be a module
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "utils" or m.startswith("utils.")}


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = module_name(path)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                graph[name] = imported(tree, name, file == "__init__.py")
    # a package's submodules import the package's __init__ first: not an edge to
    # count (Python runs it before them); only edges to modules that exist
    return {name: {m for m in deps if m in graph and not name.startswith(m + ".")}
            - {name} for name, deps in graph.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of two or more modules (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_module_of_utils_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "utils.train_cifar10.steps" in graph and len(graph) > 40
    assert circles(graph) == []


def test_the_check_finds_a_circle_through_a_type_only_import():
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from .steps import Training\n")
    assert imported(tree, "utils.train_cifar10.checkpoints", False) >= {
        "utils.train_cifar10.steps"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_training_package_has_steps_at_the_top():
    graph = import_graph()
    package = "utils.train_cifar10."
    users = {name for name, deps in graph.items() if package + "steps" in deps}
    assert users <= {"utils.train_cifar10", "utils.train_cifar10.__main__"}, users
    for shared in ("job", "state"):
        deps = {d[len(package):] for d in graph[package + shared]
                if d.startswith(package)}
        assert not deps & {"steps", "loaders", "launcher"}, (shared, deps)
