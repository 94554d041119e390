"""Prepare a token file for the recipes' --data: text files or JSONL -> PREFIX.bin, PREFIX.idx, PREFIX.json.

    python recipes/data/prepare.py --out data/stdlib/tokens                 # the Python standard library's sources
    python recipes/data/prepare.py --out data/mine/tokens notes/ more.txt corpus.jsonl --workers 8
    python recipes/data/prepare.py --out data/bpe/tokens --tokenizer bpe:4096   # a BPE trained on the corpus itself
    python recipes/data/prepare.py --out data/llama/tokens --tokenizer path/to/tokenizer.json   # a local HF tokenizer
    python recipes/data/prepare.py --chat path/to/model --out data/sft/tokens train.jsonl   # instruction data: instructions.py
    make data                                                               # the first line
    torchrun --standalone --nproc_per_node=2 recipes/ddp/train.py --data data/stdlib/tokens

The format is megatron-core's indexed dataset (what Megatron-LM's preprocess_data.py writes: a .bin of
token ids, one sequence per document, and its .idx), so Megatron users bring what they have, plus a
sidecar PREFIX.json with the dtype, the vocabulary size, the tokenizer and the train/validation split
(the last --valid-fraction of the documents, at least one). --tokenizer:
- ``bytes`` (the default): a document's UTF-8 bytes are its token ids (256 of them: the recipes' default
  --vocab-size), so nothing is downloaded;
- ``bpe:N``: a byte-level BPE of N token ids trained on the corpus itself (HuggingFace ``tokenizers``,
  offline), saved beside the data as OUT.tokenizer.json;
- a ``tokenizer.json`` file: a HuggingFace tokenizer you have (offline; nothing is fetched).
A tokenizer larger than the recipes' default needs --vocab-size N on every recipe (they refuse a token
file whose vocabulary does not fit, with one line).

Inputs: files or directories (searched for --suffixes, leaving out site-packages, dist-packages and
__pycache__); a .jsonl file is one document per line, its "text" field. Documents are read in sorted path
order, tokenized by --workers processes, and written beside their final names, then renamed into place,
the sidecar last: an interrupted run leaves no PREFIX.json, and the recipes refuse the prefix. A rerun whose
inputs (paths, sizes, modification times), tokenizer and options have not changed finds PREFIX.json up to
date and does nothing.

On a cluster, prepare once on a login node into the shared file system (Perlmutter: $SCRATCH) and pass the
prefix to every rank: the files are read through np.memmap, each rank its own rows.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import multiprocessing
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared harness
import harness  # noqa: E402
from harness.data import read_token_file_meta, write_token_file  # noqa: E402

import instructions  # noqa: E402 (recipes/data/instructions.py, beside this file)

PREPARE = "prepare"
BYTE_TOKENIZER = "bytes (UTF-8, 256 ids)"
TOKENIZERS_PIN = "tokenizers==0.23.3"  # as requirements/cpu.txt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("inputs", nargs="*", type=Path,
                   help="files and directories (default: the Python standard library's source directory)")
    p.add_argument("--out", type=Path, required=True, help="the prefix to write: OUT.bin, OUT.idx, OUT.json")
    p.add_argument("--suffixes", default=".py,.txt,.md,.rst,.jsonl", help="what to take from directories")
    p.add_argument("--valid-fraction", type=float, default=0.05, help="the last documents, for evaluation")
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes (default), bpe:N (train an N-id byte-level BPE on the inputs), or a tokenizer.json file")
    p.add_argument("--workers", type=int, default=min(8, multiprocessing.cpu_count()))
    p.add_argument("--force", action="store_true", help="rewrite even when OUT.json is up to date")
    instructions.add_options(p)
    args = p.parse_args(argv)
    if args.chat is not None:
        if not args.inputs:
            raise harness.ConfigError("--chat needs the .jsonl files of conversations to prepare")
        harness.require_at_least_one(args, "seq_len")
        if args.tokenizer != "bytes":
            raise harness.ConfigError("--chat takes the tokenizer of its model directory: leave out --tokenizer")
    if not args.inputs:
        args.inputs = [Path(sysconfig.get_paths()["stdlib"])]
    if not 0 < args.valid_fraction < 1:
        raise harness.ConfigError(f"--valid-fraction must be between 0 and 1, got {args.valid_fraction}")
    harness.require_at_least_one(args, "workers")
    if args.out.is_dir() or str(args.out).endswith("/"):
        raise harness.ConfigError(f"--out {args.out} is a directory: give a prefix in it, e.g. --out {args.out / 'tokens'}")
    existing = next(parent for parent in args.out.absolute().parents if parent.exists())  # (/ exists)
    if not existing.is_dir():
        raise harness.ConfigError(f"--out {args.out}: {existing} is a file, not a directory: give a prefix in a "
                                  "directory (it is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise harness.ConfigError(f"--out {args.out}: {existing} is not writable by you: give a prefix in a directory "
                                  "you own (on Perlmutter: under $SCRATCH)")
    if args.tokenizer != "bytes":
        if args.tokenizer.startswith("bpe:"):
            size = args.tokenizer.removeprefix("bpe:")
            if not (size.isdigit() and 257 <= int(size) <= 65536):
                raise harness.ConfigError(f"--tokenizer {args.tokenizer}: bpe:N needs N between 257 (the bytes and one "
                                          "merge) and 65536, e.g. bpe:4096")
        elif not Path(args.tokenizer).is_file():
            raise harness.ConfigError(f"--tokenizer {args.tokenizer}: no such file (bytes, bpe:N, or a HuggingFace "
                                      "tokenizer.json on this machine)")
        if importlib.util.find_spec("tokenizers") is None:
            raise harness.ConfigError(f"--tokenizer {args.tokenizer} needs HuggingFace's tokenizers package: "
                                      f"pip install {TOKENIZERS_PIN} (make venv has it), or use --tokenizer bytes")
    return args


# Not text anyone wrote for this corpus: installed packages (the stdlib directory holds site-packages, whose
# contents differ from machine to machine) and bytecode caches.
SKIPPED_DIRECTORIES = {"site-packages", "dist-packages", "__pycache__"}


def input_files(inputs: list[Path], suffixes: set[str]) -> list[Path]:
    files = set()
    for path in inputs:
        if path.is_dir():
            files.update(f for f in path.rglob("*") if f.is_file() and f.suffix in suffixes
                         and not SKIPPED_DIRECTORIES & set(f.relative_to(path).parts[:-1]))
        elif path.is_file():
            files.add(path)
        else:
            raise harness.ConfigError(f"input {path} does not exist")
    return sorted(files)


def inputs_digest(files: list[Path], args: argparse.Namespace) -> str:
    """What decides the output: every input's path, size and modification time, the tokenizer (a file's
    contents), and the options."""
    tokenizer = args.tokenizer
    if Path(tokenizer).is_file():
        tokenizer = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    digest = hashlib.sha256(json.dumps([BYTE_TOKENIZER, tokenizer, args.valid_fraction]).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def read_documents(path: Path) -> list[str]:
    """One file's documents as text (a .jsonl file: one per line, its "text"); no empty documents."""
    if path.suffix == ".jsonl":
        documents = []
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if line.strip():
                try:
                    documents.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    raise harness.ConfigError(f"{path}:{number}: not a JSON object with a \"text\" field") from None
        return [d for d in documents if d]
    text = path.read_bytes().decode("utf-8", errors="replace")  # valid UTF-8, as text tools write it
    return [text] if text else []


_hf_tokenizer = None  # the HuggingFace tokenizer of this worker process (pool initializer)


def load_hf_tokenizer(path: str | None) -> None:
    global _hf_tokenizer
    if path is not None:
        from tokenizers import Tokenizer

        _hf_tokenizer = Tokenizer.from_file(path)


def tokenize_file(path: Path) -> list[bytes]:
    """One file's documents as token ids (the bytes of uint16 arrays): UTF-8 bytes, or the HF tokenizer's ids."""
    import numpy as np

    documents = read_documents(path)
    if _hf_tokenizer is None:
        return [np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.uint16).tobytes() for d in documents]
    return [np.asarray(e.ids, dtype=np.uint16).tobytes() for e in _hf_tokenizer.encode_batch(documents)]


def train_bpe(files: list[Path], vocab_size: int, out: Path) -> Path:
    """A byte-level BPE of ``vocab_size`` ids trained on the documents (every byte is a token: nothing is
    unknown), saved as OUT.tokenizer.json beside the data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator((d for path in files for d in read_documents(path)), trainer=trainer)
    path = Path(f"{out}.tokenizer.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    args = parse_args(argv)
    files = input_files(args.inputs, set(args.suffixes.split(",")))
    if args.chat is not None:  # conversations, their chat template and loss mask: recipes/data/instructions.py
        return instructions.prepare_instructions(args, files)
    digest = inputs_digest(files, args)
    if not args.force and Path(f"{args.out}.json").exists():
        try:
            if read_token_file_meta(args.out).get("inputs_digest") == digest:
                print(f"[{PREPARE}] {args.out}.bin/.idx/.json are up to date ({len(files)} input files unchanged)")
                return 0
        except harness.ConfigError:
            pass  # damaged or partial: write it again
    started = time.monotonic()
    tokenizer_file, tokenizer_name, vocab_size = None, BYTE_TOKENIZER, 256
    if args.tokenizer != "bytes":
        # The worker processes fork after this one may have used tokenizers' thread pool: one thread each.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if args.tokenizer.startswith("bpe:"):
            tokenizer_file = train_bpe(files, int(args.tokenizer.removeprefix("bpe:")), args.out)
            print(f"[{PREPARE}] trained a byte-level BPE of {args.tokenizer.removeprefix('bpe:')} ids: {tokenizer_file}",
                  file=sys.stderr, flush=True)
        else:
            tokenizer_file = Path(args.tokenizer)
        from tokenizers import Tokenizer

        vocab_size = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()
        if vocab_size > 65536:
            raise harness.ConfigError(f"--tokenizer {args.tokenizer} has {vocab_size} ids; the token files hold uint16 "
                                      "ids (at most 65536): use a smaller tokenizer")
        tokenizer_name = f"huggingface tokenizers: {tokenizer_file.resolve()} ({vocab_size} ids)"
    documents = []
    with multiprocessing.Pool(args.workers, initializer=load_hf_tokenizer,
                              initargs=(str(tokenizer_file) if tokenizer_file else None,)) as pool:
        for done, file_documents in enumerate(pool.imap(tokenize_file, files, chunksize=16), 1):
            documents.extend(np.frombuffer(d, dtype=np.uint16) for d in file_documents)
            if done % 500 == 0 or done == len(files):
                print(f"[{PREPARE}] {done}/{len(files)} files, {len(documents)} documents", file=sys.stderr, flush=True)
    documents = [d for d in documents if d.size]
    if len(documents) < 2:
        raise harness.ConfigError(f"the inputs ({', '.join(map(str, args.inputs))}) hold {len(documents)} non-empty "
                                  "documents: a training and a validation split need at least 2")
    validation = max(1, round(len(documents) * args.valid_fraction))
    meta = write_token_file(args.out, documents, vocab_size=vocab_size, tokenizer=tokenizer_name,
                            validation_documents=validation,
                            extra={"inputs": [str(p) for p in args.inputs], "input_files": len(files), "inputs_digest": digest,
                                   "tokenizer_file": str(tokenizer_file.resolve()) if tokenizer_file else None})
    seconds = time.monotonic() - started
    print(f"[{PREPARE}] wrote {args.out}.bin/.idx/.json: {meta['documents']} documents ({validation} for validation), "
          f"{meta['tokens']:,} tokens, {meta['dtype']}, in {seconds:.1f} s ({meta['tokens'] / seconds / 1e6:.1f} M tokens/s)")
    return 0


if __name__ == "__main__":
    harness.main_entry(PREPARE, main)
