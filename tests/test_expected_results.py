"""utils.expected_results: the table of the two training scripts' speed from the newest --quick results file
that timed them, or the sentence that they have not been measured on a GPU yet (as today: the committed file
predates the scripts_speed check)."""

import json
import os
import re

from utils import expected_results
from utils.expected_results import NOT_MEASURED


def timing(script, world, seconds, rate, accuracy=None):
    return {"script": script, "world_size": world, "seconds_per_epoch": seconds, "images_per_s": rate,
            "test_accuracy": accuracy}


def report(date, speed=None, commit="abc1234", gpu="NVIDIA H200"):
    checks = {"capstone": {"passed": True}}
    if speed is not None:
        checks["scripts_speed"] = {"model": "resnet18", "train_images": 50000, "epochs": 2, "images_per_gpu": 128,
                                   "timings": speed, "passed": True}
    return {"date": date, "commit": commit, "environment": {"gpus": [gpu] * 2}, "checks": checks}


def write(folder, name, content):
    (folder / name).write_text(json.dumps(content))


SPEED = [timing("examples/train_ddp.py", 1, 8.34, 5995.2, 0.9512), timing("utils.train_cifar10", 1, 4.61, 10846.0),
         timing("examples/train_ddp.py", 2, 4.4, 11360.0), timing("utils.train_cifar10", 2, None, None)]


def test_without_a_file_that_timed_the_scripts_it_says_they_were_not_measured(tmp_path):
    assert expected_results.expected_results(str(tmp_path)) == NOT_MEASURED
    write(tmp_path, "gpu_check_quick_nvidia_h100.json", report("2026-11-26T23:05:33+00:00"))
    assert expected_results.expected_results(str(tmp_path)) == NOT_MEASURED
    assert NOT_MEASURED.startswith("Not measured on a GPU yet")
    # the committed results: today none of them has the check
    assert expected_results.expected_results() == NOT_MEASURED


def test_the_table_of_the_newest_file_that_timed_them(tmp_path):
    write(tmp_path, "gpu_check_quick_nvidia_h200.json", report("2026-12-01T10:00:00+00:00", SPEED))
    write(tmp_path, "gpu_check_quick_nvidia_a100.json",  # older: not shown
          report("2026-11-30T10:00:00+00:00", SPEED[:1], commit="0000000", gpu="NVIDIA A100"))
    write(tmp_path, "gpu_check_quick_nvidia_h100.json", report("2026-12-02T10:00:00+00:00"))  # newer, no check
    write(tmp_path, "gpu_check_nvidia_h200.json", report("2026-12-03T10:00:00+00:00", SPEED[:1]))  # not --quick
    lines = expected_results.expected_results(str(tmp_path)).splitlines()
    assert lines[0] == ("| script | GPUs | seconds per epoch (50,000 images) | images/s | test accuracy | GPU | "
                        "date | commit |")
    assert lines[2:6] == [
        "| `examples/train_ddp.py` | 1 | 8.3 | 5,995 | 0.951 | NVIDIA H200 | 2026-12-01 | abc1234 |",
        "| `utils.train_cifar10` | 1 | 4.6 | 10,846 |  | NVIDIA H200 | 2026-12-01 | abc1234 |",
        "| `examples/train_ddp.py` | 2 | 4.4 | 11,360 |  | NVIDIA H200 | 2026-12-01 | abc1234 |",
        "| `utils.train_cifar10` | 2 | did not finish |  |  | NVIDIA H200 | 2026-12-01 | abc1234 |"]
    assert lines[-1] == ("Epoch 2 of 2, resnet18, 128 images per GPU, synthetic 32x32 images (the generated "
                         "stand-in: its accuracy says the run learned, not what CIFAR-10 would score); from "
                         "`book/results/gpu_check_quick_nvidia_h200.json`.")


def test_a_run_without_a_recorded_commit_says_so(tmp_path, capsys, monkeypatch):
    skipped = {**timing("utils.train_cifar10", 8, None, None), "skipped": "the check's 150 s were spent"}
    write(tmp_path, "gpu_check_quick_nvidia_h200.json", report("2026-12-01T10:00:00+00:00", [skipped], commit=None))
    table = expected_results.expected_results(str(tmp_path))
    assert "| `utils.train_cifar10` | 8 | skipped (time budget) |  |  | NVIDIA H200 | 2026-12-01 | not recorded |" in table
    monkeypatch.setattr(expected_results, "RESULTS", str(tmp_path))
    assert expected_results.main() == 0 and capsys.readouterr().out == table + "\n"
    # a committed file whose run did not record its commit: the commit of the file, marked
    committed = expected_results.os.path.join(expected_results.ROOT, "book", "results",
                                              "gpu_check_quick_nvidia_h100_80gb_hbm3.json")
    assert re.fullmatch(r"[0-9a-f]{7,40}\*", expected_results._commit(committed, {}))


def test_how_to_run_shows_what_the_results_files_hold():
    """The page quotes `python -m utils.expected_results` as it prints today: a GPU run
    that adds scripts_speed must be followed by the page (paste the new table)."""
    page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "book", "how_to_run.md")
    with open(page) as f:
        assert expected_results.expected_results() in f.read()
