"""The recipes' TensorBoard event files, read back with TensorBoard's own event reader.

A 2-rank run writes one event file (rank 0's) holding the loss of every step, the same values as
metrics.json (events store float32: equal within 1e-6 relative). A run stopped and resumed appends a second
file, and the two together hold every step exactly once. The PyTorch recipes write through torch's
SummaryWriter, the TensorFlow ones through tf.summary (a Horovod run of 2 ranks here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

from support.curves import eval_losses, losses, read_metrics
from support.runs import assert_ok, EVAL, free_port, recipe_env, REPO, run, run_torchrun

STEPS = ["--global-batch", "8", "--max-steps", "5", "--checkpoint-every", "0", "--no-resume"]
VENV_TF = REPO / ".venv-tf"


def event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


def scalar_steps(directory: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every ``tag`` event in ``directory``: SummaryWriter's scalars, or tf.summary's
    (written as tensors by TensorFlow 2)."""
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    if tag in tags["scalars"]:
        return [(event.step, event.value) for event in events.Scalars(tag)]
    assert tag in tags["tensors"], f"no '{tag}' in {directory}: {tags}"
    return [(event.step, float(make_ndarray(event.tensor_proto))) for event in events.Tensors(tag)]


def assert_matches_metrics(directory: Path, metrics: dict, steps: list[int]) -> None:
    logged = scalar_steps(directory, "train/loss")
    assert [step for step, _ in logged] == steps
    for (_, value), expected in zip(logged, losses(metrics)):
        assert value == pytest.approx(expected, rel=1e-6)
    assert [step for step, _ in scalar_steps(directory, "train/tokens_per_s")] == steps


def test_two_rank_run_writes_the_loss_of_every_step_from_rank_0_only(tmp_path):
    assert_ok(run_torchrun(tmp_path, 2, *STEPS, *EVAL))
    metrics = read_metrics(tmp_path)
    assert metrics["world_size"] == 2 and metrics["tensorboard_dir"] == str(tmp_path / "tensorboard")
    files = event_files(tmp_path / "tensorboard")
    assert len(files) == 1, f"one writer (rank 0) expected, found {files}"
    assert_matches_metrics(tmp_path / "tensorboard", metrics, [1, 2, 3, 4, 5])
    # --eval-every 2: after steps 2 and 4 and the last, as eval/loss (the values of metrics.json)
    evaluated = scalar_steps(tmp_path / "tensorboard", "eval/loss")
    assert [step for step, _ in evaluated] == [2, 4, 5]
    assert [value for _, value in evaluated] == pytest.approx(eval_losses(metrics), rel=1e-6)


def test_a_resumed_run_appends_and_keeps_every_step_once(tmp_path):
    base = ["--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "0"]
    assert_ok(run_torchrun(tmp_path, 2, *base, "--stop-at-step", "3"))
    assert_ok(run_torchrun(tmp_path, 2, *base))
    metrics = read_metrics(tmp_path)
    assert metrics["resumed_from_step"] == 3
    assert len(event_files(tmp_path / "tensorboard")) == 2
    assert_matches_metrics(tmp_path / "tensorboard", metrics, [1, 2, 3, 4, 5, 6])


def test_tensorboard_off_and_an_explicit_directory(tmp_path):
    assert_ok(run_torchrun(tmp_path / "off", 1, *STEPS, "--tensorboard", "off"))
    assert not (tmp_path / "off" / "tensorboard").exists()
    assert read_metrics(tmp_path / "off")["tensorboard_dir"] is None
    assert_ok(run_torchrun(tmp_path / "run", 1, *STEPS, "--tensorboard", str(tmp_path / "elsewhere")))
    assert len(event_files(tmp_path / "elsewhere")) == 1


@pytest.mark.tensorflow
def test_horovod_tensorflow_run_writes_events_through_tf_summary(tmp_path):
    assert (VENV_TF / ".installed").exists(), "no .venv-tf: run `make venv-tf` (make test does)"
    cmd = [str(VENV_TF / "bin" / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", "-p", str(free_port()),
           "python", str(REPO / "recipes" / "horovod" / "train.py"), "--out-dir", str(tmp_path),
           "--seq-len", "32", "--max-steps", "4", "--checkpoint-every", "0"]
    env = recipe_env(HPCML_EXPECTED_WORLD_SIZE="2")
    env["PATH"] = f"{VENV_TF / 'bin'}:{env['PATH']}"
    assert_ok(run(cmd, env=env, timeout=300))
    metrics = read_metrics(tmp_path)
    assert metrics["world_size"] == 2
    assert len(event_files(tmp_path / "tensorboard")) == 1
    assert_matches_metrics(tmp_path / "tensorboard", metrics, [1, 2, 3, 4])
