"""utils.forkrun, the tests' lighter torchrun: each rank gets the environment a torchrun rank
gets, runs its target as __main__ as `python -m`/`python file` would, and a failure, a
refusal or a hang is reported as torchrun's would be."""

import json
import os
import pathlib
import sys
import textwrap

import pytest

from utils import forkrun, hangs

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# what a rank learns from its environment, and whether it is __main__ with its arguments
SHOW = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
             "TORCHELASTIC_USE_AGENT_STORE"]
    if __name__ == "__main__":
        dist.init_process_group("gloo")  # env:// from the variables, as a script does
        seen = {name: os.environ.get(name) for name in NAMES}
        # to a file per rank (torchrun mixes the ranks' lines), named by the first argument
        with open(f"{sys.argv[1]}{dist.get_rank()}.json", "w") as f:
            json.dump({"env": seen, "argv": sys.argv[2:], "rank": dist.get_rank(),
                       "world": dist.get_world_size()}, f)
        dist.destroy_process_group()
""")


def records(prefix):
    return [json.loads(pathlib.Path(f"{prefix}{rank}.json").read_text()) for rank in (0, 1)]


def test_each_rank_sees_what_a_torchrun_rank_sees(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    real = hangs.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node=2", str(script), f"{tmp_path}/real", "a", "--b"],
                     env=ENV, timeout=120)
    assert real.returncode == 0, real.stderr[-3000:]
    forked = forkrun.run(str(script), [f"{tmp_path}/forked", "a", "--b"], nproc=2, env=ENV,
                         timeout=120)
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert records(f"{tmp_path}/forked") == records(f"{tmp_path}/real")
    assert [r["rank"] for r in records(f"{tmp_path}/forked")] == [0, 1]
    assert records(f"{tmp_path}/forked")[1]["argv"] == ["a", "--b"]


def test_one_plain_process_has_no_rank_and_runs_a_module_as_main(tmp_path):
    done = forkrun.run("json.tool", ["--help"], env=ENV, timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout  # argparse under __main__
    script = _write(tmp_path, "import os\nprint('RANK' in os.environ, __name__)")
    assert forkrun.run(str(script), env=ENV, timeout=60).stdout == "False __main__\n"


def _write(tmp_path, code, name="script.py"):
    path = tmp_path / name
    path.write_text(code)
    return path


def test_a_refusal_exits_1_with_its_message_and_the_other_ranks_are_stopped(tmp_path):
    script = _write(tmp_path, textwrap.dedent("""
        import os, time
        if os.environ["RANK"] == "1":
            raise SystemExit("error: rank 1 refuses")
        time.sleep(600)  # rank 0 would wait for ever: torchrun stops it
    """))
    done = forkrun.run(str(script), nproc=2, env=ENV, timeout=60, grace=1)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: rank 1 refuses"


def test_an_exception_prints_its_traceback_and_a_signal_is_its_number_plus_128(tmp_path):
    raised = forkrun.run(str(_write(tmp_path, "raise ValueError('bad value')")), env=ENV,
                         timeout=60)
    assert raised.returncode == 1 and "ValueError: bad value" in raised.stderr
    assert "Traceback" in raised.stderr
    killed = forkrun.run(str(_write(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
                                    "kill.py")), env=ENV, timeout=60)
    assert killed.returncode == 128 + 9


def test_a_hang_raises_with_the_stack_it_hangs_in(tmp_path):
    script = _write(tmp_path, textwrap.dedent("""
        import time
        def waits_for_ever():
            time.sleep(600)
        print("started", flush=True)
        waits_for_ever()
    """))
    with pytest.raises(hangs.Hang) as hang:
        forkrun.run(str(script), nproc=2, env=ENV, timeout=5)
    assert hang.value.output == "started\nstarted\n"  # what the ranks printed before
    if hangs.py_spy() is not None:
        assert "waits_for_ever" in hang.value.stacks


@pytest.mark.parametrize("nproc", [0, -1, 1.5, True, "2"])
def test_a_bad_number_of_processes_is_refused(nproc):
    with pytest.raises(ValueError, match="nproc must be None"):
        forkrun.run("json.tool", nproc=nproc)
