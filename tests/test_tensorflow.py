"""The TensorFlow recipes (Horovod, MirroredStrategy) and the PyTorch Horovod variant, beyond parity (their
layouts, launchers and controls, and the schedule and clipping against one process: tests/parity.toml).

TensorFlow 2.21 + tf-keras, PyTorch 2.13 and Horovod 0.28.1 (the wheel the horovod image compiled), bare in
.venv-tf (`make venv-tf`; `make test` makes it). Here: a stopped run resumes on the same curve (a resume
without the optimizer state is caught by 100x the parity tolerance), Horovod's checkpoint resumes at another
world size, bad input is one line and exit 2, a control that would change nothing is refused, the launch
layout Slurm gives becomes Horovod's, and an MPI-less or PMI-less launch is refused instead of training as
separate worlds.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from support.curves import caught, losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import fault, horovodrun, REPO, run, TF_PYTHON, tf_env, tf_single as single, VENV_TF

pytestmark = pytest.mark.tensorflow  # every test here runs in .venv-tf

HOROVOD_TF = REPO / "recipes" / "horovod" / "train.py"
HOROVOD_TORCH = REPO / "recipes" / "horovod" / "train_torch.py"
MIRRORED = REPO / "recipes" / "tf_mirrored" / "train.py"
STEPS = ["--seq-len", "32", "--max-steps", "4", "--checkpoint-every", "0"]


@pytest.fixture(scope="module", autouse=True)
def tf_venv():
    assert TF_PYTHON.exists() and (VENV_TF / ".installed").exists(), \
        "no .venv-tf: run `make venv-tf` (make test does), which builds the horovod image for its Horovod wheel"


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


# Adam (its moments are what a resume must restore) at a learning rate where losing them shows by far, with a
# warmup and a cosine schedule, which the resumed run must continue where it stopped.
RESUME = [*STEPS, "--lr", "0.01", "--max-steps", "6", "--warmup-steps", "2", "--lr-schedule", "cosine"]


@pytest.fixture(scope="module")
def horovod_whole_and_stopped(tmp_path_factory):
    """The uninterrupted run's losses, and a run stopped after step 2 (its checkpoint): run once, the stopped
    one copied for each resume below."""
    whole, stopped = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("stopped")
    ok(horovodrun(HOROVOD_TF, whole, 2, *RESUME))
    ok(horovodrun(HOROVOD_TF, stopped, 2, *RESUME, "--stop-at-step", "2"))
    assert read_metrics(stopped)["last_step"] == 2
    assert (stopped / "checkpoints" / "step_00000002" / "meta.json").exists()
    return losses(read_metrics(whole)), stopped


@pytest.mark.parametrize("defect", [None, "resume-fresh-optimizer"])
def test_horovod_resume_continues_the_same_curve(horovod_whole_and_stopped, tmp_path, defect):
    """Stopped after step 2 and resumed, the ranks end on the uninterrupted curve, to the bit; a resume that
    restores the weights but not the optimizer state must fail that comparison by far."""
    straight, stopped = horovod_whole_and_stopped
    split = tmp_path / "split"
    shutil.copytree(stopped, split)
    result = horovodrun(HOROVOD_TF, split, 2, *RESUME, **fault(defect))
    ok(result)
    assert "resumed from" in result.stdout and "(step 2)" in result.stdout
    metrics = read_metrics(split)
    assert metrics["resumed_from_step"] == 2 and [r["step"] for r in metrics["history"]] == [1, 2, 3, 4, 5, 6]
    resumed = losses(metrics)
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
    from support.cluster import sbatch_recipe, unlabelled

    code, state, log = sbatch_recipe(slurm_cluster, tmp_path, "horovod", "-N", "2", "--ntasks-per-node", "1",
                                     recipe_args=STEPS, PYTHON=str(TF_PYTHON), HOROVOD_CONTROLLER="mpi",
                                     SLURM_MPI_TYPE="none")
    assert code != 0 and state == "FAILED", log
    errors = {line for line in unlabelled(log).splitlines() if line.startswith("[horovod] error:")}
    assert errors == {"[horovod] error: this process joined a world of 1 rank(s), but the job launched 2 "
                      "(HPCML_EXPECTED_WORLD_SIZE): the launcher started the ranks as independent trainings; "
                      "check the launch command (torchrun/accelerate/deepspeed options; srun --mpi for MPI) against the allocation"}, log
    assert not re.search(r"^\[horovod\] step ", unlabelled(log), re.M) and "Traceback" not in log, log
