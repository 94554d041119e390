"""The TensorFlow recipes (Horovod, MirroredStrategy) and the PyTorch Horovod variant, for real.

TensorFlow 2.21 + tf-keras, PyTorch 2.13 and Horovod 0.28.1 (the wheel the horovod image compiled), bare in
.venv-tf (`make venv-tf`; `make test` makes it). Ranks are real processes: horovodrun's gloo launcher,
MPICH's mpiexec (MPI controller), or one process with 2 logical CPU devices (MirroredStrategy).

Parity: the per-step loss of the parallel run against one process on the same global batch and weights,
relative difference <= 1e-5 over 4 steps (measured here: <= 2e-7), trained with plain SGD, which a gradient
of the wrong scale cannot pass (Adam, nearly blind to it, is the recipes' default). Horovod's learning rate
is --lr x world size, so the reference runs with the full batch and that learning rate. From inside the run:
world size, controller, wrapper, and the weights of all ranks identical after every step
(--check-sync-every 1). Negative controls, each caught by the same comparison with a margin of 100x the
tolerance or more: without the gradient all-reduce (the run also exits 3: the ranks' weights differ), and
with the gradients summed instead of averaged (Horovod's op=Sum; MirroredStrategy: each replica's loss
averaged over its own rows instead of the global batch); for both Horovod launchers (horovodrun, mpiexec).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import (PARITY_RTOL, caught, EVAL, REPO, eval_losses, fault, free_port, losses, max_relative_difference,
                      read_metrics, recipe_env, run)

pytestmark = pytest.mark.tensorflow  # every test here runs in .venv-tf

VENV_TF = REPO / ".venv-tf"
TF_PYTHON = VENV_TF / "bin" / "python"
HOROVOD_TF = REPO / "recipes" / "horovod" / "train.py"
HOROVOD_TORCH = REPO / "recipes" / "horovod" / "train_torch.py"
MIRRORED = REPO / "recipes" / "tf_mirrored" / "train.py"
STEPS = ["--seq-len", "32", "--max-steps", "4", "--checkpoint-every", "0"]
TORCH_STEPS = ["--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--max-steps", "4",
               "--checkpoint-every", "0"]
# Plain SGD at learning rates where a doubled gradient moves the loss by >= 100x the tolerance (measured:
# the Keras model 220x at 20 vs 40, the GPT 800x at 1 vs 2); per rank, Horovod uses lr x ranks.
KERAS_SGD_LR, GPT_SGD_LR = 10.0, 0.5
CLIP = "0.053"  # a gradient norm that clips some steps of the Keras model at SGD_KERAS (test_..._schedule_...)


@pytest.fixture(scope="module", autouse=True)
def tf_venv():
    assert TF_PYTHON.exists() and (VENV_TF / ".installed").exists(), \
        "no .venv-tf: run `make venv-tf` (make test does), which builds the horovod image for its Horovod wheel"


def tf_env(**extra: str) -> dict[str, str]:
    env = recipe_env(**extra)
    env["PATH"] = f"{VENV_TF / 'bin'}:{env['PATH']}"  # horovodrun and mpiexec start `python` from here
    return env


# ``env``: e.g. fault("grad-sum"), a negative control (recipes/harness/faults.py).
def single(recipe: Path, out_dir: Path, *args: str, **env: str):
    return run([str(TF_PYTHON), str(recipe), "--out-dir", str(out_dir), *args], env=tf_env(**env), timeout=300)


def horovodrun(recipe: Path, out_dir: Path, nproc: int, *args: str, **env: str):
    cmd = [str(VENV_TF / "bin" / "horovodrun"), "--gloo", "-np", str(nproc), "-H", f"localhost:{nproc}",
           "-p", str(free_port()), "python", str(recipe), "--out-dir", str(out_dir), *args]
    return run(cmd, env=tf_env(HPCML_EXPECTED_WORLD_SIZE=str(nproc), **env), timeout=300)


def mpiexec(recipe: Path, out_dir: Path, nproc: int, *args: str, **env: str):
    cmd = [str(VENV_TF / "bin" / "mpiexec"), "-n", str(nproc), "python", str(recipe), "--out-dir", str(out_dir), *args]
    return run(cmd, env=tf_env(HPCML_EXPECTED_WORLD_SIZE=str(nproc), **env), timeout=300)


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def horovod_reference(tmp_path: Path, recipe: Path, ranks: int, batch_per_rank: int, lr: float, steps: list[str]):
    """One process on the whole global batch with the learning rate the ranks use (lr x ranks): its metrics."""
    result = single(recipe, tmp_path / "reference", *steps, "--batch-per-rank", str(batch_per_rank * ranks),
                    "--lr", str(lr * ranks))
    ok(result)
    return read_metrics(tmp_path / "reference")


def assert_same_training(metrics: dict, reference: dict) -> None:
    """The per-step loss and the validation loss (--eval-every, averaged over the ranks) of one process's run."""
    assert max_relative_difference(losses(metrics), losses(reference)) <= PARITY_RTOL
    assert len(eval_losses(metrics)) == 2 and max_relative_difference(eval_losses(metrics), eval_losses(reference)) <= PARITY_RTOL


# ---- Horovod + TensorFlow

SGD_KERAS = [*STEPS, "--optimizer", "sgd", *EVAL]


@pytest.fixture(scope="module")
def keras_reference(tmp_path_factory):
    return horovod_reference(tmp_path_factory.mktemp("keras"), HOROVOD_TF, 2, 8, KERAS_SGD_LR, SGD_KERAS)


@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpiexec"])
def test_horovod_two_ranks_train_what_one_process_trains(keras_reference, tmp_path, launcher):
    start = horovodrun if launcher == "horovodrun-gloo" else mpiexec
    ok(start(HOROVOD_TF, tmp_path / "two", 2, *SGD_KERAS, "--batch-per-rank", "8", "--lr", str(KERAS_SGD_LR),
             "--check-sync-every", "1"))
    metrics = read_metrics(tmp_path / "two")
    controller = "gloo" if launcher == "horovodrun-gloo" else "mpi"
    assert metrics["world_size"] == 2 and metrics["backend"] == f"horovod-{controller}"
    assert metrics["model_wrapper"] == "DistributedGradientTape" and metrics["lr_used"] == pytest.approx(2 * KERAS_SGD_LR)
    assert metrics["horovod_built"] == {"gloo": True, "mpi": True, "nccl": False}
    assert metrics["tensorflow_version"] == "2.21.0" and metrics["horovod_version"] == "0.28.1"
    assert [check["param_max_abs_diff_across_ranks"] for check in metrics["sync_checks"]] == [0.0] * 4
    assert_same_training(metrics, keras_reference)


@pytest.mark.parametrize("launcher, control", [("horovodrun-gloo", "no-grad-allreduce"), ("mpiexec", "no-grad-allreduce"),
                                               ("horovodrun-gloo", "grad-sum"), ("mpiexec", "grad-sum")])
def test_horovod_negative_controls_are_caught(keras_reference, tmp_path, launcher, control):
    """The same check fails when the ranks do not average their gradients, or sum them."""
    start = horovodrun if launcher == "horovodrun-gloo" else mpiexec
    result = start(HOROVOD_TF, tmp_path / "two", 2, *SGD_KERAS, "--batch-per-rank", "8", "--lr", str(KERAS_SGD_LR),
                   **fault(control))
    metrics = read_metrics(tmp_path / "two")
    assert caught(max_relative_difference(losses(metrics), losses(keras_reference)), PARITY_RTOL)
    if control == "no-grad-allreduce":
        assert result.returncode != 0 and "weights differ across ranks" in result.stdout + result.stderr
        assert metrics["model_wrapper"] == "GradientTape" and metrics["param_max_abs_diff_across_ranks"] > 0
    else:
        ok(result)
        assert metrics["model_wrapper"] == "DistributedGradientTape" and metrics["param_max_abs_diff_across_ranks"] == 0


# Adam (its moments are what a resume must restore) at a learning rate where losing them shows by far, with a
# warmup and a cosine schedule, which the resumed run must continue where it stopped.
RESUME = [*STEPS, "--lr", "0.01", "--max-steps", "6", "--warmup-steps", "2", "--lr-schedule", "cosine"]


@pytest.mark.parametrize("defect", [None, "resume-fresh-optimizer"])
def test_horovod_resume_continues_the_same_curve(tmp_path, defect):
    """Stopped after step 2 and resumed, the ranks end on the uninterrupted curve, to the bit; a resume that
    restores the weights but not the optimizer state must fail that comparison by far."""
    whole = tmp_path / "whole"
    ok(horovodrun(HOROVOD_TF, whole, 2, *RESUME))
    split = tmp_path / "split"
    ok(horovodrun(HOROVOD_TF, split, 2, *RESUME, "--stop-at-step", "2"))
    assert read_metrics(split)["last_step"] == 2
    assert (split / "checkpoints" / "step_00000002" / "meta.json").exists()
    result = horovodrun(HOROVOD_TF, split, 2, *RESUME, **fault(defect))
    ok(result)
    assert "resumed from" in result.stdout and "(step 2)" in result.stdout
    metrics = read_metrics(split)
    assert metrics["resumed_from_step"] == 2 and [r["step"] for r in metrics["history"]] == [1, 2, 3, 4, 5, 6]
    resumed, straight = losses(metrics), losses(read_metrics(whole))
    if defect is None:
        assert resumed == straight
    else:
        assert resumed[:2] == straight[:2] and caught(max_relative_difference(resumed[2:], straight[2:]), PARITY_RTOL)
    assert not list((split / "checkpoints").glob(".step_*.partial"))


@pytest.mark.full  # (slower tier: the DDP checkpoint's change of world size runs in the default one)
def test_a_horovod_checkpoint_resumes_at_another_world_size(tmp_path):
    """Rank 0's checkpoint holds the whole model and optimizer, and the data position is the step: 2 ranks'
    checkpoint continues on 1 process on the same curve (<= 1e-5), given the same global batch and the same
    learning rate (Horovod's convention: --lr x ranks, so 1 process takes twice the --lr)."""
    whole = tmp_path / "whole"
    ok(horovodrun(HOROVOD_TF, whole, 2, *STEPS, "--batch-per-rank", "8", "--lr", "1e-3"))
    split = tmp_path / "split"
    ok(horovodrun(HOROVOD_TF, split, 2, *STEPS, "--batch-per-rank", "8", "--lr", "1e-3", "--stop-at-step", "2"))
    result = single(HOROVOD_TF, split, *STEPS, "--batch-per-rank", "16", "--lr", "2e-3")
    ok(result)
    assert "(step 2)" in result.stdout and read_metrics(split)["world_size"] == 1
    assert max_relative_difference(losses(read_metrics(split)), losses(read_metrics(whole))) <= PARITY_RTOL


def test_horovod_resume_with_another_global_batch_is_refused(tmp_path):
    ok(single(HOROVOD_TF, tmp_path, *STEPS, "--stop-at-step", "2"))
    result = single(HOROVOD_TF, tmp_path, *STEPS, "--batch-per-rank", "4")
    assert result.returncode == 2
    assert re.search(r"^\[horovod\] error: .*step_00000002 was written with .*'global_batch': 8, .*\}, "
                     r"this run has .*'global_batch': 4, .*\}: .*--no-resume", result.stderr, re.M), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("recipe", "args", "message"), [
    (HOROVOD_TF, ["--batch-per-rank", "0"], "--batch-per-rank must be at least 1, got 0"),
    (HOROVOD_TF, ["--lr", "-1"], "--lr must be a positive finite number, got -1.0"),
    (MIRRORED, ["--global-batch", "15", "--devices", "2"], "--global-batch 15 is not divisible by --devices 2"),
    (MIRRORED, ["--preflight", "2"], "MirroredStrategy runs as one process per node, but 2 were started"),
    (HOROVOD_TORCH, ["--n-embd", "30", "--n-head", "4"], "--n-embd 30 is not divisible by --n-head 4"),
])
def test_bad_input_gives_one_line_and_exit_2(tmp_path, recipe, args, message):
    result = single(recipe, tmp_path, *args)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "] error: " in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize(("recipe", "args", "control"), [
    (HOROVOD_TF, [], "no-grad-allreduce"), (HOROVOD_TORCH, [], "grad-sum"), (MIRRORED, ["--devices", "1"], "grad-sum")])
def test_a_negative_control_that_would_change_nothing_is_refused(tmp_path, recipe, args, control):
    result = single(recipe, tmp_path, *args, **fault(control))
    errors = [line for line in result.stderr.splitlines() if "] error: " in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert f"HPCML_TEST_FAULT={control} changes nothing in this layout" in errors[0], result.stderr


@pytest.mark.parametrize("recipe", [HOROVOD_TF, MIRRORED])
def test_help_shows_no_test_only_option(recipe):
    result = run([str(TF_PYTHON), str(recipe), "--help"], env=tf_env(), timeout=120)
    assert result.returncode == 0 and "--max-steps" in result.stdout, result.stderr
    for word in ("test-break", "skip-grad", "TESTS ONLY", "wrong on purpose"):
        assert word not in result.stdout, word


def test_horovod_preflight_checks_options_without_starting_horovod(tmp_path):
    result = single(HOROVOD_TF, tmp_path, "--preflight", "8")
    assert result.returncode == 0 and "preflight: options fit world size 8" in result.stdout


# ---- MirroredStrategy

MIRRORED_SGD = [*SGD_KERAS, "--lr", str(2 * KERAS_SGD_LR)]


@pytest.fixture(scope="module")
def mirrored_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("mirrored-one")
    ok(single(MIRRORED, out, *MIRRORED_SGD, "--devices", "1"))
    return read_metrics(out)


def test_mirrored_two_logical_devices_train_what_one_device_trains(mirrored_reference, tmp_path):
    result = single(MIRRORED, tmp_path / "two", *MIRRORED_SGD, "--devices", "2")
    ok(result)
    assert "replicas=2 devices=/cpu:0,/cpu:1 (cpu split into 2 logical devices)" in result.stdout
    metrics = read_metrics(tmp_path / "two")
    assert metrics["replicas"] == 2 and metrics["layout"] == {"dp": 2}
    assert metrics["model_wrapper"] == "MirroredStrategy"
    assert metrics["backend"] == "MirroredStrategy/ReductionToOneDevice"
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    assert_same_training(metrics, mirrored_reference)


@pytest.mark.parametrize("control", ["no-grad-allreduce", "grad-sum"])
def test_mirrored_negative_controls_are_caught(mirrored_reference, tmp_path, control):
    result = single(MIRRORED, tmp_path / "two", *MIRRORED_SGD, "--devices", "2", **fault(control))
    metrics = read_metrics(tmp_path / "two")
    assert caught(max_relative_difference(losses(metrics), losses(mirrored_reference)), PARITY_RTOL)
    if control == "no-grad-allreduce":
        assert result.returncode == 3 and "the replicas' weights differ" in result.stderr
        assert metrics["param_max_abs_diff_across_ranks"] > 0
    else:
        ok(result)
        assert metrics["param_max_abs_diff_across_ranks"] == 0


@pytest.mark.parametrize("defect", [None, "resume-fresh-optimizer"])
def test_mirrored_resume_continues_the_same_curve(tmp_path, defect):
    ok(single(MIRRORED, tmp_path / "whole", *RESUME))
    ok(single(MIRRORED, tmp_path / "split", *RESUME, "--stop-at-step", "2"))
    result = single(MIRRORED, tmp_path / "split", *RESUME, **fault(defect))
    ok(result)
    assert "(step 2)" in result.stdout
    resumed, straight = losses(read_metrics(tmp_path / "split")), losses(read_metrics(tmp_path / "whole"))
    if defect is None:
        assert resumed == straight
    else:
        assert resumed[:2] == straight[:2] and caught(max_relative_difference(resumed[2:], straight[2:]), PARITY_RTOL)


# ---- the learning-rate schedule and clipping on the TensorFlow recipes

SCHEDULE = ["--warmup-steps", "2", "--lr-schedule", "cosine", "--clip-grad", "CLIP"]


@pytest.mark.parametrize("recipe", ["horovod", "tf_mirrored"])
def test_the_tensorflow_recipes_follow_the_schedule_and_clip_as_one_process(tmp_path, recipe):
    """Warmup, a cosine schedule and clipping (the Keras model's gradient norms here: 0.050 to 0.059, clipped at
    0.053) on 2 Horovod ranks and on 2 MirroredStrategy replicas: the losses, learning rates and gradient norms
    of one process. The norm is the one of the averaged (Horovod) or all-reduced (MirroredStrategy) gradients."""
    schedule = [CLIP if arg == "CLIP" else arg for arg in SCHEDULE]
    if recipe == "horovod":
        reference = horovod_reference(tmp_path, HOROVOD_TF, 2, 8, KERAS_SGD_LR, [*SGD_KERAS, *schedule])
        ok(horovodrun(HOROVOD_TF, tmp_path / "two", 2, *SGD_KERAS, *schedule, "--batch-per-rank", "8", "--lr", str(KERAS_SGD_LR)))
    else:
        ok(single(MIRRORED, tmp_path / "one", *MIRRORED_SGD, *schedule, "--devices", "1"))
        ok(single(MIRRORED, tmp_path / "two", *MIRRORED_SGD, *schedule, "--devices", "2"))
        reference = read_metrics(tmp_path / "one")
    metrics = read_metrics(tmp_path / "two")
    assert metrics["world_size" if recipe == "horovod" else "replicas"] == 2
    assert_same_training(metrics, reference)
    rates = [[record["lr"] for record in run["history"]] for run in (metrics, reference)]
    norms = [[record["grad_norm"] for record in run["history"]] for run in (metrics, reference)]
    # (Horovod: --lr per rank x 2 ranks against 2 x --lr on one process: equal up to rounding)
    assert rates[0] == pytest.approx(rates[1], rel=1e-12) and rates[0][:2] == [KERAS_SGD_LR, 2 * KERAS_SGD_LR]
    assert max_relative_difference(*norms) <= PARITY_RTOL and sum(norm > float(CLIP) for norm in norms[1]) >= 2


# ---- Horovod + PyTorch (horovod.torch)

def test_horovod_torch_two_ranks_train_what_one_process_trains(tmp_path):
    sgd = [*TORCH_STEPS, "--optimizer", "sgd", *EVAL]
    reference = horovod_reference(tmp_path, HOROVOD_TORCH, 2, 8, GPT_SGD_LR, sgd)
    two = [*sgd, "--batch-per-rank", "8", "--lr", str(GPT_SGD_LR)]
    ok(horovodrun(HOROVOD_TORCH, tmp_path / "two", 2, *two))
    metrics = read_metrics(tmp_path / "two")
    assert metrics["world_size"] == 2 and metrics["backend"] == "horovod-gloo"
    assert metrics["model_wrapper"] == "DistributedOptimizer" and metrics["param_max_abs_diff_across_ranks"] == 0.0
    assert_same_training(metrics, reference)

    # The negative controls: no averaging (the ranks drift apart, the run fails), and a sum instead of the mean.
    result = horovodrun(HOROVOD_TORCH, tmp_path / "wrong", 2, *two, **fault("no-grad-allreduce"))
    assert result.returncode != 0 and "parameters differ across ranks" in result.stdout + result.stderr
    assert caught(max_relative_difference(losses(read_metrics(tmp_path / "wrong")), losses(reference)), PARITY_RTOL)
    ok(horovodrun(HOROVOD_TORCH, tmp_path / "summed", 2, *two, **fault("grad-sum")))
    assert caught(max_relative_difference(losses(read_metrics(tmp_path / "summed")), losses(reference)), PARITY_RTOL)


def test_horovod_torch_trains_your_module_with_the_schedule_and_clipping_as_one_process(tmp_path):
    """--model MODULE:FACTORY (recipes/examples/bigram.py) with warmup, a cosine schedule and clipping (the
    bigram's gradient norms here: 0.048 to 0.054, clipped at 0.05) on 2 Horovod ranks: the losses, learning
    rates and gradient norms of one process (the norm is taken after Horovod's average: synchronize(), then
    clip, then step)."""
    bigram = f"{REPO / 'recipes' / 'examples' / 'bigram.py'}:build"
    sgd = [*TORCH_STEPS, "--optimizer", "sgd", *EVAL, "--model", bigram, "--warmup-steps", "2", "--lr-schedule", "cosine",
           "--clip-grad", "0.05"]
    reference = horovod_reference(tmp_path, HOROVOD_TORCH, 2, 8, GPT_SGD_LR, sgd)
    ok(horovodrun(HOROVOD_TORCH, tmp_path / "two", 2, *sgd, "--batch-per-rank", "8", "--lr", str(GPT_SGD_LR)))
    metrics = read_metrics(tmp_path / "two")
    assert (metrics["world_size"], metrics["model_wrapper"], metrics["model"]) == (2, "DistributedOptimizer", bigram)
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    assert_same_training(metrics, reference)
    rates = [[record["lr"] for record in run["history"]] for run in (metrics, reference)]
    norms = [[record["grad_norm"] for record in run["history"]] for run in (metrics, reference)]
    assert rates[0] == rates[1] and rates[0][:2] == [0.5, 1.0]
    assert max_relative_difference(*norms) <= PARITY_RTOL and sum(norm > 0.05 for norm in norms[1]) >= 2


# ---- srun without MPI: the rendezvous layout recipes/horovod/horovod_launch.py gives every rank

def test_slurm_task_layout_becomes_horovods_rank_layout():
    import sys

    sys.path.insert(0, str(REPO / "recipes" / "horovod"))
    import horovod_launch

    assert horovod_launch.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    slots = horovod_launch.slot_layout(["a", "b"], [2, 1])
    assert [(s["hostname"], s["rank"], s["local_rank"], s["local_size"], s["cross_rank"], s["cross_size"])
            for s in slots] == [("a", 0, 0, 2, 0, 2), ("a", 1, 1, 2, 0, 1), ("b", 2, 0, 1, 1, 2)]
    assert {s["size"] for s in slots} == {3}

    environ = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
               "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "nid[01-02]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
               "SLURMD_NODENAME": "nid01"}  # rank 1 belongs on nid02 under the block distribution
    with pytest.raises(horovod_launch.harness.ConfigError, match="use srun's default --distribution=block"):
        horovod_launch.prepare_world(dict(environ))
    assert horovod_launch.prepare_world({**environ, "HOROVOD_RANK": "1"}) == "horovodrun"
    assert horovod_launch.prepare_world({**environ, "HOROVOD_CONTROLLER": "mpi"}) == "srun (MPI controller)"
    assert not os.environ.get("HOROVOD_CONTROLLER")  # (the checks above wrote into their own dicts)


def test_the_mpi_controller_needs_a_horovod_built_against_the_mpich_abi(tmp_path):
    """HOROVOD_CONTROLLER=mpi works where Cray MPICH can replace the image's MPI: a Horovod that links
    libmpi.so.12 (the cpu flavor, built here). NGC's TensorFlow image (the cuda flavor) links Open MPI's
    libmpi.so.40: refused in the preflight, with the controller that works (gloo). Checked on the real
    Horovod build of .venv-tf, and on the sonames the cuda flavor's Horovod would report."""
    import sys

    sys.path.insert(0, str(REPO / "recipes" / "horovod"))
    import horovod_launch

    check, mpi = horovod_launch.check_mpi_controller, {"HOROVOD_CONTROLLER": "mpi"}
    check(mpi, {"libmpi.so.12"})
    check({}, {"libmpi.so.40"})  # the gloo controller (the default) needs no MPI at all
    with pytest.raises(horovod_launch.harness.ConfigError, match=r"this Horovod links libmpi\.so\.40 \(Open MPI"):
        check(mpi, {"libmpi.so.40"})
    with pytest.raises(horovod_launch.harness.ConfigError, match="this Horovod was built without MPI: unset HOROVOD_CONTROLLER"):
        check(mpi, set())

    real = run([str(TF_PYTHON), "-c", "import sys; sys.path.insert(0, sys.argv[1]); import horovod_launch; "
                "print(*sorted(horovod_launch.horovod_mpi_libraries()))", str(REPO / "recipes" / "horovod")], env=tf_env())
    assert real.returncode == 0 and real.stdout.split() == ["libmpi.so.12"], real.stdout + real.stderr
    for recipe in (HOROVOD_TF, HOROVOD_TORCH):  # the preflight of both recipes asks
        result = run([str(TF_PYTHON), str(recipe), "--out-dir", str(tmp_path), "--preflight", "2"],
                     env=tf_env(HOROVOD_CONTROLLER="mpi"), timeout=120)
        assert result.returncode == 0, result.stderr


@pytest.mark.slurm
def test_srun_with_mpi_but_no_pmi_is_refused_not_trained_as_separate_worlds(slurm_cluster, tmp_path):
    """The silent fallback this catches: HOROVOD_CONTROLLER=mpi under srun without a PMI plugin gives every
    task an MPI world of its own; each would train alone and exit 0. The ranks refuse instead (exit 2)."""
    from conftest import sbatch_recipe, unlabelled

    code, state, log = sbatch_recipe(slurm_cluster, tmp_path, "horovod", "-N", "2", "--ntasks-per-node", "1",
                                     recipe_args=STEPS, PYTHON=str(TF_PYTHON), HOROVOD_CONTROLLER="mpi",
                                     SLURM_MPI_TYPE="none")
    assert code != 0 and state == "FAILED", log
    errors = {line for line in unlabelled(log).splitlines() if line.startswith("[horovod] error:")}
    assert errors == {"[horovod] error: this process joined a world of 1 rank(s), but the job launched 2 "
                      "(HPCML_EXPECTED_WORLD_SIZE): the launcher started the ranks as independent trainings; "
                      "check the launch command (torchrun/accelerate/deepspeed options; srun --mpi for MPI) against the allocation"}, log
    assert not re.search(r"^\[horovod\] step ", unlabelled(log), re.M) and "Traceback" not in log, log
