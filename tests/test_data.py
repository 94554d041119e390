"""Real data: recipes/data/prepare.py writes megatron-core's indexed-dataset format from real text (the
Python standard library's own sources), megatron-core reads the same tokens (its IndexedDataset, and the
GPTDataset the Megatron recipe trains on), every recipe trains on it
with --data, two DDP ranks match one process on it, a resume continues mid-epoch on the same curve, and
broken token files are refused with one line before any rank starts. (Every recipe trains on a token
file in tests/test_warnings.py's one-process runs.)

Tolerance: as tests/parity.toml (relative difference of the per-step loss <= 1e-5, plain SGD), with
its negative control (gradients summed over the ranks) caught by more than 100x.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest

from support.curves import caught, eval_losses, losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.chat import CHAT_WORDS, prepare_chat, write_jsonl
from support.runs import assert_ok, fault, recipe_env, python, REPO, run, run_single, run_torchrun, torchrun

PREPARE = REPO / "recipes" / "data" / "prepare.py"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SGD = ["--optimizer", "sgd", "--lr", "1.0", "--checkpoint-every", "0", "--no-resume"]


def prepare(out: Path, *inputs: Path | str, **kwargs) -> subprocess.CompletedProcess:
    return run([sys.executable, str(PREPARE), "--out", str(out), "--workers", "2", *map(str, inputs)],
               env=recipe_env(), timeout=300, **kwargs)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two packages of the standard library: about 40 files, 0.4 M tokens."""
    prefix = tmp_path_factory.mktemp("data") / "stdlib"
    assert_ok(prepare(prefix, STDLIB / "json", STDLIB / "email"))
    return prefix


def test_prepare_writes_megatrons_format_and_megatron_reads_the_same_tokens(corpus):
    meta = json.loads(Path(f"{corpus}.json").read_text())
    assert meta["format"] == "megatron-indexed-dataset-v1" and meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    documents = meta["documents"]
    assert documents > 30 and meta["splits"] == {"train": [0, documents - 2], "validation": [documents - 2, documents]}
    source = (STDLIB / "json" / "__init__.py").read_bytes()
    stream = np.fromfile(f"{corpus}.bin", dtype=np.uint16)
    assert stream.size == meta["tokens"] > 300_000 and bytes(stream.astype(np.uint8)).find(source) >= 0

    with warnings.catch_warnings():  # megatron-core's import-time notices (no TE/apex here), not this test's
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(corpus))  # megatron-core's own reader of its format
    assert len(dataset) == documents
    assert np.array_equal(np.concatenate([dataset[i] for i in range(documents)]), stream)

    sys.path.insert(0, str(REPO / "recipes"))
    from harness.data import TokenFileData

    data = TokenFileData(corpus, seq_len=64, seed=7)
    train_tokens = np.concatenate([dataset[i] for i in range(documents - 2)])
    assert data.tokens.size == train_tokens.size and isinstance(data.tokens, np.memmap)
    inputs, targets = data.numpy_global_batch(step=5, batch_size=4)
    for row, sample in enumerate(range(20, 24)):  # samples 20..23 of epoch 0, at their shuffled positions
        start_token = int(data.order(0)[sample]) * 64
        assert np.array_equal(inputs[row], train_tokens[start_token:start_token + 64])
        assert np.array_equal(targets[row], train_tokens[start_token + 1:start_token + 65])
    validation = TokenFileData(corpus, seq_len=64, seed=7, split="validation")
    assert validation.tokens.size == stream.size - train_tokens.size


def test_megatrons_gpt_dataset_draws_the_same_split_and_the_same_tokens_as_the_memmap_reader(corpus, tmp_path):
    """The Megatron recipe's --data goes through megatron-core's GPTDataset (recipes/megatron_tp_pp/megatron_data.py):
    its train and validation splits hold exactly the sidecar's documents, and every sample it draws is the
    window of --seq-len + 1 tokens that the memmap reader (harness.data) gives for the documents and offsets
    megatron's own index names."""
    import argparse

    sys.path[:0] = [str(REPO / "recipes"), str(REPO / "recipes" / "megatron_tp_pp")]
    import megatron_data
    from harness.data import TokenFileData

    meta = json.loads(Path(f"{corpus}.json").read_text())
    args = argparse.Namespace(data=str(corpus), seed=7, seq_len=64, max_steps=20, global_batch=8, eval_batches=3)
    with warnings.catch_warnings():  # megatron-core's import-time notices (no TE/apex here)
        warnings.simplefilter("ignore")
        built = megatron_data.build(args, tmp_path / "cache")
    for data, split in zip(built, ("train", "validation")):
        dataset, ours = data.dataset, TokenFileData(corpus, seq_len=64, seed=7, split=split)
        assert set(dataset.document_index.tolist()) == set(range(*meta["splits"][split])), split
        samples = len(dataset)
        assert samples >= (20 if split == "train" else 3) * 8
        for index in range(0, samples, max(1, samples // 50)):
            position = dataset.shuffle_index[index]
            (first, offset), (last, _) = dataset.sample_index[position], dataset.sample_index[position + 1]
            documents = dataset.document_index[first:last + 1]
            text = np.concatenate([ours.document(int(d)) for d in documents])[offset:offset + 65]
            sample = dataset[index]
            assert np.array_equal(sample["tokens"].numpy(), text[:-1]) and np.array_equal(sample["labels"].numpy(), text[1:])
        # step s is samples s * B onwards, rank r of 2 its half (the same global batch at any layout)
        inputs, targets = data.local_batch(2, 8, rank=1, world_size=2)
        assert np.array_equal(inputs[0].numpy(), dataset[20]["tokens"].numpy()) and inputs.shape == targets.shape == (4, 64)
    assert list((tmp_path / "cache").glob("*GPTDataset-train-shuffle_index.npy"))  # megatron's index cache, not the data dir
    assert not (corpus.parent / "cache").exists()


def test_prepare_skips_unchanged_inputs_and_redoes_changed_ones(tmp_path):
    inputs = tmp_path / "inputs"
    shutil.copytree(STDLIB / "json", inputs)
    prefix = tmp_path / "out" / "tokens"
    assert_ok(prepare(prefix, inputs))
    written = Path(f"{prefix}.bin").stat().st_mtime_ns
    again = prepare(prefix, inputs)
    assert_ok(again)
    assert "up to date" in again.stdout and Path(f"{prefix}.bin").stat().st_mtime_ns == written
    with open(inputs / "decoder.py", "a") as extra:
        extra.write("# one more line\n")
    changed = prepare(prefix, inputs)
    assert_ok(changed)
    assert "wrote" in changed.stdout and json.loads(Path(f"{prefix}.json").read_text())["tokens"] > 0
    assert not list(prefix.parent.glob("*.partial"))


def test_prepare_trains_a_bpe_on_the_corpus_reuses_it_and_a_recipe_trains_on_it(tmp_path):
    """--tokenizer bpe:N trains a byte-level BPE on the inputs (HuggingFace tokenizers, offline) and saves it
    beside the data; the same tokenizer.json given back as --tokenizer FILE writes the same tokens; a recipe
    refuses the file at the default --vocab-size, in one line, and trains on it at --vocab-size N."""
    from tokenizers import Tokenizer

    prefix = tmp_path / "bpe" / "tokens"
    assert_ok(prepare(prefix, STDLIB / "json", "--tokenizer", "bpe:512"))
    meta = json.loads(Path(f"{prefix}.json").read_text())
    tokenizer_file = Path(f"{prefix}.tokenizer.json")
    assert meta["vocab_size"] == 512 and meta["tokenizer_file"] == str(tokenizer_file) and "512 ids" in meta["tokenizer"]
    source = (STDLIB / "json" / "__init__.py").read_text()  # the first input file: document 0
    stream = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
    first = stream[:int(np.fromfile(f"{prefix}.idx", dtype=np.int32, count=1, offset=34)[0])]
    assert Tokenizer.from_file(str(tokenizer_file)).decode(first.tolist()) == source
    assert stream.max() < 512 and meta["tokens"] < 0.6 * sum(len(p.read_bytes()) for p in (STDLIB / "json").glob("*.py"))

    again = tmp_path / "again" / "tokens"
    assert_ok(prepare(again, STDLIB / "json", "--tokenizer", str(tokenizer_file)))
    assert Path(f"{again}.bin").read_bytes() == Path(f"{prefix}.bin").read_bytes()

    refused = run_single(tmp_path / "run", "--data", str(prefix), "--preflight", "2")
    assert refused.returncode == 2 and "has 512 token ids, more than --vocab-size 256: use --vocab-size 512" in refused.stderr
    assert_ok(run_single(tmp_path / "run", "--data", str(prefix), "--vocab-size", "512", "--max-steps", "3",
                         "--eval-every", "3", "--eval-batches", "1"))
    assert read_metrics(tmp_path / "run")["summary"]["final_eval_loss"] > 0

    for spec, fragment in (("bpe:10", "bpe:N needs N between 257"), (str(tmp_path / "none.json"), "no such file")):
        result = prepare(tmp_path / "bad" / "tokens", STDLIB / "json", "--tokenizer", spec)
        assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_prepare_leaves_out_installed_packages_and_bytecode_caches(tmp_path):
    """The default corpus is the stdlib directory, which holds site-packages (different on every machine)."""
    inputs = tmp_path / "lib"
    for name in ("a.py", "b.txt", "site-packages/pkg/c.py", "dist-packages/d.py", "__pycache__/e.py"):
        (inputs / name).parent.mkdir(parents=True, exist_ok=True)
        (inputs / name).write_text(f"# {name}\n")
    assert_ok(prepare(tmp_path / "out" / "tokens", inputs))
    meta = json.loads((tmp_path / "out" / "tokens.json").read_text())
    assert meta["input_files"] == 2 and meta["tokens"] == len("# a.py\n# b.txt\n")


def test_prepare_refuses_an_empty_corpus_and_bad_jsonl_and_writes_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    for inputs, fragment in (([tmp_path / "empty"], "hold 0 non-empty documents"),
                             ([tmp_path / "bad.jsonl"], 'bad.jsonl:2: not a JSON object with a "text" field'),
                             ([tmp_path / "missing"], "does not exist")):
        result = prepare(tmp_path / "out" / "tokens", *inputs)
        errors = [line for line in result.stderr.splitlines() if line.startswith("[prepare] error: ")]
        assert result.returncode == 2 and len(errors) == 1, result.stderr
        assert fragment in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_prepare_refuses_an_out_prefix_under_a_file_in_one_line(tmp_path):
    """--out whose parent is a file ended in a NotADirectoryError traceback."""
    (tmp_path / "notes.txt").write_text("not a directory\n")
    (tmp_path / "text.txt").write_text("one document\n")
    result = prepare(tmp_path / "notes.txt" / "tokens", tmp_path / "text.txt")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"[prepare] error: --out {tmp_path}/notes.txt/tokens: {tmp_path}/notes.txt is a file, not a directory: give a "
        "prefix in a directory (it is created if missing)"], result.stderr


@pytest.mark.parametrize("runtime", [{}, {"SHIFTER_RUNTIME": "1"}], ids=["bare", "in-a-container"])
def test_data_naming_a_file_says_what_a_token_file_is_not_where_to_mount(corpus, tmp_path, runtime):
    """--data naming the text itself, or one of the three files: one line saying what --data takes (it said
    that PREFIX.json did not exist in the container, and suggested mounts, on a laptop too)."""
    text = tmp_path / "corpus.txt"
    text.write_text("some text to train on\n")
    for data, message in ((text, f"--data {text} is a file, not a token file: --data takes the PREFIX of "
                                 f"PREFIX.bin/.idx/.json; make them from your text with: python recipes/data/prepare.py "
                                 f"{text} --out {tmp_path}/corpus-tokens"),
                          (Path(f"{corpus}.bin"), f"--data {corpus}.bin names one file of a token file: give the prefix "
                                                  f"of the three, --data {corpus}")):
        result = python(REPO / "recipes" / "ddp" / "train.py", "--out-dir", str(tmp_path / "run"),
                        "--data", str(data), "--preflight", "2", env=recipe_env(**runtime), timeout=120)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"[ddp] error: {message}"], result.stderr


def broken(corpus: Path, tmp_path: Path, how: str) -> Path:
    """A copy of the corpus with one defect."""
    prefix = tmp_path / "broken"
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(f"{corpus}{suffix}", f"{prefix}{suffix}")
    if how == "missing-bin":
        os.remove(f"{prefix}.bin")
    elif how == "truncated-bin":
        os.truncate(f"{prefix}.bin", os.path.getsize(f"{prefix}.bin") - 2)
    elif how == "other-idx":
        index = bytearray(Path(f"{prefix}.idx").read_bytes())
        index[18:26] = (int.from_bytes(index[18:26], "little") - 1).to_bytes(8, "little")  # one sequence fewer
        Path(f"{prefix}.idx").write_bytes(bytes(index))
    elif how == "not-megatron-idx":
        Path(f"{prefix}.idx").write_bytes(b"not an index")
    return prefix


@pytest.mark.parametrize("how, args, fragment", [
    ("missing-bin", [], "broken.bin does not exist"),
    ("truncated-bin", [], "truncated or from another run"),
    ("other-idx", [], "does not belong to"),
    ("not-megatron-idx", [], "is not a megatron index (.idx) file"),
    ("whole", ["--vocab-size", "200"], "has 256 token ids, more than --vocab-size 200: use --vocab-size 256 or more"),
    ("whole", ["--seq-len", "100000000"], "fewer than one sample of --seq-len 100000000"),
    # the validation split (2 short documents) holds no sample of 20000 tokens: only refused when evaluating
    ("whole", ["--seq-len", "20000", "--eval-every", "5"], "the validation split has"),
])
def test_a_broken_token_file_is_refused_before_any_rank_starts(corpus, tmp_path, how, args, fragment):
    """slurm/lib/launch.sh runs the recipe's --preflight on the batch node before srun; the ranks check too."""
    prefix = broken(corpus, tmp_path, how)
    for extra in (["--preflight", "4"], []):
        result = run_single(tmp_path / "run", "--data", str(prefix), *args, *extra)
        assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.count("[ddp] error: ") == 1 and not (tmp_path / "run" / "metrics.json").exists()


def test_a_token_file_missing_inside_a_container_is_named_as_a_mount_problem(tmp_path):
    """In the image (here: as Shifter marks its containers), a prefix that is not there is most often one the
    runtime does not mount: the recipe's preflight says which mounts each runtime has."""
    prefix = tmp_path / "elsewhere" / "tokens"
    result = python(REPO / "recipes" / "ddp" / "train.py", "--out-dir", str(tmp_path / "run"),
                    "--data", str(prefix), "--preflight", "2", env=recipe_env(SHIFTER_RUNTIME="1"), timeout=120)
    assert result.returncode == 2 and result.stderr.count("[ddp] error: ") == 1, result.stderr
    assert f"{prefix}.json does not exist in this shifter container" in result.stderr
    assert f'Shifter: $SCRATCH, $HOME; podman and podman-hpc: CONTAINER_MOUNTS="{prefix.parent}"' in result.stderr


def test_two_ranks_on_real_data_match_one_process_and_the_control_is_caught(corpus, tmp_path):
    args = ["--data", str(corpus), "--global-batch", "8", "--max-steps", "5", *SGD]
    assert_ok(run_single(tmp_path / "one", *args))
    reference = read_metrics(tmp_path / "one")
    assert reference["config"]["data"] == str(corpus) and reference["world_size"] == 1
    # (each rank's batches read ahead by 2 DataLoader worker processes: the same rows, in the same order)
    assert_ok(run_torchrun(tmp_path / "two", 2, *args, "--data-workers", "2"))
    parallel = read_metrics(tmp_path / "two")
    assert parallel["world_size"] == 2 and parallel["backend"] == "gloo" and parallel["model_wrapper"] == "DistributedDataParallel"
    assert parallel["config"]["data_workers"] == 2 and reference["config"]["data_workers"] == -1  # (-1: none on a CPU)
    assert max_relative_difference(losses(parallel), losses(reference)) <= PARITY_RTOL
    # The data really is the corpus: the synthetic task's first loss differs (same weights, other tokens).
    assert_ok(run_single(tmp_path / "synthetic", *args[2:]))
    assert abs(losses(read_metrics(tmp_path / "synthetic"))[0] - losses(reference)[0]) > 1e-3
    assert_ok(run_torchrun(tmp_path / "control", 2, *args, **fault("grad-sum")))
    assert caught(max_relative_difference(losses(read_metrics(tmp_path / "control")), losses(reference)), PARITY_RTOL)


def test_megatron_on_real_data_two_ranks_match_one_process(corpus, tmp_path):
    """The Megatron recipe's GPTDataset path: TP 1 x DP 2 against one process, training and validation loss."""
    recipe = REPO / "recipes" / "megatron_tp_pp" / "train.py"
    args = ["--data", str(corpus), "--seq-len", "32", "--num-layers", "2", "--global-batch", "8", "--max-steps", "4",
            "--eval-every", "2", "--eval-batches", "2", *SGD, "--clip-grad", "0"]
    assert_ok(python(recipe, "--out-dir", str(tmp_path / "one"), *args, env=recipe_env(), timeout=300))
    assert_ok(torchrun(recipe, 2, "--out-dir", str(tmp_path / "two"), *args, env=recipe_env(HPCML_EXPECTED_WORLD_SIZE="2")))
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert two["layout"]["dp"] == 2 and two["world_size"] == 2 and one["world_size"] == 1
    assert max_relative_difference(losses(two), losses(one)) <= PARITY_RTOL
    assert len(eval_losses(one)) == 2 and max_relative_difference(eval_losses(two), eval_losses(one)) <= PARITY_RTOL
    assert list((tmp_path / "two" / "megatron_data_cache").glob("*GPTDataset-train-*"))


def test_a_resume_mid_epoch_continues_the_same_curve(tmp_path):
    """A corpus of 3 small files: 12 samples of 32 tokens per epoch, 4 per step, so 8 steps cross two epoch
    boundaries; stopped at step 5 (mid-epoch) and resumed, the losses are the uninterrupted run's, bit for bit.
    The control resumes at the first batch of the data instead, and is caught."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for name in ("__init__.py", "decoder.py"):
        shutil.copy(STDLIB / "json" / name, inputs / name)
    (inputs / "zz_validation.txt").write_text("held out\n")
    prefix = tmp_path / "tokens"
    assert_ok(prepare(prefix, inputs))
    seq_len = (json.loads(Path(f"{prefix}.json").read_text())["tokens"] - len("held out\n") - 1) // 12
    args = ["--data", str(prefix), "--seq-len", str(seq_len), "--global-batch", "4", "--max-steps", "8",
            "--checkpoint-every", "1", "--optimizer", "sgd", "--lr", "1.0"]
    assert_ok(run_single(tmp_path / "whole", *args))
    expected = losses(read_metrics(tmp_path / "whole"))
    for defect in (None, "resume-data-from-start"):
        out = tmp_path / f"resumed-{defect}"
        assert_ok(run_single(out, *args, "--stop-at-step", "5"))
        # (resumed with DataLoader workers reading ahead from the checkpoint's step on)
        assert_ok(run_single(out, *args, *([] if defect else ["--data-workers", "2"]), **fault(defect)))
        metrics = read_metrics(out)
        assert metrics["resumed_from_step"] == 5 and [r["step"] for r in metrics["history"]] == list(range(1, 9))
        if defect is None:
            assert losses(metrics) == expected
        else:
            assert caught(max_relative_difference(losses(metrics)[5:], expected[5:]), PARITY_RTOL)


# ---- instruction data (prepare.py --chat, recipes/data/instructions.py): conversations, chat template, loss mask

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"},
                  {"role": "assistant", "content": "four"}, {"role": "user", "content": "and three plus four"},
                  {"role": "assistant", "content": "seven"}]},
    {"prompt": "name a colour", "completion": "blue"},
    {"prompt": "what is the sky", "completion": "blue again"},
]


def read_documents_and_masks(prefix: Path) -> list[tuple[list[str], list[int]]]:
    """Each conversation's tokens (as words) and loss mask, read from the files as a recipe would."""
    meta = json.loads(Path(f"{prefix}.json").read_text())
    lengths = np.fromfile(f"{prefix}.idx", dtype=np.int32, count=meta["documents"], offset=34)
    assert np.array_equal(np.fromfile(f"{prefix}.mask.idx", dtype=np.int32, count=meta["documents"], offset=34), lengths)
    tokens = np.fromfile(f"{prefix}.bin", dtype=meta["dtype"])
    masks = np.fromfile(f"{prefix}.mask.bin", dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [([CHAT_WORDS[t] for t in tokens[a:b]], masks[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]


def test_chat_data_is_rendered_by_the_models_template_and_only_the_answers_are_trained(chat_model, tmp_path):
    """Both shapes (messages; prompt and completion), rendered by the template the model directory carries:
    the tokens trained are each answer and its end marker; system, user and generation-prompt tokens are
    context. --train-on all trains every token. Conversations are documents (their boundaries in the index)."""
    data = write_jsonl(tmp_path / "train.jsonl", *CONVERSATIONS)
    result = prepare_chat(chat_model, tmp_path / "sft" / "tokens", data, options=["--valid-fraction", "0.3"])
    assert_ok(result)
    documents = read_documents_and_masks(tmp_path / "sft" / "tokens")
    assert [[word for word, m in zip(words, mask) if m] for words, mask in documents] == [
        ["four", "<|end|>", "seven", "<|end|>"], ["blue", "<|end|>"], ["blue", "again", "<|end|>"]]
    assert documents[1][0] == ["<|user|>", "name", "a", "colour", "<|end|>", "<|assistant|>", "blue", "<|end|>"]
    meta = json.loads((tmp_path / "sft" / "tokens.json").read_text())
    assert meta["loss_mask"]["trained_tokens"] == 9 and meta["documents"] == 3 and meta["splits"]["validation"] == [2, 3]
    assert meta["train_on"] == "assistant" and meta["vocab_size"] == len(CHAT_WORDS)
    assert "9 trained (assistant)" in result.stdout, result.stdout
    assert_ok(prepare_chat(chat_model, tmp_path / "all" / "tokens", data, options=["--train-on", "all"]))
    assert all(all(mask) for _, mask in read_documents_and_masks(tmp_path / "all" / "tokens"))
    # Other field names, named by options
    renamed = write_jsonl(tmp_path / "qa.jsonl", {"q": "name a colour", "a": "blue"}, {"q": "what is the sky", "a": "blue"})
    assert_ok(prepare_chat(chat_model, tmp_path / "qa" / "tokens", renamed,
                           options=["--prompt-field", "q", "--completion-field", "a"]))


def test_bad_chat_data_is_one_line_with_the_file_and_line(chat_model, tmp_path):
    """The first case through the command line (one line on stderr, exit 2, nothing written); the others
    through prepare.py's main in this process (the same ConfigError, without a transformers import each)."""
    good = json.dumps(CONVERSATIONS[1])
    data = write_jsonl(tmp_path / "bad.jsonl", good, '{"question": "what", "answer": "four"}')
    result = prepare_chat(chat_model, tmp_path / "out" / "tokens", data)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"[prepare] error: {data}:2: neither \"messages\" nor \"prompt\" and \"completion\": name the fields with "
        "--messages-field, or --prompt-field and --completion-field"], result.stderr
    assert not (tmp_path / "out").exists()
    sys.path.insert(0, str(REPO / "recipes" / "data"))
    import prepare as prepare_module
    from harness.errors import ConfigError

    cases = [
        ([good, good, '{"prompt": "what", "completion": "  "}'], ":3: an empty assistant answer"),
        ([good, '{"messages": [{"role": "user", "content": "what"}]}'], ":2: no assistant turn, nothing to train on"),
        ([good, '{"messages": [{"role": "robot", "content": "x"}]}'], ":2: message 1 is not {\"role\": one of"),
        (["not json"], ":1: not valid JSON"),
        ([good], "the inputs hold 1 usable conversations"),
    ]
    for lines, fragment in cases:
        data = write_jsonl(tmp_path / "bad.jsonl", *lines)
        with pytest.raises(ConfigError) as refused:
            prepare_module.main(["--chat", str(chat_model), "--out", str(tmp_path / "out" / "tokens"), str(data)])
        assert fragment in str(refused.value), refused.value
        assert not (tmp_path / "out").exists()
    no_template = tmp_path / "plain"
    shutil.copytree(chat_model, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (no_template / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="its tokenizer has no chat template"):
        prepare_module.main(["--chat", str(no_template), "--out", str(tmp_path / "out" / "tokens"), str(data)])


def test_conversations_longer_than_the_window_are_dropped_or_truncated_and_counted(chat_model, tmp_path):
    """The first conversation renders to 23 tokens: with --seq-len 12 it is over 13. Dropped by default;
    truncated, it keeps its first 13 tokens and the part of its first answer they hold (one token, "four");
    cut where no answer token is left (--seq-len 10), it is dropped all the same."""
    data = write_jsonl(tmp_path / "train.jsonl", *CONVERSATIONS)
    dropped = prepare_chat(chat_model, tmp_path / "drop" / "tokens", data, options=["--seq-len", "12"])
    assert_ok(dropped)
    assert "longer than --seq-len 12 + 1: 1 dropped, 0 truncated" in dropped.stdout, dropped.stdout
    assert len(read_documents_and_masks(tmp_path / "drop" / "tokens")) == 2
    cut = prepare_chat(chat_model, tmp_path / "cut" / "tokens", data, options=["--seq-len", "12", "--too-long", "truncate"])
    assert_ok(cut)
    assert "longer than --seq-len 12 + 1: 0 dropped, 1 truncated" in cut.stdout, cut.stdout
    words, mask = read_documents_and_masks(tmp_path / "cut" / "tokens")[0]
    assert len(words) == 13 and [w for w, m in zip(words, mask) if m] == ["four"], (words, mask)
    nothing_left = prepare_chat(chat_model, tmp_path / "none" / "tokens", data,
                                options=["--seq-len", "10", "--too-long", "truncate"])
    assert_ok(nothing_left)
    assert "longer than --seq-len 10 + 1: 1 dropped, 0 truncated" in nothing_left.stdout, nothing_left.stdout


def test_a_recipe_that_does_not_apply_the_mask_refuses_instruction_data(chat_model, tmp_path):
    """A token file with a loss mask, trained as a plain token stream, would train the prompts and run
    conversations together: a recipe that does not apply the mask refuses it in one line before any rank starts;
    so does DDP (which does) a --seq-len that would cut the conversations, and a damaged mask file."""
    prefix = tmp_path / "sft" / "tokens"
    assert_ok(prepare_chat(chat_model, prefix, write_jsonl(tmp_path / "train.jsonl", *CONVERSATIONS),
                           options=["--seq-len", "32"]))
    from support.runs import assert_preflight_refuses, DDP_RECIPE

    megatron = REPO / "recipes" / "megatron_tp_pp" / "train.py"
    assert_preflight_refuses(megatron, tmp_path / "run", 1, ["--data", str(prefix), "--seq-len", "32"],
                             "is instruction data with a loss mask (prepare.py --chat), which megatron_tp_pp does not apply "
                             "yet: train it with recipes/ddp, accelerate, deepspeed or fsdp_tp_pp")
    fsdp, deepspeed = (REPO / "recipes" / name / "train.py" for name in ("fsdp_tp_pp", "deepspeed"))
    assert_preflight_refuses(fsdp, tmp_path / "run", 2, ["--data", str(prefix), "--seq-len", "32", "--tp", "1", "--pp", "2"],
                             "which a pipeline (--pp 2) does not weigh by trained tokens yet: train it with --pp 1")
    assert_preflight_refuses(deepspeed, tmp_path / "run", 2, ["--data", str(prefix), "--seq-len", "32", "--pp", "2"],
                             "which the DeepSpeed pipeline (--pp 2) does not weigh by trained tokens yet")
    assert_preflight_refuses(DDP_RECIPE, tmp_path / "run", 1, ["--data", str(prefix), "--seq-len", "16"],
                             "its conversations were prepared for --seq-len 32 and would be cut at 16")
    (Path(f"{prefix}.mask.bin")).write_bytes(b"\0")  # a damaged mask: the token file's own check names it
    assert_preflight_refuses(DDP_RECIPE, tmp_path / "run", 1, ["--data", str(prefix), "--seq-len", "32"],
                             "its loss mask (tokens.mask.bin, tokens.mask.idx) is missing or does not match its tokens")


SFT_ARGS = ["--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--log-every", "1", *SGD]


def test_ddp_on_instruction_data_matches_one_process_and_the_trainers_per_micro_batch_mean_is_caught(sft_data, tmp_path):
    """The loss of a step (and of an evaluation batch) is the cross-entropy summed over every trained token of the
    global batch, divided by their number (harness/data.py: loss_weights), whatever the layout. The rows hold 2 to 14
    trained tokens, so the ranks and micro-batches hold very different numbers: with the GPT, 2 DDP ranks match one
    process (tests/parity.toml's tolerance), and so does one process in 2 micro-batches; the negative control, each
    micro-batch's own mean averaged (Hugging Face Trainer's bug, transformers #34191), is caught by more than 100x."""
    args = ["--data", str(sft_data), *SFT_ARGS, "--global-batch", "4", "--max-steps", "6", "--eval-every", "3",
            "--eval-batches", "2"]
    assert_ok(run_single(tmp_path / "one", *args))
    reference = read_metrics(tmp_path / "one")
    assert_ok(run_torchrun(tmp_path / "two", 2, *args))
    parallel = read_metrics(tmp_path / "two")
    assert parallel["world_size"] == 2 and parallel["backend"] == "gloo" and parallel["model_wrapper"] == "DistributedDataParallel"
    assert max_relative_difference(losses(parallel), losses(reference)) <= PARITY_RTOL
    # (the validation loss too: each eval batch's loss over its trained tokens, the same on both)
    assert len(eval_losses(reference)) == 2 and max_relative_difference(eval_losses(parallel), eval_losses(reference)) <= PARITY_RTOL
    # --grad-accum on one process: the control, each micro-batch's own mean averaged (the Trainer's gradient-
    # accumulation bug itself), is caught. (On 2 ranks x 2 micro-batches, a Hugging Face model, every recipe that
    # takes instruction data, and the mask ignored: tests/parity.toml's @sft rows.)
    assert_ok(run_single(tmp_path / "accum", *args, "--grad-accum", "2"))
    assert max_relative_difference(losses(read_metrics(tmp_path / "accum")), losses(reference)) <= PARITY_RTOL
    assert_ok(run_single(tmp_path / "accum-control", *args, "--grad-accum", "2", **fault("rank-mean-loss")))
    assert caught(max_relative_difference(losses(read_metrics(tmp_path / "accum-control")), losses(reference)), PARITY_RTOL)


def document_spans(positions) -> list[tuple[int, int]]:
    """The [start, end) of each document in a packed row: a document starts where its position is 0."""
    starts = [int(i) for i in np.flatnonzero(np.asarray(positions) == 0)]
    return list(zip(starts, [*starts[1:], len(positions)]))


def test_a_packed_conversations_logits_are_its_logits_alone_and_unconfined_packing_is_caught(sft_data, tiny_llama, monkeypatch):
    """--pack: whole conversations share a window, each attending only to itself, at positions that restart with it.
    For the GPT (recipes/gpt.py: document_mask) and a Hugging Face Llama (transformers' own packed position ids,
    SDPA and eager attention), every conversation's logits inside a packed window equal its logits alone within
    1e-5, and no target crosses from one conversation into the next (the packed epoch trains exactly the tokens
    the padded one does). The control, packing as one sequence per window (HPCML_TEST_FAULT=pack-unconfined:
    positions that do not restart, attention across conversations), differs by more than 1e-3 for every
    conversation after a window's first."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "recipes"))
    from gpt import GPT, GPTConfig
    from harness.data import ConversationData, IGNORE
    from harness.hf_model import CausalLMLoss

    packed, padded = ConversationData(sft_data, 32, seed=0, pack=True), ConversationData(sft_data, 32, seed=0)
    summary = packed.packing_summary()
    n_train = padded.samples_per_epoch  # (16 conversations, 2 of them the validation split)
    assert summary["conversations"] == n_train == 14 and summary["windows"] == packed.samples_per_epoch
    assert summary["windows"] <= 8 and summary["fill"] > 1.5 * padded.packing_summary()["fill"], summary
    inputs, targets, positions = packed.global_batch(0, packed.samples_per_epoch)  # the whole epoch
    assert int((targets != IGNORE).sum()) == int((padded.global_batch(0, n_train)[1] != IGNORE).sum())
    for row in range(len(inputs)):
        for start, end in document_spans(positions[row]):
            assert end - start == 1 or int(targets[row, end - 1]) == IGNORE or end == inputs.shape[1]
    assert max(len(document_spans(row)) for row in positions) >= 3

    torch.manual_seed(0)
    models = {"gpt": GPT(GPTConfig(vocab_size=32, seq_len=32, n_layer=2, n_head=2, n_embd=32))}
    for attention in ("sdpa", "eager"):
        models[f"llama-{attention}"] = CausalLMLoss(AutoModelForCausalLM.from_pretrained(
            tiny_llama, dtype=torch.float32, attn_implementation=attention), 32)
    monkeypatch.setenv("HPCML_TEST_FAULT", "pack-unconfined")
    unconfined = ConversationData(sft_data, 32, seed=0, pack=True).global_batch(0, packed.samples_per_epoch)[2]
    monkeypatch.delenv("HPCML_TEST_FAULT")
    with torch.no_grad():
        for name, model in models.items():
            model.eval()
            confined_logits, unconfined_logits = model.logits(inputs, positions), model.logits(inputs, unconfined)
            worst, least_control = 0.0, float("inf")
            for row in range(len(inputs)):
                for index, (start, end) in enumerate(document_spans(positions[row])):
                    alone = model.logits(inputs[row:row + 1, start:end])[0]
                    worst = max(worst, float((confined_logits[row, start:end] - alone).abs().max()))
                    if index > 0 and int(inputs[row, start]) != 0:  # (a conversation after the first; not padding)
                        least_control = min(least_control, float((unconfined_logits[row, start:end] - alone).abs().max()))
            assert worst <= 1e-5, (name, worst)
            assert least_control > 1e-3, (name, least_control)


def test_ddp_packed_matches_one_process_with_the_gpt_and_a_hugging_face_model(sft_data, tiny_llama, tmp_path):
    """--pack under DDP, the GPT (2 ranks x 2 micro-batches) and a Hugging Face Llama (its position ids through
    the DDP wrapper): 2 ranks match one process within tests/parity.toml's tolerance, on windows that hold
    several conversations (the run records how full they are); stopped mid-epoch and resumed, the same curve."""
    for model, accumulate in (("gpt", ["--grad-accum", "2"]), (f"hf:{tiny_llama}", [])):
        args = ["--data", str(sft_data), *SFT_ARGS, "--global-batch", "4", "--max-steps", "4", "--pack",
                "--model", model, "--vocab-size", "256"]
        out = tmp_path / model.split(":")[0]
        assert_ok(run_single(out / "one", *args))
        assert_ok(run_torchrun(out / "two", 2, *args, *accumulate))
        reference, parallel = read_metrics(out / "one"), read_metrics(out / "two")
        assert parallel["world_size"] == 2 and parallel["model_wrapper"] == "DistributedDataParallel"
        assert parallel["conversations"]["packed"] and parallel["conversations"]["fill"] > 0.5, parallel["conversations"]
        assert len(losses(reference)) == 4 and max_relative_difference(losses(parallel), losses(reference)) <= PARITY_RTOL
        if model == "gpt":  # stopped after step 2 and resumed (read-ahead workers on): the same curve, to the bit,
            resumed = out / "resumed"  # across the epoch's end (9 windows, 4 a step)
            resumable = [arg for arg in args if arg != "--no-resume"] + accumulate + ["--checkpoint-every", "1"]
            assert_ok(run_torchrun(resumed, 2, *resumable, "--stop-at-step", "2"))
            assert_ok(run_torchrun(resumed, 2, *resumable, "--data-workers", "2"))
            assert read_metrics(resumed)["resumed_from_step"] == 2 and losses(read_metrics(resumed)) == losses(parallel)


def test_an_exported_instruction_tuned_model_answers_in_the_tuned_format(chat_model, tmp_path):
    """--export-hf after instruction tuning writes the tokenizer with its chat template beside the weights, so
    from_pretrained + apply_chat_template + generate answer as the model was tuned to. A tiny Llama on the chat
    tokenizer's ids, trained on questions whose answer is always "blue again" (packed, 2 ranks): greedy
    generation after the template's generation prompt returns "blue again <|end|>"; the untrained model, read
    the same way, does not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = tmp_path / "chat-llama"
    shutil.copytree(chat_model, source)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(CHAT_WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
                     ).save_pretrained(source)
    questions = ["what is two plus two", "name a colour", "what is the sky", "be brief", "name the sky again"]
    records = [{"prompt": question, "completion": "blue again"} for question in questions * 4]
    prefix = tmp_path / "sft" / "tokens"
    assert_ok(prepare_chat(source, prefix, write_jsonl(tmp_path / "train.jsonl", *records), options=["--seq-len", "16"]))
    exported = tmp_path / "tuned"
    assert_ok(run_torchrun(tmp_path / "run", 2, "--model", f"hf:{source}", "--vocab-size", str(len(CHAT_WORDS)), "--data",
                           str(prefix), "--seq-len", "16", "--pack", "--global-batch", "4", "--max-steps", "30", "--lr", "1e-2",
                           "--checkpoint-every", "0", "--no-resume", "--export-hf", str(exported)))
    assert (exported / "tokenizer_config.json").is_file()

    def answer(directory: Path) -> str:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "what is the sky"}], add_generation_prompt=True,
                                               return_dict=True, return_tensors="pt")["input_ids"]
        assert tokenizer.decode(prompt[0]) == "<|user|> what is the sky <|end|> <|assistant|>"  # (the template's own)
        with torch.no_grad():
            generated = model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        return tokenizer.decode(generated[0, prompt.shape[1]:])

    assert answer(exported) == "blue again <|end|>"
    assert answer(source) != "blue again <|end|>"
