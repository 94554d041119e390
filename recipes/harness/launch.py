"""Where this process sits in the job, and the process group it trains in.

- ``detect_dist_env``: the rank layout, from torchrun's variables or from Slurm's when ``srun`` started the
  recipe directly (rendezvous host = first node of the job, never "localhost").
- ``check_expected_world_size``: refuse a world other than the one slurm/lib/launch.sh started.
- ``check_gpus_visible``: refuse to train on the CPU when Slurm gave the job GPUs.
- ``setup_torch_distributed``: device and backend (NCCL on CUDA, gloo on CPU) and the process group.
- ``startup_times``: where this process's start-up went (the launcher's preflight, srun and the container,
  Python's imports, the rendezvous), for metrics.json: at scale these, not the steps, are a job's first minutes.
- ``leave_process_group``: the teardown at the end of a run (``exit_after_leaving_the_group``: and the exit).
- ``all_hostnames``, ``average_across_ranks``, ``mean_across_ranks``, ``max_difference_across_ranks``: the few
  collectives every PyTorch recipe needs for its logs and stop agreement (TrainingRun's sync every few
  steps), its evaluations and its end-of-run proof.
- ``failed_collective_rank`` / ``exit_on_collective_failure``: a collective that failed (another rank died
  or hung) becomes one line naming this rank and host, and exit code 4, after this rank's Flight Recorder
  (``dump_flight_recorder``) is written where the launcher asked (TORCH_FR_DUMP_TEMP_FILE).

PyTorch is imported inside the functions that use it: the TensorFlow recipes import this module too.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .contract import EXIT_COLLECTIVE_FAILED, EXPECTED_WORLD_SIZE_ENV
from .errors import ConfigError, stderr_line

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "srun" or "single"


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, e.g. ``nid[000001-000003,000007],login01`` -> one name per host."""
    hosts: list[str] = []
    for item in _split_outside_brackets(hostlist):
        match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        suffixes = expand_hostlist(rest) if rest else [""]
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for number in range(int(first), int(last or first) + 1):
                hosts.extend(f"{prefix}{number:0{len(first)}d}{suffix}" for suffix in suffixes)
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def detect_dist_env(environ: dict[str, str] | None = None) -> DistEnv:
    """Where this process sits in the job. Raises ConfigError for layouts that cannot form one world."""
    env = os.environ if environ is None else environ

    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or anything that speaks its protocol)
        return DistEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )

    tasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1)))
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and tasks > 1:
        # The batch script itself runs as "rank 0 of N" with no other ranks: it would wait forever.
        raise ConfigError(
            f"started directly in the batch script of a {tasks}-task job; launch it with srun "
            "(e.g. 'srun python recipes/ddp/train.py') or use slurm/ddp.sh"
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and tasks > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        master_addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "")
        if not master_addr:
            raise ConfigError("srun set no SLURM_JOB_NODELIST and MASTER_ADDR is unset: cannot find rank 0's host")
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=tasks,
            master_addr=master_addr,
            # slurm/lib/launch.sh gives each job its own port (jobs may share a node); bare srun: torch's default
            master_port=int(env.get("MASTER_PORT") or 29500),
            launcher="srun",
        )

    return DistEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=29500, launcher="single")


def ranks_per_node(environ: dict[str, str] | None = None) -> int | None:
    """Ranks on this node, as the launcher says: torchrun's LOCAL_WORLD_SIZE or Slurm's tasks per node."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if env.get(name, "").isdigit():
            return int(env[name])
    match = re.match(r"(\d+)", env.get("SLURM_TASKS_PER_NODE", ""))  # e.g. "4(x2)"
    return int(match.group(1)) if match else None


def nodes_in_job(environ: dict[str, str] | None = None) -> int | None:
    env = os.environ if environ is None else environ
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    return int(nodes) if nodes and nodes.isdigit() else None


def tp_size(value: str) -> int:
    """An argparse type for --tp: a number of ranks, or "node": the ranks of one node (what the launcher
    started there; 1 when nothing says), so that a batch file keeps tensor parallelism inside each node."""
    if value == "node":
        return ranks_per_node() or 1
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"use a number of ranks or 'node' (the ranks of one node), not '{value}'")
    return int(value)


def check_ranks_per_gpu(environ: dict[str, str] | None = None) -> None:
    """One rank per GPU: more ranks on a node than Slurm gave it GPUs would share devices (or fail in NCCL much
    later). Also with HPCML_ALLOW_CPU=1: the layout is wrong either way."""
    env = os.environ if environ is None else environ
    ranks = ranks_per_node(env)
    gpus = env.get("SLURM_GPUS_PER_NODE", "").rpartition(":")[2]  # 4, or a100:4
    if ranks and gpus.isdigit() and 0 < int(gpus) < ranks:
        raise ConfigError(f"{ranks} ranks per node but {gpus} GPUs per node: one rank per GPU; use "
                          f"--ntasks-per-node={gpus} (or ask for --gpus-per-node={ranks})")


# slurm/lib/launch.sh exports the number of ranks it launched (EXPECTED_WORLD_SIZE_ENV). A recipe whose
# framework formed another world (a launcher that started one process, or N independent copies that each see
# world size 1, all exiting 0) stops here instead of training the wrong thing.
def check_expected_world_size(world_size: int, environ: dict[str, str] | None = None) -> None:
    expected = (os.environ if environ is None else environ).get(EXPECTED_WORLD_SIZE_ENV, "")
    if expected.isdigit() and int(expected) != world_size:
        raise ConfigError(
            f"this process joined a world of {world_size} rank(s), but the job launched {expected} "
            f"({EXPECTED_WORLD_SIZE_ENV}): the launcher started the ranks as independent trainings; "
            "check the launch command (torchrun/accelerate/deepspeed options; srun --mpi for MPI) against the allocation"
        )


# Slurm's variables that say the job was given GPUs (per node, the job's devices, --gpus-per-node).
SLURM_GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_PER_NODE")
ALLOW_CPU_ENV = "HPCML_ALLOW_CPU"


def slurm_gave_gpus(environ: dict[str, str] | None = None) -> str | None:
    """``NAME=VALUE`` of the first Slurm variable that gives this job GPUs, None when none does."""
    env = os.environ if environ is None else environ
    for name in SLURM_GPU_VARIABLES:
        value = env.get(name, "").strip()
        count = value.rpartition(":")[2]  # --gpus-per-node=a100:4
        if value and not (count.isdigit() and int(count) == 0):
            return f"{name}={value}"
    return None


def check_gpus_visible(framework: str = "torch", build_only: bool = False, environ: dict[str, str] | None = None) -> None:
    """A job that Slurm gave GPUs must train on them. Without this, a CPU image, a container without its GPU
    devices or a CUDA that failed to start all "train" at CPU speed on GPU nodes, and exit 0.

    ``build_only``: ask only whether the framework is a CUDA build (slurm/preflight.sh on a login node, which
    may have no GPU). HPCML_ALLOW_CPU=1 trains on the CPU anyway (a debugging run, or a cluster whose GPUs
    are placeholders, as the local test cluster's are).
    """
    env = os.environ if environ is None else environ
    given = slurm_gave_gpus(env)
    if not given or env.get(ALLOW_CPU_ENV) == "1":
        return
    allow = f"{ALLOW_CPU_ENV}=1 trains on the CPU anyway"
    image = "run the cuda image (make pull-IMAGE ENGINE=shifter or podman-hpc pulls it)"
    if framework == "tensorflow":
        import tensorflow as tf

        if not tf.test.is_built_with_cuda():
            raise ConfigError(f"Slurm gave this job GPUs ({given}) but TensorFlow {tf.__version__} is a CPU build: "
                              f"{image}; {allow}")
        if build_only or tf.config.list_physical_devices("GPU"):
            return
        cuda_error = "TensorFlow lists no GPU"
    else:
        import torch

        if torch.version.cuda is None:
            raise ConfigError(f"Slurm gave this job GPUs ({given}) but PyTorch {torch.__version__} is a CPU build: "
                              f"{image} or a CUDA PyTorch; {allow}")
        if build_only or torch.cuda.is_available():
            return
        try:  # CUDA's own reason ("Found no NVIDIA driver on your system", ...)
            torch.cuda.init()
            cuda_error = "no CUDA device"
        except Exception as error:  # noqa: BLE001 (any failure of CUDA's start is the reason)
            cuda_error = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    if os.path.exists("/run/.containerenv"):
        cause = "the podman container has no GPU devices: podman-hpc needs --gpu, podman --device nvidia.com/gpu=all"
    elif env.get("SHIFTER_RUNTIME"):
        cause = "Shifter needs the gpu module: add gpu to '#SBATCH --module' (e.g. --module=gpu,nccl-cu13-plugin)"
    else:
        cause = "check nvidia-smi on the node"
    raise ConfigError(f"Slurm gave this job GPUs ({given}) but this rank sees none ({cuda_error}; "
                      f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '(unset)')}): {cause}; {allow}")


GPU_ORDER_ENV = "HPCML_GPU_ORDER"


def gpu_for_local_rank(local_rank: int, gpu_count: int, order: str | None = None) -> int:
    """The GPU (an index into the node's visible GPUs) that local rank ``local_rank`` drives.

    Local rank l drives GPU l, unless HPCML_GPU_ORDER lists each rank's GPU: on Perlmutter GPU k sits next
    to NUMA domain 3-k while `srun --cpu-bind=cores` puts local rank l on the cores of domain l, so
    "3,2,1,0" keeps every rank next to its GPU (slurm/lib/launch.sh sets it there). A rank that sees one
    GPU only (Slurm bound it) drives that one.
    """
    order = os.environ.get(GPU_ORDER_ENV, "") if order is None else order
    if gpu_count == 1 or not order:
        return local_rank % gpu_count
    try:
        gpus = [int(part) for part in order.split(",")]
    except ValueError:
        gpus = []
    if sorted(gpus) != list(range(gpu_count)):
        example = ",".join(str(index) for index in reversed(range(gpu_count)))
        raise ConfigError(f"{GPU_ORDER_ENV}={order!r} must name each of this node's {gpu_count} GPUs once "
                          f"(e.g. {example}); unset it to give local rank l GPU l")
    return gpus[local_rank % gpu_count]


def cpu_list(cpus) -> str:
    """{0, 1, 2, 5} -> "0-2,5" (as taskset and Slurm write CPU lists)."""
    ranges, cpus = [], sorted(cpus)
    for cpu in cpus:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in ranges)


# Wall-clock marks of this process's start-up (seconds since the epoch), filled in by setup_torch_distributed.
_STARTUP: dict[str, float] = {}


def process_started_at() -> float | None:
    """When this process was started (Linux), so that the imports before any harness code are counted too.

    /proc/self/stat gives the start in clock ticks since boot; CLOCK_BOOTTIME is now on the same clock."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def _launcher_mark(name: str) -> float | None:
    """A time slurm/lib/launch.sh exported (HPCML_BATCH_STARTED_AT, ...), None outside its jobs."""
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def startup_times() -> dict:
    """This process's start-up, in seconds, as metrics.json's "startup" records it (rank 0's view).

    batch_started_at/step_started_at: when the job's batch script reached the launcher and when it started
    srun (after the preflight, preflight_s); process_started_at: this Python process (after srun and the
    container runtime: srun_to_process_s); imports_s: from there to the process group (Python's imports:
    a shared file system's metadata storm at scale); rendezvous_s: joining the process group, which ends
    when the last rank has joined, so it also holds the slowest rank's lag; arrival_spread_s: between the
    first and the last rank reaching the group (their start-up's spread); rendezvous_after_last_arrival_s:
    the rendezvous itself (store and connections) once the last rank was there."""
    times: dict = {"batch_started_at": _launcher_mark("HPCML_BATCH_STARTED_AT"),
                   "preflight_s": _launcher_mark("HPCML_PREFLIGHT_S"),
                   "step_started_at": _launcher_mark("HPCML_STEP_STARTED_AT"),
                   "process_started_at": process_started_at()}
    if times["step_started_at"] is not None and times["process_started_at"] is not None:
        times["srun_to_process_s"] = times["process_started_at"] - times["step_started_at"]
    if "group_started_at" in _STARTUP and times["process_started_at"] is not None:
        times["imports_s"] = _STARTUP["group_started_at"] - times["process_started_at"]
    if "group_joined_at" in _STARTUP:
        times["rendezvous_s"] = _STARTUP["group_joined_at"] - _STARTUP["group_started_at"]
    if "last_arrival_at" in _STARTUP:
        times["arrival_spread_s"] = _STARTUP["last_arrival_at"] - _STARTUP["first_arrival_at"]
        times["rendezvous_after_last_arrival_s"] = _STARTUP["group_joined_at"] - _STARTUP["last_arrival_at"]
    return times


def setup_torch_distributed(env: DistEnv, timeout_s: float, always_group: bool = False) -> tuple[torch.device, str]:
    """Pick device and backend, and join the process group when there is more than one rank.

    NCCL needs CUDA; on a CPU-only machine gloo is the only backend that works, so the choice is made from
    the hardware, not from a flag that could be set wrongly. ``always_group``: a one-rank group too, in
    memory and without a port, for frameworks that always want one (DeepSpeed, megatron-core).
    """
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        device = torch.device("cuda", gpu_for_local_rank(env.local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if os.environ.get("SLURM_JOB_ID"):  # in a job's log: where each rank runs, so a bad binding shows
        print(f"[launch] rank {env.rank} (local rank {env.local_rank}) on {socket.gethostname()}: "
              f"cpus {cpu_list(os.sched_getaffinity(0))}, device {device}", flush=True)

    _STARTUP["group_started_at"] = time.time()
    if env.world_size > 1:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
        if dist.get_world_size() != env.world_size:
            raise RuntimeError(f"process group has {dist.get_world_size()} ranks, expected {env.world_size}")
        _STARTUP["group_joined_at"] = time.time()
        # When the first and the last rank reached the group (one tiny all-reduce): the rendezvous itself,
        # apart from the ranks' spread in start-up (imports) that rank 0 waited through.
        arrived = torch.tensor([_STARTUP["group_started_at"], -_STARTUP["group_started_at"]], dtype=torch.float64,
                               device=device)
        dist.all_reduce(arrived, op=dist.ReduceOp.MAX)
        _STARTUP["last_arrival_at"], _STARTUP["first_arrival_at"] = arrived[0].item(), -arrived[1].item()
    elif always_group:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device if backend == "nccl" else None)  # (else barrier() warns on GPU)
    _STARTUP.setdefault("group_joined_at", time.time())
    return device, backend


def dump_flight_recorder() -> tuple[str, str] | None:
    """This rank's Flight Recorder (its last collectives, the one that failed among them) to
    TORCH_FR_DUMP_TEMP_FILE<rank>, as NCCL's watchdog writes it on a timeout; gloo has no such watchdog, so a
    rank whose collective failed writes its own. Returns the file and its last collective ("gloo:all_reduce
    #12"), or None (not asked for, or nothing to dump)."""
    import pickle

    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    torch_dist = sys.modules.get("torch.distributed")
    if not prefix or torch_dist is None or not torch_dist.is_initialized():
        return None
    path = f"{prefix}{torch_dist.get_rank()}"
    try:
        if not os.path.exists(path):  # (else NCCL's watchdog was first)
            from torch._C._distributed_c10d import _dump_fr_trace

            trace = _dump_fr_trace(True, True, False)  # collectives, stack traces, finished ones too
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path + ".tmp", "wb") as file:
                file.write(trace)
            os.replace(path + ".tmp", path)
        with open(path, "rb") as file:
            entries = pickle.load(file).get("entries") or [{}]
    except (ImportError, RuntimeError, OSError, pickle.UnpicklingError, AttributeError):
        return None  # evidence is a bonus here: the rank is failing already, and says why
    last = entries[-1]
    return path, f"{last.get('profiling_name', '?')} #{last.get('collective_seq_id', '?')}"


def leave_process_group() -> None:
    """All ranks together, while the interpreter is fully alive: a gloo group still alive at interpreter exit
    can abort the process (SIGABRT, exit != 0 after a successful run). Drop what holds the group first
    (DDP's reducer, an engine, the optimizer), as the recipes do just before calling this."""
    import gc

    import torch.distributed as dist

    global _left_process_group
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    _left_process_group = True


_left_process_group = False


def exit_after_leaving_the_group(code: int) -> None:
    """After leave_process_group, end the process without the interpreter's teardown: what remains there is
    the destruction of torch's C++ state, where gloo has aborted a rank after a complete run (SIGABRT,
    "terminate called without an active exception": once in a run of this project's default test tier, among
    its hundreds of multi-rank runs), failing a job that had trained and written everything. Files, streams and
    logs are flushed first; a process with children of its own (--data-workers) exits the ordinary way, so
    that they are shut down."""
    import logging
    import multiprocessing

    if not _left_process_group or multiprocessing.active_children():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_hostnames(world_size: int) -> list[str]:
    """Every rank's hostname, in rank order (proves which nodes really took part)."""
    name = socket.gethostname()
    if world_size == 1:
        return [name]
    import torch.distributed as dist

    names: list[str | None] = [None] * world_size
    dist.all_gather_object(names, name)
    return [str(n) for n in names]


def gather_from_ranks(value, world_size: int) -> list:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    if world_size == 1:
        return [value]
    import torch.distributed as dist

    values = [None] * world_size
    dist.all_gather_object(values, value)
    return values


def mean_across_ranks(value: torch.Tensor, world_size: int) -> float:
    value = value.detach()
    if world_size > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world_size
    return float(value)


def average_across_ranks(world_size: int, device) -> Callable[[list], list[float]]:
    """A function averaging a list of numbers over all ranks in one all-reduce (the same answer on every
    rank): 0-d tensors on ``device`` (a rank's loss, read on the host only after the reduction) or plain
    numbers. One process: the values themselves, as floats. TrainingRun's sync every few steps uses it."""
    if world_size == 1:
        return lambda values: [float(value) for value in values]

    def average(values: list) -> list[float]:
        import torch
        import torch.distributed as dist

        vector = torch.stack([torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())
                              for value in values])
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
        return (vector / world_size).tolist()  # (tolist: the one host-device synchronisation of the sync)

    return average


def max_difference_across_ranks(tensors: list[torch.Tensor], world_size: int, group=None) -> float:
    """Largest elementwise spread (max - min over the ranks of ``group``, default all) of the given tensors.

    0.0 when all ranks agree. ``world_size`` is the size of that group.
    """
    if world_size == 1 or not tensors:
        return 0.0
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.detach().float().flatten() for t in tensors])
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    return float((highest - lowest).max())


# What torch.distributed's errors say when the other side of a collective went away or never came: gloo
# raises a plain RuntimeError from its transport ("Connection reset by peer", "Timed out waiting 5000ms for
# recv"), NCCL a DistBackendError. Any other RuntimeError (a dtype mismatch, a shape error) is a bug in this
# process and keeps its traceback: naming it "a collective failed" would send the user to the wrong rank.
COLLECTIVE_FAILURE_SIGNS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
                            "Timed out waiting", "NCCL", "ProcessGroup", "Broken pipe")


def failed_collective_rank(error: BaseException) -> int | str | None:
    """This process's rank if ``error`` is a collective that failed, else None (then it is a real bug).

    Once its group exists, torch.distributed raises DistError (NCCL) or a RuntimeError from gloo's transport
    (COLLECTIVE_FAILURE_SIGNS); Horovod raises its own and TensorFlow's errors. Only frameworks already
    imported are asked (no torch in the TensorFlow recipes).
    """
    torch_dist = sys.modules.get("torch.distributed")
    if isinstance(error, RuntimeError) and torch_dist and torch_dist.is_available() and torch_dist.is_initialized():
        if isinstance(error, getattr(torch_dist, "DistError", ())) or any(sign in str(error) for sign in COLLECTIVE_FAILURE_SIGNS):
            return torch_dist.get_rank()
        return None
    if type(error).__module__.startswith(("tensorflow", "horovod")):
        for name in ("horovod.tensorflow", "horovod.torch"):
            hvd = sys.modules.get(name)
            if hvd is not None:
                return hvd.rank() if hvd.is_initialized() else "?"
    return None


def exit_on_collective_failure(recipe: str, error: BaseException, rank: int | str = "?") -> None:
    """One line naming this rank and host when a collective fails or times out, then exit 4.

    Every surviving rank says it; srun (--kill-on-bad-exit) then ends the job. The rank that really failed
    is the one that died (srun names it), or the one that is missing from these lines.
    """
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    recorded = dump_flight_recorder()
    evidence = f" (its last collective: {recorded[1]}; flight recorder: {recorded[0]})" if recorded else ""
    stderr_line(f"[{recipe}] error: rank {rank} on {socket.gethostname()}: a collective failed ({first_line[:200]}): "
                f"another rank died, hung or was stopped; the job ends here{evidence}")
    sys.exit(EXIT_COLLECTIVE_FAILED)
