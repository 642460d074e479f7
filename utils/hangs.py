"""When a command hangs, say where: the Python stack of every process it started.

``run(cmd, timeout=...)`` is ``subprocess.run(cmd, capture_output=True, text=True)`` for
the book's launches (torchrun and its ranks, DataLoader workers, fork servers). At the
timeout it takes the stack of each process of the command's tree with ``py-spy dump``
(the Python frames of every thread), kills the tree and raises :class:`Hang`, a
``subprocess.TimeoutExpired`` whose message holds those stacks and the last lines the
command printed. ``communicate(procs, timeout=...)`` does the same for several ``Popen``
started side by side (two torchrun "nodes"). A hang then names its place in the test's
or the cell's own error, instead of "timed out after 300 seconds".

py-spy reads another process's memory, which Linux allows to root, or to the process's
owner where ``/proc/sys/kernel/yama/ptrace_scope`` is 0, and macOS to root only. Where
it cannot read a process, that process's block holds py-spy's own message, and the hang
is still reported, with its output, at the timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Sequence

import psutil

__all__ = ["Hang", "run", "communicate", "python_stacks", "kill_tree", "py_spy"]

_TAIL = 3000  # characters of each output stream kept in a Hang's message


class Hang(subprocess.TimeoutExpired):
    """A command ran past its timeout; ``stacks`` holds every process's Python stack,
    taken before the command was killed."""

    def __init__(self, cmd, timeout: float, stacks: str, output: str = "",
                 stderr: str = ""):
        super().__init__(cmd, timeout, output=output, stderr=stderr)
        self.stacks = stacks

    def __str__(self) -> str:
        return (f"{super().__str__()}; every process's stack before it was killed:\n"
                f"{self.stacks}\n--- the last of its stdout ---\n{_tail(self.output)}\n"
                f"--- the last of its stderr ---\n{_tail(self.stderr)}")


def _tail(text) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-_TAIL:]


def py_spy() -> str | None:
    """The py-spy executable: beside this Python's (a virtual environment's), or on
    PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def python_stacks(pid: int, timeout: float = 20.0) -> str:
    """The Python stack of process ``pid`` and of every process under it, one block
    each."""
    exe = py_spy()
    blocks = []
    for proc in _tree(pid):
        try:
            title = " ".join(proc.cmdline())[:160]
        except psutil.Error:
            title = "(gone)"
        if exe is None:
            text = "(no stack: py-spy is not installed; pip install py-spy)"
        else:
            try:
                dump = subprocess.run([exe, "dump", "--pid", str(proc.pid)],
                                      capture_output=True, text=True, timeout=timeout)
                text = dump.stdout.strip() or dump.stderr.strip()
            except subprocess.TimeoutExpired:
                text = f"(py-spy did not answer within {timeout:g} s)"
        blocks.append(f"--- pid {proc.pid}: {title}\n{text}")
    return "\n".join(blocks) or f"(process {pid} had already ended)"


def kill_tree(pid: int) -> None:
    """SIGKILL a process, then every process it started, and theirs. torchrun starts
    each rank in a session of its own: killing torchrun's process group would leave
    the ranks (and their GPUs) behind."""
    for proc in _tree(pid):
        try:
            proc.kill()
        except psutil.Error:
            pass


def _rest(proc: subprocess.Popen) -> tuple:
    """What a killed command had left in its pipes; empty if a process outside its tree
    (one that left it, such as a detached server) still holds them open."""
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        return "", ""


def communicate(procs: Sequence[subprocess.Popen], timeout: float) -> list[tuple]:
    """``[p.communicate() for p in procs]`` within one shared ``timeout``; past it, the
    stacks of every process of every command are taken, all are killed and :class:`Hang`
    is raised."""
    deadline = time.monotonic() + timeout
    outputs = []
    for proc in procs:
        try:
            left = max(0.1, deadline - time.monotonic())
            outputs.append(proc.communicate(timeout=left))
        except subprocess.TimeoutExpired:
            stacks = "\n".join(python_stacks(p.pid) for p in procs if p.poll() is None)
            for p in procs:
                kill_tree(p.pid)
            late = [_rest(p) for p in procs]
            out = "".join(o or "" for o, _ in late)
            err = "".join(e or "" for _, e in late)
            raise Hang(proc.args, timeout, stacks, out, err) from None
    return outputs


def run(cmd, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
    **kwargs)``, except that a command still running at ``timeout`` has every
    process's stack taken before it is killed, in the :class:`Hang` raised."""
    kwargs.setdefault("text", True)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          **kwargs) as proc:
        (out, err), = communicate([proc], timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
