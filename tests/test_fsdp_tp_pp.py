"""The PyTorch-native recipe (recipes/fsdp_tp_pp): FSDP2, HSDP, DTensor TP and pipelining, for real.

Reference: 1 plain process on the global batch of 8, plain SGD (lr 0.3): unlike Adam, SGD's update is
proportional to the gradient, so a gradient off by a factor (a sum for a mean, micro-batches not averaged)
changes the curve. Every layout (gloo ranks under torchrun) must match it over 4 steps within 1e-5
relative, in the loss of every step and in the global gradient norm of every step (measured here: loss
<= 2e-7, gradient norm <= 2e-8). From inside the run: world size, the mesh, every parameter's DTensor mesh
dimensions and placements (checked by the recipe against the layout, and here for the TP and FSDP ones),
and the parameters of every stage identical on the ranks that hold it.

Negative controls, one per kind of parallelism, each with that parallelism broken on purpose
(HPCML_TEST_FAULT, recipes/harness/faults.py): the gradient-norm check must flag them by at least 100x its tolerance (measured: 1.2e-1 and
more, 1e4x). Resume: AdamW (it has state to lose), stopped after step 3 and resumed, in the same and in
another layout (FSDP 2 x TP 2 -> PP 2), matches the uninterrupted run within 1e-5; a resume that drops the
optimizer state (resume-fresh-optimizer) must be caught, by 100x.
"""

from __future__ import annotations


import pytest

from conftest import (PARITY_RTOL, caught, EVAL, REPO, assert_ok, assert_preflight_refuses, eval_losses, grad_norms,
                      losses, max_relative_difference, read_metrics, run_recipe)

RECIPE = REPO / "recipes" / "fsdp_tp_pp" / "train.py"
MODEL = ["--seq-len", "32", "--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--global-batch", "8"]
SGD = [*MODEL, "--optimizer", "sgd", "--lr", "0.3", "--max-steps", "4", "--checkpoint-every", "0", "--no-resume", *EVAL]
ADAMW = [*MODEL, "--optimizer", "adamw", "--lr", "3e-3", "--max-steps", "6", "--checkpoint-every", "0"]

LAYOUTS = {  # name: (ranks, options, wrapper reported from inside)
    "fsdp2": (2, ["--tp", "1", "--dp-shard", "2"], "FSDP2"),
    "hsdp-2x2": (4, ["--tp", "1", "--dp-replicate", "2", "--dp-shard", "2"], "HSDP"),
    "tp2": (2, ["--tp", "2"], "TP"),
    "pp2-1f1b": (2, ["--tp", "1", "--pp", "2", "--micro-batches", "2"], "PP(1F1B)"),
    "pp2-interleaved": (2, ["--tp", "1", "--pp", "2", "--pp-schedule", "Interleaved1F1B", "--pp-virtual", "2",
                            "--micro-batches", "2"], "PP(Interleaved1F1B)"),
    "pp2-gpipe": (2, ["--tp", "1", "--pp", "2", "--pp-schedule", "GPipe", "--micro-batches", "4"], "PP(GPipe)"),
    "fsdp2xtp2": (4, ["--tp", "2", "--dp-shard", "2"], "FSDP2+TP"),
    "tp2xpp2": (4, ["--tp", "2", "--pp", "2", "--micro-batches", "2"], "TP+PP(1F1B)"),
}


def train(out_dir, nproc: int, *args: str, **env: str):
    return run_recipe(RECIPE, out_dir, nproc, *args, **env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert_ok(train(out, 1, *SGD, "--tp", "1"))
    metrics = read_metrics(out)
    assert metrics["world_size"] == 1 and metrics["model_wrapper"] == "none"
    assert set(metrics["placements"].values()) == {"plain tensor"}
    return metrics


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(name, reference, tmp_path):
    ranks, options, wrapper = LAYOUTS[name]
    result = train(tmp_path, ranks, *SGD, *options)
    assert_ok(result)
    metrics = read_metrics(tmp_path)
    assert metrics["world_size"] == ranks and metrics["backend"] == "gloo" and metrics["model_wrapper"] == wrapper
    mesh = metrics["mesh"]
    assert mesh["pp"] * mesh["dp_replicate"] * mesh["dp_shard"] * mesh["tp"] == ranks
    placements = metrics["placements"]
    assert len(placements) == len(reference["placements"])  # every parameter of every stage is accounted for
    if mesh["tp"] > 1:
        assert "'tp'" in placements["blocks.0.attn.qkv.weight"] and "Shard(dim=0)" in placements["blocks.0.attn.qkv.weight"]
        assert "Shard(dim=1)" in placements["blocks.0.attn.proj.weight"]
    if mesh["dp_shard"] > 1:
        assert all("'dp_shard'" in text for text in placements.values()), placements
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    assert max_relative_difference(losses(metrics), losses(reference)) <= PARITY_RTOL
    assert max_relative_difference(grad_norms(metrics), grad_norms(reference)) <= PARITY_RTOL
    # the validation loss (the pipeline: its schedule's forward-only eval), averaged over DP
    assert len(eval_losses(metrics)) == 2 and max_relative_difference(eval_losses(metrics), eval_losses(reference)) <= PARITY_RTOL


def test_activation_checkpointing_changes_nothing_but_memory(reference, tmp_path):
    assert_ok(train(tmp_path, 2, *SGD, "--tp", "1", "--dp-shard", "2", "--activation-checkpointing"))
    metrics = read_metrics(tmp_path)
    assert max_relative_difference(losses(metrics), losses(reference)) <= PARITY_RTOL
    assert max_relative_difference(grad_norms(metrics), grad_norms(reference)) <= PARITY_RTOL


@pytest.mark.parametrize("control, ranks, options", [
    ("tp-no-reduce", 2, ["--tp", "2"]),
    ("grad-sum", 2, ["--tp", "1", "--dp-shard", "2"]),
    ("no-grad-allreduce", 2, ["--tp", "1", "--dp-shard", "2"]),
    ("pp-loss-unscaled", 2, ["--tp", "1", "--pp", "2", "--micro-batches", "2"]),
])
def test_negative_control_is_caught(control, ranks, options, reference, tmp_path):
    """The same run with one parallelism wrong on purpose: the parity check above must fail, by 100x."""
    result = train(tmp_path, ranks, *SGD, *options, HPCML_TEST_FAULT=control)
    metrics = read_metrics(tmp_path)
    assert caught(max_relative_difference(grad_norms(metrics), grad_norms(reference)), PARITY_RTOL)
    if control == "tp-no-reduce":  # the TP ranks' replicated parameters drift apart: the run says so
        assert result.returncode != 0 and "parameters differ across the ranks of a stage" in result.stderr
        assert metrics["param_max_abs_diff_across_ranks"] > 0


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
