"""DDP is numerically the same training as one process on the full batch, and the check can fail.

Reference: 1 plain process (no process group, no DDP wrapper) on the global batch of 8.
Parallel: 2 gloo ranks under torchrun, each on 4 rows of the same global batch.
Tolerance: relative difference of the per-step loss <= 1e-5 (float32 reductions in another order), over
6 steps; parameters bitwise identical across ranks (checked inside the run) and within 1e-5 of the reference.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_ok, losses, max_relative_difference, read_metrics, run_single, run_torchrun

STEPS = ["--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "0", "--no-resume"]
LOSS_RTOL = 1e-5


def final_params(out_dir) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(out_dir / "checkpoints" / "step_00000006.pt", weights_only=True)
    return checkpoint["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run_single(out, *STEPS))
    metrics = read_metrics(out)
    assert metrics["world_size"] == 1 and metrics["model_wrapper"] == "GPT"
    return out, metrics


def test_two_ranks_match_one_process(reference, tmp_path):
    ref_dir, ref = reference
    result = run_torchrun(tmp_path, 2, *STEPS)
    assert_ok(result)
    metrics = read_metrics(tmp_path)

    # It really was parallel: from inside the run, not from how it was launched.
    assert metrics["world_size"] == 2
    assert metrics["backend"] == "gloo"
    assert metrics["model_wrapper"] == "DistributedDataParallel"
    assert len(metrics["hostnames"]) == 2
    assert "world_size=2 backend=gloo" in result.stdout

    assert len(losses(metrics)) == 6
    assert max_relative_difference(losses(metrics), losses(ref)) <= LOSS_RTOL
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0

    ours, theirs = final_params(tmp_path), final_params(ref_dir)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_negative_control_unsynchronised_gradients_are_caught(reference, tmp_path):
    """Same run with DDP's gradient all-reduce skipped: the comparison above must fail, loudly."""
    _, ref = reference
    result = run_torchrun(tmp_path, 2, *STEPS, "--skip-grad-allreduce")
    assert result.returncode != 0
    assert "parameters differ across ranks" in result.stderr
    metrics = read_metrics(tmp_path)
    assert metrics["param_max_abs_diff_across_ranks"] > 0.0
    assert max_relative_difference(losses(metrics), losses(ref)) > 100 * LOSS_RTOL
