"""Five failures a reader of "How to run" can meet under torchrun on a CPU, run for
real, with what torchrun and the ranks print (book/how_to_run.md, "When it fails"):

    python -m utils.failures --out book/results/failures_cpu.json

- ``port_in_use``: torchrun's ``--master_port`` is held by another process (a second
  job on the node, a leftover run); and the same port as ``--rdzv-endpoint``.
- ``rank_error``: one rank's exception (rank 0's save into an ``--out`` under a
  regular file) in torchrun's ``ChildFailedError`` report, which ``@record`` fills.
- ``rank_killed``: SIGKILL to one rank of ``examples/train_ddp.py`` (what the host's
  out-of-memory killer does): torchrun's ``exitcode: -9`` report.
- ``no_network``: ``--download`` where CIFAR-10's host cannot be reached (run on a
  machine with no network; skipped, not faked, on one that has it).
- ``ctrl_c``: a terminal's Ctrl-C (SIGINT to torchrun's process group) during
  ``utils.train_cifar10``; its resume, stopped by SIGTERM to torchrun alone (``kill``,
  a scheduler); and Ctrl-C during ``examples/train_ddp.py``, which has no handler.

Each command runs in a temporary folder holding the small stand-in data set
(``data``), bounded by a timeout (``utils.hangs``), every process it started checked
gone afterwards. Each scenario keeps the command as a reader types it, the exit codes
and the lines a reader must look at (``excerpt``), with what differs from run to run
replaced by placeholders (``sanitize``: ``<pid>``, ``<time>``, ``<port>``, ``<host>``,
``<work>`` for the scenario's folder, ``<tmp>`` for the system's). torchrun does not
say how its ranks exited after a signal: each rank runs under ``rank_exit_code``,
which prints it, and those lines are left out of the output shown.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import psutil

from . import hangs
from .results import ROOT, package_sources, write

SCRIPT = os.path.join(ROOT, "examples", "train_ddp.py")
# the torchrun script, as a reader runs it (``python -m torch.distributed.run`` logs
# under another name, without torch's "W1128 10:55:33.818000 16926 ..." prefix)
_SCRIPT = os.path.join(os.path.dirname(sys.executable), "torchrun")
TORCHRUN = ([sys.executable, _SCRIPT] if os.path.exists(_SCRIPT)
            else [sys.executable, "-m", "torch.distributed.run"])
# what the results depend on: the two training programs and the signal handling of the
# package's workers; utils.hangs only bounds the runs, and utils.data's stand-in only
# feeds them (no line kept depends on its images)
SOURCES = ["examples/train_ddp.py", "utils/failures.py", "utils/workers.py",
           "utils/_detach.py", *package_sources("utils/train_cifar10")]
EXIT_MARK = "utils.failures:"  # starts the line each rank's wrapper prints
WRAP = "from utils.failures import rank_exit_code; rank_exit_code()"
TIMEOUT = 150.0  # seconds for one torchrun command, its shutdown included
C10D_WAIT = 5.0  # seconds the --rdzv-endpoint variant waits for Ctrl-C, then for kill


def rank_exit_code() -> None:
    """Run a rank's command (``python -u ARGS``), print its exit code and exit as it
    did; the signals torchrun sends to the rank's process group reach both processes,
    and this one only waits."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)  # a function: the child starts with SIG_DFL
    code = subprocess.call([sys.executable, "-u", *sys.argv[1:]])
    print(f"{EXIT_MARK} rank {os.environ.get('RANK')} exit code {code}", flush=True)
    if code < 0:  # killed by a signal: so is this process, as torchrun would see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# --- running a command: bounded, one stream as a terminal shows it, nothing left ------

class Watch:
    """Every process under ``pid``, noted every ``interval`` seconds while it runs, so
    that the ones still alive after it has ended (a rank, a DataLoader worker, a fork
    server moved to a process group of its own) can be found and killed."""

    def __init__(self, pid: int, interval: float = 0.2):
        """Start watching ``pid``'s descendants in a thread."""
        self.seen: dict[int, psutil.Process] = {}
        self.pid, self.interval, self.done = pid, interval, threading.Event()
        self.thread = threading.Thread(target=self._note, daemon=True)
        self.thread.start()

    def _note(self) -> None:
        """Note the descendants until ``done`` is set or ``pid`` is gone."""
        while not self.done.wait(self.interval):
            try:
                found = psutil.Process(self.pid).children(recursive=True)
            except psutil.Error:
                return
            self.seen.update((p.pid, p) for p in found if p.pid not in self.seen)

    def left_behind(self, grace: float = 10.0) -> list[str]:
        """Stop watching; the command lines of the processes still alive ``grace``
        seconds later, which are then killed."""
        self.done.set()
        self.thread.join()
        alive = [p for p in self.seen.values() if p.is_running()]
        _, alive = psutil.wait_procs(alive, timeout=grace)
        names = []
        for proc in alive:
            try:
                names.append(" ".join(proc.cmdline())[:120])
                proc.kill()
            except psutil.Error:
                pass
        return names


Send = Callable[[subprocess.Popen], None]  # sends the command a signal (ctrl_c, kill)


def launch(cmd: list[str], timeout: float = TIMEOUT,
           during: Callable[[subprocess.Popen, Callable[[Send], None]], None]
           | None = None) -> dict:
    """Run ``cmd`` in the repository's root, in a session of its own (as a terminal
    starts a foreground job), its stdout and stderr in one stream; ``during(proc,
    signal)`` runs in a thread meanwhile, and ``signal(send)`` sends one.
    ``{"exit_code", "output", "seconds", "signals", "timed_out", "left_behind"}``:
    ``signals`` holds ``[send's name, seconds after the start]``; past ``timeout``
    the command is killed (``exit_code`` None)."""
    start, sent = time.monotonic(), []

    def signal_now(send: Send) -> None:
        """``send(proc)``, noted with the time."""
        send(proc)
        sent.append([send.__name__, round(time.monotonic() - start, 1)])

    # as a reader's shell has it: OMP_NUM_THREADS unset (torchrun says it sets it)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    watch = Watch(proc.pid)
    if during is not None:
        threading.Thread(target=during, args=(proc, signal_now), daemon=True).start()
    try:
        (output, _), = hangs.communicate([proc], timeout)
        code, timed_out = proc.returncode, False
    except hangs.Hang as hang:
        output, code, timed_out = hang.output or "", None, True
    return {"exit_code": code, "output": output, "timed_out": timed_out,
            "seconds": round(time.monotonic() - start, 1), "signals": sent,
            "left_behind": watch.left_behind()}


def when_saved(path: str, send: Send, timeout: float = TIMEOUT) -> Callable:
    """A ``during`` for ``launch``: once ``path`` is written anew (a checkpoint: the
    training is under way), ``send``; nothing if the command ends first."""
    def wait_and_send(proc: subprocess.Popen, signal_now: Callable) -> None:
        """Poll ``path`` every 50 ms until it changes, then send."""
        before = _mtime(path)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if _mtime(path) != before:
                signal_now(send)
                return
            time.sleep(0.05)
    return wait_and_send


def _mtime(path: str) -> int | None:
    """``path``'s modification time in ns, None while it does not exist."""
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal's Ctrl-C does: SIGINT to every process of the foreground
    process group (torchrun's)."""
    os.killpg(proc.pid, signal.SIGINT)


def kill(proc: subprocess.Popen) -> None:
    """What ``kill PID`` (or a scheduler) does: SIGTERM to torchrun alone."""
    proc.send_signal(signal.SIGTERM)


# --- what a reader must see ---------------------------------------------------------

def sanitize(text: str, work: str = "", port: int | None = None) -> str:
    """``text`` with what varies from run to run replaced: process ids, times, the
    temporary folders, the port, this machine's names, the repository's place."""
    tmp = re.escape(tempfile.gettempdir())
    text = text.replace(ROOT + os.sep, "")
    if work:
        text = text.replace(work, "<work>")
    for pattern, placeholder in [
            (r"(?m)^([DIWEF])\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ", r"\1<time> <pid> "),
            (r"time\s+: \S+", "time      : <time>"),
            (r"host\s+: \S+", "host      : <host>"),
            (rf"{tmp}/torchelastic_\w+/[\w-]+/", "<tmp>/torchelastic_<id>/<run>/"),
            (r"(?i)(pid[:=] ?|pid |process )\d+", r"\1<pid>"),
            (r"fd=\d+", "fd=<fd>"),
            (r"[^\s\"']*/site-packages/", "<site-packages>/")]:
        text = re.sub(pattern, placeholder, text)
    if port is not None:
        text = re.sub(rf"\b{port}\b", "<port>", text)
    names = {socket.gethostname(), socket.getfqdn()} - {""}
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", "<host>", text)
    return text


def excerpt(text: str, keep: list[str]) -> str:
    """The lines of ``text`` that match one of the regular expressions ``keep``, in
    their order, a traceback's frame with its line of code, and ``...`` where lines
    were left out."""
    lines = [line.rstrip() for line in text.splitlines()]
    kept = set()
    for number, line in enumerate(lines):
        if any(re.search(pattern, line) for pattern in keep):
            kept.add(number)
            if re.search(r'^(\[rank\d+\]:)? *File "', line):
                kept.add(number + 1)  # the frame's line of code
    out = []
    for number in sorted(kept & set(range(len(lines)))):
        if number > 0 and number - 1 not in kept:
            out.append("...")
        out.append(lines[number])
    if out and len(lines) - 1 not in kept:
        out.append("...")
    return "\n".join(out)


def rank_exits(run: dict) -> dict[str, int]:
    """Take the ``rank_exit_code`` lines out of ``run["output"]``: ``{rank: code}``."""
    mark = re.escape(EXIT_MARK)
    found = re.findall(rf"^{mark} rank (\d+) exit code (-?\d+)$", run["output"],
                       flags=re.M)
    run["output"] = re.sub(rf"(?m)^{mark} .*\n?", "", run["output"])
    return {rank: int(code) for rank, code in sorted(found)}


def finish(run: dict, command: str, keep: list[str], work: str,
           port: int | None = None) -> dict:
    """A run as the results file keeps it: the command a reader types, the excerpt
    of its output (sanitized), its exit code and the facts about its processes."""
    text = sanitize(run.pop("output"), work, port)
    code = run["exit_code"]
    shell = 128 - code if code is not None and code < 0 else code
    return {"command": sanitize(command, work, port), **run,
            "shell_exit_code": shell, "output": excerpt(text, keep)}


# --- the scenarios ------------------------------------------------------------------

def torchrun(options: list[str], program: list[str],
             wrap: bool = False) -> tuple[list[str], str]:
    """``(argv, shown)``: the command that runs ``torchrun OPTIONS PROGRAM`` (with
    ``wrap``, each rank under ``rank_exit_code``), and the command as a reader types
    it."""
    shown = " ".join(["torchrun", *options, *program]).replace(
        SCRIPT, "examples/train_ddp.py")
    if wrap:
        program = ["--no-python", sys.executable, "-u", "-c", WRAP, *program]
    return [*TORCHRUN, *options, *program], shown


def train_ddp(work: str, out: str, *more: str) -> list[str]:
    """examples/train_ddp.py on the CPU, on the stand-in in ``work/data``, into
    ``work/out``."""
    return [SCRIPT, "--device", "cpu", "--data", os.path.join(work, "data"), *more,
            "--out", os.path.join(work, out)]


def train_cifar10(work: str, out: str, *more: str) -> list[str]:
    """``-m utils.train_cifar10`` as the Ctrl-C scenarios run it: 16 short steps an
    epoch, a checkpoint every 2 (the sign that training is under way)."""
    return ["-m", "utils.train_cifar10", "--device", "cpu", "--data",
            os.path.join(work, "data"), "--no-progress", "--checkpoint-every", "2",
            "--epochs", "3", "--global-batch", "32", *more,
            "--out", os.path.join(work, out)]


def who_listens(port: int) -> dict | None:
    """What ``ss -ltnp`` says of ``port`` (None where there is no ``ss``)."""
    if shutil.which("ss") is None:
        return None
    found = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True,
                           timeout=30).stdout
    lines = [" ".join(line.split()) for line in found.splitlines()
             if f":{port} " in line]
    return {"command": "ss -ltnp | grep :<port>",
            "output": sanitize("\n".join(lines), port=port)}


def when_connected(port: int) -> Callable:
    """A ``during`` for ``launch``: once torchrun is connected to ``port`` (to the
    holder, taken for a rendezvous store), a reader's Ctrl-C ``C10D_WAIT`` seconds
    later, and ``kill PID`` as long after that if it did not end it."""
    def wait_and_send(proc: subprocess.Popen, signal_now: Callable) -> None:
        """Poll torchrun's connections every 100 ms, then Ctrl-C, then kill."""
        deadline = time.monotonic() + TIMEOUT
        while not _connected(proc.pid, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.1)
        for send in (ctrl_c, kill):
            try:
                proc.wait(C10D_WAIT)
                return
            except subprocess.TimeoutExpired:
                signal_now(send)
    return wait_and_send


def _connected(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a TCP connection to ``port`` established."""
    try:
        proc = psutil.Process(pid)
        found = (getattr(proc, "net_connections", None) or proc.connections)("tcp")
    except psutil.Error:
        return False
    return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
               for c in found)


PORT_LINES = [r"^Traceback", r"static_tcp_rendezvous", r"DistNetworkError"]


# another process holding a port, until its stdin closes: a second job, a leftover run
HOLDER = ("import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
          "s.listen(); print(s.getsockname()[1], flush=True); sys.stdin.read()")


def port_in_use(work: str, rdzv_endpoint: bool = True) -> dict:
    """torchrun while another process listens on its port: as ``--master_port`` (the
    static rendezvous: the agent must listen there), and with ``rdzv_endpoint`` as
    ``--rdzv-endpoint`` (the c10d rendezvous, which connects to the holder instead: a
    reader waits, presses Ctrl-C, waits, and kills it)."""
    with subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            port = int(holder.stdout.readline())
            found = {"holder": who_listens(port),
                     **static_port(work, port)}
            if rdzv_endpoint:
                found["rdzv_endpoint"] = c10d_port(work, port)
        finally:
            holder.stdin.close()
    return found


def static_port(work: str, port: int) -> dict:
    """``--master_addr`` and ``--master_port``: the agent listens there."""
    argv, shown = torchrun(["--nnodes=1", "--nproc_per_node=2",
                            "--master_addr=127.0.0.1", f"--master_port={port}"],
                           train_ddp(work, "port", "--workers", "0"))
    return finish(launch(argv), shown, PORT_LINES, work, port)


def c10d_port(work: str, port: int) -> dict:
    """``--rdzv-backend=c10d --rdzv-endpoint``: the agent connects to the holder."""
    argv, shown = torchrun(["--nnodes=1", "--nproc_per_node=2", "--rdzv-backend=c10d",
                            f"--rdzv-endpoint=127.0.0.1:{port}"],
                           train_ddp(work, "port", "--workers", "0"))
    run = launch(argv, during=when_connected(port))
    return {"ended_by": "Ctrl-C" if run["exit_code"] != -signal.SIGTERM else "kill",
            **finish(run, shown, [r"."], work, port)}  # all of it: its few lines


# the rank's error; the report's header, root cause and its traceback's frame in the
# script (the rank's own traceback shows the same frame, and one more: its <module>)
REPORT_LINES = [r"^\[rank\d+\]: \w+Error", r" FAILED$", r"^Root Cause", r"^\[\d+\]:$",
                r"^  rank\s+:", r"^  exitcode\s+:", r"^  error_file:",
                r"^  traceback :", r'^ +File "examples/', r"^  \w+Error: "]


def rank_error(work: str) -> dict:
    """Rank 0's save fails (``--out`` under a regular file: ``NotADirectoryError``, an
    ``OSError`` as a full disk's would be): torchrun's ``ChildFailedError`` report."""
    with open(os.path.join(work, "file"), "w"):
        pass
    argv, shown = torchrun(["--standalone", "--nproc_per_node=2"],
                           train_ddp(work, "file/run", "--workers", "0",
                                     "--epochs", "1", "--global-batch", "64"))
    found = finish(launch(argv), shown, REPORT_LINES, work)
    cause = root_cause(found["output"], r"\w+Error: .*")
    block = found["output"].split("Root Cause", 1)[-1]
    cause["error_file"] = bool(re.search(r"^  error_file: \S+error\.json$", block,
                                         re.M))
    found["root_cause"] = {key: cause[key] for key in ("rank", "exitcode", "error_file",
                                                       "error")}
    return found


def root_cause(output: str, error: str | None = None) -> dict:
    """The rank and exit code in the root cause's block of torchrun's report (the rank
    torchrun stopped may be listed above it), and the last line there matching
    ``error``, where given."""
    report = output.split("Root Cause", 1)[-1]
    found = {"rank": _int(r"^  rank\s+: (\d+)", report),
             "exitcode": _int(r"^  exitcode\s+: (-?\d+)", report)}
    if error is not None:
        found["error"] = (re.findall(rf"^  ({error})$", report, re.M) or [None])[-1]
    return found


def _int(pattern: str, text: str) -> int | None:
    """The first group of ``pattern``'s first match in ``text``, as an int."""
    match = re.search(pattern, text, re.M)
    return int(match.group(1)) if match else None


def kill_a_rank(proc: subprocess.Popen) -> None:
    """What the host's out-of-memory killer (or ``kill -9 PID``) does: SIGKILL to one
    rank, the last torchrun started."""
    ranks = [p for p in psutil.Process(proc.pid).children()
             if "train_ddp.py" in " ".join(p.cmdline())]
    max(ranks, key=lambda p: p.pid).kill()


# torchrun's line for the killed rank, and its report's root cause
KILLED_LINES = [r"failed \(exitcode: -?\d+\)", r"^Root Cause", r"^  rank\s+:",
                r"^  exitcode\s+:", r"^  error_file:", r"^  traceback :", r" FAILED$"]


def rank_killed(work: str) -> dict:
    """A rank killed by SIGKILL in the second epoch of examples/train_ddp.py (after
    the first epoch's checkpoint): what torchrun prints."""
    out = "killed"
    argv, shown = torchrun(["--standalone", "--nproc_per_node=2"],
                           train_ddp(work, out, "--workers", "0", "--epochs", "3",
                                     "--global-batch", "32"))
    run = launch(argv, during=when_saved(os.path.join(work, out, "checkpoint.pt"),
                                         kill_a_rank))
    found = finish(run, shown, KILLED_LINES, work)
    found["root_cause"] = root_cause(found["output"])
    return found


# rank 0's error, and the report's root cause
NETWORK_LINES = [r"^\[rank0\]: urllib\.error\.URLError", r"^Root Cause", r"^  rank\s+:",
                 r"^  exitcode\s+:", r"^  urllib\.error\.URLError: "]
CIFAR10_HOST = "www.cs.toronto.edu"  # where torchvision downloads CIFAR-10 from


def no_network(work: str) -> dict:
    """``--download`` on a machine that reaches no network (run where the name of
    CIFAR-10's host does not resolve; elsewhere the scenario is skipped, not faked)."""
    try:
        socket.getaddrinfo(CIFAR10_HOST, 443)
        return {"skipped": f"{CIFAR10_HOST} resolves here: this machine has a network"}
    except OSError:
        pass
    argv, shown = torchrun(["--standalone", "--nproc_per_node=2"],
                           [SCRIPT, "--download", "--data", os.path.join(work, "fresh"),
                            "--device", "cpu", "--out", os.path.join(work, "offline")])
    found = finish(launch(argv), shown, NETWORK_LINES, work)
    found["root_cause"] = root_cause(found["output"], r"[\w.]*URLError: .*")
    return found


# the ranks' stop (or their KeyboardInterrupt), torchrun's relay of the signal, its
# SIGKILL if a rank outlasts its shutdown timeout, and its own traceback
SIGNAL_LINES = [r"every rank stopped after step", r"^resumed from", r"death signal",
                r"closing signal", r"Unable to shutdown", r"^Traceback",
                r"^During handling", r"^\S*SignalException:",
                r"^\[rank\d+\]: \w*Interrupt", r"^\w*Interrupt", r"exited unexpectedly"]


def signalled(work: str, program: list[str], send: Callable, out: str) -> dict:
    """Run ``program`` under torchrun on 2 ranks, each under ``rank_exit_code``, and
    ``send`` a signal once ``out``'s checkpoint is written anew."""
    argv, shown = torchrun(["--standalone", "--nproc_per_node=2"], program, wrap=True)
    run = launch(argv, during=when_saved(
        os.path.join(work, out, "checkpoint.pt"), send))
    ranks = rank_exits(run)
    found = finish(run, shown, SIGNAL_LINES, work)
    stopped = re.search(r"stopped after step (\d+)", found["output"])
    return {**found, "rank_exit_codes": ranks,
            "stopped_after_step": int(stopped.group(1)) if stopped else None,
            "torchrun_traceback": "SignalException" in found["output"]}


def ctrl_c_scenarios(work: str) -> dict:
    """Ctrl-C during ``utils.train_cifar10``; then its ``--resume``, stopped by SIGTERM
    to torchrun alone; then Ctrl-C during examples/train_ddp.py (no handler)."""
    return {
        "ctrl_c": signalled(work, train_cifar10(work, "cifar"), ctrl_c, "cifar"),
        "sigterm_resume": signalled(work, train_cifar10(work, "cifar", "--resume"),
                                    kill, "cifar"),
        "ctrl_c_train_ddp": signalled(work, train_ddp(
            work, "ddp", "--epochs", "3", "--global-batch", "32"), ctrl_c, "ddp")}


def run_all(work: str) -> dict:
    """Every scenario, in ``work`` (an empty folder), on the small stand-in."""
    from .data import write_synthetic_cifar10
    write_synthetic_cifar10(os.path.join(work, "data"), n_train=512, n_test=256)
    with ThreadPoolExecutor(1) as beside:  # mostly waiting: beside rank_error
        port = beside.submit(port_in_use, work)
        found = {"rank_error": rank_error(work)}
        found["port_in_use"] = port.result()
    found["rank_killed"] = rank_killed(work)
    found["no_network"] = no_network(work)
    return {**found, **ctrl_c_scenarios(work)}


def main(argv: list[str] | None = None) -> None:
    """``python -m utils.failures --out PATH``: every scenario, into a results file."""
    p = argparse.ArgumentParser(prog="python -m utils.failures",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out",
                   default=os.path.join("book", "results", "failures_cpu.json"))
    args = p.parse_args(argv)
    from .bench import environment
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="failures-") as work:
        scenarios = run_all(os.path.realpath(work))
    write(args.out, {"command": f"python -m utils.failures --out {args.out}",
                     "seconds": round(time.monotonic() - start, 1),
                     "environment": environment(), **scenarios}, SOURCES)


if __name__ == "__main__":
    main()
