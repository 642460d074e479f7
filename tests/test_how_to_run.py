"""Every shell block of "How to run this book" (book/how_to_run.md) that can run on a
CPU-only machine, run as a reader runs them: one after the other in one shell, from a
fresh clone of this repository, on 2 CPU processes and the generated stand-in for
CIFAR-10 that the page's own rehearsal writes (no hidden set-up). Each block carries, on the line before it in the page's source, a MyST comment
(``% test: ...``, not rendered) that says what the test changes in it (``replace "A"
with "B", ...``; every "A" must occur in the block), or that it runs ``as it is``, or why
it is skipped (a GPU, SLURM, a server). The clone is of the repository's last commit."""

import os
import pathlib
import re
import socket
import subprocess
import sys

from utils import hangs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "how_to_run.md"
DIRECTIVE = re.compile(r"^% test: (.*)$")


def blocks(text: str) -> list[tuple[str, str]]:
    """``(directive, code)`` for each ```bash block of the page, in order."""
    found, directive, code = [], None, None
    for line in text.splitlines():
        if code is not None:
            if line.startswith("```"):
                found.append((directive, "\n".join(code)))
                directive, code = None, None
            else:
                code.append(line)
        elif line.startswith("```bash"):
            code = []
        elif DIRECTIVE.match(line):
            directive = DIRECTIVE.match(line).group(1)
        elif line.strip():
            directive = None  # a directive belongs to the block right after it
    return found


def as_tested(directive: str, code: str) -> str | None:
    """The block as the test runs it, or None if the directive skips it."""
    if directive.startswith("skip"):
        return None
    if directive.startswith("run as it is"):
        return code
    assert directive.startswith("replace "), directive
    changes = directive.removeprefix("replace ").split(", then ")[0]
    for old, new in re.findall(r'"([^"]+)" with "([^"]*)"', changes):
        assert old in code, f"{old!r} is not in the block it changes:\n{code}"
        code = code.replace(old, new)
    return code


def test_every_block_says_how_it_is_tested():
    found = blocks(PAGE.read_text())
    assert len(found) >= 10
    missing = [code for directive, code in found if directive is None]
    assert not missing, f"blocks without a '% test:' line before them: {missing}"
    skipped = [d for d, _ in found if d.startswith("skip")]
    # what cannot run here: a GPU driver, SLURM, a notebook server, the suite's own set-up,
    # and two GPU commands that a CPU would only run as the blocks before them (the
    # rehearsal, train_ddp.py on 2 ranks): tests/test_book_commands.py checks their options
    assert len(skipped) <= 6, skipped


def shown_rehearsal(text: str) -> list[str]:
    """The output the page shows below its CPU rehearsal (its first ```text block)."""
    return text.split("```text\n", 1)[1].split("```", 1)[0].splitlines()


def test_the_blocks_run_from_a_fresh_clone(tmp_path):
    text = PAGE.read_text()
    script = ["set -e -o pipefail"]
    for number, (directive, code) in enumerate(blocks(text), start=1):
        tested = as_tested(directive, code)
        if tested is not None:
            script += [f"echo '== block {number}' >&2", tested]
    # the reader's python, torchrun and jupyter: this environment's
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    env = {**os.environ, "PATH": path, "REPOSITORY": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the clone's utils, not this checkout's
    done = hangs.run(["bash", "-c", "\n".join(script)], cwd=str(tmp_path), env=env,
                     timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout.splitlines()
    # the rehearsal, run as shown (no hidden set-up: --synthetic wrote its data), printed
    # what the page shows: its first lines as they are, the epochs' loss and accuracy
    shown = [line.replace("HOST", socket.gethostname()) for line in shown_rehearsal(text)]
    assert out[:4] == shown[:4], out[:8]
    epochs = [line for line in out if re.match(r"epoch \d+/\d+: train loss ", line)]
    numbers = lambda line: [float(x) for x in re.findall(r"(?:loss|accuracy) ([\d.]+)",
                                                        line)]
    # the first epoch's loss as the page shows it; after it, another CPU's kernels, which
    # round otherwise, send the training elsewhere (seen: epoch 2's accuracy 0.259 on an
    # Intel Xeon, 0.291 on the AMD EPYC that printed the page)
    assert epochs[0].split(", test")[0] == shown[4].split(", test")[0], (epochs, shown)
    assert [line.split(":")[0] for line in epochs[:3]] == [line.split(":")[0]
                                                           for line in shown[4:]]
    assert numbers(epochs[2])[0] < numbers(epochs[0])[0], epochs  # the loss fell
    # it learned: far above chance (0.10) after 3 epochs (0.92 measured)
    assert numbers(epochs[2])[1] >= 0.5, epochs
    # one line per epoch with images/s and the processes that took part
    assert all(re.search(r"; [\d.]+ s, \d+ images/s on \d+ process(es)?$", line)
               for line in epochs), epochs
    assert len(epochs) == 3 + 1  # the rehearsal's, train_ddp.py's GPU command on 2 ranks
    # the environment check: the lines the page shows are among those it printed
    # (the rank lines and the verdict; the rest depends on the machine's driver)
    check = [line for line in text.split("```text\n")[2].split("```", 1)[0].splitlines()
             if line.startswith(("rank ", "OK for a CPU run"))]
    missing = [line for line in check if line not in done.stdout]
    assert len(check) == 3 and not missing, (missing, done.stdout[-3000:])
    clone = tmp_path / "ddl-book"
    for out_folder in ("rehearsal", "train_ddp"):
        assert (clone / "runs" / out_folder / "checkpoint.pt").exists(), out_folder
    assert (clone / "shared" / "cifar10" / "cifar-10-batches-py").is_dir()
    assert subprocess.run(["git", "-C", str(clone), "status", "--porcelain",
                           "--untracked-files=no"], capture_output=True,
                          text=True).stdout == ""
