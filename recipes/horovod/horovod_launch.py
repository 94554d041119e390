"""How the Horovod recipes form one world, whichever way their ranks were started.

- ``horovodrun --gloo -np N python ...``: horovodrun runs the rendezvous and sets every rank's HOROVOD_*
  variables; nothing to do here.
- ``mpiexec -n N`` or ``srun --mpi=pmi2`` (or Cray's ``--mpi=cray_shasta``) with HOROVOD_CONTROLLER=mpi:
  MPI forms the world (Cray MPICH replaces the image's MPICH under Shifter/podman-hpc); nothing to do.
- ``srun`` without MPI (the default of slurm/horovod.sh: one task per rank, in any container runtime): nobody
  runs horovodrun's rendezvous, and hvd.init() would make every task a world of one that trains alone and
  exits 0. So rank 0 serves Horovod's own rendezvous (its HTTP key-value store) on MASTER_ADDR:MASTER_PORT,
  every rank gets the HOROVOD_* layout horovodrun would have given it (from Slurm's variables), and
  Horovod's gloo controller does the rest: the same code path as horovodrun, with srun as the launcher.

``prepare_world()`` must run before ``hvd.init()``; it returns the launcher's name for the logs.
``check_mpi_controller()`` refuses HOROVOD_CONTROLLER=mpi with a Horovod that cannot use it (the preflight
and every rank call it first).
``add_batch_options`` adds the batch and learning-rate options both Horovod recipes take, in Horovod's
convention (the batch is per rank, the learning rate is scaled by the world size).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness
import harness  # noqa: E402

# Horovod loads TensorFlow when it is installed, also for horovod.torch: no INFO lines from TensorFlow's C++
# side (CPU features) in the log of either recipe (keras_model.py sets the same for the TensorFlow one).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def add_batch_options(p: argparse.ArgumentParser, lr: float, optimizer: str) -> None:
    p.add_argument("--batch-per-rank", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=lr, help=f"{optimizer} learning rate for one rank; used x world size")


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's SLURM_STEP_TASKS_PER_NODE, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise harness.ConfigError(f"cannot read SLURM_STEP_TASKS_PER_NODE='{spec}'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slot_layout(hosts: list[str], counts: list[int]) -> list[dict]:
    """One dict per rank, as horovodrun assigns them: ranks fill the hosts in order (srun's block
    distribution); cross_rank/cross_size number the hosts that have a rank with the same local rank."""
    if len(hosts) != len(counts):
        raise harness.ConfigError(f"{len(hosts)} hosts in the step's node list but task counts for {len(counts)}")
    size = sum(counts)
    slots, rank = [], 0
    for host_index, (host, count) in enumerate(zip(hosts, counts)):
        for local_rank in range(count):
            peers = [i for i, c in enumerate(counts) if c > local_rank]  # hosts with this local rank
            slots.append({"hostname": host, "rank": rank, "local_rank": local_rank, "local_size": count,
                          "cross_rank": peers.index(host_index), "cross_size": len(peers), "size": size})
            rank += 1
    return slots


def horovod_mpi_libraries() -> set[str]:
    """The MPI libraries (sonames) this installation's Horovod extensions link, read from the files without
    importing Horovod or the frameworks: empty when Horovod was built without MPI (or is not installed).
    (Its extensions are called mpi_lib* whatever the controller; only an MPI build links libmpi.so.N.)"""
    import importlib.util

    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return set()
    names: set[str] = set()
    for location in spec.submodule_search_locations:
        for library in Path(location).glob("*/mpi_lib*.so"):
            names.update(match.decode() for match in re.findall(rb"libmpi\.so\.\d+", library.read_bytes()))
    return names


def check_mpi_controller(environ: dict | None = None, libraries: set[str] | None = None) -> None:
    """HOROVOD_CONTROLLER=mpi needs a Horovod built with MPI against the MPICH ABI (libmpi.so.12): then
    Cray MPICH (Shifter's mpich module, podman-hpc --mpi) replaces the image's MPICH and srun starts one
    MPI world. NGC's TensorFlow image (the horovod image's cuda flavor) links Open MPI (libmpi.so.40),
    which neither swap applies to: refused before any rank starts, with the controller that does work."""
    env = os.environ if environ is None else environ
    if env.get("HOROVOD_CONTROLLER") != "mpi":
        return
    libraries = horovod_mpi_libraries() if libraries is None else libraries
    default = "unset HOROVOD_CONTROLLER: the default gloo controller starts with srun alone (NCCL still moves the tensors on GPUs)"
    if not libraries:
        raise harness.ConfigError(f"HOROVOD_CONTROLLER=mpi, but this Horovod was built without MPI: {default}")
    if "libmpi.so.12" not in libraries:
        raise harness.ConfigError(
            f"HOROVOD_CONTROLLER=mpi, but this Horovod links {', '.join(sorted(libraries))} (Open MPI, as in NGC's "
            f"TensorFlow image), not the MPICH ABI (libmpi.so.12) that Cray MPICH replaces under Shifter and podman-hpc: {default}")


def prepare_world(environ: dict | None = None, rendezvous_timeout_s: float = 120.0) -> str:
    env = os.environ if environ is None else environ
    if "HOROVOD_RANK" in env:
        return "horovodrun"
    under_srun = "SLURM_STEP_ID" in env
    if env.get("HOROVOD_CONTROLLER") == "mpi":
        return "srun (MPI controller)" if under_srun else "mpiexec (MPI controller)"
    if not under_srun:
        return "mpiexec (MPI controller)" if "PMI_RANK" in env else "single"
    dist_env = harness.detect_dist_env(env)  # srun: rank, world size, rank 0's host, the job's port
    if dist_env.world_size == 1:
        return "single"
    hosts = harness.expand_hostlist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
    slots = slot_layout(hosts, tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))))
    mine = slots[dist_env.rank]
    here = env.get("SLURMD_NODENAME", socket.gethostname())
    if mine["hostname"] != here or mine["local_rank"] != dist_env.local_rank:
        raise harness.ConfigError(
            f"srun placed rank {dist_env.rank} on {here} (local rank {dist_env.local_rank}), not where a block "
            f"distribution puts it ({mine['hostname']}, local rank {mine['local_rank']}): use srun's default "
            "--distribution=block"
        )
    address, port = dist_env.master_addr, dist_env.master_port
    if dist_env.rank == 0:
        serve_rendezvous(port, slots)
    else:
        wait_for_port(address, port, rendezvous_timeout_s)
    env.update({
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": env.get("HOROVOD_CPU_OPERATIONS", "gloo"),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": address, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_HOSTNAME": mine["hostname"],
        **{f"HOROVOD_{key.upper()}": str(mine[key])
           for key in ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")},
    })
    return "srun (gloo controller, rendezvous on rank 0)"


def serve_rendezvous(port: int, slots: list[dict]) -> None:
    """Horovod's rendezvous server (what horovodrun runs), in a daemon thread of rank 0."""
    import threading

    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    try:
        server = RendezvousHTTPServer(("", port), RendezvousHandler, 0)
    except OSError as error:
        raise harness.ConfigError(f"rank 0 cannot serve Horovod's rendezvous on port {port} ({error.strerror}): "
                                 "set MASTER_PORT to a free port") from None
    server.init([SlotInfo(**slot) for slot in slots])
    threading.Thread(target=server.serve_forever, name="horovod-rendezvous", daemon=True).start()


def wait_for_port(address: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((address, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise harness.ConfigError(
                    f"rank 0's Horovod rendezvous at {address}:{port} did not answer within {timeout_s:.0f} s: "
                    "rank 0 failed to start (see its error above) or the port is blocked between the nodes"
                ) from None
            time.sleep(0.2)
