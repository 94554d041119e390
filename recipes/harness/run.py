"""The steps of a run: where it starts, when it checkpoints, when it stops, and how it ends.

    run = harness.TrainingRun(RECIPE, args, rank, start_step, agree=harness.max_across_ranks(world_size, device))
    batches = harness.step_batches(data, args, range(start_step + 1, args.max_steps + 1), ...)  # this rank's rows
    for step, (inputs, targets) in run.steps(batches):  # (the wait for each batch is timed apart)
        with harness.phase("forward"):         # named ranges: the --profile trace, NVTX on a GPU
            ...                                # the recipe's own training step
        metrics.log_step(step, loss, global_batch, run.step_time(), lr)
        if run.eval_due(step):                 # --eval-every: the validation loss, averaged over the DP ranks
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):          # checkpoints when due; True: --stop-at-step or a stop signal
            break
    run.save_last(save)
    ...                                        # the recipe's end-of-run proof (parameter spread)
    code = run.finish(metrics, spread)         # metrics.json (peak memory, data-wait share), the done line, the
                                               # stop marker, the --profile trace; the exit code
"""

from __future__ import annotations

import argparse
import math
import signal
import time
from typing import Callable, Iterable, Iterator

from . import faults
from .checkpoint import checkpoint_due
from .errors import stderr_line
from .profiling import StepProfiler, peak_memory, profile_steps
from .signals import STOP_MARKER, StopRequest


class TrainingRun:
    """``agree(value)``: the largest ``value`` over all ranks (the stop signal every rank acts on); the
    identity for one process."""

    def __init__(self, recipe: str, args: argparse.Namespace, rank: int, start_step: int,
                 agree: Callable[[int], int] | None = None, host_memory=None):
        self.recipe, self.args, self.rank = recipe, args, rank
        self.host_memory = host_memory  # (a HostMemory: the first step's peak, "step", recorded in it)
        self.start_step = self.last_step = start_step
        self.stopped_by = 0
        self._agree = agree or (lambda value: value)
        if rank == 0:
            (args.out_dir / STOP_MARKER).unlink(missing_ok=True)  # from an earlier, stopped run
        self.stop = StopRequest(recipe, rank)  # SIGUSR1 before the time limit, SIGTERM on preemption
        steps = profile_steps(args)
        self.profiler = StepProfiler(steps, rank, args.out_dir) if steps else None
        self.step_seconds = self.data_seconds = 0.0  # (summed over the steps: the share spent waiting for data)

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

    def step_time(self) -> float:
        """Seconds since the current step began (call it once the step's loss is known on every rank)."""
        return time.perf_counter() - self._step_started

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
        """After ``step``: checkpoint if --checkpoint-every says so; True if the run stops here."""
        self.last_step = step
        self.step_seconds += time.perf_counter() - self._step_started
        if self.profiler:
            self.profiler.step_ends(step)
        if checkpoint_due(self.args, step):
            save(step)
        self.stopped_by = self._agree(self.stop.received)
        return step == self.args.stop_at_step or bool(self.stopped_by)

    def save_last(self, save: Callable[[int], None]) -> None:
        """The last step's checkpoint, unless it was just written (or no step ran)."""
        if self.last_step > self.start_step and not checkpoint_due(self.args, self.last_step):
            save(self.last_step)

    def finish(self, metrics, spread: float | None, extra: dict | None = None,
               differ: str = "parameters differ across ranks") -> int:
        """Record the end of the run and return its exit code: 3 when the copies of the model that should be
        identical are not (``spread``, None where they are shards by design), otherwise 0, also after a stop
        signal (then with OUT_DIR/stopped_by_signal, so that the launcher requeues the job). ``differ`` names the copies in the
        error line."""
        signame = signal.Signals(self.stopped_by).name if self.stopped_by else None
        trace = self.profiler.close() if self.profiler else None
        metrics.write({"param_max_abs_diff_across_ranks": spread, "last_step": self.last_step,
                       "stopped_early": self.last_step < self.args.max_steps, "stopped_by_signal": signame,
                       "peak_memory": peak_memory(),  # (the logging rank's)
                       "data_wait_s": self.data_seconds, "step_time_s": self.step_seconds,
                       "data_wait_share": self.data_seconds / self.step_seconds if self.step_seconds else None,
                       "profile_trace": str(trace) if trace else None, **(extra or {})})
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
        if self.stopped_by and self.rank == 0:
            StopRequest.write_marker(self.args.out_dir, self.stopped_by, self.last_step)
            print(f"[{self.recipe}] stopped by {signame} after step {self.last_step}: checkpoint written; "
                  "run again with the same --out-dir to continue (slurm/ files requeue the job themselves)", flush=True)
        return 0


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


def clip_gradients(parameters, max_norm: float) -> float:
    """The global norm of the gradients of ``parameters`` (reduced, replicated ones: DDP's after backward),
    and, with --clip-grad (``max_norm`` > 0), the gradients scaled down to ``max_norm`` when it is larger."""
    import torch

    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return float(norm)


def torch_optimizer(parameters, name: str, lr: float):
    """The optimizer of --optimizer (cli.add_optimizer_option): AdamW without weight decay, or plain SGD."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
