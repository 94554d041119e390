"""The shared launcher (slurm/lib/launch.sh): runtime choice, image checks and the srun command it builds.

Runs the real script in bash with a job's SLURM_* variables; LAUNCH_DRY_RUN=1 prints the command instead of
running srun, so the command for runtimes this machine lacks (shifter, podman-hpc) can still be checked.
The same errors on a real job are exercised in tests/test_slurm_ddp.py.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.runs import recipe_env, REPO, run

JOB = dict(SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="nid[000003-000004]", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="8",
           SLURM_SUBMIT_DIR=str(REPO), REPO_DIR=str(REPO),
           HPCML_IMAGES_FILE="/nonexistent/hpcml-images")  # no image recorded, unless a test records one


def launch(*recipe_args: str, **env: str):
    # The shell options of the sbatch files, so a command that fails under them fails here too.
    script = (f'set -euo pipefail; source "{REPO}/slurm/lib/launch.sh"; '
              f'launch_recipe recipes/ddp/train.py {shlex.join(recipe_args)}')
    return run(["bash", "-c", script], env=recipe_env(**{**JOB, **env}), timeout=60, cwd=REPO)


def srun_line(result) -> list[str]:
    line = next(line for line in result.stdout.splitlines() if line.startswith("launch: srun "))
    return shlex.split(line.removeprefix("launch: "))


def test_bare_runtime_command_and_environment():
    result = launch("--max-steps", "3", CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    assert srun_line(result) == ["srun", "--label", "--kill-on-bad-exit=1", "python3", f"{REPO}/recipes/ddp/train.py",
                                 "--max-steps", "3"]
    # Rendezvous at the first node of the allocation, a port derived from the job id.
    assert "master=nid000003:30734" in result.stdout
    assert "NCCL_NET=AWS Libfabric" in result.stdout


IMAGE_ID = "74933ee84d16741a63cc732cbee594fb0568861217967d98b33f28bd23b5c723"


def test_shifter_runs_the_jobs_image_by_its_id():
    """`sbatch --image=docker:NAME` reaches the job as Shifter's SPANK plugin hands it over: the image's ID,
    type "id". A bare `shifter` takes that from the environment; nothing looks the ID up as a name."""
    result = launch(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", SLURM_SPANK_SHIFTER_IMAGE=IMAGE_ID,
                    SLURM_SPANK_SHIFTER_IMAGETYPE="id", SLURM_SPANK_SHIFTER_MODULE="gpu,nccl-cu13-plugin")
    assert result.returncode == 0, result.stderr
    words = without_settings(srun_line(result))
    assert words[:6] == ["srun", "--label", "--kill-on-bad-exit=1", "shifter", "--module=gpu,nccl-cu13-plugin", "python3"]
    assert f"image=id:{IMAGE_ID} (from the job's --image)" in result.stdout


def test_podman_runtimes_ignore_shifters_job_image(tmp_path):
    """A Shifter image ID means nothing to podman: the podman runtimes take CONTAINER_IMAGE or the recorded
    image, never the job's --image (so no podman-hpc or bare run needs a Shifter image)."""
    shifter_job = dict(LAUNCH_DRY_RUN="1", SLURM_SPANK_SHIFTER_IMAGE=IMAGE_ID, SLURM_SPANK_SHIFTER_IMAGETYPE="id",
                       HPCML_IMAGES_FILE=str(tmp_path / "images"))
    error = one_line_error(launch(CONTAINER_RUNTIME="podman-hpc", **shifter_job))
    assert "needs the ddp image" in error and "make pull-ddp REGISTRY=... ENGINE=podman-hpc" in error
    (tmp_path / "images").write_text("megatron=reg/hpcml/megatron:cuda\nddp=reg/hpcml/ddp:old\nddp=reg/hpcml/ddp:cuda\n")
    for runtime in ("podman-hpc", "podman"):
        result = launch(CONTAINER_RUNTIME=runtime, **shifter_job)
        assert result.returncode == 0, result.stderr
        assert "reg/hpcml/ddp:cuda" in srun_line(result)
        assert f"image=docker:reg/hpcml/ddp:cuda (from {tmp_path / 'images'})" in result.stdout
    assert launch(CONTAINER_RUNTIME="none", **shifter_job).returncode == 0


def test_image_recorded_by_make_pull_names_each_family_once(tmp_path):
    """One file, one line per image family, written by `make pull-IMAGE`: every recipe finds its own image."""
    images = tmp_path / "images"
    images.write_text("ddp=reg/hpcml/ddp:cuda\ndeepspeed=reg/hpcml/deepspeed:cuda\n")
    script = (f'source "{REPO}/slurm/lib/launch.sh"; for r in recipes/ddp/train.py recipes/fsdp_tp_pp/train.py '
              f'recipes/deepspeed/train.py recipes/megatron_tp_pp/train.py; do echo "$(recorded_image "$(image_family $r)")"; done')
    result = run(["bash", "-c", script], env=recipe_env(HPCML_IMAGES_FILE=str(images)), timeout=30)
    assert result.stdout.splitlines() == ["reg/hpcml/ddp:cuda", "reg/hpcml/ddp:cuda", "reg/hpcml/deepspeed:cuda", ""]
    # Every entry point the sbatch files launch has a family.
    for sbatch in (REPO / "slurm").glob("*.sh"):
        for entry in re.findall(r"launch_recipe (\S+)", sbatch.read_text()):
            if entry.startswith("recipes/") or entry.startswith("bench/"):
                family = run(["bash", "-c", f'source "{REPO}/slurm/lib/launch.sh"; image_family {entry}'], timeout=30)
                assert (REPO / "containers" / family.stdout.strip() / "Containerfile").exists(), (sbatch, entry)


def test_no_sbatch_file_names_a_shifter_image():
    """A placeholder '#SBATCH --image=' makes Shifter abort sbatch for anyone whose gateway lacks that
    exact name, and the podman-hpc and bare paths would still need it: the image is named once, elsewhere."""
    for sbatch in (REPO / "slurm").glob("*.sh"):
        assert not re.search(r"^#SBATCH\s+--image", sbatch.read_text(), re.M), sbatch


def test_shifter_explicit_image_and_modules():
    result = launch(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="docker:me/ddp:v1",
                    SLURM_SPANK_SHIFTER_MODULE="gpu,nccl-cu13-plugin")
    assert srun_line(result)[3:6] == ["shifter", "--image=docker:me/ddp:v1", "--module=gpu,nccl-cu13-plugin"]
    without_modules = launch(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1")
    assert without_modules.returncode == 0, without_modules.stderr
    assert without_settings(srun_line(without_modules))[3:6] == ["shifter", "--image=docker:me/ddp:v1", "python3"]


def without_settings(words: list[str]) -> list[str]:
    """A Shifter command without the launcher's --env=NAME=VALUE settings."""
    return [word for word in words if not word.startswith("--env=")]


def shifter_settings(words: list[str]) -> dict[str, str]:
    return dict(word.removeprefix("--env=").split("=", 1) for word in words if word.startswith("--env="))


# HPE's Slingshot settings for NCCL (its application note "Running NCCL-Based Applications"), the site plugin's
# file, the Flight Recorder, the image's own packages, and torch.compile's cache on node-local disk.
LAUNCHER_SETTINGS = {
    "FI_MR_CACHE_MONITOR": "userfaultfd", "FI_CXI_DISABLE_HOST_REGISTER": "1", "FI_CXI_DEFAULT_CQ_SIZE": "131072",
    "FI_CXI_RX_MATCH_MODE": "hybrid", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_SOCKET_IFNAME": "hsn", "NCCL_CROSS_NIC": "1",
    "NCCL_NET": "AWS Libfabric", "NCCL_NET_PLUGIN": "libnccl-net.so", "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000",
    "PYTHONNOUSERSITE": "1", "TRITON_CACHE_DIR": f"/tmp/triton-{os.getuid()}",
}


def test_the_launchers_settings_are_named_in_the_shifter_command(tmp_path):
    """Under Shifter the image's own environment wins over the job's for every variable the image sets (NVIDIA's
    recent images set NCCL_NET_PLUGIN, and NCCL then never loads the site's libnccl-net.so): the launcher
    names its settings with --env. A user's own value wins over the launcher's default. The host's PYTHONPATH
    and PYTHONUSERBASE stay outside (they would shadow the image's packages), unless CONTAINER_PYTHONPATH."""
    job = dict(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1", RUN_DIR=str(tmp_path / "run"))
    result = launch(**job, PYTHONPATH="/home/me/lib", PYTHONUSERBASE="/home/me/.local", NCCL_DEBUG="INFO")
    assert result.returncode == 0, result.stderr
    settings = shifter_settings(srun_line(result))
    expected = {**LAUNCHER_SETTINGS, "NCCL_DEBUG": "INFO",
                "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "run" / "flight_recorder" / "rank_")}
    assert {name: settings.get(name) for name in expected} == expected
    assert "PYTHONPATH" not in settings and "PYTHONUSERBASE" not in settings
    assert "NCCL_NET=AWS Libfabric NCCL_NET_PLUGIN=libnccl-net.so (module none) NCCL_DEBUG=INFO" in result.stdout
    # HPE's rendezvous settings for GH200 are not Perlmutter's A100 nodes': the site's values stay
    assert not any(name.startswith("FI_CXI_RDZV") for name in settings), settings
    asked = launch(**job, PYTHONPATH="/home/me/lib", CONTAINER_PYTHONPATH="/global/common/software/me/lib")
    assert shifter_settings(srun_line(asked))["PYTHONPATH"] == "/global/common/software/me/lib"
    # Shifter refuses --env=NAME= ("Improperly formatted environment variable"): an empty one stays out
    empty = launch(**job, NCCL_IB_HCA="", NCCL_ALGO="Ring")
    assert "NCCL_IB_HCA" not in shifter_settings(srun_line(empty)) and shifter_settings(srun_line(empty))["NCCL_ALGO"] == "Ring"


def test_podman_takes_the_launchers_settings_and_podman_hpc_the_slingshot_devices(tmp_path):
    """podman passes the launcher's settings from the step's environment (-e NAME and prefixes, which win over
    the image's ENV); the host's PYTHONPATH is not among them. podman-hpc also gets the node's Slingshot NICs
    (/dev/cxi*): NERSC's nccl module binds libfabric and libcxi, not the devices."""
    job = dict(LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1", RUN_DIR=str(tmp_path / "run"), PYTHONPATH="/home/me/lib")
    for runtime in ("podman", "podman-hpc"):
        words = srun_line(launch(**job, CONTAINER_RUNTIME=runtime, HPCML_CXI_DEVICES="/dev/cxi0 /dev/cxi1"))
        passed = [words[i + 1] for i, word in enumerate(words) if word == "-e"]
        for name in ("NCCL_*", "FI_*", "TORCH_NCCL_*", "TORCH_FR_*", "PYTHONNOUSERSITE", "TRITON_CACHE_DIR"):
            assert name in passed, (name, passed)
        assert not any(name.startswith("PYTHONPATH") for name in passed)
        devices = [word for word in words if word.startswith("--device=")]
        assert devices == (["--device=/dev/cxi0", "--device=/dev/cxi1"] if runtime == "podman-hpc" else []), words
    # this machine has no Slingshot NIC: none by default
    words = srun_line(launch(**job, CONTAINER_RUNTIME="podman-hpc"))
    assert not [word for word in words if word.startswith("--device=")]
    words = srun_line(launch(**job, CONTAINER_RUNTIME="podman", CONTAINER_PYTHONPATH="/opt/mine"))
    assert "PYTHONPATH=/opt/mine" in words


def test_nccl_is_not_sent_to_the_network_on_one_node():
    """HPE: NCCL_NET on a single-node job forces the network transport where nothing crosses the network.
    The launcher names the Slingshot plugin only on more nodes; a user's own NCCL_NET is kept on one node."""
    one_node = dict(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1",
                    SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="nid000003", SLURM_NTASKS="4")
    result = launch(**one_node)
    assert result.returncode == 0, result.stderr
    assert "NCCL_NET" not in shifter_settings(srun_line(result)) and "NCCL_NET=(any)" in result.stdout
    assert shifter_settings(srun_line(launch(**one_node, NCCL_NET="AWS Libfabric")))["NCCL_NET"] == "AWS Libfabric"
    two_nodes = launch(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1")
    assert shifter_settings(srun_line(two_nodes))["NCCL_NET"] == "AWS Libfabric"


def mounts(words: list[str]) -> list[str]:
    """The host directories a podman command mounts (each at the same path inside)."""
    pairs = [words[i + 1].split(":") for i, word in enumerate(words) if word == "-v"]
    assert all(host == inside for host, inside in pairs), pairs
    return [host for host, _ in pairs]


def test_podman_mounts_the_run_directory_and_extra_mounts_once(tmp_path):
    data, run_dir = tmp_path / "data", tmp_path / "out" / "run-1"
    data.mkdir()
    words = srun_line(launch(CONTAINER_RUNTIME="podman", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1",
                             RUN_DIR=str(run_dir), CONTAINER_MOUNTS=f"{data} {REPO}/recipes"))
    # recipes/ is inside the repository, already mounted
    assert mounts(words) == [str(REPO), str(run_dir), str(data)]


def test_unwritable_run_directory_and_bad_mounts_fail_before_srun(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    error = one_line_error(launch(CONTAINER_RUNTIME="none", RUN_DIR=str(blocker / "run")))
    assert f"cannot write to the run directory RUN_DIR={blocker}/run" in error
    assert not (blocker / "run").exists()
    error = one_line_error(launch(CONTAINER_RUNTIME="none", CONTAINER_MOUNTS="relative/dir"))
    assert "CONTAINER_MOUNTS: 'relative/dir' is not an existing absolute directory" in error


def preflight_in_container(runtime: str, mounted: list, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The ddp recipe's preflight as the launcher runs it in a podman or podman-hpc container: with the runtime
    and the mounted directories it passes (HPCML_CONTAINER_RUNTIME, HPCML_CONTAINER_MOUNTS)."""
    return run([sys.executable, str(REPO / "recipes" / "ddp" / "train.py"), "--out-dir", "/tmp/hpcml-unused", *args,
                "--preflight", "2"], env=recipe_env(HPCML_CONTAINER_RUNTIME=runtime,
                                                   HPCML_CONTAINER_MOUNTS=":".join(map(str, mounted)), **env), timeout=120)


def test_a_token_file_must_be_mounted_into_the_containers(tmp_path):
    """--data PREFIX under podman/podman-hpc: inside a mounted directory, on the command line or in --config
    alike. The launcher passes its mounts to the containers and parses no option of the recipe; the recipe's
    own preflight, in the container and after reading --config, checks every path its ranks will read
    (recipes/harness/mounts.py; every case of it: tests/unit/test_mounts.py) and says whether the files are
    there and whole (tests/test_data.py)."""
    data = tmp_path / "data"
    data.mkdir()
    prefix = data / "tokens"
    # Not prepared: the recipe's preflight (run by the launcher on the batch node) refuses the job, one line.
    refused = launch("--data", str(prefix), CONTAINER_RUNTIME="none", PYTHON=sys.executable, RUN_DIR=str(tmp_path / "run"))
    assert refused.returncode == 2 and "job step failed" not in refused.stderr, (refused.stdout, refused.stderr)
    assert [line for line in refused.stderr.splitlines() if "error" in line] == [
        line for line in refused.stderr.splitlines() if line.startswith(f"[ddp] error: --data {prefix}")], refused.stderr
    assert "prepare.py" in refused.stderr and not (tmp_path / "run").exists()
    for runtime in ("podman", "podman-hpc"):  # what the containers are told they have
        image = dict(CONTAINER_IMAGE="me/ddp:v1", CONTAINER_RUNTIME=runtime, LAUNCH_DRY_RUN="1")
        words = srun_line(launch("--data", str(prefix), **image, RUN_DIR=str(tmp_path / "run"), CONTAINER_MOUNTS=str(data)))
        assert f"HPCML_CONTAINER_MOUNTS={REPO}:{tmp_path}/run:{data}" in words and mounts(words) == [
            str(REPO), f"{tmp_path}/run", str(data)]
    # In the container, the data set named in the user's TOML file: refused before any rank starts unless mounted
    config = tmp_path / "conf" / "run.toml"
    config.parent.mkdir()
    config.write_text(f'data = "{prefix}"\n')
    error = preflight_in_container("podman-hpc", [REPO, config.parent], "--config", str(config))
    assert error.returncode == 2 and error.stderr.strip().splitlines() == [
        f"[ddp] error: --data {prefix} is not in any directory mounted into the podman-hpc containers ({REPO}, "
        f"{config.parent}): mount its directory: add {data} to CONTAINER_MOUNTS"], error.stderr
    unmounted_config = preflight_in_container("podman-hpc", [REPO, data], "--config", str(config))
    assert f"[ddp] error: --config {config} is not in any directory mounted" in unmounted_config.stderr
    mounted = preflight_in_container("podman-hpc", [REPO, config.parent, data], "--config", str(config))
    assert mounted.returncode == 2 and f"--data {prefix}: {prefix}.json does not exist" in mounted.stderr  # (its files)
    assert "mounted" not in mounted.stderr, mounted.stderr


def test_podman_mounts_a_working_directory_outside_the_repository(tmp_path):
    script_env = {"CONTAINER_RUNTIME": "podman", "LAUNCH_DRY_RUN": "1", "CONTAINER_IMAGE": "me/ddp:v1"}
    script = f'set -euo pipefail; source "{REPO}/slurm/lib/launch.sh"; launch_recipe recipes/ddp/train.py'
    # A sibling whose name starts like the repository's is still outside it.
    for workdir in (tmp_path, REPO.parent / f"{REPO.name}-sibling"):
        workdir.mkdir(exist_ok=True)
        try:
            result = run(["bash", "-c", script], env=recipe_env(**{**JOB, **script_env}), timeout=60, cwd=workdir)
        finally:
            if workdir != tmp_path:
                workdir.rmdir()
        assert result.returncode == 0, result.stderr
        assert mounts(srun_line(result)) == [str(REPO), str(workdir)]
    inside = srun_line(launch(**script_env))  # run from the repository root: one mount only
    assert mounts(inside) == [str(REPO)] and inside[inside.index("-w") + 1] == str(REPO)
    # Ranks run as the submitting user (as under Shifter), so their files belong to that user.
    assert inside[inside.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"


def test_podman_hpc_command():
    result = launch(CONTAINER_RUNTIME="podman-hpc", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1")
    assert result.returncode == 0, result.stderr
    words = srun_line(result)
    # (podman-hpc's default, --log-level=fatal, would hide why a container did not start)
    assert words[3:9] == ["podman-hpc", "--log-level=error", "run", "--rm", "--network=host", "--ipc=host"]
    # The network plugin's flag follows the image's CUDA major: the PyTorch family's image is CUDA 13 (the
    # dry run reads no label: the family's), the horovod image NGC's CUDA 12 (test_the_network_plugin_...).
    assert "--gpu" in words and "--nccl-cu13" in words and "--nccl" not in words
    # Rootless: uid 0 inside is the submitting user outside (the image's USER 10001 would be a subordinate
    # uid that can write nothing of theirs and read no squashed image; the podman-hpc matrix cells run it).
    assert words[words.index("--user") + 1] == "0:0"
    assert ["-v", f"{REPO}:{REPO}"] == words[words.index("-v"):words.index("-v") + 2]
    # Each rank's own SLURM_PROCID and the step's variables (absent where the command is built) must
    # reach its container: podman takes them, by prefix, from each task's environment.
    passed = [words[i + 1] for i, word in enumerate(words) if word == "-e"]
    assert passed == [f"HPCML_CONTAINER_MOUNTS={REPO}",  # (what the recipe's preflight checks its paths against)
                      "SLURM_*", "MASTER_*", "NCCL_*", "TORCH_NCCL_*", "TORCH_FR_*", "FI_*", "HPCML_*", "HOROVOD_*",
                      "TF_*", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONNOUSERSITE", "TRITON_CACHE_DIR"]
    assert words[words.index("me/ddp:v1") + 1 :][:2] == ["python3", f"{REPO}/recipes/ddp/train.py"]


def test_nccl_net_check_can_be_turned_off():
    result = launch(CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1", NCCL_NET="")
    assert result.returncode == 0, result.stderr
    assert "NCCL_NET=(any)" in result.stdout


def one_line_error(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("launch: error:")]
    assert len(errors) == 1, result.stderr
    assert "launch: srun" not in result.stdout  # nothing was started
    return errors[0]


def test_unknown_runtime():
    error = one_line_error(launch(CONTAINER_RUNTIME="docker"))
    assert "unknown CONTAINER_RUNTIME 'docker': use one of: shifter podman-hpc podman none" in error


def test_container_runtime_without_image(tmp_path):
    nothing_recorded = str(tmp_path / "images")
    error = one_line_error(launch(CONTAINER_RUNTIME="podman", LAUNCH_DRY_RUN="1", HPCML_IMAGES_FILE=nothing_recorded))
    assert "needs the ddp image" in error and "make pull-ddp" in error and "CONTAINER_IMAGE=" in error
    error = one_line_error(launch(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", HPCML_IMAGES_FILE=nothing_recorded))
    assert "--image=docker:REPO/NAME:TAG" in error


def test_runtime_not_installed():
    error = one_line_error(launch(CONTAINER_RUNTIME="shifter", SLURM_SPANK_SHIFTER_IMAGE=IMAGE_ID,
                                  SLURM_SPANK_SHIFTER_IMAGETYPE="id"))
    assert "'shifter' command is not on PATH" in error


@pytest.mark.containers  # (asks podman's own storage)
def test_podman_image_missing():
    error = one_line_error(launch(CONTAINER_RUNTIME="podman", CONTAINER_IMAGE="localhost/hpcml/no-such-image:cpu"))
    assert "image 'localhost/hpcml/no-such-image:cpu' is not in podman's local storage" in error


def test_outside_a_job():
    env = {k: "" for k in JOB}
    error = one_line_error(launch(CONTAINER_RUNTIME="none", **env))
    assert "not inside a Slurm job" in error


def test_shifter_gpu_job_needs_the_nccl_plugin_module_when_nccl_net_names_it():
    gpu_job = dict(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1", SLURM_GPUS_PER_NODE="4")
    error = one_line_error(launch(**gpu_job, SLURM_SPANK_SHIFTER_MODULE="gpu"))
    assert ("needs Shifter's network plugin module: add '#SBATCH --module=gpu,nccl-cu13-plugin' (the ddp image's "
            "CUDA 13 build)") in error, error
    for module in ("gpu,nccl-cu13-plugin", "gpu,nccl-plugin"):  # (which build loads, the recipe's preflight says)
        result = launch(**gpu_job, SLURM_SPANK_SHIFTER_MODULE=module)
        assert result.returncode == 0 and f"(module {module.split(',')[1]})" in result.stdout, result.stderr
    assert launch(**gpu_job, SLURM_SPANK_SHIFTER_MODULE="gpu", NCCL_NET="").returncode == 0  # TCP allowed on purpose
    # A site whose modules are named otherwise
    assert launch(**gpu_job, SLURM_SPANK_SHIFTER_MODULE="gpu,ofi-nccl", HPCML_NCCL_MODULE="ofi-nccl").returncode == 0


def test_the_network_plugin_follows_the_images_cuda_major_and_can_be_named():
    """NERSC builds the plugin once per CUDA major: podman-hpc gets the flag of the image's major (the PyTorch
    family's cuda image is CUDA 13, the horovod image NGC's CUDA 12), or the one HPCML_NCCL_MODULE names."""
    def podman_hpc_flags(recipe: str, **env: str) -> list[str]:
        script = (f'set -euo pipefail; source "{REPO}/slurm/lib/launch.sh"; launch_recipe {recipe}')
        result = run(["bash", "-c", script], env=recipe_env(**{**JOB, "CONTAINER_RUNTIME": "podman-hpc",
                     "LAUNCH_DRY_RUN": "1", "CONTAINER_IMAGE": "me/image:v1", **env}), timeout=60, cwd=REPO)
        assert result.returncode == 0, result.stderr
        return [word for word in srun_line(result) if word.startswith("--nccl")]

    assert podman_hpc_flags("recipes/ddp/train.py") == ["--nccl-cu13"]
    assert podman_hpc_flags("recipes/horovod/train.py") == ["--nccl"]
    assert podman_hpc_flags("recipes/ddp/train.py", HPCML_NCCL_MODULE="nccl") == ["--nccl"]


def test_network_devices_are_the_slingshot_nics_and_gdrcopys(tmp_path):
    """podman-hpc gets /dev/cxi* and /dev/gdrdrv where they exist (NERSC's gpu module does not pass gdrdrv);
    HPCML_CXI_DEVICES= (empty) passes none (test_podman_takes_the_launchers_settings_...)."""
    for name in ("cxi0", "cxi1", "gdrdrv"):
        os.mknod(tmp_path / name, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    (tmp_path / "cxi_not_a_device").write_text("")
    listed = run(["bash", "-c", f'source "{REPO}/slurm/lib/runtime.sh"; network_devices "{tmp_path}"'])
    assert listed.stdout.split() == [str(tmp_path / name) for name in ("cxi0", "cxi1", "gdrdrv")], listed.stderr


def test_gh200_slingshot_settings_are_an_explicit_choice():
    """HPE's April 2026 rendezvous settings (for a GDRCopy corruption on GH200) with the srun option they need;
    not on A100 nodes (Perlmutter's), where NERSC's own values stay. Another value is one line."""
    job = dict(CONTAINER_RUNTIME="shifter", LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/ddp:v1")
    words = srun_line(launch(**job, HPCML_SLINGSHOT="gh200"))
    assert {name: value for name, value in shifter_settings(words).items() if name.startswith("FI_CXI_RDZV")} == {
        "FI_CXI_RDZV_THRESHOLD": "0", "FI_CXI_RDZV_GET_MIN": "0", "FI_CXI_RDZV_EAGER_SIZE": "0",
        "FI_CXI_RDZV_PROTO": "alt_read"}
    assert words[:4] == ["srun", "--label", "--kill-on-bad-exit=1", "--network=disable_rdzv_get"], words
    error = one_line_error(launch(**job, HPCML_SLINGSHOT="a100"))
    assert "HPCML_SLINGSHOT=a100 is not a node type with its own Slingshot settings: use gh200" in error


def sbatch_file(name: str, *recipe_args: str, **env: str):
    """One of the sbatch files themselves, as Slurm would run it (a dry run: the srun line is printed)."""
    return run(["bash", str(REPO / "slurm" / f"{name}.sh"), *recipe_args],
               env=recipe_env(**{**JOB, "LAUNCH_DRY_RUN": "1", **env}), timeout=60, cwd=REPO)


def test_accelerate_starts_one_launcher_per_node_that_expands_the_node_rank_there():
    result = sbatch_file("accelerate", "--max-steps", "3", CONTAINER_RUNTIME="podman", CONTAINER_IMAGE="me/acc:v1",
                         SLURM_CPUS_PER_TASK="32")
    assert result.returncode == 0, result.stderr
    words = srun_line(result)
    # 8 ranks on 2 nodes: one task per node, with the CPUs of its 4 ranks.
    assert words[:7] == ["srun", "--label", "--kill-on-bad-exit=1", "-N", "2", "--ntasks=2", "--ntasks-per-node=1"]
    assert words[7] == "--cpus-per-task=128"
    image_at = words.index("me/acc:v1")
    assert words[image_at + 1:image_at + 3] == ["bash", f"{REPO}/slurm/lib/per_node.sh"]
    script = words[image_at + 3]
    # Single-quoted into the job: each node expands its own rank, the world comes from the allocation.
    for per_node in ('--machine_rank "$SLURM_NODEID"', '--num_processes "$HPCML_EXPECTED_WORLD_SIZE"',
                     '--num_machines "$SLURM_JOB_NUM_NODES"', '--rdzv_backend c10d', '--main_process_ip "$MASTER_ADDR"'):
        assert per_node in script
    assert words[image_at + 4:image_at + 6] == ["python3", f"{REPO}/recipes/accelerate/train.py"]
    assert words[image_at + 6:image_at + 8] == ["--launch-config", f"{REPO}/recipes/accelerate/multi_gpu.yaml"]
    assert words[-2:] == ["--max-steps", "3"]
    assert "HPCML_*" in words  # HPCML_EXPECTED_WORLD_SIZE and the config path reach the container


def test_accelerate_per_node_script_runs_as_written(tmp_path):
    """The script the nodes run, run by bash here: it hands accelerate the node's own values."""
    result = sbatch_file("accelerate", CONTAINER_RUNTIME="none")
    words = srun_line(result)
    script = words[words.index(f"{REPO}/slurm/lib/per_node.sh") + 1]
    fake_python = tmp_path / "python3"
    fake_python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake_python.chmod(0o755)
    node = run(["bash", str(REPO / "slurm" / "lib" / "per_node.sh"), script, str(fake_python), "recipe.py", "--x"], timeout=30,
               env=recipe_env(SLURM_NODEID="1", SLURM_JOB_NUM_NODES="2", HPCML_EXPECTED_WORLD_SIZE="8",
                              HPCML_ACCELERATE_CONFIG="/c.yaml", MASTER_ADDR="nid000003", MASTER_PORT="30734"))
    args = node.stdout.splitlines()
    assert node.returncode == 0, node.stderr
    assert args[:4] == ["-m", "accelerate.commands.launch", "--config_file", "/c.yaml"]
    pairs = dict(zip(args[4::2], args[5::2]))
    assert pairs["--machine_rank"] == "1" and pairs["--num_processes"] == "8" and pairs["--num_machines"] == "2"
    assert pairs["--main_process_ip"] == "nid000003" and pairs["--main_process_port"] == "30734"
    assert args[-2:] == ["recipe.py", "--x"]


def test_accelerate_needs_the_same_ranks_on_every_node():
    error = one_line_error(sbatch_file("accelerate", CONTAINER_RUNTIME="none", SLURM_NTASKS="7"))
    assert "7 tasks on 2 nodes" in error and "--ntasks-per-node" in error


def test_accelerate_config_that_does_not_exist():
    error = one_line_error(sbatch_file("accelerate", CONTAINER_RUNTIME="none", ACCELERATE_CONFIG="nope.yaml"))
    assert "ACCELERATE_CONFIG=" in error and "no such file" in error


def test_deepspeed_ranks_are_srun_tasks_with_node_local_op_caches():
    result = sbatch_file("deepspeed", "--zero-stage", "3", CONTAINER_RUNTIME="none")
    assert result.returncode == 0, result.stderr
    assert srun_line(result) == ["srun", "--label", "--kill-on-bad-exit=1", "python3", f"{REPO}/recipes/deepspeed/train.py",
                                 "--out-dir", f"{REPO}/runs/deepspeed-1234", "--zero-stage", "3"]


def test_megatron_puts_tp_inside_a_node_and_pp_across_nodes_unless_told_otherwise():
    """--tp node: the recipe takes the ranks of a node (harness.tp_size, tests/unit/test_harness_launch.py); --pp the nodes."""
    result = sbatch_file("megatron_tp_pp", "--num-layers", "8", CONTAINER_RUNTIME="none", SLURM_NTASKS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    assert srun_line(result) == ["srun", "--label", "--kill-on-bad-exit=1", "python3", f"{REPO}/recipes/megatron_tp_pp/train.py",
                                 "--tp", "node", "--pp", "2", "--out-dir", f"{REPO}/runs/megatron_tp_pp-1234", "--num-layers", "8"]
    # The user's --tp/--pp come after the defaults: argparse keeps the last one.
    override = sbatch_file("megatron_tp_pp", "--tp", "2", "--pp", "4", CONTAINER_RUNTIME="none", SLURM_NTASKS_PER_NODE="4")
    assert srun_line(override)[-4:] == ["--tp", "2", "--pp", "4"]


def test_horovod_runs_the_tensorflow_recipe_or_the_pytorch_one_and_nothing_else():
    result = sbatch_file("horovod", "--batch-per-rank", "4", CONTAINER_RUNTIME="none")
    assert result.returncode == 0, result.stderr
    assert srun_line(result) == ["srun", "--label", "--kill-on-bad-exit=1", "python3", f"{REPO}/recipes/horovod/train.py",
                                 "--out-dir", f"{REPO}/runs/horovod-1234", "--batch-per-rank", "4"]
    torch_variant = sbatch_file("horovod", CONTAINER_RUNTIME="none", RECIPE="recipes/horovod/train_torch.py")
    assert srun_line(torch_variant)[4] == f"{REPO}/recipes/horovod/train_torch.py"
    wrong = sbatch_file("horovod", CONTAINER_RUNTIME="none", RECIPE="recipes/ddp/train.py")
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == ("launch: error: RECIPE=recipes/ddp/train.py: use recipes/horovod/train.py "
                                    "(TensorFlow) or recipes/horovod/train_torch.py (PyTorch)")


def test_podman_passes_horovod_and_tensorflow_settings_into_the_container():
    result = sbatch_file("horovod", CONTAINER_RUNTIME="podman", CONTAINER_IMAGE="hpcml/horovod:cpu")
    assert result.returncode == 0, result.stderr
    command = srun_line(result)
    assert {"HOROVOD_*", "TF_*"} <= {command[i + 1] for i, word in enumerate(command) if word == "-e"}


def test_per_node_script_passes_slurm_signals_to_the_ranks_not_the_launcher(tmp_path):
    """A launcher that would die of SIGUSR1 (no handler, as torchrun's agent) survives it; its rank gets
    the signal, and the script exits with the launcher's code."""
    rank = tmp_path / "rank.py"
    rank.write_text("import pathlib, signal, sys, time\n"
                    "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(3))\n"
                    f"pathlib.Path({str(tmp_path / 'ready')!r}).touch()\n"
                    "time.sleep(60)\n")
    launcher = tmp_path / "launcher.py"  # exits with 10 + its rank's exit code
    launcher.write_text("import subprocess, sys\n"
                        "sys.exit(10 + subprocess.call([sys.executable, sys.argv[1]]))\n")
    script = 'exec "$0" "$@"'
    node = subprocess.Popen(["bash", str(REPO / "slurm" / "lib" / "per_node.sh"), script, sys.executable,
                             str(launcher), str(rank)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and node.poll() is None, "the rank did not start"
        time.sleep(0.05)
    # Bare or under Shifter, Slurm signals every process of the step, the launcher included: here too.
    launcher_pid = int(subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True, text=True).stdout.split()[0])
    assert str(launcher) in Path(f"/proc/{launcher_pid}/cmdline").read_text()
    os.kill(launcher_pid, signal.SIGUSR1)
    node.send_signal(signal.SIGUSR1)
    _, stderr = node.communicate(timeout=30)
    assert node.returncode == 13, stderr  # the launcher survived and reported its rank's exit code 3
    assert re.search(r"per_node: \S+: USR1 to rank process \d+", stderr), stderr


def test_each_rank_gets_its_own_cores_and_perlmutter_gpus_are_ordered_by_numa():
    """srun does not inherit --cpus-per-task since Slurm 22.05: without passing it, a node's ranks share
    one core. On Perlmutter GPU k is next to NUMA domain 3-k: local rank l (on domain l) drives GPU 3-l.
    (What the ranks then see is logged by each one: '[launch] rank R ... cpus C, device D'.)"""
    job = dict(CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1", SLURM_CPUS_PER_TASK="32", SLURM_GPUS_PER_NODE="4")
    result = launch(**job)
    assert srun_line(result)[:6] == ["srun", "--label", "--kill-on-bad-exit=1", "--cpus-per-task=32", "--cpu-bind=cores", "python3"]
    assert "GPU order=(local rank l: GPU l)" in result.stdout
    assert "GPU order=3,2,1,0" in launch(**job, NERSC_HOST="perlmutter").stdout
    assert "GPU order=(local rank l: GPU l)" in launch(**job, NERSC_HOST="perlmutter", HPCML_GPU_ORDER="").stdout


def test_a_per_node_launcher_hands_its_ranks_the_gpus_in_that_order():
    result = run(["bash", str(REPO / "slurm" / "lib" / "per_node.sh"), 'echo "$CUDA_VISIBLE_DEVICES ${HPCML_GPU_ORDER:-unset}"'],
                 env=recipe_env(CUDA_VISIBLE_DEVICES="4,5,6,7", HPCML_GPU_ORDER="3,2,1,0"), timeout=30)
    assert result.returncode == 0 and result.stdout.split() == ["7,6,5,4", "unset"], result.stdout + result.stderr


def test_the_nccl_check_sees_nccls_transport_lines():
    """slurm/nccl_check.sh reads NCCL's NET/OFI or NET/Socket lines, which only INFO prints: the launcher's
    WARN default must not reach it (it does reach the training jobs)."""
    def dry_run(sbatch_file: str) -> str:
        result = run(["bash", str(REPO / "slurm" / sbatch_file)], env=recipe_env(**JOB, CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1"),
                     cwd=REPO, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout
    assert "NCCL_DEBUG=INFO " in dry_run("nccl_check.sh")
    assert "NCCL_DEBUG=WARN " in dry_run("ddp.sh")


def test_horovods_mpi_controller_gets_cray_mpich_from_the_runtime_or_is_refused():
    """HOROVOD_CONTROLLER=mpi relies on the runtime to put Cray MPICH in place of the image's MPICH: under
    Shifter its mpich module must be among the job's modules (naming modules drops Shifter's defaults);
    under podman-hpc the mpi module runs shared-run, where the time-limit signal never reaches a rank."""
    job = dict(LAUNCH_DRY_RUN="1", CONTAINER_IMAGE="me/horovod:v1", HOROVOD_CONTROLLER="mpi")
    error = one_line_error(launch(CONTAINER_RUNTIME="shifter", SLURM_SPANK_SHIFTER_MODULE="gpu,nccl-plugin", **job))
    assert "needs Shifter's mpich module" in error and "--module=gpu,nccl-plugin,mpich" in error, error
    for modules in ("gpu,nccl-plugin,mpich", ""):  # named, or Shifter's defaults
        assert launch(CONTAINER_RUNTIME="shifter", SLURM_SPANK_SHIFTER_MODULE=modules, **job).returncode == 0
    error = one_line_error(launch(CONTAINER_RUNTIME="podman-hpc", **job))
    assert "HOROVOD_CONTROLLER=mpi under podman-hpc" in error and "shared-run" in error, error
    assert launch(CONTAINER_RUNTIME="podman-hpc", **{**job, "HOROVOD_CONTROLLER": "gloo"}).returncode == 0


def test_requeues_stop_at_the_limit_and_a_bad_limit_is_refused(tmp_path):
    """At the time-limit checkpoint the job requeues itself, until it was restarted LAUNCH_MAX_REQUEUES times:
    then one line says so and nothing is requeued. A job cancelled while its ranks checkpointed is not put back
    (`scontrol requeue` takes a finished job too: a scancel in that window was undone). scontrol here is a
    stand-in that records its calls and gives the job's state as JOB_STATE says."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n'
                        '[ "$1" = show ] && echo "JobId=42 JobName=ddp JobState=$JOB_STATE Reason=None"\nexit 0\n')
    scontrol.chmod(0o755)
    def requeue(restarts: str, limit: str, state: str = "RUNNING"):
        (tmp_path / "calls").unlink(missing_ok=True)
        script = (f'source "{REPO}/slurm/lib/launch.sh"; '
                  f"SLURM_JOB_ID=42 SLURM_RESTART_COUNT={restarts} LAUNCH_MAX_REQUEUES={limit} requeue_job")
        result = run(["bash", "-c", script], env=recipe_env(PATH=f"{tmp_path}:/usr/bin:/bin", JOB_STATE=state), timeout=30)
        calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
        return result, calls
    below, calls = requeue("2", "3")
    assert below.returncode == 0 and "requeued job 42 (restart 3)" in below.stdout
    assert calls == ["show job -o 42", "requeue 42"]
    at_limit, calls = requeue("3", "3")
    assert at_limit.returncode == 0 and at_limit.stderr.strip() == (
        "launch: error: job 42 was requeued 3 times (LAUNCH_MAX_REQUEUES=3): not again; resubmit it, or raise the time limit")
    assert calls == []  # not called again
    cancelled, calls = requeue("2", "3", state="CANCELLED")
    assert cancelled.returncode == 0 and cancelled.stdout == "" and cancelled.stderr.strip() == (
        "launch: job 42 was cancelled while it checkpointed (JobState=CANCELLED): not requeued; the checkpoint is "
        "kept, and resubmitting the job continues from it")
    assert calls == ["show job -o 42"]  # (the control: without the state check, "requeue 42" follows)
    error = one_line_error(launch(CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1", LAUNCH_MAX_REQUEUES="ten"))
    assert "LAUNCH_MAX_REQUEUES=ten is not a number of requeues" in error


def test_an_images_file_that_is_a_directory_is_one_line(tmp_path):
    error = one_line_error(launch(CONTAINER_RUNTIME="podman", LAUNCH_DRY_RUN="1", HPCML_IMAGES_FILE=str(tmp_path)))
    assert f"HPCML_IMAGES_FILE={tmp_path} is not a file" in error


def test_nsight_systems_wraps_each_rank_for_the_profiled_steps(tmp_path):
    """HPCML_NSYS=1 (GPU only: it is checked here as a dry run): `nsys profile` in front of each rank's Python,
    its capture range the CUDA profiler range the recipe opens for --profile START:END, a report per rank in
    RUN_DIR/nsys. Without --profile (on the command line or in --config) there is nothing to capture: one line
    from the recipe's preflight, before srun. (On a GPU machine: HPCML_NSYS=1 sbatch slurm/ddp.sh --profile 10:12,
    then `nsys stats RUN_DIR/nsys/rank0.nsys-rep`.)"""
    run_dir = tmp_path / "run"
    result = launch("--profile", "3:4", CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1", HPCML_NSYS="1", RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stderr
    words = srun_line(result)
    nsys = words.index("nsys")
    assert words[nsys:nsys + 2] == ["nsys", "profile"] and words[nsys + 7:nsys + 9] == ["python3", f"{REPO}/recipes/ddp/train.py"]
    assert {"--capture-range=cudaProfilerApi", "--capture-range-end=stop", f"--output={run_dir}/nsys/rank%q{{SLURM_PROCID}}"} \
        <= set(words[nsys:nsys + 7])
    # Without --profile (on the command line or in --config): the recipe's preflight refuses it, one line
    refused = preflight_in_container("none", [], "--max-steps", "3", HPCML_NSYS="1")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "add it (e.g. --profile 10:12)" in lines[0], refused.stderr
    config = tmp_path / "run.toml"
    config.write_text('profile = "3:4"\nmax-steps = 5\n')
    assert preflight_in_container("none", [], "--config", str(config), HPCML_NSYS="1").returncode == 0
    plain = srun_line(launch("--profile", "3:4", CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1", RUN_DIR=str(run_dir)))
    assert "nsys" not in plain


def test_spare_nodes_leave_the_job_shape_of_the_nodes_that_train():
    """HPCML_SPARE_NODES=1 on a 2-node job of 8 ranks: the batch script's Slurm variables describe 1 node, 4 ranks
    (what the ranks and the sbatch files' layouts see, Megatron's --pp "$SLURM_JOB_NUM_NODES" among them)."""
    script = (f'set -euo pipefail; source "{REPO}/slurm/lib/launch.sh"; '
              f'source "{REPO}/slurm/lib/launch.sh"; '  # (sourced twice, as slurm/preflight.sh may: the same shape)
              'echo "$SLURM_JOB_NUM_NODES $SLURM_NNODES $SLURM_NTASKS $SLURM_TASKS_PER_NODE $HPCML_JOB_NODES"')
    result = run(["bash", "-c", script], env=recipe_env(**{**JOB, "HPCML_SPARE_NODES": "1"}), timeout=60, cwd=REPO)
    assert result.returncode == 0 and result.stdout.split() == ["1", "1", "4", "4(x1)", "1234:2"], result.stdout + result.stderr
    dry = launch(CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1", HPCML_SPARE_NODES="1")
    assert dry.returncode == 0 and "on 2 node(s) [nid[000003-000004]], 4 task(s) on 1 of them (HPCML_SPARE_NODES=1)" in dry.stdout


@pytest.mark.parametrize("env, message", [
    ({"HPCML_SPARE_NODES": "two"}, "launch: error: HPCML_SPARE_NODES=two: give a number of nodes (0: none)"),
    ({"HPCML_SPARE_NODES": "2"}, "launch: error: HPCML_SPARE_NODES=2 leaves none of the job's 2 node(s) to train on: "
                                 "ask for more (sbatch -N 4)"),
    ({"HPCML_SPARE_NODES": "1", "SLURM_NTASKS": "3"}, "launch: error: HPCML_SPARE_NODES: 3 tasks on 2 nodes: a spare "
                                                      "replaces a node with as many ranks; use --ntasks-per-node"),
    ({"LAUNCH_MAX_NODE_RESTARTS": "-1"}, "launch: error: LAUNCH_MAX_NODE_RESTARTS=-1: give a number of restarts (0: none)"),
], ids=["not-a-number", "none-left", "uneven", "restarts"])
def test_bad_spare_node_settings_are_one_line(env, message):
    result = launch(CONTAINER_RUNTIME="none", LAUNCH_DRY_RUN="1", **env)
    assert result.returncode == 2 and result.stderr.strip() == message, result.stderr

