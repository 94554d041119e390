"""The accelerate recipe: 2 processes train exactly what 1 process trains, resume continues the curve,
and the checks catch a wrong result (negative control) and a launch that silently fell back.

Reference: 1 plain process on the global batch of 8. Parallel: `accelerate launch --multi_gpu` (the
launcher slurm/accelerate.sh uses), 2 gloo ranks, 2 micro-batches of 2 rows per rank and step (gradient
accumulation). Tolerance: relative difference of the per-step loss <= 1e-5 over 6 steps (float32
reductions in another order); parameters bitwise identical across ranks (checked inside the run).
Optimizer: plain SGD (lr 1.0), which a gradient of the wrong scale cannot pass. Negative controls, each
caught by the same comparison with a margin of 100x the tolerance or more: the all-reduce skipped, the
ranks' gradients summed instead of averaged, the micro-batches' gradients summed instead of averaged; and a
resume that restores the weights but not the optimizer state (AdamW), caught by the resume comparison.
"""

from __future__ import annotations

import sys

import pytest

from conftest import (PARITY_RTOL, caught, EVAL, REPO, TINY, assert_ok, eval_losses, fault, free_port, losses,
                      max_relative_difference, read_metrics, recipe_env, run)

RECIPE = REPO / "recipes" / "accelerate" / "train.py"
MULTI_GPU_CONFIG = REPO / "recipes" / "accelerate" / "multi_gpu.yaml"
STEPS = [*TINY, "--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "2"]
SGD = [*STEPS, "--optimizer", "sgd", "--lr", "1.0", *EVAL]
ADAMW = [*STEPS, "--lr", "0.01"]  # the resume tests: Adam's moments are what a resume must restore


def accelerate_launch(out_dir, nproc: int, *args: str, launcher_args: tuple[str, ...] = ("--multi_gpu",), **env):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args, "--num_machines", "1",
           "--num_processes", str(nproc), "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           str(RECIPE), "--out-dir", str(out_dir), *args]
    return run(cmd, env=recipe_env(**env), timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run([sys.executable, str(RECIPE), "--out-dir", str(out), *SGD], env=recipe_env()))
    metrics = read_metrics(out)
    assert metrics["world_size"] == 1 and metrics["model_wrapper"] == "GPT" and metrics["distributed_type"] == "NO"
    return metrics


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    result = accelerate_launch(out, 2, *SGD, "--grad-accum", "2", "--launch-config", str(MULTI_GPU_CONFIG),
                               HPCML_EXPECTED_WORLD_SIZE="2")
    assert_ok(result)
    return result, read_metrics(out)


@pytest.fixture(scope="module")
def straight_adamw(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight-adamw")
    assert_ok(accelerate_launch(out, 2, *ADAMW, "--grad-accum", "2"))
    return read_metrics(out)


def test_two_processes_match_one(reference, two_processes):
    result, metrics = two_processes
    # It really was parallel: from inside the run, not from how it was launched.
    assert metrics["world_size"] == 2 and metrics["backend"] == "gloo"
    assert metrics["model_wrapper"] == "DistributedDataParallel" and metrics["distributed_type"] == "MULTI_CPU"
    assert metrics["grad_accum"] == 2 and len(metrics["hostnames"]) == 2
    assert "world_size=2 backend=gloo" in result.stdout
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    assert [r["step"] for r in metrics["history"]] == [1, 2, 3, 4, 5, 6]
    assert max_relative_difference(losses(metrics), losses(reference)) <= PARITY_RTOL
    # the validation loss after steps 2, 4 and 6, through the prepared model, averaged over the ranks
    assert len(eval_losses(metrics)) == 3 and max_relative_difference(eval_losses(metrics), eval_losses(reference)) <= PARITY_RTOL


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


@pytest.mark.parametrize("control, options", [("no-grad-allreduce", []), ("grad-sum", ["--grad-accum", "2"]),
                                              ("accum-sum", ["--grad-accum", "2"])])
def test_negative_controls_are_caught(reference, tmp_path, control, options):
    result = accelerate_launch(tmp_path, 2, *SGD, *options, **fault(control))
    metrics = read_metrics(tmp_path)
    assert caught(max_relative_difference(losses(metrics), losses(reference)), PARITY_RTOL)
    if control == "no-grad-allreduce":  # the ranks' models drift apart: the run itself fails
        assert result.returncode != 0 and "parameters differ across ranks" in result.stderr
        assert metrics["param_max_abs_diff_across_ranks"] > 0.0
    else:  # every rank applies the same wrong gradient: only the comparison with one process sees it
        assert_ok(result)


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
    result = run([sys.executable, str(RECIPE), *TINY, "--out-dir", str(tmp_path / "run"), "--launch-config", str(path),
                  "--preflight", "4"], env=recipe_env(SLURM_JOB_NUM_NODES="2"), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("[accelerate] error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_shipped_configs_pass_the_check_for_any_layout():
    for world_size, nodes in ((1, 1), (4, 2), (8, 2)):
        result = run([sys.executable, str(RECIPE), *TINY, "--global-batch", "8", "--launch-config",
                      str(MULTI_GPU_CONFIG), "--preflight", str(world_size)],
                     env=recipe_env(SLURM_JOB_NUM_NODES=str(nodes)), timeout=120)
        assert_ok(result)
        assert f"options fit world size {world_size}" in result.stdout
