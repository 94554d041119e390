"""Shared fixtures: paths, a subprocess helper, free ports, and the local Slurm cluster."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


def read_metrics(out_dir: Path) -> dict:
    return json.loads((out_dir / "metrics.json").read_text())


def losses(metrics: dict) -> list[float]:
    return [record["loss"] for record in metrics["history"]]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """The local Slurm cluster (started if needed, left running for the next test session; `make cluster-stop`).

    Needs root. A machine where it cannot start fails the tests that use it: it is never skipped.
    """
    result = run(["bash", str(CLUSTER_SCRIPT), "start", str(CLUSTER_NODES)], timeout=600)
    assert result.returncode == 0, f"local Slurm cluster did not start:\n{result.stdout}\n{result.stderr}"
    return {"SLURM_CONF": str(CLUSTER_DIR / "etc" / "slurm.conf")}
