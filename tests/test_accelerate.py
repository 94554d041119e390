"""The accelerate recipe beyond parity (its layout and controls: tests/parity.toml): a resume continues the
same curve, and the checks catch a resume without the optimizer state, a launch that silently fell back to
one process, and a launcher config that contradicts the allocation.

Resume: AdamW (its moments are what a resume must restore) on 2 ranks x 2 micro-batches, stopped after step
3 and rerun, gives the uninterrupted run's losses bit for bit; without the optimizer state
(resume-fresh-optimizer), its later losses miss by more than 100x the parity tolerance.
"""

from __future__ import annotations


import pytest

from support.curves import caught, losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import accelerate_launch as launch, assert_ok, fault, python, recipe_env, REPO, TINY

RECIPE = REPO / "recipes" / "accelerate" / "train.py"
MULTI_GPU_CONFIG = REPO / "recipes" / "accelerate" / "multi_gpu.yaml"
STEPS = [*TINY, "--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "2"]
ADAMW = [*STEPS, "--lr", "0.01"]  # the resume tests: Adam's moments are what a resume must restore


def accelerate_launch(out_dir, nproc: int, *args: str, **options):
    return launch(RECIPE, out_dir, nproc, *args, **options)


@pytest.fixture(scope="module")
def straight_adamw(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight-adamw")
    assert_ok(accelerate_launch(out, 2, *ADAMW, "--grad-accum", "2"))
    return read_metrics(out)


@pytest.mark.parametrize("defect", [None, "resume-fresh-optimizer"])
def test_resume_from_saved_state_continues_the_same_curve(straight_adamw, tmp_path, defect):
    """AdamW, whose moments a resume must restore; the control resumes without them and must be caught."""
    first = accelerate_launch(tmp_path, 2, *ADAMW, "--grad-accum", "2", "--stop-at-step", "3")
    assert_ok(first)
    assert read_metrics(tmp_path)["last_step"] == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]

    second = accelerate_launch(tmp_path, 2, *ADAMW, "--grad-accum", "2", **fault(defect))
    assert_ok(second)
    assert "resumed from" in second.stdout and "(step 3)" in second.stdout
    resumed = read_metrics(tmp_path)
    assert resumed["resumed_from_step"] == 3
    assert [r["step"] for r in resumed["history"]] == [1, 2, 3, 4, 5, 6]
    if defect is None:  # same weights, optimizer state and data position: to the bit
        assert losses(resumed) == losses(straight_adamw)
    else:
        assert losses(resumed)[:3] == losses(straight_adamw)[:3]
        assert caught(max_relative_difference(losses(resumed)[3:], losses(straight_adamw)[3:]), PARITY_RTOL)


def test_a_launch_that_starts_one_process_instead_of_two_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts ONE process, which would train and exit 0."""
    result = accelerate_launch(tmp_path, 2, *STEPS, launcher_args=("--cpu",), HPCML_EXPECTED_WORLD_SIZE="2")
    assert result.returncode != 0
    assert "joined a world of 1 rank(s), but the job launched 2" in result.stderr
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("config, fragments", [
    ("num_processes: 8\nnum_machines: 2\n", ["num_processes: 8 but the job has 4 ranks", "delete num_processes"]),
    ("distributed_type: FSDP\n", ["asks for FSDP, which accelerate runs only on GPUs"]),
    ("num_processes: [", ["is not valid YAML"]),
])
def test_an_accelerate_config_that_contradicts_the_allocation_is_refused(tmp_path, config, fragments):
    path = tmp_path / "accelerate.yaml"
    path.write_text(config)
    result = python(RECIPE, *TINY, "--out-dir", str(tmp_path / "run"), "--launch-config", str(path),
                    "--preflight", "4", env=recipe_env(SLURM_JOB_NUM_NODES="2"), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("[accelerate] error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_shipped_configs_pass_the_check_for_any_layout():
    for world_size, nodes in ((1, 1), (4, 2), (8, 2)):
        result = python(RECIPE, *TINY, "--global-batch", "8", "--launch-config",
                        str(MULTI_GPU_CONFIG), "--preflight", str(world_size),
                        env=recipe_env(SLURM_JOB_NUM_NODES=str(nodes)), timeout=120)
        assert_ok(result)
        assert f"options fit world size {world_size}" in result.stdout
