"""Your model instead of the stack's GPT (--model, recipes/harness/model.py): a Hugging Face causal LM from a
local directory, and your own torch.nn.Module and dataset. Their parity on DDP, accelerate and DeepSpeed ZeRO-3
against one process, and their controls, are rows of tests/parity.toml; here, the rest: what the logs say of
your model (MFU from its config, or n/a), the loss is the model's own (the recipe's loss on a sequence equals
Hugging Face's ``labels=`` loss; the easy mistake with pre-shifted targets, ``labels=targets``, shifted twice,
is caught), the export loads and gives the trained model's logits, a stopped run resumes to the bit, and
every model or dataset that cannot be used is one line before any rank starts.

Nothing is downloaded: the tests make a tiny Llama (LlamaConfig + save_pretrained, 106,816 parameters) and
use recipes/examples/bigram.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from support.curves import losses, PARITY_RTOL, read_metrics
from support.runs import accelerate_launch, assert_ok, DDP_RECIPE, EVAL, python, recipe_env, REPO, run_recipe

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402

SHORT = ["--seq-len", "32", "--log-every", "1", "--global-batch", "8", "--max-steps", "4", "--checkpoint-every", "0",
         "--no-resume", "--optimizer", "sgd", "--lr", "0.5", *EVAL]
BIGRAM = f"{REPO / 'recipes' / 'examples' / 'bigram.py'}:build"
FIELDS = REPO / "recipes" / "examples" / "fields.py"
EXPORT = REPO / "recipes" / "export_hf.py"


def model_args(which: str, tiny_llama: Path, fields_file: Path) -> list[str]:
    return {"hugging-face": ["--model", f"hf:{tiny_llama}"], "own-module": ["--model", BIGRAM],
            "own-data": ["--model", f"{FIELDS}:model", "--dataset", f"{FIELDS}:dataset", "--data", str(fields_file)],
            }[which]


@pytest.mark.parametrize("which", ["hugging-face", "own-module", "own-data"])
def test_the_log_says_what_it_can_of_your_model(tiny_llama, fields_file, tmp_path, which):
    """MFU from a Hugging Face model's config; a module that declares none says n/a; fields, not tokens: no
    tokens/s (and the CNN learns the stencil: its loss halves)."""
    result = run_recipe(DDP_RECIPE, tmp_path, 1, *model_args(which, tiny_llama, fields_file), *SHORT)
    assert_ok(result)
    metrics = read_metrics(tmp_path)
    assert metrics["model"] == model_args(which, tiny_llama, fields_file)[1]
    if which == "hugging-face":
        assert metrics["summary"]["mean_mfu"] > 0 and "MFU" in result.stdout
    else:
        assert metrics["summary"]["mean_mfu"] is None and "MFU n/a" in result.stdout
    if which == "own-data":
        assert metrics["summary"]["mean_tokens_per_s"] is None and "tokens/s" not in result.stdout
        assert losses(metrics)[-1] < losses(metrics)[0] / 2


def test_a_pipeline_of_a_hugging_face_model_is_refused_on_deepspeed(tiny_llama, tmp_path):
    result = python(REPO / "recipes" / "deepspeed" / "train.py", "--out-dir", str(tmp_path),
                    "--model", f"hf:{tiny_llama}", *SHORT, "--pp", "2", "--preflight", "2", env=recipe_env(), timeout=120)
    assert result.returncode == 2 and "the pipeline splits the stack's GPT" in result.stderr, result.stderr


def test_the_loss_is_the_models_own_labels_loss_and_a_double_shift_is_caught(tiny_llama):
    """On the same tokens, the recipe's loss (logits for inputs against targets = inputs one ahead) equals the
    model's own labels= loss on the whole sequence (it shifts inside). The control, labels=targets, shifts
    twice. An untrained model predicts every token almost alike (the two losses differed by 0.08%), so the
    model first learns a sequence through the recipe's loss; the double shift then asks it for the token two
    ahead, which it does not predict."""
    args = harness.new_parser("").parse_args([])
    args.model, args.seq_len = f"hf:{tiny_llama}", 32
    spec = harness.model_spec(args)
    wrapped = spec.build()
    torch.manual_seed(1)
    tokens = (torch.arange(33) * 7 + torch.arange(4)[:, None] * 31) % 256  # 4 rows, each its own steps of 7
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for _ in range(40):
        wrapped(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        ours = float(wrapped(inputs, targets))
        theirs = float(wrapped.model(input_ids=tokens, labels=tokens).loss)
        shifted_twice = float(wrapped.model(input_ids=inputs, labels=targets).loss)
    assert abs(ours - theirs) / theirs <= 1e-6, (ours, theirs)
    assert theirs < 0.5 and abs(shifted_twice - theirs) / theirs > 100 * PARITY_RTOL, (shifted_twice, theirs)


@pytest.mark.parametrize("recipe", ["ddp", "accelerate"])
def test_the_exported_model_loads_and_gives_the_trained_models_logits(tiny_llama, tmp_path, recipe):
    """--export-hf DIR after 2 ranks trained: from_pretrained(DIR) on one process gives the logits of the
    trained weights (the run's last checkpoint, loaded into the source model) within 1e-5, and the
    source's tokenizer files come along; the export differs from the untrained model (it really trained)."""
    from transformers import AutoModelForCausalLM

    export = tmp_path / "exported"
    args = ["--model", f"hf:{tiny_llama}", *SHORT, "--export-hf", str(export)]
    if recipe == "ddp":
        result = run_recipe(DDP_RECIPE, tmp_path / "run", 2, *args)
    else:
        result = accelerate_launch(REPO / "recipes" / "accelerate" / "train.py", tmp_path / "run", 2, *args)
    assert_ok(result)
    assert f"exported the trained model to {export}" in result.stdout
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in export.iterdir()}
    assert not export.with_name("exported.partial").exists()

    trained = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True)
    if recipe == "ddp":
        state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000004.pt", weights_only=True)["model"]
    else:  # accelerate's save_state (torch's format)
        state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000004" / "pytorch_model.bin", weights_only=True)
    trained.load_state_dict({name.removeprefix("model."): tensor for name, tensor in state.items()})
    exported = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    untrained = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs, before = (m(input_ids=tokens).logits for m in (exported, trained, untrained))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - before).abs().max() > 1e-3
    # recipes/export_hf.py on the run directory (its newest checkpoint): the same model
    exported = python(EXPORT, str(tmp_path / "run"), "--out", str(tmp_path / "again"),
                      env=recipe_env(), timeout=300)
    assert_ok(exported)
    assert {"ddp": "the DDP recipe's checkpoint file", "accelerate": "accelerate's save_state"}[recipe] in exported.stdout
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", local_files_only=True)(input_ids=tokens).logits
    torch.testing.assert_close(again, ours, rtol=0, atol=1e-6)


@pytest.mark.parametrize("which", ["hugging-face", "own-data"])
def test_your_model_resumes_on_the_same_curve(tiny_llama, fields_file, tmp_path, which):
    """Stopped after step 2 and run again: the losses of an uninterrupted run, to the bit (the model's state,
    the optimizer's and, for --dataset, the data position: the step)."""
    args = [*model_args(which, tiny_llama, fields_file), *SHORT[:-len(EVAL)], "--checkpoint-every", "2"]
    args.remove("--no-resume")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert_ok(run_recipe(DDP_RECIPE, straight, 2, *args))
    assert_ok(run_recipe(DDP_RECIPE, stopped, 2, *args, "--stop-at-step", "2"))
    resumed = run_recipe(DDP_RECIPE, stopped, 2, *args)
    assert_ok(resumed)
    assert "(step 2)" in resumed.stdout
    assert losses(read_metrics(stopped)) == losses(read_metrics(straight))


@pytest.mark.parametrize("case", ["missing", "not-a-model", "no-weights", "small-vocabulary", "no-module",
                                  "no-factory", "not-a-module", "factory-no-args", "factory-raises", "forward-one-arg",
                                  "loss-not-scalar", "no-form", "export-not-hf", "export-exists",
                                  "dataset-no-module", "dataset-not-tensors", "dataset-empty", "dataset-fails"])
def test_a_model_that_cannot_be_used_is_one_line_before_any_rank(tiny_llama, tmp_path, case):
    """--preflight (what slurm/lib/launch.sh runs before srun) and a plain run: one line, exit 2."""
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text((tiny_llama / "config.json").read_text())
    (tmp_path / "empty").mkdir()
    (tmp_path / "mine.py").write_text("import torch\ndef build(args):\n    return 'not a module'\n"
                                      "def numbers(args, split):\n    return list(range(10))\n"
                                      "def nothing(args, split):\n    return []\n"
                                      "def bare():\n    return torch.nn.Linear(2, 2)\n"
                                      "def fails(args):\n    raise ValueError('no such width')\n"
                                      "class Embed(torch.nn.Module):\n"
                                      "    def __init__(self):\n        super().__init__(); self.e = torch.nn.Embedding(512, 4)\n"
                                      "    def forward(self, inputs, targets=None):\n        return self.e(inputs).mean(-1)\n"
                                      "def per_token(args):\n    return Embed()\n"
                                      "class Lone(Embed):\n    def forward(self, inputs):\n        return self.e(inputs).mean()\n"
                                      "def lone(args):\n    return Lone()\n")
    model, extra, message = {
        "missing": (f"hf:{tmp_path}/nowhere", [], f"--model hf:{tmp_path}/nowhere: {tmp_path}/nowhere is not a directory"),
        "not-a-model": (f"hf:{tmp_path}/empty", [], "has no config.json: it is not a Hugging Face model directory"),
        "no-weights": (f"hf:{tmp_path}/config-only", [], "has config.json but no weights (model.safetensors"),
        "small-vocabulary": (f"hf:{tiny_llama}", ["--vocab-size", "300"],
                             "takes 256 token ids, fewer than --vocab-size 300: use --vocab-size 256 or less"),
        "no-module": ("no_such_module:build", [], "cannot import no_such_module: ModuleNotFoundError"),
        "no-factory": (f"{tmp_path}/mine.py:make", [], f"{tmp_path}/mine.py has no function make"),
        "not-a-module": (f"{tmp_path}/mine.py:build", [], "build(args) returned str, not a torch.nn.Module"),
        "factory-no-args": (f"{tmp_path}/mine.py:bare", [], "bare must take one argument, the run's options"),
        "factory-raises": (f"{tmp_path}/mine.py:fails", [], f"fails(args) raised ValueError: no such width ({tmp_path}/mine.py:"),
        "forward-one-arg": (f"{tmp_path}/mine.py:lone", [], "Lone.forward must take (inputs, targets)"),
        "loss-not-scalar": (f"{tmp_path}/mine.py:per_token", [], "Embed.forward(inputs, targets) returned (16, 64), not the "
                            "batch's mean loss (a scalar float tensor)"),
        "no-form": ("llama", [], "--model llama: use gpt, hf:DIR (a Hugging Face model directory) or MODULE:FACTORY"),
        "export-not-hf": (BIGRAM, ["--export-hf", str(tmp_path / "out")], "--export-hf writes a Hugging Face model "
                          "directory: it needs --model hf:DIR"),
        "export-exists": (f"hf:{tiny_llama}", ["--export-hf", str(tmp_path / "mine.py")],
                          f"--export-hf {tmp_path}/mine.py exists and is not an empty directory"),
        "dataset-no-module": ("gpt", ["--dataset", "no_such_data:build"], "cannot import no_such_data: ModuleNotFoundError"),
        "dataset-not-tensors": ("gpt", ["--dataset", f"{tmp_path}/mine.py:numbers"],
                                "item 0 of its train data is int, not a pair of tensors (inputs, targets)"),
        "dataset-empty": ("gpt", ["--dataset", f"{tmp_path}/mine.py:nothing"], "its train data has no items"),
        # (readable, but a directory: the factory's own error; one not readable: tests/unit/test_mounts.py)
        "dataset-fails": ("gpt", ["--dataset", f"{FIELDS}:dataset", "--data", str(tmp_path)],
                          f"its train data fails: FileNotFoundError: --data {tmp_path} is not an HDF5 file"),
    }[case]
    # (the factory's result is known only once it is built: on each rank, before the first step)
    built = ("not-a-module", "factory-raises", "forward-one-arg", "loss-not-scalar")  # (known once it is built)
    for preflight in ([] if case in built else [["--preflight", "2"]]) + [[]]:
        result = python(DDP_RECIPE, "--out-dir", str(tmp_path / "run"), "--model", model, *extra,
                        "--max-steps", "1", *preflight, env=recipe_env(), timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("[ddp] error: --"), result.stderr
        assert message in lines[0], lines[0]
        assert not (tmp_path / "run" / "metrics.json").exists()
