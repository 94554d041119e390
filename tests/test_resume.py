"""A run stopped after step k and started again ends exactly where an uninterrupted run ends, and the
comparison that shows it can fail.

The runs are deterministic, so a resume that silently retrained from scratch, or lost part of its state,
could still end near the uninterrupted curve by luck of the task; what the check compares is every step's
loss after the resume, to the bit, and two resumes with a defect injected (HPCML_TEST_FAULT: the optimizer state
not restored; the data read from its first batch again) must fail that comparison by far. (The RNG state is
checkpointed and restored too, but these recipes draw no random numbers while training: data and weights
depend on the seed and the step only, so no control can show it.)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support.curves import caught, losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import assert_ok, DDP_RECIPE, fault, recipe_env, run, run_single, run_torchrun, TINY

# AdamW (its moments are state a resume must restore) at a learning rate where losing them shows by far.
ARGS = ["--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "2", "--lr", "0.01"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    assert_ok(run_torchrun(out, 2, *ARGS))
    return losses(read_metrics(out))


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory):
    """2 ranks stopped after step 3 (its checkpoint): run once, copied for each resume below."""
    out = tmp_path_factory.mktemp("stopped")
    assert_ok(run_torchrun(out, 2, *ARGS, "--stop-at-step", "3"))
    assert read_metrics(out)["stopped_early"] is True and read_metrics(out)["last_step"] == 3
    return out


def stop_and_resume(stopped, out, *resume_args: str, resume_ranks: int = 2, defect: str | None = None):
    shutil.copytree(stopped, out, dirs_exist_ok=True)
    second = run_torchrun(out, resume_ranks, *ARGS, *resume_args, **fault(defect)) if resume_ranks > 1 else \
        run_single(out, *ARGS, *resume_args, **fault(defect))
    assert_ok(second)
    assert "resumed from" in second.stdout and "(step 3)" in second.stdout
    resumed = read_metrics(out)
    assert resumed["resumed_from_step"] == 3 and [r["step"] for r in resumed["history"]] == [1, 2, 3, 4, 5, 6]
    return losses(resumed)


def test_stop_and_resume_gives_the_same_curve(straight, stopped_at_3, tmp_path):
    # Same data position, optimizer state and weights: the curves agree step for step, to the bit.
    assert stop_and_resume(stopped_at_3, tmp_path) == straight


@pytest.mark.parametrize("defect", ["resume-fresh-optimizer", "resume-data-from-start"])
def test_a_resume_that_loses_state_is_caught(straight, stopped_at_3, tmp_path, defect):
    resumed = stop_and_resume(stopped_at_3, tmp_path, defect=defect)
    assert resumed[:3] == straight[:3]  # the steps before the stop are the first run's
    assert resumed != straight
    assert caught(max_relative_difference(resumed[3:], straight[3:]), PARITY_RTOL)


def test_a_checkpoint_resumes_at_another_world_size(straight, stopped_at_3, tmp_path):
    """DDP's checkpoint holds the whole model and optimizer and the data position is the step, so 2 ranks'
    checkpoint continues on 1 process (or more ranks) on the same curve, within float reduction order."""
    resumed = stop_and_resume(stopped_at_3, tmp_path, resume_ranks=1)
    assert max_relative_difference(resumed, straight) <= PARITY_RTOL


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    assert_ok(run_single(tmp_path, *ARGS, "--stop-at-step", "2"))
    result = run_single(tmp_path, *ARGS, "--n-embd", "64")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("[ddp] error:") and len(result.stderr.strip().splitlines()) == 1
    assert "use the same settings, a new --out-dir, or --no-resume" in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_signal_to_every_process_with_read_ahead_workers_still_checkpoints(tmp_path, signum):
    """Slurm signals every process of a job step (the time-limit warning, scancel, preemption), the
    DataLoader's read-ahead workers too (--data-workers 2, the default on a GPU). The rank must still
    checkpoint after its step, write the stop marker and exit 0, and the rerun must end on the uninterrupted
    curve. (Before the workers ignored the signal, they died of it and the rank failed with "DataLoader
    worker ... killed by signal", exit 1, no checkpoint.)"""
    args = ["--global-batch", "8", "--max-steps", "300", "--checkpoint-every", "0", "--data-workers", "2",
            "--tensorboard", "off"]
    reference = tmp_path / "reference"
    assert_ok(run_single(reference, *args))
    out, log = tmp_path / "signalled", tmp_path / "signalled.log"
    with open(log, "w") as output:
        rank = subprocess.Popen([sys.executable, str(DDP_RECIPE), "--out-dir", str(out), *TINY, *args], env=recipe_env(),
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not re.search(r"^\[ddp\] step +10 ", log.read_text(), re.M):
            assert rank.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        workers = run(["pgrep", "-P", str(rank.pid)]).stdout.split()
        assert len(workers) >= 2, f"the read-ahead workers are not running: {workers}"
        os.killpg(rank.pid, signum)  # every process of the rank, as slurmstepd signals a step
        assert rank.wait(timeout=120) == 0, log.read_text()
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
    text = log.read_text()
    name = signal.Signals(signum).name
    stopped = re.search(rf"\[ddp\] stopped by {name} after step (\d+): checkpoint written", text)
    assert stopped and "killed by signal" not in text and "Traceback" not in text, text
    step = int(stopped.group(1))
    assert 10 <= step < 300 and (out / "stopped_by_signal").read_text() == f"{name} after step {step}\n"
    assert read_metrics(out)["last_step"] == step

    resumed = run_single(out, *args)
    assert_ok(resumed)
    assert f"(step {step})" in resumed.stdout
    metrics = read_metrics(out)
    assert [r["step"] for r in metrics["history"]] == list(range(1, 301))
    assert losses(metrics) == losses(read_metrics(reference))  # the same batches, workers or not, to the bit
