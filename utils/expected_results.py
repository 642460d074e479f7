"""What to expect of the book's two training scripts on a GPU: seconds per epoch and
images/s, on one GPU and on all of a machine's, as the newest
``python -m utils.gpu_check --quick`` measured them (its ``scripts_speed`` check, in
``book/results/gpu_check_quick_<gpu>.json``).

    python -m utils.expected_results     # a markdown table, or why there is none

The table has one row per script and number of GPUs: epoch 2 of 2 (the first also
starts the DataLoader workers), ResNet-18, 128 images per GPU, 50,000 synthetic
32x32 images; the GPU, the date and the commit measured (``*``: the run did not record
its commit, so the one that last changed the results file is given).
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "book", "results")
PATTERN = "gpu_check_quick_*.json"
NOT_MEASURED = ("Not measured on a GPU yet: no GPU run of `python -m utils.gpu_check "
                "--quick` has timed the two training scripts so far.")


def _date(report: dict) -> datetime.datetime:
    """The report's date (timezone-aware; the oldest possible where it has none)."""
    try:
        date = datetime.datetime.fromisoformat(report["date"])
    except (KeyError, TypeError, ValueError):
        return datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return date if date.tzinfo else date.replace(tzinfo=datetime.timezone.utc)


def newest_speed_results(folder: str = RESULTS) -> tuple[str, dict] | None:
    """``(path, report)`` of the newest results file (by the date it records) of
    ``--quick`` on a GPU in ``folder`` that has a ``scripts_speed`` check; ``None``
    where none has."""
    found = []
    for path in glob.glob(os.path.join(folder, PATTERN)):
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue
        speed = report.get("checks", {}).get("scripts_speed", {})
        if speed.get("timings") and not report.get("rehearsal"):
            found.append((_date(report), path, report))
    if not found:
        return None
    _, path, report = max(found, key=lambda item: (item[0], item[1]))
    return path, report


def _file_commit(path: str) -> str | None:
    """The commit that last changed ``path`` (``None``: not in a repository)."""
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%h", "--", path],
                              cwd=os.path.dirname(path), capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None  # (nothing: a file not committed)


def _commit(path: str, report: dict) -> str:
    """The commit measured; else the results file's, marked ``*``."""
    if report.get("commit"):
        return report["commit"]
    committed = _file_commit(path)
    return f"{committed}*" if committed else "not recorded"


def _figures(timing: dict) -> tuple[str, str, str]:
    """Seconds per epoch, images/s and test accuracy as the table shows them."""
    if timing.get("images_per_s") is None:
        return ("skipped (time budget)" if timing.get("skipped")
                else "did not finish"), "", ""
    accuracy = timing.get("test_accuracy")  # not in files written before it was read
    return (f"{timing['seconds_per_epoch']:.1f}", f"{timing['images_per_s']:,.0f}",
            "" if accuracy is None else f"{accuracy:.3f}")


def expected_results(folder: str = RESULTS) -> str:
    """The newest ``scripts_speed`` figures as a markdown table ("script, GPUs,
    seconds per epoch, images/s, test accuracy, GPU, date, commit") with a line saying
    where they come from, or ``NOT_MEASURED``."""
    found = newest_speed_results(folder)
    if found is None:
        return NOT_MEASURED
    path, report = found
    speed = report["checks"]["scripts_speed"]
    gpu = (report.get("environment", {}).get("gpus") or ["?"])[0]
    date, commit = str(report.get("date", "?"))[:10], _commit(path, report)
    lines = [f"| script | GPUs | seconds per epoch ({speed['train_images']:,} images) "
             "| images/s | test accuracy | GPU | date | commit |",
             "|---|--:|--:|--:|--:|---|---|---|"]
    for timing in speed["timings"]:
        seconds, rate, accuracy = _figures(timing)
        lines.append(f"| `{timing['script']}` | {timing['world_size']} | {seconds} | "
                     f"{rate} | {accuracy} | {gpu} | {date} | {commit} |")
    lines += ["", f"Epoch {speed['epochs']} of {speed['epochs']}, "
              f"{speed['model']}, {speed['images_per_gpu']} images per GPU, synthetic "
              "32x32 images (the generated stand-in: its accuracy says the run learned,"
              " not what CIFAR-10 would score); from "
              f"`book/results/{os.path.basename(path)}`."]
    return "\n".join(lines)


def main() -> int:
    print(expected_results(RESULTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
