"""DDP is numerically the same training as one process on the full batch, and the check can fail.

Reference: 1 plain process (no process group, no DDP wrapper) on the global batch of 8.
Parallel: 2 gloo ranks under torchrun, each on 4 rows of the same global batch.
Tolerance: relative difference of the per-step loss <= 1e-5 (float32 reductions in another order), over
6 steps, and of the validation loss after steps 2, 4 and 6 (--eval-every: each rank evaluates its rows of
the validation batches, averaged over the ranks); parameters bitwise identical across ranks (checked inside the run) and within 1e-5
of the reference.
Optimizer: plain SGD (lr 1.0), which a gradient of the wrong scale cannot pass (Adam, nearly invariant to a
uniform scale of the gradients, would hide a sum-instead-of-mean all-reduce); and AdamW, the default.
Negative controls, each caught by the same comparison with a margin of at least 100x the tolerance: the
all-reduce skipped (the ranks' parameters also drift apart, and the run says so), and the gradients summed
over the ranks instead of averaged (measured here: 8e-3, 800x).
"""

from __future__ import annotations

import pytest
import torch

from conftest import (PARITY_RTOL, caught, EVAL, assert_ok, fault, eval_losses, losses, max_relative_difference,
                      read_metrics, run_single, run_torchrun)

STEPS = ["--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "0", "--no-resume", *EVAL]
OPTIMIZERS = {"sgd": ["--optimizer", "sgd", "--lr", "1.0"], "adamw": ["--optimizer", "adamw"]}


def final_params(out_dir) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(out_dir / "checkpoints" / "step_00000006.pt", weights_only=True)
    return checkpoint["model"]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    runs = {}
    for name, options in OPTIMIZERS.items():
        out = tmp_path_factory.mktemp(f"reference-{name}")
        assert_ok(run_single(out, *STEPS, *options))
        metrics = read_metrics(out)
        assert metrics["world_size"] == 1 and metrics["model_wrapper"] == "GPT"
        runs[name] = out, metrics
    return runs


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_ranks_match_one_process(references, tmp_path, optimizer):
    ref_dir, ref = references[optimizer]
    result = run_torchrun(tmp_path, 2, *STEPS, *OPTIMIZERS[optimizer])
    assert_ok(result)
    metrics = read_metrics(tmp_path)

    # It really was parallel: from inside the run, not from how it was launched.
    assert metrics["world_size"] == 2
    assert metrics["backend"] == "gloo"
    assert metrics["model_wrapper"] == "DistributedDataParallel"
    assert len(metrics["hostnames"]) == 2
    assert "world_size=2 backend=gloo" in result.stdout

    assert len(losses(metrics)) == 6
    assert max_relative_difference(losses(metrics), losses(ref)) <= PARITY_RTOL
    # The validation loss after steps 2, 4 and 6: each rank its rows, averaged, as one process on all of them.
    assert len(eval_losses(metrics)) == 3 and max_relative_difference(eval_losses(metrics), eval_losses(ref)) <= PARITY_RTOL
    assert metrics["summary"]["final_eval_loss"] == eval_losses(metrics)[-1]
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0

    ours, theirs = final_params(tmp_path), final_params(ref_dir)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("control", ["no-grad-allreduce", "grad-sum"])
def test_negative_controls_are_caught(references, tmp_path, control):
    """The same SGD run, wrong on purpose (HPCML_TEST_FAULT): the comparison above must fail, by far."""
    _, ref = references["sgd"]
    result = run_torchrun(tmp_path, 2, *STEPS, *OPTIMIZERS["sgd"], **fault(control))
    metrics = read_metrics(tmp_path)
    assert caught(max_relative_difference(losses(metrics), losses(ref)), PARITY_RTOL)
    assert caught(max_relative_difference(eval_losses(metrics), eval_losses(ref)), PARITY_RTOL)  # the wrong model evaluated
    if control == "no-grad-allreduce":  # the ranks' models drift apart: the run itself fails
        assert result.returncode != 0 and "parameters differ across ranks" in result.stderr
        assert metrics["param_max_abs_diff_across_ranks"] > 0.0
    else:  # every rank applies the same (summed) gradient: only the comparison with one process sees it
        assert_ok(result)
        assert metrics["param_max_abs_diff_across_ranks"] == 0.0
