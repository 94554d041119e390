"""Shared fixtures: paths, a subprocess helper, free ports, and the local Slurm cluster."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DDP_RECIPE = REPO / "recipes" / "ddp" / "train.py"
CLUSTER_SCRIPT = REPO / "tests" / "cluster" / "local_slurm.sh"
CLUSTER_DIR = Path(os.environ.get("LOCAL_SLURM_DIR", "/tmp/hpcml-slurm"))
CLUSTER_NODES = 4

# Small and fast on 2 CPU cores; every run in the tests uses these unless it says otherwise.
TINY = ["--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--log-every", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_env(**extra: str) -> dict[str, str]:
    """Environment for recipe subprocesses: this interpreter first on PATH, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def run_single(out_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The recipe as one plain process: the reference."""
    return run([sys.executable, str(DDP_RECIPE), "--out-dir", str(out_dir), *TINY, *args], env=recipe_env(), timeout=timeout)


def run_torchrun(out_dir: Path, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(DDP_RECIPE), "--out-dir", str(out_dir), *TINY, *args]
    return run(cmd, env=recipe_env(), timeout=timeout)


def run_recipe(recipe: Path, out_dir: Path, nproc: int, *args: str, timeout: float = 300, **env: str):
    """``recipe`` as one plain process (nproc 1) or under torchrun with ``nproc`` ranks on this machine."""
    cmd = [sys.executable, str(recipe)] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", str(recipe)]
    return run([*cmd, "--out-dir", str(out_dir), *args], env=recipe_env(**env), timeout=timeout)


def assert_preflight_refuses(recipe: Path, out_dir: Path, world: int, args: list[str], message: str) -> None:
    """``recipe --preflight WORLD`` (what slurm/lib/launch.sh runs before any rank starts) must answer exit 2
    and one line, "[<recipe>] error: ...", containing ``message``."""
    result = run([sys.executable, str(recipe), "--out-dir", str(out_dir), *args, "--preflight", str(world)],
                 env=recipe_env(), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"[{recipe.parent.name}] error: ") and message in lines[0], lines[0]


def read_metrics(out_dir: Path) -> dict:
    return json.loads((out_dir / "metrics.json").read_text())


def losses(metrics: dict) -> list[float]:
    return [record["loss"] for record in metrics["history"]]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    """Largest per-step relative difference of two loss curves of the same length."""
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """The local Slurm cluster (started if needed, left running for the next test session; `make cluster-stop`).

    Needs root. A machine where it cannot start fails the tests that use it: it is never skipped.
    """
    result = run(["bash", str(CLUSTER_SCRIPT), "start", str(CLUSTER_NODES)], timeout=600)
    assert result.returncode == 0, f"local Slurm cluster did not start:\n{result.stdout}\n{result.stderr}"
    # The start lock comes free (the other test worker may hold it a moment for its own start): had a
    # daemon inherited it, that worker would wait forever.
    free = run(["flock", "-w", "60", f"{CLUSTER_DIR}.lock", "true"], timeout=90)
    assert free.returncode == 0, f"{CLUSTER_DIR}.lock is still held 60 s after the cluster started (fuser -v shows by whom)"
    return {"SLURM_CONF": str(CLUSTER_DIR / "etc" / "slurm.conf")}


def container_env(**extra: str) -> dict[str, str]:
    """recipe_env plus the podman settings containers/images.sh uses (runc, explicit ulimits) where it would."""
    env = recipe_env(**extra)
    if "CONTAINERS_CONF" not in env and shutil.which("runc"):
        env["CONTAINERS_CONF"] = str(REPO / "containers" / "podman" / "containers.conf")
    return env


def sbatch_recipe(cluster: dict, tmp_path: Path, recipe: str, *options: str, recipe_args: list[str],
                  **env: str) -> tuple[int, str, str]:
    """Submit slurm/<recipe>.sh from the repository root and wait; returns (exit code, job state, log text).

    Runtime "none" unless env says otherwise; the run directory is tmp_path/run. Judged by `sbatch --wait`'s
    exit code and by the final state Slurm recorded (jobcomp), since `sbatch --wait` alone reports 0 for a
    job cancelled before it ran.
    """
    code, job_id = submit_recipe(cluster, tmp_path, recipe, "--wait", *options, recipe_args=recipe_args, **env)
    log = tmp_path / f"{recipe}-{job_id}.out"
    return code, job_state(job_id), log.read_text() if log.exists() else ""


def submit_recipe(cluster: dict, tmp_path: Path, recipe: str, *options: str, recipe_args: list[str],
                  **env: str) -> tuple[int, str]:
    """sbatch slurm/<recipe>.sh (add "--wait" to options to wait); returns (sbatch's exit code, job id)."""
    run_env = container_env(**{**cluster, "CONTAINER_RUNTIME": "none", "RUN_DIR": str(tmp_path / "run"), **env})
    # A 5-minute limit (options may set another): a job that hangs ends as TIMEOUT and frees its nodes
    # for the next test, well before this call gives up waiting on it.
    result = run(["sbatch", "--parsable", "-t", "5", "-o", str(tmp_path / "%x-%j.out"), *options,
                  str(REPO / "slurm" / f"{recipe}.sh"), *recipe_args], env=run_env, cwd=REPO, timeout=420)
    job_id = result.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch did not submit:\n{result.stdout}\n{result.stderr}"
    return result.returncode, job_id


def job_records(job_id: str, timeout: float = 15) -> list[str]:
    """Slurm's job-completion records of a job (one per run: a requeued job has several), waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = [line for line in (CLUSTER_DIR / "jobcomp.txt").read_text().splitlines()
                   if line.startswith(f"JobId={job_id} ")]
        if records:
            return records
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never reached a final state in jobcomp.txt")


def job_state(job_id: str) -> str:
    return re.search(r"JobState=(\S+)", job_records(job_id)[-1]).group(1)  # the last run's


def job_nodes(job_id: str, run_index: int = 0) -> list[str]:
    """The nodes Slurm itself recorded for a run of the job (jobcomp's NodeList, expanded by scontrol).

    Evidence from outside the run: the tests compare what a recipe reports against it, and never assume
    which nodes a job gets (another test's job may hold the first ones)."""
    nodelist = re.search(r"NodeList=(\S+)", job_records(job_id)[run_index]).group(1)
    result = run(["scontrol", "show", "hostnames", nodelist], env={**os.environ, "SLURM_CONF": str(CLUSTER_DIR / "etc" / "slurm.conf")})
    assert result.returncode == 0 and result.stdout.split(), f"scontrol show hostnames {nodelist}: {result.stderr}"
    return result.stdout.split()


def build_images(*images: str) -> None:
    """Build the cpu flavor of the images (from cache when unchanged). A failed build fails the test.

    Call it from a fixture (below), not from a test's body: the per-test timeout counts only the test's
    own call (pyproject.toml: timeout_func_only), and a cold build of the horovod image takes ~10 minutes.
    Concurrent builds (pytest-xdist workers) wait for each other: containers/images.sh takes a lock."""
    result = run(["bash", str(REPO / "containers" / "images.sh"), "build", *images],
                 env=container_env(FLAVOR="cpu"), timeout=3600)
    assert result.returncode == 0, f"image build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"


def image_fixture(*images: str):
    """A session fixture that builds these cpu images (once per test process) and returns their names."""
    @pytest.fixture(scope="session")
    def built() -> list[str]:
        build_images(*images)
        return [f"hpcml/{image}:cpu" for image in images]
    return built


base_image = image_fixture("base")
ddp_image = image_fixture("ddp")
accelerate_image = image_fixture("accelerate")
