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
