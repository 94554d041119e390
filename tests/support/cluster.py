"""The local Slurm cluster, its normal user, and the container stores (podman, podman-hpc, Shifter) the tests use."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from support.runs import PLACEHOLDER_GPUS, REPO, container_env, run

CLUSTER_SCRIPT = REPO / "tests" / "cluster" / "local_slurm.sh"
CLUSTER_DIR = Path(os.environ.get("LOCAL_SLURM_DIR", "/tmp/hpcml-slurm"))
# make test-scale asks for 16 (HPCML_CLUSTER_NODES); the cluster restarts when the count changes.
CLUSTER_NODES = int(os.environ.get("HPCML_CLUSTER_NODES", "6"))
# The second local cluster (LOCAL_SLURM_SHAPE=host): one node shaped like this machine, binding CPUs.
HOST_SHAPED_DIR = Path("/tmp/hpcmlhost-slurm")
SHIFTER_STAND_IN = Path("tests") / "cluster" / "shifter"  # shifter, shifterimg (relative to a checkout)
SHIFTER_GATEWAY = CLUSTER_DIR / "shifter"
CLUSTER_USER = "hpcml-user"  # jobs run as this normal user where Perlmutter would run them as the user

RANK_LABEL = re.compile(r"^ *\d+: ", re.M)  # srun --label (slurm/lib/runtime.sh): " 9: [ddp] step ..."


def unlabelled(log: str) -> str:
    """A job log without srun's rank labels, for reading what the ranks said."""
    return RANK_LABEL.sub("", log)


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


def job_records(job_id: str, timeout: float = 15, cluster_dir: Path = CLUSTER_DIR) -> list[str]:
    """Slurm's job-completion records of a job (one per run: a requeued job has several), waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = [line for line in (cluster_dir / "jobcomp.txt").read_text().splitlines()
                   if line.startswith(f"JobId={job_id} ")]
        if records:
            return records
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never reached a final state in jobcomp.txt")


def job_state(job_id: str, cluster_dir: Path = CLUSTER_DIR) -> str:
    return re.search(r"JobState=(\S+)", job_records(job_id, cluster_dir=cluster_dir)[-1]).group(1)  # the last run's


def job_nodes(job_id: str, run_index: int = 0) -> list[str]:
    """The nodes Slurm itself recorded for a run of the job (jobcomp's NodeList, expanded by scontrol).

    Evidence from outside the run: the tests compare what a recipe reports against it, and never assume
    which nodes a job gets (another test's job may hold the first ones)."""
    nodelist = re.search(r"NodeList=(\S+)", job_records(job_id)[run_index]).group(1)
    result = run(["scontrol", "show", "hostnames", nodelist], env={**os.environ, "SLURM_CONF": str(CLUSTER_DIR / "etc" / "slurm.conf")})
    assert result.returncode == 0 and result.stdout.split(), f"scontrol show hostnames {nodelist}: {result.stderr}"
    return result.stdout.split()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Polls predicate until it returns something true (returned), or fails the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def final_state(job_id: str) -> str | None:
    """The job's last record in the job-completion log once it has ended for good (None before)."""
    records = [line for line in (CLUSTER_DIR / "jobcomp.txt").read_text().splitlines() if line.startswith(f"JobId={job_id} ")]
    if not records:
        return None
    state = re.search(r"JobState=(\S+)", records[-1]).group(1)
    return None if state in ("PENDING", "REQUEUED") else state


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The PID of a rank of the job writing to run_dir, found through its environment: the Python process itself
    (in a container too: not the runtime's client, `podman-hpc run ... train.py`, which has the same words)."""
    for pid in subprocess.run(["pgrep", "-f", f"train.py --out-dir {run_dir}"], capture_output=True, text=True).stdout.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            program = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if f"SLURM_PROCID={rank}".encode() in environ and os.path.basename(program).startswith(b"python"):
            return int(pid)
    return None


def step_launches(job_id: str, step: int = 0) -> dict[str, int]:
    """Slurm's own record of where a job step ran, and as whom: each node's slurmd logs "launch task
    StepId=JOB.STEP request from UID:U" when it starts the step's tasks there. {node: uid}."""
    launched = {}
    for log in sorted((CLUSTER_DIR / "log").glob("slurmd-*.log")):
        match = re.search(rf"launch task StepId={job_id}\.{step} request from UID:(\d+)", log.read_text(errors="replace"))
        if match:
            launched[log.stem.removeprefix("slurmd-")] = int(match.group(1))
    return launched


def flavor_env(flavor: str) -> dict[str, str]:
    """containers/images.sh's settings for an image tag: cpu, cuda, or cuda-ngc (FLAVOR=cuda CUDA_BASE=ngc)."""
    return {"FLAVOR": "cuda", "CUDA_BASE": "ngc"} if flavor == "cuda-ngc" else {"FLAVOR": flavor, "CUDA_BASE": "pypi"}


def build_images(*images: str, flavor: str = "cpu") -> None:
    """Build the images in a flavor (default cpu; from cache when unchanged). A failed build fails the test.

    Call it from a fixture (below), not from a test's body: the per-test timeout counts only the test's
    own call (pyproject.toml: timeout_func_only), and a cold build of the horovod image takes ~10 minutes.
    Concurrent builds (pytest-xdist workers) wait for each other: containers/images.sh takes a lock."""
    result = run(["bash", str(REPO / "containers" / "images.sh"), "build", *images],
                 env=container_env(**flavor_env(flavor)), timeout=3600)
    assert result.returncode == 0, f"image build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"


def image_fixture(*images: str):
    """A session fixture that builds these cpu images (once per test process) and returns their names."""
    @pytest.fixture(scope="session")
    def built() -> list[str]:
        build_images(*images)
        return [f"hpcml/{image}:cpu" for image in images]
    return built


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


SITE_ENV = Path("/opt/hpcml-env")


PODMAN_HPC_INSTALL = REPO / "tests" / "cluster" / "podman-hpc" / "install.sh"
PODMAN_HPC_PREFIX = Path("/opt/hpcml-podman-hpc")


PODMAN_HPC_STORE_LOCK = f"/tmp/{CLUSTER_USER}-podman-hpc.lock"


@contextlib.contextmanager
def podman_hpc_store_lock():
    """Held while a test changes the user's podman-hpc stores: the test workers share that user, and
    podman-hpc rewrites the squashed store's images.json in place (a job starting meanwhile may read half a
    file). Jobs and checks that only read the stores hold it shared (squashed_images below)."""
    with open(PODMAN_HPC_STORE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def podman_hpc_migrate(user: ClusterUser, *images: str, flavor: str = "cpu") -> None:
    """The images (default: cpu flavor) into the user's squashed store, and only there (a Perlmutter compute node sees no
    other): root's image piped into `podman-hpc load` (as the user), migrated, the local copy removed.
    Skipped for an image whose squashed copy has root's image ID already. `podman-hpc migrate` exits 0
    when it fails, so the store itself is asked afterwards (slurm/lib/squashed_image.sh)."""
    with podman_hpc_store_lock():
        for image in images:
            name = f"localhost/hpcml/{image}:{flavor}"
            image_id = run(["podman", "image", "inspect", "--format", "{{.Id}}", name], env=container_env()).stdout.strip()
            # (podman-hpc silences podman's own errors unless asked: --log-level)
            listed = user.run(["podman-hpc", "--log-level=error", "images", "--no-trunc", "--format",
                               "{{.ID}} {{.Repository}}:{{.Tag}} {{.ReadOnly}}"])
            assert listed.returncode == 0, f"podman-hpc images as {user.name}: {listed.stderr}"
            if re.search(rf"^(sha256:)?{image_id} {re.escape(name)} true$", listed.stdout, re.M):
                continue
            if image in ("ddp", "megatron", "deepspeed", "accelerate") or (image, flavor) == ("horovod", "cpu"):
                keep_parent_local(user, listed.stdout, flavor)  # (the images built on hpcml/pytorch: images.sh parent_of)
            pipe_image_to_user(user, name, "podman-hpc", "load")
            for step in (["migrate", name], ["rmi", name]):
                done = user.run(["podman-hpc", *step], timeout=900)
                assert done.returncode == 0, f"podman-hpc {' '.join(step)}: {done.stdout}{done.stderr}"
            squashed = user.run(["bash", str(user.repo / "slurm" / "lib" / "squashed_image.sh"), name])
            assert squashed.returncode == 0, f"{name} is not in {user.name}'s squashed store after podman-hpc migrate"


def keep_parent_local(user: ClusterUser, listed: str, flavor: str) -> None:
    """The image families are built on hpcml/pytorch: that parent stays in the user's local podman-hpc store (never
    migrated, never run), so a family's `podman-hpc load` writes only its own layers instead of all of them
    again (50-118 s a family, against 20-30 s with the shared layers present), and its `rmi` after the migration
    leaves them. A rebuilt parent replaces the one kept."""
    name = f"localhost/hpcml/pytorch:{flavor}"
    parent_id = run(["podman", "image", "inspect", "--format", "{{.Id}}", name], env=container_env()).stdout.strip()
    if re.search(rf"^(sha256:)?{parent_id} {re.escape(name)} false$", listed, re.M):
        return
    user.run(["podman-hpc", "--log-level=error", "rmi", name])  # (the superseded parent, if any; none: fails, fine)
    pipe_image_to_user(user, name, "podman-hpc", "load")


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


def shifter_pull(*images: str, flavor: str = "cpu") -> None:
    """The image gateway pulls these images (as its admin, root), as `shifterimg pull` on Perlmutter."""
    for image in images:
        result = run([str(REPO / SHIFTER_STAND_IN / "shifterimg"), "pull", f"docker:hpcml/{image}:{flavor}"],
                     env={**os.environ, "SHIFTER_GATEWAY_DIR": str(SHIFTER_GATEWAY)}, timeout=300)
        assert result.returncode == 0, result.stderr


# ---- models and data a user brings (tests/test_models.py, tests/test_fine_tuning.py): made here, nothing downloaded

