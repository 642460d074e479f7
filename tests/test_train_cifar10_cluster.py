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
    monkeypatch.setattr(train.steps, "set_up_job", broken)
    monkeypatch.setattr(sys, "argv", ["train_cifar10", "--out", str(tmp_path / "run")])
    with pytest.raises(RuntimeError, match="GPU 3 is gone"):
        train.run()  # what `python -m utils.train_cifar10` runs
    written = json.loads(error_file.read_text())["message"]
    assert "GPU 3 is gone" in written["message"]
    assert "broken" in written["extraInfo"]["py_callstack"]


def test_a_checkpoint_is_renamed_into_place_and_its_folder_flushed(tmp_path,
                                                                    monkeypatch):
    flushed = []
    monkeypatch.setattr(train.checkpoints, "_fsync_folder", flushed.append)
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
    monkeypatch.setattr(train.steps, "setup_distributed", lambda device, timeout: three)
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
    preemption = sys.modules["utils.train_cifar10.preemption"]
    clock = [0.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    stop, seen = train.Preemption(check_seconds), []
    for step, seconds in enumerate(step_seconds, start=1):
        clock[0] += seconds
        if stop.due(step):
            stop.agreed(False, step=step)
            seen.append(step)
    assert seen == checks


def test_the_test_set_on_the_device_gives_the_workers_loaders_exact_batches(tmp_path):
    """With the GPU loader the test set is held on the device, normalised once: each batch is
    a slice of it, with the values (bits) and labels the DataLoader's batches have, rank by
    rank (uneven shards, no padding)."""
    from utils.data import load_cifar10, write_synthetic_cifar10

    write_synthetic_cifar10(str(tmp_path), n_train=64, n_test=1030, seed=0)
    test_set = train.KeyedAugment(load_cifar10(str(tmp_path), train=False), 0, train=False)
    args = train.parse_args(["--workers", "0"])
    for rank in range(3):
        job = train.Job(True, rank, rank, 3, torch.device("cpu"), 8, channels_last=True)
        workers = list(train.make_test_loader(args, job, test_set, "workers", {}))
        resident = train.make_test_loader(args, job, test_set, "gpu", {})
        assert [len(y) for _, y in resident] == [len(y) for _, y in workers] == [343 + (rank == 0)]
        for (x, y), (xw, yw) in zip(resident, workers):
            assert torch.equal(x, xw) and torch.equal(y, yw)
            assert x.is_contiguous(memory_format=torch.channels_last)


def test_the_metrics_line_times_evaluation_and_save_and_checkpoint_epochs_skips_saves(tmp_path):
    """On main every epoch's end wrote a full checkpoint and evaluated, inside no timed figure."""
    out = tiny_run(tmp_path, "--epochs", "3", "--checkpoint-epochs", "2", "--keep-checkpoints", "5")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(line["eval_seconds"] > 0 for line in lines)
    saved = [line["save_seconds"] > 0 for line in lines]
    assert saved == [False, True, True]  # epoch 2 (every 2nd) and 3 (the last)
    assert sorted(os.listdir(out)) == ["checkpoint-step16.pt", "checkpoint.pt", "done.json",
                                       "metrics.jsonl", "model_final.pt"]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 24


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """The reads of a tensor's values by the host that an operation makes (``.item()``,
    ``bool``, ``float``, ``torch.equal``): each makes the host wait for a GPU."""
    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
             torch.ops.aten.is_nonzero.default)

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_training_step_with_the_gpu_loader_makes_the_host_wait_for_nothing(tmp_path, monkeypatch):
    """Steps 3 to 5 of a run with the GPU loader (here on the CPU), the loop's own work between
    the steps included: no read of a tensor's value, no copy to the host. On a GPU each would
    make the host wait, and the GPU then idles until the host has queued the next kernels.
    (The loop reads the loss every --log-every steps, and agrees on a stop every 10: neither
    falls in steps 3 to 5. --amp fp16 on CUDA: the fused SGD takes the scaler's inf flag on
    the device; an optimizer that is not fused makes GradScaler.step read it every step.)"""
    reads, mode = [], HostReads()
    for name in ("tolist", "numpy", "cpu"):  # no operation of their own to see
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _method=method, **kwargs):
            if mode in reads:
                mode.seen.append(_name)
            return _method(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    step = train.train_step

    def watched(args, job, training, *rest):
        if training.step == 2:
            mode.__enter__()
            reads.append(mode)
        elif training.step == 5:
            reads.remove(mode)
            mode.__exit__(None, None, None)
        return step(args, job, training, *rest)

    from utils.data import write_synthetic_cifar10
    write_synthetic_cifar10(str(tmp_path / "data"), n_train=512, n_test=64, seed=0)
    train.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--epochs", "1",
                "--global-batch", "64", "--workers", "0", "--no-progress", "--device", "cpu",
                "--loader", "gpu"], step=watched)
    assert not reads and mode.seen == []


def test_a_resume_keeps_this_runs_fused_sgd_whatever_the_checkpoint_had(tmp_path, monkeypatch):
    """Optimizer.load_state_dict replaces the param groups, "fused" with them: a CUDA run resumed
    from a checkpoint of a CPU run (unfused) ran unfused, and with --amp fp16 its scaler's step
    failed ("Expected grad_scale and found_inf to be None"). Fused SGD runs on the CPU too."""
    out = tiny_run(tmp_path, "--stop-at-step", "2")  # on the CPU: not fused
    build, resume, seen = train.steps.build_model, train.steps.resume_or_start, []
    monkeypatch.setattr(train.steps, "build_model",
                        lambda args, steps, fused=False: build(args, steps, fused=True))
    monkeypatch.setattr(train.steps, "resume_or_start",
                        lambda *args: seen.append(resume(*args)) or seen[-1])
    train.main(["--data", str(tmp_path / "data"), "--out", str(out), "--epochs", "1",
                "--global-batch", "64", "--workers", "0", "--no-progress", "--device", "cpu",
                "--resume", "--stop-at-step", "3"])
    assert [g["fused"] for g in seen[0].optimizer.param_groups] == [True]
