"""The container test matrix: every cell of tests/matrix.toml, run for real on the local Slurm cluster.

A cell builds its cpu image (from cache when unchanged), submits slurm/<recipe>.sh unchanged with
CONTAINER_RUNTIME=<runtime>, waits, and checks: the exit code and Slurm's final state; from inside the
run, the world size, backend, wrapper, layout, hosts and the container (and interpreter) it ran in; the
metrics JSON; and the loss of every step against one plain process on the same data and weights
(relative 1e-5), so a job that silently trains on fewer ranks, or in the wrong environment, fails. Cells
with ``data = true`` train on a token file outside the checkout, mounted as a user would mount a data set,
and their validation losses are compared too.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

from support.cluster import (build_images, job_nodes, job_state, podman_load_as_user, shifter_pull, step_launches,
                             submit_recipe, unlabelled)
from support.curves import eval_losses, losses, PARITY_RTOL, read_metrics
from support.trackers import tracking_errors
from support.runs import container_env, EVAL, recipe_env, REPO, run, TINY

pytestmark = [pytest.mark.slurm, pytest.mark.containers]
MATRIX = REPO / "tests" / "matrix.toml"
BASE_ARGS = [*TINY, "--max-steps", "4", "--checkpoint-every", "0"]
# The Megatron recipe names its model options as Megatron-LM does, and the TensorFlow recipes have their own
# small Keras model (their defaults are tiny already).
SHORT_RUN = ["--seq-len", "32", "--log-every", "1", "--max-steps", "4", "--checkpoint-every", "0"]
RECIPE_BASE_ARGS = {"megatron_tp_pp": SHORT_RUN, "horovod": SHORT_RUN, "tf_mirrored": SHORT_RUN}
# Every cell trains with plain SGD, at a learning rate where a gradient of the wrong scale (a sum for a mean)
# moves the loss by 100x the tolerance or more (tests/parity.toml: every control measures it): Adam would
# hide it. (Megatron: no norm clip, which would hide it too; Horovod: per rank, used x world size.)
SGD = ["--optimizer", "sgd", "--lr", "1.0"]
RECIPE_SGD = {"megatron_tp_pp": [*SGD, "--clip-grad", "0"], "fsdp_tp_pp": ["--optimizer", "sgd", "--lr", "0.3"],
              "horovod": ["--optimizer", "sgd", "--lr", "10"], "tf_mirrored": ["--optimizer", "sgd", "--lr", "20"]}
# On the token file (real bytes), SGD at those rates diverges within four steps (Megatron: loss 5.1 -> 17.5),
# and the rounding of two layouts grows with it past the tolerance (measured: eval losses 2e-5 apart on a
# CPU with AVX-512); at a tenth the loss falls and TP 2 x PP 2 gives one process's losses to 1e-7. (The data
# cells prove the data path and the evaluation; the synthetic cells keep the rate that shows a wrong scale.)
DATA_LR = ["--lr", "0.1"]
# The TensorFlow recipes run bare in their own venv (make venv-tf), not in the PyTorch one.
TF_PYTHON = str(REPO / ".venv-tf" / "bin" / "python")
BARE_PYTHON = {"horovod": TF_PYTHON, "tf_mirrored": TF_PYTHON}
# The backend each recipe must report (torch.distributed's gloo, unless the recipe is not torch.distributed).
BACKEND = {"horovod": "horovod-gloo", "tf_mirrored": "MirroredStrategy/ReductionToOneDevice"}
RUNTIMES = ("shifter", "podman-hpc", "podman", "none")
AS_USER = ("shifter", "podman-hpc")  # always submitted by a normal user, as on Perlmutter
BY_DEFAULT_AS_USER = (*AS_USER, "none")  # (bare: the site's venvs, make site-env)
CONTAINER = {"shifter": "shifter", "podman-hpc": "podman", "podman": "podman"}  # what a rank inside sees
IMAGE_PYTHON = "/opt/venv/bin/python3"
# What each recipe must report from inside a run of more than one rank: the wrapper around the model, and
# how its ranks were started (accelerate's per-node launcher speaks torchrun's protocol).
PARALLEL_RUN = {
    "ddp": {"model_wrapper": "DistributedDataParallel", "launcher": "srun"},
    "accelerate": {"model_wrapper": "DistributedDataParallel", "launcher": "torchrun", "distributed_type": "MULTI_CPU"},
    "deepspeed": {"launcher": "srun"},  # (DeepSpeedEngine, or PipelineEngine with --pp: checked in the cell)
    "fsdp_tp_pp": {"launcher": "srun"},  # (its wrapper depends on the layout: the cell's layout is checked)
    "megatron_tp_pp": {"model_wrapper": "DistributedDataParallel", "launcher": "srun", "cpu_placement_shim": True},
    "horovod": {"model_wrapper": "DistributedGradientTape", "launcher": "srun (gloo controller, rendezvous on rank 0)",
                "collectives": "gloo"},
}


# Recipes whose sbatch file starts one launcher per node (RECIPE_LAUNCHER), which starts that node's ranks.
PER_NODE_LAUNCHER = {"accelerate"}


def containers_started(job: str, runtime: str, user, since: int) -> int:
    """How many containers podman (root's, or the user's under podman-hpc or rootless podman) started for the
    job: its own event log, filtered by the job's label (slurm/lib/launch.sh) — evidence from outside the run.
    Only since the job's submission (``since``, Unix time): a job id comes back when the cluster starts anew,
    and podman's log (the journal) outlives it, so an earlier job of that id was counted too."""
    query = ["events", "--stream=false", "--since", str(since), "--filter", "event=start", "--filter",
             f"label=io.hpcml.job={job}", "--format", "{{.Name}}"]
    result = user.run([runtime, *query]) if user is not None else run(["podman", *query], env=container_env())
    assert result.returncode == 0, result.stderr
    return len(result.stdout.split())


def load_cells() -> list[dict]:
    cells = tomllib.loads(MATRIX.read_text())["cell"]
    for cell in cells:
        unknown = set(cell) - {"image", "recipe", "runtime", "image_from", "user", "nodes", "tasks_per_node",
                               "devices_per_task", "layout", "args", "expect", "tier", "data", "model", "tracker", "config"}
        assert not unknown, f"matrix.toml: unknown keys {unknown} in {cell}"
        assert cell["expect"] in ("pass", "config-error"), cell
        assert cell.setdefault("tier", "default") in ("default", "full"), cell
        assert cell.setdefault("data", False) in (True, False) and not (cell["data"] and cell["expect"] != "pass"), cell
        assert cell.setdefault("model", False) in (True, False) and not (cell["model"] and cell["expect"] != "pass"), cell
        assert cell.setdefault("tracker", False) in (True, False) and not (cell["tracker"] and cell["expect"] != "pass"), cell
        assert cell.setdefault("config", False) in (True, False) and not (cell["config"] and not cell["data"]), cell
        assert cell["runtime"] in RUNTIMES, cell
        cell.setdefault("user", "normal" if cell["runtime"] in BY_DEFAULT_AS_USER else "root")
        assert cell["user"] in ("normal", "root") and (cell["user"] == "normal" or cell["runtime"] not in AS_USER), cell
        cell.setdefault("image_from", "sbatch" if cell["runtime"] == "shifter" else "env")
        assert cell["image_from"] in ("sbatch", "env", "recorded"), cell
        assert cell["image_from"] != "sbatch" or cell["runtime"] == "shifter", cell
        # A typo in a recipe's name must not drop its cell from the matrix without a word.
        assert (REPO / "recipes" / cell["recipe"] / "train.py").exists(), f"matrix.toml: no recipe {cell['recipe']!r}: {cell}"
    return cells


def cell_id(cell: dict) -> str:
    rootless = "-rootless" if cell["runtime"] == "podman" and cell["user"] == "normal" else ""
    return (f"{cell['image']}-{cell['recipe']}-{cell['runtime']}{rootless}"
            f"-{cell['nodes']}x{cell['tasks_per_node']}-"
            + ("" if cell["runtime"] == "none" or cell["image_from"] == "env" else f"image_{cell['image_from']}-")
            + f"{cell['layout']}-{cell['expect']}" + ("-" + "_".join(cell["args"]).replace("--", "") if cell["args"] else "")
            + ("-token_file" if cell["data"] else "") + ("-hf_model" if cell["model"] else "")
            + ("-wandb_mlflow" if cell["tracker"] else ""))


CELLS = load_cells()


@pytest.fixture(scope="session")
def matrix_images() -> set[str]:
    """Every image a collected cell runs in, built once per session."""
    images = sorted({cell["image"] for cell in CELLS if cell["runtime"] != "none"})
    build_images(*images)
    shifter_pull(*sorted({cell["image"] for cell in CELLS if cell["runtime"] == "shifter"}))
    return set(images)


def reference_args(recipe: str, args: list[str], world: int) -> tuple[str, ...]:
    """The arguments of the one-process run that must reproduce a parallel run with ``args``."""
    def value(option: str, default: str) -> str:
        return args[len(args) - 1 - args[::-1].index(option) + 1] if option in args else default

    if recipe == "horovod":  # the whole global batch, at the learning rate the ranks use (--lr x world size)
        return (*args, "--batch-per-rank", str(int(value("--batch-per-rank", "8")) * world),
                "--lr", str(float(value("--lr", "1e-3")) * world))
    if recipe == "tf_mirrored":
        return (*args, "--devices", "1")
    if recipe == "deepspeed" and "--pp" in args:  # the same model and batch on one process, no pipeline
        at = args.index("--pp")
        return (*args[:at], *args[at + 2:])
    if recipe == "fsdp_tp_pp":  # the same model and batch, none of the layout (slurm/fsdp_tp_pp.sh adds --tp)
        layout_options = {"--pp", "--tp", "--dp-shard", "--dp-replicate", "--micro-batches", "--pp-schedule", "--pp-virtual"}
        kept = [a for i, a in enumerate(args) if a not in layout_options and (i == 0 or args[i - 1] not in layout_options)]
        return (*kept, "--tp", "1")
    return tuple(args)


@functools.cache
def reference_losses(recipe: str, args: tuple[str, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The recipe as one plain process on the host: the losses every parallel layout must reproduce (training,
    and validation where the run evaluates)."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"reference-{recipe}-"))
    result = run([BARE_PYTHON.get(recipe, sys.executable), str(REPO / "recipes" / recipe / "train.py"),
                  "--out-dir", str(out_dir), *args], env=recipe_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(out_dir)
    shutil.rmtree(out_dir)
    return tuple(losses(metrics)), tuple(eval_losses(metrics))


@pytest.fixture(scope="session")
def shared_token_file() -> Path:
    """A token file as a user's data set: outside any checkout, in a directory every user can read (under /tmp,
    which the Shifter stand-in mounts as Perlmutter mounts $SCRATCH; podman and podman-hpc need CONTAINER_MOUNTS)."""
    directory = Path(tempfile.mkdtemp(prefix="hpcml-data-", dir="/tmp"))
    directory.chmod(0o755)
    prefix = directory / "json"
    result = run([sys.executable, str(REPO / "recipes" / "data" / "prepare.py"), "--out", str(prefix),
                  str(Path(sysconfig.get_paths()["stdlib"]) / "json")], env=recipe_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    for path in directory.iterdir():
        path.chmod(0o644)
    yield prefix
    shutil.rmtree(directory)


@pytest.fixture(scope="session")
def shared_hf_model() -> Path:
    """A Hugging Face model directory as a user's (a tiny Llama, save_pretrained): outside any checkout, in a
    directory every user can read, as shared_token_file is."""
    directory = Path(tempfile.mkdtemp(prefix="hpcml-model-", dir="/tmp"))
    made = run([sys.executable, "-c", f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)).save_pretrained({str(directory / "llama")!r})
"""], env=recipe_env(HF_HUB_DISABLE_PROGRESS_BARS="1"), timeout=300)
    assert made.returncode == 0, made.stderr
    for path in (directory, directory / "llama"):
        path.chmod(0o755)
    for path in (directory / "llama").iterdir():
        path.chmod(0o644)
    yield directory / "llama"
    shutil.rmtree(directory)


def parse_layout(layout: str) -> dict[str, int]:
    return {key: int(value) for key, value in (part.split("=") for part in layout.split(","))}


def test_matrix_has_a_passing_cell_per_recipe_and_runtime():
    """The table itself: every recipe that exists runs in its image and bare, and layouts multiply out."""
    recipes = {path.parent.name for path in (REPO / "recipes").glob("*/train.py")}
    for recipe in recipes:
        runtimes = {c["runtime"] for c in CELLS if c["recipe"] == recipe and c["expect"] == "pass"}
        assert {"podman", "none"} <= runtimes, f"recipe {recipe}: passing cells for {runtimes} only"
    families = {path.parent.name for path in (REPO / "containers").glob("*/Containerfile")} - {"base", "base-tf", "pytorch"}
    for runtime in AS_USER:
        covered = {c["image"] for c in CELLS if c["runtime"] == runtime and c["expect"] == "pass"}
        assert covered == families, f"image families without a passing {runtime} cell: {families - covered}"
    assert {c["image_from"] for c in CELLS if c["runtime"] == "shifter"} == {"sbatch", "env", "recorded"}
    # `make test` runs the default tier only (`make test-full` every cell): it still starts every recipe in
    # a container and bare, every image family under Shifter, podman-hpc and rootless podman as a normal
    # user, every recipe bare as that user, and every runtime; the slower tier repeats those paths in more
    # layouts and as root.
    default = [c for c in CELLS if c["tier"] == "default" and c["expect"] == "pass"]
    for recipe in recipes:
        runtimes = {c["runtime"] for c in default if c["recipe"] == recipe}
        assert "none" in runtimes and runtimes - {"none"}, f"recipe {recipe}: default tier has {runtimes}"
    for runtime in AS_USER:
        assert {c["image"] for c in default if c["runtime"] == runtime} == families, f"default tier, {runtime}"
    # ... and under rootless podman, as the normal user, from the image in their own store
    rootless = {c["image"] for c in default if c["runtime"] == "podman" and c["user"] == "normal"}
    assert rootless == families, f"default tier, rootless podman: no passing cell for {families - rootless}"
    # ... and bare, as the normal user, every recipe on the site's venvs
    bare = {c["recipe"] for c in default if c["runtime"] == "none" and c["user"] == "normal"}
    assert bare == recipes, f"default tier, bare as a normal user: no passing cell for {recipes - bare}"
    assert {c["runtime"] for c in default} == set(RUNTIMES)
    assert {c["image_from"] for c in default if c["runtime"] == "shifter"} == {"sbatch", "env", "recorded"}
    # a data set from a shared file system: mounted by the site (Shifter) and through CONTAINER_MOUNTS (podman-hpc)
    assert {c["runtime"] for c in default if c["data"]} >= {"shifter", "podman-hpc"}
    # ... and a Hugging Face model directory, fine-tuned sharded (FSDP2 x TP, ZeRO-3), likewise
    assert {c["runtime"] for c in default if c["model"]} >= {"shifter", "podman-hpc"}
    for cell in CELLS:
        ranks = cell["nodes"] * cell["tasks_per_node"] * cell.get("devices_per_task", 1)
        assert math.prod(parse_layout(cell["layout"]).values()) == ranks, cell


@pytest.mark.parametrize("cell", [pytest.param(c, id=cell_id(c), marks=[pytest.mark.full] if c["tier"] == "full" else [])
                                  for c in CELLS])
def test_cell(cell, slurm_cluster, matrix_images, request, tmp_path):
    recipe, runtime = cell["recipe"], cell["runtime"]
    args = [*RECIPE_BASE_ARGS.get(recipe, BASE_ARGS), *RECIPE_SGD.get(recipe, SGD), *cell["args"]]
    image = f"hpcml/{cell['image']}:cpu"
    env, options, user, work = {"CONTAINER_RUNTIME": runtime}, [], None, tmp_path
    mounts = []  # (podman and podman-hpc: CONTAINER_MOUNTS; Shifter mounts /tmp, as Perlmutter its file systems)
    if cell["data"]:  # a data set outside the checkout, mounted as a user mounts one
        token_file = request.getfixturevalue("shared_token_file")
        args += ["--data", str(token_file), *EVAL, *DATA_LR]
        mounts.append(str(token_file.parent))
    if cell["model"]:  # a Hugging Face model directory outside the checkout, likewise
        model_dir = request.getfixturevalue("shared_hf_model")
        args += ["--model", f"hf:{model_dir}"]
        mounts.append(str(model_dir.parent))
    if mounts and runtime in ("podman", "podman-hpc"):
        env["CONTAINER_MOUNTS"] = " ".join(mounts)
    if cell["user"] == "normal":  # a normal user, as every Perlmutter user, from their own checkout
        # (rootless podman needs what podman-hpc's set-up gives the user: /dev/fuse, host networking)
        user = request.getfixturevalue("cluster_user" if runtime in ("shifter", "none") else "podman_hpc_user")
        work = user.work_dir(tmp_path)
        if runtime == "podman-hpc":  # (the squashed store then unchanged until the job is done)
            request.getfixturevalue("squashed_images")(cell["image"])
        elif runtime == "podman":  # rootless podman: the image in the user's own store
            podman_load_as_user(user, cell["image"])
    if runtime == "none" and user is not None:  # the site's venvs, as a user's `module load` gives them
        site_env = request.getfixturevalue("site_env")
        env["PYTHON"] = str(site_env / ("venv-tf" if recipe in BARE_PYTHON else "venv") / "bin" / "python")
    elif runtime == "none":
        if recipe in BARE_PYTHON:
            env["PYTHON"] = BARE_PYTHON[recipe]
    elif cell["image_from"] == "sbatch":
        options.append(f"--image=docker:{image}")
    elif cell["image_from"] == "env":
        env["CONTAINER_IMAGE"] = image
    else:  # what `make pull-IMAGE` records
        env["HPCML_IMAGES_FILE"] = str(work / "images")
        (work / "images").write_text(f"{cell['image']}=hpcml/not-this-one:cpu\n{cell['image']}={image}\n")
    tracked = ["--tracker", "tensorboard,wandb,mlflow"] if cell["tracker"] else []  # (not the reference's)
    submitted = int(time.time()) - 1  # (podman's events of this job: from here on)
    recipe_args = [*args, *tracked]
    if cell["config"]:  # the data set named in the user's TOML file instead (the preflight reads it, in the image)
        config = work / "config" / "run.toml"
        config.parent.mkdir()
        config.write_text(f'data = "{token_file}"\n')
        at = recipe_args.index("--data")
        recipe_args[at:at + 2] = ["--config", str(config)]
        if runtime in ("podman", "podman-hpc"):  # (mounted, as the data set is: the check is the recipe's, after --config)
            env["CONTAINER_MOUNTS"] = f"{env.get('CONTAINER_MOUNTS', '')} {config.parent}".strip()
    code, job = submit_recipe(slurm_cluster, work, recipe, "--wait", "-N", str(cell["nodes"]),
                              "--ntasks-per-node", str(cell["tasks_per_node"]), *options, recipe_args=recipe_args,
                              user=user, **env)
    state, log = job_state(job), (work / f"{recipe}-{job}.out").read_text()
    assert f"launch: runtime={runtime} " in log, log
    if runtime == "shifter":  # the image by name in the log, with the ID every rank starts it by
        source = {"sbatch": "the job's --image", "env": "CONTAINER_IMAGE", "recorded": str(work / "images")}
        assert re.search(rf"image=docker:{re.escape(image)} id:[0-9a-f]{{64}} \(from {re.escape(source[cell['image_from']])}\)", log), log
        # (the job's own image is the one a bare `shifter` takes; a named one the launcher resolved once)
        srun = next(line for line in log.splitlines() if line.startswith("launch: srun "))
        assert "--image=docker:" not in srun and ("--image=id:" in srun) == (cell["image_from"] != "sbatch"), srun
    tmp_path = work

    if cell["expect"] == "config-error":
        assert code == 2 and state == "FAILED", log  # the preflight's exit code for bad input
        errors = {line for line in unlabelled(log).splitlines() if line.startswith(f"[{recipe}] error:")}
        assert len(errors) == 1, log  # one message (each rank may print it), and nothing else went wrong
        assert "Traceback" not in log and not re.search(rf"^\[{recipe}\] step ", unlabelled(log), re.M), log
        assert not (tmp_path / "run" / "metrics.json").exists()
        return

    assert (code, state) == (0, "COMPLETED"), log
    world = cell["nodes"] * cell["tasks_per_node"]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    # From inside the run: it really was this parallel, in this environment.
    assert metrics["world_size"] == world and metrics["backend"] == BACKEND.get(recipe, "gloo")
    expected_layout = parse_layout(cell["layout"])  # (recipes may report more: micro-batches, VP)
    assert {key: metrics["layout"].get(key) for key in expected_layout} == expected_layout
    if world > 1:
        assert {key: metrics.get(key) for key in PARALLEL_RUN[recipe]} == PARALLEL_RUN[recipe]
    if cell.get("devices_per_task", 1) > 1:  # one process, several replicas (MirroredStrategy)
        assert metrics["replicas"] == cell["devices_per_task"] and metrics["model_wrapper"] == "MirroredStrategy"
    if "--zero-stage" in args:
        assert metrics["zero_stage"] == int(args[args.index("--zero-stage") + 1])
    if cell["model"]:  # the user's model, loaded from their directory inside the container
        assert metrics["model"] == f"hf:{model_dir}", metrics["model"]
        if "--zero-stage" in args and args[args.index("--zero-stage") + 1] == "3":
            assert metrics["loaded_partitioned"], metrics  # straight into ZeRO-3's shards
    if recipe == "deepspeed":
        assert metrics["model_wrapper"] == ("PipelineEngine" if "--pp" in args else "DeepSpeedEngine"), metrics
    # Each rank's host, against the nodes Slurm recorded for the job (block distribution: rank r on node
    # r // tasks_per_node), whichever nodes those were.
    nodes = job_nodes(job)
    assert len(nodes) == cell["nodes"], nodes
    assert metrics["hostnames"] == [node for node in nodes for _ in range(cell["tasks_per_node"])]
    # ... and the nodes whose slurmd started the job's step, as whom: on every node of the job, as its user.
    assert step_launches(job) == {node: user.uid if user else 0 for node in nodes}, log
    if runtime != "none":
        assert metrics["container"] == CONTAINER[runtime] and metrics["python"] == IMAGE_PYTHON, metrics
    else:
        # (this test machine may itself be a container; what matters is that it is not the image)
        assert metrics["container"] not in ("podman", "shifter") and metrics["python"] != IMAGE_PYTHON, metrics
        if "PYTHON" in env:  # ... and it was the interpreter the job was given (the user's: the site's venv)
            assert metrics["python"] == env["PYTHON"], metrics
    if user is not None:  # written by the user's ranks, as the user
        assert (tmp_path / "run" / "metrics.json").stat().st_uid == user.uid
    if runtime in ("podman", "podman-hpc"):  # and from the runtime's own record: the containers the job started
        per_node = recipe in PER_NODE_LAUNCHER
        expected = cell["nodes"] if per_node else world
        assert containers_started(job, runtime, user, submitted) == expected + 1, log  # (+1: the recipe's preflight check)
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    assert [record["step"] for record in metrics["history"]] == [1, 2, 3, 4]
    if cell["tracker"]:  # W&B offline and MLflow inside the image, as its user: one run each, every step once
        assert tracking_errors(tmp_path / "run", metrics) == []
        assert not [p for p in (tmp_path / "run").rglob("*") if user and p.lstat().st_uid != user.uid]

    reference, reference_eval = reference_losses(recipe, reference_args(recipe, args, world))
    assert losses(metrics) == pytest.approx(list(reference), rel=PARITY_RTOL)
    if cell["config"]:  # the preflight's answer (RUN_DIR/preflight.json): the paths it checked, after --config
        answer = json.loads((tmp_path / "run" / "preflight.json").read_text())
        assert answer["world_size"] == world and answer["container"] == runtime, answer
        assert answer["paths_read"] == {f"--config {config}": str(config), f"--data {token_file}": str(token_file.parent)}
    if cell["data"]:  # it read the data set, and evaluated on its validation split as one process does
        assert metrics["config"]["data"] == args[args.index("--data") + 1] and len(eval_losses(metrics)) == 2
        assert eval_losses(metrics) == pytest.approx(list(reference_eval), rel=PARITY_RTOL)
