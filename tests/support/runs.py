"""Running a recipe as the tests do: one process, torchrun, accelerate, Horovod; its environment; faults."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
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


# ---- the tests' own launches of a recipe on this machine: forked from a parent that imported the frameworks once
# (support/forkserver.py), or, with HPCML_TEST_LAUNCH=real, fresh interpreters under the real torchrun.

FORK = os.environ.get("HPCML_TEST_LAUNCH", "fork") != "real"


class ForkServer:
    """This test worker's fork server, started on first use and ended with the worker (its stdin closes)."""

    _server: "ForkServer | None" = None

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="hpcml-forkserver-"))
        self.socket, self.log = self.dir / "socket", self.dir / "server.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")), str(self.socket)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=recipe_env(),
                                            cwd=REPO)
        ready = self.process.stdout.readline()
        assert ready == b"ready\n", f"the fork server did not start: {self.log.read_text()[-3000:]}"

    @classmethod
    def get(cls) -> "ForkServer":
        if cls._server is None or cls._server.process.poll() is not None:
            cls._server = cls()
        return cls._server

    def run(self, script: Path, args: list[str], envs: list[dict[str, str]], timeout: float,
            cwd: Path | None = None, check_env: bool = True) -> subprocess.CompletedProcess:
        """``script ARGS`` in len(envs) processes (one per environment), like subprocess.run(capture_output=True,
        text=True, stdin=DEVNULL): the exit code of the one process, or torchrun's for a rank set (1 when any
        rank failed). A setting that the parent's libraries read when they loaded cannot change in a child:
        asking for another is refused (launch it for real)."""
        for env in envs if check_env else []:
            threads = env.get("OMP_NUM_THREADS")
            assert threads == "1", (f"OMP_NUM_THREADS={threads} cannot reach a forked process (OpenMP read 1 when the "
                                    "fork server loaded torch): launch this run with real=True")
        cmd = ["forked", str(script), *args]
        request = json.dumps({"script": str(script), "args": list(args), "env": envs, "cwd": str(cwd or Path.cwd())}).encode()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            for stream in (out, err):  # appended to by every rank at once, as torchrun's ranks share its streams
                fcntl.fcntl(stream.fileno(), fcntl.F_SETFL, fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) | os.O_APPEND)
            conn.connect(str(self.socket))
            socket.send_fds(conn, [struct.pack("!Q", len(request)) + request], [out.fileno(), err.fileno()])
            replies = conn.makefile("rb")
            deadline = time.monotonic() + timeout
            conn.settimeout(60)
            started = json.loads(replies.readline())

            def text(stream) -> str:
                stream.seek(0)
                return stream.read().decode(errors="replace")
            try:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                line = replies.readline()
            except TimeoutError:
                line = b""
            if not line:
                try:  # the time is up (or the server went): kill the ranks, as subprocess.run does
                    os.killpg(started["pgid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                assert time.monotonic() >= deadline - 1, f"the fork server went away: {self.log.read_text()[-3000:]}"
                raise subprocess.TimeoutExpired(cmd, timeout, output=text(out), stderr=text(err))
            codes = json.loads(line)["exit"]
            stdout, stderr = text(out), text(err)
        if len(codes) == 1:
            return subprocess.CompletedProcess(cmd, codes[0], stdout, stderr)
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        stderr += "".join(f"forked rank {rank} failed: exitcode  : {code}\n" for rank, code in failed)
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, stdout, stderr)


def torchrun_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun --standalone-like single-node launches give rank ``rank`` (its agent's store left out: rank 0
    hosts the rendezvous store, as it does under srun)."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}


def python(script: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
           cwd: Path | None = None, real: bool = False) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` with this interpreter (forked, unless ``real`` or HPCML_TEST_LAUNCH=real)."""
    env = recipe_env() if env is None else env
    if FORK and not real:
        return ForkServer.get().run(script, list(args), [env], timeout, cwd)
    return run([sys.executable, str(script), *args], env=env, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)


def torchrun(script: Path, nproc: int, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
             real: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=NPROC SCRIPT ARGS`` on this machine (forked ranks unless ``real`` or
    HPCML_TEST_LAUNCH=real; ``real``: the tests of what torchrun itself does)."""
    env, port = recipe_env() if env is None else env, free_port()
    if FORK and not real:
        return ForkServer.get().run(script, list(args), [torchrun_env(env, rank, nproc, port) for rank in range(nproc)],
                                    timeout)
    return run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                f"--master_port={port}", str(script), *args], env=env, timeout=timeout)


def run_single(out_dir: Path, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """The recipe as one plain process: the reference. ``env``: e.g. HPCML_TEST_FAULT=NAME (a negative control,
    recipes/harness/faults.py)."""
    return python(DDP_RECIPE, "--out-dir", str(out_dir), *TINY, *args, env=recipe_env(**env), timeout=timeout)


def run_torchrun(out_dir: Path, nproc: int, *args: str, timeout: float = 300, real: bool = False,
                 **env: str) -> subprocess.CompletedProcess:
    return torchrun(DDP_RECIPE, nproc, "--out-dir", str(out_dir), *TINY, *args, env=recipe_env(**env), timeout=timeout,
                    real=real)


def fault(name: str | None) -> dict[str, str]:
    """The environment that switches on the negative control ``name`` (None: none) in a recipe."""
    return {"HPCML_TEST_FAULT": name} if name else {}


def run_recipe(recipe: Path, out_dir: Path, nproc: int, *args: str, timeout: float = 300, real: bool = False, **env: str):
    """``recipe`` as one plain process (nproc 1) or under torchrun with ``nproc`` ranks on this machine (forked
    unless ``real``)."""
    if nproc == 1:
        return python(recipe, "--out-dir", str(out_dir), *args, env=recipe_env(**env), timeout=timeout, real=real)
    return torchrun(recipe, nproc, "--out-dir", str(out_dir), *args, env=recipe_env(**env), timeout=timeout, real=real)


def assert_preflight_refuses(recipe: Path, out_dir: Path, world: int, args: list[str], message: str) -> None:
    """``recipe --preflight WORLD`` (what slurm/lib/launch.sh runs before any rank starts) must answer exit 2
    and one line, "[<recipe>] error: ...", containing ``message``."""
    result = python(recipe, "--out-dir", str(out_dir), *args, "--preflight", str(world), timeout=120)
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
