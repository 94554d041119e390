"""Shared fixtures: paths, a subprocess helper, free ports, and the local Slurm cluster."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
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
SHIFTER_STAND_IN = Path("tests") / "cluster" / "shifter"  # shifter, shifterimg (relative to a checkout)
SHIFTER_GATEWAY = CLUSTER_DIR / "shifter"
CLUSTER_USER = "hpcml-user"  # jobs run as this normal user where Perlmutter would run them as the user

# Small and fast on 2 CPU cores; every run in the tests uses these unless it says otherwise.
# This machine has no GPU, and the local cluster's nodes declare Perlmutter's 4 GPUs per node with placeholder
# device files: a job that Slurm gave GPUs would refuse to train on the CPU (recipes/harness/launch.py:
# check_gpus_visible), and slurm/preflight.sh refuses a CPU PyTorch for a file that asks for GPUs. The tests
# say so, as a user would for a debugging run on the CPU; a test of the refusal sets it to "".
PLACEHOLDER_GPUS = {"HPCML_ALLOW_CPU": "1"}

TINY = ["--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--log-every", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def read_metrics(out_dir: Path) -> dict:
    return json.loads((out_dir / "metrics.json").read_text())


def losses(metrics: dict) -> list[float]:
    return [record["loss"] for record in metrics["history"]]


def grad_norms(metrics: dict) -> list[float]:
    """The global gradient norm of every step (before clipping), as the recipes log it."""
    return [record["grad_norm"] for record in metrics["history"]]


# --eval-every 2 --eval-batches 2: the validation loss after every second step (and the last), averaged over
# the data-parallel ranks; parity tests compare it with one process's as they compare the training loss.
EVAL = ["--eval-every", "2", "--eval-batches", "2"]


def eval_losses(metrics: dict) -> list[float]:
    """The validation losses of a run (--eval-every), in step order."""
    return [record["eval_loss"] for record in metrics["history"] if "eval_loss" in record]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    """Largest per-step relative difference of two loss curves of the same length; infinite where either
    is not a finite number (max() skips a NaN it meets after the first element: a curve that went NaN
    midway would pass a parity check)."""
    assert len(a) == len(b) and a, (a, b)
    if not all(math.isfinite(x) for x in (*a, *b)):
        return math.inf
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# Every parity check: a distributed run against one process on the same data and weights, per step, relative
# (float32 sums in another order differ by ~1e-7; a wrong gradient scale by 1e-3 and more).
PARITY_RTOL = 1e-5
CONTROL_MARGIN = 100  # a negative control must miss its check's tolerance by this factor at least
MARGINS_FILE_ENV = "HPCML_TEST_MARGINS"  # set: every control's measured margin is appended there (JSON lines)


def caught(difference: float, tolerance: float) -> bool:
    """A negative control's run differs from the right one by more than CONTROL_MARGIN x ``tolerance``. The
    margin (difference / tolerance) goes to $HPCML_TEST_MARGINS, when set, with the test that measured it."""
    if os.environ.get(MARGINS_FILE_ENV):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(os.environ[MARGINS_FILE_ENV], "a") as out:
            out.write(json.dumps({"test": test, "difference": difference, "tolerance": tolerance,
                                  "margin": difference / tolerance}) + "\n")
    return difference > CONTROL_MARGIN * tolerance


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


RANK_LABEL = re.compile(r"^ *\d+: ", re.M)  # srun --label (slurm/lib/runtime.sh): " 9: [ddp] step ..."


def unlabelled(log: str) -> str:
    """A job log without srun's rank labels, for reading what the ranks said."""
    return RANK_LABEL.sub("", log)


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
    return {"SLURM_CONF": str(CLUSTER_DIR / "etc" / "slurm.conf"), **PLACEHOLDER_GPUS}



def container_env(**extra: str) -> dict[str, str]:
    """recipe_env plus the podman settings containers/images.sh uses (runc, explicit ulimits) where it would."""
    env = recipe_env(**extra)
    if "CONTAINERS_CONF" not in env and shutil.which("runc"):
        env["CONTAINERS_CONF"] = str(REPO / "containers" / "podman" / "containers.conf")
    return env


def sbatch_recipe(cluster: dict, tmp_path: Path, recipe: str, *options: str, recipe_args: list[str],
                  user: "ClusterUser | None" = None, **env: str) -> tuple[int, str, str]:
    """Submit slurm/<recipe>.sh from the repository root and wait; returns (exit code, job state, log text).

    Runtime "none" unless env says otherwise; the run directory is tmp_path/run. Judged by `sbatch --wait`'s
    exit code and by the final state Slurm recorded (jobcomp), since `sbatch --wait` alone reports 0 for a
    job cancelled before it ran.
    """
    code, job_id = submit_recipe(cluster, tmp_path, recipe, "--wait", *options, recipe_args=recipe_args, user=user, **env)
    log = tmp_path / f"{recipe}-{job_id}.out"
    return code, job_state(job_id), log.read_text() if log.exists() else ""


def submit_recipe(cluster: dict, tmp_path: Path, recipe: str, *options: str, recipe_args: list[str],
                  user: "ClusterUser | None" = None, **env: str) -> tuple[int, str]:
    """sbatch slurm/<recipe>.sh (add "--wait" to options to wait); returns (sbatch's exit code, job id).

    With ``user``, submitted as that normal user from their own checkout (tmp_path must be theirs:
    ``user.work_dir(tmp_path)``), with their environment, not root's."""
    if user is None:
        run_env = container_env(**{**cluster, "CONTAINER_RUNTIME": "none", "RUN_DIR": str(tmp_path / "run"), **env})
        prefix, repo = [], REPO
    else:
        run_env = {**user.env, **cluster, "CONTAINER_RUNTIME": "none", "RUN_DIR": str(tmp_path / "run"), **env}
        prefix, repo = user.as_user, user.repo
    # A 5-minute limit (options may set another): a job that hangs ends as TIMEOUT and frees its nodes
    # for the next test, well before this call gives up waiting on it.
    result = run([*prefix, "sbatch", "--parsable", "-t", "5", "-o", str(tmp_path / "%x-%j.out"), *options,
                  str(repo / "slurm" / f"{recipe}.sh"), *recipe_args], env=run_env, cwd=repo, timeout=420)
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


def step_launches(job_id: str, step: int = 0) -> dict[str, int]:
    """Slurm's own record of where a job step ran, and as whom: each node's slurmd logs "launch task
    StepId=JOB.STEP request from UID:U" when it starts the step's tasks there. {node: uid}."""
    launched = {}
    for log in sorted((CLUSTER_DIR / "log").glob("slurmd-*.log")):
        match = re.search(rf"launch task StepId={job_id}\.{step} request from UID:(\d+)", log.read_text(errors="replace"))
        if match:
            launched[log.stem.removeprefix("slurmd-")] = int(match.group(1))
    return launched


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


class ClusterUser:
    """A normal user of the cluster, as every Perlmutter user is: their own checkout in their home, their
    own environment (no root venv on PATH), their own files. Jobs they submit run as them."""

    def __init__(self, name: str, repo: Path):
        import pwd
        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid, self.home, self.repo = name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir), repo
        self.as_user = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--"]
        self.env = {"HOME": str(self.home), "USER": name, "LOGNAME": name, "LANG": "C.UTF-8",
                    "PATH": f"{repo / SHIFTER_STAND_IN}:/usr/local/bin:/usr/bin:/bin",
                    "SHIFTER_GATEWAY_DIR": str(SHIFTER_GATEWAY), **PLACEHOLDER_GPUS}

    def work_dir(self, tmp_path: Path) -> Path:
        """A directory of the user's for one test (pytest's own tmp_path is root's, mode 700)."""
        work = self.home / "tests" / f"{tmp_path.parent.name}-{tmp_path.name}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        os.chown(work, self.uid, self.gid)
        return work

    def run(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("cwd", self.repo)
        return run([*self.as_user, *cmd], env={**self.env, **kwargs.pop("env", {})}, **kwargs)


def copy_checkout(destination: Path) -> None:
    """This checkout as it is (tracked and new files, uncommitted changes included; no venvs or runs) and its
    .git, so that a job log started from the copy names the commit."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    for name in filter(None, listed.stdout.split("\0")):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    shutil.copytree(REPO / ".git", destination / ".git", symlinks=True)


@pytest.fixture(scope="session")
def cluster_user() -> ClusterUser:
    """The normal user, with a fresh copy of this checkout (its tracked and new files) in their home.

    One copy per test run, shared by the test workers (pytest-xdist gives them one run id)."""
    home = Path("/home") / CLUSTER_USER
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    repo = home / "checkouts" / run_id[:12]
    with open(f"/tmp/{CLUSTER_USER}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if run(["id", "-u", CLUSTER_USER]).returncode != 0:
            created = run(["useradd", "--create-home", "--shell", "/bin/bash", CLUSTER_USER])
            assert created.returncode == 0, created.stderr
        if not (repo / ".done").exists():
            shutil.rmtree(home / "checkouts", ignore_errors=True)  # a last run's
            copy_checkout(repo)
            (repo / ".done").touch()
            owned = run(["chown", "-R", f"{CLUSTER_USER}:{CLUSTER_USER}", str(home)])
            assert owned.returncode == 0, owned.stderr
    return ClusterUser(CLUSTER_USER, repo)


SITE_ENV = Path("/opt/hpcml-env")


@pytest.fixture(scope="session")
def site_env() -> Path:
    """Both venvs for every user of the cluster (`make site-env`: built from Debian's Python, world-readable),
    as a center's software module is: what a normal user's bare jobs run (root's venvs link to an interpreter
    only root can reach here). Installed once, from pip's cache and the horovod image's wheel (minutes)."""
    with open("/tmp/hpcml-site-env.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = {key: value for key, value in container_env().items() if not key.startswith("MAKE")}
        installed = run(["make", "-C", str(REPO), "site-env", f"SITE_ENV={SITE_ENV}"], env=env, timeout=1800)
        assert installed.returncode == 0, f"make site-env:\n{installed.stdout[-4000:]}\n{installed.stderr[-4000:]}"
    return SITE_ENV


PODMAN_HPC_INSTALL = REPO / "tests" / "cluster" / "podman-hpc" / "install.sh"
PODMAN_HPC_PREFIX = Path("/opt/hpcml-podman-hpc")


@pytest.fixture(scope="session")
def podman_hpc_user(cluster_user) -> ClusterUser:
    """The normal user with NERSC's podman-hpc (tests/cluster/podman-hpc/install.sh): rootless podman, their
    squashed image store in $SCRATCH/storage, as on Perlmutter. Its SCRATCH is ~/scratch."""
    with podman_hpc_store_lock():
        installed = run(["bash", str(PODMAN_HPC_INSTALL), "install", str(PODMAN_HPC_PREFIX)], timeout=900)
        assert installed.returncode == 0, installed.stdout + installed.stderr
        cluster_user.env.update(PATH=f"{PODMAN_HPC_PREFIX / 'bin'}:{cluster_user.env['PATH']}",
                                PODMANHPC_CONFIG_FILE=str(PODMAN_HPC_PREFIX / "etc" / "podman_hpc.yaml"),
                                SCRATCH=str(cluster_user.home / "scratch"))
        configured = cluster_user.run(["bash", str(PODMAN_HPC_INSTALL), "user", str(PODMAN_HPC_PREFIX)], timeout=60)
        assert configured.returncode == 0, configured.stdout + configured.stderr
    return cluster_user


PODMAN_HPC_STORE_LOCK = f"/tmp/{CLUSTER_USER}-podman-hpc.lock"


@contextlib.contextmanager
def podman_hpc_store_lock():
    """Held while a test changes the user's podman-hpc stores: the test workers share that user, and
    podman-hpc rewrites the squashed store's images.json in place (a job starting meanwhile may read half a
    file). Jobs and checks that only read the stores hold it shared (squashed_images below)."""
    with open(PODMAN_HPC_STORE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture
def squashed_images(podman_hpc_user):
    """``squashed_images(*images)``: the cpu images in the user's squashed store (podman_hpc_migrate), which
    then stays as it is until the test ends (the lock held shared: other tests' jobs run meanwhile, their
    migrations wait). Returns the user."""
    with open(PODMAN_HPC_STORE_LOCK, "w") as lock:
        def migrated(*images: str) -> ClusterUser:
            fcntl.flock(lock, fcntl.LOCK_UN)  # (a second call: podman_hpc_migrate locks on its own)
            podman_hpc_migrate(podman_hpc_user, *images)
            fcntl.flock(lock, fcntl.LOCK_SH)
            return podman_hpc_user
        yield migrated


def podman_hpc_migrate(user: ClusterUser, *images: str) -> None:
    """The cpu images into the user's squashed store, and only there (a Perlmutter compute node sees no
    other): root's image piped into `podman-hpc load` (as the user), migrated, the local copy removed.
    Skipped for an image whose squashed copy has root's image ID already. `podman-hpc migrate` exits 0
    when it fails, so the store itself is asked afterwards (slurm/lib/squashed_image.sh)."""
    with podman_hpc_store_lock():
        for image in images:
            name = f"localhost/hpcml/{image}:cpu"
            image_id = run(["podman", "image", "inspect", "--format", "{{.Id}}", name], env=container_env()).stdout.strip()
            # (podman-hpc silences podman's own errors unless asked: --log-level)
            listed = user.run(["podman-hpc", "--log-level=error", "images", "--no-trunc", "--format",
                               "{{.ID}} {{.Repository}}:{{.Tag}} {{.ReadOnly}}"])
            assert listed.returncode == 0, f"podman-hpc images as {user.name}: {listed.stderr}"
            if re.search(rf"^(sha256:)?{image_id} {re.escape(name)} true$", listed.stdout, re.M):
                continue
            pipe_image_to_user(user, name, "podman-hpc", "load")
            for step in (["migrate", name], ["rmi", name]):
                done = user.run(["podman-hpc", *step], timeout=900)
                assert done.returncode == 0, f"podman-hpc {' '.join(step)}: {done.stdout}{done.stderr}"
            squashed = user.run(["bash", str(user.repo / "slurm" / "lib" / "squashed_image.sh"), name])
            assert squashed.returncode == 0, f"{name} is not in {user.name}'s squashed store after podman-hpc migrate"


def pipe_image_to_user(user: ClusterUser, name: str, *load: str) -> None:
    """root's image ``name`` into one of the user's stores: `podman save NAME | <as the user> LOAD...`."""
    user_env = [f"{key}={value}" for key, value in user.env.items()]
    loaded = run(["bash", "-c", 'set -o pipefail; podman save "$1" | "${@:2}"', "_", name,
                  *user.as_user, "env", "-i", *user_env, *load], env=container_env(), cwd=user.home, timeout=900)
    assert loaded.returncode == 0, f"podman save {name} | {' '.join(load)}: {loaded.stdout}{loaded.stderr}"


def podman_load_as_user(user: ClusterUser, *images: str) -> None:
    """The cpu images into the user's own rootless podman store (skipped when root's image ID is there)."""
    with open(f"/tmp/{CLUSTER_USER}-podman.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for image in images:
            name = f"localhost/hpcml/{image}:cpu"
            image_id = run(["podman", "image", "inspect", "--format", "{{.Id}}", name], env=container_env()).stdout.strip()
            theirs = user.run(["podman", "image", "inspect", "--format", "{{.Id}}", name])
            if theirs.returncode != 0 or theirs.stdout.strip() != image_id:
                pipe_image_to_user(user, name, "podman", "load")


def shifter_pull(*images: str) -> None:
    """The image gateway pulls these cpu images (as its admin, root), as `shifterimg pull` on Perlmutter."""
    for image in images:
        result = run([str(REPO / SHIFTER_STAND_IN / "shifterimg"), "pull", f"docker:hpcml/{image}:cpu"],
                     env={**os.environ, "SHIFTER_GATEWAY_DIR": str(SHIFTER_GATEWAY)}, timeout=300)
        assert result.returncode == 0, result.stderr


# ---- models and data a user brings (tests/test_models.py, tests/test_fine_tuning.py): made here, nothing downloaded


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A Llama-style causal LM saved as Hugging Face saves one: config.json and model.safetensors."""
    directory = tmp_path_factory.mktemp("models") / "tiny-llama"
    made = run([sys.executable, "-c", f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
LlamaForCausalLM(config).save_pretrained({str(directory)!r})
"""], env=recipe_env(HF_HUB_DISABLE_PROGRESS_BARS="1"), timeout=300)
    assert made.returncode == 0, made.stderr
    assert (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')  # (a tokenizer file to carry)
    return directory


@pytest.fixture(scope="session")
def fields_file(tmp_path_factory) -> Path:
    """recipes/examples/fields.py's HDF5 file of 2D fields and their next heat-equation step (h5py)."""
    path = tmp_path_factory.mktemp("fields") / "fields.h5"
    made = run([sys.executable, str(REPO / "recipes" / "examples" / "fields.py"), "--out", str(path), "--train", "128",
                "--validation", "32", "--size", "16"],
               env=recipe_env(), timeout=120)
    assert made.returncode == 0 and path.is_file(), made.stderr
    return path
