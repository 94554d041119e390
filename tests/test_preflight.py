"""slurm/preflight.sh: the login-node check of a submission, run for real on the batch files (bare runtime,
and Shifter through the local stand-in; the launcher's own checks are tested in tests/test_launch.py).

It must take the layout from the file's #SBATCH lines (or -N/-n), run every check the job would run before
starting ranks, and answer 0, or 2 with one line, in seconds, without creating a run directory.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, ddp_image, recipe_env, shifter_pull  # noqa: F401 (ddp_image: a fixture)

PREFLIGHT = REPO / "slurm" / "preflight.sh"


def preflight(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = recipe_env(CONTAINER_RUNTIME="none", PYTHON=sys.executable, RUN_DIR=str(tmp_path / "run"))
    return subprocess.run(["bash", str(PREFLIGHT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_layout_comes_from_the_files_sbatch_lines(tmp_path):
    result = preflight(tmp_path, "slurm/ddp.sh")
    assert result.returncode == 0, result.stderr
    assert "slurm/ddp.sh on 2 node(s) x 4 task(s), 4 GPU(s) per node" in result.stdout
    assert "[ddp] preflight: options fit world size 8" in result.stdout
    assert "launch: preflight passed" in result.stdout
    assert not (tmp_path / "run").exists()


def test_command_line_layout_wins(tmp_path):
    result = preflight(tmp_path, "-N", "4", "-n", "2", "slurm/fsdp_tp_pp.sh", "--pp", "2")
    assert result.returncode == 0, result.stderr
    assert "[fsdp_tp_pp] preflight: pp 2 x dp_replicate 1 x dp_shard 2 x tp 2 = 8 ranks" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["slurm/ddp.sh", "--global-batch", "10"], "[ddp] error: --global-batch 10 is not divisible by the world size 8"),
    (["-N", "3", "slurm/fsdp_tp_pp.sh", "--pp", "2"], "[fsdp_tp_pp] error: world size 12 is not divisible by"),
    (["-N", "0", "slurm/ddp.sh"], "preflight: error: '0' is not a positive count"),
    (["slurm/no_such_recipe.sh"], "preflight: error: slurm/no_such_recipe.sh not found"),
])
def test_a_bad_submission_is_one_line_and_exit_2(tmp_path, args, message):
    result = preflight(tmp_path, *args)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def shifter_ddp(ddp_image):
    shifter_pull("ddp")


@pytest.mark.containers
@pytest.mark.parametrize("image_given", ["directive", "option"])
def test_under_shifter_the_check_gets_the_image_as_the_job_would(shifter_ddp, cluster_user, tmp_path, image_given):
    """As a user on a login node, with the Shifter stand-in: the image named by '#SBATCH --image' or -i is
    resolved to its ID with type "id", as Shifter's plugin does at submission, so the recipe's own check
    runs in the image (a bare `shifter` takes an image from the environment only when both are set)."""
    work = cluster_user.work_dir(tmp_path)
    sbatch_file, args = "slurm/ddp.sh", ["-i", "docker:hpcml/ddp:cpu"]
    if image_given == "directive":
        sbatch_file = str(work / "ddp.sh")
        text = (REPO / "slurm" / "ddp.sh").read_text()
        (work / "ddp.sh").write_text(text.replace("#SBATCH -J ddp\n", "#SBATCH -J ddp\n#SBATCH --image=docker:hpcml/ddp:cpu\n"))
        args = []
    result = cluster_user.run(["bash", "slurm/preflight.sh", *args, sbatch_file],
                              env={"CONTAINER_RUNTIME": "shifter", "RUN_DIR": str(work / "run")}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"image=docker:hpcml/ddp:cpu id:[0-9a-f]{64} \(from the job's --image\)", result.stdout), result.stdout
    assert "[ddp] preflight: options fit world size 8" in result.stdout
    missing = cluster_user.run(["bash", "slurm/preflight.sh", "-i", "docker:hpcml/no-such:cpu", "slurm/ddp.sh"],
                               env={"CONTAINER_RUNTIME": "shifter", "RUN_DIR": str(work / "run")}, timeout=120)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "preflight: error: Shifter's image gateway has no hpcml/no-such:cpu: shifterimg pull docker:hpcml/no-such:cpu"
        " (sbatch would refuse the job)"], missing.stderr
    assert not (work / "run").exists()
