"""examples/part1_sharding.py and examples/part2_workers.py, the plain-torch take-away
scripts of Parts I and II: each at most 100 lines, importing torch and the standard
library only, and each run once here under torchrun on 2 CPU ranks (a module-scoped
fixture per script), its printed lines checked against what torch computes in this
process.

Each script checks its own guarantees on the ranks' gathered indices and exits 1 with
a message when one fails (the fixture then fails every test that uses it); the tests
below also call the scripts' check functions and data sets in-process, on shards that
are wrong on purpose, so that each check is seen to fail.
"""

import ast
import importlib.util
import multiprocessing as mp
import os
import pathlib
import re
import sys
import types

import pytest
from torch.utils.data import DistributedSampler

from utils import hangs

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
PART1, PART2 = EXAMPLES / "part1_sharding.py", EXAMPLES / "part2_workers.py"
# CPU ranks, so the test means the same on a GPU machine; torchrun sets 1 thread a rank
ENV = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
       "CUDA_VISIBLE_DEVICES": ""}
N1, BATCH1, EPOCHS1, SEED1 = 11, 2, 2, 3  # 11 on 2 ranks: one padded index per epoch
N2, BATCH2, EPOCHS2, WORKERS2 = 12, 2, 2, 2  # part 2's defaults, spelt out
WORLD = 2


def torchrun(script: pathlib.Path, *args: str) -> str:
    """The script's stdout under torchrun on WORLD CPU ranks; fails on an exit not 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={WORLD}", str(script), *args]
    done = hangs.run(command, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def load(path: pathlib.Path) -> types.ModuleType:
    """The script as a module, its main() not run."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def part1_lines():
    return torchrun(PART1, "--samples", str(N1), "--batch-size", str(BATCH1),
                    "--epochs", str(EPOCHS1), "--seed", str(SEED1)).splitlines()


@pytest.fixture(scope="module")
def part2_lines():
    return torchrun(PART2, "--samples", str(N2), "--batch-size", str(BATCH2),
                    "--epochs", str(EPOCHS2), "--workers", str(WORKERS2)).splitlines()


def shards(n: int, world: int, seed: int, epoch: int, drop_last: bool) -> list[list]:
    """Each rank's indices from torch's DistributedSampler."""
    result = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank,
                                     shuffle=True, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        result.append(list(sampler))
    return result


# --- both scripts: short, plain torch -----------------------------------------------

@pytest.mark.parametrize("script", [PART1, PART2], ids=lambda p: p.name)
def test_the_script_is_short_and_imports_torch_and_the_standard_library_only(script):
    text = script.read_text()
    lines = text.splitlines()
    assert len(lines) <= 100 and max(map(len, lines)) <= 88
    # spawned workers import the file: main() only when it is the program
    assert any(line.startswith('if __name__ == "__main__":') for line in lines)
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            imported.add(node.module.split(".")[0])
    assert "torch" in imported
    assert imported <= {"torch", "torchvision"} | set(sys.stdlib_module_names), imported


# --- part 1: DistributedSampler, set_epoch -------------------------------------------

def test_part1_prints_each_ranks_batches_as_distributed_sampler_gives_them(part1_lines):
    printed = {}
    for line in part1_lines:
        found = re.fullmatch(r"epoch (\d+) rank (\d+): (.*)", line)
        if found:
            batches = [[int(i) for i in b.strip("[]").split(",")]
                       for b in found.group(3).split()]
            printed[int(found.group(1)), int(found.group(2))] = batches
    expected = {}
    for epoch in range(EPOCHS1):
        for rank, indices in enumerate(shards(N1, WORLD, SEED1, epoch, False)):
            expected[epoch, rank] = [indices[i:i + BATCH1]
                                     for i in range(0, len(indices), BATCH1)]
    assert printed == expected
    # in rank order (gathered, printed by rank 0), after a header
    assert [line.split(":")[0] for line in part1_lines[1:]] == [
        s for e in range(EPOCHS1) for s in (f"epoch {e} rank 0", f"epoch {e} rank 1",
                                            f"epoch {e}")] + ["ok"]


def test_part1_reports_a_partition_each_epoch_with_its_padded_index(part1_lines):
    assert part1_lines[0] == (f"{N1} samples on {WORLD} ranks, drop_last=False: 6 per "
                              f"rank per epoch, in 3 batches of at most {BATCH1}")
    for epoch in range(EPOCHS1):
        rank0, rank1 = shards(N1, WORLD, SEED1, epoch, False)
        padded = rank1[-1]  # 11 positions, 12 places: the last is a repeat
        assert padded in rank0 + rank1[:-1]
        assert (f"epoch {epoch}: partition ok: all {N1} samples once each, plus 1 "
                f"padded [{padded}]") in part1_lines
    assert part1_lines[-1] == (f"ok: {EPOCHS1} epoch(s), each a partition, each order "
                               "new")


@pytest.mark.parametrize("n,world", [(11, 2), (10, 3), (1, 2), (1, 4), (3, 4), (8, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_part1_check_passes_what_distributed_sampler_gives(n, world, drop_last):
    check_epoch = load(PART1).check_epoch
    for epoch in range(2):
        given = shards(n, world, 0, epoch, drop_last)
        order, summary = check_epoch(given, n, drop_last)
        assert sorted(order) == sorted(sum(given, []))
        assert summary.startswith(f"{n // world * world} of {n}" if drop_last
                                  else f"all {n} samples")


def test_part1_check_fails_on_shards_that_do_not_partition():
    check_epoch = load(PART1).check_epoch
    # each rank its own seed: the shards overlap and miss samples
    overlapping = [shards(11, 2, rank, 0, False)[rank] for rank in range(2)]
    naive = [list(range(11))[rank::2] for rank in range(2)]  # 6 and 5: unequal
    cases = [(overlapping, 11, False, "missing"), (naive, 11, False, "unequal"),
             ([[0, 2], [1, 3]], 6, True, "cut"),  # 4 and 5 missing, none to cut
             ([[0, 2], [1, 0]], 4, False, "missing"),  # 0 twice, 3 never
             ([[0, 0, 4], [1, 3, 2]], 5, False, "padded"),  # a repeat, not at the end
             ([[0, 2], [1, 7]], 4, True, "outside")]
    for given, n, drop_last, words in cases:
        with pytest.raises(ValueError, match=words):
            check_epoch(given, n, drop_last)


def test_part1_names_a_bad_argument(capsys):
    with pytest.raises(SystemExit) as stopped:
        load(PART1).parse_args(["--batch-size", "0"])
    assert stopped.value.code == 2
    assert "--batch-size=0: expected >= 1" in capsys.readouterr().err


# --- part 2: workers, seeds, an IterableDataset --------------------------------------

def test_part2_report_draws_and_reads_each_sample_once(part2_lines):
    per_rank = -(-N2 // WORLD)  # DistributedSampler pads to a multiple of WORLD
    batches = [min(BATCH2, per_rank - i) for i in range(0, per_rank, BATCH2)]
    drawn = {f"r{r}w{w}": EPOCHS2 * sum(batches[w::WORKERS2])  # batch b: worker b % W
             for r in range(WORLD) for w in range(WORKERS2)}
    streamed = {f"r{r}w{w}": len(range(r * WORKERS2 + w, N2, WORLD * WORKERS2))
                for r in range(WORLD) for w in range(WORKERS2)}
    assert part2_lines == [
        f"{WORLD} ranks x {WORKERS2} workers",
        f"draws per (rank, worker): {drawn}",
        f"draws: all {EPOCHS2 * WORLD * per_rank} distinct; a new loader repeats "
        "epoch 0's",
        f"stream reads per (rank, worker): {streamed}",
        f"stream: each of the {N2} samples read exactly once"]


@pytest.mark.parametrize("world,workers", [(1, 1), (2, 2), (3, 2), (2, 3)])
def test_part2_stream_reads_each_sample_once_over_ranks_and_workers(world, workers,
                                                                   monkeypatch):
    part2 = load(PART2)
    for n in (0, 1, 5, 12, 13):
        read = []
        for rank in range(world):
            stream = part2.Stream.__new__(part2.Stream)  # no process group here
            stream.n, stream.rank, stream.world = n, rank, world
            for worker in range(workers):
                info = types.SimpleNamespace(num_workers=workers, id=worker)
                monkeypatch.setattr(part2, "get_worker_info", lambda: info)
                read += [i for i, _ in stream]
        assert sorted(read) == list(range(n)), (n, world, workers)


def test_part2_names_a_bad_argument(capsys):
    with pytest.raises(SystemExit) as stopped:
        load(PART2).parse_args(["--workers", "-1"])
    assert stopped.value.code == 2
    assert "--workers: -1 < 0" in capsys.readouterr().err
