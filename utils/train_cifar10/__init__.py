"""Train a CNN on CIFAR-10 with DistributedDataParallel: one script for a laptop, a GPU
server and a cluster.

    # one process
    python -m utils.train_cifar10 --data data --synthetic
    # one node, N processes
    torchrun --standalone --nproc_per_node=N -m utils.train_cifar10 ...
    # M nodes
    torchrun --nnodes=M --nproc_per_node=N --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:PORT -m utils.train_cifar10 ...

``RANK`` in the environment (set by torchrun) makes it a distributed run: ``nccl`` with
CUDA, ``gloo`` without (or with ``--device cpu``), one GPU per local rank. Local rank 0
of each node prepares the data. Rank 0 alone logs (a progress bar with images/s, and a
JSON-lines metrics file), writes checkpoints (atomically) and decides whether to resume,
for everyone. ``--global-batch`` is split over the processes and every global batch is
the same block of the epoch's order whatever their number, so a run may resume on
another number of processes. Every random choice is a function of the seed, the epoch
and the sample index (augmentations), or of the seed, step and rank (anything a model
draws), so a run killed and resumed from a checkpoint, on any number of workers, ends
with the same parameters as one that never stopped. Under torchrun's restarts each
attempt gets a store of its own (``attempt_store``); SIGTERM or SIGUSR1 makes every rank
stop after the same step (the ranks agree on it every ``STOP_CHECK_EVERY`` steps and
after an epoch's last step), with one checkpoint, ``preempted.json`` and exit code 75
(``EXIT_PREEMPTED``); ``examples/slurm/train_cifar10.sbatch`` runs it under SLURM.

Feeding the GPU: ``--loader gpu`` keeps the uint8 training set on the device and
augments whole batches there (``utils.gpu_loader.GPULoader``: the same sample order
as ``--loader workers``, other augmentation draws, also keyed by the seed, the epoch
and the index); ``--loader auto``, the default, takes it with CUDA when the training
set fits (see ``choose_loader``), else the DataLoader with worker processes. On CUDA
the model and its inputs use ``channels_last``. The training loop waits for the GPU only
where it must: the loss is summed on the device and read every ``--log-every`` steps
(progress bar) and at the end of each epoch, and a checkpoint (every
``--checkpoint-every`` steps; at the end of every ``--checkpoint-epochs``-th epoch
and of the last) copies the weights off it. ``--sync-bn`` (torch's SyncBatchNorm, off
by default) adds a collective to every BatchNorm layer's forward and backward, which
makes the host wait for the GPU; with CUDA the SGD is fused (a few kernel launches for
all parameters, and ``--amp fp16``'s loss scaler hands them its overflow flag on the
device: no wait).
``--compile`` compiles the model and the GPU loader's augmentation;
``--compile-mode reduce-overhead`` then replays the model's kernels as CUDA graphs (one
launch from the host for many kernels).

Each epoch rank 0 writes one JSON line to ``OUT/metrics.jsonl``: ``epoch``, ``step``,
``train_loss`` (the mean over the epoch's steps and ranks), ``test_accuracy``,
``images_per_s``, ``epoch_seconds`` (the steps), ``eval_seconds``, ``save_seconds``
(0 where ``--checkpoint-epochs`` skips the epoch), ``world_size``, ``data``, ``model``,
``device``, and ``loader`` (``gpu`` or ``workers``; added with ``--loader``;
``webdataset`` with ``--data-format webdataset``).

``--data-format webdataset --shards URLS`` trains on WebDataset tar shards (over HTTP,
or paths) instead of ``--data``'s training set, with the same augmentation and the same
number of steps on every rank (``shards``); it resumes mid-epoch too, by replaying
the epoch's seeded streams, with the same processes and ``--workers``.

The modules follow the sections of chapters 12 and 13, each of which names its module:

    settings      the command line (``--help``)
    recipe        the model, the batch split, the learning-rate schedule (chapter 11)
    augment       step 1: augmentation keyed by (seed, epoch, index)
    checkpoints   step 2: atomic checkpoints, EpochSampler, what a resume must repeat
    per_node      step 3: data per node; rank 0 decides whether to resume
    restarts      (chapter 13) a store per attempt; timeouts: a hang becomes a restart
    preemption    (chapter 13) a signal, one agreed checkpoint, exit code 75
    job           Job: this process's rank, device and batch
    shards        --data-format webdataset: tar shards, as many steps on every rank
    loaders       step 4: the GPU loader, or DataLoader workers
    state         Data and Training: the loaders, and what a checkpoint holds
    launcher      (chapter 13) checks of torchrun, srun and the GPUs; the process group
    steps         the run, one named step after another (``main``, ``run``)

Their imports go one way, to ``steps`` at the top (``tests/test_imports.py`` finds no
circle, type-only imports included): the shared state sits in ``job`` and ``state``,
which import none of the modules that take it, and the modules under those take plain
values. The names a script or a test needs are names of this package too
(``utils.train_cifar10.main``); to replace one, patch the module that uses it
(``utils.train_cifar10.steps``), and a different training step goes to ``main`` or
``run`` as ``step=`` (chapter 13's preemption demo).
"""

from __future__ import annotations

from .settings import add_run_arguments, add_speed_arguments, check_args, parse_args
from .recipe import (GlobalAvgPool, make_model, one_cycle, per_process_batch, SimpleCNN)
from .augment import KeyedAugment
from .checkpoints import (CHECKPOINT, FORMAT, LEGACY_SETTINGS, RUN_SETTINGS,
                          _fsync_folder, EpochSampler, keep_older, load_checkpoint,
                          run_config, save_checkpoint, write_atomically)
from .per_node import (agree_on_resume, check_same_data, from_rank_0, prepare_data)
from .restarts import (FIND_STORE_SECONDS, attempt_store, init_process_group,
                       shorten_timeouts)
from .preemption import (DONE, EXIT_PREEMPTED, PREEMPTED, STOP_CHECK_EVERY,
                         Preemption, refuse_restart_after_preemption, this_run,
                         write_preempted)
from .shards import (IMAGE_KEYS, SHUFFLE_BUFFER, EpochBatches, ShardStream,
                     StreamAugment, batches_taken, check_dealing, check_resume,
                     count_samples, deal, default_manifest, expand_shards,
                     manifest_counts, no_manifest_line, open_shards, read_manifest,
                     reader_batches, sample_index, shard_counts, steps_per_epoch,
                     stream_loader)
from .loaders import (EVAL_BATCH, FIT_FRACTION, agreed_free_memory, batch_dtype,
                      choose_loader, eval_workers, make_test_loader, make_train_loader,
                      shield_worker, worker_start)
from .launcher import (check_compile, check_gpus, launcher_args, refuse_elastic_nnodes,
                       refuse_srun_without_torchrun, setup_distributed)
from .job import Job
from .state import Data, Training
from .steps import (build_data, build_model, end_epoch, evaluate, finish, grad_scaler,
                    main, prepare_only, progress_bar, resume_or_start, rng_states, run,
                    save, set_up_job, show_progress, start_log, train, train_epoch,
                    train_step, use_deterministic_algorithms, wrap_model)

MODULES = ("settings", "recipe", "augment", "checkpoints", "per_node", "restarts",
           "preemption", "job", "shards", "loaders", "state", "launcher", "steps")
