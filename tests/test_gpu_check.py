"""`make gpu-check`: its collective checks are real (they pass on CPU ranks with gloo, and fail when
the thing they check is broken); without CUDA it says so, writes nothing and exits 0. What needs a GPU
is decided by plain functions tested here: which checks run on how many GPUs and what the results file
lists as not checked, the op names read from "no deterministic implementation" warnings and the
allow-list's verdict, the CUDA_VISIBLE_DEVICES split and the torchrun command lines of two nodes. The
multi-rank training checks (resume on fewer ranks, two nodes) also run for real on gloo ranks (the
one-node runs with their ranks forked by utils.forkrun, the two nodes as two real torchruns); the
whole check runs on a pretend GPU machine with torchrun replaced by a stand-in."""

import functools
import json
import os
import sys
import time
import types

import pytest
import torch

import utils.gpu_check as gpu_check
import utils.metrics
from utils import forkrun
from utils.gpu_check import collective_checks, main
from utils.launch import run_distributed


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
def test_without_a_gpu_it_fails_saying_so_unless_allowed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "nvidia_smi_gpus", lambda: [])
    assert main(["--out", str(tmp_path)]) == 1
    said = capsys.readouterr()
    assert "error: no GPU here" in said.err and "--rehearse" in said.err
    assert main(["--out", str(tmp_path), "--allow-no-gpu"]) == 0
    assert "--allow-no-gpu: nothing checked" in capsys.readouterr().out
    # GPUs that nvidia-smi lists and torch cannot use: a failure, whatever --allow-no-gpu says
    monkeypatch.setattr(gpu_check, "nvidia_smi_gpus", lambda: ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"])
    assert main(["--out", str(tmp_path), "--allow-no-gpu"]) == 1
    assert "nvidia-smi lists 1 GPU(s) (GPU 0: NVIDIA H100" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_gpus_that_torch_cannot_use_are_named():
    two = ["GPU 0: A", "GPU 1: B"]
    assert gpu_check.gpu_problem(two, {}, True, 2) is None
    assert "torch sees 1" in gpu_check.gpu_problem(two, {}, True, 1)
    assert gpu_check.gpu_problem(two, {"CUDA_VISIBLE_DEVICES": "1"}, True, 1) is None  # one asked for
    assert "torch cannot use them" in gpu_check.gpu_problem(two, {}, False, 0)
    assert gpu_check.gpu_problem(two, {"CUDA_VISIBLE_DEVICES": ""}, False, 0).startswith("no GPU here")
    assert gpu_check.gpu_problem([], {}, True, 1) is None  # no nvidia-smi, torch sees one: fine


def test_the_quick_plan_fits_its_minutes_by_the_timings_it_states(capsys):
    assert main(["--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out
    total = int(out.split("total")[1].split()[0])
    assert total <= 60 * gpu_check.QUICK_MINUTES
    assert [line.split()[0] for line in out.splitlines()[1:len(gpu_check.QUICK) + 1]] == gpu_check.QUICK
    checks, not_checked = gpu_check.plan(1, profile="quick")
    assert sum(gpu_check.STATED_SECONDS[c][0] for c in checks) == total
    assert checks[-1] == "scripts_speed" and "scripts_speed" in out  # worth least: last, and in the total
    assert gpu_check.SPEED_ONE_GPU in not_checked
    # on 8 GPUs both scripts also run on all of them: more seconds, still within the minutes
    # on 8 GPUs both scripts also run on all of them: what --quick's minutes leave, no more
    lines, total8 = gpu_check.stated_plan(gpu_check.plan(8, profile="quick")[0], 8, gpu_check.QUICK_MINUTES)
    assert total < total8 <= min(total + gpu_check.SEVERAL_GPUS_SECONDS["scripts_speed"][0],
                                 60 * gpu_check.QUICK_MINUTES)
    assert gpu_check.SPEED_ONE_GPU not in gpu_check.plan(8, profile="quick")[1]
    # the checks before scripts_speed leave it time for one run at least
    before = total - gpu_check.stated_seconds("scripts_speed", 1)[0]
    assert 60 * gpu_check.QUICK_MINUTES - before >= 2 * gpu_check.SPEED_MIN_RUN


def test_the_gpu_busy_share_is_the_union_of_the_kernels_over_the_span():
    from utils.step_bench import covered_fraction

    # overlapping kernels count once; what lies outside the span, not at all
    assert covered_fraction([(1, 3), (2, 4), (6, 7), (9, 12)], [(0, 10), (5, 6)]) == 0.5
    assert covered_fraction([], [(0, 10)]) == 0.0


def test_scripts_speed_starts_no_run_after_the_quick_deadline(tmp_path, monkeypatch):
    """--quick's minutes bound the whole plan: scripts_speed skips what would start after them."""
    started = []
    monkeypatch.setattr(gpu_check, "DEADLINE", time.perf_counter() + gpu_check.SPEED_MIN_RUN - 1)
    monkeypatch.setattr(gpu_check, "speed_run", lambda *a: started.append(a))
    monkeypatch.setattr("utils.data.write_synthetic_cifar10", lambda root, n_train, n_test: None)
    result = gpu_check.scripts_speed_check(1, str(tmp_path), "cpu")
    assert started == [] and not result["passed"]
    assert all("minutes, were spent" in t["skipped"] for t in result["timings"])


def test_the_quick_profile_rehearsed_on_the_cpu(tmp_path, monkeypatch):
    """The same plan, the same timeouts, for real on 2 gloo ranks: the orchestration works before a GPU
    is seen. (Ranks started by torchrun, as on the GPU.)"""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(gpu_check, "RUN_TIMEOUT", gpu_check.RUN_TIMEOUT)  # main sets it for --quick
    monkeypatch.setattr(gpu_check, "DEADLINE", None)  # and this
    # scripts_speed's 4 runs with forked ranks, not 4 more torchruns (their command lines are tested below)
    monkeypatch.setattr(gpu_check, "_speed_torchrun", lambda nproc, script, args, timeout: forked_torchrun(
        nproc, args, timeout=timeout, module=script))
    code = main(["--quick", "--rehearse", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "gpu_check_rehearsal_cpu_quick.json").read_text())
    assert report["rehearsal"] and report["device"] == "cpu" and report["world_size"] == 2
    assert report["run_timeout_s"] == gpu_check.QUICK_RUN_TIMEOUT
    checks = report["checks"]
    assert list(checks) == gpu_check.QUICK + ["nondeterministic_ops"]
    assert checks["collectives"]["per_rank"] == [{"sum_over_ranks": True, "gather_by_index": True,
                                                  "NaiveDDP": True, "BucketedDDP": True,
                                                  "SyncBatchNorm": True}] * 2
    assert checks["loader_no_sync"]["batches_equal_cpu"] and checks["loader_no_sync"]["batches"] == 5
    capstone = checks["capstone"]
    assert capstone["bit_identical_after_restart"] and capstone["restarted_run_resumed"] and capstone["fp32_finished"]
    assert capstone["runs"]["amp_killed_and_restarted"]["nccl_pinned"] == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    assert checks["loader_bench"]["result"]["results"] and "resident" in checks["loader_bench"]["table"]
    bench = checks["throughput"]["result"]
    assert bench["world_size"] == 2 and bench["steps_per_epoch"] == 8 and bench["capstone_over_bare"] > 0
    ratios = bench["capstone_over_bare_per_round"]
    assert 0 < ratios["min"] <= ratios["median"] == bench["capstone_over_bare"] <= ratios["max"]
    assert bench["gpu_busy"] == {"bare": None, "capstone": None}  # no CUDA: no kernel to time
    assert bench["capstone_host_syncs_per_epoch"] is None
    assert bench["ceiling"]["steps_per_s"] > 0 and bench["capstone_over_ceiling"] > 0
    compiled = checks["compiled_step"]["result"]
    assert compiled["ceiling"] is None and "--no-ceiling" in compiled["command"]
    speed = checks["scripts_speed"]
    assert (speed["model"], speed["train_images"], speed["test_images"]) == ("simplecnn", 128, 32)
    assert [(t["script"], t["world_size"]) for t in speed["timings"]] == [
        ("examples/train_ddp.py", 1), ("utils.train_cifar10", 1), ("examples/train_ddp.py", 2),
        ("utils.train_cifar10", 2)]
    assert all(t["seconds_per_epoch"] is not None and t["images_per_s"] > 0 for t in speed["timings"])
    assert [t["world_size_reported"] for t in speed["timings"][1::2]] == [1, 2]
    assert all(c["passed"] for c in checks.values())


# --- what runs where ----------------------------------------------------------------------------------

FULL_ONE_GPU = ["collectives", "loader_no_sync", "training", "loader_workers", "compile", "amp_fp16",
                "loader_bench", "throughput"]


def test_on_one_gpu_the_multi_rank_checks_are_listed_as_not_checked_with_their_reason():
    checks, not_checked = gpu_check.plan(1)
    assert checks == FULL_ONE_GPU
    assert "resume on fewer GPUs: needs 2 GPUs" in not_checked
    assert any(line.startswith("two nodes (") and line.endswith("needs 2 GPUs") for line in not_checked)
    assert any(line.startswith("collectives over several ranks: needs 2 GPUs") for line in not_checked)
    assert any(line.startswith("training over several ranks") for line in not_checked)
    assert gpu_check.SEVERAL_MACHINES in not_checked  # two torchruns on one machine are not two machines
    assert any(line.startswith("make test: not asked") for line in not_checked)


@pytest.mark.parametrize("gpus", [2, 3, 8])
def test_with_several_gpus_every_check_runs(gpus):
    checks, not_checked = gpu_check.plan(gpus, make_test=True)
    assert checks == FULL_ONE_GPU[:6] + ["resume_on_fewer_gpus", "two_nodes"] + FULL_ONE_GPU[6:] + ["make_test"]
    assert not_checked == [gpu_check.SEVERAL_MACHINES]
    assert set(checks) <= set(gpu_check.CHECKS)


def test_compile_and_fp16_where_unavailable_are_recorded_with_the_reason():
    checks, not_checked = gpu_check.plan(4, "needs Triton", "not in this version of utils.train_cifar10")
    assert "compile" not in checks and "amp_fp16" not in checks
    assert "--compile: needs Triton" in not_checked
    assert "--amp fp16: not in this version of utils.train_cifar10" in not_checked


def test_compile_unavailable_gives_the_scripts_reason(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    assert gpu_check.compile_unavailable() == (None if real("triton") else gpu_check.compile_unavailable())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    reason = gpu_check.compile_unavailable()
    assert reason.startswith("--compile on CUDA needs Triton")
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    assert "does not support this Python" in gpu_check.compile_unavailable()


def test_amp_fp16_is_checked_exactly_when_the_script_takes_the_option(monkeypatch):
    import contextlib
    import io

    import utils.train_cifar10 as script

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        script.parse_args(["--help"])
    assert (gpu_check.amp_fp16_unavailable() is None) == ("fp16" in help_text.getvalue())

    monkeypatch.setattr(script, "parse_args", lambda argv: types.SimpleNamespace(amp=argv[-1]))
    assert gpu_check.amp_fp16_unavailable() is None

    def old_parser(argv):  # --amp without a value: argparse stops on "fp16"
        print("usage: ... unrecognized arguments: fp16", file=sys.stderr)
        raise SystemExit(2)

    monkeypatch.setattr(script, "parse_args", old_parser)
    assert gpu_check.amp_fp16_unavailable() == "not in this version of utils.train_cifar10"


# --- ops without a deterministic kernel ---------------------------------------------------------------

STDERR = """\
[rank0]:/x/torch/autograd/graph.py:829: UserWarning: adaptive_avg_pool2d_backward_cuda does not have a \
deterministic implementation, but you set 'torch.use_deterministic_algorithms(True, warn_only=True)'. \
You can file an issue at https://github.com/pytorch/pytorch/issues (Triggered internally at Context.cpp:96.)
  return Variable._execution_engine.run_backward(
[W710 10:11:12.000 Context.cpp:96] Warning: scatter_add_cuda_kernel does not have a deterministic \
implementation, but you set 'torch.use_deterministic_algorithms(True, warn_only=True)'.
/x/utils/foo.py:3: UserWarning: adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation
index_add_cuda_ does not have a deterministic implementation, but you set ...
UserWarning: something else entirely
"""


def test_the_op_names_are_read_from_the_warnings_whatever_the_prefix():
    assert gpu_check.nondeterministic_ops(STDERR) == ["adaptive_avg_pool2d_backward_cuda", "index_add_cuda_",
                                                      "scatter_add_cuda_kernel"]
    assert gpu_check.nondeterministic_ops("all fine\n") == []


def test_an_op_off_the_allow_list_fails_and_every_op_seen_is_listed():
    checks = {"training": {"runs": {"uninterrupted": {"nondeterministic_ops": ["a_cuda", "b_cuda"]},
                                    "speed": {"nondeterministic_ops": []}}},
              "two_nodes": {"runs": {"node1": {"nondeterministic_ops": ["b_cuda"]}}},
              "collectives": {"per_rank": [], "passed": True}}
    verdict = gpu_check.nondeterminism_verdict(checks, allowed={"b_cuda": "why b is tolerated"})
    assert verdict == {"seen": {"a_cuda": ["training/uninterrupted"],
                                "b_cuda": ["training/uninterrupted", "two_nodes/node1"]},
                       "allowed": {"b_cuda": "why b is tolerated"}, "unexpected": ["a_cuda"], "passed": False}
    allowed = {"a_cuda": "why a is", "b_cuda": "why b is"}
    assert gpu_check.nondeterminism_verdict(checks, allowed=allowed)["passed"] is True
    assert gpu_check.nondeterminism_verdict({})["passed"] is True


def test_every_allowed_op_says_why_it_is_tolerated():
    for op, reason in gpu_check.ALLOWED_NONDETERMINISTIC_OPS.items():
        assert op and " " not in op and isinstance(reason, str) and len(reason) > 20


# --- two nodes, fewer GPUs: the numbers and the command lines -----------------------------------------

def test_the_gpus_are_split_between_the_nodes_as_the_parent_sees_them():
    assert gpu_check.visible_devices({}, 4) == ["0", "1", "2", "3"]
    assert gpu_check.visible_devices({"CUDA_VISIBLE_DEVICES": "4,5, 6,7"}, 4) == ["4", "5", "6", "7"]
    assert gpu_check.visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2,GPU-c3"}, 2) == ["GPU-a1", "GPU-b2"]
    # the global batch (128 per GPU) must split over the two nodes' ranks
    assert [gpu_check.gpus_per_node(n, 128 * n) for n in (1, 2, 3, 4, 7, 8)] == [None, 1, 1, 2, 2, 4]
    assert [gpu_check.fewer_gpus(n, 128 * n) for n in (1, 2, 3, 4, 7, 8)] == [None, 1, 2, 2, 4, 4]


def test_the_two_torchruns_form_one_job_with_a_static_rendezvous():
    launches = gpu_check.two_node_launches(["4", "5", "6", "7"], 2, 29511, [["--out", "a"], ["--out", "b"]])
    for node, (cmd, env) in enumerate(launches):
        assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
        assert cmd[3:8] == ["--nnodes=2", f"--node-rank={node}", "--master-addr=127.0.0.1",
                            "--master-port=29511", "--nproc_per_node=2"]
        assert cmd[8:] == ["-m", "utils.train_cifar10", "--out", "ab"[node]]
        assert not any(c.startswith("--rdzv") or c == "--standalone" for c in cmd)
    assert [env for _, env in launches] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert gpu_check.torchrun_command(3, ["--x"]) == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      "--nproc_per_node=3", "-m", "utils.train_cifar10", "--x"]
    assert gpu_check.torchrun_command(2, ["--x"], module="examples/train_ddp.py")[4:] == [
        "--nproc_per_node=2", "examples/train_ddp.py", "--x"]  # a file, not a module


def test_the_runs_arguments():
    common = gpu_check.common_args(8, "/w")
    assert "--global-batch 1024" in " ".join(common)  # 128 per GPU: splits over any number of GPUs
    assert "--synthetic-size 40960 2048" in " ".join(common) and "--checkpoint-every 10" in " ".join(common)
    assert gpu_check.break_step(common) == 25  # after the checkpoint at step 20
    fp16 = gpu_check._with(common, "--amp", "fp16")
    assert fp16[fp16.index("--amp"):][:3] == ["--amp", "fp16", "--sync-bn"]
    assert gpu_check._with(fp16, "--amp", "bf16").count("fp16") == 0
    assert gpu_check._with(common, "--data", "/n1")[:2] == ["--data", "/n1"]
    cpu = gpu_check.common_args(2, "/w", "cpu")
    assert "--amp" not in cpu and gpu_check.break_step(cpu) == 5 and gpu_check._arg(cpu, "--device") == "cpu"


LIKE_TORCHRUN = """
import subprocess, sys, time
# a rank in a session of its own, as torchrun starts them
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(rank.pid, flush=True)
time.sleep(60)
"""


def test_processes_are_run_together_and_killed_with_their_ranks_at_the_timeout():
    import psutil

    python = sys.executable
    t0 = time.perf_counter()
    results = gpu_check._run_processes([([python, "-c", "import os; print(os.environ['X'])"], {"X": "one"}),
                                        ([python, "-c", "import sys; sys.exit('two')"], {})], timeout=60)
    assert results == [(0, "one\n", ""), (1, "", "two\n")]
    results = gpu_check._run_processes([([python, "-c", "print('x' * 200000, flush=True)"], {}),
                                        ([python, "-c", LIKE_TORCHRUN], {})], timeout=3)
    assert results[0] == (0, "x" * 200000 + "\n", "")  # more than a pipe holds
    assert results[1][0] == -9 and "(gpu-check: stopped, still running at the time limit;" in results[1][2]
    assert results[1][2].count("--- pid") == 2  # the stack of the launcher and of its rank
    rank = int(results[1][1])
    time.sleep(0.5)
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
    assert time.perf_counter() - t0 < 30


def test_when_one_node_fails_the_other_is_stopped_after_a_grace_period(monkeypatch):
    monkeypatch.setattr(gpu_check, "FAILED_NODE_GRACE", 1)
    t0 = time.perf_counter()
    results = gpu_check._run_processes([([sys.executable, "-c", "import sys; sys.exit(3)"], {}),
                                        ([sys.executable, "-c", "import time; time.sleep(60)"], {})], timeout=60)
    assert [r[0] for r in results] == [3, -9] and time.perf_counter() - t0 < 20


# --- the multi-rank training checks, for real on gloo ranks -------------------------------------------

def forked_torchrun(nproc, script_args, extra=(), timeout=None, env=None, module="utils.train_cifar10"):
    """gpu_check's one-node torchrun, with each rank forked from a server that imported torch
    once (utils.forkrun: the environment of a torchrun rank): the subject here is what the checks
    run and conclude, not how torchrun starts ranks, which the two nodes still do for real."""
    assert not extra, f"a torchrun option that forkrun does not emulate: {extra}"
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **(env or {})}
    done = forkrun.run(module, script_args, nproc=nproc, env=env, timeout=timeout or gpu_check.RUN_TIMEOUT,
                       cwd=gpu_check.ROOT)
    return done.returncode, done.stdout, done.stderr


def test_resume_on_fewer_ranks_and_two_nodes_on_gloo_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(gpu_check, "_torchrun", forked_torchrun)
    work = str(tmp_path)
    fewer = gpu_check.fewer_gpus_check(2, work, device="cpu")
    assert fewer["passed"], json.dumps(fewer, indent=1)[-4000:]
    assert fewer["gpus"] == [2, 1] and fewer["resumed"] and fewer["ran_on_fewer"]
    assert fewer["reference_run"] == "uninterrupted" and fewer["runs"]["uninterrupted"]["returncode"] == 0
    assert fewer["relative_distance"] < 1e-3 and not fewer["runs"]["uninterrupted"]["nondeterministic_ops"]
    nodes = gpu_check.two_nodes_check(2, work, device="cpu")
    assert nodes["passed"], json.dumps(nodes, indent=1)[-4000:]
    assert nodes["reference_run"].startswith("uninterrupted, from an earlier check") and "uninterrupted" not in nodes["runs"]
    assert nodes["world_size"] == 2 and nodes["cuda_visible_devices"] == ["0", "1"]
    for node in (0, 1):  # each node wrote its own data
        assert os.path.isdir(tmp_path / "two_nodes" / f"node{node}" / "data" / "cifar-10-batches-py")
    assert nodes["runs"]["node0"]["metrics"][-1]["world_size"] == 2 and "metrics" not in nodes["runs"]["node1"]


# --- the whole check on a pretend GPU machine ---------------------------------------------------------

@functools.lru_cache
def initial_weights(model):
    from utils.train_cifar10 import make_model

    torch.manual_seed(0)
    return make_model(model).state_dict()


def fake_processes(differ=None, fail=(), warn=None):
    """Stands in for the torchruns: each writes what the script would (checkpoint, final weights, metrics,
    rank 0's lines). `differ`: {run: how far its final weights are moved}; `fail`: runs that exit 1;
    `warn`: an op that warns in --deterministic runs."""
    def other(cmd):  # the loader's no-sync check, the loader and step benchmarks, as they report
        if "examples/train_ddp.py" in cmd:  # its epoch lines (epoch 2: 7.5 s, 5200 images/s)
            return 0, "".join(f"epoch {e}/2: train loss 1.0, test accuracy 0.5 (10000 images); {9.5 - e} s, "
                              f"{5000 + 100 * e} images/s on 1 process\n" for e in (1, 2)), ""
        if "-c" in cmd:
            return 0, json.dumps({"batches": 5, "host_syncs_checked": True, "host_sync_error": None,
                                  "batches_equal_cpu": True, "passed": True}) + "\n", ""
        bench = "utils.bench" in cmd
        with open(cmd[cmd.index("--out" if bench else "--result") + 1], "w") as f:
            json.dump({"results": [{"method": "pil_dataloader"}]} if bench else {"capstone_over_bare": 0.97}, f)
        return 0, "a table", ""

    def one(cmd, env):
        if "utils.train_cifar10" not in cmd:
            return other(cmd)
        launch, args = cmd[:cmd.index("utils.train_cifar10")], cmd[cmd.index("utils.train_cifar10") + 1:]
        nproc = int(next(c for c in launch if c.startswith("--nproc_per_node=")).split("=")[1])
        nodes = 2 if "--nnodes=2" in launch else 1
        out = args[args.index("--out") + 1]
        name = os.path.basename(os.path.dirname(out)) if nodes == 2 else os.path.basename(out)
        if name in fail:
            return 1, "", "Traceback ... RuntimeError: NCCL error"
        stderr = (f"UserWarning: {warn} does not have a deterministic implementation, but ..."
                  if warn and "--deterministic" in args else "")
        if "--node-rank=1" in launch:
            return 0, "", stderr
        os.makedirs(out, exist_ok=True)
        scaler = {"scale": 32768.0, "_growth_tracker": 7} if "fp16" in args else {}  # a GradScaler's, or off
        torch.save({"model": {}, "scaler": scaler}, os.path.join(out, "checkpoint.pt"))
        world, batch = nproc * nodes, int(args[args.index("--global-batch") + 1])
        loader = "workers" if "workers" in args else "gpu"
        stdout = (f"synthetic CIFAR-10 in x: ...; global batch {batch} = {batch // world} x {world}\n"
                  f"loader: {loader} (...); channels_last: yes; compile: {'yes' if '--compile' in args else 'no'}\n")
        if "--resume" in args:
            stdout += "resumed from x: epoch 1, step 20 of the epoch (20 in all)\n"
        if "--stop-at-step" in args:
            return 0, stdout, stderr
        model = args[args.index("--model") + 1]
        offset = 0.01 + (differ or {}).get(name, 0)
        torch.save({k: v + offset if v.is_floating_point() else v for k, v in initial_weights(model).items()},
                   os.path.join(out, "model_final.pt"))
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            for epoch in (1, 2):
                f.write(json.dumps({"epoch": epoch, "train_loss": 2.0 / epoch,
                                    "images_per_s": 1000.0 if epoch == 1 else 1234.5,
                                    "epoch_seconds": 4.0 + epoch / 10, "world_size": world,
                                    "loader": loader}) + "\n")
        return 0, stdout, stderr

    return lambda launches, timeout=0: [one(cmd, env) for cmd, env in launches]


@pytest.mark.parametrize("differ, fail, passed", [(None, (), True), ({"killed_and_restarted": 1e-5}, (), False),
                                                  (None, ("killed_and_restarted",), False)])
def test_the_training_verdict(tmp_path, monkeypatch, differ, fail, passed):
    monkeypatch.setattr(gpu_check, "_run_processes", fake_processes(differ, fail, warn="foo_backward_cuda"))
    result = gpu_check.training_checks(8, str(tmp_path))
    assert result["passed"] is passed
    assert result["bit_identical_after_restart"] is (not differ and not fail)
    assert "--global-batch 1024" in result["command"]  # 128 per GPU: splits over any number of GPUs
    if not fail:
        assert result["runs"]["uninterrupted"]["nondeterministic_ops"] == ["foo_backward_cuda"]
        assert result["runs"]["speed"]["nondeterministic_ops"] == []  # no --deterministic, no warning
        assert result["images_per_s_last_epoch_with_sync_bn_and_checkpoints"] == 1234.5
        assert result["loaders"] == ["gpu"]
        assert result["relative_distance_speed_run_to_deterministic"] == 0.0


# --- scripts_speed: the two scripts' seconds per epoch and images/s -----------------------------------

def test_scripts_speed_times_both_scripts_on_one_gpu_and_on_all(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr("utils.data.write_synthetic_cifar10",
                        lambda root, n_train, n_test: written.append((root, n_train, n_test)))
    monkeypatch.setattr(gpu_check, "_run_processes", fake_processes())
    result = gpu_check.scripts_speed_check(2, str(tmp_path))
    data = str(tmp_path / "speed_data")
    assert written == [(data, 50000, 10000)]  # once, for both scripts
    timings = result["timings"]
    assert [(t["script"], t["world_size"]) for t in timings] == [
        ("examples/train_ddp.py", 1), ("utils.train_cifar10", 1), ("examples/train_ddp.py", 2),
        ("utils.train_cifar10", 2)]
    ddp = f"--data {data} --model resnet18 --epochs 2 --global-batch {{}} --device cuda --out {tmp_path}/speed_"
    # 128 images a GPU, as the book's commands: a global batch of 128 on one, 256 on two
    assert timings[0]["command"] == ("torchrun --standalone --nproc_per_node=1 examples/train_ddp.py "
                                     + ddp.format(128) + "train_ddp_1")
    assert timings[3]["command"] == (f"torchrun --standalone --nproc_per_node=2 -m utils.train_cifar10 "
                                     + ddp.format(256) + "train_cifar10_2 --synthetic --synthetic-size 50000 10000 "
                                     "--amp --no-progress")
    assert result["images_per_gpu"] == 128
    # epoch 2's figures: printed by train_ddp.py, in train_cifar10's metrics.jsonl
    assert [(t["seconds_per_epoch"], t["images_per_s"]) for t in timings] == [(7.5, 5200.0), (4.2, 1234.5)] * 2
    assert [t["world_size_reported"] for t in timings[1::2]] == [1, 2]
    assert all(t["timeout_s"] == gpu_check.SPEED_RUN_TIMEOUT and t["returncode"] == 0 for t in timings)
    assert result["passed"] and (result["model"], result["train_images"]) == ("resnet18", 50000)
    assert [t["world_size"] for t in gpu_check.scripts_speed_check(1, str(tmp_path))["timings"]] == [1, 1]


def test_a_run_without_its_epoch_figures_fails_scripts_speed(tmp_path, monkeypatch):
    monkeypatch.setattr("utils.data.write_synthetic_cifar10", lambda root, n_train, n_test: None)
    fake = fake_processes()

    def no_second_epoch(launches, timeout=0):  # train_ddp.py stops after epoch 1
        code, stdout, stderr = fake(launches)[0]
        return [(code, stdout.split("epoch 2/2")[0], "Killed") if "examples/train_ddp.py" in launches[0][0]
                else (code, stdout, stderr)]

    monkeypatch.setattr(gpu_check, "_run_processes", no_second_epoch)
    result = gpu_check.scripts_speed_check(1, str(tmp_path))
    assert not result["passed"] and result["timings"][1]["images_per_s"] == 1234.5
    assert result["timings"][0]["images_per_s"] is None and result["timings"][0]["stderr_tail"] == "Killed"


def test_scripts_speed_starts_no_run_past_its_budget(tmp_path, monkeypatch):
    now = [0.0]  # a clock that each run moves on by a minute
    monkeypatch.setattr(gpu_check, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr("utils.data.write_synthetic_cifar10", lambda root, n_train, n_test: now.__setitem__(0, 10))
    for name, value in (("SPEED_BUDGET", 150), ("SPEED_RUN_TIMEOUT", 90), ("SPEED_MIN_RUN", 15)):
        monkeypatch.setattr(gpu_check, name, value)
    started = []

    def run(script, nproc, args, timeout):
        started.append((now[0], timeout))
        now[0] += 60
        return {"script": script, "world_size": nproc, "seconds_per_epoch": 1.0, "images_per_s": 2.0}

    monkeypatch.setattr(gpu_check, "speed_run", run)
    result = gpu_check.scripts_speed_check(2, str(tmp_path))
    assert started == [(10, 90), (70, 80), (130, 20)]  # each one's timeout ends it by the budget
    assert result["timings"][3]["skipped"] == "the check's 150 s, or --quick's 6 minutes, were spent" and not result["passed"]
    assert result["data_seconds"] == 10 and result["timings"][3]["command"].startswith(
        "torchrun --standalone --nproc_per_node=2 -m utils.train_cifar10")


def test_the_epoch_figures_are_read_as_the_scripts_write_them(tmp_path):
    stdout = ("data: ...\nepoch 1/2: train loss 2.1, test accuracy 0.31 (10000 images); 9.0 s, 5547 images/s\n"
              "epoch 2/2: train loss 1.2, test accuracy 0.62 (10000 images); 8.3 s, 6012 images/s on 2 processes\n")
    assert gpu_check.ddp_epoch_figures(stdout, 2) == {"seconds_per_epoch": 8.3, "images_per_s": 6012.0,
                                                      "test_accuracy": 0.62}
    assert gpu_check.ddp_epoch_figures(stdout, 1)["images_per_s"] == 5547.0
    assert gpu_check.ddp_epoch_figures(stdout, 3) is None
    assert gpu_check.cifar10_epoch_figures(str(tmp_path), 2) is None  # no metrics.jsonl
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"epoch": e, "images_per_s": 100.0 * e, "epoch_seconds": 5.0 / e, "world_size": 4,
                            "test_accuracy": 0.4 * e}) + "\n" for e in (1, 2)))
    assert gpu_check.cifar10_epoch_figures(str(tmp_path), 2) == {"seconds_per_epoch": 2.5, "images_per_s": 200.0,
                                                                 "test_accuracy": 0.8, "world_size_reported": 4}
    assert gpu_check.speed_world_sizes(1) == [1] and gpu_check.speed_world_sizes(8) == [1, 8]


def test_the_results_file_records_the_commit(tmp_path):
    import re

    assert re.fullmatch(r"[0-9a-f]{7,40}(\+changes)?", gpu_check.git_commit())
    assert gpu_check.git_commit(str(tmp_path)) is None  # a copy without .git


def pretend_gpus(monkeypatch, count, **fake):
    props = types.SimpleNamespace(name="NVIDIA Pretend 80GB", total_memory=80 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(gpu_check, "_run_processes", fake_processes(**fake))
    monkeypatch.setattr(gpu_check, "nvidia_smi_gpus", lambda: [f"GPU {i}: NVIDIA Pretend 80GB" for i in range(count)])
    monkeypatch.setattr(gpu_check, "amp_fp16_unavailable", lambda: None)
    monkeypatch.setattr("utils.launch.run_distributed",
                        lambda fn, n, *a, **k: [{"sum_over_ranks": True}] * n)


def test_the_results_file_on_a_pretend_two_gpu_machine(tmp_path, monkeypatch):
    pretend_gpus(monkeypatch, 2)
    monkeypatch.setattr(gpu_check, "compile_unavailable", lambda: None)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check_nvidia_pretend_80gb.json").read_text())
    assert {"check", "command", "date", "environment", "world_size", "not_checked", "checks", "passed"} <= set(report)
    assert report["environment"]["gpus"] == ["NVIDIA Pretend 80GB"] * 2 and report["date"]
    assert report["not_checked"] == [gpu_check.SEVERAL_MACHINES,
                                     "make test: not asked (--make-test; make gpu-check asks)"]
    checks = report["checks"]
    assert list(checks) == ["collectives", "loader_no_sync", "training", "loader_workers", "compile", "amp_fp16",
                            "resume_on_fewer_gpus", "two_nodes", "loader_bench", "throughput",
                            "nondeterministic_ops"]
    assert checks["throughput"]["result"] == {"capstone_over_bare": 0.97} and checks["loader_no_sync"]["passed"]
    assert all(c["passed"] for c in checks.values()), {k: c for k, c in checks.items() if not c["passed"]}
    assert checks["loader_workers"]["loaders"] == ["workers"] and checks["training"]["loaders"] == ["gpu"]
    assert checks["amp_fp16"]["checkpoint_keys"] == ["model", "scaler"]
    assert checks["amp_fp16"]["scaler_in_checkpoint"] == {"scale": 32768.0, "_growth_tracker": 7}
    assert checks["amp_fp16"]["runs"]["fp16_uninterrupted"]["setup"]  # the fake's rank-0 lines were read
    assert checks["compile"]["relative_distance_to_uncompiled_run"] == 0.0
    assert checks["resume_on_fewer_gpus"]["gpus"] == [2, 1] and checks["resume_on_fewer_gpus"]["ran_on_fewer"]
    assert checks["two_nodes"]["cuda_visible_devices"] == ["0", "1"]
    assert checks["two_nodes"]["commands"][1].startswith("CUDA_VISIBLE_DEVICES=1 torchrun --nnodes=2 --node-rank=1")
    assert checks["two_nodes"]["reference_run"] == "uninterrupted, from an earlier check (training)"
    assert checks["nondeterministic_ops"] == {"seen": {}, "allowed": {}, "unexpected": [], "passed": True}


def test_on_a_pretend_one_gpu_machine_the_file_says_what_was_not_checked(tmp_path, monkeypatch):
    pretend_gpus(monkeypatch, 1, warn="foo_backward_cuda")
    monkeypatch.setattr(gpu_check, "compile_unavailable", lambda: "--compile on CUDA needs Triton")
    assert gpu_check.main(["--out", str(tmp_path)]) == 1  # an op off the allow-list warned
    report = json.loads((tmp_path / "gpu_check_nvidia_pretend_80gb.json").read_text())
    assert "resume on fewer GPUs: needs 2 GPUs" in report["not_checked"]
    assert "--compile: --compile on CUDA needs Triton" in report["not_checked"]
    assert list(report["checks"]) == ["collectives", "loader_no_sync", "training", "loader_workers", "amp_fp16",
                                      "loader_bench", "throughput", "nondeterministic_ops"]
    verdict = report["checks"]["nondeterministic_ops"]
    assert verdict["unexpected"] == ["foo_backward_cuda"] and not verdict["passed"]
    assert verdict["seen"]["foo_backward_cuda"] == [
        "training/uninterrupted", "training/killed_and_restarted", "loader_workers/workers_uninterrupted",
        "loader_workers/workers_killed_and_restarted", "amp_fp16/fp16_uninterrupted",
        "amp_fp16/fp16_killed_and_restarted"]
    assert all(report["checks"][c]["passed"] for c in ("collectives", "training", "loader_workers", "amp_fp16"))
    monkeypatch.setattr(gpu_check, "ALLOWED_NONDETERMINISTIC_OPS", {"foo_backward_cuda": "a reason, for the test"})
    assert gpu_check.main(["--out", str(tmp_path)]) == 0


def test_an_fp16_checkpoint_without_its_scaler_fails_the_fp16_check(tmp_path, monkeypatch):
    fake = fake_processes()

    def scaler_dropped(launches, timeout=0):
        results = fake(launches)
        for cmd, _ in launches:
            out = cmd[cmd.index("--out") + 1]
            state = torch.load(os.path.join(out, "checkpoint.pt"))
            torch.save({**state, "scaler": {}}, os.path.join(out, "checkpoint.pt"))
        return results

    monkeypatch.setattr(gpu_check, "_run_processes", scaler_dropped)
    result = gpu_check.amp_fp16_check(1, str(tmp_path))
    assert result["bit_identical_after_restart"] and result["passed"] is False


def test_a_failing_check_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    # resumed on 1 GPU: no exit status 0; two nodes: off by as far as training moved the weights
    pretend_gpus(monkeypatch, 2, fail=("resumed_on_1",), differ={"node0": 0.01})
    monkeypatch.setattr("utils.launch.run_distributed", lambda fn, n, *a, **k: [{"sum_over_ranks": True},
                                                                                 {"sum_over_ranks": False}])

    def broken(nproc, work, device):
        raise RuntimeError("no Triton kernel for this")

    monkeypatch.setitem(gpu_check.CHECKS, "compile", broken)
    monkeypatch.setitem(gpu_check.CHECKS, "make_test", lambda nproc, work, device: {"passed": True})
    assert gpu_check.main(["--out", str(tmp_path), "--make-test"]) == 1
    checks = json.loads((tmp_path / "gpu_check_nvidia_pretend_80gb.json").read_text())["checks"]
    assert checks["collectives"]["passed"] is False
    assert checks["compile"] == {"error": "RuntimeError: no Triton kernel for this", "passed": False,
                                 "check_seconds": checks["compile"]["check_seconds"]}
    assert checks["resume_on_fewer_gpus"]["passed"] is False and checks["two_nodes"]["passed"] is False
    assert checks["two_nodes"]["relative_distance"] == pytest.approx(1.0)
    assert checks["two_nodes"]["runs"]["node0"]["returncode"] == 0
    assert checks["training"]["passed"] is True and checks["make_test"]["passed"] is True


def test_the_tolerance_comes_from_the_run_to_run_noise_measured_here(tmp_path):
    init = initial_weights("simplecnn")
    for name, offset in (("uninterrupted", 0.01), ("speed", 0.0101)):  # the training check's pair
        os.makedirs(tmp_path / name)
        torch.save({k: v + offset if v.is_floating_point() else v for k, v in init.items()},
                   tmp_path / name / "model_final.pt")
    noise = gpu_check.compare_weights(gpu_check.final_weights(str(tmp_path), "speed"),
                                      gpu_check.final_weights(str(tmp_path), "uninterrupted"),
                                      "simplecnn")["relative_distance"]
    limit, source = gpu_check.tolerance(str(tmp_path), "simplecnn")
    assert 0 < noise and limit == gpu_check.NOISE_FACTOR * noise and "run-to-run noise" in source
    (tmp_path / "speed" / "model_final.pt").unlink()  # nothing measured: the fixed tolerance, said so
    limit, source = gpu_check.tolerance(str(tmp_path), "simplecnn")
    assert limit == gpu_check.RESUME_TOLERANCE and source.startswith("RESUME_TOLERANCE: no run-to-run")
