"""The bare environment (make venv) and the images pin the same framework versions, so a recipe checked
bare is the recipe the images run."""

from __future__ import annotations

import re

from support.runs import REPO


def pins(path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s#]+)", line.strip())
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def test_requirements_and_image_pins_agree():
    env = dict(re.findall(r"^([A-Za-z0-9_]+)=(\S*)$", (REPO / "containers" / "versions.env").read_text(), re.M))
    bare = pins(REPO / "requirements" / "cpu.txt") | pins(REPO / "requirements" / "frameworks.txt")
    image = {"torch": env["TORCH_VERSION_cpu"], "numpy": env["NUMPY_VERSION_cpu"],
             "accelerate": env["ACCELERATE_VERSION"], "deepspeed": env["DEEPSPEED_VERSION"],
             "megatron-core": env["MEGATRON_CORE_VERSION"], "psutil": env["PSUTIL_VERSION"],
             "tensorboard": env["TENSORBOARD_VERSION"], "transformers": env["TRANSFORMERS_VERSION"],
             "peft": env["PEFT_VERSION"], "safetensors": env["SAFETENSORS_VERSION"], "h5py": env["H5PY_VERSION"],
             "wandb": env["WANDB_VERSION"], "mlflow-skinny": env["MLFLOW_SKINNY_VERSION"],
             "sqlalchemy": env["SQLALCHEMY_VERSION"], "alembic": env["ALEMBIC_VERSION"]}
    assert {name: bare.get(name) for name in image} == image


def test_tensorflow_venv_and_horovod_image_pins_agree():
    """.venv-tf (make venv-tf) is the horovod image's cpu flavor outside the container."""
    env = dict(re.findall(r"^([A-Za-z0-9_]+)=(\S*)$", (REPO / "containers" / "versions.env").read_text(), re.M))
    bare = pins(REPO / "requirements" / "tensorflow.txt")
    image = {"torch": env["TORCH_VERSION_cpu"], "numpy": env["NUMPY_VERSION_cpu"],
             "tensorflow-cpu": env["TENSORFLOW_VERSION_cpu"], "mpich": env["MPICH_VERSION"],
             "tensorboard": env["TENSORBOARD_VERSION"]}
    assert {name: bare.get(name) for name in image} == image
