"""Run the tests and chapters that start DataLoader workers from ranks again and again, each
under a timeout: a fork of a process with threads hangs now and then, so one green run proves
little. A run that hangs is stopped at its timeout with every process's Python stack
(utils.hangs) printed, and counted.

    .venv/bin/python tests/hang_loop.py --times 10             # all targets, 10 rounds
    .venv/bin/python tests/hang_loop.py --times 3 tests/test_workers.py

Prints one line per run (round, target, seconds, outcome) and a summary; exits 1 if any run
hung or failed.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from utils import hangs  # noqa: E402

NBVAL = ["--nbval", "--nbval-current-env", "--nbval-sanitize-with", "sanitize.cfg"]
# (pytest arguments) of each target: every test that starts workers from a rank, and the
# chapters whose ranks start workers most (6, 7, 8) or run the training scripts with them (11, 12, 13)
TARGETS = {
    "workers tests": ["tests/test_workers.py"],
    "examples in ranks": ["tests/test_examples.py", "-k", "ranks"],
    "training script, workers": ["tests/test_train_cifar10.py", "-k",
                                 "sigterm or killed_after_and_before or two_ranks_equal"],
    "capstone scripts": ["tests/test_train_ddp.py"],
    "chapter 6": [*NBVAL, "notebooks/06_workers.ipynb"],
    "chapter 7": [*NBVAL, "notebooks/07_seeding.ipynb"],
    "chapter 8": [*NBVAL, "notebooks/08_iterable_datasets.ipynb"],
    "chapter 11": [*NBVAL, "notebooks/11_cifar10_ddp.ipynb"],
    "chapter 12": [*NBVAL, "notebooks/12_exact_resume.ipynb"],
    "chapter 13": [*NBVAL, "notebooks/13_restarts_and_slurm.ipynb"],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds one run may take before it counts as hung")
    parser.add_argument("--skip", action="append", default=[],
                        help="a target to leave out (repeatable)")
    parser.add_argument("targets", nargs="*",
                        help="pytest arguments of one target instead of the list")
    args = parser.parse_args(argv)
    if args.times < 1:
        parser.error(f"--times must be at least 1, got {args.times}")
    unknown = [name for name in args.skip if name not in TARGETS]
    if unknown:
        parser.error(f"--skip takes target names {sorted(TARGETS)}, got {unknown}")
    targets = ({" ".join(args.targets): args.targets} if args.targets else
               {k: v for k, v in TARGETS.items() if k not in args.skip})
    bad = []
    for round_ in range(1, args.times + 1):
        for name, pytest_args in targets.items():
            start = time.monotonic()
            try:
                done = hangs.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  *pytest_args], timeout=args.timeout, cwd=ROOT)
                outcome = "passed" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
                tail = done.stdout.strip().splitlines()[-1:] if done.stdout else []
            except hangs.Hang as hang:
                outcome, tail = "HUNG", [str(hang)]
            if outcome != "passed":
                bad.append((round_, name))
            print(f"round {round_:2}  {name:<26} {time.monotonic() - start:7.1f} s  {outcome}"
                  f"  {tail[0] if tail and outcome == 'passed' else ''}", flush=True)
            if outcome != "passed":
                print("\n".join(tail)[-6000:], flush=True)
    runs = args.times * len(targets)
    print(f"{runs - len(bad)} passed, {len(bad)} failed: {len(targets)} targets x "
          f"{args.times} rounds" + (f"; not passed: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
