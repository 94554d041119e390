"""--tracker wandb,mlflow on nodes without a network: W&B offline and MLflow's SQLite store under the run
directory, rank 0 only, read back through the libraries' own readers (support/trackers.py); a run that
crashes and resumes continues the same W&B and MLflow run and records every step exactly once."""

from __future__ import annotations

import signal
import sys

from support.curves import losses, read_metrics
from support.runs import DDP_RECIPE, TINY, assert_ok, recipe_env, run, run_torchrun
from support.trackers import mlflow_history, tracking_errors

sys.path.insert(0, str(DDP_RECIPE.parents[1]))
from harness.tracking import scalars  # noqa: E402

TRACKED = ["--tracker", "tensorboard,wandb,mlflow", "--global-batch", "8", "--max-steps", "6",
           "--checkpoint-every", "2", "--eval-every", "3", "--eval-batches", "1"]


def crash_and_resume(out, **env: str):
    """Two ranks; rank 0 killed while it writes step 4's checkpoint (steps 3 and 4 ran, no checkpoint holds
    them); then resumed from step 2 on two ranks to the end."""
    crashed = run_torchrun(out, 2, *TINY, *TRACKED, HPCML_TEST_CRASH_DURING_CHECKPOINT="4", **env)
    assert crashed.returncode != 0 and f"exitcode  : -{int(signal.SIGKILL)}" in crashed.stderr, crashed.stderr[-2000:]
    resumed = run_torchrun(out, 2, *TINY, *TRACKED, **env)
    assert_ok(resumed)
    assert "(step 2)" in resumed.stdout, resumed.stdout
    return read_metrics(out)


def test_a_crashed_and_resumed_run_is_one_tracked_run_with_every_step_once(tmp_path):
    out = tmp_path / "run"
    metrics = crash_and_resume(out)
    assert [record["step"] for record in metrics["history"]] == [1, 2, 3, 4, 5, 6]
    assert tracking_errors(out, metrics) == []
    runs, _ = mlflow_history(out, "train/loss")
    assert runs[0].data.params["max_steps"] == "6" and runs[0].info.run_name.startswith("ddp-")


def test_trackers_that_record_steps_no_checkpoint_holds_are_caught(tmp_path):
    """The negative control: the trackers fed at every step (HPCML_TEST_FAULT=track-every-step) record steps 3
    and 4 twice, once by the crashed attempt and once after the resume; the check above must say so."""
    out = tmp_path / "run"
    metrics = crash_and_resume(out, HPCML_TEST_FAULT="track-every-step")
    wrong = tracking_errors(out, metrics)
    assert any("W&B: steps [3, 4] recorded more than once" in line for line in wrong), wrong
    assert any("MLflow: steps [3, 4] recorded more than once" in line for line in wrong), wrong


def test_the_trackers_are_the_logging_ranks_alone_and_the_curve_is_the_runs(tmp_path):
    """One process tracking only MLflow: no W&B files, no TensorBoard events, the run's own curve."""
    out = tmp_path / "run"
    assert_ok(run([sys.executable, str(DDP_RECIPE), "--out-dir", str(out), *TINY, "--max-steps", "3",
                   "--tracker", "mlflow"], env=recipe_env()))
    assert not (out / "wandb").exists() and not (out / "tensorboard").exists()
    runs, entries = mlflow_history(out, "train/loss")
    assert len(runs) == 1 and [value for _, value in entries] == losses(read_metrics(out))


def test_a_step_record_becomes_the_tensorboard_names():
    record = {"step": 3, "loss": 2.5, "lr": 0.1, "tokens_per_s": None, "mfu": None, "grad_norm": 1, "eval_loss": 2.0}
    assert scalars(record) == {"train/loss": 2.5, "train/lr": 0.1, "train/grad_norm": 1.0, "eval/loss": 2.0}
