"""How much disk each part of the book's environment takes, read from the distributions
installed in this Python's environment (run it with .venv's Python):

    python -m utils.install_size --out book/results/install_size.json \
        [--wheel torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl]

Three groups: torch with everything it depends on (the CUDA wheels, ``nvidia-*``, among
them on Linux); what the reader's ``requirements.txt`` adds to that; what the
contributors' ``requirements-dev.txt`` adds to the reader's. A file's closure is the
distributions it names and, recursively, those their ``Requires-Dist`` asks for, with
the markers evaluated for this Python and platform; an extra is followed only where a
requirement names it (torch's ``cuda-toolkit[cublas,...]``). A distribution's size is
that of the files its ``RECORD`` lists, each as large as it is on disk (RECORD's size
where the file is gone), a file listed by several distributions counted once; MB are
10^6 bytes of file size, as ``du -sb`` counts files (``du -sh`` counts allocated
blocks, in GiB). Version ranges are not checked: what is installed is what is measured.
``--wheel`` adds a wheel that is not installed (a CPU-only torch, where this
environment has the CUDA one): its download, its files unpacked, and what its
dependencies take here.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import os
import platform
import re
import site
import sys
import zipfile
from dataclasses import dataclass, field

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

from . import results

__all__ = ["Dist", "canonical", "read_requirements", "installed", "closure",
           "size", "measure", "wheel_size"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READER = "requirements.txt"
DEVELOPER = "requirements-dev.txt"
TORCH = "torch"
# the parts of torch's closure that a CPU-only build of torch does without
CUDA_PARTS = {"nvidia-*": "nvidia-", "cuda-*": "cuda-", "triton": "triton"}
# and torch's own libraries for CUDA (torch/lib/libtorch_cuda.so, libc10_cuda.so ...)
TORCH_CUDA_FILE = re.compile(r"(cuda|nvshmem|nvrtc)[^/]*\.so")


@dataclass(frozen=True)
class Dist:
    """An installed distribution: its canonical name, version, ``Requires-Dist`` lines
    and files (path: bytes)."""
    name: str
    version: str = "0"
    requires: tuple[str, ...] = ()
    files: dict[str, int] = field(default_factory=dict)


def canonical(name: str) -> str:
    """The name as PEP 503 compares names: ``PyYAML`` and ``pyyaml``, ``jupyter_core``
    and ``jupyter-core`` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: str) -> list[str]:
    """The requirements a pip requirements file names, in order: those of the files it
    includes (``-r``) too; an editable project (``-e .``) as its ``pyproject.toml``
    name; constraints (``-c``) and other options left out."""
    found = []
    folder = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            option, _, rest = line.partition(" ")
            if option in ("-r", "--requirement"):
                found += read_requirements(os.path.join(folder, rest.strip()))
            elif option in ("-e", "--editable"):
                found.append(_project_name(rest.strip()))
            elif line and not line.startswith("-"):
                found.append(line)
    return found


def _project_name(project: str) -> str:
    """The ``[project]`` name in ``project``'s ``pyproject.toml`` (a path relative to
    the current folder, as pip reads ``-e``)."""
    with open(os.path.join(project, "pyproject.toml"), encoding="utf-8") as f:
        found = re.search(r'^name\s*=\s*"([^"]+)"', f.read(), flags=re.M)
    if not found:
        raise ValueError(f"no [project] name in {project}/pyproject.toml")
    return found.group(1)


def installed(path: list[str] | None = None, sizes: bool = True) -> dict[str, Dist]:
    """The distributions installed in the folders ``path`` (this environment's
    site-packages, not the current folder, where a ``*.egg-info`` may lie), by
    canonical name; the first one found of a name, as ``import`` finds it. ``sizes``
    false: without their files (no file is looked at: quicker)."""
    found = {}
    for dist in importlib.metadata.distributions(path=path or _site_packages()):
        name = canonical(dist.metadata["Name"] or "")
        if name and name not in found:
            found[name] = Dist(name, dist.version, tuple(dist.requires or ()),
                               _files(dist) if sizes else {})
    return found


def _site_packages() -> list[str]:
    """This environment's site-packages folders, the user's too where Python reads it
    (as ``pip list`` lists them)."""
    folders = site.getsitepackages()
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    return [f for f in folders if os.path.isdir(f)]


def _files(dist: importlib.metadata.Distribution) -> dict[str, int]:
    """``{absolute path: bytes}`` for each file of ``dist``'s RECORD: the size on disk,
    RECORD's where the file is gone, 0 where RECORD has none either."""
    sizes = {}
    for entry in dist.files or ():
        where = os.path.abspath(str(dist.locate_file(entry)))
        try:
            sizes[where] = os.lstat(where).st_size
        except OSError:
            sizes[where] = entry.size or 0
    return sizes


def closure(roots: list[str], dists: dict[str, Dist],
            environment: dict | None = None) -> tuple[set[str], set[str]]:
    """``(installed, missing)``: the canonical names of the distributions ``roots``
    (requirement strings) need, recursively, that are installed, and those that are
    not. A marker is evaluated in ``environment`` (this Python's, by default) with
    ``extra`` set to each extra named by the requirement that reached its
    distribution."""
    environment = {**default_environment(), **(environment or {})}
    done: dict[str, set[str]] = {}
    missing: set[str] = set()
    todo = [(Requirement(r), "") for r in roots]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate(
                {**environment, "extra": extra}):
            continue
        name = canonical(requirement.name)
        if name not in dists:
            missing.add(name)
            continue
        extras = {""} | {canonical(e) for e in requirement.extras}
        new = extras - done.get(name, set())
        if name in done and not new:
            continue
        done.setdefault(name, set()).update(new)
        todo += [(Requirement(line), e) for line in dists[name].requires for e in new]
    return set(done), missing


def size(names, dists: dict[str, Dist], counted: set[str] | None = None) -> int:
    """The bytes of the files of the distributions ``names``, each file once; a file in
    ``counted`` (the paths already counted, updated) is not counted again."""
    counted = set() if counted is None else counted
    total = 0
    for name in sorted(names):
        for path, nbytes in dists[name].files.items():
            if path not in counted:
                counted.add(path)
                total += nbytes
    return total


def _group(names, dists: dict[str, Dist], counted: set[str]) -> dict:
    """``{"bytes", "distributions": {name: bytes, largest first}}`` of ``names``."""
    each = {name: size([name], dists, counted) for name in sorted(names)}
    return {"bytes": sum(each.values()),
            "distributions": dict(sorted(each.items(), key=lambda kv: (-kv[1], kv[0])))}


def measure(dists: dict[str, Dist], reader: list[str], developer: list[str],
            environment: dict | None = None) -> dict:
    """The three groups, each distribution in the first that needs it: ``torch`` (its
    closure; ``cuda``: the bytes of its ``nvidia-*``, ``cuda-*`` and ``triton``
    distributions and of torch's own CUDA libraries), ``reader`` (what ``reader``'s
    closure adds to torch's),
    ``contributors`` (what ``developer``'s adds to the reader's); ``other``: the
    installed distributions no closure needs (pip); ``missing``: names a closure
    needs that are not installed."""
    torch, lost = closure([TORCH], dists, environment)
    read, lost_reader = closure(reader, dists, environment)
    dev, lost_dev = closure(developer, dists, environment)
    counted: set[str] = set()
    groups = {"torch": _group(torch, dists, counted),
              "reader": _group(read - torch, dists, counted),
              "contributors": _group(dev - read - torch, dists, counted),
              "other": _group(set(dists) - dev - read - torch, dists, counted)}
    sizes = groups["torch"]["distributions"]
    groups["torch"]["cuda"] = {
        part: sum(b for n, b in sizes.items() if n.startswith(prefix))
        for part, prefix in CUDA_PARTS.items()}
    groups["torch"]["cuda"]["torch's *cuda*.so"] = sum(
        b for path, b in (dists[TORCH].files if TORCH in dists else {}).items()
        if TORCH_CUDA_FILE.search(os.path.basename(path)))
    groups["missing"] = sorted(lost | lost_reader | lost_dev)
    return groups


def wheel_size(path: str, dists: dict[str, Dist],
               environment: dict | None = None) -> dict:
    """What a wheel that is not installed would take (a CPU-only torch, say): the file's
    bytes (the download), its files' bytes unpacked (without the ``.pyc`` that pip
    compiles when it installs), and the bytes its dependencies take in ``dists``,
    its closure with itself left out."""
    with zipfile.ZipFile(path) as wheel:
        unpacked = sum(info.file_size for info in wheel.infolist())
        metadata = next(n for n in wheel.namelist()
                        if n.endswith(".dist-info/METADATA"))
        text = wheel.read(metadata).decode("utf-8")
    name = canonical(re.search(r"^Name: (.+)$", text, flags=re.M).group(1).strip())
    requires = re.findall(r"^Requires-Dist: (.+)$", text, flags=re.M)
    dependencies, missing = closure(requires, dists, environment)
    return {"wheel": os.path.basename(path), "download_bytes": os.path.getsize(path),
            "unpacked_bytes": unpacked,
            "dependencies_bytes": size(dependencies - {name}, dists),
            "dependencies": sorted(dependencies - {name}), "missing": sorted(missing)}


def folder_size(folder: str) -> int:
    """Bytes of every file under ``folder`` (links not followed), as ``du -sb``."""
    total = 0
    for where, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(where, name)).st_size
            except OSError:
                pass
    return total


def environment() -> dict:
    """The platform the sizes hold for: wheels differ by OS, machine and Python."""
    dists = installed()
    return {"python": platform.python_version(), "platform": platform.platform(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "torch": dists[TORCH].version if TORCH in dists else None,
            "prefix": os.path.relpath(sys.prefix, ROOT)
            if sys.prefix.startswith(ROOT) else sys.prefix,
            "virtual_environment": sys.prefix != sys.base_prefix}


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.0f} MB"


def _largest(group: dict, count: int = 5) -> str:
    return ", ".join(f"{name} {_mb(b)}"
                     for name, b in list(group["distributions"].items())[:count])


def report(result: dict) -> str:
    """The groups as text, the way ``main`` prints them."""
    torch, env = result["groups"]["torch"], result["environment"]
    share = {part: b / max(torch["bytes"], 1) for part, b in torch["cuda"].items()}
    lines = [
        f"{env['prefix']} (Python {env['python']}, {env['machine']}): "
        f"{_mb(result['environment_bytes'])} on disk, "
        f"{_mb(result['distributions_bytes'])} of it in "
        f"{result['distributions']} distributions",
        f"torch {env['torch']} and its closure: {_mb(torch['bytes'])} "
        f"({len(torch['distributions'])} distributions)",
        "  of which " + "; ".join(f"{part} {_mb(b)} ({share[part]:.0%})"
                                  for part, b in torch["cuda"].items()),
        f"  the rest, about what a CPU-only torch installs (not measured: its "
        f"libraries differ): {_mb(torch['bytes'] - sum(torch['cuda'].values()))}",
        f"  largest: {_largest(torch)}"]
    for key, what in [("reader", f"{READER}'s closure without torch's"),
                      ("contributors", f"what {DEVELOPER} adds to {READER}")]:
        group = result["groups"][key]
        lines += [f"{what}: {_mb(group['bytes'])} "
                  f"({len(group['distributions'])} distributions)",
                  f"  largest: {_largest(group)}"]
    other = result["groups"]["other"]
    lines.append(f"in no closure: {_largest(other) or 'nothing'}; in no RECORD: "
                 f"{_mb(result['environment_bytes'] - result['distributions_bytes'])}")
    wheel = result.get("wheel")
    if wheel:
        lines.append(
            f"{wheel['wheel']} (not installed): {_mb(wheel['download_bytes'])} to "
            f"download, {_mb(wheel['unpacked_bytes'])} unpacked (without .pyc), "
            f"{_mb(wheel['dependencies_bytes'])} of dependencies in this environment")
    if result["groups"]["missing"]:
        lines.append(f"not installed: {', '.join(result['groups']['missing'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """``python -m utils.install_size``: print the groups; save ``--out``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m utils.install_size",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="save the result as JSON here, through "
                        "utils.results: book/results/install_size.json")
    parser.add_argument("--wheel", help="also a wheel that is not installed, as "
                        "what it would take (a CPU-only torch: torch-*+cpu-*.whl)")
    args = parser.parse_args(argv)
    wheel = os.path.abspath(args.wheel) if args.wheel else None
    os.chdir(ROOT)  # -e . in requirements.txt is relative to the repository
    dists = installed()
    requirements = {READER: read_requirements(READER),
                    DEVELOPER: read_requirements(DEVELOPER)}
    result = {
        "benchmark": "size on disk of torch's closure, the reader's requirements "
                     "and the contributors' tools, in this environment",
        "groups": measure(dists, requirements[READER], requirements[DEVELOPER]),
        "requirements": requirements,
        "distributions": len(dists),
        "distributions_bytes": size(dists, dists),
        "environment_bytes": folder_size(sys.prefix),
        **({"wheel": wheel_size(wheel, dists)} if wheel else {}),
        "environment": environment(),
        "versions": {name: dists[name].version for name in sorted(dists)},
        "command": " ".join(["python -m utils.install_size", *argv]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    print(report(result), flush=True)
    if args.out:
        results.write(args.out, result, [f"utils/install_size.py::{name}" for name in (
            "read_requirements", "_project_name", "installed", "_site_packages",
            "_files", "closure", "size", "_group", "measure", "folder_size",
            "wheel_size")])
    return result


if __name__ == "__main__":
    main()
