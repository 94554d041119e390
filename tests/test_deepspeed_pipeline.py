"""The DeepSpeed recipe's pipeline (--pp): a PipelineModule of the stack's GPT under DeepSpeed's pipeline
engine, alone and with data parallelism and ZeRO-1, for real (DeepSpeed 0.19 on gloo, CPU accelerator).

Reference: 1 process, no pipeline, ZeRO-0, plain SGD at lr 1.0 (a gradient off by a factor changes SGD's
curve; Adam's hardly), global batch 8. Every layout must give its loss over 4 steps within 1e-5 relative
(measured: <= 3e-7), report its PP x DP layout and the pipeline engine from inside, and hold identical
parameters on the DP replicas of each stage.

Negative controls: the replicas of a stage that never average their gradients (PP 2 x DP 2), and a
pipeline that takes its gradient from the last micro-batch only (4 micro-batches): each must leave the
tolerance by more than 100x. Resume: stopped after step 3 and rerun in the same layout, the run ends on
the uninterrupted curve (config AdamW); another --pp is refused, as ZeRO-2/3 with a pipeline is.
"""

from __future__ import annotations

import sys

import pytest

from conftest import (PARITY_RTOL, caught, EVAL, REPO, assert_ok, assert_preflight_refuses, eval_losses, losses,
                      max_relative_difference, read_metrics, recipe_env, run, run_recipe)

RECIPE = REPO / "recipes" / "deepspeed" / "train.py"
MODEL = ["--seq-len", "32", "--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--global-batch", "8"]
SGD = [*MODEL, "--optimizer", "sgd", "--lr", "1.0", "--max-steps", "4", "--checkpoint-every", "0", "--no-resume", *EVAL]


def train(out_dir, nproc: int, *args: str, **env: str):
    return run_recipe(RECIPE, out_dir, nproc, *args, HPCML_EXPECTED_WORLD_SIZE=str(nproc), **env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert_ok(train(out, 1, *SGD, "--zero-stage", "0"))
    metrics = read_metrics(out)
    assert metrics["layout"] == {"pp": 1, "dp": 1} and metrics["model_wrapper"] == "DeepSpeedEngine"
    assert len(eval_losses(metrics)) == 2
    return losses(metrics), eval_losses(metrics)


@pytest.mark.parametrize("ranks, options, stage", [
    (2, ["--pp", "2", "--grad-accum", "2"], 1),
    (4, ["--pp", "2", "--grad-accum", "2", "--zero-stage", "0"], 0),
    (4, ["--pp", "2", "--grad-accum", "2"], 1),
    (2, ["--pp", "2", "--grad-accum", "2", "--partition-method", "parameters", "--activation-checkpointing"], 1),
], ids=["pp2", "pp2xdp2", "pp2xzero1xdp2", "pp2-by-parameters-recomputed"])
def test_pipeline_layout_matches_one_process(ranks, options, stage, reference, tmp_path):
    result = train(tmp_path, ranks, *SGD, *options)
    assert_ok(result)
    metrics = read_metrics(tmp_path)
    assert metrics["model_wrapper"] == "PipelineEngine" and metrics["world_size"] == ranks
    assert metrics["layout"] == {"pp": 2, "dp": ranks // 2} and metrics["zero_stage"] == stage
    assert metrics["ds_config"]["gradient_accumulation_steps"] == 2  # the micro-batches of each step
    assert f"PP=2 DP={ranks // 2}" in result.stdout
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    assert max_relative_difference(losses(metrics), reference[0]) <= PARITY_RTOL
    # the validation loss: the engine's forward-only schedule (eval_batch), its mean over micro-batches and DP
    assert max_relative_difference(eval_losses(metrics), reference[1]) <= PARITY_RTOL


@pytest.mark.parametrize("ranks, options, control", [
    (4, ["--pp", "2", "--grad-accum", "2", "--zero-stage", "0"], "no-grad-allreduce"),
    (2, ["--pp", "2", "--grad-accum", "4"], "last-microbatch-loss"),
], ids=["dp-replicas-not-averaged", "last-micro-batch-only"])
def test_negative_control_is_caught(ranks, options, control, reference, tmp_path):
    result = train(tmp_path, ranks, *SGD, *options, HPCML_TEST_FAULT=control)
    metrics = read_metrics(tmp_path)
    assert caught(max_relative_difference(losses(metrics), reference[0]), PARITY_RTOL)
    if control == "no-grad-allreduce":  # the replicas of a stage drift apart: the run says so
        assert result.returncode != 0 and "parameters differ across ranks" in result.stderr


def test_resume_in_the_same_layout_matches_the_uninterrupted_run(tmp_path):
    adamw = [*MODEL, "--max-steps", "6", "--checkpoint-every", "0", "--pp", "2", "--grad-accum", "2"]
    assert_ok(train(tmp_path / "straight", 2, *adamw, "--no-resume"))
    assert_ok(train(tmp_path / "resumed", 2, *adamw, "--stop-at-step", "3"))
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step_00000003"
    assert list(checkpoint.glob("layer_*-model_states.pt"))  # DeepSpeed's pipeline checkpoint: a file per layer
    result = train(tmp_path / "resumed", 2, *adamw)
    assert_ok(result)
    assert "resumed from" in result.stdout and "(step 3)" in result.stdout
    assert losses(read_metrics(tmp_path / "resumed")) == losses(read_metrics(tmp_path / "straight"))
    other = run([sys.executable, str(RECIPE), "--out-dir", str(tmp_path / "resumed"), *adamw, "--max-steps", "8",
                 "--pp", "4", "--preflight", "4"], env=recipe_env(), timeout=120)  # what slurm/lib/launch.sh runs first
    assert other.returncode == 2 and "was written by 2 pipeline stage(s); this run has --pp 4" in other.stderr


@pytest.mark.parametrize("world, options, message", [
    (4, ["--pp", "2", "--zero-stage", "2"], "--zero-stage 2 with --pp 2: DeepSpeed's pipeline engine runs ZeRO stage 0 or 1"),
    (4, ["--pp", "3"], "world size 4 is not divisible by --pp 3"),
    (2, ["--pp", "2", "--n-layer", "3"], "--n-layer 3 is not divisible by --pp 2"),
    (4, ["--pp", "2", "--grad-accum", "3"], "gradient_accumulation_steps 3 x 2 DP ranks = 6"),
    (2, ["--pp", "two"], "--pp must be a number of stages or auto"),
])
def test_bad_pipeline_layout_is_refused_before_any_rank_starts(world, options, message, tmp_path):
    assert_preflight_refuses(RECIPE, tmp_path, world, [*MODEL, *options], message)
