"""The Megatron-core recipe beyond parity (its layouts and controls are rows of tests/parity.toml): the
distributed checkpoint resumes (in the same layout and in another one), bf16 trains and resumes, every bad
layout is refused with one line by the preflight and by every rank, and the CPU placement shim
(recipes/megatron_tp_pp/cpu_placement_shim.py) rewrites placements only, at sites on the checked-in
allow-list (tests/megatron_shim_sites.txt; support/megatron_shim.py).

Resume: stopped after step 3 and rerun, the same layout continues bit for bit, another layout (PP 2 -> TP 2,
resharded on load) within the parity tolerance; the control, a resume without the optimizer state, must miss
it by 100x.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from support import megatron_shim
from support.curves import caught, losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import assert_ok, EVAL, free_port, python, recipe_env, REPO, run, torchrun as launch_torchrun

RECIPE = REPO / "recipes" / "megatron_tp_pp" / "train.py"
STEPS = ["--seq-len", "32", "--max-steps", "4", "--checkpoint-every", "0", "--log-every", "1",
         "--optimizer", "sgd", "--lr", "1.0", "--clip-grad", "0", *EVAL]


def torchrun(out_dir, nproc: int, *args: str, real: bool = False, **env):
    return launch_torchrun(RECIPE, nproc, "--out-dir", str(out_dir), *args, real=real,
                           env=recipe_env(HPCML_EXPECTED_WORLD_SIZE=str(nproc), **env))


def single(out_dir, *args: str):
    return python(RECIPE, "--out-dir", str(out_dir), *args, env=recipe_env(), timeout=300)


def assert_refused_by_every_rank(out_dir, nproc: int, *args: str, fragment: str) -> None:
    """Every rank refuses on its own, with the one line and exit code 2, before any process group exists.

    Each rank is started alone with torchrun's variables (no other rank, no rendezvous): under torchrun the
    first refusal makes the agent stop the others, so whether they print their line is a race. A rank that
    did not refuse would wait for the others at the rendezvous, and fail by the timeout instead."""
    for rank in range(nproc):
        result = python(RECIPE, "--out-dir", str(out_dir), *args, timeout=120,
                        env=recipe_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(free_port()), HPCML_EXPECTED_WORLD_SIZE=str(nproc)))
        errors = [line for line in result.stderr.splitlines() if line.startswith("[megatron_tp_pp] error: ")]
        assert result.returncode == 2 and len(errors) == 1 and fragment in errors[0], (rank, result.stderr)
        assert "Traceback" not in result.stderr, (rank, result.stderr)
    # And through torchrun itself: the job fails with the rank's exit code 2, not with a traceback of the recipe.
    result = torchrun(out_dir, nproc, *args, real=True)
    errors = [line for line in result.stderr.splitlines() if line.startswith("[megatron_tp_pp] error: ")]
    assert result.returncode != 0 and errors and all(fragment in line for line in errors), result.stderr
    assert "exitcode  : 2" in result.stderr and "train.py\", line" not in result.stderr, result.stderr
    assert not (Path(out_dir) / "metrics.json").exists()


def checked_metrics(out_dir) -> dict:
    """The run's metrics, after the checks every run must pass: shim on, its sites allowed, replicas equal."""
    metrics = read_metrics(out_dir)
    assert metrics["backend"] == "gloo"
    megatron_shim.check_sites(metrics)
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    return metrics


def test_batched_p2p_with_virtual_stages_is_refused(tmp_path):
    """PP 2 + virtual stages + batched p2p swaps activations silently (exit 0, wrong losses): the recipe refuses
    it, on every rank. (Forced through, the parity check sees the loss go wrong: tests/parity.toml's control
    megatron-pp2-vp2-batch-p2p.)"""
    assert_refused_by_every_rank(tmp_path / "refused", 2, *STEPS, "--pp", "2", "--vp", "2", "--batch-p2p-comm",
                                 fragment="drop --batch-p2p-comm")


def test_checkpoint_resume_same_and_other_layout(tmp_path):
    """Stop at step 3, resume to 6: the later losses are those of the uninterrupted run; megatron's
    distributed checkpoint of a PP 2 run also resumes as TP 2 (resharded on load)."""
    steps = ["--seq-len", "32", "--max-steps", "6", "--checkpoint-every", "2"]
    uninterrupted = tmp_path / "uninterrupted"
    assert_ok(torchrun(uninterrupted, 2, *steps, "--pp", "2"))
    expected = losses(checked_metrics(uninterrupted))

    interrupted = tmp_path / "interrupted"
    assert_ok(torchrun(interrupted, 2, *steps, "--pp", "2", "--stop-at-step", "3"))
    assert checked_metrics(interrupted)["last_step"] == 3
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    other_layout, control = tmp_path / "other-layout", tmp_path / "resume-without-optimizer"
    shutil.copytree(interrupted, other_layout)
    shutil.copytree(interrupted, control)

    resumed = torchrun(interrupted, 2, *steps, "--pp", "2")
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and "step_00000003" in resumed.stdout
    metrics = checked_metrics(interrupted)
    assert metrics["resumed_from_step"] == 3 and [r["step"] for r in metrics["history"]] == [1, 2, 3, 4, 5, 6]
    assert losses(metrics) == expected  # same layout: bit for bit

    resharded = torchrun(other_layout, 2, *steps, "--tp", "2")
    assert_ok(resharded)
    metrics = checked_metrics(other_layout)
    assert metrics["layout"]["tp"] == 2 and metrics["layout"]["pp"] == 1 and metrics["resumed_from_step"] == 3
    assert max_relative_difference(losses(metrics)[3:], expected[3:]) <= PARITY_RTOL

    # The control: the same resume without the optimizer state (Adam's moments) must fail the comparison.
    assert_ok(torchrun(control, 2, *steps, "--pp", "2", HPCML_TEST_FAULT="resume-fresh-optimizer"))
    defective = losses(checked_metrics(control))
    assert defective[:3] == expected[:3] and caught(max_relative_difference(defective[3:], expected[3:]), PARITY_RTOL)
    megatron_shim.covered("resume")


def test_async_checkpoints_are_the_state_of_their_step_and_resume_on_the_same_curve(tmp_path):
    """--async-checkpoint (megatron's async save, a forked writer): training goes on while a checkpoint is
    written; it is published when written (the stop at step 5 ends with its checkpoint published), holds its
    own step's state (the writer forked with it), and the resume continues the sync run's curve bit for bit."""
    steps = ["--seq-len", "32", "--max-steps", "6", "--checkpoint-every", "2", "--pp", "2"]
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    assert_ok(torchrun(uninterrupted, 2, *steps))
    expected = losses(checked_metrics(uninterrupted))
    assert_ok(torchrun(interrupted, 2, *steps, "--async-checkpoint", "--stop-at-step", "5"))
    assert len(checked_metrics(interrupted)["checkpoint_blocking_s"]) == 3  # steps 2, 4, 5
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]
    for step in (4, 5):
        checkpoint = interrupted / "checkpoints" / f"step_{step:08d}"
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert [r["step"] for r in state["history"]] == list(range(1, step + 1)) and (checkpoint / "metadata.json").exists()
    resumed = torchrun(interrupted, 2, *steps, "--async-checkpoint")
    assert_ok(resumed)
    assert "step_00000005" in resumed.stdout and losses(checked_metrics(interrupted)) == expected
    megatron_shim.covered("async-checkpoint")


def test_bf16_the_gpu_dtype_trains_checkpoints_and_resumes(tmp_path):
    """bf16 (the default on a GPU) as Megatron-LM runs it: every parameter bf16 (the local spec's LayerNorm
    included, which once stayed fp32: CUDA's layer norm refused it, and the mixed-precision optimizer's
    checkpoint failed), fp32 master weights in the optimizer, and a resume that continues the same curve."""
    steps = [*STEPS[:STEPS.index("--optimizer")], "--dtype", "bf16", "--checkpoint-every", "2"]
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    assert_ok(single(uninterrupted, *steps))
    metrics = checked_metrics(uninterrupted)
    assert metrics["dtype"] == "torch.bfloat16" and metrics["parameter_dtypes"] == ["torch.bfloat16"], metrics
    assert metrics["optimizers"] == ["Float16OptimizerWithFloat16Params"] and metrics["model_wrapper"] == "DistributedDataParallel"
    assert_ok(single(interrupted, *steps, "--stop-at-step", "2"))
    resumed = single(interrupted, *steps)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and losses(read_metrics(interrupted)) == losses(metrics)
    megatron_shim.covered("bf16")


def test_resume_refuses_another_model(tmp_path):
    assert_ok(single(tmp_path, "--seq-len", "32", "--max-steps", "2", "--checkpoint-every", "1"))
    result = single(tmp_path, "--seq-len", "32", "--max-steps", "4", "--num-layers", "2")
    assert result.returncode == 2 and "was written with" in result.stderr and "--no-resume" in result.stderr, result.stderr


def preflight(world_size: int, *args: str, **env):
    return python(RECIPE, "--preflight", str(world_size), "--out-dir", "/nonexistent/x", *args,
                  env=recipe_env(**env), timeout=120)


@pytest.mark.parametrize("world_size, args, fragment", [
    (6, ["--tp", "2", "--pp", "2"], "world size 6 is not divisible by TP x PP = 2 x 2 = 4"),
    (4, ["--tp", "4", "--num-heads", "6", "--hidden-size", "96"], "--num-heads 6 is not divisible by --tp 4"),
    (2, ["--tp", "2", "--hidden-size", "65", "--num-heads", "2"], "--hidden-size 65 is not divisible by --tp 2"),
    (1, ["--hidden-size", "66", "--num-heads", "4"], "--hidden-size 66 is not divisible by --num-heads 4"),
    (2, ["--tp", "2", "--vocab-size", "255"], "--vocab-size 255 is not divisible by --tp 2"),
    (2, ["--pp", "2", "--num-layers", "3"], "--num-layers 3 is not divisible by --pp 2"),
    (4, ["--pp", "2", "--vp", "2", "--num-layers", "6"], "--num-layers 6 is not divisible by PP x VP = 2 x 2 = 4"),
    (4, ["--tp", "2", "--global-batch", "6"], "--global-batch 6 is not divisible by --micro-batch 2 x DP 2 = 4"),
    (2, ["--pp", "2", "--vp", "2", "--batch-p2p-comm"], "drop --batch-p2p-comm"),
    (2, ["--vp", "2"], "--vp 2 needs --vp >= 2 and --pp >= 2"),
    (1, ["--clip-grad", "-1"], "--clip-grad must be 0 (no clipping) or a positive norm, got -1.0"),
    (1, ["--lr", "0"], "--lr must be a positive finite number, got 0.0"),
    (1, ["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (2, ["--optimizer", "sgd", "--distributed-optimizer"], "distributed optimizer is Adam only"),
])
def test_bad_layout_is_refused_with_one_line(world_size, args, fragment):
    result = preflight(world_size, *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("[megatron_tp_pp] error: ") and fragment in lines[0], lines[0]


def test_tp_across_nodes_warns_but_runs(tmp_path):
    result = preflight(8, "--tp", "8", "--num-heads", "8", SLURM_NTASKS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    assert "--tp 8 is more than the 4 ranks per node" in result.stderr and "Slingshot" in result.stderr
    assert "preflight: TP 8 x PP 1 x DP 1 = 8 ranks" in result.stdout
    quiet = preflight(8, "--tp", "4", "--pp", "2", SLURM_TASKS_PER_NODE="4(x2)")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


def test_world_that_does_not_fit_is_refused_before_megatron_starts(tmp_path):
    """Not only in the preflight: the ranks themselves refuse, each with the same line, no traceback."""
    assert_refused_by_every_rank(tmp_path, 2, *STEPS, "--tp", "2", "--pp", "2",
                                 fragment="world size 2 is not divisible by TP x PP = 2 x 2 = 4")


def test_shim_rewrites_placement_only_and_records_where():
    """The shim on its own: CUDA placements become CPU ones, nothing else changes, every rewrite is noted."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(RECIPE.parent)!r})
import cpu_placement_shim as shim
shim.enable()
x = torch.zeros(3, device="cuda")
y = torch.ones(2, dtype=torch.float64).cuda()
z = torch.arange(4).to(torch.cuda.current_device())
assert x.device.type == y.device.type == z.device.type == "cpu"
assert y.dtype == torch.float64 and z.tolist() == [0, 1, 2, 3]
assert torch.ones(1).type() == "torch.cuda.FloatTensor" and torch.ones(1).type(torch.float64).dtype == torch.float64
torch.cuda.synchronize()
before = list(shim.sites())
torch.zeros(2, device="cpu") + torch.randn(2)
assert shim.sites() == before  # CPU placements are left alone and not recorded
print("\\n".join(before))
"""
    result = run([sys.executable, "-c", code], env=recipe_env(), timeout=120)
    assert_ok(result)
    recorded = result.stdout.strip().splitlines()
    assert all(line.startswith("outside megatron: <string>: ") for line in recorded), recorded
    assert {line.split(": ", 2)[2] for line in recorded} == {
        "zeros(device=cuda)", "Tensor.cuda()", "torch.cuda.current_device()", "Tensor.to(cuda)", "Tensor.type()",
        "torch.cuda.synchronize()"}
