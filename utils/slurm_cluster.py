"""A two-node Slurm cluster on this machine, for the recipe's tests
(``tests/test_slurm_recipe.py``) and the chapter's record of one job's life
(``utils.slurm_job``): Debian's ``slurm-wlm`` and ``munge`` (Slurm 22.05), started as
root from a generated ``slurm.conf`` in a temporary folder, and stopped again.

    with Cluster(folder) as cluster:
        job = cluster.sbatch(["examples/slurm/train_cifar10.sbatch"], env=...)
        cluster.wait(job, "COMPLETED")

- ``munged`` with a key and socket of its own; ``slurmctld`` on the bridge's address;
  two ``slurmd -N node1|node2``, each in a network namespace of its own (``ip netns``)
  with its own address on a bridge, from a documentation range (198.51.100.0/24), its
  own host name and ``/etc/hosts`` (``unshare --uts --mount``, a file of the
  cluster's folder mounted over ``/etc/hosts``). ``loopback_names=True`` (or, for a
  while, ``with cluster.loopback_names():``) maps each node's name to 127.0.1.1
  instead, as Debian's installer does.
- Where namespaces are not allowed, ``namespaces=False``: both nodes on 127.0.0.1
  (different ports), and the recipe needs ``LOOPBACK_OK=1``.
- Partitions: ``main`` (the default), and ``low`` and ``high`` over the same nodes:
  a job in ``high`` preempts one in ``low`` (``preempt/partition_prio``,
  ``PreemptMode=REQUEUE``, ``GraceTime``: SIGTERM to the job's steps, then the
  requeue ``GRACE_TIME`` seconds later).
- Slurm keeps a requeued job pending until its last run's credential, which it revoked,
  has expired: ``cred_expire`` seconds (120 by default; ``scontrol update
  StartTime=now`` does not help: the job is allocated, then killed as "non-startable:
  Job credential revoked"). Here ``CRED_EXPIRE`` (10 s, Slurm's minimum is 5): a
  requeued job starts again after it and the scheduler's next pass, half a minute to a
  minute or so after its requeue (over two minutes with the default). Nothing else
  differs from Slurm's defaults but the short ``KillWait`` (``KILL_WAIT``) and the
  plugins that need no cgroups (``proctrack/linuxproc``, ``task/none``).
- By hand (as root): ``python -m utils.slurm_cluster`` starts it, prints the
  ``SLURM_CONF`` a shell needs, and stops it on Ctrl-C.

``unavailable()`` says why a cluster cannot run here (not Linux, not root, no Slurm).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from .launch import free_port

NODES = ("node1", "node2")
SUBNET = "198.51.100"  # TEST-NET-2 (RFC 5737): documentation, never a real network
CONTROLLER_ADDR = f"{SUBNET}.1"
LOOPBACK_NAME_ADDR = "127.0.1.1"  # what Debian's /etc/hosts gives the host's own name
INTERFACE = "slurm0"  # each node's interface on the bridge (SOCKET_IFNAME)
GRACE_TIME = 20  # seconds a preempted job of partition ``low`` gets before the requeue
KILL_WAIT = 10  # seconds between Slurm's SIGTERM and its SIGKILL (default 30)
CRED_EXPIRE = 10  # seconds a requeued job waits before it may start (default 120)
# per node, as slurm.conf declares them (the recipe's header asks for 64 CPUs and 8
# GPUs a node): slurmd takes them as given (config_overrides), whatever the machine
# has, and the GPUs are counts (``_gres``)
CPUS = 64
GPUS = 8
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel",
            "sinfo", "squeue", "ip", "unshare", "nsenter")
START_SECONDS = 60
# a job in one of these states has ended (unless it is requeued)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE")


def unavailable() -> str | None:
    """Why a cluster cannot be started here, or None if it can."""
    if not sys.platform.startswith("linux"):
        return f"Slurm's daemons run on Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "starting Slurm's daemons and network namespaces needs root"
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        return (f"no {', '.join(missing)} on PATH: install Debian's slurm-wlm and "
                "munge (apt-get install slurm-wlm munge), as .ci/run does")
    return None


def stale_networks() -> list[tuple[str, list[str]]]:
    """The bridges and namespaces of clusters whose process is gone (a run killed
    with SIGKILL, or a machine's session ended, never reached ``stop()``): each
    ``(bridge, [namespace, ...])``. Left alone, one keeps the controller's address
    and every later cluster on this machine would refuse to start."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                           text=True).stdout
    bridges = re.findall(r"^\d+: (slbr(\d+))[:@]", links, flags=re.M)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                            text=True).stdout
    spaces = re.findall(r"^(sl(\d+)node\d+)\b", listed, flags=re.M)
    stale = []
    for tag in sorted({t for _, t in bridges} | {t for _, t in spaces}):
        owned = [ns for ns, t in spaces if t == tag]
        if psutil.pid_exists(int(tag)) or any(_pids_in(ns) for ns in owned):
            continue  # a cluster that runs (its owner, or a daemon in a node)
        stale.append((f"slbr{tag}", owned))
    return stale


def _pids_in(namespace: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True).stdout.split()


def remove_network(bridge: str, namespaces: list[str]) -> None:
    """Delete the namespaces (and their veth pairs) and the bridge; what is
    already gone is skipped."""
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)


class SlurmError(RuntimeError):
    """The cluster did not start, or a Slurm command failed."""


class Cluster:
    """Start with ``with Cluster(folder):`` (or ``start()``/``stop()``); every
    command runs with ``env()`` (``SLURM_CONF`` of this cluster)."""

    def __init__(self, folder, namespaces: bool = True, loopback_names: bool = False):
        self.folder = Path(folder)
        self.namespaces = namespaces
        self.loopback_names_default = loopback_names
        tag = f"{os.getpid()}"  # stale_networks() reads the owner's pid back
        self.bridge = f"slbr{tag}"
        self.netns = {node: f"sl{tag}{node}" for node in NODES}
        self.addr = {node: (f"{SUBNET}.{11 + i}" if namespaces else "127.0.0.1")
                     for i, node in enumerate(NODES)}
        self.controller = CONTROLLER_ADDR if namespaces else "127.0.0.1"
        self.conf = self.folder / "slurm.conf"
        self.processes: list[subprocess.Popen] = []
        self.started_network = False

    # --- start and stop -----------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        reason = unavailable()
        if reason:
            raise SlurmError(reason)
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            if self.namespaces:
                self._network()
            self._munge()
            self.conf.write_text(self.slurm_conf())
            self._gres()
            self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f",
                                       str(self.conf)])
            for node in NODES:
                self._daemon(node, self.on_node(node, [
                    "slurmd", "-D", "-N", node, "-f", str(self.conf)]))
            self._wait_idle()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Everything it started: jobs, daemons, namespaces."""
        if self.conf.exists():
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env(),
                           capture_output=True, timeout=30)
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.processes):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes.clear()
        self._kill_leftovers()
        if self.started_network:
            remove_network(self.bridge, list(self.netns.values()))
            self.started_network = False

    def _kill_leftovers(self) -> None:
        """Any process that runs with this cluster's configuration (job steps, their
        ranks and workers: slurmstepd's children inherit SLURM_CONF)."""
        mine = str(self.conf)
        for proc in psutil.process_iter():
            try:
                if proc.pid == os.getpid():
                    continue
                if proc.environ().get("SLURM_CONF") == mine or mine in proc.cmdline():
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass

    def _network(self) -> None:
        for bridge, namespaces in stale_networks():
            remove_network(bridge, namespaces)
        taken = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True,
                               text=True).stdout
        if f" {CONTROLLER_ADDR}/" in taken:
            raise SlurmError(f"{CONTROLLER_ADDR} is taken: another test cluster is "
                             "running on this machine (one at a time)")
        self.started_network = True
        run = self._ip
        run("link", "add", self.bridge, "type", "bridge")
        run("addr", "add", f"{CONTROLLER_ADDR}/24", "dev", self.bridge)
        run("link", "set", self.bridge, "up")
        for i, node in enumerate(NODES):
            ns, veth = self.netns[node], f"{self.bridge}v{i}"
            run("netns", "add", ns)
            run("link", "add", veth, "type", "veth", "peer", "name", INTERFACE,
                "netns", ns)
            run("link", "set", veth, "master", self.bridge)
            run("link", "set", veth, "up")
            run("-n", ns, "addr", "add", f"{self.addr[node]}/24", "dev", INTERFACE)
            run("-n", ns, "link", "set", INTERFACE, "up")
            run("-n", ns, "link", "set", "lo", "up")

        self._hosts(loopback=self.loopback_names_default)

    def _hosts(self, loopback: bool) -> None:
        """Each node's /etc/hosts: its own name at its address (or 127.0.1.1), the
        other's, the controller's."""
        hosts = self.folder / "hosts"
        hosts.mkdir(exist_ok=True)
        for node in NODES:
            own = LOOPBACK_NAME_ADDR if loopback else self.addr[node]
            others = [f"{self.addr[other]} {other}" for other in NODES if other != node]
            with open(hosts / node, "r+" if (hosts / node).exists() else "w") as f:
                f.write("\n".join(["127.0.0.1 localhost", f"{own} {node}", *others,
                                   f"{CONTROLLER_ADDR} controller", ""]))
                f.truncate()

    @staticmethod
    def _ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise SlurmError(f"ip {' '.join(args)}: {done.stderr.strip()} (network "
                             "namespaces not allowed here? Cluster(namespaces=False) "
                             "puts both nodes on 127.0.0.1)")

    def _munge(self) -> None:
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = self.folder / "munge.socket"
        self._daemon("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={self.folder / 'munged.pid'}",
            f"--log-file={self.folder / 'munged.log'}",
            f"--seed-file={self.folder / 'munged.seed'}"])
        deadline = time.monotonic() + START_SECONDS
        while not self.munge_socket.exists():
            self._check_running()
            if time.monotonic() > deadline:
                raise SlurmError("munged did not create its socket")
            time.sleep(0.1)

    def _gres(self) -> None:
        """``GPUS`` GPUs a node for Slurm to count and hand out: Slurm drops a GPU
        without a device file, so each is an empty file of the cluster's folder (a job
        that asks for GPUs gets CUDA_VISIBLE_DEVICES, and no device)."""
        devices = self.folder / "dev"
        devices.mkdir(exist_ok=True)
        for i in range(GPUS):
            (devices / f"nvidia{i}").touch()
        (self.folder / "gres.conf").write_text(
            f"Name=gpu File={devices}/nvidia[0-{GPUS - 1}]\n")

    def slurm_conf(self) -> str:
        ports = {node: free_port() for node in NODES}
        state = self.folder / "state"
        state.mkdir(exist_ok=True)
        for node in NODES:
            (self.folder / "spool" / node).mkdir(parents=True, exist_ok=True)
        nodes = [f"NodeName={node} NodeAddr={self.addr[node]} NodeHostname={node} "
                 f"Port={ports[node]} CPUs={CPUS} Gres=gpu:{GPUS} RealMemory=1000 "
                 "State=UNKNOWN"
                 for node in NODES]
        every = ",".join(NODES)
        return "\n".join([
            "ClusterName=book",
            # slurmctld runs only where its host name is this one
            f"SlurmctldHost={socket.gethostname()}({self.controller})",
            "MailProg=/bin/true",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root", "SlurmdUser=root",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={self.folder / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.folder / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.folder / 'slurmctld.log'}",
            f"SlurmdLogFile={self.folder / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides", "GresTypes=gpu",
            "ReturnToService=2", "MpiDefault=none", "SwitchType=switch/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={self.folder / 'jobcomp.txt'}",
            "SchedulerType=sched/builtin",
            f"KillWait={KILL_WAIT}",
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            *nodes,
            f"PartitionName=main Nodes={every} Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName=low Nodes={every} PriorityTier=1 PreemptMode=REQUEUE "
            f"GraceTime={GRACE_TIME} State=UP",
            f"PartitionName=high Nodes={every} PriorityTier=2 PreemptMode=OFF State=UP",
            ""])

    def on_node(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` as it runs on ``node``: in its namespace, under its host name."""
        if not self.namespaces:
            return argv
        # not ``ip netns exec``, which mounts a sysfs of the namespace's own, without
        # the cgroup file system that slurmd needs
        hosts = self.folder / "hosts" / node
        return ["nsenter", f"--net=/run/netns/{self.netns[node]}", "unshare", "--mount",
                "--uts", "sh", "-c", f'mount --bind {hosts} /etc/hosts && '
                f'hostname {node} && exec "$@"', "sh", *argv]

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / f"{name}.out", "ab")
        self.processes.append(subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env(), start_new_session=True))
        log.close()

    def _check_running(self) -> None:
        for proc in self.processes:
            if proc.poll() is not None:
                name = proc.args[0] if proc.args[0] != "ip" else proc.args[-4]
                raise SlurmError(f"{name} exited with {proc.returncode} as it started: "
                                 f"see {self.folder}/*.log and *.out")

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while True:
            self._check_running()
            done = subprocess.run(["sinfo", "-h", "-N", "-p", "main", "-o", "%N %T"],
                                  env=self.env(), capture_output=True, text=True)
            states = dict(line.split() for line in done.stdout.splitlines()
                          if line.strip())
            if all(states.get(node) == "idle" for node in NODES):
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"nodes not idle after {START_SECONDS} s: {states} "
                                 f"{done.stderr.strip()}")
            time.sleep(0.5)

    @contextlib.contextmanager
    def loopback_names(self):
        """Within it, each node's /etc/hosts gives its own name 127.0.1.1, as
        Debian's installer writes it (the file is rewritten in place: the nodes see the
        change)."""
        self._hosts(loopback=True)
        try:
            yield
        finally:
            self._hosts(loopback=self.loopback_names_default)

    # --- using it -----------------------------------------------------------------
    def env(self, base: dict | None = None) -> dict:
        """``base`` (this process's environment) with this cluster's SLURM_CONF, and
        no variables of an enclosing job."""
        base = dict(os.environ if base is None else base)
        env = {k: v for k, v in base.items()
               if not k.startswith(("SLURM_", "SRUN_", "SBATCH_", "SALLOC_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def command(self, argv: list[str], env: dict | None = None, check: bool = True,
                timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, env=self.env(env), capture_output=True, text=True,
                              timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: exit {done.returncode}: "
                             f"{done.stderr.strip()}")
        return done

    def sbatch(self, argv: list[str], env: dict | None = None, cwd=None) -> str:
        """Submit; the job id."""
        done = self.command(["sbatch", "--parsable", *argv], env=env, cwd=cwd)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, Reason, Restarts, ...); {} once
        Slurm has forgotten the job."""
        done = self.command(["scontrol", "show", "job", "-o", job_id], check=False)
        if done.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait(self, job_id: str, until, timeout: float = 300, states: list | None = None,
             poll: float = 0.5) -> dict:
        """Poll the job until ``until(job)`` (a function of ``job``'s dict) or its
        state is one of ``until`` (a string or tuple); every state seen is appended to
        ``states``. Raises SlurmError after ``timeout`` seconds."""
        if not callable(until):
            wanted = (until,) if isinstance(until, str) else tuple(until)
            until = lambda job: job.get("JobState") in wanted  # noqa: E731
        deadline = time.monotonic() + timeout
        ended_at = 0.0  # when the job was first seen ended (it may be requeued still)
        while True:
            found = self.job(job_id)
            if states is not None and found and (not states or states[-1] != (
                    found.get("JobState"), found.get("Restarts"))):
                states.append((found.get("JobState"), found.get("Restarts")))
            if until(found):
                return found
            if found.get("JobState") not in ENDED:
                ended_at = 0.0
            elif not ended_at:
                ended_at = time.monotonic()
            elif time.monotonic() > ended_at + 5:  # ended, and not requeued
                raise SlurmError(f"job {job_id} ended ({found.get('JobState')}, "
                                 f"{found.get('Reason')}) before what was waited for")
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id}: still {found.get('JobState')} "
                                 f"({found.get('Reason')}) after {timeout} s")
            time.sleep(poll)


def main(argv=None) -> None:
    """``python -m utils.slurm_cluster [--folder DIR]`` (as root): start the cluster,
    print what a shell needs to use it, and stop it on Ctrl-C or SIGTERM."""
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description="A two-node Slurm cluster on this machine "
                                "(see utils/slurm_cluster.py); Ctrl-C stops it")
    p.add_argument("--folder", help="its configuration, logs and state (default: a "
                   "new temporary folder)")
    p.add_argument("--loopback", action="store_true",
                   help="both nodes on 127.0.0.1, no network namespaces")
    args = p.parse_args(argv)
    reason = unavailable()
    if reason:
        raise SystemExit(f"error: {reason}")
    folder = args.folder or tempfile.mkdtemp(prefix="slurm_cluster_")
    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    with Cluster(folder, namespaces=not args.loopback) as cluster:
        interface = (f"SOCKET_IFNAME={INTERFACE}" if cluster.namespaces
                     else "LOOPBACK_OK=1")
        nodes = ", ".join(f"{node} at {cluster.addr[node]}" for node in NODES)
        print(f"nodes {nodes}; logs in {folder}\nin another shell:\n"
              f"  export SLURM_CONF={cluster.conf}\n  sinfo\nand give the recipe "
              f"{interface} (see examples/slurm/README.md); Ctrl-C here stops the "
              "cluster and its jobs", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:  # a second one must not cut the stop short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
