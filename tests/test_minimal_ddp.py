"""examples/minimal_ddp.py, chapter 0's whole DDP script: short enough to show whole, it
runs under torchrun on 2 CPU ranks with rank 0 alone printing a loss that decreases, and
2 ranks end with the parameters of 1 process.

Why 2 ranks equal 1 process here: the script splits a global batch of 32 over the ranks,
DistributedSampler gives rank r positions r, r + 2, ... of one shuffled order, so the
two ranks' k-th batches together are the k-th batch of 32 that one process takes; with a
mean loss and equal batches, DDP's average of the two ranks' gradients is that batch's
gradient. Only the order of float additions differs (measured: under 1e-8 here; the
test allows 1e-5).
"""

import os
import pathlib
import re
import sys
import textwrap

import pytest
import torch

from utils import forkrun, hangs

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "minimal_ddp.py"
# CPU ranks, so the test means the same on a GPU machine; torchrun sets 1 thread a rank
ENV = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
       "CUDA_VISIBLE_DEVICES": ""}
# A script that runs minimal_ddp.main() and then saves each rank's final parameters:
# it catches the model as the script wraps it in DDP.
SAVING = textwrap.dedent("""
    import os, sys, torch
    from torch.nn.parallel import DistributedDataParallel
    sys.path.insert(0, {examples!r})
    import minimal_ddp
    wrapped = []
    def keep(module, **kwargs):
        wrapped.append(DistributedDataParallel(module, **kwargs))
        return wrapped[-1]
    if __name__ == "__main__":
        minimal_ddp.DDP = keep
        minimal_ddp.main()
        state = wrapped[0].module.state_dict()
        torch.save(state, os.path.join({out!r}, f"rank{{os.environ['RANK']}}.pt"))
""")

def torchrun(script, nproc):
    """The script under torchrun on nproc CPU ranks; one process forked from a server that
    imported torch, in a torchrun rank's environment (utils.forkrun), where nproc is 1."""
    if nproc == 1:
        done = forkrun.run(str(script), nproc=1, env=ENV, timeout=300)
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", str(script)]
        done = hangs.run(command, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_script_is_short_enough_to_show_whole():
    lines = SCRIPT.read_text().splitlines()
    assert len(lines) <= 45
    assert max(map(len, lines)) <= 88
    assert 'if __name__ == "__main__":' in lines


def test_on_two_cpu_ranks_rank_0_prints_a_decreasing_loss(final_parameters):
    stdout, _ = final_parameters[2]  # the script's main() under torchrun on 2 ranks
    lines = stdout.splitlines()
    # one line per epoch (one-based): rank 1 printed nothing; each says 2 ranks took part
    assert [line.split(":")[0] for line in lines] == [f"epoch {e}/5" for e in range(1, 6)]
    losses = [float(re.fullmatch(r"epoch \d/5: loss (\d+\.\d{4}), ranks 2",
                                 line).group(1)) for line in lines]
    assert all(a > b for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] / 100


@pytest.fixture(scope="module")
def final_parameters(tmp_path_factory):
    """{number of processes: [each rank's final state_dict]}"""
    runs = {}
    for nproc in (1, 2):
        out = tmp_path_factory.mktemp(f"nproc{nproc}")
        script = out / "save_parameters.py"
        script.write_text(SAVING.format(examples=str(SCRIPT.parent), out=str(out)))
        runs[nproc] = (torchrun(script, nproc),
                       [torch.load(out / f"rank{r}.pt", weights_only=True)
                        for r in range(nproc)])
    return runs


def test_two_ranks_end_with_the_parameters_of_one_process(final_parameters):
    (stdout1, [alone]), (stdout2, [rank0, rank1]) = (final_parameters[1],
                                                     final_parameters[2])
    # DDP keeps the replicas identical: the same averaged gradient on both ranks
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    # and equal to one process taking the batches of 32, to float32 rounding
    for k in alone:
        torch.testing.assert_close(rank0[k], alone[k], rtol=1e-5, atol=1e-5)
    # so the printed losses are the same to the 4 decimals printed
    assert stdout1.replace("ranks 1", "ranks 2") == stdout2
