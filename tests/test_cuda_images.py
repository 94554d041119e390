"""The cuda flavor's own checks, without a GPU: `make test-cuda-images` runs these and tests/test_images.py on
the cuda flavor of the PyTorch family (HPCML_TEST_FLAVOR=cuda). Not in `make test`: a cold build downloads
~3 GB of CUDA wheels and the tier needs ~26 GB of disk at its peak (docs/tests.md gives its time).

Each cuda image: its size (goal: 10 GB or less, every size written to runs/cuda-images/sizes.json); its torch
is PyPI's CUDA build of the pinned version with exactly the pinned CUDA wheels, consistent (pip check); the
DDP recipe trains in it on 2 gloo ranks (no GPU here) and matches one process; a normal user runs it through
podman-hpc from the squashed store (the user inside is the user) and root runs it under podman; it goes
through the local registry and back unchanged. The GPU side (NCCL, kernels): `make venv-cuda` and the
commands of docs/gpu-checks.md, listed in docs/validated.toml until they have run.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from support.cluster import build_images, podman_hpc_migrate
from support.curves import losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import REPO, TINY
from test_images import cuda_wheel_pins, IMAGES, labels, podman, versions_env
from test_registry import assert_pulled_is_pushed, empty_image_store, make, registry, tags  # noqa: F401 (registry: the fixture)

pytestmark = [pytest.mark.containers, pytest.mark.cuda_images]
SIZE_GOAL = 10 * 10**9  # bytes, per image (issue: "goal <= 10 GB per image")
REPORT = REPO / "runs" / "cuda-images"


@pytest.fixture(scope="module")
def cuda_images() -> list[str]:
    build_images(*IMAGES, flavor="cuda")
    return IMAGES


def test_sizes_are_reported_and_within_the_goal(cuda_images):
    sizes = {}
    for image in cuda_images:
        inspect = json.loads(podman("image", "inspect", f"hpcml/{image}:cuda").stdout)[0]
        sizes[image] = inspect["Size"]
    REPORT.mkdir(parents=True, exist_ok=True)
    (REPORT / "sizes.json").write_text(json.dumps({"goal_bytes": SIZE_GOAL, "bytes": sizes,
                                                   "gb": {k: round(v / 1e9, 2) for k, v in sizes.items()}}, indent=1) + "\n")
    assert all(size <= SIZE_GOAL for size in sizes.values()), sizes
    assert all(size > 3 * 10**9 for size in sizes.values()), f"too small to hold CUDA's libraries: {sizes}"


@pytest.mark.parametrize("image", IMAGES)
def test_torch_is_the_pinned_cuda_build_with_exactly_the_pinned_wheels(cuda_images, image):
    """PyPI's torch build of the pinned version (the local wheel directory's +cpu build would sort above
    it: images.sh keeps it out of cuda builds), and every CUDA wheel at its pin: pip's own record."""
    assert labels(image)["io.hpcml.version.torch"] == versions_env()["TORCH_VERSION_cpu"] + "+cu130"
    frozen = podman("run", "--rm", f"hpcml/{image}:cuda", "bash", "-c", "python -m pip check && python -m pip freeze")
    assert frozen.returncode == 0, frozen.stdout + frozen.stderr
    installed = dict(line.split("==") for line in frozen.stdout.splitlines() if "==" in line)
    wrong = {name: (pin, installed.get(name)) for name, pin in cuda_wheel_pins().items() if installed.get(name) != pin}
    assert not wrong, f"pinned vs installed: {wrong}"


def ddp_command(out: str, nproc: int) -> str:
    return (f"torchrun --standalone --nproc_per_node={nproc} /opt/hpcml/recipes/ddp/train.py --out-dir {out} "
            f"{' '.join(TINY)} --max-steps 4 --global-batch 8 --optimizer sgd --lr 0.1 --checkpoint-every 0 --no-resume")


def test_the_ddp_recipe_trains_in_it_on_cpu_and_matches_one_process(cuda_images, tmp_path):
    """No GPU here: the CUDA build of torch falls back to the CPU and gloo, as the recipe decides from inside
    (the GPU path is the gpu check's). 2 ranks against 1 on the same global batch."""
    tmp_path.chmod(0o777)  # the image's user (uid 10001) writes the runs
    script = f"{ddp_command('/runs/two', 2)} && {ddp_command('/runs/one', 1)}"
    result = podman("run", "--rm", "-e", "OMP_NUM_THREADS=1", "-v", f"{tmp_path}:/runs", "hpcml/ddp:cuda",
                    "bash", "-c", script, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert (two["world_size"], two["backend"], two["model_wrapper"]) == (2, "gloo", "DistributedDataParallel"), two
    assert "world_size=2 backend=gloo" in result.stdout
    assert len(losses(two)) == 4 and max_relative_difference(losses(two), losses(one)) <= PARITY_RTOL, (losses(two), losses(one))


def test_a_normal_user_runs_it_through_podman_hpc_and_root_under_podman(cuda_images, podman_hpc_user):
    """podman-hpc's rules, as slurm/lib/runtime.sh runs ranks: the image from the user's squashed store only,
    rootless with `--user 0:0` (uid 0 inside is the user outside: what a rank writes is theirs) in their own
    directory, mounted at the same path; root, as a site's admin runs it, under podman."""
    podman_hpc_migrate(podman_hpc_user, "ddp", flavor="cuda")
    work = podman_hpc_user.home / "cuda-image-check"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    os.chown(work, podman_hpc_user.uid, podman_hpc_user.gid)
    probe = ("import os, torch; open('written-inside', 'w').close(); "
             "print(os.getuid(), torch.version.cuda, *torch.cuda.nccl.version(), sep=chr(32))")
    user_run = podman_hpc_user.run(["podman-hpc", "--log-level=error", "run", "--rm", "--user", "0:0", "-v", f"{work}:{work}",
                                    "-w", str(work), "localhost/hpcml/ddp:cuda", "python", "-c", probe], timeout=300)
    assert user_run.returncode == 0, user_run.stdout + user_run.stderr
    nccl = cuda_wheel_pins()["nvidia-nccl-cu13"].split(".")
    assert user_run.stdout.split() == ["0", "13.0", *nccl], user_run.stdout
    assert (work / "written-inside").stat().st_uid == podman_hpc_user.uid  # the user's, outside
    root_run = podman("run", "--rm", "--user", "0", "hpcml/ddp:cuda", "python", "-c", probe.replace("'written-inside'", "'/tmp/x'"))
    assert root_run.returncode == 0 and root_run.stdout.split() == ["0", "13.0", *nccl], root_run.stdout + root_run.stderr


def test_push_and_pull_round_trip(registry, cuda_images, tmp_path):  # noqa: F811 (the registry fixture)
    pushed = make("push-ddp", FLAVOR="cuda", REGISTRY=registry, TLS_VERIFY="false", ALLOW_DIRTY="1")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    revision = pushed.stdout.strip().splitlines()[-1].rsplit(":cuda-", 1)[1]
    assert {"cuda", f"cuda-{revision}"} <= set(tags(registry, "hpcml/ddp"))
    with empty_image_store(tmp_path) as fresh:
        pulled = make("pull-ddp", FLAVOR="cuda", REGISTRY=registry, TLS_VERIFY="false", ENGINE="podman", **fresh)
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        reference = f"{registry}/hpcml/ddp:cuda"
        assert_pulled_is_pushed(reference, "hpcml/ddp:cuda", fresh)
        assert (tmp_path / "images").read_text() == f"ddp={reference}\n"
