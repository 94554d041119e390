"""Running a recipe as the tests do: one process, torchrun, accelerate, Horovod; its environment; faults."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DDP_RECIPE = REPO / "recipes" / "ddp" / "train.py"


# Small and fast on 2 CPU cores; every run in the tests uses these unless it says otherwise.
# This machine has no GPU, and the local cluster's nodes declare Perlmutter's 4 GPUs per node with placeholder
# device files: a job that Slurm gave GPUs would refuse to train on the CPU (recipes/harness/launch.py:
# check_gpus_visible), and slurm/preflight.sh refuses a CPU PyTorch for a file that asks for GPUs. The tests
# say so, as a user would for a debugging run on the CPU; a test of the refusal sets it to "".
PLACEHOLDER_GPUS = {"HPCML_ALLOW_CPU": "1"}

TINY = ["--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--log-every", "1"]


# Rendezvous ports for the tests' own launches: below the kernel's ephemeral range (32768-60999), where an
# outgoing connection of another test (gloo opens hundreds) cannot take the port between this check and
# the launcher's bind, and a block of its own per test worker; the local cluster's jobs use 29500 + job id.
_PORTS_PER_WORKER = 800
_next_port = [0]


def free_port() -> int:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = 20000 + (worker % 11) * _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = first + (os.getpid() + _next_port[0]) % _PORTS_PER_WORKER
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:  # taken, or in TIME_WAIT from an earlier launch
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + _PORTS_PER_WORKER - 1}")


def recipe_env(**extra: str) -> dict[str, str]:
    """Environment for recipe subprocesses: this interpreter first on PATH, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **PLACEHOLDER_GPUS)
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def run_single(out_dir: Path, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """The recipe as one plain process: the reference. ``env``: e.g. HPCML_TEST_FAULT=NAME (a negative control,
    recipes/harness/faults.py)."""
    return run([sys.executable, str(DDP_RECIPE), "--out-dir", str(out_dir), *TINY, *args], env=recipe_env(**env),
               timeout=timeout)


def run_torchrun(out_dir: Path, nproc: int, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(DDP_RECIPE), "--out-dir", str(out_dir), *TINY, *args]
    return run(cmd, env=recipe_env(**env), timeout=timeout)


def fault(name: str | None) -> dict[str, str]:
    """The environment that switches on the negative control ``name`` (None: none) in a recipe."""
    return {"HPCML_TEST_FAULT": name} if name else {}


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


# --eval-every 2 --eval-batches 2: the validation loss after every second step (and the last), averaged over
# the data-parallel ranks; parity tests compare it with one process's as they compare the training loss.
EVAL = ["--eval-every", "2", "--eval-batches", "2"]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def container_env(**extra: str) -> dict[str, str]:
    """recipe_env plus the podman settings containers/images.sh uses (runc, explicit ulimits) where it would."""
    env = recipe_env(**extra)
    if "CONTAINERS_CONF" not in env and shutil.which("runc"):
        env["CONTAINERS_CONF"] = str(REPO / "containers" / "podman" / "containers.conf")
    return env




def accelerate_launch(recipe: Path, out_dir: Path, nproc: int, *args: str,
                      launcher_args: tuple[str, ...] = ("--multi_gpu",), **env: str) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu`` (what slurm/accelerate.sh runs on each node), ``nproc`` gloo ranks here."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args, "--num_machines", "1",
           "--num_processes", str(nproc), "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           str(recipe), "--out-dir", str(out_dir), *args]
    return run(cmd, env=recipe_env(**env), timeout=300)


# ---- the TensorFlow recipes and horovod.torch: in .venv-tf (`make venv-tf`), whose Horovod the horovod image built

VENV_TF = REPO / ".venv-tf"
TF_PYTHON = VENV_TF / "bin" / "python"


def tf_env(**extra: str) -> dict[str, str]:
    env = recipe_env(**extra)
    env["PATH"] = f"{VENV_TF / 'bin'}:{env['PATH']}"  # horovodrun and mpiexec start `python` from here
    return env


def tf_single(recipe: Path, out_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return run([str(TF_PYTHON), str(recipe), "--out-dir", str(out_dir), *args], env=tf_env(**env), timeout=300)


def horovodrun(recipe: Path, out_dir: Path, nproc: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Horovod's own launcher, its gloo controller."""
    cmd = [str(VENV_TF / "bin" / "horovodrun"), "--gloo", "-np", str(nproc), "-H", f"localhost:{nproc}",
           "-p", str(free_port()), "python", str(recipe), "--out-dir", str(out_dir), *args]
    return run(cmd, env=tf_env(HPCML_EXPECTED_WORLD_SIZE=str(nproc), **env), timeout=300)


def mpiexec(recipe: Path, out_dir: Path, nproc: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    """MPICH's mpiexec: Horovod's MPI controller."""
    cmd = [str(VENV_TF / "bin" / "mpiexec"), "-n", str(nproc), "python", str(recipe), "--out-dir", str(out_dir), *args]
    return run(cmd, env=tf_env(HPCML_EXPECTED_WORLD_SIZE=str(nproc), **env), timeout=300)
