"""Instruction data (prepare.py --chat MODEL_DIR): JSONL conversations -> a token file and its loss mask.

    python recipes/data/prepare.py --chat path/to/model --out data/sft/tokens train.jsonl --seq-len 2048
    python recipes/data/prepare.py --chat path/to/model --out data/sft/tokens qa.jsonl \
        --prompt-field question --completion-field answer --train-on all --too-long truncate

Each line of a .jsonl input is one conversation, in one of the common shapes:
- ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`` (--messages-field), or
- ``{"prompt": "...", "completion": "..."}`` (--prompt-field, --completion-field): a user turn and its answer.
The model's own chat template (the tokenizer files in MODEL_DIR, read offline) renders it, through transformers'
``apply_chat_template``. The loss mask marks the tokens that are trained: those of the assistant turns (the
default; found by rendering the conversation up to each answer, with and without it), or every token
(--train-on all). A conversation longer than --seq-len + 1 tokens is dropped (default) or truncated
(--too-long truncate); the summary counts both. Bad data is one line naming the file and line.

Written: PREFIX.bin/.idx (one document per conversation: the document boundaries), PREFIX.mask.bin/.idx (the
same layout, uint8: 1 = trained, 0 = context) and PREFIX.json (with "loss_mask", the template and the counts).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared harness
import harness  # noqa: E402
from harness.data import write_token_file  # noqa: E402

PREPARE = "prepare"
ROLES = ("system", "user", "assistant", "tool")


def add_options(p) -> None:
    g = p.add_argument_group("instruction data (--chat MODEL_DIR)")
    g.add_argument("--chat", type=Path, default=None, metavar="MODEL_DIR",
                   help="a Hugging Face model directory whose tokenizer and chat template render .jsonl conversations")
    g.add_argument("--messages-field", default="messages")
    g.add_argument("--prompt-field", default="prompt")
    g.add_argument("--completion-field", default="completion")
    g.add_argument("--train-on", choices=("assistant", "all"), default="assistant",
                   help="the tokens the loss trains: the assistant turns' (default), or every token")
    g.add_argument("--seq-len", type=int, default=2048, help="the recipes' --seq-len: longer conversations are too long")
    g.add_argument("--too-long", choices=("drop", "truncate"), default="drop",
                   help="a conversation over --seq-len + 1 tokens: left out (default), or cut (its answer may be cut)")


def load_tokenizer(model_dir: Path):
    """The model directory's tokenizer with its chat template, offline; one line when it has neither."""
    if not model_dir.is_dir():
        raise harness.ConfigError(f"--chat {model_dir}: not a directory (a Hugging Face model directory with its "
                                  "tokenizer files)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as error:
        raise harness.ConfigError(f"--chat {model_dir}: no tokenizer there ({str(error).splitlines()[0][:160]})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise harness.ConfigError(f"--chat {model_dir}: its tokenizer has no chat template (tokenizer_config.json's "
                                  "\"chat_template\", or chat_template.jinja): use the instruct model's tokenizer files")
    return tokenizer


def conversation(record, where: str, args) -> list[dict]:
    """The messages of one JSONL record, in either shape; ConfigError naming FILE:LINE when it is neither."""
    if not isinstance(record, dict):
        raise harness.ConfigError(f"{where}: not a JSON object")
    if args.messages_field in record:
        messages = record[args.messages_field]
        if not isinstance(messages, list) or not messages:
            raise harness.ConfigError(f"{where}: \"{args.messages_field}\" is not a non-empty list of messages")
        for number, message in enumerate(messages, 1):
            if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
                raise harness.ConfigError(f"{where}: message {number} is not {{\"role\": one of {', '.join(ROLES)}, "
                                          "\"content\": text}")
    elif args.prompt_field in record and args.completion_field in record:
        prompt, completion = record[args.prompt_field], record[args.completion_field]
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise harness.ConfigError(f"{where}: \"{args.prompt_field}\" and \"{args.completion_field}\" must be text")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    else:
        raise harness.ConfigError(f"{where}: neither \"{args.messages_field}\" nor \"{args.prompt_field}\" and "
                                  f"\"{args.completion_field}\": name the fields with --messages-field, or --prompt-field "
                                  "and --completion-field")
    answers = [message for message in messages if message["role"] == "assistant"]
    if not answers:
        raise harness.ConfigError(f"{where}: no assistant turn, nothing to train on")
    if any(not message["content"].strip() for message in answers):
        raise harness.ConfigError(f"{where}: an empty assistant answer")
    return messages


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokens_and_mask(tokenizer, messages: list[dict], train_on: str, where: str) -> tuple[list[int], list[int]]:
    """The conversation's token ids and its loss mask. An assistant turn's tokens are those its rendering adds
    after the prompt for it (the conversation so far and the generation prompt): rendered with and without
    the answer, the shorter must be the start of the longer, or the template cannot be masked this way."""
    tokens = render(tokenizer, messages, generation_prompt=False)
    if train_on == "all":
        return tokens, [1] * len(tokens)
    mask = [0] * len(tokens)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:turn], generation_prompt=True) if turn else []
        through = render(tokenizer, messages[:turn + 1], generation_prompt=False)
        if through[:len(before)] != before or tokens[:len(through)] != through or len(through) == len(before):
            raise harness.ConfigError(f"{where}: the chat template does not render this conversation as a series of "
                                      f"prefixes (turn {turn + 1}), so its answers cannot be masked: use --train-on all")
        mask[len(before):len(through)] = [1] * (len(through) - len(before))
    return tokens, mask


def prepare_instructions(args, files: list[Path]) -> int:
    import numpy as np

    tokenizer = load_tokenizer(args.chat)
    documents, masks, too_long, truncated = [], [], 0, 0
    for path in files:
        if path.suffix != ".jsonl":
            raise harness.ConfigError(f"{path}: --chat takes .jsonl files, one conversation per line")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError:
                raise harness.ConfigError(f"{where}: not valid JSON") from None
            tokens, mask = tokens_and_mask(tokenizer, conversation(record, where, args), args.train_on, where)
            if len(tokens) > args.seq_len + 1:
                if args.too_long == "drop":
                    too_long += 1
                    continue
                tokens, mask = tokens[:args.seq_len + 1], mask[:args.seq_len + 1]
                if not any(mask[1:]):  # (the first token is never a target)
                    too_long += 1
                    continue
                truncated += 1
            documents.append(np.asarray(tokens, dtype=np.int64))  # (written as uint16, or int32 past 65536 ids)
            masks.append(np.asarray(mask, dtype=np.uint8))
    if len(documents) < 2:
        raise harness.ConfigError(f"the inputs hold {len(documents)} usable conversations ({too_long} longer than --seq-len "
                                  f"{args.seq_len} + 1 left out): a training and a validation split need at least 2")
    validation = max(1, round(len(documents) * args.valid_fraction))
    template = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()[:16]
    meta = write_token_file(args.out, documents, vocab_size=len(tokenizer), validation_documents=validation,
                            tokenizer=f"huggingface: {args.chat.resolve()} ({len(tokenizer)} ids)", loss_masks=masks,
                            extra={"inputs": [str(p) for p in args.inputs], "chat_template_sha256": template,
                                   "train_on": args.train_on, "seq_len": args.seq_len, "too_long": args.too_long,
                                   "dropped_too_long": too_long, "truncated": truncated})
    print(f"[{PREPARE}] wrote {args.out}.bin/.idx/.json and {args.out}.mask.bin/.idx: {meta['documents']} conversations "
          f"({validation} for validation), {meta['tokens']:,} tokens, {meta['loss_mask']['trained_tokens']:,} trained "
          f"({args.train_on}); longer than --seq-len {args.seq_len} + 1: {too_long} dropped, {truncated} truncated")
    return 0
