"""Fine-tuning a Hugging Face model, sharded: FSDP2 and FSDP2 x TP (the model's own base_model_tp_plan) on
recipes/fsdp_tp_pp, LoRA (peft) on DDP and FSDP2, the learning-rate schedule and gradient clipping, and
recipes/export_hf.py, which turns any recipe's checkpoint of such a run into a Hugging Face directory.

Nothing is downloaded: the tiny Llama (4 heads, 2 key/value heads) and the HDF5 fields come from the
fixtures in tests/conftest.py. Parity as everywhere here: the same global batch, plain SGD, every step's
loss, validation loss and gradient norm within 1e-5 relative of one process, the wrapper and the parameters'
placements checked from inside the run, and a negative control per layout caught by more than 100x. Clipping
is on (--clip-grad below the gradient norm) in the sharded runs: a norm taken over one rank's shards instead
of the whole model would clip differently and fail the comparison.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import (PARITY_RTOL, caught, DDP_RECIPE, EVAL, REPO, assert_ok, eval_losses, grad_norms, losses,
                      max_relative_difference, read_metrics, recipe_env, run, run_recipe)
from test_models import model_args
from test_warnings import warnings_in

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402

FSDP_RECIPE = REPO / "recipes" / "fsdp_tp_pp" / "train.py"
DEEPSPEED_RECIPE = REPO / "recipes" / "deepspeed" / "train.py"
EXPORT = REPO / "recipes" / "export_hf.py"
SHORT = ["--seq-len", "32", "--log-every", "1", "--global-batch", "8", "--max-steps", "4", "--checkpoint-every", "0",
         "--no-resume", "--optimizer", "sgd", "--lr", "0.5", *EVAL]
CLIPPED = [*SHORT, "--clip-grad", "0.9"]  # (the tiny Llama's gradient norms: 0.87 to 0.98 over these steps)
# LoRA trains far fewer weights, so its curve moves less per step: a larger rate keeps the skipped all-reduce
# of its control more than 100x outside the tolerance (measured: 230x at 2, 39x at 0.5).
LORA = ["--lora-rank", "4", *SHORT, "--lr", "2"]
LAYOUTS = {  # name: (ranks, options, wrapper reported from inside)
    "fsdp2": (2, ["--tp", "1", "--dp-shard", "2"], "FSDP2"),
    "fsdp2xtp": (4, ["--tp", "2", "--dp-shard", "2"], "FSDP2+TP"),
}


def logits(directory: Path) -> torch.Tensor:
    """The logits of the Hugging Face model saved in ``directory``, loaded on one process, for fixed tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=tokens).logits


def export_command(checkpoint: Path, out: Path, *extra: str):
    return run([sys.executable, str(EXPORT), str(checkpoint), "--out", str(out), *extra], env=recipe_env(), timeout=300)


@pytest.fixture(scope="module")
def fsdp_reference(tiny_llama, tmp_path_factory) -> tuple[dict, Path]:
    """The tiny Llama on recipes/fsdp_tp_pp as one process, clipped, exported at the end."""
    out = tmp_path_factory.mktemp("fsdp-reference")
    assert_ok(run_recipe(FSDP_RECIPE, out / "run", 1, "--model", f"hf:{tiny_llama}", *CLIPPED, "--tp", "1",
                         "--export-hf", str(out / "export")))
    metrics = read_metrics(out / "run")
    assert metrics["model_wrapper"] == "none" and set(metrics["placements"].values()) == {"plain tensor"}
    assert max(grad_norms(metrics)) > 0.9  # clipping took part
    return metrics, out / "export"


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_hugging_face_model_sharded_matches_one_process_and_exports_whole(name, tiny_llama, fsdp_reference, tmp_path):
    """FSDP2 per decoder layer over 2 ranks, and FSDP2 x TP 2 x 2 with the model's base_model_tp_plan: the
    curve of one process, with no warning in the log; the q/k/v/o and MLP weights really are cut over TP (DTensors on the tp mesh
    dimension) and everything over dp_shard; --export-hf gathers the shards into a directory whose logits
    are the one-process export's within 1e-5; recipes/export_hf.py on the run's DCP checkpoint writes the
    same model."""
    reference, reference_export = fsdp_reference
    ranks, options, wrapper = LAYOUTS[name]
    export = tmp_path / "export"
    result = run_recipe(FSDP_RECIPE, tmp_path / "run", ranks, "--model", f"hf:{tiny_llama}", *CLIPPED, *options,
                        "--export-hf", str(export))
    assert warnings_in(result) == []  # (and it succeeded)
    metrics = read_metrics(tmp_path / "run")
    assert (metrics["world_size"], metrics["model_wrapper"], metrics["model"]) == (ranks, wrapper, f"hf:{tiny_llama}")
    cut = {name: text for name, text in metrics["placements"].items() if "'tp'" in text}
    if name == "fsdp2xtp":
        assert len(cut) == 14 and all(any(f".{layer}.weight" in key for layer in ("q_proj", "k_proj", "v_proj", "o_proj",
                                      "gate_proj", "up_proj", "down_proj")) for key in cut), sorted(cut)
    else:
        assert not cut
    assert all("dp_shard" in text for text in metrics["placements"].values())
    for curve in (losses, eval_losses, grad_norms):
        assert max_relative_difference(curve(metrics), curve(reference)) <= PARITY_RTOL, curve.__name__
    torch.testing.assert_close(logits(export), logits(reference_export), rtol=PARITY_RTOL, atol=PARITY_RTOL)

    again = export_command(tmp_path / "run", tmp_path / "from-checkpoint")
    assert_ok(again)
    assert "read a DCP checkpoint (fsdp_tp_pp)" in again.stdout
    torch.testing.assert_close(logits(tmp_path / "from-checkpoint"), logits(export), rtol=0, atol=1e-6)


@pytest.mark.parametrize("control, name", [("grad-sum", "fsdp2"), ("tp-no-reduce", "fsdp2xtp")])
def test_the_negative_control_of_each_sharded_layout_is_caught(control, name, tiny_llama, fsdp_reference, tmp_path):
    reference, _ = fsdp_reference
    ranks, options, _ = LAYOUTS[name]
    run_recipe(FSDP_RECIPE, tmp_path, ranks, "--model", f"hf:{tiny_llama}", *CLIPPED, *options, HPCML_TEST_FAULT=control)
    assert caught(max_relative_difference(grad_norms(read_metrics(tmp_path)), grad_norms(reference)), PARITY_RTOL)


@pytest.mark.parametrize("which", ["own-module", "own-data"])
def test_your_module_and_your_data_on_fsdp2_match_one_process(which, tiny_llama, fields_file, tmp_path):
    """The bigram LM (one FSDP2 unit: it declares no blocks) and the CNN on the HDF5 fields through --dataset."""
    arguments = [*model_args(which, tiny_llama, fields_file), *SHORT, "--tp", "1"]
    assert_ok(run_recipe(FSDP_RECIPE, tmp_path / "single", 1, *arguments))
    assert_ok(run_recipe(FSDP_RECIPE, tmp_path / "sharded", 2, *arguments, "--dp-shard", "2"))
    reference, metrics = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "sharded")
    assert (metrics["world_size"], metrics["model_wrapper"]) == (2, "FSDP2")
    assert all("dp_shard" in text for text in metrics["placements"].values())
    for curve in (losses, eval_losses, grad_norms):
        assert max_relative_difference(curve(metrics), curve(reference)) <= PARITY_RTOL, curve.__name__


@pytest.fixture(scope="module")
def lora_reference(tiny_llama, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("lora-reference")
    assert_ok(run_recipe(DDP_RECIPE, out / "run", 1, "--model", f"hf:{tiny_llama}", *LORA, "--export-hf", str(out / "export")))
    return read_metrics(out / "run"), out / "export"


@pytest.mark.parametrize("recipe", ["ddp", "fsdp2"])
def test_lora_matches_one_process_and_its_export_merges_the_adapters(recipe, tiny_llama, lora_reference, tmp_path):
    """--lora-rank 4 on 2 DDP ranks and on FSDP2 over 2 ranks, against one process: the same curve; only the
    adapters trained (the model's own weights frozen: the parameter count the logs give is the whole
    model's, the adapters are 4 per linear layer); the export merges them (its logits: the reference's
    export's; not the untrained model's) and keeps them alone in DIR/adapter; recipes/export_hf.py on the
    run's checkpoint writes the same model."""
    from safetensors.torch import load_file

    reference, reference_export = lora_reference
    export = tmp_path / "export"
    args = ["--model", f"hf:{tiny_llama}", *LORA, "--export-hf", str(export)]
    if recipe == "ddp":
        result = run_recipe(DDP_RECIPE, tmp_path / "run", 2, *args)
    else:
        result = run_recipe(FSDP_RECIPE, tmp_path / "run", 2, *args, "--tp", "1", "--dp-shard", "2")
    assert warnings_in(result) == []  # (and it succeeded)
    metrics = read_metrics(tmp_path / "run")
    assert metrics["world_size"] == 2 and metrics["model_wrapper"] == {"ddp": "DistributedDataParallel", "fsdp2": "FSDP2"}[recipe]
    for curve in (losses, eval_losses):
        assert max_relative_difference(curve(metrics), curve(reference)) <= PARITY_RTOL, curve.__name__
    adapter = load_file(export / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_A" in key or "lora_B" in key for key in adapter), sorted(adapter)
    assert not any("lora" in key for key in load_file(export / "model.safetensors"))  # merged: a plain Llama
    torch.testing.assert_close(logits(export), logits(reference_export), rtol=PARITY_RTOL, atol=PARITY_RTOL)
    assert (logits(export) - logits(tiny_llama)).abs().max() > 1e-3

    again = export_command(tmp_path / "run", tmp_path / "from-checkpoint")
    assert_ok(again)
    assert "LoRA rank 4" in again.stdout
    torch.testing.assert_close(logits(tmp_path / "from-checkpoint"), logits(export), rtol=0, atol=1e-6)


def test_lora_with_the_gradient_all_reduce_skipped_is_caught(tiny_llama, lora_reference, tmp_path):
    reference, _ = lora_reference
    result = run_recipe(DDP_RECIPE, tmp_path, 2, "--model", f"hf:{tiny_llama}", *LORA, HPCML_TEST_FAULT="no-grad-allreduce")
    assert result.returncode != 0 and "parameters differ across ranks" in result.stderr
    assert caught(max_relative_difference(losses(read_metrics(tmp_path)), losses(reference)), PARITY_RTOL)


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
        result = run([sys.executable, str(recipe), "--out-dir", str(tmp_path / "run"), *args, "--max-steps", "1",
                      *preflight], env=recipe_env(), timeout=120)
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
