"""The steps of a run: where it starts, when it checkpoints, when it stops, and how it ends.

    metrics = harness.start_metrics(...)
    run = harness.TrainingRun(RECIPE, args, rank, start_step, metrics, harness.average_across_ranks(world_size, device))
    batches = harness.step_batches(data, args, range(start_step + 1, args.max_steps + 1), ...)  # this rank's rows
    for step, (inputs, targets) in run.steps(batches):  # (the wait for each batch is timed apart)
        with harness.phase("forward"):         # named ranges: the --profile trace, NVTX on a GPU
            ...                                # the recipe's own training step
        metrics.log_step(step, loss, global_batch, lr)  # this rank's loss tensor: averaged at the next sync
        if run.eval_due(step):                 # --eval-every: the validation loss, averaged over the DP ranks
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):          # the sync when due; checkpoints when due; True: --stop-at-step or a
            break                              # stop signal
    run.save_last(save)
    ...                                        # the recipe's end-of-run proof (parameter spread)
    code = run.finish(metrics, spread)         # metrics.json (peak memory, data-wait share), the done line, the
                                               # stop marker, the --profile trace; the exit code

The ranks meet once per window of steps, not after every step: one all-reduce averages the window's losses
and agrees on a stop signal (on a GPU also the one host-device synchronisation), as torchtitan and Megatron
reduce their logs every N steps. A window ends at every --log-every-th step, at an evaluation, a checkpoint,
--stop-at-step and the last step, and after about SYNC_WITHIN_S seconds of steps (never less than one step),
so that SIGUSR1 is acted on well inside the sbatch files' 120-s warning even when --log-every is large. A
step's time is its whole period: from the end of the step before (or the first step's start) to its own end,
so its data wait, logging, evaluation and the checkpoint written before it are in it, and the step times
add up to the wall time of the steps (metrics.json's steps_wall_s).
"""

from __future__ import annotations

import argparse
import math
import signal
import statistics
import time
from typing import Callable, Iterable, Iterator

from . import faults, outcome, profiling
from .checkpoint import checkpoint_due
from .errors import stderr_line
from .profiling import StepProfiler, peak_memory, profile_steps
from .signals import STOP_MARKER, STOP_SIGNALS, StopRequest

SYNC_WITHIN_S = 10.0  # the longest window of steps between two syncs (a stop signal waits at most this)


class TrainingRun:
    """``metrics``: the run's MetricsLogger (its steps are recorded at each sync); ``average(values)``: the
    values' means over all ranks in one collective (harness.average_across_ranks; Horovod's own); the values
    themselves for one process."""

    def __init__(self, recipe: str, args: argparse.Namespace, rank: int, start_step: int, metrics,
                 average: Callable[[list], list[float]] | None = None, host_memory=None):
        self.recipe, self.args, self.rank, self.metrics = recipe, args, rank, metrics
        self.host_memory = host_memory  # (a HostMemory: the first step's peak, "step", recorded in it)
        self.start_step = self.last_step = start_step
        self.stopped_by = 0
        self._average = average or (lambda values: [float(value) for value in values])
        if rank == 0:
            (args.out_dir / STOP_MARKER).unlink(missing_ok=True)  # from an earlier, stopped run
        self.stop = StopRequest(recipe, rank)  # SIGUSR1 before the time limit, SIGTERM on preemption
        steps = profile_steps(args)
        self.profiler = StepProfiler(steps, rank, args.out_dir) if steps else None
        self.step_seconds = self.data_seconds = 0.0  # (summed over the steps: the share spent waiting for data)
        self.syncs = 0  # the collectives of the steps (metrics.json: fewer than the steps unless --log-every 1)
        self._window_steps = 1  # the steps of a window, agreed at each sync (the first: the first step alone)
        self._periods: list[float] = []  # the whole periods of the steps since the last sync
        self._last_window = (0.0, 0)  # (seconds, steps) of the window before, measured after its sync
        self._period_started = self._window_started = None  # (perf_counter) the end of the step before
        self._wall = [None, None]  # (time.time) the first step's start, the last step's end: steps_wall_s
        self.world_size = getattr(metrics, "world_size", 1) or 1
        self.stragglers = Stragglers(getattr(args, "straggler_factor", 0.0), self.world_size, rank,
                                     getattr(metrics, "run_info", {}).get("hostnames"), recipe,
                                     leave=getattr(args, "leave_stragglers", False))

    def steps(self, batches: Iterable | None = None) -> Iterator:
        """The steps still to run (after a resume: from the checkpoint's next step), each one timed; with
        ``batches``, (step, batch) pairs, and the wait for each batch timed on its own (the data loader's
        share of the step time, in metrics.json)."""
        batches = iter(batches) if batches is not None else None
        first_step = self.host_memory.phase("step") if self.host_memory else None  # (its peak host memory)
        if first_step:
            first_step.__enter__()
        try:
            for step in range(self.start_step + 1, self.args.max_steps + 1):
                if first_step and step == self.start_step + 2:
                    first_step, _ = None, first_step.__exit__(None, None, None)
                self._step_started = time.perf_counter()
                outcome.note_step(step)
                if self._period_started is None:  # the first step of this process
                    self._period_started = self._window_started = self._step_started
                    self._wall[0] = time.time()
                if self.profiler:
                    self.profiler.step_starts(step)
                if batches is None:
                    yield step
                    continue
                batch = next(batches, None)
                if batch is None:
                    return
                self.data_seconds += time.perf_counter() - self._step_started
                yield step, batch
        finally:
            if first_step:
                first_step.__exit__(None, None, None)

    def learning_rate(self, step: int) -> float:
        """The learning rate of ``step`` (--lr-schedule, --warmup-steps): a function of the step number, so a
        resumed run goes on with the rate the uninterrupted one had there."""
        counted = step - self.start_step if faults.active("schedule-restart") else step  # (a negative control)
        return learning_rate(self.args, counted)

    def eval_due(self, step: int) -> bool:
        """--eval-every N: after every N-th step and after the last one (the run's final eval loss)."""
        every = self.args.eval_every
        return every > 0 and (step % every == 0 or step == self.args.max_steps)

    def step_done(self, step: int, save: Callable[[int], None]) -> bool:
        """After ``step``: the sync if its window ends here; a checkpoint if --checkpoint-every says so;
        True if the run stops here (--stop-at-step, or a stop signal agreed at the sync)."""
        self.last_step = step
        # (a negative control: the same error on every rank, as a bug in the program would raise)
        if step == 5 and (faults.active("program-error") or faults.active("program-error-as-node")):
            raise ValueError(f"a deterministic error in the program after step 5 ({faults.FAULT_ENV}={faults.requested()})")
        if self.profiler:
            self.profiler.step_ends(step)
        if self._sync_due(step):
            self._sync()
        else:
            self._step_ended()
        if checkpoint_due(self.args, step):
            save(step)
        return step == self.args.stop_at_step or bool(self.stopped_by) or self.stragglers.leaving is not None

    def _sync_due(self, step: int) -> bool:
        args = self.args
        return (len(self._periods) + 1 >= self._window_steps or step % args.log_every == 0 or self.eval_due(step)
                or checkpoint_due(args, step) or step in (args.stop_at_step, args.max_steps))

    def _step_ended(self) -> float:
        """The end of a step's period (now): its time recorded; the time returned."""
        now = time.perf_counter()
        # (the fault: the step timed from its start only, as before: what a checkpoint costs goes unseen)
        began = self._step_started if faults.active("step-time-from-start") else self._period_started
        self._periods.append(now - began)
        self._period_started, self._wall[1] = now, time.time()
        return now

    def _sync(self) -> None:
        """The ranks meet: the window's losses averaged and the stop signal agreed, in one collective; the
        window's steps recorded; the next window's length agreed (from the window before's step time, the
        same number on every rank)."""
        losses = self.metrics.local_losses()
        window_s, window_steps = self._last_window
        received = [1.0 if self.stop.received == signum else 0.0 for signum in STOP_SIGNALS]
        own_times = self.stragglers.own_times(len(self._periods) + 1)  # (the window's steps: this one too)
        averaged = self._average([*losses, window_s / max(1, window_steps), *received, *own_times])
        self.stragglers.check(averaged[len(averaged) - len(own_times):], self.last_step)
        self.syncs += 1
        now = self._step_ended()  # (after the collective: on a GPU the window's kernels have finished)
        self.metrics.flush(averaged[:len(losses)], self._periods)
        self.step_seconds += sum(self._periods)
        self._last_window = (now - self._window_started, len(self._periods))
        self._periods, self._window_started = [], now
        step_s = averaged[len(losses)]
        self._window_steps = max(1, min(self.args.log_every, int(SYNC_WITHIN_S / step_s))) if step_s > 0 else 1
        agreed = averaged[len(losses) + 1:len(losses) + 1 + len(STOP_SIGNALS)]
        self.stopped_by = max((int(signum) for signum, share in zip(STOP_SIGNALS, agreed) if share > 0), default=0)

    def save_last(self, save: Callable[[int], None]) -> None:
        """The last step's checkpoint, unless it was just written (or no step ran)."""
        self._sync_pending()
        if self.last_step > self.start_step and not checkpoint_due(self.args, self.last_step):
            save(self.last_step)

    def _sync_pending(self) -> None:
        """The steps not synced yet (the data ran out before --max-steps): synced now, on every rank."""
        if self._periods:
            self._sync()

    def finish(self, metrics, spread: float | None, extra: dict | None = None,
               differ: str = "parameters differ across ranks") -> int:
        """Record the end of the run and return its exit code: 3 when the copies of the model that should be
        identical are not (``spread``, None where they are shards by design), otherwise 0, also after a stop
        signal (then with OUT_DIR/stopped_by_signal, so that the launcher requeues the job). ``differ`` names the copies in the
        error line."""
        self._sync_pending()
        signame = signal.Signals(self.stopped_by).name if self.stopped_by else None
        trace = self.profiler.close() if self.profiler else None
        first, last = self._wall
        metrics.write({"param_max_abs_diff_across_ranks": spread, "last_step": self.last_step,
                       "stopped_early": self.last_step < self.args.max_steps, "stopped_by_signal": signame,
                       "peak_memory": peak_memory(),  # (the logging rank's)
                       "data_wait_s": self.data_seconds, "step_time_s": self.step_seconds,
                       "steps_wall_s": last - first if first and last else None, "syncs": self.syncs,
                       "data_wait_share": self.data_seconds / self.step_seconds if self.step_seconds else None,
                       "profile_trace": str(trace) if trace else None, "stragglers": self.stragglers.found,
                       "straggler_worst_ratio": self.stragglers.worst_ratio if self.stragglers.on else None,
                       **(extra or {})})
        metrics.close()
        if metrics.is_logging_rank:
            s, peak = metrics.summary(), metrics.peak_flops_per_device
            evaluated = f", eval loss {s['final_eval_loss']:.4f}" if s["final_eval_loss"] is not None else ""
            print(f"[{self.recipe}] done: step {self.last_step}/{self.args.max_steps}, final loss {s['final_loss']:.4f}{evaluated}, "
                  f"{s['mean_samples_per_s']:.1f} samples/s, "
                  + (f"{s['mean_tokens_per_s']:.0f} tokens/s, " if s["mean_tokens_per_s"] is not None else "")
                  + (f"MFU {100 * s['mean_mfu']:.2f}% " if s["mean_mfu"] is not None else "MFU n/a ")
                  + f"(peak {peak / 1e12:.3f} TFLOP/s, {metrics.peak_source}); "
                  f"metrics in {metrics.path}", flush=True)
        if spread:
            stderr_line(f"[{self.recipe}] error: {differ} by up to {spread:.3g}: "
                        "gradients were not synchronised")
            return 3
        leaving = self.stragglers.leaving
        if leaving is not None:  # (--leave-stragglers: its rank ends as its node's failure; the launcher goes on)
            if self.rank == 0:
                print(f"[{self.recipe}] stopped after step {self.last_step}: rank {leaving['rank']} on {leaving['host']} "
                      "is a straggler (--leave-stragglers): checkpoint written", flush=True)
            if self.rank == leaving["rank"]:
                raise outcome.NodeFault(f"rank {self.rank} on {leaving['host']} is a straggler (--leave-stragglers): "
                                        f"its forward pass took {leaving['forward_s_per_step'] / leaving['median_s_per_step']:.1f} "
                                        "times the other ranks' median")
        if self.stopped_by and self.rank == 0:
            StopRequest.write_marker(self.args.out_dir, self.stopped_by, self.last_step)
            print(f"[{self.recipe}] stopped by {signame} after step {self.last_step}: checkpoint written; "
                  "run again with the same --out-dir to continue (slurm/ files requeue the job themselves)", flush=True)
        return 0


class Stragglers:
    """A rank persistently slower than the others, named with its node (--straggler-factor F).

    At each sync every rank adds its forward pass's time per step in the window (profiling.phase_seconds: its
    own work, no collective inside) to the one all-reduce the sync makes anyway: a vector of world-size numbers,
    each rank its own slot. A rank whose time is above F times the other ranks' median, and STRAGGLER_MIN_S more, in
    STRAGGLER_WINDOWS windows in a row is named once, in the log and in metrics.json's stragglers. Every rank
    sees the same numbers and decides the same; rank 0 says it. F <= 0 or one rank: nothing added."""

    def __init__(self, factor: float, world_size: int, rank: int, hostnames: list[str] | None, recipe: str,
                 leave: bool = False):
        self.factor, self.world_size, self.rank, self.recipe, self.leave = factor, world_size, rank, recipe, leave
        self.leaving: dict | None = None  # (--leave-stragglers: the first straggler named; the run stops there)
        self.hostnames = hostnames or []
        self.on = factor > 0 and world_size > 1
        self._slow_windows = [0] * world_size
        self._ratios: list[list[float]] = [[] for _ in range(world_size)]
        self.worst_ratio = 0.0  # the largest ratio to the others' median a rank kept STRAGGLER_WINDOWS syncs in a row
        self.found: list[dict] = []

    def own_times(self, steps: int) -> list[float]:
        """This rank's slot (its forward seconds per step, scaled so that the average is the value), zeros
        elsewhere; nothing when the check is off."""
        if not self.on:
            return []
        slots = [0.0] * self.world_size
        slots[self.rank] = profiling.phase_seconds("forward") / max(1, steps) * self.world_size
        return slots

    def check(self, times: list[float], step: int) -> None:
        if not self.on or not any(times):
            return
        named = {entry["rank"] for entry in self.found}
        for rank, seconds in enumerate(times):
            median = statistics.median(times[:rank] + times[rank + 1:])  # (the others': with 2 ranks, the other)
            ratio = seconds / median if median > 0 else 0.0
            recent = self._ratios[rank] = [*self._ratios[rank], ratio][-STRAGGLER_WINDOWS:]
            if len(recent) == STRAGGLER_WINDOWS:  # the closest any rank came to being named (metrics.json)
                self.worst_ratio = max(self.worst_ratio, min(recent))
            slow = ratio > self.factor and seconds - median > STRAGGLER_MIN_S
            self._slow_windows[rank] = self._slow_windows[rank] + 1 if slow else 0
            if self._slow_windows[rank] == STRAGGLER_WINDOWS and rank not in named:
                host = self.hostnames[rank] if rank < len(self.hostnames) else "?"
                self.found.append({"rank": rank, "host": host, "step": step, "forward_s_per_step": seconds,
                                   "median_s_per_step": median})
                if self.leave and self.leaving is None:
                    self.leaving = self.found[-1]
                if self.rank == 0:
                    stderr_line(f"[{self.recipe}] warning: rank {rank} on {host} is a straggler: its forward pass took "
                                f"{1000 * seconds:.1f} ms per step against the other ranks' median {1000 * median:.1f} ms "
                                f"in {STRAGGLER_WINDOWS} syncs in a row (up to step {step}; --straggler-factor "
                                f"{self.factor:g}); metrics.json: stragglers")


# A straggler is slow in this many syncs in a row, and by this much per step at least (a tiny model's steps
# differ by fractions of a millisecond from scheduling alone).
STRAGGLER_WINDOWS = 3
STRAGGLER_MIN_S = 0.002


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """--lr at step ``step`` (1, 2, ... --max-steps): linear warmup over --warmup-steps, then constant, or a
    cosine from --lr down to --lr/10 at --max-steps (as nanoGPT's)."""
    warmup = getattr(args, "warmup_steps", 0)
    if step <= warmup:
        return args.lr * step / warmup
    if getattr(args, "lr_schedule", "constant") == "constant":
        return args.lr
    progress = min(1.0, (step - warmup) / max(1, args.max_steps - warmup))
    floor = args.lr / 10
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - floor)


def set_learning_rate(optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` at ``lr`` (the schedule's rate of the step about to be taken)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(parameters, max_norm: float):
    """The global norm of the gradients of ``parameters`` (reduced, replicated ones: DDP's after backward), a tensor,
    and, with --clip-grad (``max_norm`` > 0), the gradients scaled down to ``max_norm`` when it is larger."""
    import torch

    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm  # (a tensor: read on the host at the run's next sync, not every step)


def torch_optimizer(parameters, name: str, lr: float):
    """The optimizer of --optimizer (cli.add_optimizer_option): AdamW without weight decay, or plain SGD."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
