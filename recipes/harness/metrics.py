"""What a run reports: rank 0's step lines, OUT_DIR/metrics.json, TensorBoard event files, the W&B and MLflow
runs of --tracker (tracking.py), and MFU.

- ``start_metrics``: the MetricsLogger of a run (its JSON path, TensorBoard directory and the record of
  what ran, from ``describe_run``), and the log line with the model's size and the peak MFU divides by.
- ``transformer_flops_per_token``, ``peak_flops``, ``gpu_peak_flops``: MFU's numerator and denominator.

TensorBoard: PyTorch's SummaryWriter (the ``tensorboard`` package) for the PyTorch recipes, ``tf.summary``
for the TensorFlow ones; only the logging rank writes. Evaluations (--eval-every) go into the record of
the step they follow (``eval_loss``) and into TensorBoard as eval/loss. The events are flushed at every
checkpoint and at the end, so a run that dies loses at most the steps since its last checkpoint, as its
weights do.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import faults, outcome
from .checkpoint import atomic_write_bytes
from .errors import ConfigError
from .launch import startup_times
from .tracking import open_trackers, parse_trackers, run_name

if TYPE_CHECKING:
    import torch

# Dense peak FLOP/s per GPU from NVIDIA's data sheets (bf16 tensor cores; fp32 without TF32).
# Keyed by dtype name, the same in PyTorch and TensorFlow.
GPU_PEAK_FLOPS = {
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
}



def tensorboard_dir(args: argparse.Namespace) -> Path | None:
    """Where the event files go: --tensorboard DIR, OUT_DIR/tensorboard by default, None for 'off' (or a
    --tracker without tensorboard)."""
    if args.tensorboard == "off" or "tensorboard" not in parse_trackers(getattr(args, "tracker", "tensorboard")):
        return None
    return Path(args.tensorboard) if args.tensorboard else Path(args.out_dir) / "tensorboard"


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


def check_tensorboard_writer() -> None:
    """Refuse --tensorboard before any rank starts when the package behind the writers is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("TensorBoard logging needs the tensorboard package (pip install tensorboard; every image "
                          "has it): install it, or pass --tensorboard off")


class _TensorFlowSummaryWriter:
    """tf.summary behind SummaryWriter's three calls (add_scalar, flush, close)."""

    def __init__(self, directory: Path):
        import tensorflow as tf

        self._tf, self._writer = tf, tf.summary.create_file_writer(str(directory))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        with self._writer.as_default():
            self._tf.summary.scalar(tag, value, step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_tensorboard_writer(directory: Path, framework: str):
    """A writer of event files in ``directory``: tf.summary for ``framework`` "tensorflow", else PyTorch's."""
    directory.mkdir(parents=True, exist_ok=True)
    if framework == "tensorflow":
        return _TensorFlowSummaryWriter(directory)
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(directory), flush_secs=30)


@dataclass
class MetricsLogger:
    """Rank 0 prints one line per logged step, writes everything to ``path`` as JSON and the step scalars
    to TensorBoard (``tensorboard_dir``; None: no event files) and to ``trackers`` (W&B, MLflow: the steps
    since the last checkpoint, at each checkpoint and at the end; tracking.py says why)."""

    recipe: str
    path: Path
    is_logging_rank: bool
    tokens_per_sample: int | None  # None: samples are not token sequences (--dataset): no tokens/s, no MFU
    flops_per_token: float | None  # None: unknown (a user's model that says nothing): no MFU
    peak_flops_per_device: float
    peak_source: str
    world_size: int
    log_every: int = 1
    run_info: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    tensorboard_dir: Path | None = None
    framework: str = "torch"  # whose TensorBoard writer: "torch" or "tensorflow"
    trackers: list = field(default_factory=list)
    _writer: object = field(default=None, repr=False)
    _stepped: bool = field(default=False, repr=False)  # this process has logged a step (a resume too)
    pending: list[dict] = field(default_factory=list, repr=False)  # the steps logged since the last sync

    def __post_init__(self):
        # The steps of a resumed checkpoint's history reached the trackers before it was published.
        self._tracked_step = self.history[-1]["step"] if self.history else 0

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps of the metrics: the step history and the trackers' run ids (a resume
        continues both)."""
        return {"history": self.history, "tracked_runs": {tracker.name: tracker.run_id for tracker in self.trackers}}

    def log_step(self, step: int, loss, samples: int, lr: float, **extra) -> None:
        """One step's numbers, recorded at the next sync (TrainingRun.step_done: every --log-every steps, or
        sooner): ``loss`` as a tensor is this rank's (its mean over the ranks is taken then, in one all-reduce
        with the other steps' and the stop agreement: no host-device synchronisation per step); as a number it
        is already the global loss (Megatron's schedule, Horovod's, one process). ``extra``: more numbers of the
        step (e.g. grad_norm; tensors read at the sync), in JSON and TensorBoard."""
        self.pending.append({"step": step, "loss": loss, "samples": samples, "lr": lr, "extra": extra})
        if not self._stepped:
            self._stepped = True
            self._first_step_done()

    def local_losses(self) -> list:
        """The pending steps' losses that are still this rank's own (tensors), for the sync to average."""
        return [entry["loss"] for entry in self.pending if not isinstance(entry["loss"], (int, float))]

    def flush(self, averaged_losses: list[float], step_times: list[float]) -> None:
        """The pending steps' records, now that the sync has their losses (``averaged_losses``: those of
        ``local_losses``, averaged over the ranks) and their times (``step_times``: each step's whole period)."""
        averaged = iter(averaged_losses)
        for entry, step_time_s in zip(self.pending, step_times, strict=True):
            loss = entry["loss"] if isinstance(entry["loss"], (int, float)) else next(averaged)
            extra = {key: None if value is None else float(value) for key, value in entry["extra"].items()}
            self._record(entry["step"], float(loss), entry["samples"], step_time_s, entry["lr"], entry.get("eval"), extra)
        self.pending = []

    def _record(self, step: int, loss: float, samples: int, step_time_s: float, lr: float, evaluated: tuple | None,
                extra: dict) -> None:
        tokens_per_s = samples * self.tokens_per_sample / step_time_s if self.tokens_per_sample else None
        mfu = (tokens_per_s * self.flops_per_token / (self.world_size * self.peak_flops_per_device)
               if self.flops_per_token and tokens_per_s else None)
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "step_time_s": step_time_s,
            "samples_per_s": samples / step_time_s,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            **extra,
        }
        if evaluated is not None:
            record["eval_loss"] = evaluated[0]
        self.history.append(record)
        if not self.is_logging_rank:
            return
        if faults.active("track-every-step"):  # (a negative control: the trackers get steps no checkpoint holds)
            self._track()
        if self.tensorboard_dir is not None:
            if self._writer is None:
                self._writer = open_tensorboard_writer(self.tensorboard_dir, self.framework)
            for key in ("loss", "lr", "tokens_per_s", "mfu", "step_time_s", *extra):
                if record[key] is not None:
                    self._writer.add_scalar(f"train/{key}", record[key], step)
            if evaluated is not None:
                self._writer.add_scalar("eval/loss", evaluated[0], step)
        if step % self.log_every == 0:
            print(
                f"[{self.recipe}] step {step:5d} | loss {loss:.4f} | {record['samples_per_s']:8.1f} samples/s"
                + (f" | {tokens_per_s:10.0f} tokens/s" if tokens_per_s is not None else "")
                + (f" | MFU {100 * mfu:5.2f}%" if mfu is not None else " | MFU n/a"),
                flush=True,
            )
        if evaluated is not None:
            print(f"[{self.recipe}] eval {step:5d} | eval loss {evaluated[0]:.4f} | {evaluated[1]} batches of "
                  "validation data", flush=True)

    def _first_step_done(self) -> None:
        """Completes run_info's "startup" (harness.launch.startup_times) with this process's first step, and
        says on the logging rank where the time before it went."""
        startup = self.run_info.get("startup")
        if startup is None:
            return
        startup["first_step_at"] = time.time()
        parts = [f"{label} {startup[key]:.1f} s" for key, label in
                 (("preflight_s", "preflight"), ("srun_to_process_s", "srun and runtime"), ("imports_s", "imports"),
                  ("rendezvous_s", "rendezvous")) if startup.get(key) is not None]
        begun = startup.get("batch_started_at") or startup.get("process_started_at")
        if self.is_logging_rank and begun is not None:
            print(f"[{self.recipe}] first step done {startup['first_step_at'] - begun:.1f} s after the "
                  f"{'job' if startup.get('batch_started_at') else 'process'} started"
                  + (f" ({', '.join(parts)})" if parts else ""),
                  flush=True)

    def log_eval(self, step: int, loss: float, batches: int) -> None:
        """The validation loss after ``step`` (averaged over ``batches`` global batches and the data-parallel
        ranks), kept in that step's record (written at the sync that follows: an evaluated step is one):
        a checkpoint's history holds it, a resume continues it."""
        entry = self.pending[-1] if self.pending else None
        assert entry is not None and entry["step"] == step, f"log_eval({step}) without a pending step {step}"
        entry["eval"] = (loss, batches)

    def summary(self) -> dict:
        # The first step of a process includes warm-up (allocator, NCCL/gloo connections): leave it out.
        timed = self.history[1:] or self.history
        mean = lambda key: sum(r[key] for r in timed) / len(timed) if timed else float("nan")  # noqa: E731
        evaluated = [r["eval_loss"] for r in self.history if "eval_loss" in r]
        return {
            "steps": len(self.history),
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "final_eval_loss": evaluated[-1] if evaluated else None,
            "mean_samples_per_s": mean("samples_per_s"),
            "mean_tokens_per_s": mean("tokens_per_s") if self.tokens_per_sample else None,
            "mean_mfu": mean("mfu") if self.flops_per_token and self.tokens_per_sample else None,
            "flops_per_token": self.flops_per_token,
            "mfu_formula": "tokens/s * (6N + 12*L*d*T) / (world_size * peak)",
            "peak_flops_per_device": self.peak_flops_per_device,
            "peak_source": self.peak_source,
        }

    def write(self, extra: dict | None = None, checkpointed: int | None = None) -> None:
        """metrics.json now (atomically), the TensorBoard events so far, and to the trackers the steps up to
        ``checkpointed`` (the checkpoint just published; None: every step). Called at every checkpoint."""
        if not self.is_logging_rank:
            return
        incidents = outcome.incidents_summary(self.path.parent)  # (failed steps before this run: the launcher's)
        document = {"recipe": self.recipe, **self.run_info, **(extra or {}), "summary": self.summary(),
                    **({"incidents": incidents} if incidents else {}), "history": self.history}
        atomic_write_bytes(self.path, (json.dumps(document, indent=2, default=str) + "\n").encode())
        if self._writer is not None:
            self._writer.flush()
        self._track(checkpointed)

    def _track(self, through: int | None = None) -> None:
        """The steps the trackers have not seen yet (up to step ``through``), to every tracker."""
        untracked = [record for record in self.history
                     if record["step"] > self._tracked_step and (through is None or record["step"] <= through)]
        if untracked:
            for tracker in self.trackers:
                tracker.log(untracked)
            self._tracked_step = untracked[-1]["step"]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def start_metrics(recipe: str, args: argparse.Namespace, run_info: dict, resumed: dict | None, *, logging_rank: bool,
                  devices: int, size: tuple[int, float], peak: tuple[float, str], framework: str = "torch") -> MetricsLogger:
    """The run's MetricsLogger: OUT_DIR/metrics.json with ``run_info`` and the options, --tensorboard,
    --tracker, --log-every; ``resumed``: the checkpoint state a resume starts from (its ``checkpoint_state``
    keys: the step history, the trackers' run ids), None for a new run. ``devices``: what MFU divides the peak over (the
    world size, or MirroredStrategy's replicas); ``size``: the model's (parameters, training FLOPs per
    token); ``peak``: (FLOP/s per device, where it came from). The logging rank prints size and peak.
    ``framework``: "tensorflow" for the TensorFlow recipes (their TensorBoard writer is tf.summary)."""
    (n_params, flops_per_token), (peak_flops_per_device, peak_source) = size, peak
    settings = network_settings()
    if logging_rank:
        flops = f"{flops_per_token / 1e6:.2f} MFLOP/token" if flops_per_token else "FLOPs per token unknown (no MFU)"
        print(f"[{recipe}] {n_params / 1e6:.2f}M parameters, {flops}, "
              f"peak {peak_flops_per_device / 1e12:.3f} TFLOP/s per device ({peak_source})", flush=True)
        if os.environ.get("SLURM_JOB_ID"):  # in a job's log: what NCCL and libfabric really got, in the container
            words = " ".join(f"{name}={value}" for name, value in settings.items())
            print(f"[launch] rank 0 sees {words or 'no NCCL_*/FI_* settings'}", flush=True)
    events = tensorboard_dir(args)
    history = list(resumed["history"]) if resumed else []
    config = {key: value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
              for key, value in vars(args).items()}
    trackers = open_trackers(parse_trackers(getattr(args, "tracker", "tensorboard")), Path(args.out_dir),
                             (resumed or {}).get("tracked_runs", {}), run_name(recipe, args.out_dir),
                             config) if logging_rank else []
    return MetricsLogger(
        recipe=recipe, path=Path(args.out_dir) / "metrics.json", is_logging_rank=logging_rank,
        tokens_per_sample=None if getattr(args, "dataset", None) else args.seq_len, flops_per_token=flops_per_token,
        peak_flops_per_device=peak_flops_per_device,
        peak_source=peak_source, world_size=devices, log_every=args.log_every, history=history,
        run_info={**run_info, "n_params": n_params, "config": vars(args),
                  "resumed_from_step": history[-1]["step"] if history else None,
                  "tensorboard_dir": str(events) if events else None, "network_settings": settings},
        tensorboard_dir=events, framework=framework, trackers=trackers,
    )


NETWORK_SETTING_PREFIXES = ("NCCL_", "FI_", "TORCH_NCCL_", "TORCH_FR_")


def network_settings() -> dict[str, str]:
    """The NCCL, libfabric and Flight Recorder settings this process really has: inside a container, an
    image's own environment may have won over what the launcher set (slurm/lib/launch.sh passes them)."""
    return {name: value for name, value in sorted(os.environ.items()) if name.startswith(NETWORK_SETTING_PREFIXES)}


def container_runtime() -> str:
    """The container this process runs in, as far as the runtime says so ("none" on the bare host). podman's
    marker first: podman-hpc's modules mount their libraries under /opt/udiImage too, as Shifter's do."""
    if os.environ.get("SHIFTER_RUNTIME"):
        return "shifter"
    if os.path.exists("/run/.containerenv"):
        return "podman"
    if os.path.isdir("/opt/udiImage"):
        return "shifter"
    if os.path.exists("/.dockerenv"):
        return "docker"
    return "none"


def describe_run(env, backend: str, device, wrapper: str, versions: dict | None = None, **layout) -> dict:
    """What ran: recorded in every metrics file so a result can be traced back to its layout and versions.

    ``env``: the DistEnv; ``versions``: the framework versions to record (default: PyTorch's); ``layout``:
    the parallel layout, e.g. ``dp=4`` or ``tp=2, pp=2, dp=1`` (recorded as "layout").
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
        "layout": layout,
        **versions,
        "python_version": sys.version.split()[0],
        "python": sys.executable,
        "container": container_runtime(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "startup": startup_times(),
    }
