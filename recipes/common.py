"""What every recipe needs, and nothing more.

- ``detect_dist_env``: this process's rank layout, from torchrun's variables or from Slurm's when the
  recipe is started by ``srun`` directly (rendezvous host = first node of the job, never "localhost").
- ``setup_torch_distributed``: device and backend (NCCL on CUDA, gloo on CPU) and the process group.
- ``SyntheticTokens`` (``numpy_token_batch`` for TensorFlow): deterministic token batches; step ``s`` is the
  same global batch at any world size.
- ``MetricsLogger`` and ``transformer_flops_per_token`` / ``peak_flops``: rank-0 logs, JSON, MFU.
- ``save_checkpoint`` / ``latest_checkpoint``: atomic checkpoint files (temp name, fsync, rename), and
  ``staging_checkpoint_dir`` / ``publish_checkpoint_dir`` the same for checkpoints written by every rank,
  ``save_checkpoint_dir`` / ``checkpoint_dir_to_resume`` for a framework's files plus meta.json (TensorFlow).

Recipes put ``recipes/`` on ``sys.path`` and ``import common``; the file has no other project imports.
PyTorch is imported inside the functions that use it, so the TensorFlow recipes (recipes/horovod,
recipes/tf_mirrored) share the rest without loading a second framework into their processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ConfigError(Exception):
    """Bad input found before any process starts talking to another. Its message says what to change."""


def stderr_line(text: str) -> None:
    """``text`` and its newline in one write. Ranks often print the same message at the same moment into one
    log, unbuffered (PYTHONUNBUFFERED=1): print() writes the text and the newline separately, and two ranks'
    lines then run into each other ("...error: A[...] error: A\n\n")."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def exit_on_config_error(recipe: str, error: ConfigError) -> None:
    """One line on stderr, exit code 2: what users see instead of a stack trace."""
    stderr_line(f"[{recipe}] error: {error}")
    sys.exit(2)


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; a ``--config FILE.toml`` gives defaults that the command line overrides.

    Keys are the option names without '--' (dashes or underscores). An unknown key, a value of the wrong
    type or a file that is not TOML is a ConfigError naming the file and the key.
    """
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    try:
        values = tomllib.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"cannot read --config {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path} is not valid TOML: {error}") from None
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", "preflight")}
    defaults = {}
    for key, value in values.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            known = ", ".join(sorted(name.replace("_", "-") for name in actions))
            raise ConfigError(f"unknown option '{key}' in --config {path}; known: {known}")
        action = actions[dest]
        flag = isinstance(action, argparse._StoreTrueAction)
        wanted = bool if flag else (action.type or str)
        acceptable = {bool: (bool,), int: (int,), float: (int, float)}.get(wanted, (str,))
        if not isinstance(value, acceptable) or (isinstance(value, bool) and wanted is not bool):
            raise ConfigError(f"'{key}' in --config {path} must be {'true/false' if flag else wanted.__name__}, "
                              f"got {value!r}")
        value = value if flag else wanted(value)
        if action.choices and value not in action.choices:
            raise ConfigError(f"'{key}' in --config {path} must be one of {list(action.choices)}, got {value!r}")
        defaults[dest] = value
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Distributed environment


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


def default_master_port(job_id: str | None) -> int:
    """Same on every rank of a job, different between jobs that may share a node."""
    return 29500 + int(job_id) % 10000 if job_id and job_id.isdigit() else 29500


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
            master_port=int(env.get("MASTER_PORT") or default_master_port(env.get("SLURM_JOB_ID"))),
            launcher="srun",
        )

    return DistEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=29500, launcher="single")


# slurm/lib/launch.sh exports the number of ranks it launched. A recipe whose framework formed another world
# (a launcher that started one process, or N independent copies that each see world size 1, all exiting 0)
# stops here instead of training the wrong thing.
EXPECTED_WORLD_SIZE_ENV = "HPCML_EXPECTED_WORLD_SIZE"


def check_expected_world_size(world_size: int, environ: dict[str, str] | None = None) -> None:
    expected = (os.environ if environ is None else environ).get(EXPECTED_WORLD_SIZE_ENV, "")
    if expected.isdigit() and int(expected) != world_size:
        raise ConfigError(
            f"this process joined a world of {world_size} rank(s), but the job launched {expected} "
            f"({EXPECTED_WORLD_SIZE_ENV}): the launcher started the ranks as independent trainings; "
            "check the launch command (torchrun/accelerate/deepspeed options; srun --mpi for MPI) against the allocation"
        )


def setup_torch_distributed(env: DistEnv, timeout_s: float) -> tuple[torch.device, str]:
    """Pick device and backend, and join the process group when there is more than one rank.

    NCCL needs CUDA; on a CPU-only machine gloo is the only backend that works, so the choice is made from
    the hardware, not from a flag that could be set wrongly.
    """
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
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
    return device, backend


def exit_on_collective_failure(recipe: str, error: Exception, rank: int | str | None = None) -> None:
    """One line naming this rank and host when a collective fails or times out, then exit 4.

    Every surviving rank says it; srun (--kill-on-bad-exit) then ends the job. The rank that really failed
    is the one that died (srun names it), or the one that is missing from these lines. ``rank``: this
    process's rank where torch.distributed is not what formed the world (Horovod).
    """
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else "?"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    stderr_line(f"[{recipe}] error: rank {rank} on {socket.gethostname()}: a collective failed ({first_line[:200]}): "
                "another rank died, hung or was stopped; the job ends here")
    sys.exit(4)


# --------------------------------------------------------------------------------------------------
# Time limits and preemption

# The sbatch files ask Slurm for SIGUSR1 shortly before the time limit (--signal=USR1@T). A recipe that
# gets it finishes its step, checkpoints, writes OUT_DIR/STOP_MARKER ("SIGUSR1 after step N") and exits 0
# (a non-zero exit would make srun kill the ranks still finishing); slurm/lib/launch.sh then requeues
# the job, and the requeued run resumes from the checkpoint.
STOP_MARKER = "stopped_by_signal"
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """SIGUSR1 (time limit ahead) or SIGTERM (preemption, scancel): stop after the current step.

    Signals reach the ranks at slightly different moments, so the ranks agree on when to stop: after each
    step every rank contributes what it received and all stop at the same step.
    """

    def __init__(self, recipe: str, rank: int):
        self.recipe, self.rank, self.received = recipe, rank, 0
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if not self.received:
            stderr_line(f"[{self.recipe}] rank {self.rank}: {signal.Signals(signum).name} received: "
                        "checkpointing after this step, then exiting")
        self.received = max(self.received, int(signum))

    def agreed(self, world_size: int, device: torch.device) -> int:
        """The signal any rank received (0: none); the same answer on every rank."""
        if world_size == 1:
            return self.received
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.received], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    @staticmethod
    def write_marker(out_dir: Path, signum: int, step: int) -> None:
        atomic_write_bytes(Path(out_dir) / STOP_MARKER, f"{signal.Signals(signum).name} after step {step}\n".encode())


def all_hostnames(world_size: int) -> list[str]:
    """Every rank's hostname, in rank order (proves which nodes really took part)."""
    name = socket.gethostname()
    if world_size == 1:
        return [name]
    import torch.distributed as dist

    names: list[str | None] = [None] * world_size
    dist.all_gather_object(names, name)
    return [str(n) for n in names]


def mean_across_ranks(value: torch.Tensor, world_size: int) -> float:
    if world_size > 1:
        import torch.distributed as dist

        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world_size
    return float(value)


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


# --------------------------------------------------------------------------------------------------
# Synthetic data


class SyntheticTokens:
    """Arithmetic token sequences, x[t] = (start + t * stride) mod vocab, with a random start and stride per row.

    A model has to read the context to predict the next token, so the loss falls well below ln(vocab) as it
    learns. Step ``s`` always yields the same global batch (generated from ``seed`` and ``s``), and rank r
    takes rows [r * b, (r + 1) * b): the data depends on the step, not on the world size or on a resume.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, max_stride: int = 7):
        self.vocab_size, self.seq_len, self.seed, self.max_stride = vocab_size, seq_len, seed, max_stride

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=generator)
        stride = torch.randint(1, self.max_stride + 1, (batch_size, 1), generator=generator)
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:, :-1], tokens[:, 1:]

    def local_batch(self, step: int, global_batch_size: int, rank: int, world_size: int):
        inputs, targets = self.global_batch(step, global_batch_size)
        per_rank = global_batch_size // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        return inputs[rows], targets[rows]


def numpy_token_batch(vocab_size: int, seq_len: int, seed: int, step: int, batch_size: int, max_stride: int = 7):
    """The same task as SyntheticTokens, drawn with NumPy (for the TensorFlow recipes): the global batch of
    ``step`` as int32 arrays (inputs, targets). The rows differ from SyntheticTokens' (another generator)."""
    import numpy as np

    generator = np.random.default_rng(seed * 1_000_003 + step)
    start = generator.integers(0, vocab_size, (batch_size, 1))
    stride = generator.integers(1, max_stride + 1, (batch_size, 1))
    tokens = ((start + stride * np.arange(seq_len + 1)) % vocab_size).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------------------------------
# Metrics and MFU

# Dense peak FLOP/s per GPU from NVIDIA's data sheets (bf16 tensor cores; fp32 without TF32).
# Keyed by dtype name, the same in PyTorch and TensorFlow.
GPU_PEAK_FLOPS = {
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
}


def gpu_peak_flops(device_name: str, dtype_name: str) -> tuple[float, str]:
    """The data-sheet peak of the GPU called ``device_name`` (as the framework reports it), and its source."""
    for gpu, table in GPU_PEAK_FLOPS.items():
        if gpu in device_name and dtype_name in table:
            return table[dtype_name], f"{gpu} data sheet, {dtype_name} dense"
    return float("nan"), f"unknown GPU '{device_name}': pass --peak-tflops"


def transformer_flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (forward + backward) plus 12*L*d*T for attention.

    The formula of the PaLM paper (appendix B); N excludes position embeddings, which are lookups.
    """
    return 6.0 * n_params + 12.0 * n_layer * d_model * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None) -> tuple[float, str]:
    """The per-device peak that MFU divides by, and where the number came from (logged with every MFU)."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        import torch

        return gpu_peak_flops(torch.cuda.get_device_name(device), str(dtype).removeprefix("torch."))
    return measure_cpu_matmul_flops(dtype)


def measure_cpu_matmul_flops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.3) -> tuple[float, str]:
    """A CPU has no data-sheet peak that means much; measure a large matmul, same dtype and threads, now."""
    import torch

    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b)
        count += 1
    flops = 2.0 * size**3 * count / elapsed
    return flops, f"measured: {size}x{size} {str(dtype).removeprefix('torch.')} matmul, {torch.get_num_threads()} threads"


@dataclass
class MetricsLogger:
    """Rank 0 prints one line per logged step and writes everything to ``path`` as JSON."""

    recipe: str
    path: Path
    is_logging_rank: bool
    tokens_per_sample: int
    flops_per_token: float
    peak_flops_per_device: float
    peak_source: str
    world_size: int
    log_every: int = 1
    run_info: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)

    def log_step(self, step: int, loss: float, samples: int, step_time_s: float, lr: float) -> None:
        tokens_per_s = samples * self.tokens_per_sample / step_time_s
        mfu = tokens_per_s * self.flops_per_token / (self.world_size * self.peak_flops_per_device)
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "step_time_s": step_time_s,
            "samples_per_s": samples / step_time_s,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
        }
        self.history.append(record)
        if self.is_logging_rank and (step % self.log_every == 0):
            print(
                f"[{self.recipe}] step {step:5d} | loss {loss:.4f} | {record['samples_per_s']:8.1f} samples/s"
                f" | {tokens_per_s:10.0f} tokens/s | MFU {100 * mfu:5.2f}%",
                flush=True,
            )

    def summary(self) -> dict:
        # The first step of a process includes warm-up (allocator, NCCL/gloo connections): leave it out.
        timed = self.history[1:] or self.history
        mean = lambda key: sum(r[key] for r in timed) / len(timed) if timed else float("nan")  # noqa: E731
        return {
            "steps": len(self.history),
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "mean_samples_per_s": mean("samples_per_s"),
            "mean_tokens_per_s": mean("tokens_per_s"),
            "mean_mfu": mean("mfu"),
            "flops_per_token": self.flops_per_token,
            "mfu_formula": "tokens/s * (6N + 12*L*d*T) / (world_size * peak)",
            "peak_flops_per_device": self.peak_flops_per_device,
            "peak_source": self.peak_source,
        }

    def write(self, extra: dict | None = None) -> None:
        if not self.is_logging_rank:
            return
        document = {"recipe": self.recipe, **self.run_info, **(extra or {}), "summary": self.summary(), "history": self.history}
        atomic_write_bytes(self.path, (json.dumps(document, indent=2, default=str) + "\n").encode())


# --------------------------------------------------------------------------------------------------
# Checkpoints

CHECKPOINT_PATTERN = re.compile(r"step_(\d{8})\.pt")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data))


def _atomic_write(path: Path, write) -> None:
    """Write to a temporary name in the same directory, fsync, then rename over the target.

    A crash at any point leaves either the old file or the complete new one, never a torn file under the
    real name; the rename is made durable by fsyncing the directory too.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# Tests only: kill this process (SIGKILL) halfway through writing the checkpoint of this step, to show that
# a crash mid-write leaves the previous checkpoint as the one resume uses (tests/test_reliability.py).
CRASH_DURING_CHECKPOINT_ENV = "HPCML_TEST_CRASH_DURING_CHECKPOINT"


def save_checkpoint(directory: Path, step: int, state: dict, keep: int = 2) -> Path:
    """Atomically write ``step_XXXXXXXX.pt`` and delete all but the newest ``keep`` checkpoints.

    Temporary files left by a write that crashed are removed here; they are never read.
    """
    directory = Path(directory)
    path = directory / f"step_{step:08d}.pt"
    if directory.is_dir():
        for stale in directory.glob(".step_*.pt.tmp.*"):
            stale.unlink(missing_ok=True)
    import torch

    if os.environ.get(CRASH_DURING_CHECKPOINT_ENV) == str(step):
        def write(f):
            torch.save(state, f)
            f.truncate(f.tell() // 2)
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
    else:
        def write(f):
            torch.save(state, f)
    _atomic_write(path, write)
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary files of an interrupted write are never listed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if CHECKPOINT_PATTERN.fullmatch(p.name))


def latest_checkpoint(directory: Path) -> Path | None:
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1] if checkpoints else None


# Frameworks that shard state over ranks (accelerate, DeepSpeed) write a directory per checkpoint, a file
# or more per rank. The same promise as above: every rank writes into a staging directory; after a barrier
# rank 0 renames it to step_XXXXXXXX, so a directory under that name is always complete.
CHECKPOINT_DIR_PATTERN = re.compile(r"step_(\d{8})")


def staging_checkpoint_dir(directory: Path, step: int) -> Path:
    """Where every rank writes the checkpoint of ``step`` before it is published (never read by a resume)."""
    return Path(directory) / f".step_{step:08d}.partial"


def publish_checkpoint_dir(directory: Path, step: int, keep: int = 2) -> Path:
    """Rank 0, after all ranks finished writing: rename the staging directory, keep the newest ``keep``.

    Staging directories of writes that crashed (any step) are removed here.
    """
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    if final.exists():  # the same step written again (a rerun after a crash that came after publishing)
        shutil.rmtree(final)
    os.replace(staging_checkpoint_dir(directory, step), final)
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
    for stale in directory.glob(".step_*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoint_dirs(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoint_dirs(directory: Path) -> list[Path]:
    """Published checkpoint directories, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and CHECKPOINT_DIR_PATTERN.fullmatch(p.name))


def latest_checkpoint_dir(directory: Path) -> Path | None:
    checkpoints = list_checkpoint_dirs(directory)
    return checkpoints[-1] if checkpoints else None


# The TensorFlow recipes' checkpoints: a directory of the framework's files plus meta.json (the step, the
# metrics history and what must match to resume), published like the directories above.

def save_checkpoint_dir(directory: Path, step: int, write_files, meta: dict, keep: int = 2) -> Path:
    """``write_files(staging_dir)`` writes the framework's files; then meta.json; then the rename."""
    staging = staging_checkpoint_dir(directory, step)
    staging.mkdir(parents=True, exist_ok=True)
    write_files(staging)
    atomic_write_bytes(staging / "meta.json", json.dumps({"step": step, **meta}).encode())
    return publish_checkpoint_dir(directory, step, keep)


def checkpoint_dir_to_resume(directory: Path, no_resume: bool, must_match: dict) -> tuple[Path | None, dict | None]:
    """The newest published checkpoint directory and its meta.json, if the ``must_match`` entries it recorded
    (model, batch) are this run's; otherwise a ConfigError that says what differs."""
    latest = None if no_resume else latest_checkpoint_dir(directory)
    if latest is None:
        return None, None
    try:
        meta = json.loads((latest / "meta.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {latest}/meta.json ({error}): move {latest} away, or use --no-resume") from None
    written = {key: meta.get(key) for key in must_match}
    if written != must_match:
        raise ConfigError(f"{latest} was written with {written}, this run has {must_match}: use the same settings, "
                          "a new --out-dir, or --no-resume")
    return latest, meta


def rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def container_runtime() -> str:
    """The container this process runs in, as far as the runtime says so ("none" on the bare host)."""
    if os.environ.get("SHIFTER_RUNTIME") or os.path.isdir("/opt/udiImage"):
        return "shifter"
    if os.path.exists("/run/.containerenv"):
        return "podman"
    if os.path.exists("/.dockerenv"):
        return "docker"
    return "none"


def describe_run(env: DistEnv, backend: str, device, wrapper: str, versions: dict | None = None) -> dict:
    """What ran: recorded in every metrics file so a result can be traced back to its layout and versions.

    ``versions``: the framework versions to record (default: PyTorch's).
    """
    if versions is None:
        import torch

        versions = {"torch_version": torch.__version__}
    return {
        "world_size": env.world_size,
        "backend": backend,
        "device": str(device),
        "launcher": env.launcher,
        "master": f"{env.master_addr}:{env.master_port}",
        "model_wrapper": wrapper,
        **versions,
        "python_version": sys.version.split()[0],
        "python": sys.executable,
        "container": container_runtime(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
