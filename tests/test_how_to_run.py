"""Every shell block of "How to run this book" (book/how_to_run.md) that can run on a
CPU-only machine, run as a reader runs them: one after the other in one shell, from a
fresh clone of this repository, on 2 CPU processes and the generated stand-in for
CIFAR-10. Each block carries, on the line before it in the page's source, a MyST comment
(``% test: ...``, not rendered) that says what the test changes in it (``replace "A"
with "B", ...``; every "A" must occur in the block), or that it runs ``as it is``, or why
it is skipped (a GPU, SLURM, a server). The clone is of the repository's last commit."""

import os
import pathlib
import re
import subprocess
import sys

from utils import hangs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "how_to_run.md"
DIRECTIVE = re.compile(r"^% test: (.*)$")
STAND_IN = ("python -c \"from utils.data import write_synthetic_cifar10 as w; "
            "w('data', n_train=1024, n_test=256)\"")


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
    if "then write the stand-in into data/" in directive:
        code += "\n" + STAND_IN
    return code


def test_every_block_says_how_it_is_tested():
    found = blocks(PAGE.read_text())
    assert len(found) >= 10
    missing = [code for directive, code in found if directive is None]
    assert not missing, f"blocks without a '% test:' line before them: {missing}"
    skipped = [d for d, _ in found if d.startswith("skip")]
    # what cannot run here: a GPU driver, SLURM, a notebook server, the suite's own set-up
    assert len(skipped) <= 4, skipped


def test_the_blocks_run_from_a_fresh_clone(tmp_path):
    script = ["set -e -o pipefail"]
    for number, (directive, code) in enumerate(blocks(PAGE.read_text()), start=1):
        tested = as_tested(directive, code)
        if tested is not None:
            script += [f"echo '== block {number}' >&2", tested]
    # the reader's python, torchrun and jupyter: this environment's
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    env = {**os.environ, "PATH": path, "REPOSITORY": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the clone's utils, not this checkout's
    done = hangs.run(["bash", "-c", "\n".join(script)], cwd=str(tmp_path), env=env,
                     timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    # what the page says the scripts print: one line per epoch with images/s
    epochs = re.findall(r"^epoch \d+/\d+: train loss .*; [\d.]+ s, \d+ images/s$", out,
                        flags=re.M)
    assert len(epochs) == 2 + 1 + 1, out  # 2 ranks for 2 epochs, 1 GPU's, train_single's
    clone = tmp_path / "ddl-book"
    assert (clone / "runs" / "train_ddp" / "checkpoint.pt").exists()
    assert (clone / "runs" / "one_gpu" / "checkpoint.pt").exists()
    assert (clone / "shared" / "cifar10" / "cifar-10-batches-py").is_dir()
    assert subprocess.run(["git", "-C", str(clone), "status", "--porcelain",
                           "--untracked-files=no"], capture_output=True,
                          text=True).stdout == ""
