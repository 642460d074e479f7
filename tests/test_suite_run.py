"""utils.suite_run: the phases of a fresh-clone run of `make test`, read from its
timestamped log (a small recorded one below), and the CPU meter around a command."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from utils import results, suite_run
from utils.suite_run import phases, short_name, summary_counts, timed_lines

# A run of `bash .ci/run` as --log writes it, cut short: set-up, then make starting the
# two lanes, then each lane's output in one piece when it ended (--output-sync)
LOG = """\
    0.40 Get:1 http://deb.debian.org/debian bookworm InRelease [151 kB]
   31.80 Setting up chromium (130.0.6723.116-1~deb12u1) ...
   32.10 .venv/bin/python tests/browser/find_browser.py --install
   33.00 found Chromium: /usr/bin/chromium
   33.10 test -x .venv/bin/python || /usr/bin/python3.11 -m venv .venv
   36.50 .venv/bin/python -m pip install --quiet -c constraints.txt -r requirements.txt
   98.00 touch .venv/.installed
   98.05 make test: 2 cores, 2 lanes of tests side by side with 1 test process(es) each
   98.11 make --no-print-directory -j2 --output-sync=target JOBS=1 test-lane-fork \
test-lane-portable
 1420.41 .venv/bin/python -m pytest tests -q --ignore=tests/browser  \
--ignore=tests/test_slurm_recipe.py --ignore=tests/test_gpu_check.py
 1420.41 ........................................................................ [  7%]
 1420.41 ........................................................................ [100%]
 1420.41 =============================== warnings summary ===============================
 1420.41 tests/test_workers.py::test_workers_start
 1420.41   DeprecationWarning: an old way
 1420.42 996 passed, 31 warnings in 885.12s (0:14:45)
 1420.42 .venv/bin/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with \
sanitize.cfg -q -p no:cacheprovider  notebooks --ignore=notebooks/07_seeding.ipynb \
--ignore=notebooks/09_distributed_evaluation.ipynb
 1420.42 ........................................................... [100%]
 1420.43 263 passed in 431.40s (0:07:11)
 1514.02 PYTHONPATH=/tmp/suite_run_x/ddl-book/tests/start_method \
BOOK_START_METHOD=forkserver .venv/bin/python -m pytest --nbval --nbval-current-env \
--nbval-sanitize-with sanitize.cfg -q -p no:cacheprovider  notebooks/00_the_picture.ipynb \
notebooks/03_set_epoch.ipynb notebooks/16_streams_of_shards.ipynb tests/test_start_method.py
 1514.02 ........................................................... [100%]
 1514.03 268 passed in 440.20s (0:07:20)
 1514.03 PYTHONPATH=/tmp/suite_run_x/ddl-book/tests/start_method BOOK_START_METHOD=spawn \
.venv/bin/python -m pytest --nbval -q -p no:cacheprovider  notebooks/06_workers.ipynb \
tests/test_start_method.py
 1514.04 20 passed in 72.30s (0:01:12)
 1514.04 .venv/bin/python -m pytest --nbval -q -p no:cacheprovider  \
notebooks/07_seeding.ipynb notebooks/09_distributed_evaluation.ipynb
 1514.05 181 passed in 519.00s (0:08:39)
 1514.05 .venv/bin/python -m pytest tests/test_slurm_recipe.py tests/test_gpu_check.py -q
 1514.05 ..................................
 1514.05   1 passed in 0.50s
 1514.06 34 passed, 1 skipped in 251.00s (0:04:11)
 1514.06 .venv/bin/python -m utils.source_archive _build/source/ddl-book-source.zip && \
.venv/bin/jupyter-book build . --all --path-output . -W -n --keep-going
 1514.06 build succeeded.
 1514.07 .venv/bin/python -m pytest tests/browser -q -rP
 1514.07 ==================================== PASSES ====================================
 1514.07 checked 22 pages
 1514.08 38 passed in 63.10s (0:01:03)
"""


def recorded():
    # (a backslash at the end of a line above joins it to the next, in Python's string)
    return timed_lines(LOG)


def test_a_logged_line_is_its_seconds_and_its_text():
    lines = recorded()
    assert lines[0] == (0.4, "Get:1 http://deb.debian.org/debian bookworm InRelease "
                             "[151 kB]")
    assert lines[-1] == (1514.08, "38 passed in 63.10s (0:01:03)")
    assert timed_lines("12.5 \n  3 x y") == [(12.5, ""), (3.0, "x y")]


def test_pytest_summaries_with_and_without_their_rulers():
    assert summary_counts("996 passed, 31 warnings in 885.12s (0:14:45)") == (
        {"passed": 996, "failed": 0, "warnings": 31}, 885.12)
    assert summary_counts("==== 1 failed, 2 passed, 1 error in 2.89s ====") == (
        {"passed": 2, "failed": 1, "errors": 1}, 2.89)
    assert summary_counts("\x1b[32m5 passed\x1b[0m in 1.00s") == (
        {"passed": 5, "failed": 0}, 1.0)
    assert summary_counts("no tests ran in 0.01s") == ({"passed": 0, "failed": 0}, 0.01)
    for other in ("996 passed", "the run passed in 3 s", "build succeeded."):
        assert summary_counts(other) is None, other


def test_the_phases_of_a_recorded_run():
    found = phases(recorded())
    assert found["setup_s"] == 98.1  # the line before the first pytest: make's lanes
    lane1, lane2 = found["lanes"]
    assert (lane1["ended_s"], lane1["wall_s"]) == (1420.4, 1322.3)
    assert (lane2["ended_s"], lane2["wall_s"]) == (1514.1, 1416.0)
    assert lane1["pytest_s"] == 1316.5 and lane1["other_s"] == 5.8
    assert [(r["name"], r["passed"], r["failed"], r["seconds"]) for r in lane1["runs"]] == [
        ("tests/ (3 ignored)", 996, 0, 885.12),
        ("nbval notebooks/ (2 ignored)", 263, 0, 431.4)]
    assert [(r["name"], r["passed"], r["seconds"]) for r in lane2["runs"]] == [
        ("forkserver: nbval 3 chapters, test_start_method", 268, 440.2),
        ("spawn: nbval 1 chapter, test_start_method", 20, 72.3),
        ("nbval 2 chapters", 181, 519.0),
        # the last summary before the next command, not one a test printed
        ("test_slurm_recipe, test_gpu_check", 34, 251.0),
        ("tests/browser/", 38, 63.1)]
    assert lane2["runs"][3]["counts"] == {"passed": 34, "failed": 0, "skipped": 1}
    assert lane2["runs"][0]["command"].startswith("PYTHONPATH=")
    assert found["counts"] == {"passed": 1800, "failed": 0, "warnings": 31,
                               "skipped": 1}
    assert found["without_summary"] == []


def test_a_failed_run_and_one_cut_short_are_reported():
    log = LOG.replace("263 passed in", "2 failed, 261 passed in")
    log = log.replace(" 1514.08 38 passed in 63.10s (0:01:03)\n", "")
    found = phases(timed_lines(log))
    assert found["lanes"][0]["counts"]["failed"] == 2
    assert found["counts"]["failed"] == 2 and found["counts"]["passed"] == 1800 - 2 - 38
    assert found["without_summary"] == ["tests/browser/"]
    assert found["lanes"][1]["runs"][-1]["summary"] is None


def test_a_run_that_never_reached_pytest_is_all_set_up():
    lines = recorded()[:5]
    assert phases(lines) == {"setup_s": 33.1, "lanes": [],
                             "counts": {"passed": 0, "failed": 0},
                             "without_summary": []}
    assert phases([])["setup_s"] == 0.0


def test_lanes_without_output_sync_still_give_each_run():
    """Without --output-sync (macOS's make 3.81) each command's lines come as it runs:
    the set-up ends at the first pytest, and each run is found, if not its lane."""
    lines = [(1.0, "make --no-print-directory -j2 JOBS=1 test-lane-fork"),
             (1.1, ".venv/bin/python -m pytest tests -q"),
             (500.0, "900 passed in 498.70s (0:08:18)")]
    found = phases(lines)
    assert found["setup_s"] == 1.0
    assert [r["seconds"] for lane in found["lanes"] for r in lane["runs"]] == [498.7]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_pytest_command_of_make_tests_lanes_is_found_and_named_apart():
    root = results.ROOT
    plan = subprocess.run(["make", "-n", "--no-print-directory", "JOBS=1",
                           "test-lane-fork", "test-lane-portable"], cwd=root,
                          capture_output=True, text=True, check=True).stdout
    lines = plan.splitlines()
    found = [line for line in lines if suite_run.PYTEST.match(line)]
    assert found == [line for line in lines if " -m pytest " in line + " "]
    names = [short_name(line) for line in found]
    assert len(names) >= 5 and len(set(names)) == len(names), names


def test_the_results_file_holds_what_every_results_file_must(tmp_path):
    report = suite_run._report(0, 1514.5, {"cpu_s": 2671.0, "user_s": 2300.0,
                                           "system_s": 371.0, "method": "m",
                                           "left_running": 3}, recorded(), tail=4)
    assert report["totals"]["cores_busy"] == 1.76 and report["green"]
    assert report["log_tail"][-1] == "38 passed in 63.10s (0:01:03)"
    out = tmp_path / "test_suite_cpu.json"
    results.write(str(out), {**report, "command": "python -m utils.suite_run --out x"},
                  suite_run.SOURCES)
    written = json.loads(out.read_text())
    assert written["sources"] and written["date"] and written["command"]
    assert results.stale(str(out)) == []


def test_from_log_prints_the_phases_and_runs_nothing(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    assert suite_run.main(["--from-log", str(log)]) == 0
    shown = capsys.readouterr().out
    assert "set-up: 98 s" in shown and "tests/ (3 ignored): 996 passed" in shown


def test_the_meter_counts_a_command_and_what_it_left_running():
    meter = suite_run.CpuMeter()
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    # the busy child, and a sleep its shell leaves behind
    proc = meter.popen(["sh", "-c", f'sleep 60 & "{sys.executable}" -c "$0"', busy],
                       start_new_session=True)
    assert proc.wait() == 0
    cpu = meter.stop()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the sleep, where no cgroup ended it
    except ProcessLookupError:
        pass
    assert cpu["cpu_s"] >= 0.2 and cpu["cpu_s"] >= cpu["user_s"] >= 0
    if cpu["method"].startswith("cgroup"):
        assert cpu["left_running"] == 1 and not os.path.exists(meter.group)
    else:
        assert cpu["method"].startswith("getrusage")


def test_run_suite_times_each_line_and_returns_the_exit_code(tmp_path):
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text(
        'echo "CI=$CI"\nprintf "10%%\\r100%%\\n"\nprintf "\\033[32m3 passed\\033[0m in 0.10s\\n"'
        "\nexit 3\n")
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        code, wall, cpu, lines = suite_run.run_suite(str(tmp_path), f)
    assert code == 3 and wall >= lines[-1][0] >= lines[0][0] >= 0
    assert [text for _, text in lines] == ["CI=true", "100%", "3 passed in 0.10s"]
    assert timed_lines(log.read_text()) == [(round(t, 2), text) for t, text in lines]
    assert cpu["cpu_s"] >= 0


def test_the_command_runs_a_fresh_clone_of_head_and_writes_the_file(tmp_path, monkeypatch):
    """The whole command on a stand-in repository whose .ci/run prints a short run."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "run").write_text(
        'echo "set-up in $(pwd)"\necho "make --output-sync=target test-lane-fork"\n'
        'echo ".venv/bin/python -m pytest tests -q"\necho "7 passed in 1.50s"\nexit 1\n')
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "stand-in"], check=True)
    (repo / ".ci" / "run").write_text("exit 0\n")  # not committed: not run
    monkeypatch.setattr(suite_run, "ROOT", str(repo))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the clone goes
    # utils.bench.environment imports torch: the machine's own figures suffice here
    monkeypatch.setattr(suite_run, "_environment", lambda: {"cpu_count": os.cpu_count()})
    out, log = tmp_path / "suite.json", tmp_path / "run.log"
    assert suite_run.main(["--out", str(out), "--tail", "2", "--log", str(log)]) == 1
    written = json.loads(out.read_text())
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True)
    assert written["commit"] == head.stdout.strip()
    assert written["uncommitted_changes_not_run"] == 1
    assert written["exit_code"] == 1 and not written["green"]
    assert written["phases"]["lanes"][0]["runs"][0]["passed"] == 7
    assert written["log_tail"] == [".venv/bin/python -m pytest tests -q",
                                   "7 passed in 1.50s"]
    assert written["environment"]["cpu_count"] and written["environment"]["memory_gib"]
    assert written["command"] == (f"python -m utils.suite_run --out {out} --tail 2 "
                                  f"--log {log}")
    assert written["sources"] and written["date"]
    ran_in = timed_lines(log.read_text())[0][1]  # the whole log, from --log
    assert ran_in.startswith(f"set-up in {scratch}") and ran_in.endswith("/ddl-book")
    assert list(scratch.iterdir()) == []  # the clone is gone
    # --commit: an earlier commit, as it was (its .ci/run, not HEAD's), for a "before"
    subprocess.run(git + ["commit", "-q", "-am", "after"], check=True)
    assert suite_run.main(["--out", str(out), "--commit", "HEAD~1"]) == 1
    before = json.loads(out.read_text())
    assert before["commit"] == head.stdout.strip() and before["exit_code"] == 1
    assert before["uncommitted_changes_not_run"] == 0
    # --before: the earlier run's figures and the ratios, in the new file
    shutil.copy(out, tmp_path / "before.json")
    assert suite_run.main(["--out", str(out), "--before", str(tmp_path / "before.json")]) == 0
    after = json.loads(out.read_text())
    assert after["before"]["commit"] == before["commit"] != after["commit"]
    assert after["before"]["cpu_s"] == before["totals"]["cpu_s"]
    assert after["before"]["cpu_ratio"] == (round(after["totals"]["cpu_s"] / before["totals"]["cpu_s"], 3)
                                            if before["totals"]["cpu_s"] else None)
    assert after["before"]["same_environment"]
