"""Fine-tuning beyond parity (a Hugging Face model sharded by FSDP2 and FSDP2 x TP, LoRA on DDP and FSDP2, your
module and data on FSDP2, each against one process with its export and its control: tests/parity.toml): the
learning-rate schedule and gradient clipping, stopped and resumed exactly on every PyTorch recipe, and what
cannot work refused in one line before any rank trains (the export command's refusals too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.curves import caught, losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import assert_ok, DDP_RECIPE, python, recipe_env, REPO, run_recipe

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402

FSDP_RECIPE = REPO / "recipes" / "fsdp_tp_pp" / "train.py"
DEEPSPEED_RECIPE = REPO / "recipes" / "deepspeed" / "train.py"
EXPORT = REPO / "recipes" / "export_hf.py"


def export_command(checkpoint: Path, out: Path, *extra: str):
    return python(EXPORT, str(checkpoint), "--out", str(out), *extra, env=recipe_env(), timeout=300)


# ---- the learning-rate schedule and gradient clipping


def test_the_learning_rate_schedule():
    """Linear warmup to --lr, then constant, or a cosine down to --lr/10 at --max-steps."""
    args = harness.new_parser("").parse_args([])
    args.lr, args.max_steps, args.warmup_steps = 1.0, 12, 2
    args.lr_schedule = "constant"
    assert [harness.learning_rate(args, step) for step in (1, 2, 3, 12)] == [0.5, 1.0, 1.0, 1.0]
    args.lr_schedule = "cosine"
    rates = [harness.learning_rate(args, step) for step in range(1, 13)]
    assert rates[:2] == [0.5, 1.0] and rates[-1] == pytest.approx(0.1)
    assert rates[6] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay (step 7 of 3..12): the middle
    assert all(a > b for a, b in zip(rates[1:], rates[2:]))


SCHEDULED = ["--seq-len", "32", "--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "3", "--optimizer",
             "sgd", "--lr", "2", "--lr-schedule", "cosine", "--warmup-steps", "2", "--clip-grad", "0.35"]
GPT = ("--n-layer", "2", "--n-head", "2", "--n-embd", "32")
SCHEDULE_RECIPES = {  # recipe -> its path and the options for the same small GPT (Megatron: megatron-core's own)
    "ddp": (DDP_RECIPE, GPT), "fsdp_tp_pp": (FSDP_RECIPE, (*GPT, "--tp", "1")), "deepspeed": (DEEPSPEED_RECIPE, GPT),
    "accelerate": (REPO / "recipes" / "accelerate" / "train.py", GPT),
    "megatron_tp_pp": (REPO / "recipes" / "megatron_tp_pp" / "train.py",
                       ("--num-layers", "2", "--num-heads", "2", "--hidden-size", "32", "--micro-batch", "8")),
}


@pytest.mark.parametrize("recipe", SCHEDULE_RECIPES)
def test_the_schedule_and_clipping_resume_exactly(recipe, tmp_path):
    """Warmup, cosine decay and clipping (the GPT's gradient norms here reach 0.74 and 0.39: clipped at 0.35),
    stopped after step 3 and resumed: the learning rates and the losses of the uninterrupted run, to the bit.
    The control (HPCML_TEST_FAULT=schedule-restart, DDP): a resume that starts the schedule again is caught,
    by more than 100x the parity tests' tolerance (measured: 480x)."""
    path, extra = SCHEDULE_RECIPES[recipe]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert_ok(run_recipe(path, straight, 1, *SCHEDULED, *extra))
    assert_ok(run_recipe(path, stopped, 1, *SCHEDULED, *extra, "--stop-at-step", "3"))
    resumed = run_recipe(path, stopped, 1, *SCHEDULED, *extra)
    assert_ok(resumed)
    assert "(step 3" in resumed.stdout
    expected = [record["lr"] for record in read_metrics(straight)["history"]]
    assert expected[:2] == [1.0, 2.0] and expected[-1] == pytest.approx(0.2)
    assert [record["lr"] for record in read_metrics(stopped)["history"]] == expected
    assert losses(read_metrics(stopped)) == losses(read_metrics(straight))
    norms = [record.get("grad_norm") for record in read_metrics(straight)["history"]]
    assert sum(norm > 0.35 for norm in norms) >= 2
    if recipe != "ddp":
        return
    restarted = tmp_path / "restarted"
    assert_ok(run_recipe(path, restarted, 1, *SCHEDULED, *extra, "--stop-at-step", "3"))
    assert_ok(run_recipe(path, restarted, 1, *SCHEDULED, *extra, HPCML_TEST_FAULT="schedule-restart"))
    assert [record["lr"] for record in read_metrics(restarted)["history"]][3] == 1.0  # warmup again at step 4
    assert caught(max_relative_difference(losses(read_metrics(restarted)), losses(read_metrics(straight))), PARITY_RTOL)


# ---- what cannot be done: one line, exit 2, before any rank trains


ACCELERATE_RECIPE = REPO / "recipes" / "accelerate" / "train.py"
BOTH, PREFLIGHT, PLAIN = ("preflight", "plain"), ("preflight",), ("plain",)


@pytest.mark.parametrize("case", ["tp-heads", "tp-lora", "pp-model", "lora-gpt", "lora-deepspeed", "warmup", "clip",
                                  "accelerate-cpu", "accelerate-heads", "accelerate-tp-gpt", "accelerate-layout"])
def test_a_fine_tuning_option_that_cannot_work_is_one_line_before_any_rank(case, tiny_llama, tmp_path):
    """--preflight WORLD checks the options for WORLD ranks, as slurm/lib/launch.sh runs it before srun; a plain
    run is one process (so a layout for 4 ranks is the preflight's to refuse). accelerate's --dp-shard/--tp
    (ParallelismConfig, GPUs only) is refused on a CPU by the ranks themselves: a login node's preflight
    passes it on to the GPU nodes."""
    hf = ["--model", f"hf:{tiny_llama}"]
    recipe, world, modes, args, message = {
        "tp-heads": (FSDP_RECIPE, 4, PREFLIGHT, [*hf, "--tp", "4"], "num_key_value_heads (the model's config) 2 is not "
                     "divisible by --tp 4: each TP rank takes whole heads (use a --tp that divides 2)"),
        "tp-lora": (FSDP_RECIPE, 4, PREFLIGHT, [*hf, "--tp", "2", "--lora-rank", "4"], "--lora-rank with --tp 2: LoRA's adapters"),
        "pp-model": (FSDP_RECIPE, 2, PREFLIGHT, [*hf, "--tp", "1", "--pp", "2"], f"--pp 2 with --model hf:{tiny_llama}: "
                     "the pipeline cuts the stack's GPT"),
        "lora-gpt": (DDP_RECIPE, 2, BOTH, ["--lora-rank", "4"], "--lora-rank wraps a Hugging Face model's linear layers"),
        "lora-deepspeed": (DEEPSPEED_RECIPE, 2, BOTH, [*hf, "--lora-rank", "4"], "--lora-rank: recipes/ddp and "
                           "recipes/fsdp_tp_pp fine-tune with LoRA; deepspeed does not"),
        "warmup": (DDP_RECIPE, 2, BOTH, ["--warmup-steps", "-1"], "--warmup-steps must be 0 (no warmup) or more, got -1"),
        "clip": (FSDP_RECIPE, 2, BOTH, ["--clip-grad", "nan"], "--clip-grad must be 0 (no clipping) or a positive norm"),
        "accelerate-cpu": (ACCELERATE_RECIPE, 1, PLAIN, [*hf, "--dp-shard", "1"], "--dp-shard/--tp: accelerate's "
                           "ParallelismConfig runs on GPUs only (it refuses a CPU world); on a CPU, recipes/fsdp_tp_pp"),
        "accelerate-heads": (ACCELERATE_RECIPE, 4, PREFLIGHT, [*hf, "--tp", "4"],
                             "num_key_value_heads (the model's config) 2 is not divisible by --tp 4"),
        "accelerate-tp-gpt": (ACCELERATE_RECIPE, 4, PREFLIGHT, ["--tp", "2"], "--tp 2: accelerate cuts a Hugging Face "
                              "model with its own TP plan; --model gpt has none here"),
        "accelerate-layout": (ACCELERATE_RECIPE, 4, PREFLIGHT, [*hf, "--dp-shard", "3", "--tp", "2"],
                              "--dp-shard 3 x --tp 2 = 6, but the job has 4 ranks"),
    }[case]
    for mode in modes:
        preflight = ["--preflight", str(world)] if mode == "preflight" else []
        result = python(recipe, "--out-dir", str(tmp_path / "run"), *args, "--max-steps", "1",
                        *preflight, env=recipe_env(), timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"[{recipe.parent.name}] error: "), \
            result.stderr
        assert message in lines[0], lines[0]
        assert not (tmp_path / "run" / "metrics.json").exists()


def test_the_export_command_refuses_what_it_cannot_export_in_one_line(tmp_path):
    """A run of the stack's GPT (its checkpoints are the model), a directory without checkpoints, an output
    directory that exists."""
    assert_ok(run_recipe(DDP_RECIPE, tmp_path / "gpt", 1, "--max-steps", "1", "--seq-len", "16"))
    (tmp_path / "empty").mkdir()
    for checkpoint, out, message in (
            (tmp_path / "gpt", tmp_path / "out", "is not from a Hugging Face model (--model hf:DIR): it trained the stack's GPT"),
            (tmp_path / "empty", tmp_path / "out", f"{tmp_path}/empty is neither a checkpoint"),
            (tmp_path / "gpt", tmp_path / "gpt", f"--out {tmp_path}/gpt exists and is not an empty directory")):
        result = export_command(checkpoint, out)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("[export_hf] error: "), result.stderr
        assert message in lines[0], lines[0]
