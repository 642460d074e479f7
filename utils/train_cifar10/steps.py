"""The run: main and the steps it calls, in order.

``main`` reads top to bottom, and each step it calls is defined below it, in the order
it runs; the hardening each step relies on lives in the module named in its import
(chapter 12, "the sum of the steps")."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from ..data import is_synthetic_cifar10, load_cifar10
from ..gpu_loader import resident_bytes
from ..metrics import sum_over_ranks
from ..seeding import derive_seed, seed_everything
from ..workers import WatchParent, end_workers
from .augment import KeyedAugment
from .checkpoints import (CHECKPOINT, FORMAT, keep_older, run_config, save_checkpoint,
                          write_atomically)
from .job import Job
from .launcher import check_compile, setup_distributed
from .loaders import (agreed_free_memory, batch_dtype, choose_loader,
                      make_test_loader, make_train_loader, shield_worker, worker_start)
from .per_node import agree_on_resume, check_same_data, prepare_data
from .preemption import (DONE, EXIT_PREEMPTED, PREEMPTED, Preemption,
                         refuse_restart_after_preemption, this_run, write_preempted)
from .recipe import BASE_LR, did_not_learn, make_model, one_cycle, per_process_batch
from .restarts import shorten_timeouts
from .settings import parse_args
from .shards import check_resume, open_shards
from .state import Data, Training


def main(argv=None, step=None) -> None:
    """The whole run, one named step after another. ``step``: the training step,
    ``train_step`` unless one is given (chapter 13 passes one that sends a signal)."""
    args = parse_args(argv)
    if args.prepare_only:
        prepare_only(args)
        return
    if args.deterministic:
        use_deterministic_algorithms()
    # SIGTERM, SIGUSR1, SIGINT: an agreed stop
    with Preemption(args.stop_check_seconds) as preemption:
        job = set_up_job(args)
        job.preemption = preemption
        data = build_data(args, job)
        model, optimizer, scheduler = build_model(args, data.steps_per_epoch,
                                                  fused=job.cuda)
        training = resume_or_start(args, job, data, model, optimizer, scheduler)
        model = wrap_model(args, job, training)
        metrics = start_log(args, job, data)
        train(args, job, data, training, model, metrics, step or train_step)
        finish(args, job, training, metrics)
    if training.failed:  # rank 0's last line (under torchrun, above its report); exit 1
        raise SystemExit(training.failed if job.master else 1)
    if training.stop_signal and training.epoch < args.epochs:
        raise SystemExit(EXIT_PREEMPTED)


def prepare_only(args) -> None:
    """``--prepare-only``: the data into ``--data`` (as one node's local rank 0 would
    prepare it), and nothing else."""
    if "RANK" in os.environ:
        raise SystemExit("error: --prepare-only runs as one process, without torchrun "
                         "(once per disk that the nodes read --data from)")
    prepare_data(args, local_rank=0, ddp=False)
    kind = "synthetic" if is_synthetic_cifar10(args.data) else "real"
    print(f"{kind} CIFAR-10 ready in {args.data}", flush=True)


def use_deterministic_algorithms() -> None:
    """``--deterministic``: kernels that give the same bits every run."""
    # before CUDA starts: cuBLAS needs it
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op with no deterministic CUDA kernel warns (and names itself)
    # instead of stopping
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def set_up_job(args) -> Job:
    """The process group and the device, then the checks that need them."""
    init_timeout = timedelta(seconds=args.init_timeout)
    ddp, rank, local_rank, world_size, device = setup_distributed(args.device,
                                                                  init_timeout)
    cuda = device.type == "cuda"
    if (args.amp or args.sync_bn) and not cuda:
        raise SystemExit("error: --amp and --sync-bn need CUDA; this run is on the CPU")
    if args.compile:
        check_compile(device)
    if cuda and not args.deterministic:
        # the fastest convolution algorithms for these shapes (every batch has the same
        # shape), timed once; they may differ from run to run, so not with
        # --deterministic
        torch.backends.cudnn.benchmark = True
    if args.resume and args.global_batch % world_size:
        # a resume whose settings differ from its checkpoint's is refused for that
        # first: the global batch to split is the checkpoint's
        agree_on_resume(os.path.join(args.out, CHECKPOINT), run_config(args), rank, ddp)
    batch_size = per_process_batch(args.global_batch, world_size)
    channels_last = args.channels_last == "yes" or (args.channels_last == "auto"
                                                    and cuda)
    # preemption flags are agreed on over gloo: a CPU tensor, no wait for the GPU
    control = (dist.new_group(backend="gloo", timeout=init_timeout) if ddp and cuda
               else None)
    return Job(ddp, rank, local_rank, world_size, device, batch_size, channels_last,
               control)


def build_data(args, job: Job) -> Data:
    """The data sets, the training loader (``--loader``; the shards' with
    ``--data-format webdataset``) and the test loader."""
    # prepared once per node; every process reads its own copy
    prepare_data(args, job.local_rank, job.ddp)
    synthetic = is_synthetic_cifar10(args.data)
    test_set = KeyedAugment(load_cifar10(args.data, train=False), args.seed,
                            train=False)
    if args.data_format == "webdataset":
        check_same_data(test_set, test_set, synthetic, job.ddp)  # the test set's
        # shards counted, dealt, cut to the same steps on every rank (shards)
        train_set, why = open_shards(args, job)
        steps_per_epoch, loader = train_set.steps_per_epoch, "webdataset"
    else:
        train_set = KeyedAugment(load_cifar10(args.data, train=True), args.seed,
                                 train=True)
        check_same_data(train_set, test_set, synthetic, job.ddp)
        # whole global batches: the same on any world size
        steps_per_epoch = len(train_set) // args.global_batch
        if steps_per_epoch == 0:
            raise SystemExit(f"error: {len(train_set)} training images is less than "
                             f"one global batch of {args.global_batch}")
        loader, why = choose_loader(args.loader, job.device,
                                    resident_bytes(train_set.data,
                                                   dtype=batch_dtype(args),
                                                   num_replicas=job.world_size),
                                    agreed_free_memory(job.device, job.ddp))
    loader_kwargs = dict(num_workers=args.workers, pin_memory=job.cuda,
                         persistent_workers=args.workers > 0,
                         worker_init_fn=WatchParent(shield_worker),
                         multiprocessing_context=worker_start(args.workers))
    train_loader, sampler = make_train_loader(args, job, train_set, loader,
                                              loader_kwargs)
    test_loader = make_test_loader(args, job, test_set, loader, loader_kwargs)
    return Data(train_set, test_set, synthetic, steps_per_epoch, loader, why,
                train_loader, sampler, test_loader)


def build_model(args, steps_per_epoch: int, fused: bool = False):
    """``(model, optimizer, scheduler)``, the same initial weights on every rank.
    ``fused`` (with CUDA): a few kernel launches update every parameter, and ``--amp
    fp16``'s scaler hands them its inf flag on the device, where an SGD that is not
    fused makes ``GradScaler.step`` read the flag on the host every step."""
    torch.manual_seed(args.seed)  # one seed where ranks must agree: the initial weights
    model = make_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True,
                                fused=True if fused else None)
    scheduler = one_cycle(optimizer, args.lr, args.epochs * steps_per_epoch)
    return model, optimizer, scheduler


def resume_or_start(args, job: Job, data: Data, model: nn.Module, optimizer,
                    scheduler) -> Training:
    """The checkpoint rank 0 found (with ``--resume``), loaded before the DDP wrap;
    else step 0. The model ends on the device."""
    os.makedirs(args.out, exist_ok=True)
    training = Training(model, optimizer, scheduler,
                        os.path.join(args.out, CHECKPOINT),
                        run_config(args, len(data.train_set), data.loader),
                        scaler=grad_scaler(args.amp == "fp16"))
    refuse_restart_after_preemption(args, job.master, job.ddp)
    state = (agree_on_resume(training.path, training.config, job.rank, job.ddp)
             if args.resume else None)
    if state is not None and data.loader == "webdataset":
        # on every rank
        check_resume(state, data.steps_per_epoch, training.path, job.world_size,
                     args.workers)
    for name in (PREEMPTED, DONE):  # this run goes on from it / is not done yet
        if job.master and os.path.exists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))
    if args.resume and state is None and job.master:
        print(f"--resume: rank 0 found no checkpoint at {training.path}; "
              f"starting from step 0", flush=True)
    if state is not None:
        model.load_state_dict(state["model"])
        training.epoch, training.step_in_epoch, training.step = (
            state["epoch"], state["step_in_epoch"], state["step"])
        training.saved_step = state["step"]
        # (checkpoints written before the epoch's loss was saved: from here on only)
        training.loss_before, training.steps_before = state.get("epoch_loss", (0.0, 0))
        if args.amp == "fp16" and state.get("scaler"):
            training.scaler.load_state_dict(state["scaler"])
    training.model = model.to(job.device, memory_format=job.memory_format)
    if state is not None:
        # after .to(device): moves its buffers there too
        optimizer.load_state_dict(state["optimizer"])
        # a checkpoint's param groups replace ours, "fused" with them: this run's stays
        for group in optimizer.param_groups:
            group["fused"] = optimizer.defaults["fused"]
        scheduler.load_state_dict(state["scheduler"])
        if job.master:
            print(f"resumed from {training.path}: epoch {training.epoch + 1}, step "
                  f"{training.step_in_epoch} of the epoch ({training.step} in all)",
                  flush=True)
    return training


def grad_scaler(enabled: bool):
    """``--amp fp16``'s loss scaler: fp16 gradients underflow without it. Disabled, its
    calls pass through."""
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):  # torch >= 2.3
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def wrap_model(args, job: Job, training: Training) -> nn.Module:
    """SyncBatchNorm, DDP and ``torch.compile`` as asked: the model the steps run.
    ``training.model`` stays the unwrapped one, which is evaluated and saved."""
    if args.sync_bn:
        training.model = nn.SyncBatchNorm.convert_sync_batchnorm(training.model)
    model = training.model
    if job.ddp:
        # DDP regroups gradients into new buckets after its first step, so a restarted
        # process's first step would sum them over 3 or more ranks in another order than
        # the uninterrupted run did, and differ in the last bits. DDP does not regroup
        # when it looks for unused parameters: --deterministic pays that (a graph
        # traversal per step) for exact restarts.
        fixed_buckets = {"find_unused_parameters": True} if args.deterministic else {}
        model = DDP(model, device_ids=[job.local_rank] if job.cuda else None,
                    **fixed_buckets)
    if args.compile:
        # after the DDP wrap: compiled per bucket
        model = torch.compile(model, mode=None if args.compile_mode == "default"
                              else args.compile_mode)
    return model


def evaluate(model: nn.Module, loader, device) -> float:
    """Exact test accuracy of rank 0's model: uneven shards, no padding (chapter 9).

    Every rank first takes rank 0's buffers (BatchNorm's running statistics): without
    --sync-bn each rank's follow its own last batch, and scoring each shard on its own
    rank's buffers would score a mixture of models, none of them the one rank 0 saves.
    """
    if dist.is_available() and dist.is_initialized():
        for buffer in model.buffers():  # on the group's device (a GPU per rank)
            dist.broadcast(buffer, src=0)
    model.eval()
    correct = count = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            correct += int((model(x).argmax(1) == y).sum())
            count += len(y)
    correct, count = sum_over_ranks(correct, count)
    model.train()
    return correct / count


def save(args, training: Training, job: Job) -> None:
    """Rank 0 writes the checkpoint (unless this step's is written already: a stop
    agreed at a periodic save's step) and, after a stop, ``preempted.json``; every rank
    waits for it."""
    if training.saved_step != training.step:
        # mid-epoch, the epoch's loss so far (a collective: on every rank)
        epoch_loss = (training.epoch_loss(job.world_size) if training.step_in_epoch
                      else (0.0, 0))
        # a loss that is no longer finite: keep the last good checkpoint (the epoch's
        # end then fails the run: did_not_learn)
        if job.master and math.isfinite(epoch_loss[0]):
            keep_older(args, training.path, training.saved_step, training.step)
            save_checkpoint(training.path, {
                "format": FORMAT, "model": training.model.state_dict(),
                "optimizer": training.optimizer.state_dict(),
                # a bound method in OneCycleLR's state before torch 2.4: not loadable
                # with weights_only=True, and the new scheduler has its own
                "scheduler": {k: v for k, v in training.scheduler.state_dict().items()
                              if not callable(v)},
                "scaler": training.scaler.state_dict(), "epoch": training.epoch,
                "step_in_epoch": training.step_in_epoch, "step": training.step,
                "epoch_loss": list(epoch_loss), "world_size": job.world_size,
                # a stream of shards replays an epoch with the same dealing (shards)
                "workers": args.workers, "config": training.config})
        training.saved_step = training.step  # on every rank: they decide alike
    if job.master and training.stop_signal and training.epoch < args.epochs:
        # before the barrier: no rank exits first
        write_preempted(args, training.step, training.stop_signal)
    if job.ddp:
        # nobody runs ahead of a checkpoint that may be needed to restart them
        dist.barrier()


def start_log(args, job: Job, data: Data):
    """Rank 0 opens ``metrics.jsonl`` and says which data, where every rank runs and
    the recipe; others get ``None``."""
    ranks = rank_lines(job)  # a collective: every rank takes part
    if not job.master:
        return None
    metrics = open(os.path.join(args.out, "metrics.jsonl"), "a" if args.resume else "w")
    sets = (f"{'synthetic' if data.synthetic else 'real'} CIFAR-10 in {args.data}: "
            f"{len(data.train_set)} train, {len(data.test_set)} test images")
    if data.loader == "webdataset":  # the training images are the shards'
        sets = (f"{len(data.train_set)} train images in "
                f"{len(data.train_set.urls)} WebDataset shards; "
                + sets.replace(f"{len(data.train_set)} train, ", ""))
    print(f"{sets}; {job.world_size} process(es), "
          f"{job.device.type}, "
          f"{dist.get_backend() if job.ddp else 'no process group'}; "
          f"global batch {args.global_batch} = {job.batch_size} x {job.world_size}",
          *ranks, f"peak lr {args.lr:g}" + (f" (the linear rule: {BASE_LR[args.model]} "
                                            f"per 256 images)" if args.lr_from_rule
                                            else ""), sep="\n", flush=True)
    print(f"loader: {data.loader} ({data.why}); "
          f"channels_last: {'yes' if job.channels_last else 'no'}; "
          f"compile: {'yes' if args.compile else 'no'}", flush=True)
    return metrics


def rank_lines(job: Job) -> list[str]:
    """One line per rank, where it runs, gathered from every rank: that each took
    part. Over the gloo control group with CUDA (no wait for the GPU)."""
    name = f" ({torch.cuda.get_device_name(job.device)})" if job.cuda else ""
    mine = (f"rank {job.rank} of {job.world_size} (local rank {job.local_rank}) on "
            f"{socket.gethostname()}: {job.device}{name}")
    lines = [mine] * job.world_size
    if job.ddp:
        dist.all_gather_object(lines, mine, group=job.control)
    return lines


def train(args, job: Job, data: Data, training: Training, model: nn.Module,
          metrics, step=None) -> None:
    """Epochs until ``--epochs``, ``--stop-at-step``, or a signal the ranks agreed on
    (``training.stop_signal``), each step of them ``step`` (``train_step``)."""
    # --fail-at-step fails a rank in its node's first attempt only
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    while training.epoch < args.epochs:
        data.set_epoch(training.epoch, training.step_in_epoch, job.batch_size)
        totals = train_epoch(args, job, data, training, model, restarts, step)
        if totals is None:
            # stopped mid-epoch, as a job whose time ran out: save where it stands
            save(args, training, job)
        else:
            end_epoch(args, job, data, training, metrics, *totals)
        if (totals is None or training.step == args.stop_at_step or training.stop_signal
                or training.failed):
            break
    if training.stop_signal and job.master:
        name = signal.Signals(training.stop_signal).name
        if training.epoch < args.epochs:
            print(f"{name}: every rank stopped after step {training.step}, saved in "
                  f"{training.path}; exit code {EXIT_PREEMPTED}: resume with --resume",
                  flush=True)
        else:  # nothing left to resume: a requeue would be for nothing
            print(f"{name} after the last step ({training.step}): the run is complete",
                  flush=True)


def train_epoch(args, job: Job, data: Data, training: Training, model: nn.Module,
                restarts: int, step=None) -> tuple[int, float] | None:
    """The rest of this epoch: ``(images, seconds)``, or ``None`` if
    ``--stop-at-step`` or a signal stopped it mid-epoch."""
    bar = progress_bar(args, job, data, training)
    t0, seen = time.perf_counter(), 0
    # summed on the device (float64: the same sum as in Python floats); reading it
    # would make the host wait for the GPU, so it is read every --log-every steps
    training.loss_sum = torch.zeros((), dtype=torch.float64, device=job.device)
    training.steps_run = 0
    logged = (0.0, 0)  # the sum and the number of steps when last read
    for x, y in data.train_loader:
        if (training.step + 1 == args.fail_at_step and job.rank == job.world_size - 1
                and restarts == 0):
            # a failure during this step, for the fault-tolerance tests: an exception,
            # as a CUDA out-of-memory error or a failed save raises
            raise RuntimeError(f"--fail-at-step {args.fail_at_step}: rank {job.rank} "
                               "fails (a test of restarts)")
        loss = (step or train_step)(args, job, training, model, x, y)
        if not training.stepped:
            shorten_timeouts(job, args.step_timeout)
            training.stepped = True
        training.step, training.step_in_epoch = (training.step + 1,
                                                 training.step_in_epoch + 1)
        training.steps_run += 1
        seen += len(x) * job.world_size
        training.loss_sum += loss.detach()
        if bar is not None:
            logged = show_progress(args, data, training, bar, logged, seen, t0)
        if (args.checkpoint_every and training.step % args.checkpoint_every == 0
                and training.step_in_epoch < data.steps_per_epoch):
            save(args, training, job)
        if job.preemption and job.preemption.due(training.step):
            training.stop_signal = job.preemption.agreed(job.ddp, job.control,
                                                         training.step)
        elif job.preemption and training.step_in_epoch == data.steps_per_epoch:
            training.stop_signal = job.preemption.agreed(job.ddp, job.control)
        if training.step == args.stop_at_step or training.stop_signal:
            break
    if bar is not None:
        bar.close()
    if training.step_in_epoch < data.steps_per_epoch:
        return None
    training.loss_sum.item()  # waits for the epoch's last step: then time it
    return seen, time.perf_counter() - t0


def show_progress(args, data: Data, training: Training, bar, logged, seen: int,
                  t0: float) -> tuple[float, int]:
    """Advance the bar; every ``--log-every`` steps (and at the epoch's end) read the
    loss from the device and show its mean since the last read, and images/s."""
    if (training.steps_run % args.log_every == 0
            or training.step_in_epoch == data.steps_per_epoch):
        total = float(training.loss_sum)  # waits for the GPU: every N steps only
        bar.set_postfix(
            loss=f"{(total - logged[0]) / (training.steps_run - logged[1]):.3f}",
            img_s=f"{seen / (time.perf_counter() - t0):.0f}")
        logged = (total, training.steps_run)
    bar.update(1)
    return logged


def progress_bar(args, job: Job, data: Data, training: Training):
    """Rank 0's progress bar for this epoch (``None`` elsewhere or with
    ``--no-progress``)."""
    if not job.master or args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=data.steps_per_epoch, initial=training.step_in_epoch,
                desc=f"epoch {training.epoch + 1}/{args.epochs}", unit="step",
                file=sys.stdout, mininterval=1.0)


def train_step(args, job: Job, training: Training, model: nn.Module, x, y):
    """One optimizer step on this rank's batch; returns its loss (on the device)."""
    # a seed per rank and step where ranks must differ (dropout, if a model had it),
    # also after a resume; not again once a step has shown that nothing draws any
    if training.reseed is not False:
        seed_everything(derive_seed(args.seed, training.step), job.rank)
        before = rng_states(job) if training.reseed is None else None
    # no-ops for the GPU loader's batches, already there in this format
    x = x.to(job.device, non_blocking=True, memory_format=job.memory_format)
    y = y.to(job.device, non_blocking=True)
    dtype = torch.float16 if args.amp == "fp16" else torch.bfloat16
    with torch.autocast(job.device.type, dtype=dtype, enabled=args.amp is not None):
        loss = F.cross_entropy(model(x), y)
    training.optimizer.zero_grad(set_to_none=True)
    # the scaler (--amp fp16) multiplies the loss so that small gradients survive in
    # fp16, and divides them again before the step (which it skips on inf or NaN)
    training.scaler.scale(loss).backward()
    training.scaler.step(training.optimizer)
    training.scaler.update()
    training.scheduler.step()
    if training.reseed is None:  # this process's first step: did it draw any?
        training.reseed = not all(map(torch.equal, before, rng_states(job)))
    return loss


def rng_states(job: Job) -> list[torch.Tensor]:
    """The state of torch's generators that a step could draw from: the CPU's and this
    process's GPU's (kept on the host: reading it does not wait for the GPU)."""
    return [torch.get_rng_state(),
            *([torch.cuda.get_rng_state(job.device)] if job.cuda else [])]


def end_epoch(args, job: Job, data: Data, training: Training, metrics, seen: int,
              elapsed: float) -> None:
    """Test accuracy, a checkpoint at the epoch's end (``--checkpoint-epochs``, or a
    stop), and rank 0's metrics line, which times the epoch's steps, the evaluation and
    the save apart."""
    # the mean over the epoch's global batches, those before a resume included
    loss, steps = training.epoch_loss(job.world_size)
    training.loss_before, training.steps_before = 0.0, 0
    t0 = time.perf_counter()
    accuracy = evaluate(training.model, data.test_loader, job.device)
    eval_seconds = time.perf_counter() - t0  # evaluate reads its sums: the GPU is done
    training.epoch, training.step_in_epoch = training.epoch + 1, 0
    # the same verdict on every rank (loss and accuracy are summed over all ranks);
    # a run that failed keeps its last good checkpoint
    training.failed = did_not_learn(loss / max(steps, 1), accuracy,
                                    training.epoch == args.epochs, training.step)
    t0 = time.perf_counter()
    every = args.checkpoint_epochs
    if not training.failed and (
            (every and (training.epoch % every == 0 or training.epoch == args.epochs))
            or training.stop_signal or training.step == args.stop_at_step):
        save(args, training, job)
    save_seconds = time.perf_counter() - t0
    if job.master:
        record = {"epoch": training.epoch, "step": training.step,
                  "train_loss": round(loss / max(steps, 1), 4),
                  "test_accuracy": round(accuracy, 4),
                  "images_per_s": round(seen / elapsed, 1),
                  "epoch_seconds": round(elapsed, 2),
                  "eval_seconds": round(eval_seconds, 2),
                  "save_seconds": round(save_seconds, 2), "world_size": job.world_size,
                  "data": "synthetic" if data.synthetic else "cifar10",
                  "model": args.model, "device": job.device.type,
                  "loader": data.loader}
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        print(json.dumps(record), flush=True)


def finish(args, job: Job, training: Training, metrics) -> None:
    """Rank 0 closes the log and, if every epoch ran, saves the final weights; the
    process group ends."""
    if job.master:
        metrics.close()
        if training.epoch == args.epochs and not training.failed:
            # loads anywhere, GPU or not, in the default memory format
            final = {k: v.cpu().contiguous()
                     for k, v in training.model.state_dict().items()}
            save_checkpoint(os.path.join(args.out, "model_final.pt"), final)
            # what "done" means to a job script: this run wrote model_final.pt (one
            # left from an earlier run in the same OUT does not say so)
            record = {"step": training.step, "epoch": training.epoch, **this_run()}
            write_atomically(os.path.join(args.out, DONE),
                             lambda f: f.write(json.dumps(record).encode()))
    if job.ddp:
        dist.destroy_process_group()


def run(step=None) -> None:
    """The command line's entry point: ``main`` under torchelastic's ``@record``, so
    that under torchrun a rank's exception and traceback reach its error file and
    torchrun prints them (instead of ``error_file: <N/A>``). ``main`` itself, which
    notebooks and tests call in-process, goes without: ``@record`` also sets up a fault
    handler on the process's stderr. A rank that raises ends its DataLoader workers
    before it exits (``end_workers``: without that it would never exit). ``step``: as
    ``main``'s."""
    try:
        record(main)(step=step)
    except BaseException:
        end_workers()
        raise
