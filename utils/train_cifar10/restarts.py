"""A dead rank, restarted by torchrun (chapter 13).

Under torchrun's restarts every attempt gets a store of its own (``attempt_store``),
and after the first step a collective that hangs fails the rank
(``shorten_timeouts``), so that torchrun restarts the job."""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def init_process_group(backend: str, device: torch.device | None = None,
                       timeout: timedelta | None = None) -> None:
    """``init_process_group`` on a store of this attempt's own, hosted by its rank 0,
    with ``timeout`` for its collectives (torch's default: 10 minutes for ``nccl``, 30
    for ``gloo``), until ``shorten_timeouts``.

    torchrun (2.14) keeps the store at ``MASTER_ADDR:MASTER_PORT`` across restarts, so
    restarted ranks that share it can read the addresses of the processes that died and
    dial them (chapter 13 shows it). Numbering the attempts does not fix that for good:
    ``TORCHELASTIC_RESTART_COUNT`` can differ between nodes (an agent counts a restart
    when its own workers failed; one whose workers were healthy does not), and a count
    kept in the store is shifted for ever by a
    process that dies before it adds its 1. So every attempt gets a fresh store
    (``attempt_store``), and nothing of a dead attempt can be read.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the store is rank 0's to host, unless torchrun's agent hosts it
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           world_size, hosts_store)
    # the attempt counter lives in the shared store, which outlives a restart only when
    # it is torchrun's agent's; otherwise rank 0 hosts a new one each attempt, and the
    # agent's own count of restarts (of rank 0's node) is the best there is
    floor = (0 if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
             else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    store, attempt = attempt_store(shared, os.environ["MASTER_ADDR"], rank, world_size,
                                   floor)
    os.environ["TRAIN_CIFAR10_ATTEMPT"] = str(attempt)
    # one id for every attempt of this launch, none of another: in the agent's store,
    # which lives as long as the launch (a relaunch that reuses --rdzv-id gets a new
    # one); the first rank to ask sets it
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        launch = shared.compare_set("train_cifar10/launch", "", os.urandom(8).hex())
        os.environ["TRAIN_CIFAR10_LAUNCH"] = launch.decode()
    # device_id binds this rank's GPU to the group: barriers use it
    extra = {"device_id": device} if backend == "nccl" else {}
    if timeout is not None:
        extra["timeout"] = timeout
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            **extra)


FIND_STORE_SECONDS = 600  # how long ranks wait for their rank 0's store


def attempt_store(shared, host: str, rank: int, world_size: int, floor: int = 0):
    """``(store, attempt)``: a store that only this attempt's processes know, and the
    attempt's number (rank 0's count in the shared store, at least ``floor``).

    Rank 0 starts a new store on a free port and publishes ``host:port:token`` in the
    shared store, with a random token that it also writes into the new store. Every
    other rank reads what is published, connects, and reads the token back. What a dead
    attempt published names a store whose process is gone (or a port since reused by
    another store, with another token): the rank waits for this attempt's rank 0 to
    publish. Rank 0 also checks that the world size has not changed between attempts
    (an elastic ``--nnodes``); its refusal reaches every rank.
    """
    if rank == 0:
        own = dist.TCPStore(host, 0, world_size, True, wait_for_workers=False)
        attempt = max(shared.add("train_cifar10/attempts", 1) - 1, floor)
        token = f"{attempt}-{os.urandom(8).hex()}"
        own.set("token", token)
        first = shared.compare_set("train_cifar10/world_size", "", str(world_size))
        published = f"{host}:{own.port}:{token}"
        if first.decode() != str(world_size):
            published = (f"error: the world size changed between attempts of this "
                         f"torchrun job, from {first.decode()} to {world_size} "
                         f"processes: an elastic --nnodes MIN:MAX? Start torchrun "
                         f"with a fixed --nnodes (resume on another number of "
                         f"processes with a new job and --resume)")
        shared.set("train_cifar10/store", published)
        if published.startswith("error:"):
            raise SystemExit(published)
        return own, attempt
    shared.set_timeout(timedelta(seconds=FIND_STORE_SECONDS))  # a slow rank 0
    deadline = time.monotonic() + FIND_STORE_SECONDS
    while time.monotonic() < deadline:
        published = shared.get("train_cifar10/store").decode()
        if published.startswith("error:"):
            raise SystemExit(published)
        address, port, token = published.rsplit(":", 2)
        try:
            # a quiet look first: a dead attempt's port refuses at once, where a
            # TCPStore client would retry, and log each try
            socket.create_connection((address, int(port)), timeout=2).close()
            store = dist.TCPStore(address, int(port), world_size, False,
                                  timeout=timedelta(seconds=2))
            if store.get("token").decode() == token:
                store.set_timeout(timedelta(seconds=FIND_STORE_SECONDS))
                return store, int(token.split("-")[0])
        except (OSError, RuntimeError):  # no store there, or not ours
            pass
        time.sleep(0.2)
    raise SystemExit(f"error: rank {rank} found no store from this attempt's rank 0 "
                     f"in {FIND_STORE_SECONDS} s (last published: {published}); did "
                     f"rank 0 start?")


def shorten_timeouts(job, seconds: float) -> None:
    """After this process's first step: a collective that waits ``seconds`` has hung
    (a rank stuck in a file system, a dead peer that never reached it), and the rank
    fails instead of waiting for the long start-up timeout, so that torchrun restarts
    the job (torchtitan, too, shortens its timeout after the first step). On the group
    of the training and on the preemption flag's."""
    if not job.ddp:
        return
    set_timeout = (getattr(dist, "set_timeout", None)  # torch >= 2.14
                   or getattr(dist.distributed_c10d, "_set_pg_timeout", None))
    if set_timeout is None:  # an older torch
        if job.master:
            print("warning: this torch cannot change a process group's timeout; "
                  "--step-timeout is ignored, --init-timeout applies throughout",
                  file=sys.stderr, flush=True)
        return
    set_timeout(timedelta(seconds=seconds))  # the default group
    if job.control is not None:
        set_timeout(timedelta(seconds=seconds), job.control)
