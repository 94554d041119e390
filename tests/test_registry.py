"""Registry round trip: a real registry on 127.0.0.1, `make push-ddp`, a fresh image store, `make pull-ddp`,
and a matrix cell run under Slurm from the pulled image only; with podman, and with NERSC's podman-hpc as a
normal user (the pulled image squashed, as compute nodes need it).

The registry is Debian's docker-registry (the CNCF distribution server) with a minimal no-auth config,
started and stopped by the tests. The pulled image goes to a separate, empty podman store
(CONTAINERS_STORAGE_CONF), so nothing of the locally built copy can stand in for it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from support.cluster import podman_hpc_store_lock, sbatch_recipe
from support.runs import container_env, free_port, REPO, run, TINY

pytestmark = [pytest.mark.containers, pytest.mark.slurm]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    assert shutil.which("docker-registry"), "docker-registry is not installed (apt-get install docker-registry; .ci/run does)"
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\n"
                      f"http:\n  addr: 127.0.0.1:{port}\n")
    server = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL,
                              stderr=open(root / "registry.log", "w"))
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as response:
                assert response.status == 200
                break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, (root / "registry.log").read_text()
            time.sleep(0.3)
    yield address
    server.terminate()
    server.wait(timeout=30)


def make(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run(["make", "--no-print-directory", *args], env=container_env(**env), cwd=REPO, timeout=900)


def tags(registry: str, repository: str) -> list[str]:
    with urllib.request.urlopen(f"http://{registry}/v2/{repository}/tags/list", timeout=10) as response:
        return sorted(json.load(response)["tags"])


@contextlib.contextmanager
def empty_image_store(tmp_path: Path):
    """An empty podman store (only what comes from the registry will be there) and the file `make pull-IMAGE`
    records the pulled image in: the environment that selects both. Emptied and removed afterwards."""
    store = tmp_path / "store"
    storage_conf = tmp_path / "storage.conf"
    storage_conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{store}/graph"\nrunroot = "{store}/run"\n')
    fresh = {"CONTAINERS_STORAGE_CONF": str(storage_conf), "HPCML_IMAGES_FILE": str(tmp_path / "images")}
    try:
        listed = run(["podman", "images", "--format", "{{.Repository}}"], env=container_env(**fresh))
        assert listed.returncode == 0 and listed.stdout.strip() == "", listed.stdout + listed.stderr
        yield fresh
    finally:
        run(["podman", "rmi", "--all", "--force"], env=container_env(**fresh), timeout=300)
        shutil.rmtree(store, ignore_errors=True)


def assert_pulled_is_pushed(reference: str, local: str, fresh: dict[str, str]) -> None:
    ids = [json.loads(run(["podman", "image", "inspect", image], env=container_env(**env)).stdout)[0]["Id"]
           for image, env in ((reference, fresh), (local, {}))]
    assert ids[0] == ids[1], f"the pulled image {reference} differs from the one pushed ({local})"


def test_push_pull_and_run_from_the_pulled_image(registry, slurm_cluster, ddp_image, tmp_path):
    pushed = make("push-ddp", REGISTRY=registry, TLS_VERIFY="false", ALLOW_DIRTY="1")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    immutable = pushed.stdout.strip().splitlines()[-1]
    revision = immutable.rsplit(":cpu-", 1)[1]
    assert tags(registry, "hpcml/ddp") == sorted(["cpu", f"cpu-{revision}"])

    with empty_image_store(tmp_path) as fresh:
        pulled = make("pull-ddp", REGISTRY=registry, TLS_VERIFY="false", ENGINE="podman", **fresh)
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        reference = f"{registry}/hpcml/ddp:cpu"
        assert_pulled_is_pushed(reference, "hpcml/ddp:cpu", fresh)

        code, state, log = sbatch_recipe(slurm_cluster, tmp_path, "ddp", "-N", "2", "--ntasks-per-node", "1",
                                         recipe_args=[*TINY, "--max-steps", "3", "--global-batch", "4", "--checkpoint-every", "0"],
                                         CONTAINER_RUNTIME="podman", **fresh)  # no CONTAINER_IMAGE
        assert (code, state) == (0, "COMPLETED"), log
        assert (tmp_path / "images").read_text() == f"ddp={reference}\n"
        assert f"image=docker:{reference} (from {tmp_path / 'images'})" in log
        metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
        assert metrics["world_size"] == 2 and metrics["container"] == "podman"


def test_podman_hpc_pull_squashes_the_image_and_a_users_job_runs_from_it(registry, slurm_cluster, ddp_image, podman_hpc_user, tmp_path):
    """As a Perlmutter user would: `make pull-ddp ENGINE=podman-hpc` from their checkout puts the image into
    the squashed store (all a compute node sees) and records it; their job then runs it with no image
    named. (podman-hpc squashes a pulled image by its name as given: with a docker:// transport in front it
    matched nothing, and the pull left the image unsquashed with exit code 0.) The store is this test's
    alone meanwhile: podman-hpc rewrites it in place, and other tests' jobs read it."""
    pushed = make("push-ddp", REGISTRY=registry, TLS_VERIFY="false", ALLOW_DIRTY="1")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    user, reference = podman_hpc_user, f"{registry}/hpcml/ddp:cpu"
    work = user.work_dir(tmp_path)
    recorded = {"HPCML_IMAGES_FILE": str(work / "images")}
    with podman_hpc_store_lock():
        try:
            pulled = user.run(["make", "--no-print-directory", "pull-ddp", f"REGISTRY={registry}", "TLS_VERIFY=false",
                               "ENGINE=podman-hpc", "FLAVOR=cpu"], env=recorded, timeout=900)
            assert pulled.returncode == 0, pulled.stdout + pulled.stderr
            assert f"{reference} is in podman-hpc's squashed store" in pulled.stderr, pulled.stderr
            assert (work / "images").read_text() == f"ddp={reference}\n"
            # the login node's copy: compute nodes never see it (nor may the job here)
            removed = user.run(["podman-hpc", "--log-level=error", "rmi", reference], timeout=120)
            assert removed.returncode == 0, removed.stdout + removed.stderr
            squashed = user.run(["bash", "slurm/lib/squashed_image.sh", reference])
            assert squashed.returncode == 0, f"{reference} is not in the squashed store after make pull-ddp"

            code, state, log = sbatch_recipe(slurm_cluster, work, "ddp", "-N", "2", "--ntasks-per-node", "1", user=user,
                                             recipe_args=[*TINY, "--max-steps", "3", "--global-batch", "4", "--checkpoint-every", "0"],
                                             CONTAINER_RUNTIME="podman-hpc", **recorded)  # no CONTAINER_IMAGE
            assert (code, state) == (0, "COMPLETED"), log
            assert f"image=docker:{reference} (from {work / 'images'})" in log
            metrics = json.loads((work / "run" / "metrics.json").read_text())
            assert metrics["world_size"] == 2 and metrics["container"] == "podman"
            assert (work / "run" / "metrics.json").stat().st_uid == user.uid
        finally:
            user.run(["podman-hpc", "rmsqi", reference], timeout=120)  # the name only: the image is also hpcml/ddp:cpu


def test_pulling_for_shifter_takes_the_gpu_flavor_unless_told(ddp_image, tmp_path):
    """The README's `make pull-ddp REGISTRY=... ENGINE=shifter` pulls and records hpcml/ddp:cuda: Shifter (and
    podman-hpc) pull for GPU nodes, where the cpu image would train on the CPU (it pulled :cpu before).
    FLAVOR=cpu still pulls the cpu image. The local image gateway pulls from this machine's podman store, where
    the cpu image stands in for the registry's cuda one under its name."""
    registry = "registry.nersc.gov/myproject"
    shifter_path = f"{REPO / 'tests' / 'cluster' / 'shifter'}:{container_env()['PATH']}"
    for flavor in ("cuda", "cpu"):
        tagged = run(["podman", "tag", "localhost/hpcml/ddp:cpu", f"{registry}/hpcml/ddp:{flavor}"], env=container_env())
        assert tagged.returncode == 0, tagged.stderr
    try:
        images = tmp_path / "images"
        env = {"HPCML_IMAGES_FILE": str(images), "PATH": shifter_path,
               "SHIFTER_GATEWAY_DIR": str(tmp_path / "gateway")}
        pulled = make("pull-ddp", f"REGISTRY={registry}", "ENGINE=shifter", **env)
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        assert f"pulling {registry}/hpcml/ddp:cuda with shifter" in pulled.stderr, pulled.stderr
        assert images.read_text() == f"ddp={registry}/hpcml/ddp:cuda\n"
        pulled = make("pull-ddp", f"REGISTRY={registry}", "ENGINE=shifter", "FLAVOR=cpu", **env)
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        assert images.read_text() == f"ddp={registry}/hpcml/ddp:cpu\n"
    finally:
        run([str(REPO / "tests" / "cluster" / "shifter" / "shifterimg"), "release-all"],
            env={**container_env(), "SHIFTER_GATEWAY_DIR": str(tmp_path / "gateway")})
        for flavor in ("cuda", "cpu"):
            run(["podman", "untag", "localhost/hpcml/ddp:cpu", f"{registry}/hpcml/ddp:{flavor}"], env=container_env())


def test_an_immutable_tag_is_never_overwritten(registry, base_image, tmp_path):
    """Two different images with the same revision label: the second push of that tag is refused.
    (base: the smallest image with everything a push needs.)"""
    repo = "hpcml-immutable-test"
    for content in ("first", "second"):
        (tmp_path / "Containerfile").write_text(
            f"FROM localhost/hpcml/base:cpu\nLABEL org.opencontainers.image.revision=0123abcd content={content}\n")
        built = run(["podman", "build", "-q", "-t", f"{repo}/ddp:cpu", str(tmp_path)], env=container_env(), timeout=300)
        assert built.returncode == 0, built.stderr
        result = make("push-ddp", REGISTRY=registry, TLS_VERIFY="false", IMAGE_REPO=repo)
        if content == "first":
            assert result.returncode == 0, result.stdout + result.stderr
        else:
            assert result.returncode != 0
            assert "already exists in the registry and is a different image" in result.stderr, result.stderr
    assert tags(registry, f"{repo}/ddp") == ["cpu", "cpu-0123abcd"]
    run(["podman", "rmi", "--force", f"{repo}/ddp:cpu"], env=container_env())


def test_a_dirty_image_is_not_pushed_without_allow_dirty(registry, base_image, tmp_path):
    (tmp_path / "Containerfile").write_text(
        "FROM localhost/hpcml/base:cpu\nLABEL org.opencontainers.image.revision=0123abcd-dirty\n")
    repo = "hpcml-dirty-test"
    built = run(["podman", "build", "-q", "-t", f"{repo}/ddp:cpu", str(tmp_path)], env=container_env(), timeout=300)
    assert built.returncode == 0, built.stderr
    result = make("push-ddp", REGISTRY=registry, TLS_VERIFY="false", IMAGE_REPO=repo)
    assert result.returncode != 0 and "built from uncommitted changes (0123abcd-dirty)" in result.stderr, result.stderr
    run(["podman", "rmi", "--force", f"{repo}/ddp:cpu"], env=container_env())
