"""recipes/harness/run.py: the ranks meet once per window of steps (the losses averaged and a stop signal agreed
in one collective), not after every step; a window ends at --log-every and within SYNC_WITHIN_S seconds; every
step is recorded with its whole period. One process, the real TrainingRun and MetricsLogger; the collective is
counted (at 2 ranks it is harness.average_across_ranks: tests/test_profiling.py runs that)."""

from __future__ import annotations

import argparse
import signal
import sys
import time

import pytest
import torch

from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402
from harness import run as run_module  # noqa: E402


def short_run(tmp_path, *, log_every: int, max_steps: int = 12, checkpoint_every: int = 0, eval_every: int = 0):
    args = argparse.Namespace(out_dir=tmp_path, max_steps=max_steps, log_every=log_every, stop_at_step=None,
                              checkpoint_every=checkpoint_every, eval_every=eval_every, profile=None)
    metrics = harness.MetricsLogger(recipe="test", path=tmp_path / "metrics.json", is_logging_rank=True,
                                    tokens_per_sample=32, flops_per_token=None, peak_flops_per_device=1.0,
                                    peak_source="test", world_size=1, log_every=log_every)
    syncs = []  # the values each sync averaged (the collective, counted)

    def average(values):
        syncs.append(list(values))
        return [float(value) for value in values]

    return harness.TrainingRun("test", args, 0, 0, metrics, average), metrics, syncs


def train(run, metrics, step_s: float = 0.0, signal_at: int | None = None) -> int:
    last = 0
    for step in run.steps():
        time.sleep(step_s)
        if step == signal_at:  # (what the handler does when SIGUSR1 arrives; the OS signal itself is the
            run.stop._handle(signal.SIGUSR1, None)  # integration tests', never sent to this test worker)
        metrics.log_step(step, torch.tensor(float(step)), 4, 0.1, grad_norm=torch.tensor(2.0))
        last = step
        if run.step_done(step, lambda step: None):
            break
    run.save_last(lambda step: None)
    return last


@pytest.fixture
def restore_signals():
    saved = {signum: signal.getsignal(signum) for signum in harness.STOP_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_the_ranks_meet_every_log_every_steps_not_every_step(tmp_path, restore_signals):
    run, metrics, syncs = short_run(tmp_path, log_every=4)
    train(run, metrics)
    # the first window is the first step (no step time measured yet), the second too (its length is agreed
    # from the first's); then every --log-every steps
    assert [len(values) - 3 for values in syncs] == [1, 1, 2, 4, 4], syncs  # (losses; + step time + 2 signals)
    assert [record["step"] for record in metrics.history] == list(range(1, 13))
    assert [record["loss"] for record in metrics.history] == [float(step) for step in range(1, 13)]
    assert all(record["grad_norm"] == 2.0 and isinstance(record["grad_norm"], float) for record in metrics.history)


def test_a_window_ends_within_sync_within_s_even_with_a_large_log_every(tmp_path, restore_signals, monkeypatch):
    """A stop signal is acted on at the next sync: with --log-every 1000, 50-ms steps and SYNC_WITHIN_S 0.2,
    the windows are 3-4 steps, and SIGUSR1 in step 5 stops the run at the end of that window, every rank
    at the same step (the flag is part of the sync's collective)."""
    monkeypatch.setattr(run_module, "SYNC_WITHIN_S", 0.2)
    run, metrics, syncs = short_run(tmp_path, log_every=1000, max_steps=40)
    last = train(run, metrics, step_s=0.05, signal_at=5)
    windows = [len(values) - 3 for values in syncs]
    assert max(windows) <= 4 and sum(windows) == last, windows
    assert 5 <= last <= 5 + 3 and run.stopped_by == signal.SIGUSR1, (last, windows)
    assert syncs[-1][-2:] == [1.0, 0.0], syncs[-1]  # (this rank's SIGUSR1, no SIGTERM)


def test_the_step_times_add_up_to_the_wall_time_of_the_steps(tmp_path, restore_signals):
    """A step's time is its whole period: what runs between two steps (here a 50-ms checkpoint) is in the
    next step's time, so the step times add up to the wall time from the first step's start to the last's end."""
    run, metrics, _ = short_run(tmp_path, log_every=2, max_steps=6, checkpoint_every=2)
    for step in run.steps():
        time.sleep(0.01)
        metrics.log_step(step, torch.tensor(1.0), 4, 0.1)
        run.step_done(step, lambda step: time.sleep(0.05))
    first, last = run._wall
    total = sum(record["step_time_s"] for record in metrics.history)
    assert total == pytest.approx(last - first, rel=0.01) and total > 6 * 0.01 + 2 * 0.05, (total, last - first)
    assert [record["step"] for record in metrics.history] == list(range(1, 7))


def test_a_rank_slower_than_the_others_in_three_syncs_in_a_row_is_named_once(capsys):
    """Stragglers.check on the numbers every rank sees after the sync's all-reduce: a rank whose forward time is
    above the factor times the others' median (and STRAGGLER_MIN_S more) in 3 syncs in a row is named, once, with
    its host; one slow sync, or a ratio under the factor, names no one."""
    check = run_module.Stragglers(1.5, 4, 0, ["n1", "n2", "n3", "n4"], "test")
    normal, slow = [0.010, 0.011, 0.010, 0.012], [0.010, 0.040, 0.011, 0.010]
    for step, times in enumerate([slow, normal, slow, slow, [0.010, 0.014, 0.010, 0.010]], start=1):
        check.check(times, step)
    assert check.found == []  # (interrupted at step 2, 1.4x at step 5)
    for step in (6, 7, 8, 9):
        check.check(slow, step)
    assert [(f["rank"], f["host"], f["step"]) for f in check.found] == [(1, "n2", 8)]
    assert "[test] warning: rank 1 on n2 is a straggler: its forward pass took 40.0 ms per step against the other " \
           "ranks' median 10.0 ms in 3 syncs in a row (up to step 8" in capsys.readouterr().err
    assert check.worst_ratio == pytest.approx(4.0)


def test_two_ranks_compare_each_with_the_other_and_tiny_differences_are_not_stragglers():
    check = run_module.Stragglers(1.5, 2, 1, None, "test")
    for step in range(1, 5):
        check.check([0.0001, 0.0009], step)  # 9x, but 0.8 ms: scheduling noise on a tiny model
    assert check.found == []
    for step in range(5, 8):
        check.check([0.010, 0.030], step)
    assert [(f["rank"], f["host"]) for f in check.found] == [(1, "?")]


def test_off_with_one_rank_or_a_factor_of_zero():
    assert run_module.Stragglers(0, 4, 0, None, "test").own_times(5) == []
    assert run_module.Stragglers(1.5, 1, 0, None, "test").own_times(5) == []
    slots = run_module.Stragglers(1.5, 4, 2, None, "test").own_times(5)
    assert len(slots) == 4 and slots[0] == slots[1] == slots[3] == 0.0
