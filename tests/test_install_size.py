"""utils.install_size: the closures of the requirements files (markers evaluated, extras
followed only where named), the sizes of the groups (each file once, each distribution
in the first group that needs it), on small fake distributions; and the split itself:
what the chapters import comes from requirements.txt, the contributors' tools only
from requirements-dev.txt, and make installs the latter."""

import ast
import json
import os
import pathlib
import re
import sys
import zipfile

from utils import install_size
from utils.install_size import Dist, canonical, closure, measure, size

ROOT = pathlib.Path(install_size.ROOT)
RESULT = ROOT / "book" / "results" / "install_size.json"
LINUX = {"platform_system": "Linux", "sys_platform": "linux"}
MAC = {"platform_system": "Darwin", "sys_platform": "darwin"}
TOOLS = {"jupyter-book", "pytest", "nbval", "hypothesis", "pytest-xdist", "playwright"}


def fake(name, requires=(), files=None, **sizes):
    """A distribution with files ``/env/{name}/{file}`` of the given sizes (``files``,
    or keyword arguments)."""
    files = {**(files or {}), **sizes}
    return Dist(canonical(name), "1.0", tuple(requires),
                {f"/env/{name}/{path}": nbytes for path, nbytes in files.items()})


def fakes(*dists):
    return {d.name: d for d in dists}


# a torch as on Linux: CUDA wheels behind markers, one through an extra
TORCH = fakes(
    fake("torch", ["filelock", 'nvidia-cudnn; platform_system == "Linux"',
                   'cuda-toolkit[cublas]==13; platform_system == "Linux"',
                   'triton; platform_system == "Linux" and python_version < "3.15"'],
         {"lib/libtorch_cpu.so": 100, "lib/libtorch_cuda.so": 40}),
    fake("filelock", a=1),
    fake("nvidia-cudnn", lib=50),
    fake("cuda-toolkit", ['nvidia-cublas; extra == "cublas"',
                          'nvidia-cufft; extra == "cufft"'], meta=2),
    fake("nvidia-cublas", lib=30),
    fake("nvidia-cufft", lib=20),  # installed, but no extra asks for it
    fake("triton", lib=9),
)


def test_names_compare_as_pep_503_says():
    assert canonical("PyYAML") == canonical("pyyaml") == "pyyaml"
    assert canonical("jupyter_core") == canonical("Jupyter.Core") == "jupyter-core"


def test_the_closure_follows_markers_and_only_the_extras_named():
    names, missing = closure(["torch>=2.2"], TORCH, LINUX)
    assert names == {"torch", "filelock", "nvidia-cudnn", "cuda-toolkit",
                     "nvidia-cublas", "triton"}
    assert missing == set()
    on_a_mac, _ = closure(["torch"], TORCH, MAC)
    assert on_a_mac == {"torch", "filelock"}
    with_fft, _ = closure(["torch", "cuda-toolkit[cufft]"], TORCH, LINUX)
    assert "nvidia-cufft" in with_fft


def test_a_cycle_ends_and_what_is_not_installed_is_reported():
    dists = fakes(fake("a", ["b"]), fake("b", ["a", "c; python_version > '1'",
                                              "d; python_version < '1'"]))
    assert closure(["A"], dists) == ({"a", "b"}, {"c"})
    assert closure(['a; sys_platform == "nowhere"'], dists) == (set(), set())


def test_each_file_is_counted_once():
    dists = fakes(Dist("a", files={"/x": 5, "/shared": 7}),
                  Dist("b", files={"/y": 11, "/shared": 7}))
    assert size(["a", "b"], dists) == 5 + 7 + 11
    counted = set()
    assert size(["a"], dists, counted) == 12 and size(["b"], dists, counted) == 11


def test_the_groups_are_disjoint_and_say_what_cuda_takes_of_torch():
    dists = fakes(*TORCH.values(), fake("numpy", n=3),
                  fake("torchvision", ["torch", "numpy", "pillow"], v=4),
                  fake("pillow", p=6), fake("pytest", ["pluggy"], t=8),
                  fake("pluggy", q=1), fake("pip", r=12))
    groups = measure(dists, ["torchvision", "numpy"], ["torchvision", "pytest"], LINUX)
    assert groups["torch"]["bytes"] == 100 + 40 + 1 + 50 + 2 + 30 + 9
    assert groups["torch"]["cuda"] == {"nvidia-*": 80, "cuda-*": 2, "triton": 9,
                                       "torch's *cuda*.so": 40}
    assert groups["reader"]["distributions"] == {"pillow": 6, "torchvision": 4,
                                                 "numpy": 3}
    assert groups["contributors"] == {"bytes": 9,
                                      "distributions": {"pytest": 8, "pluggy": 1}}
    assert list(groups["other"]["distributions"]) == ["nvidia-cufft", "pip"]
    assert groups["missing"] == []


def test_installed_reads_record_and_sizes_on_disk(tmp_path):
    info = tmp_path / "Fake_Pkg-1.2.dist-info"
    info.mkdir()
    (tmp_path / "fake_pkg").mkdir()
    (tmp_path / "fake_pkg" / "__init__.py").write_text("x = 1\n")  # 6 bytes on disk
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: Fake_Pkg\nVersion: 1.2"
                                   "\nRequires-Dist: numpy>=1\n")
    (info / "RECORD").write_text("fake_pkg/__init__.py,sha256=x,999\n"
                                 "fake_pkg/gone.py,sha256=y,40\n"
                                 "Fake_Pkg-1.2.dist-info/RECORD,,\n")
    found = install_size.installed([str(tmp_path)])
    dist = found["fake-pkg"]
    assert (dist.version, dist.requires) == ("1.2", ("numpy>=1",))
    sizes = {os.path.relpath(p, tmp_path): b for p, b in dist.files.items()}
    assert sizes["fake_pkg/__init__.py"] == 6  # the disk's size, not RECORD's
    assert sizes["fake_pkg/gone.py"] == 40  # gone: RECORD's
    assert sizes["Fake_Pkg-1.2.dist-info/RECORD"] == (info / "RECORD").stat().st_size


def test_a_wheel_not_installed_is_measured_unpacked_with_its_dependencies(tmp_path):
    path = tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr("torch/lib/libtorch_cpu.so", b"\0" * 5000)
        wheel.writestr("torch-2.13.0+cpu.dist-info/METADATA",
                       "Name: torch\nVersion: 2.13.0+cpu\nRequires-Dist: filelock\n"
                       'Requires-Dist: triton; platform_system == "Windows"\n'
                       'Requires-Dist: numpy; extra == "numpy"\n')
    with zipfile.ZipFile(path) as wheel:
        meta = wheel.getinfo("torch-2.13.0+cpu.dist-info/METADATA").file_size
    found = install_size.wheel_size(str(path), TORCH, LINUX)
    assert found["unpacked_bytes"] == 5000 + meta
    assert found["download_bytes"] == path.stat().st_size < 5000
    assert (found["dependencies"], found["dependencies_bytes"]) == (["filelock"], 1)


def test_requirements_files_are_read_as_pip_reads_them(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "my-utils"\n')
    (tmp_path / "base.txt").write_text("# the reader's\ntorch>=2.2,<3  # note\n"
                                       'py-spy>=0.3; sys_platform != "win32"\n-e .\n')
    (tmp_path / "dev.txt").write_text("-r base.txt\n-c constraints.txt\n"
                                      "--extra-index-url https://x\n\npytest>=8\n")
    monkeypatch.chdir(tmp_path)  # pip reads -e . from the current folder
    found = install_size.read_requirements(str(tmp_path / "dev.txt"))
    assert found == ["torch>=2.2,<3", 'py-spy>=0.3; sys_platform != "win32"',
                     "my-utils", "pytest>=8"]


def _chapter_imports() -> set[str]:
    """Top-level modules that the chapters' code cells and the utils modules they use
    import (utils.notebook_times and utils.install_size are the contributors' tools)."""
    sources = []
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        sources += ["\n".join(line for line in "".join(c["source"]).splitlines()
                              if not line.lstrip().startswith(("%", "!")))
                    for c in cells if c["cell_type"] == "code"]
    sources += [p.read_text() for p in sorted((ROOT / "utils").rglob("*.py"))
                if p.name not in ("notebook_times.py", "install_size.py")]
    found = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"utils"}


def test_every_module_a_chapter_imports_comes_from_requirements_txt():
    from importlib.metadata import packages_distributions
    dists = install_size.installed(sizes=False)
    reader, _ = closure(install_size.read_requirements(str(ROOT / "requirements.txt")),
                        dists)
    providers = packages_distributions()
    imports = _chapter_imports()
    assert {"torch", "matplotlib", "webdataset", "torchdata"} <= imports
    outside = {m: providers.get(m) for m in imports
               if not {canonical(d) for d in providers.get(m, [])} & reader}
    assert not outside, f"imported by a chapter, not in requirements.txt's: {outside}"


def test_the_contributors_tools_are_in_requirements_dev_txt_only(monkeypatch):
    monkeypatch.chdir(ROOT)
    reader = {canonical(re.split(r"[\s<>=!~;\[]", r)[0])
              for r in install_size.read_requirements("requirements.txt")}
    dev = {canonical(re.split(r"[\s<>=!~;\[]", r)[0])
           for r in install_size.read_requirements("requirements-dev.txt")}
    assert not reader & TOOLS, reader & TOOLS
    assert TOOLS <= dev and reader <= dev  # -r requirements.txt
    assert "ddl-book-utils" in reader  # -e .


def test_make_installs_requirements_dev_txt_and_remakes_it_when_a_file_changes():
    makefile = (ROOT / "Makefile").read_text()
    stamp = re.search(r"^\$\(STAMP\):(.*)\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert set(stamp.group(1).split()) >= {"requirements.txt", "requirements-dev.txt",
                                           "constraints.txt", "pyproject.toml"}
    assert "-c constraints.txt -r requirements-dev.txt" in stamp.group(2)
    grep = re.search(r"grep '\^playwright' (\S+)\)", makefile).group(1)
    assert re.search(r"^playwright\b", (ROOT / grep).read_text(), flags=re.M), grep


def test_the_results_file_measured_the_requirements_as_they_are_now(monkeypatch):
    assert RESULT.exists(), "python -m utils.install_size --out " + str(RESULT)
    recorded = json.loads(RESULT.read_text())
    monkeypatch.chdir(ROOT)
    now = {name: install_size.read_requirements(name)
           for name in recorded["requirements"]}
    assert set(now) == {"requirements.txt", "requirements-dev.txt"}
    assert recorded["requirements"] == now, (
        f"the requirements changed since {RESULT.name} was written: run "
        f"`{recorded['command']}` again")
