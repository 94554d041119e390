"""Bad input ends in one clear line and exit code 2, before any process group exists.

"Before any process group" is shown by timing: each case would otherwise wait for ranks that never come
(world size 4, nobody else started) until the test's timeout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.runs import DDP_RECIPE, free_port, python, recipe_env, REPO, TINY


def run_as_rank0_of(world_size: int, *args: str, **extra_env: str):
    env = recipe_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), **extra_env)
    return python(DDP_RECIPE, *TINY, *args, env=env, timeout=60)


def assert_one_line_error(result, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("[ddp] error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    "world_size, args, fragments",
    [
        (4, ["--global-batch", "10"], ["--global-batch 10 is not divisible by the world size 4", "--global-batch 12"]),
        (3, ["--global-batch", "16"], ["not divisible by the world size 3"]),
        (1, ["--n-embd", "30", "--n-head", "4"], ["--n-embd 30 is not divisible by --n-head 4"]),
        (2, ["--max-steps", "0"], ["--max-steps must be at least 1"]),
        (2, ["--max-steps", "5", "--stop-at-step", "9"], ["--stop-at-step must be between 1 and --max-steps 5"]),
        # degenerate numbers that a range check lets through or that are divided by
        (2, ["--lr", "inf"], ["--lr must be a positive finite number, got inf"]),
        (2, ["--lr", "nan"], ["--lr must be a positive finite number, got nan"]),
        (2, ["--timeout-s", "0"], ["--timeout-s must be a positive finite number, got 0.0"]),
        (2, ["--timeout-s", "inf"], ["--timeout-s must be a positive finite number, got inf"]),
        (2, ["--peak-tflops", "0"], ["--peak-tflops must be a positive finite number, got 0.0"]),
        (2, ["--global-batch", "0"], ["--global-batch must be at least 1, got 0"]),
        (2, ["--eval-every", "-1"], ["--eval-every must be 0 (no evaluation) or more, got -1"]),
        (2, ["--eval-batches", "0"], ["--eval-batches must be at least 1, got 0"]),
        (2, ["--data-workers", "-2"], ["--data-workers must be 0 (read in the training process) or more, or -1 (auto)"]),
        (2, ["--tracker", "wandb,comet"], ["--tracker 'wandb,comet': use a comma-separated list of tensorboard, wandb, mlflow, or none"]),
        (2, ["--pack"], ["--pack packs instruction data's conversations", "leave out --pack"]),
        (2, ["--pack", "--model", "mymodel.py:build"], ["--pack needs a model that takes each token's position"]),
        (2, ["--tracker", "wandb", "--tensorboard", "tb"],
         ["--tensorboard tb names a directory for TensorBoard, which --tracker wandb leaves out: add tensorboard"]),
    ],
)
def test_recipe_rejects_bad_layout_before_starting(tmp_path, world_size, args, fragments):
    result = run_as_rank0_of(world_size, "--out-dir", str(tmp_path), *args)
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("fault, fragment", [
    ("grad-sum", "HPCML_TEST_FAULT=grad-sum changes nothing in this layout: it needs the parallelism it breaks"),
    ("no-grad-allreduce", "HPCML_TEST_FAULT=no-grad-allreduce changes nothing in this layout"),
    ("tp-no-reduce", "HPCML_TEST_FAULT=tp-no-reduce: ddp injects only grad-sum, accum-sum, no-grad-allreduce, "),
])
def test_a_negative_control_that_would_change_nothing_is_refused(tmp_path, fault, fragment):
    """A control that silently does nothing would pass its test: on one process a gradient sum or a skipped
    all-reduce changes nothing, and a fault the recipe cannot inject is not injected."""
    result = run_as_rank0_of(1, "--out-dir", str(tmp_path), HPCML_TEST_FAULT=fault)
    assert_one_line_error(result, fragment)


TORCH_RECIPES = ["ddp", "accelerate", "deepspeed", "fsdp_tp_pp", "megatron_tp_pp", "horovod/train_torch"]


@pytest.mark.parametrize("recipe", TORCH_RECIPES)
def test_help_shows_no_test_only_option(recipe):
    """The negative controls are the tests' (HPCML_TEST_FAULT), not options a user reads in --help."""
    path = REPO / "recipes" / (recipe if "/" in recipe else f"{recipe}/train")
    result = python(Path(f"{path}.py"), "--help", timeout=120)
    assert result.returncode == 0 and "--max-steps" in result.stdout, result.stderr
    for word in ("test-break", "skip-grad", "test-last", "test-resume", "TESTS ONLY", "wrong on purpose"):
        assert word not in result.stdout, word


def test_recipe_started_in_batch_script_without_srun_is_refused(tmp_path):
    env = recipe_env(SLURM_JOB_ID="99", SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_JOB_NODELIST="nid[000001-000002]")
    result = python(DDP_RECIPE, *TINY, "--out-dir", str(tmp_path), env=env, timeout=60)
    assert_one_line_error(result, "launch it with srun")


@pytest.mark.parametrize("option", ["--out-dir", "--tensorboard", "--config"])
def test_a_path_of_the_wrong_kind_is_one_line(tmp_path, option):
    """A file where a directory belongs (--out-dir, --tensorboard), a directory where a file belongs (--config)."""
    a_file, a_directory = tmp_path / "a-file", tmp_path / "a-directory"
    a_file.write_text("")
    a_directory.mkdir()
    args = {"--out-dir": ["--out-dir", str(a_file)],
            "--tensorboard": ["--out-dir", str(tmp_path / "run"), "--tensorboard", str(a_file)],
            "--config": ["--out-dir", str(tmp_path / "run"), "--config", str(a_directory)]}[option]
    result = run_as_rank0_of(2, *args)
    fragment = f"cannot read --config {a_directory}: Is a directory" if option == "--config" else \
        f"{option} {a_file} exists and is not a directory"
    assert_one_line_error(result, fragment)


@pytest.mark.parametrize("world_size", ["0", "-1"])
def test_a_world_size_below_one_is_refused_by_the_preflight(tmp_path, world_size):
    result = python(DDP_RECIPE, *TINY, "--out-dir", str(tmp_path), "--preflight", world_size,
                    env=recipe_env(), timeout=60)
    assert_one_line_error(result, f"the world size must be at least 1 rank, got {world_size}")
