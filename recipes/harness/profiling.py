"""Where the time and the memory go: --profile START:END, the phases of a step, and the run's peak memory.

- ``--profile START:END`` (PyTorch recipes): torch.profiler records steps START to END (inclusive) on every
  rank and writes OUT_DIR/profile/rank<R>.pt.trace.json, a Chrome trace that Perfetto (ui.perfetto.dev)
  and TensorBoard's PyTorch profiler plugin read. On a GPU, the same steps are the capture range of Nsight
  Systems (cudaProfilerStart/Stop: slurm/lib/runtime.sh's HPCML_NSYS=1 wraps each rank in `nsys profile`).
- ``phase(name)``: a named range around part of a step ("forward", "backward", "optimizer"), seen in the
  trace and, on a GPU, as an NVTX range in Nsight Systems. Costs nothing measurable when nothing records.
  The forward pass is also timed (``phase_seconds``): the straggler check compares the ranks' times.
- ``peak_memory()``: this process's peak resident memory (CPU) and, on a GPU, PyTorch's peak allocated and
  reserved memory, for metrics.json.
- ``HostMemory``: a rank's host memory by phase of the run (loading the model, its first step, the export), as
  the peak above what the rank held before it built the model: metrics.json's host_memory, one entry per rank.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path

from . import faults
from .errors import ConfigError
from .launch import expand_hostlist


def profile_steps(args) -> tuple[int, int] | None:
    """--profile START:END as (START, END), checked against --max-steps; None without --profile."""
    text = getattr(args, "profile", None)
    if not text:
        return None
    start, _, end = str(text).partition(":")
    if not (start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
        raise ConfigError(f"--profile {text}: give the first and last step to record, START:END with "
                          f"1 <= START <= END (e.g. --profile 3:5; the first steps include warm-up)")
    if int(start) > args.max_steps:
        raise ConfigError(f"--profile {text} starts after the last step (--max-steps {args.max_steps})")
    return int(start), int(end)


def _cuda():
    """torch.cuda, where this process uses it (nothing is imported or initialised here for a CPU run)."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized() else None


# The phases whose time each rank keeps for the straggler check (harness/run.py): in the data-parallel recipes
# (DDP, DeepSpeed ZeRO-1/2, accelerate's DDP) the forward pass is the rank's own work, no collective inside, so a
# rank slower than the others there is slow itself, not waiting for them (with FSDP, TP or PP the forward pass
# waits for the others' collectives too: a straggler stands out less).
TIMED_PHASES = ("forward",)
_timed: dict[str, list] = {name: [] for name in TIMED_PHASES}  # seconds, or (start, end) CUDA events on a GPU


@contextlib.contextmanager
def phase(name: str):
    """A named range of the step: a record_function for torch.profiler, and an NVTX range on a GPU; the
    TIMED_PHASES also timed (CUDA events on a GPU: no synchronisation here), read by ``phase_seconds``."""
    import torch

    cuda = _cuda()
    timed = _timed.get(name)
    if cuda is not None:
        cuda.nvtx.range_push(name)
    if timed is not None:
        started = cuda.Event(enable_timing=True) if cuda is not None else time.perf_counter()
        if cuda is not None:
            started.record()
    try:
        with torch.profiler.record_function(name):
            if timed is not None and _slowed_by_a_fault():
                time.sleep(SLOW_RANK_S)
            yield
    finally:
        if cuda is not None:
            cuda.nvtx.range_pop()
        if timed is not None:
            if cuda is not None:
                ended = cuda.Event(enable_timing=True)
                ended.record()
                timed.append((started, ended))
            else:
                timed.append(time.perf_counter() - started)


SLOW_RANK_S = 0.03  # the slow-rank fault's delay in each forward pass (rank 1): a few times a tiny model's forward


def _slowed_by_a_fault() -> bool:
    """slow-rank: rank 1 is slow; slow-node: the rank on the job's node HPCML_TEST_SLOW_NODE=@I is (whichever rank
    runs there: a slow machine, not a slow rank)."""
    if faults.active("slow-rank"):
        return os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == "1"
    if faults.active("slow-node"):
        index = int(os.environ.get("HPCML_TEST_SLOW_NODE", "@-1").lstrip("@"))
        nodes = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", ""))
        return 0 <= index < len(nodes) and nodes[index] == socket.gethostname()
    return False


def phase_seconds(name: str) -> float:
    """The time spent in the phase ``name`` since the last call (on a GPU: waits for its last range to end)."""
    timed = _timed[name]
    if timed and isinstance(timed[-1], tuple):
        timed[-1][1].synchronize()
        total = sum(start.elapsed_time(end) for start, end in timed) / 1000
    else:
        total = sum(timed)
    timed.clear()
    return total


class StepProfiler:
    """Records steps START..END of this rank (--profile) and writes its trace when they are done, or when the
    run ends first (a stop signal, --stop-at-step)."""

    def __init__(self, steps: tuple[int, int], rank: int, out_dir: Path):
        self.start, self.end = steps
        self.path = Path(out_dir) / "profile" / f"rank{rank}.pt.trace.json"
        self._profiler = None
        self.written = False  # (by this run: a resumed run past START writes none, and names none)

    def step_starts(self, step: int) -> None:
        if step == self.start:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if _cuda() is not None:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.profiler.start()  # Nsight Systems' capture range (HPCML_NSYS=1)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()

    def step_ends(self, step: int) -> None:
        if step == self.end:
            self.close()

    def close(self) -> Path | None:
        """Stop and write the trace (if recording); its path, once this run wrote it."""
        if self._profiler is not None:
            self._profiler.stop()
            if _cuda() is not None:
                _cuda().profiler.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(self.path))
            self._profiler, self.written = None, True
        return self.path if self.written else None


def peak_memory() -> dict:
    """This process's peak memory in bytes: resident (CPU, getrusage) and, on a GPU, PyTorch's allocator."""
    peak = {"cpu_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # (Linux: KiB)
    cuda = _cuda()
    if cuda is not None:
        peak.update(gpu_allocated_bytes=cuda.max_memory_allocated(), gpu_reserved_bytes=cuda.max_memory_reserved())
    return peak


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (RssAnon: what its tensors and allocators hold), not the file
    pages it maps (safetensors files read by mmap: the page cache, which the kernel drops under pressure)."""
    with open("/proc/self/statm") as statm:
        _, resident, shared = statm.read().split()[:3]
    return (int(resident) - int(shared)) * os.sysconf("SC_PAGE_SIZE")


class HostMemory:
    """A rank's host memory by phase: the peak of its anonymous resident memory while the phase ran, above
    the baseline taken when this object is made (after the imports and the process group, before the model).
    A thread samples /proc/self/statm every ``INTERVAL_S`` while a phase runs, and only then (a spike shorter
    than that can be missed; a model held whole, as the sharded load exists to avoid, lasts far longer).
    Linux only; elsewhere it records nothing."""

    INTERVAL_S = 0.002

    def __init__(self):
        self.available = os.path.exists("/proc/self/statm")
        self.baseline = anonymous_bytes() if self.available else 0
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}  # what the rank held when the phase began, above the baseline

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.available:
            yield
            return
        peak, stop = [anonymous_bytes()], threading.Event()
        self.starts.setdefault(name, peak[0] - self.baseline)

        def sample() -> None:
            while not stop.wait(self.INTERVAL_S):
                peak[0] = max(peak[0], anonymous_bytes())

        sampler = threading.Thread(target=sample, name=f"host-memory-{name}", daemon=True)
        sampler.start()
        try:
            yield
        finally:
            stop.set()
            sampler.join()
            peak[0] = max(peak[0], anonymous_bytes())
            self.peaks[name] = max(self.peaks.get(name, 0), peak[0] - self.baseline)

    def record(self) -> dict:
        """What metrics.json keeps for this rank, in bytes: the baseline, and for each phase what the rank held
        when it began and its peak, both above the baseline."""
        return {"baseline_bytes": self.baseline, **{f"{name}_start_bytes": start for name, start in self.starts.items()},
                **{f"{name}_peak_bytes": peak for name, peak in self.peaks.items()}}
