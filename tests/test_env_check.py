"""`python -m utils.env_check`: each diagnosis from the facts that make it, a real run
here with every package but torch, torchvision and numpy hidden (2 gloo ranks with
--cpu-ok; "no NVIDIA driver" without it on this CUDA build without a driver), the
start-up hang's timeout, and gpu_check's one-line stop when a package it needs is
missing."""

import importlib.util
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from utils import env_check
from utils.env_check import Facts, diagnose, hides_all, torchvision_mismatch, verdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
HIDDEN = ["cloudpickle", "psutil", "tqdm", "matplotlib", "ipywidgets", "hypothesis",
          "pytest", "nbval", "webdataset", "datasets", "aiohttp", "torchdata", "py_spy",
          "playwright", "IPython"]
BLOCKER = f"""import sys

# None in sys.modules: `import name` raises ModuleNotFoundError, and
# importlib.util.find_spec(name) is None, as for a package that is not installed
for name in {sorted(HIDDEN)!r}:
    sys.modules[name] = None
"""
SMI = dict(cuda="12.4", smi_gpus=8, driver_library=True)  # a GPU server's driver
TOO_OLD = ("The NVIDIA driver on your system is too old (found version 11040). Please "
           "update your GPU driver by downloading and installing a new version")
NO_DRIVER = ("Found no NVIDIA driver on your system. Please check that you have an "
             "NVIDIA GPU and installed a driver from "
             "http://www.nvidia.com/Download/index.aspx")
CASES = {  # name: (facts, the diagnosis's name starts so, exit code without --cpu-ok)
    "usable": (Facts(torch_gpus=8, **SMI), "GPUs usable", 0),
    "cpu_only": (Facts(), "CPU-only build of torch", 1),
    "cpu_only_with_smi": (Facts(smi_gpus=8, driver_library=True),
                          "CPU-only build of torch", 1),
    "visible_empty": (Facts(visible="", **SMI), "CUDA_VISIBLE_DEVICES hides", 1),
    "visible_minus_1": (Facts(visible="-1", **SMI), "CUDA_VISIBLE_DEVICES hides", 1),
    "visible_none": (Facts(visible="none", **SMI), "CUDA_VISIBLE_DEVICES hides", 1),
    "visible_past_end": (Facts(visible="8,9", **SMI), "CUDA_VISIBLE_DEVICES hides", 1),
    "visible_bad_uuid": (Facts(visible="GPU-0000", **SMI), "CUDA_VISIBLE_DEVICES hides",
                         1),
    "no_driver": (Facts(cuda="13.0", messages=[NO_DRIVER]), "no NVIDIA driver", 1),
    "no_driver_found": (Facts(cuda="13.0"), "no NVIDIA driver", 1),
    # no driver, and an empty CUDA_VISIBLE_DEVICES too: the driver is the cause
    "no_driver_visible_empty": (Facts(cuda="13.0", visible="", messages=[NO_DRIVER]),
                                "no NVIDIA driver", 1),
    "driver_not_loaded": (Facts(cuda="12.4", driver_library=True,
                                smi_error="NVIDIA-SMI has failed because it couldn't "
                                          "communicate with the NVIDIA driver."),
                          "no NVIDIA driver", 1),
    "driver_too_old": (Facts(messages=[TOO_OLD], **SMI),
                       "driver too old for this torch's CUDA", 1),
    "driver_insufficient": (Facts(messages=["CUDA driver version is insufficient for "
                                            "CUDA runtime version"], **SMI),
                            "driver too old for this torch's CUDA", 1),
    "smi_but_not_torch": (Facts(messages=["CUDA unknown error"], **SMI),
                          "nvidia-smi lists 8 GPUs but torch sees 0", 1),
    "no_gpu_at_all": (Facts(cuda="12.4", smi_gpus=0, driver_library=True),
                      "no GPU: nvidia-smi lists 0 GPUs", 1),
    "rocm": (Facts(hip="6.2"), "ROCm build of torch sees no GPU", 1),
}


@pytest.mark.parametrize("case", CASES)
def test_each_diagnosis_from_its_facts(case):
    facts, name, code = CASES[case]
    diagnosis = diagnose(facts)
    assert diagnosis.name.startswith(name)
    assert diagnosis.usable == (code == 0)
    exit_code, line = verdict(facts, diagnosis, cpu_ok=False)
    assert exit_code == code and len(line) <= env_check.WIDTH
    assert line.startswith("OK" if code == 0 else "FAIL") and diagnosis.fix in line
    assert verdict(facts, diagnosis, cpu_ok=True)[0] == 0  # a CPU run is fine


def test_the_fixes_say_what_to_do():
    fixes = {case: diagnose(facts).fix for case, (facts, _, _) in CASES.items()}
    assert "pytorch.org" in fixes["cpu_only"] and "CUDA build" in fixes["cpu_only"]
    assert "unset CUDA_VISIBLE_DEVICES" in fixes["visible_empty"]
    assert "install the NVIDIA driver" in fixes["no_driver"]
    assert "update the NVIDIA driver" in fixes["driver_too_old"]
    assert "--nproc-per-node=8" in fixes["usable"]


def test_an_empty_cuda_visible_devices_hides_the_gpus():
    diagnosis = diagnose(Facts(visible="", **SMI))
    assert diagnosis.name == "CUDA_VISIBLE_DEVICES hides the GPUs"
    assert "CUDA_VISIBLE_DEVICES=''" in diagnosis.why
    assert not hides_all(None, 8) and not hides_all("0,1", 8) and not hides_all("7", 8)
    assert hides_all("", 8) and hides_all("-1", 8) and hides_all("8", 8)
    assert not hides_all("GPU-0a1b", 8)  # a UUID: judged by what torch sees


def test_fewer_gpus_than_nvidia_smi_lists_are_still_usable_and_noted():
    diagnosis = diagnose(Facts(torch_gpus=2, visible="0,1", **SMI))
    assert diagnosis.usable and "of the 8 nvidia-smi lists" in diagnosis.why


def test_a_broken_torchvision_fails_even_a_cpu_run():
    facts = Facts(torch_gpus=8, library_problem="install the torchvision for torch 2.4",
                  **SMI)
    assert verdict(facts, diagnose(facts), cpu_ok=True) == (
        1, "FAIL: install the torchvision for torch 2.4")


def test_torchvision_must_match_torch():
    assert torchvision_mismatch("2.14.1+cu130", "0.29.1+cu130") == ""
    assert torchvision_mismatch("2.4.1", "0.19.1") == ""
    assert "torchvision 0.19.x" in torchvision_mismatch("2.4.1", "0.20.0")
    assert "+cu121" in torchvision_mismatch("2.4.1+cu121", "0.19.1+cpu")


def sleep_a_minute(rank, *args):
    time.sleep(60)


def fail_on_rank_1(rank, *args):
    if rank == 1:
        raise ValueError("rank 1 broke")


def test_a_group_that_hangs_is_killed_at_the_timeout():
    start = time.monotonic()
    assert env_check.run_ranks(sleep_a_minute, "gloo", 2, timeout=1.0) == "hang"
    assert time.monotonic() - start < 20 and multiprocessing.active_children() == []
    assert "rank 1 broke" in env_check.run_ranks(fail_on_rank_1, "gloo", 2, 20.0)


def test_a_hang_is_reported_with_what_to_try(monkeypatch, capsys):
    monkeypatch.setattr(env_check, "run_ranks", lambda *args: "hang")
    args = env_check.parser().parse_args(["--timeout", "60"])
    facts = Facts(torch_gpus=8, **SMI)
    problem = env_check.all_reduce(diagnose(facts), facts, args)
    said = capsys.readouterr().out
    assert "nccl on 8 processes" in said and "start-up hang" in said
    for hint in ["NCCL_DEBUG=INFO", "NCCL_P2P_DISABLE=1", "NCCL_SOCKET_IFNAME"]:
        assert hint in said.replace("\n" + " " * 13, " ")
    assert verdict(facts, diagnose(facts), False, problem)[0] == 1
    assert all(len(line) <= env_check.WIDTH for line in said.splitlines())


def no_driver_here() -> bool:
    """A CUDA build of torch on a machine without an NVIDIA driver (as this one is)."""
    torch_dir = pathlib.Path(importlib.util.find_spec("torch").origin).parent
    cuda_build = (torch_dir / "lib" / "libtorch_cuda.so").exists()
    return cuda_build and shutil.which("nvidia-smi") is None and not (
        env_check.probe_driver_library())


# one interpreter for both (each start imports torch: seconds on a small machine)
PLAIN_THEN_GPU_CHECK = """import sys
from utils import env_check
print("exit code", env_check.main([]), flush=True)
from utils import gpu_check  # its imports need cloudpickle and psutil
gpu_check.main(["--quick"])
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (exit code, stdout, stderr)}: the commands, run at once, with the book's
    packages hidden."""
    blocker = tmp_path_factory.mktemp("blocker")
    (blocker / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    commands = {"cpu_ok": ["-m", "utils.env_check", "--cpu-ok"],
                "plain_then_gpu_check": ["-c", PLAIN_THEN_GPU_CHECK],
                "blocked": ["-c", "import cloudpickle"]}
    started = {name: subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env,
                                      text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
               for name, command in commands.items()}
    return {name: (p.wait(timeout=300), *p.communicate())
            for name, p in started.items()}


def test_the_blocker_hides_the_books_packages(runs):
    code, _, err = runs["blocked"]
    assert code == 1 and "ModuleNotFoundError" in err and "cloudpickle" in err


def test_a_cpu_run_needs_only_torch_torchvision_and_numpy(runs):
    code, out, err = runs["cpu_ok"]
    assert code == 0, out + err
    lines = out.splitlines()
    assert "Traceback" not in err and all(len(line) <= 88 for line in lines)
    assert lines[-1].startswith("OK for a CPU run (--cpu-ok)")
    assert any(line.startswith("torch build ") for line in lines)
    assert "rank 0 of 2: cpu (gloo)" in lines and "rank 1 of 2: cpu (gloo)" in lines
    assert "every rank got the right sum" in out


@pytest.mark.skipif(not no_driver_here(), reason="needs a CUDA torch and no driver")
def test_a_cuda_build_without_a_driver_says_no_driver(runs):
    _, out, err = runs["plain_then_gpu_check"]
    out = out.partition("exit code ")
    assert out[2].strip() == "1", out + (err,)
    assert "diagnosis    no NVIDIA driver" in out[0] and "CPU-only" not in out[0]
    assert "driver" in out[0].splitlines()[-1] and "rank 0" not in out[0]


def test_gpu_check_names_the_missing_packages_in_one_line(runs):
    code, _, err = runs["plain_then_gpu_check"]
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        f"gpu-check: error: missing cloudpickle, psutil; install them with: "
        f"{os.path.basename(sys.executable)} -m pip install cloudpickle psutil"]
