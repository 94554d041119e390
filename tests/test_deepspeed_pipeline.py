"""The DeepSpeed recipe's pipeline (--pp) beyond parity (its layouts, alone, with DP and with ZeRO-1, and its
controls: tests/parity.toml): stopped after step 3 and rerun in the same layout, the run ends on the
uninterrupted curve (config AdamW); another --pp is refused, as ZeRO-2/3 with a pipeline is.
"""

from __future__ import annotations


import pytest

from support.curves import losses, read_metrics
from support.runs import assert_ok, assert_preflight_refuses, python, recipe_env, REPO, run_recipe

RECIPE = REPO / "recipes" / "deepspeed" / "train.py"
MODEL = ["--seq-len", "32", "--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--global-batch", "8"]


def train(out_dir, nproc: int, *args: str, **env: str):
    return run_recipe(RECIPE, out_dir, nproc, *args, HPCML_EXPECTED_WORLD_SIZE=str(nproc), **env)


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
    other = python(RECIPE, "--out-dir", str(tmp_path / "resumed"), *adamw, "--max-steps", "8",
                   "--pp", "4", "--preflight", "4", env=recipe_env(), timeout=120)  # what slurm/lib/launch.sh runs first
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
