"""Checkpoints that are never torn, and the check that a checkpoint belongs to this run before it is resumed.

Two layouts, both under OUT_DIR/checkpoints:
- one file per checkpoint, ``step_XXXXXXXX.pt`` (DDP, Horovod's PyTorch variant): written by rank 0 under a
  temporary name, fsynced, renamed (``save_checkpoint``; ``resume_file`` reads the newest back);
- one directory per checkpoint, ``step_XXXXXXXX/`` (accelerate, DeepSpeed, megatron-core, TensorFlow),
  where the framework's files go, one or more per rank, next to a small JSON state file (step, loss
  history and what must match to resume): written into ``.step_XXXXXXXX.partial`` and renamed by rank 0
  once every rank has finished (``save_sharded_checkpoint``, ``save_checkpoint_dir``; ``resume_dir``).
  ``ShardedCheckpoints`` does the same where the framework writes in the background (--async-checkpoint):
  the checkpoint is published, and only then counted as written, once the background write has finished.

A directory or file under the published name is therefore always complete when published; a crash leaves
the previous one as the one a rerun resumes. Only the newest ``keep`` (2) are kept. A directory also lists
its files and their sizes (``manifest.json``): a shard the file system lost or cut short later is refused
before any rank starts, with the checkpoint to move away, instead of failing deep in the framework's loader.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

from .errors import ConfigError

CHECKPOINT_PATTERN = re.compile(r"step_(\d{8})\.pt")
CHECKPOINT_DIR_PATTERN = re.compile(r"step_(\d{8})")
TRAINER_STATE = "trainer_state.json"  # in a checkpoint directory, next to the framework's own files

# Tests only: kill this process (SIGKILL) halfway through writing the checkpoint of this step, to show that
# a crash mid-write leaves the previous checkpoint as the one resume uses (tests/test_reliability.py).
CRASH_DURING_CHECKPOINT_ENV = "HPCML_TEST_CRASH_DURING_CHECKPOINT"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data))


def _fsync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


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
    _fsync_directory(path.parent)


def checkpoint_due(args, step: int) -> bool:
    """Whether --checkpoint-every asks for a checkpoint after ``step``."""
    return bool(args.checkpoint_every) and step % args.checkpoint_every == 0


# ---- one file per checkpoint

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


def _refuse_other_settings(path: Path, state: dict, must_match: dict) -> None:
    written = {key: state.get(key) for key in must_match}
    if written != must_match:
        raise ConfigError(f"{path} was written with {written}, this run has {must_match}: use the same settings, "
                          "a new --out-dir, or --no-resume")


def resume_file(args, must_match: dict) -> tuple[Path | None, dict | None]:
    """The newest ``step_*.pt`` in OUT_DIR/checkpoints and its contents, if the ``must_match`` entries it
    recorded (model, batch) are this run's; (None, None) when there is none or --no-resume."""
    latest = None if args.no_resume else latest_checkpoint(Path(args.out_dir) / "checkpoints")
    if latest is None:
        return None, None
    import torch

    try:
        state = torch.load(latest, map_location="cpu", weights_only=True)
    except Exception as error:  # a file we did not write (our own writes are atomic)
        raise ConfigError(f"cannot read the checkpoint {latest} ({type(error).__name__}): "
                          "move it away, or use --no-resume") from None
    _refuse_other_settings(latest, state, must_match)
    return latest, state


# ---- one directory per checkpoint

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
    _fsync_directory(directory)
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


MANIFEST = "manifest.json"


def write_manifest(checkpoint: Path) -> None:
    """Every file of a checkpoint directory and its size, as written (rank 0, after every rank finished)."""
    files = {p.relative_to(checkpoint).as_posix(): p.stat().st_size
             for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name != MANIFEST}
    atomic_write_bytes(checkpoint / MANIFEST, json.dumps(files, indent=0).encode())


def check_manifest(checkpoint: Path) -> None:
    """A published checkpoint is whole: every file its manifest lists is there, at the size written. A shard
    the file system lost or cut short (a full quota, a node lost mid-flush) is otherwise found deep inside the
    framework's loader, on every rank, as a stack trace. (Checkpoints from before manifests are not checked.)"""
    manifest = checkpoint / MANIFEST
    if not manifest.exists():
        return
    try:
        files = json.loads(manifest.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {manifest} ({type(error).__name__}): move {checkpoint} away to resume "
                          "from the checkpoint before it, or use --no-resume") from None
    for name, size in files.items():
        path = checkpoint / name
        found = path.stat().st_size if path.is_file() else None
        if found != size:
            what = "is missing" if found is None else f"has {found} bytes where {size} were written"
            raise ConfigError(f"the checkpoint {checkpoint} is damaged: {name} {what}; move {checkpoint} away to "
                              "resume from the checkpoint before it, or use --no-resume")


def save_sharded_checkpoint(directory: Path, step: int, write_shards: Callable[[Path], None], state: dict, *,
                            writes_state: bool, is_rank0: bool, barrier: Callable[[], None]) -> Path:
    """Every rank: ``write_shards(staging_dir)`` writes its part of the framework's checkpoint; the rank that
    ``writes_state`` adds TRAINER_STATE ({"step": step, **state}); after a barrier rank 0 publishes."""
    def written_now(staging: Path) -> None:  # (what the framework's save returns is not a pending write)
        write_shards(staging)

    ShardedCheckpoints(directory, writes_state=writes_state, is_rank0=is_rank0, barrier=barrier).save(
        step, written_now, state)
    return Path(directory) / f"step_{step:08d}"


class ShardedCheckpoints:
    """The checkpoints of a run, as save_sharded_checkpoint writes them, where ``write_shards`` may write in the
    background: it returns None when its files are written, or a future (DCP's async_save) that is done when
    they are. Training goes on meanwhile; the checkpoint is finished (TRAINER_STATE, a barrier, the manifest,
    rank 0's rename) when the next save starts or at ``wait()``, which a recipe calls before its run ends: a
    stop signal still ends with a published checkpoint. Then ``published(step)``: what may only count the
    checkpoint once it is there (metrics.json, the trackers). One save is pending at most (a second waits
    for the first). ``blocking_s``: the seconds each save held training up."""

    def __init__(self, directory: Path, *, writes_state: bool, is_rank0: bool, barrier: Callable[[], None],
                 published: Callable[[int], None] = lambda step: None):
        self.directory, self.writes_state, self.is_rank0 = Path(directory), writes_state, is_rank0
        self.barrier, self.published = barrier, published
        self.blocking_s: list[float] = []
        self._pending = None

    def save(self, step: int, write_shards: Callable[[Path], object], state: dict) -> None:
        started = time.perf_counter()
        self.wait()
        staging = staging_checkpoint_dir(self.directory, step)
        if self.is_rank0:  # an empty directory: a write that crashed at this step may have left one behind
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.barrier()
        written = write_shards(staging)
        # (the state as it is now: the history goes on growing while the shards are written)
        self._pending = (step, staging, written, json.dumps({"step": step, **state}).encode())
        if written is None:
            self.wait()
        self.blocking_s.append(time.perf_counter() - started)

    def wait(self) -> None:
        """Finish the pending checkpoint, if any: its background write, then publish it."""
        if self._pending is None:
            return
        step, staging, written, state = self._pending
        self._pending = None
        if written is not None:
            written.result()  # (raises what the background write raised)
        if self.writes_state:
            atomic_write_bytes(staging / TRAINER_STATE, state)
        self.barrier()
        if self.is_rank0:
            write_manifest(staging)
            publish_checkpoint_dir(self.directory, step)
        self.published(step)


def save_checkpoint_dir(directory: Path, step: int, write_files: Callable[[Path], None], meta: dict,
                        keep: int = 2, state_file: str = "meta.json") -> Path:
    """One process writes the whole checkpoint (the TensorFlow recipes): ``write_files(staging_dir)``, then
    ``state_file``, then the rename."""
    staging = staging_checkpoint_dir(directory, step)
    staging.mkdir(parents=True, exist_ok=True)
    write_files(staging)
    atomic_write_bytes(staging / state_file, json.dumps({"step": step, **meta}).encode())
    write_manifest(staging)
    return publish_checkpoint_dir(directory, step, keep)


def resume_dir(args, must_match: dict, state_file: str = TRAINER_STATE) -> tuple[Path | None, dict | None]:
    """The newest published checkpoint directory in OUT_DIR/checkpoints and its state file, if the
    ``must_match`` entries it recorded (model, batch) are this run's; otherwise a ConfigError that says
    what differs. (None, None) when there is none or --no-resume."""
    latest = None if args.no_resume else latest_checkpoint_dir(Path(args.out_dir) / "checkpoints")
    if latest is None:
        return None, None
    try:
        state = json.loads((latest / state_file).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {latest / state_file} ({type(error).__name__}): "
                          f"move {latest} away, or use --no-resume") from None
    _refuse_other_settings(latest, state, must_match)
    check_manifest(latest)
    return latest, state


# ---- random number generators (the PyTorch recipes' checkpoints carry them)

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
