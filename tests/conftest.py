"""The tests' fixtures: the local Slurm cluster, its normal user and their stores, the images, and the models
and data a user brings (made here, nothing downloaded). The helpers they use are in tests/support/."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from support.cluster import (CLUSTER_DIR, CLUSTER_NODES, CLUSTER_SCRIPT, CLUSTER_USER, HOST_SHAPED_DIR, PODMAN_HPC_INSTALL,
                             PODMAN_HPC_PREFIX, PODMAN_HPC_STORE_LOCK, SITE_ENV, ClusterUser, copy_checkout,
                             image_fixture, podman_hpc_migrate, podman_hpc_store_lock)
from support import megatron_shim, timings
from support.chat import prepare_chat, save_chat_tokenizer, uneven_answers, write_jsonl
from support.runs import PLACEHOLDER_GPUS, REPO, container_env, recipe_env, run


TIMINGS_DIR = REPO / "runs" / "test-durations"


def pytest_configure(config):
    """One directory per test run, shared by its workers (they inherit the environment), for what the tests
    record across workers (support/megatron_shim.py); in the process that sees every report, the recorder of
    each test's time (support/timings.py)."""
    if not hasattr(config, "workerinput") and not os.environ.get(megatron_shim.RUN_DIR_ENV):
        os.environ[megatron_shim.RUN_DIR_ENV] = tempfile.mkdtemp(prefix="hpcml-test-run-")
    timings.register(config, TIMINGS_DIR, REPO)


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle, whose order inside each scope stays
def pytest_collection_modifyitems(items):
    """The longest test scopes first (tests/scope_durations.json; the Makefile passes --no-loadscope-reorder)."""
    if timings.SCOPES.exists():
        timings.longest_scopes_first(items, json.loads(timings.SCOPES.read_text()))


def pytest_sessionfinish(session):
    """After the last test of the run (pytest-xdist: in the controller, once every worker finished): once every
    test that runs megatron passed, every entry of the CPU shim's allow-list must have been needed by one of
    their runs. An entry no run needs any more (megatron dropped that CUDA assumption) is to be removed, so
    the list stays the truth: the run fails, saying which."""
    if hasattr(session.config, "workerinput"):
        return
    unused = megatron_shim.unused_entries(Path(os.environ[megatron_shim.RUN_DIR_ENV]))
    if unused:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.ensure_newline()
        reporter.write_line(f"FAILED {megatron_shim.ALLOW_LIST.name} allows sites no run needed any more: remove {unused}",
                            red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


@pytest.fixture(scope="session")
def host_shaped_cluster() -> dict[str, str]:
    """The second local cluster: one node (cpu000001) that declares this machine's own sockets and cores, and
    binds each task to its cores (task/affinity), as Perlmutter's nodes do; the first cluster's nodes are
    Perlmutter-shaped (128 CPUs), which a small machine cannot bind. Started if needed and left running."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOCAL_SLURM_")}
    env.update(LOCAL_SLURM_SHAPE="host", LOCAL_SLURM_DIR=str(HOST_SHAPED_DIR))
    result = run(["bash", str(CLUSTER_SCRIPT), "start", "1"], env=env, timeout=600)
    assert result.returncode == 0, f"the host-shaped local Slurm cluster did not start:\n{result.stdout}\n{result.stderr}"
    return {"SLURM_CONF": str(HOST_SHAPED_DIR / "etc" / "slurm.conf"), **PLACEHOLDER_GPUS}


base_image = image_fixture("base")
ddp_image = image_fixture("ddp")
accelerate_image = image_fixture("accelerate")


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
        drop_superseded_squashed_images(cluster_user)
    return cluster_user


def drop_superseded_squashed_images(user: ClusterUser) -> None:
    """An image rebuilt since the last run is migrated again, and podman-hpc keeps the superseded copy,
    nameless, in the squashed store (38 GB of them once filled this machine's disk). `podman-hpc rmsqi` does not
    count layers shared with the current images (tried: it broke the current ddp image), so the store goes
    whole; the tests refill it by image ID (podman_hpc_migrate)."""
    listed = user.run(["podman-hpc", "--log-level=error", "images", "--format", "{{.Repository}} {{.ReadOnly}}"])
    assert listed.returncode == 0, f"podman-hpc images as {user.name}: {listed.stderr}"
    if "<none> true" in listed.stdout.splitlines():
        shutil.rmtree(user.home / "scratch" / "storage")


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
def chat_model(tmp_path_factory) -> Path:
    """A model directory's tokenizer files with a chat template, as an instruct model ships them (support/chat.py)."""
    return save_chat_tokenizer(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="session")
def sft_data(chat_model, tmp_path_factory) -> Path:
    """Instruction data for --seq-len 32 whose conversations hold 2 to 14 trained tokens each (support/chat.py:
    uneven_answers), 14 for training and 2 for validation: the prefix of its token file."""
    directory = tmp_path_factory.mktemp("sft")
    prepared = prepare_chat(chat_model, directory / "tokens", write_jsonl(directory / "train.jsonl", *uneven_answers()),
                            options=["--seq-len", "32", "--valid-fraction", "0.1"])
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    return directory / "tokens"


@pytest.fixture(scope="session")
def fields_file(tmp_path_factory) -> Path:
    """recipes/examples/fields.py's HDF5 file of 2D fields and their next heat-equation step (h5py)."""
    path = tmp_path_factory.mktemp("fields") / "fields.h5"
    made = run([sys.executable, str(REPO / "recipes" / "examples" / "fields.py"), "--out", str(path), "--train", "128",
                "--validation", "32", "--size", "16"],
               env=recipe_env(), timeout=120)
    assert made.returncode == 0 and path.is_file(), made.stderr
    return path
