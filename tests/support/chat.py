"""Instruction data for the tests: a word-level tokenizer with a chat template (as an instruct model's directory
ships it), and conversations prepared with it by recipes/data/prepare.py --chat. conftest.py makes them once
per session (chat_model, sft_data); tests/test_data.py and the parity rows (tests/parity.toml: @sft) use them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .runs import REPO, recipe_env, run

PREPARE = REPO / "recipes" / "data" / "prepare.py"
# id = position in CHAT_WORDS: a test reads tokens back without the tokenizer
CHAT_WORDS = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "be", "brief", "what", "is", "two", "plus",
              "four", "and", "three", "seven", "name", "a", "colour", "blue", "the", "sky", "again"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def save_chat_tokenizer(directory: Path) -> Path:
    """A model directory's tokenizer files with a chat template: a word-level tokenizer over CHAT_WORDS, saved by
    transformers (in a process of its own: the test worker need not import transformers)."""
    made = run([sys.executable, "-c", f"""
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
words = {CHAT_WORDS!r}
tokenizer = Tokenizer(models.WordLevel({{w: i for i, w in enumerate(words)}}, unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|end|>")
fast.chat_template = {CHAT_TEMPLATE!r}
fast.save_pretrained({str(directory)!r})
"""], env=recipe_env(), timeout=300)
    assert made.returncode == 0, made.stderr
    return directory


def write_jsonl(path: Path, *records) -> Path:
    path.write_text("".join((record if isinstance(record, str) else json.dumps(record)) + "\n" for record in records))
    return path


def prepare_chat(chat_model: Path, out: Path, *inputs: Path, options=()) -> subprocess.CompletedProcess:
    return run([sys.executable, str(PREPARE), "--chat", str(chat_model), "--out", str(out), *map(str, inputs), *options],
               env=recipe_env(HF_HUB_OFFLINE="1"), timeout=300)


def uneven_answers(count: int = 16) -> list[dict]:
    """Prompt/completion records whose answers hold 1 to 13 words (2 to 14 trained tokens with the end marker):
    ranks and micro-batches then hold very different numbers of trained tokens."""
    answers = [" ".join((["four", "seven", "blue"] * 5)[:(i * 5) % 13 + 1]) for i in range(count)]
    return [{"prompt": ["what is two plus two", "name a colour"][i % 2], "completion": answer}
            for i, answer in enumerate(answers)]
