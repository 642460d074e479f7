"""utils.failures: the five failures of "How to run"'s troubleshooting section happen
as book/results/failures_cpu.json says, and the page shows that file's lines
(book/_ext/results_text.py), so it cannot drift from what torchrun prints.

The cheap scenarios run again here (a busy port, without the --rdzv-endpoint variant's
wait; a rank's error; Ctrl-C during utils.train_cifar10: about 50 s of CPU in all) and
their sanitized lines are compared with the file's; the file's other runs (SIGTERM to
torchrun on the resumed run, Ctrl-C during examples/train_ddp.py) are checked as
recorded: tests/test_results.py says when the code they ran has changed since."""

import json
import os
import re
import sys

import pytest

from utils import failures
from utils.data import write_synthetic_cifar10
from utils.results import RESULTS, ROOT

sys.path.insert(0, os.path.join(ROOT, "book", "_ext"))
from results_text import results_text  # noqa: E402  (the book's Sphinx extension)

# torchrun with 2 ranks: run beside tests that do not start ranks (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("ranks")

RECORDED = os.path.join(RESULTS, "failures_cpu.json")
# a line number of examples/train_ddp.py or torch in the excerpt moved, say
AGAIN = "the page would show other lines: run `python -m utils.failures` again"


@pytest.fixture(scope="module")
def recorded():
    with open(RECORDED) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """An empty folder with the stand-in in ``data``, as ``run_all`` makes it."""
    work = os.path.realpath(tmp_path_factory.mktemp("failures"))
    write_synthetic_cifar10(os.path.join(work, "data"), n_train=512, n_test=256)
    return work


def kept(output: str) -> list[str]:
    """An excerpt's lines without its gaps (``...``, where other lines, such as a
    warning of one run, were left out), the step a signal stopped at masked."""
    return [re.sub(r"step \d+", "step N", line) for line in output.splitlines()
            if line != "..."]


def test_a_busy_port_fails_at_once_with_eaddrinuse(work, recorded):
    found = failures.port_in_use(work, rdzv_endpoint=False)
    assert found["exit_code"] == 1 and not found["timed_out"], found
    assert found["output"].endswith("name: EADDRINUSE, message: address already in use")
    assert "static_tcp_rendezvous.py" in found["output"]
    assert not found["left_behind"]
    page = recorded["port_in_use"]
    assert found["command"] == page["command"]
    assert kept(found["output"]) == kept(page["output"]), AGAIN
    if found["holder"] is not None:  # where ss is installed
        assert found["holder"] == page["holder"]


def test_with_rdzv_endpoint_a_busy_port_hangs_and_only_kill_ends_it(recorded):
    """Recorded, not run again here (its point is a wait): torchrun connects to the
    holder as a client of its store and waits, silent after its banner."""
    c10d = recorded["port_in_use"]["rdzv_endpoint"]
    assert c10d["ended_by"] == "kill" and c10d["exit_code"] == -15
    assert c10d["shell_exit_code"] == 143 and not c10d["left_behind"]
    assert [name for name, _ in c10d["signals"]] == ["ctrl_c", "kill"]
    assert "OMP_NUM_THREADS" in c10d["output"] and "Error" not in c10d["output"]


def test_a_ranks_error_heads_torchruns_report(work, recorded):
    found = failures.rank_error(work)
    error = "NotADirectoryError: [Errno 20] Not a directory: '<work>/file/run'"
    assert found["exit_code"] == 1 and not found["left_behind"], found
    assert found["root_cause"] == {"rank": 0, "exitcode": 1, "error_file": True,
                                   "error": error}
    out = found["output"]
    # the rank's own traceback (through @record) is printed above torchrun's report
    assert out.index(f"[rank0]: {error}") < out.index("Root Cause") < out.rindex(error)
    # from the root cause on (whether torchrun lists the rank it stopped above it varies)
    assert (kept(out.split("Root Cause", 1)[1]) ==
            kept(recorded["rank_error"]["output"].split("Root Cause", 1)[1])), AGAIN


def test_ctrl_c_stops_every_rank_at_one_step_with_75(work, recorded):
    found = failures.signalled(work, failures.train_cifar10(work, "cifar"),
                               failures.ctrl_c, "cifar")
    # each rank's exit code, where its wrapper's line was caught before torchrun ended
    # (best effort: torchrun may end first); the script's own line says 75 for all
    assert set(found["rank_exit_codes"].values()) <= {75}, found
    # torchrun itself exits 1, with its SignalException's traceback
    assert found["exit_code"] == 1 and found["torchrun_traceback"]
    assert [name for name, _ in found["signals"]] == ["ctrl_c"]
    assert "SIGINT: every rank stopped after step" in found["output"]
    assert found["stopped_after_step"] >= 2 and not found["left_behind"]
    assert kept(found["output"]) == kept(recorded["ctrl_c"]["output"]), AGAIN


def test_the_recorded_sigterm_and_train_ddp_runs(recorded):
    resumed, ddp = recorded["sigterm_resume"], recorded["ctrl_c_train_ddp"]
    assert set(resumed["rank_exit_codes"].values()) <= {75}
    assert resumed["exit_code"] == 1 and resumed["torchrun_traceback"]
    stopped = recorded["ctrl_c"]["stopped_after_step"]
    assert f"epoch 1, step {stopped} of the epoch ({stopped} in all)" in resumed["output"]
    assert resumed["stopped_after_step"] > stopped
    assert "SIGTERM: every rank stopped after step" in resumed["output"]
    # no handler: a KeyboardInterrupt in each rank, and no checkpoint of the stop
    assert all(code != 0 for code in ddp["rank_exit_codes"].values())
    assert len(ddp["rank_exit_codes"]) <= 2 and ddp["stopped_after_step"] is None
    for rank in "01":
        assert f"[rank{rank}]: KeyboardInterrupt" in ddp["output"]
    assert not any(run["left_behind"] for run in (resumed, ddp))


def test_the_recorded_killed_rank_and_no_network_runs(recorded):
    """Recorded, not run again here (each is a torchrun of its own; the second needs a
    machine without a network): what How to run's entries quote."""
    killed = recorded["rank_killed"]
    assert [name for name, _ in killed["signals"]] == ["kill_a_rank"]
    assert killed["exit_code"] == 1 and not killed["left_behind"]
    assert killed["root_cause"]["exitcode"] == -9
    assert re.search(r"failed \(exitcode: -9\) local_rank: \d", killed["output"])
    assert "Signal 9 (SIGKILL) received by PID" in killed["output"]
    offline = recorded["no_network"]
    assert offline["exit_code"] == 1 and not offline["left_behind"]
    assert offline["root_cause"]["rank"] == 0
    assert "URLError: <urlopen error" in offline["root_cause"]["error"]
    assert "--download" in offline["command"]


def test_sanitize_replaces_what_varies_between_runs():
    tmp = failures.tempfile.gettempdir()
    text = (f"W1128 10:59:47.618000 17897 torch/x.py:753] Sending process 17906\n"
            f"  time      : 2026-11-28_10:57:53\n  host      : node7.example\n"
            f"  exitcode  : 1 (pid: 17264)\n  error_file: {tmp}/torchelastic_wad9y/"
            f"0e5e3bd9-ff49_tvxqc8fq/attempt_0/0/error.json\n"
            f"/w/x/file/run port: 29511, users:((\"python\",pid=18797,fd=3))\n"
            f'  File "{ROOT}/.venv/lib/python3.11/site-packages/torch/a.py"\n'
            f"  traceback : Signal 9 (SIGKILL) received by PID 7924")
    assert failures.sanitize(text, "/w/x", 29511).splitlines() == [
        "W<time> <pid> torch/x.py:753] Sending process <pid>",
        "  time      : <time>", "  host      : <host>",
        "  exitcode  : 1 (pid: <pid>)",
        "  error_file: <tmp>/torchelastic_<id>/<run>/attempt_0/0/error.json",
        '<work>/file/run port: <port>, users:(("python",pid=<pid>,fd=<fd>))',
        '  File "<site-packages>/torch/a.py"',
        "  traceback : Signal 9 (SIGKILL) received by PID <pid>"]


def test_excerpt_marks_the_lines_left_out():
    text = "a\nkeep 1\nkeep 2\nb\nc\nkeep 3\nd"
    assert failures.excerpt(text, ["^keep"]) == "...\nkeep 1\nkeep 2\n...\nkeep 3\n..."
    assert failures.excerpt("keep\nx", ["^keep"]) == "keep\n..."
    assert failures.excerpt("x", ["^keep"]) == ""
    frame = 'x\n  File "examples/a.py", line 3, in main\n    f()\ny'
    assert failures.excerpt(frame, ['File "examples/']) == (
        '...\n  File "examples/a.py", line 3, in main\n    f()\n...')


def test_the_rank_wrapper_lines_are_taken_out_of_the_output():
    run = {"output": "a\nutils.failures: rank 1 exit code -2\nb\n"
                     "utils.failures: rank 0 exit code 75\n"}
    assert failures.rank_exits(run) == {"0": 75, "1": -2}
    assert run["output"] == "a\nb\n"


def test_results_text_shows_a_value_and_names_what_is_missing(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"a": {"b": "x\ny", "n": [1, {"c": 2}]}}))
    assert results_text("r.json", "a.b", str(tmp_path)) == "x\ny"
    assert results_text("r.json", "a.n.1", str(tmp_path)) == '{\n  "c": 2\n}'
    with pytest.raises(LookupError, match=r"r.json has no 'd' in a \(its keys there: b, n\)"):
        results_text("r.json", "a.d", str(tmp_path))
    with pytest.raises(LookupError, match=r"no '5' in a.n \(a list there\)"):
        results_text("r.json", "a.n.5", str(tmp_path))
    with pytest.raises(LookupError, match="no results file s.json"):
        results_text("s.json", "a", str(tmp_path))


def missing_values(folder: str) -> list[str]:
    """``page: FILE KEYS: why`` for each ``{results-text}`` of ``folder``'s pages whose
    value is not there."""
    missing = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".md"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                found = re.findall(r"\{results-text\}\s+(\S+)\s+(\S+)", f.read())
            for results, keys in found:
                try:
                    results_text(results, keys)
                except LookupError as why:
                    missing.append(f"{name}: {results} {keys}: {why}")
    return missing


def test_every_results_text_on_the_pages_names_a_value_that_exists(tmp_path):
    assert missing_values(os.path.join(ROOT, "book")) == []
    (tmp_path / "p.md").write_text("```{results-text} failures_cpu.json ctrl_c.nothing\n```\n")
    assert missing_values(str(tmp_path)) == [
        "p.md: failures_cpu.json ctrl_c.nothing: failures_cpu.json has no 'nothing' in "
        "ctrl_c (its keys there: command, exit_code, timed_out, seconds, signals, "
        "left_behind, shell_exit_code, output, rank_exit_codes, stopped_after_step, "
        "torchrun_traceback)"]
