"""utils.train_cifar10 on a cluster, checked in-process (no ranks started): srun
without torchrun is refused, a rank's exception reaches torchrun's error file, and a
checkpoint's rename is flushed to disk with its folder."""

import json
import os
import sys

import pytest
import torch

import utils.train_cifar10 as train


@pytest.mark.parametrize("env", [{}, {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}])
def test_one_process_outside_srun_or_one_srun_task_is_accepted(env):
    train.refuse_srun_without_torchrun(env)


def test_several_srun_tasks_without_torchrun_are_refused_before_anything_starts(
        monkeypatch):
    with pytest.raises(SystemExit, match=r"started by srun as task 2 of 4 without "
                                         r"torchrun .* one torchrun per node"):
        train.refuse_srun_without_torchrun({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    with pytest.raises(SystemExit, match="task 3 of 4"):
        train.setup_distributed("cpu")
    assert not torch.distributed.is_initialized()


def test_an_exception_in_main_is_written_to_torchruns_error_file(tmp_path, monkeypatch):
    """torchrun sets TORCHELASTIC_ERROR_FILE for each rank; with @record on the entry
    point, the rank's exception and traceback land there and torchrun prints them
    (without it, torchrun reports `error_file: <N/A>`)."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def broken(args):
        raise RuntimeError("the node's GPU 3 is gone")
    monkeypatch.setattr(train, "set_up_job", broken)
    monkeypatch.setattr(sys, "argv", ["train_cifar10", "--out", str(tmp_path / "run")])
    with pytest.raises(RuntimeError, match="GPU 3 is gone"):
        train.run()  # what `python -m utils.train_cifar10` runs
    written = json.loads(error_file.read_text())["message"]
    assert "GPU 3 is gone" in written["message"]
    assert "broken" in written["extraInfo"]["py_callstack"]


def test_a_checkpoint_is_renamed_into_place_and_its_folder_flushed(tmp_path,
                                                                    monkeypatch):
    flushed = []
    monkeypatch.setattr(train, "_fsync_folder", flushed.append)
    path = tmp_path / "model_final.pt"
    train.save_checkpoint(str(path), {"w": torch.arange(3)})
    assert flushed == [str(tmp_path)]
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(3))
    assert os.listdir(tmp_path) == ["model_final.pt"]  # no temporary file left
    train._fsync_folder(str(tmp_path))  # the real one runs here without error


@pytest.mark.parametrize("argv", [["torchrun", "--nnodes=1:2", "-m", "x"],
                                  ["torchrun", "--nnodes", "2:4", "-m", "x"]])
def test_an_elastic_nnodes_range_is_refused(argv):
    with pytest.raises(SystemExit, match=r"elastic job.*fixed one: --nnodes=N"):
        train.refuse_elastic_nnodes(argv)


@pytest.mark.parametrize("argv", [[], ["torchrun", "--nnodes=2", "-m", "x"],
                                  ["torchrun", "--nnodes=2:2"], ["python", "-m", "x"]])
def test_a_fixed_number_of_nodes_is_accepted(argv):
    train.refuse_elastic_nnodes(argv)


def test_the_launchers_command_line_is_read_from_proc():
    if not os.path.exists(f"/proc/{os.getppid()}/cmdline"):
        pytest.skip("no /proc here: the check is skipped on such systems")
    assert train.launcher_args()[0]  # this process's parent: a shell, pytest-xdist...


def test_a_global_batch_that_does_not_split_lists_the_process_counts_it_splits_over():
    assert train.per_process_batch(64, 4) == 16
    with pytest.raises(SystemExit, match=r"--global-batch 64 does not split evenly over 3 "
                                         r"processes; it splits over 1, 2, 4, 8, 16, 32 "
                                         r"or 64 processes.*e\.g\. 63 or 66"):
        train.per_process_batch(64, 3)


def tiny_run(tmp_path, *extra):
    """main in-process on 512 synthetic images: 8 steps of 64 per epoch."""
    from utils.data import write_synthetic_cifar10

    data = tmp_path / "data"
    if not data.exists():
        write_synthetic_cifar10(str(data), n_train=512, n_test=64, seed=0)
    train.main(["--data", str(data), "--out", str(tmp_path / "out"), "--epochs", "1",
                "--global-batch", "64", "--workers", "0", "--no-progress",
                "--device", "cpu", *extra])
    return tmp_path / "out"


def test_a_resume_on_a_count_that_does_not_split_checks_the_checkpoint_first(
        tmp_path, monkeypatch, capsys):
    """On main, resuming a G=64 run on 3 processes advised 'use 63 or 66', and
    --global-batch 66 was then refused by the checkpoint: now the checkpoint is read
    first, and the message lists the counts its global batch splits over."""
    out = tiny_run(tmp_path, "--stop-at-step", "2")
    three = (False, 0, 0, 3, torch.device("cpu"))  # as rank 0 of 3 would see it
    monkeypatch.setattr(train, "setup_distributed", lambda device, timeout: three)
    common = ["--data", str(tmp_path / "data"), "--out", str(out), "--resume",
              "--epochs", "1", "--device", "cpu", "--workers", "0"]
    with pytest.raises(SystemExit, match=r"cannot resume .*--global-batch 66 "
                                         r"\(checkpoint: 64\)"):
        train.main([*common, "--global-batch", "66"])
    with pytest.raises(SystemExit, match=r"splits over 1, 2, 4, 8, 16, 32 or 64"):
        train.main([*common, "--global-batch", "64"])


def test_the_last_k_checkpoints_are_kept(tmp_path):
    out = tiny_run(tmp_path, "--checkpoint-every", "2", "--keep-checkpoints", "3")
    names = sorted(os.listdir(out))
    # saves at steps 2, 4, 6 and 8 (the epoch's end): the newest, and the 2 before it
    assert names == ["checkpoint-step4.pt", "checkpoint-step6.pt", "checkpoint.pt",
                     "done.json", "metrics.jsonl", "model_final.pt"]
    for name, step in [("checkpoint-step4.pt", 4), ("checkpoint-step6.pt", 6),
                       ("checkpoint.pt", 8)]:
        assert torch.load(out / name, weights_only=True)["step"] == step


def test_a_scheduler_whose_state_holds_a_method_still_saves_a_weights_only_checkpoint(
        tmp_path, monkeypatch):
    """torch 2.2-2.3 (which requirements.txt admits) put OneCycleLR's anneal_func, a
    bound method, in its state_dict: torch.load(weights_only=True) refused every
    checkpoint. Here today's torch is made to do the same."""
    state_dict = torch.optim.lr_scheduler.OneCycleLR.state_dict

    def old_state_dict(self):
        return {**state_dict(self), "anneal_func": self._anneal_func}
    monkeypatch.setattr(torch.optim.lr_scheduler.OneCycleLR, "state_dict",
                        old_state_dict)
    out = tiny_run(tmp_path, "--stop-at-step", "3")
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert "anneal_func" not in state["scheduler"] and state["step"] == 3
    tiny_run(tmp_path, "--resume")  # loads it, and the schedule goes on
    assert (out / "model_final.pt").exists()


@pytest.mark.parametrize("total", [3, 4, 5, 7, 8, 100])
def test_the_schedule_runs_on_short_runs_too(total):
    """4 steps in all (1 epoch of 4 global batches) warmed up over 0 steps, and OneCycleLR
    divided by zero."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = train.one_cycle(optimizer, 0.1, total)
    rates = []  # the learning rate of each step
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] == pytest.approx(0.1 / 25) and max(rates) == pytest.approx(0.1)
    assert rates[-1] < rates[0]  # warm-up, then down to about 0


def test_a_run_with_fewer_than_3_steps_is_refused():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(SystemExit, match="2 optimizer step.*needs at least 3"):
        train.one_cycle(optimizer, 0.1, 2)


def test_setting_a_name_on_the_package_reaches_the_modules_that_use_it_and_undo_restores_it(monkeypatch):
    """utils.train_cifar10 is a package; a test or script that sets a name on it (as on the one-file
    script it was) must change what the modules that use the name call, and monkeypatch's undo (which
    deletes a name the package did not hold itself) must put the modules' own back."""
    import time

    steps, preemption = sys.modules["utils.train_cifar10.steps"], sys.modules["utils.train_cifar10.preemption"]
    step, load, every = steps.train_step, steps.load_cifar10, steps.PREEMPTED
    with monkeypatch.context() as patch:
        patch.setattr(train, "train_step", "wrapped")      # defined in steps, re-exported
        patch.setattr(train, "write_atomically", "atomic")  # defined in checkpoints, used by preemption
        patch.setattr(train, "load_cifar10", "loader")      # only imported by steps (from utils.data)
        patch.setattr(train, "time", "clock")              # a module the modules import
        patch.setattr(train, "PREEMPTED", "other.json")
        assert (steps.train_step, preemption.write_atomically, steps.load_cifar10) == ("wrapped", "atomic",
                                                                                       "loader")
        assert preemption.time == sys.modules["utils.train_cifar10.restarts"].time == "clock"
        assert steps.PREEMPTED == preemption.PREEMPTED == "other.json"
    assert (steps.train_step, steps.load_cifar10, steps.PREEMPTED) == (step, load, every)
    assert preemption.time is time and preemption.write_atomically is train.write_atomically
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        train.no_such_name


@pytest.mark.parametrize("check_seconds, step_seconds, checks", [
    # fast steps: every 10 steps, on multiples of 10 (what the chapters' outputs show)
    (10.0, [0.1] * 30, [10, 20, 30]),
    # 1 s steps with 3 s to stop in: every 3 steps once the first 10 have shown it; then fast again
    (3.0, [1.0] * 20 + [0.1] * 20, [10, 13, 16, 19, 22, 29, 39]),
])
def test_the_ranks_agree_on_a_stop_more_often_where_ten_steps_take_longer_than_stop_check_seconds(
        monkeypatch, check_seconds, step_seconds, checks):
    """On main the ranks agreed every 10 steps whatever a step took: ten slow steps could outlast the
    shutdown budget that a scheduler gives after its signal."""
    from types import SimpleNamespace

    preemption = sys.modules["utils.train_cifar10.preemption"]
    clock = [0.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    stop, job, seen = train.Preemption(check_seconds), SimpleNamespace(ddp=False), []
    for step, seconds in enumerate(step_seconds, start=1):
        clock[0] += seconds
        if stop.due(step):
            stop.agreed(job, step)
            seen.append(step)
    assert seen == checks
