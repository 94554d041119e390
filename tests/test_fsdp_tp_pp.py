"""The PyTorch-native recipe (recipes/fsdp_tp_pp) beyond parity (FSDP2, HSDP, DTensor TP and pipelining against
one process, one control per kind of parallelism: tests/parity.toml): resume and bad layouts.

Resume: AdamW (it has state to lose), stopped after step 3 and resumed, in the same and in another layout
(FSDP 2 x TP 2 -> PP 2), matches the uninterrupted run within the parity tolerance; a resume that drops the
optimizer state (resume-fresh-optimizer) must be caught, by 100x. A layout that cannot be built, and a control
without the parallelism it breaks, are one line before any rank starts.
"""

from __future__ import annotations

import json

import pytest

from support.curves import caught, losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import assert_ok, assert_preflight_refuses, REPO, run_recipe

RECIPE = REPO / "recipes" / "fsdp_tp_pp" / "train.py"
MODEL = ["--seq-len", "32", "--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--global-batch", "8"]
ADAMW = [*MODEL, "--optimizer", "adamw", "--lr", "3e-3", "--max-steps", "6", "--checkpoint-every", "0"]

def train(out_dir, nproc: int, *args: str, **env: str):
    return run_recipe(RECIPE, out_dir, nproc, *args, **env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(train(out, 1, *ADAMW, "--tp", "1", "--no-resume"))
    return losses(read_metrics(out))


@pytest.mark.parametrize("first, then", [
    ((2, ["--tp", "1", "--dp-shard", "2"]), (2, ["--tp", "1", "--dp-shard", "2"])),
    ((4, ["--tp", "2", "--dp-shard", "2"]), (2, ["--tp", "1", "--pp", "2", "--micro-batches", "2"])),
], ids=["same-layout", "fsdp2xtp2-to-pp2"])
def test_resume_matches_the_uninterrupted_run(first, then, uninterrupted, tmp_path):
    assert_ok(train(tmp_path, first[0], *ADAMW, *first[1], "--stop-at-step", "3"))
    checkpoint = tmp_path / "checkpoints" / "step_00000003"
    assert (checkpoint / ".metadata").exists() and list(checkpoint.glob("*.distcp"))
    assert not list((tmp_path / "checkpoints").glob(".step_*.partial"))
    result = train(tmp_path, then[0], *ADAMW, *then[1])
    assert_ok(result)
    assert "resumed from" in result.stdout and "(step 3, written with" in result.stdout
    metrics = read_metrics(tmp_path)
    assert metrics["resumed_from_step"] == 3 and [r["step"] for r in metrics["history"]] == [1, 2, 3, 4, 5, 6]
    assert max_relative_difference(losses(metrics), uninterrupted) <= PARITY_RTOL


def test_async_checkpoints_are_the_state_of_their_step_and_resume_on_the_same_curve(uninterrupted, tmp_path):
    """--async-checkpoint: each checkpoint is written while the next steps train, published when written
    (at the next save or the run's end: the stop at step 5 ends with its checkpoint published), holds the state
    of its own step, and resumes on the uninterrupted run's curve."""
    fsdp = ["--tp", "1", "--dp-shard", "2", "--checkpoint-every", "2", "--async-checkpoint"]
    assert_ok(train(tmp_path, 2, *ADAMW, *fsdp, "--stop-at-step", "5"))
    metrics = read_metrics(tmp_path)
    assert metrics["async_checkpoint"] is True and len(metrics["checkpoint_blocking_s"]) == 3  # steps 2, 4, 5
    published = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert published == ["step_00000004", "step_00000005"], published
    for step in (4, 5):
        state = json.loads((tmp_path / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text())
        assert [r["step"] for r in state["history"]] == list(range(1, step + 1))
    result = train(tmp_path, 2, *ADAMW, *fsdp)
    assert_ok(result)
    assert "(step 5, written with" in result.stdout
    assert max_relative_difference(losses(read_metrics(tmp_path)), uninterrupted) <= PARITY_RTOL


def test_resume_without_the_optimizer_state_is_caught(uninterrupted, tmp_path):
    assert_ok(train(tmp_path, 2, *ADAMW, "--tp", "1", "--dp-shard", "2", "--stop-at-step", "3"))
    assert_ok(train(tmp_path, 2, *ADAMW, "--tp", "1", "--dp-shard", "2", HPCML_TEST_FAULT="resume-fresh-optimizer"))
    assert caught(max_relative_difference(losses(read_metrics(tmp_path)), uninterrupted), PARITY_RTOL)


@pytest.mark.parametrize("world, options, message", [
    (6, ["--tp", "2", "--pp", "2"], "world size 6 is not divisible by PP x DP_replicate x TP = 2 x 1 x 2 = 4"),
    (4, ["--tp", "2", "--dp-shard", "3"], "= 6, but the job has 4 ranks"),
    (2, ["--tp", "2", "--n-head", "3", "--n-embd", "33"], "--n-head 3 is not divisible by --tp 2"),
    (2, ["--tp", "1", "--pp", "2", "--n-layer", "3"], "--n-layer 3 is not divisible by --pp 2"),
    (2, ["--tp", "1", "--pp", "2", "--pp-schedule", "Interleaved1F1B"], "goes with --pp-virtual 2 or more"),
    (2, ["--tp", "1", "--dp-shard", "2", "--micro-batches", "4"], "micro-batches are the pipeline's"),
    (2, ["--tp", "1", "--dp-shard", "2", "--global-batch", "7"], "--global-batch 7 is not divisible by DP 2"),
])
def test_bad_layout_is_refused_before_any_rank_starts(world, options, message, tmp_path):
    assert_preflight_refuses(RECIPE, tmp_path, world, [*MODEL, *options], message)


def test_a_control_without_the_parallelism_it_breaks_is_refused(tmp_path):
    """tp-no-reduce with TP 1 would change nothing, and a control that changes nothing passes its test."""
    result = train(tmp_path, 1, *MODEL, "--tp", "1", "--max-steps", "1", HPCML_TEST_FAULT="tp-no-reduce")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "[fsdp_tp_pp] error: HPCML_TEST_FAULT=tp-no-reduce changes nothing in this layout: it needs the parallelism it breaks"]
