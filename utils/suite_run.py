"""How long the whole test suite takes from a fresh clone, as CI runs it:

    python -m utils.suite_run --out book/results/test_suite_cpu.json

clones this repository's HEAD (committed work only; ``--commit REV`` another commit,
to measure a change's "before" on the same machine) into a temporary folder, runs
``bash .ci/run`` there with ``CI=true`` (the set-up of ``.venv`` included), and writes
the wall time, the CPU seconds of every process of the run, its phases and the tail of
its log, with the commit, the machine and the versions; it exits with ``.ci/run``'s
exit code. ``--log FILE`` keeps the whole log, each line with its time; ``--from-log
FILE`` prints the phases of such a log again, without running anything.

CPU seconds, by the first method that works here (the file's ``cpu_method`` says
which): a cgroup v2 made for the run, its ``cpu.stat`` ``usage_usec``; a cgroup v1
``cpuacct`` group, its ``cpuacct.usage``; else ``resource.getrusage(RUSAGE_CHILDREN)``.
A cgroup counts every process that ran in it: the fork servers that outlive their
notebook, with the ranks and workers they forked, too. ``getrusage`` (as
``/usr/bin/time``) counts only the processes their parents waited for, and misses
those. Processes of the run still alive when ``.ci/run`` exits are counted, then ended.

Phases (``phases``, from the timestamped lines alone): the set-up lasts until the first
pytest command line, or rather the line before it: ``make test`` runs its lanes with
GNU make's ``--output-sync``, which prints each lane's output in one piece when the
lane ends, so the line before is make starting the lanes. A lane is such a burst of
lines (no gap over ``GAP`` seconds); it ended when its burst came, and it started at
the end of the set-up. In it, each pytest run is the command line make echoed and the
last pytest summary line (``996 passed, 3 warnings in 885.12s (0:14:45)``) before the
next command: its counts and the seconds pytest itself reported. Without
``--output-sync`` (macOS's make 3.81 mixes the lanes' lines) each run is still found,
with its counts and seconds, but not which lane ran it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from . import results

ROOT = results.ROOT
GAP = 2.0  # seconds without output that end one lane's burst of lines
TAIL = 60  # lines of the log kept in the results file

# a command line make echoes: VAR=value ... python -m pytest ..., or pytest ...
PYTEST = re.compile(r"^(?:\w+=\S*\s+)*(?:\S*python[\d.]*\s+-m\s+pytest|(?:\S*/)?pytest)"
                    r"(?:\s|$)")
# pytest's last line, decorated with '=' or not (-q): "1 failed, 2 passed in 2.89s"
SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+|no tests ran) in ([\d.]+)s"
                     r"(?: \([\d:]+\))?\s*=*$")
PLURAL = {"error": "errors", "warning": "warnings"}
COLOUR = re.compile(r"\x1b\[[0-9;]*m")
RUSAGE = "getrusage(RUSAGE_CHILDREN): only the processes their parents waited for"

# The figures depend on the whole commit, which the file records as "commit"; its
# sources are the code that measures and parses, so that the file is not stale with
# every commit (remake it when the README's figure should follow the code:
# python -m utils.suite_run --out book/results/test_suite_cpu.json).
SOURCES = [f"utils/suite_run.py::{name}" for name in (
    "phases", "_runs", "_bursts", "summary_counts", "short_name", "PYTEST", "SUMMARY",
    "CpuMeter", "_new_cgroup", "run_suite")]

__all__ = ["phases", "summary_counts", "short_name", "timed_lines", "CpuMeter",
           "run_suite"]


def summary_counts(line: str) -> tuple[dict, float] | None:
    """``({"passed": 996, "failed": 0, ...}, seconds)`` from pytest's summary line,
    ``None`` for any other line."""
    m = SUMMARY.match(COLOUR.sub("", line).strip())
    if not m:
        return None
    counts = {"passed": 0, "failed": 0}
    for number, word in re.findall(r"(\d+) ([a-z]+)", m.group(1)):
        counts[PLURAL.get(word, word)] = int(number)
    return counts, float(m.group(2))


def short_name(command: str) -> str:
    """What a pytest command runs, briefly: ``tests/ (3 ignored)``, ``nbval notebooks/
    (5 ignored)``, ``forkserver: nbval 9 chapters, test_start_method``."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        tokens = command.split()
    method = next((t.split("=", 1)[1] for t in tokens
                   if t.startswith("BOOK_START_METHOD=")), None)
    where = [i for i, t in enumerate(tokens) if os.path.basename(t) == "pytest"]
    after = tokens[where[0] + 1:] if where else tokens[1:]
    targets, ignored, skip = [], 0, False
    for token in after:
        if skip:  # the value of an option that takes one
            skip = False
        elif token.startswith("--ignore"):
            ignored += 1
            skip = "=" not in token
        elif token in ("-n", "--dist", "-p", "-k", "-m", "--nbval-sanitize-with"):
            skip = True
        elif not token.startswith("-"):
            targets.append(token)
    chapters = [t for t in targets if t.endswith(".ipynb")]
    plural = "s" if len(chapters) > 1 else ""
    parts = [f"{len(chapters)} chapter{plural}"] if chapters else []
    parts += [t.rstrip("/") + "/" if "." not in os.path.basename(t) else
              os.path.splitext(os.path.basename(t))[0]
              for t in targets if not t.endswith(".ipynb")]
    name = ("nbval " if "--nbval" in tokens else "") + ", ".join(parts or ["tests"])
    name += f" ({ignored} ignored)" if ignored else ""
    return f"{method}: {name}" if method else name


def timed_lines(text: str) -> list[tuple[float, str]]:
    """The lines of a log that ``--log`` wrote (``seconds text``), as pairs."""
    pairs = []
    for line in text.splitlines():
        m = re.match(r"^\s*(\d+(?:\.\d+)?) ?(.*)$", line)
        if m:
            pairs.append((float(m.group(1)), m.group(2)))
    return pairs


def _bursts(lines: list[tuple[float, str]], first: int, gap: float) -> list[range]:
    """The lines from ``first`` on, split where more than ``gap`` seconds pass."""
    bursts, start = [], first
    for i in range(first + 1, len(lines)):
        if lines[i][0] - lines[i - 1][0] > gap:
            bursts.append(range(start, i))
            start = i
    return bursts + [range(start, len(lines))] if first < len(lines) else bursts


def _runs(lines: list[tuple[float, str]], first: int) -> list[tuple[int, float, dict]]:
    """Every pytest run from line ``first`` on: its command line with the last summary
    line that follows it before the next command; as ``(index of the command line,
    seconds at which the run's last line came, run)``."""
    commands = [i for i in range(first, len(lines)) if PYTEST.match(lines[i][1])]
    runs = []
    for n, i in enumerate(commands):
        end = commands[n + 1] if n + 1 < len(commands) else len(lines)
        found = [(j, summary_counts(lines[j][1])) for j in range(i + 1, end)]
        found = [(j, s) for j, s in found if s]
        counts, seconds = found[-1][1] if found else ({"passed": 0, "failed": 0}, None)
        runs.append((i, lines[found[-1][0] if found else i][0], {
            "name": short_name(lines[i][1]), "command": lines[i][1].strip(),
            "passed": counts["passed"], "failed": counts["failed"],
            "seconds": seconds, "counts": counts,
            "summary": lines[found[-1][0]][1].strip() if found else None}))
    return runs


def _added(runs: list[dict]) -> dict:
    """The counts of ``runs`` added up (passed, failed, errors, skipped, ...)."""
    total = {"passed": 0, "failed": 0}
    for run in runs:
        for key, value in run["counts"].items():
            total[key] = total.get(key, 0) + value
    return total


def phases(lines: list[tuple[float, str]], gap: float = GAP) -> dict:
    """The set-up, the lanes and their pytest runs, from ``(seconds, line)`` pairs of a
    run of ``make test`` (see the module's docstring for how)."""
    first = next((i for i, (_, text) in enumerate(lines) if PYTEST.match(text)),
                 None)
    if first is None:  # no pytest started: all of it was set-up
        end = lines[-1][0] if lines else 0.0
        return {"setup_s": round(end, 1), "lanes": [], "counts": _added([]),
                "without_summary": []}
    setup = lines[first - 1][0] if first else lines[first][0]
    lanes, every = [], _runs(lines, first)
    for burst in _bursts(lines, first, gap):
        mine = [(came, run) for i, came, run in every if i in burst]
        if not mine:  # make's own messages after a lane, say
            continue
        runs = [run for _, run in mine]
        ended = max(lines[burst.stop - 1][0], *(came for came, _ in mine))
        pytest_s = sum(r["seconds"] or 0.0 for r in runs)
        lanes.append({"lane": len(lanes) + 1, "ended_s": round(ended, 1),
                      "wall_s": round(ended - setup, 1), "pytest_s": round(pytest_s, 1),
                      "other_s": round(ended - setup - pytest_s, 1),
                      "counts": _added(runs), "runs": runs})
    every = [run for _, _, run in every]
    return {"setup_s": round(setup, 1), "lanes": lanes, "counts": _added(every),
            "without_summary": [r["name"] for r in every if r["seconds"] is None]}


def _own_cgroup(names: str) -> str | None:
    """This process's cgroup path in the hierarchy whose controllers are ``names``
    ("" for cgroup v2, "cpuacct" for v1's)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, found, path = line.rstrip("\n").split(":", 2)
            if (names == "" and found == "") or (names and names in found.split(",")):
                return path
    return None


def _new_cgroup() -> tuple[str | None, str]:
    """A new, empty child of this process's cgroup, and the method it measures with:
    cgroup v2 first, then v1's cpuacct; ``(None, "getrusage ...")`` if neither can be
    made here (no permission, no cgroup file system, another OS)."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:4] for line in f]
    except OSError:
        mounts = []
    kinds = [("cgroup2", "", "cpu.stat", "cgroup v2: cpu.stat usage_usec"),
             ("cgroup", "cpuacct", "cpuacct.usage", "cgroup v1: cpuacct.usage")]
    for kind, names, stat, method in kinds:
        for point, fs, options in mounts:
            if fs != kind or (names and names not in options.split(",")):
                continue
            try:
                path = _own_cgroup(names)
                group = os.path.join(point + (path or "/"), f"suite_run.{os.getpid()}")
                os.mkdir(group)
            except (OSError, TypeError):
                continue
            if os.path.exists(os.path.join(group, stat)):
                return group, method
            os.rmdir(group)
    return None, RUSAGE


class CpuMeter:
    """CPU seconds of every process started through ``popen`` and of all they start,
    measured by a cgroup of their own where one can be made (``method`` says how)."""

    def __init__(self):
        self.group, self.method = _new_cgroup()
        self.before = resource.getrusage(resource.RUSAGE_CHILDREN)

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen``, the child moved into the cgroup before it runs
        anything, so that every process it starts is in it too."""
        if self.group:
            procs = os.path.join(self.group, "cgroup.procs")

            def join():  # in the child, between fork and exec
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            try:
                return subprocess.Popen(args, preexec_fn=join, **kwargs)
            except (OSError, subprocess.SubprocessError):
                self._remove()
                self.group, self.method = None, f"{RUSAGE} (the cgroup refused it)"
        return subprocess.Popen(args, **kwargs)

    def stop(self) -> dict:
        """``cpu_s``, ``user_s``, ``system_s`` and ``method``; the processes still in
        the cgroup are ended first (``left_running``), so their seconds count."""
        if not self.group:
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            user = after.ru_utime - self.before.ru_utime
            system = after.ru_stime - self.before.ru_stime
            return {"cpu_s": round(user + system, 1), "user_s": round(user, 1),
                    "system_s": round(system, 1), "method": self.method,
                    "left_running": None}
        left = self._end_leftovers()
        if self.method.startswith("cgroup v2"):
            with open(os.path.join(self.group, "cpu.stat")) as f:
                stat = dict(line.split() for line in f if line.strip())
            total, user, system = (int(stat[k]) / 1e6 for k in
                                   ("usage_usec", "user_usec", "system_usec"))
        else:
            with open(os.path.join(self.group, "cpuacct.usage")) as f:
                total = int(f.read()) / 1e9
            with open(os.path.join(self.group, "cpuacct.stat")) as f:
                ticks = dict(line.split() for line in f if line.strip())
            hz = os.sysconf("SC_CLK_TCK")
            user, system = int(ticks["user"]) / hz, int(ticks["system"]) / hz
        self._remove()
        return {"cpu_s": round(total, 1), "user_s": round(user, 1),
                "system_s": round(system, 1), "method": self.method,
                "left_running": left}

    def _pids(self) -> list[int]:
        with open(os.path.join(self.group, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]

    def _end_leftovers(self, wait: float = 10.0) -> int:
        """End the processes of the run still in the cgroup; how many there were."""
        pids = self._pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while self._pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        return len(pids)

    def _remove(self):
        for _ in range(50):
            try:
                os.rmdir(self.group)
                return
            except FileNotFoundError:
                return
            except OSError:  # a process just ended is still being removed
                time.sleep(0.1)


def _clean_env() -> dict:
    """This environment as CI's would be: ``CI=true``, without this checkout's ``.venv``
    on the PATH, ``PYTHONPATH`` or the Makefile's knobs (``CORES``, ``LANES``,
    ``JOBS``) and a parent make's flags."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CORES", "LANES", "JOBS",
            "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    venv = os.path.join(ROOT, ".venv")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not p.startswith(venv))
    env["CI"] = "true"
    return env


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60:3d}:{int(seconds) % 60:02d}"


def run_suite(clone: str, log=None) -> tuple[int, float, dict, list]:
    """Run ``bash .ci/run`` in ``clone``; its exit code, wall seconds, CPU (``CpuMeter
    .stop``) and its output lines with the seconds at which each came. Each line is
    also printed, after its time, and written to ``log`` (a text file) if given."""
    meter = CpuMeter()
    start = time.monotonic()
    proc = meter.popen(["bash", ".ci/run"], cwd=clone, env=_clean_env(),
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, start_new_session=True)
    lines = []
    try:
        for raw in proc.stdout:
            now = time.monotonic() - start
            text = raw.decode("utf-8", "replace").rstrip("\r\n").split("\r")[-1]
            text = COLOUR.sub("", text)
            lines.append((now, text))
            print(f"[{_clock(now)}] {text}", flush=True)
            if log is not None:
                log.write(f"{now:9.2f} {text}\n")
        code = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: end the run
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wall = time.monotonic() - start
        cpu = meter.stop()  # ends what is left in its cgroup
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # and in its session, without one
        except (ProcessLookupError, PermissionError):
            pass
    return code, wall, cpu, lines


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _tested_with(clone: str) -> dict:
    """The Python and torch of the clone's ``.venv``: what the tests ran with."""
    python = os.path.join(clone, ".venv", "bin", "python")
    code = "import platform, torch; print(platform.python_version(), torch.__version__)"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                             timeout=300).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(zip(("python", "torch"), out)) if len(out) == 2 else {}


def _environment() -> dict:
    """``utils.bench.environment()``, as the other results files have it (it imports
    torch: only after the run, outside it); a shorter one where torch is missing."""
    try:
        from .bench import environment
    except Exception:  # no torch, or a broken one: never lose a run's figures to it
        import platform
        return {"cpu": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(), "python": platform.python_version(),
                "platform": platform.platform()}
    return environment()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f
                       if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        return None
    return round(kib / 2**20, 1)


def _report(code, wall, cpu, lines, tail) -> dict:
    """The results of a run: totals, phases, exit code, the log's tail."""
    found = phases(lines)
    return {"exit_code": code, "green": code == 0,
            "totals": {"wall_s": round(wall, 1), "cpu_s": cpu["cpu_s"],
                       "user_s": cpu["user_s"], "system_s": cpu["system_s"],
                       "cores_busy": round(cpu["cpu_s"] / wall, 2) if wall else None,
                       **found["counts"]},
            "cpu_method": cpu["method"], "left_running": cpu["left_running"],
            "phases": found, "log_tail": [text for _, text in lines[-tail:]]}


def _print_phases(found: dict) -> None:
    print(f"set-up: {found['setup_s']:.0f} s")
    for lane in found["lanes"]:
        print(f"lane {lane['lane']}: ended at {lane['ended_s']:.0f} s, "
              f"{lane['wall_s']:.0f} s after the set-up")
        for run in lane["runs"]:
            seconds = "no summary" if run["seconds"] is None else f"{run['seconds']} s"
            print(f"  {run['name']}: {run['passed']} passed, {run['failed']} failed, "
                  f"{seconds}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="results file to write, e.g. "
                        "book/results/test_suite_cpu.json")
    parser.add_argument("--log", help="also write the whole log here, each line "
                        "after the seconds at which it came")
    parser.add_argument("--from-log", help="print the phases of a log --log wrote, "
                        "and run nothing")
    parser.add_argument("--tail", type=int, default=TAIL,
                        help=f"lines of the log kept in the file (default {TAIL})")
    parser.add_argument("--commit", default="HEAD",
                        help="the commit to clone and run (default HEAD): an earlier "
                        "one measures the 'before' of a change on the same machine")
    parser.add_argument("--before", help="a results file this command wrote for an "
                        "earlier commit on this machine (--commit): the new file "
                        "records it and the ratio of the CPU seconds")
    parser.add_argument("--keep", action="store_true",
                        help="keep the clone (in $TMPDIR) instead of removing it")
    args = parser.parse_args(argv)
    if args.from_log:
        with open(args.from_log) as f:
            _print_phases(phases(timed_lines(f.read())))
        return 0
    if not args.out:
        parser.error("--out is required to run the suite")
    return _measure(args, argv)


def _ratio(now: float, then: float) -> float | None:
    return round(now / then, 3) if then else None


def before_of(path: str, result: dict) -> dict:
    """What the results file at ``path`` (an earlier commit, run on this machine)
    says, beside ``result``: its commit, wall and CPU seconds, and the ratios."""
    with open(path) as f:
        before = json.load(f)
    then, now = before["totals"], result["totals"]
    return {"commit": before["commit"], "started": before["started"],
            "green": before["green"], "wall_s": then["wall_s"], "cpu_s": then["cpu_s"],
            "cpu_ratio": _ratio(now["cpu_s"], then["cpu_s"]),
            "wall_ratio": _ratio(now["wall_s"], then["wall_s"]),
            "same_environment": before.get("environment") == result.get("environment")}


def _measure(args, argv) -> int:
    """Clone the commit, run the suite there, write the results file; .ci/run's exit
    code."""
    commit = _git("rev-parse", args.commit)
    changed = (_git("status", "--porcelain", "--untracked-files=no").splitlines()
               if commit == _git("rev-parse", "HEAD") else [])
    folder = tempfile.mkdtemp(prefix="suite_run_")
    clone = os.path.join(folder, "ddl-book")
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-checkout",
                        _git("rev-parse", "--show-toplevel"), clone], check=True)
        subprocess.run(["git", "-C", clone, "checkout", "--quiet", "--detach", commit],
                       check=True)
        log = open(args.log, "w") if args.log else None
        try:
            code, wall, cpu, lines = run_suite(clone, log)
        finally:
            if log is not None:
                log.close()
        tested_with = _tested_with(clone)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    result = {"benchmark": "make test from a fresh clone: bash .ci/run with CI=true, "
                           "set-up of .venv included",
              "commit": commit, "uncommitted_changes_not_run": len(changed),
              "started": started, **_report(code, wall, cpu, lines, args.tail),
              "environment": {**_environment(), "memory_gib": _memory_gib()},
              "tested_with": tested_with,
              "command": "python -m utils.suite_run "
                         + " ".join(sys.argv[1:] if argv is None else argv)}
    if args.before:
        result["before"] = before_of(args.before, result)
    _print_phases(result["phases"])
    print(f"exit code {code}, {wall / 60:.1f} min, {cpu['cpu_s']:.0f} CPU-s "
          f"({cpu['method']})")
    results.write(args.out, result, SOURCES)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
