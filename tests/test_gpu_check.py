"""`make gpu-check`: its collective checks are real (they pass on CPU ranks with gloo, and fail when
the thing they check is broken); without CUDA it says so, writes nothing and exits 0."""

import json
import os
import types

import pytest
import torch

import utils.gpu_check as gpu_check
import utils.metrics
from utils.gpu_check import collective_checks, main
from utils.launch import run_distributed


def test_the_collective_checks_pass_on_cpu_ranks_with_gloo():
    per_rank = run_distributed(collective_checks, 3, "cpu")
    assert per_rank == [{"sum_over_ranks": True, "gather_by_index": True, "NaiveDDP": True,
                         "BucketedDDP": True, "SyncBatchNorm": True}] * 3


def test_the_collective_checks_catch_a_broken_sum():
    def broken(device_type):
        dist = utils.metrics.dist
        real = dist.all_reduce

        def all_reduce_except_float64(tensor, *args, **kwargs):  # sum_over_ranks's tensor is float64
            return None if tensor.dtype == torch.float64 else real(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce_except_float64
        return collective_checks(device_type)

    assert [r["sum_over_ranks"] for r in run_distributed(broken, 2, "cpu")] == [False, False]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for machines without CUDA")
def test_without_cuda_it_says_so_and_exits_0(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert "torch.cuda.is_available() is False" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def fake_torchrun(differ=False, fail=None):
    """Stands in for torchrun: writes what the script would (final weights, metrics)."""
    def run(nproc, args, extra=(), timeout=0):
        out = args[args.index("--out") + 1]
        name = os.path.basename(out)
        if name == fail:
            return 1, "", "Traceback ... RuntimeError: NCCL error"
        os.makedirs(out, exist_ok=True)
        weight = torch.ones(3) + (1e-7 if differ and name == "killed_and_restarted" else 0)
        torch.save({"w": weight}, os.path.join(out, "model_final.pt"))
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"epoch": 2, "images_per_s": 1234.5}) + "\n")
        resumed = "resumed from x: epoch 0, step 20\n" if "--resume" in args else ""
        return 0, resumed + "done", "UserWarning: foo_backward_cuda does not have a deterministic implementation"
    return run


@pytest.mark.parametrize("differ, fail, passed", [(False, None, True), (True, None, False),
                                                  (False, "killed_and_restarted", False)])
def test_the_training_verdict(tmp_path, monkeypatch, differ, fail, passed):
    monkeypatch.setattr(gpu_check, "_torchrun", fake_torchrun(differ, fail))
    result = gpu_check.training_checks(8, str(tmp_path))
    assert result["passed"] is passed
    assert result["bit_identical_after_restart"] is (not differ and fail is None)
    assert "--global-batch 1024" in result["command"]  # 128 per GPU: splits over any number of GPUs
    if fail is None:
        assert result["runs"]["uninterrupted"]["nondeterministic_ops"] == ["foo_backward_cuda"]
        assert result["train_images_per_s_last_epoch"] == 1234.5


def test_the_results_file_on_a_pretend_gpu_machine(tmp_path, monkeypatch):
    props = types.SimpleNamespace(name="NVIDIA Pretend 80GB", total_memory=80 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(gpu_check, "_torchrun", fake_torchrun())
    monkeypatch.setattr("utils.launch.run_distributed",
                        lambda fn, n, *a, **k: [{"sum_over_ranks": True}, {"sum_over_ranks": False}])
    assert gpu_check.main(["--out", str(tmp_path)]) == 1  # one rank's check failed
    report = json.loads((tmp_path / "gpu_check_nvidia_pretend_80gb.json").read_text())
    assert report["passed"] is False and report["checks"]["collectives"]["passed"] is False
    assert report["checks"]["training"]["passed"] is True
    assert report["environment"]["gpus"] == ["NVIDIA Pretend 80GB"] * 2 and report["date"]
