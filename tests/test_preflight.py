"""slurm/preflight.sh: the login-node check of a submission, run for real on the batch files (bare runtime,
Shifter through the local stand-in, NERSC's podman-hpc as a normal user; the launcher's own checks are
tested in tests/test_launch.py).

It must take the layout from the file's #SBATCH lines (or -N/-n), run every check the job would run before
starting ranks, and answer 0, or 2 with one line, in seconds, without creating a run directory.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.cluster import pipe_image_to_user, shifter_pull
from support.runs import container_env, recipe_env, REPO, run

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


@pytest.mark.containers
def test_when_podman_hpc_itself_fails_the_preflight_says_so_not_that_the_image_is_missing(podman_hpc_user, tmp_path):
    """podman-hpc that cannot list its images (here: a site config whose podman is /usr/bin/false; in a CI
    run: a shared-run container left behind, "invalid internal status", which podman-hpc's default log level
    silences) is one line naming that failure and how to inspect it; before, the preflight called the image
    missing and suggested `podman-hpc migrate`, which fails the same way."""
    user = podman_hpc_user
    work = user.work_dir(tmp_path)
    site = Path(user.env["PODMANHPC_CONFIG_FILE"]).read_text()
    broken = work / "podman_hpc.yaml"
    broken.write_text(re.sub(r"(?m)^podman_bin: .*$", 'podman_bin: "/usr/bin/false"', site))
    result = user.run(["bash", "slurm/preflight.sh", "slurm/ddp.sh"], timeout=300,
                      env={"CONTAINER_RUNTIME": "podman-hpc", "CONTAINER_IMAGE": "hpcml/ddp:cpu", "RUN_DIR": str(work / "run"),
                           "PODMANHPC_CONFIG_FILE": str(broken)})
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"launch: error: podman-hpc images failed on {socket.gethostname()} (exit 1, no message): podman-hpc itself fails"
        " on this node, and every rank would; 'podman-hpc ps -a' shows containers left behind, 'podman-hpc system"
        " migrate' resets its state"], result.stderr
    assert not (work / "run").exists()


@pytest.mark.containers
def test_under_podman_hpc_the_image_must_be_in_the_squashed_store(ddp_image, base_image, squashed_images, tmp_path):
    """As a user on a login node, with NERSC's podman-hpc: an image in the squashed store ($SCRATCH/storage,
    all a compute node sees) passes, although `podman-hpc image exists` says it is not there (it never looks
    in that store: the check answered exit 2 for every squashed image before); an image only in the login
    node's local store is refused with the command that squashes it; an image without the recipe's
    framework is refused in one line, not with Python's traceback."""
    user = squashed_images("ddp", "base")  # (no other test loads them into the local store meanwhile)
    # podman-hpc's blind spot (the full name: a short one also matches any registry's copy in the local store)
    assert user.run(["podman-hpc", "image", "exists", "localhost/hpcml/ddp:cpu"]).returncode == 1
    work = user.work_dir(tmp_path)
    check = {"CONTAINER_RUNTIME": "podman-hpc", "RUN_DIR": str(work / "run")}

    def preflight_as_user(image: str):
        return user.run(["bash", "slurm/preflight.sh", "slurm/ddp.sh"], env={**check, "CONTAINER_IMAGE": image}, timeout=300)

    result = preflight_as_user("hpcml/ddp:cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ddp] preflight: options fit world size 8" in result.stdout and "launch: preflight passed" in result.stdout

    wrong = preflight_as_user("hpcml/base:cpu")  # squashed, but no torch in it
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        "launch: error: recipes/ddp/train.py cannot import torch in the image hpcml/base:cpu: run it in the ddp image"
        " (make pull-ddp ENGINE=podman-hpc REGISTRY=..., or CONTAINER_IMAGE=...)"], wrong.stderr

    # Only in the local store (what a build or a plain `podman pull` leaves on the login node).
    local_only = "localhost/hpcml-local-only/ddp:cpu"
    assert run(["podman", "tag", "localhost/hpcml/base:cpu", local_only], env=container_env()).returncode == 0
    try:
        pipe_image_to_user(user, local_only, "podman-hpc", "load")
        refused = preflight_as_user(local_only)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
            f"launch: error: image '{local_only}' is not in podman-hpc's squashed store ({user.home}/scratch/storage), the"
            f" only one compute nodes see: make pull-ddp ENGINE=podman-hpc REGISTRY=..., or podman-hpc migrate {local_only}"
        ], refused.stderr
    finally:
        user.run(["podman-hpc", "rmi", local_only], timeout=120)
        run(["podman", "rmi", local_only], env=container_env())
    assert not (work / "run").exists()


def test_a_bare_python_without_the_framework_is_one_line(tmp_path):
    """CONTAINER_RUNTIME=none with an interpreter that lacks torch (Debian's own python3 here): one line that
    names the interpreter and the fix, exit 2, instead of Python's ModuleNotFoundError traceback."""
    env = recipe_env(CONTAINER_RUNTIME="none", PYTHON="/usr/bin/python3", RUN_DIR=str(tmp_path / "run"))
    result = subprocess.run(["bash", str(PREFLIGHT), "slurm/ddp.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("launch: error: recipes/ddp/train.py cannot import torch with PYTHON=/usr/bin/python3 "
                               "(/usr/bin/python3) on "), lines[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_a_bare_python_the_user_cannot_run_is_one_line(cluster_user, tmp_path):
    """As a normal user, CONTAINER_RUNTIME=none with an interpreter only root can reach (a venv's Python under
    root's home, as root's own venvs are here; made here as a link in a directory of mode 700) or one that is
    not there: one line naming it and the fix, exit 2, before any rank would fail with "Permission denied"."""
    private = Path(tempfile.mkdtemp(prefix="hpcml-root-only-"))  # mode 700, root's
    (private / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # (this venv's Python)
    (private / "python").chmod(0o755)
    work = cluster_user.work_dir(tmp_path)
    try:
        for python in (private / "python", work / "no-venv" / "bin" / "python"):
            result = cluster_user.run(["bash", "slurm/preflight.sh", "slurm/ddp.sh"], timeout=60, env={
                "CONTAINER_RUNTIME": "none", "PYTHON": str(python), "RUN_DIR": str(work / "run")})
            assert result.returncode == 2 and result.stderr.strip().splitlines() == [
                f"launch: error: PYTHON={python} is not an interpreter {cluster_user.name} can run on {socket.gethostname()}:"
                " use a Python environment every user of the compute nodes can read (make site-env builds one), or run"
                " in the image (CONTAINER_RUNTIME=shifter, podman-hpc or podman)"], result.stdout + result.stderr
        # the control: root's own check of the same interpreter passes this line (root can reach it)
        result = subprocess.run(["bash", str(PREFLIGHT), "slurm/ddp.sh"], cwd=REPO, capture_output=True, text=True,
                                timeout=120, env=recipe_env(CONTAINER_RUNTIME="none", PYTHON=str(private / "python"),
                                                            RUN_DIR=str(tmp_path / "run")))
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        shutil.rmtree(private)
    assert not (work / "run").exists()


def test_a_run_directory_the_user_cannot_write_is_refused_as_a_permission_error(cluster_user, tmp_path):
    """As a normal user (root can write anywhere, so only a user's check shows this): a RUN_DIR in a
    directory they do not own is refused before anything starts, with the path and what to do."""
    for run_dir in ("/root/hpcml-run", "/opt/hpcml-run"):  # root's home (mode 700); a system directory (755)
        result = cluster_user.run(["bash", "slurm/preflight.sh", "slurm/ddp.sh"],
                                  env={"CONTAINER_RUNTIME": "none", "RUN_DIR": run_dir}, timeout=60)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            f"launch: error: cannot write to the run directory RUN_DIR={run_dir}: choose one you own (e.g. under $SCRATCH)"
        ], result.stdout + result.stderr
        assert not Path(run_dir).exists()
