"""The DeepSpeed recipe beyond parity (ZeRO 1-3 against one process, and their controls: tests/parity.toml):
checkpoint-resume reproduces the later losses, a resume without the optimizer shards is caught, and bad
DeepSpeed settings and damaged shards are refused before any rank starts.

Resume: ZeRO-2 on 2 ranks with the config's AdamW, stopped after step 3 and rerun: the uninterrupted run's
losses, bit for bit; without the optimizer shards (resume-fresh-optimizer), the later losses miss by more
than 100x the parity tolerance.
"""

from __future__ import annotations

import json

import pytest

from support.curves import caught, losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import assert_ok, python, recipe_env, REPO, TINY, torchrun as launch_torchrun

RECIPE = REPO / "recipes" / "deepspeed" / "train.py"
STEPS = [*TINY, "--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "2"]
ADAMW = [*STEPS, "--lr", "0.01"]  # the resume tests: Adam's moments are what a resume must restore


def torchrun(out_dir, nproc: int, *args: str, **env):
    return launch_torchrun(RECIPE, nproc, "--out-dir", str(out_dir), *args, env=recipe_env(**env))


def assert_one_line_error(result, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("[deepspeed] error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def zero2_adamw(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero2-adamw")
    assert_ok(torchrun(out, 2, "--zero-stage", "2", *ADAMW))
    return read_metrics(out)


def test_checkpoint_resume_reproduces_later_losses(zero2_adamw, tmp_path):
    assert_ok(torchrun(tmp_path, 2, "--zero-stage", "2", *ADAMW, "--stop-at-step", "3"))
    assert read_metrics(tmp_path)["last_step"] == 3
    checkpoints = tmp_path / "checkpoints"
    # (DeepSpeed also puts its converters to a plain state dict there: zero_to_fp32.py and friends)
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step_00000002", "step_00000003"]
    # Each rank wrote its own ZeRO-2 optimizer shard.
    assert len(list((checkpoints / "step_00000003").glob("*optim_states.pt"))) == 2

    second = torchrun(tmp_path, 2, "--zero-stage", "2", *ADAMW)
    assert_ok(second)
    assert "resumed from" in second.stdout and "(step 3)" in second.stdout
    resumed = read_metrics(tmp_path)
    assert resumed["resumed_from_step"] == 3
    assert losses(resumed) == losses(zero2_adamw)

    # The shards fit ZeRO-2 on 2 ranks only: another stage is refused before any rank starts.
    refused = python(RECIPE, "--out-dir", str(tmp_path), "--zero-stage", "3", *ADAMW,
                     "--preflight", "2", env=recipe_env(), timeout=120)
    assert_one_line_error(refused, "holds ZeRO-2 shards of 2 ranks; this run is ZeRO-3 on 2")


def test_a_resume_without_the_optimizer_shards_is_caught(zero2_adamw, tmp_path):
    assert_ok(torchrun(tmp_path, 2, "--zero-stage", "2", *ADAMW, "--stop-at-step", "3"))
    assert_ok(torchrun(tmp_path, 2, "--zero-stage", "2", *ADAMW, HPCML_TEST_FAULT="resume-fresh-optimizer"))
    resumed, straight = losses(read_metrics(tmp_path)), losses(zero2_adamw)
    assert resumed[:3] == straight[:3] and caught(max_relative_difference(resumed[3:], straight[3:]), PARITY_RTOL)


def ds_config_file(tmp_path, **changes) -> str:
    config = json.loads((REPO / "recipes" / "deepspeed" / "ds_config.json").read_text())
    config.update(changes)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("world_size, make_args, fragments", [
    (2, lambda tmp: ["--zero-stage", "4"], ["--zero-stage is 4: ZeRO stages are 0"]),
    (2, lambda tmp: ["--ds-config", ds_config_file(tmp, zero_optimization={"stage": 5})],
     ["zero_optimization.stage in", "is 5"]),
    (4, lambda tmp: ["--ds-config", ds_config_file(tmp, train_batch_size=16, train_micro_batch_size_per_gpu=2)],
     ["train_micro_batch_size_per_gpu 2", "x 4 ranks = 8, not the train_batch_size 16"]),
    (3, lambda tmp: ["--global-batch", "16"], ["train_batch_size 16 is not divisible by", "--global-batch 18"]),
    (2, lambda tmp: ["--ds-config", str(tmp / "missing.json")], ["cannot read --ds-config"]),
])
def test_bad_deepspeed_settings_are_refused_before_any_rank_starts(tmp_path, world_size, make_args, fragments):
    result = python(RECIPE, *TINY, "--out-dir", str(tmp_path / "run"), *make_args(tmp_path),
                    "--preflight", str(world_size), env=recipe_env(), timeout=120)
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "run").exists()


def test_a_truncated_shard_is_refused_before_any_rank_starts(tmp_path):
    """The newest checkpoint with one rank's optimizer shard cut short (a full quota, a node lost mid-flush):
    refused by the check slurm/lib/launch.sh runs before any rank, one line naming the file; moved away, the
    run resumes from the checkpoint before it."""
    assert_ok(torchrun(tmp_path, 2, "--zero-stage", "2", *STEPS, "--stop-at-step", "3"))
    newest = tmp_path / "checkpoints" / "step_00000003"
    shard = max(newest.rglob("*optim_states.pt"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as file:
        file.truncate(size // 2)
    refused = python(RECIPE, "--out-dir", str(tmp_path), "--zero-stage", "2", *STEPS,
                     "--preflight", "2", env=recipe_env(), timeout=120)
    assert_one_line_error(refused, f"the checkpoint {newest} is damaged: {shard.relative_to(newest)} has {size // 2} "
                          f"bytes where {size} were written; move {newest} away")
    newest.rename(tmp_path / "damaged-step-3")
    resumed = torchrun(tmp_path, 2, "--zero-stage", "2", *STEPS)
    assert_ok(resumed)
    assert "(step 2)" in resumed.stdout and read_metrics(tmp_path)["resumed_from_step"] == 2
