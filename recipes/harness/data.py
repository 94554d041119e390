"""The training data: the same global batch for step ``s`` at any world size (rank r takes its rows), so a
parallel run can be compared with one process step by step, and a resume continues mid-epoch exactly (the
position in the data is the step, which every checkpoint holds).

Two sources, chosen with ``--data``:
- ``synthetic`` (the default): ``SyntheticTokens`` for the PyTorch recipes, ``numpy_token_batch`` for the
  TensorFlow ones (no torch);
- ``PREFIX``: a token file, PREFIX.bin + PREFIX.idx in megatron-core's indexed-dataset format (what
  Megatron-LM's preprocessing writes) and PREFIX.json beside them (dtype, vocabulary size, tokenizer, the
  train/validation split by document), written by recipes/data/prepare.py. ``TokenFileData`` reads it
  through ``np.memmap`` (no copy into memory): sample k of an epoch is the window of seq_len + 1 tokens
  at k * seq_len of the split's token stream, the samples in a seeded random order per epoch.
And the user's own, with ``--dataset MODULE:FACTORY`` (DDP and accelerate): ``DatasetBatches`` over the
map-style dataset FACTORY(args, split) returns, items (inputs, targets), in a seeded order per epoch too.

``step_batches`` hands a PyTorch recipe this rank's batch of each step in order; with ``--data-workers``
(default: 2 on a GPU, none on a CPU) a DataLoader reads ahead in worker processes into pinned memory, so
the next batch is ready, and on the GPU, when a step begins. ``tf_step_batches`` does the same for the
TensorFlow recipes through tf.data.

``validation_data`` (``numpy_batches(args, "validation")`` for TensorFlow) is what ``--eval-every`` evaluates: the
token file's validation split, or synthetic rows drawn with another seed. Evaluation batch k is global
batch k of it, the same --eval-batches batches at every evaluation, so a run's eval losses compare.
"""

from __future__ import annotations

import json
import os
import signal
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from . import faults
from .errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

TOKEN_FILE_FORMAT = "megatron-indexed-dataset-v1"
INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron/core/datasets/indexed_dataset.py, version 1
INDEX_DTYPE_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
INDEX_FIXED_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequence and document counts
SPLITS = ("train", "validation")
# The synthetic validation rows: another seed, whose batches no training step draws (a step would have to
# pass 7919 * 1_000_003).
VALIDATION_SEED_OFFSET = 7919


class GlobalBatches:
    """What every data source shares: rank r of world_size takes rows [r * b, (r + 1) * b) of step s's global batch."""

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def local_batch(self, step: int, global_batch_size: int, rank: int, world_size: int):
        per_rank = global_batch_size // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        return tuple(part[rows] for part in self.global_batch(step, global_batch_size))  # (inputs, targets[, positions])


class SyntheticTokens(GlobalBatches):
    """Arithmetic token sequences, x[t] = (start + t * stride) mod vocab, with a random start and stride per row.

    A model has to read the context to predict the next token, so the loss falls well below ln(vocab) as it
    learns. Step ``s`` always yields the same global batch (generated from ``seed`` and ``s``), and rank r
    takes rows [r * b, (r + 1) * b): the data depends on the step, not on the world size or on a resume.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, max_stride: int = 7):
        self.vocab_size, self.seq_len, self.seed, self.max_stride = vocab_size, seq_len, seed, max_stride

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=generator)
        stride = torch.randint(1, self.max_stride + 1, (batch_size, 1), generator=generator)
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:, :-1], tokens[:, 1:]



def numpy_token_batch(vocab_size: int, seq_len: int, seed: int, step: int, batch_size: int, max_stride: int = 7):
    """The same task as SyntheticTokens, drawn with NumPy (for the TensorFlow recipes): the global batch of
    ``step`` as int32 arrays (inputs, targets). The rows differ from SyntheticTokens' (another generator)."""
    import numpy as np

    generator = np.random.default_rng(seed * 1_000_003 + step)
    start = generator.integers(0, vocab_size, (batch_size, 1))
    stride = generator.integers(1, max_stride + 1, (batch_size, 1))
    tokens = ((start + stride * np.arange(seq_len + 1)) % vocab_size).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def token_dtype(vocab_size: int) -> str:
    """The smallest dtype that holds every token id (Megatron's choice: uint16 up to 65536 ids, else int32)."""
    return "uint16" if vocab_size <= 65536 else "int32"


def _write_indexed(path_prefix: str, documents: list, dtype) -> tuple[Path, Path]:
    """PATH_PREFIX.bin and .idx, written beside their final names (.partial); returns the two partial files."""
    import numpy as np

    lengths = np.array([len(document) for document in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]).astype(np.int64) * dtype.itemsize
    data, index = Path(f"{path_prefix}.bin.partial"), Path(f"{path_prefix}.idx.partial")
    with open(data, "wb") as out:
        for document in documents:
            out.write(np.asarray(document, dtype=dtype).tobytes())
    with open(index, "wb") as out:
        out.write(INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", INDEX_DTYPE_CODES[dtype.name]))
        out.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1))
        out.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return data, index


LOSS_MASK_SUFFIX = ".mask"  # PREFIX.mask.bin/.idx: instruction data's loss mask, in the token file's own layout


def write_token_file(prefix: Path, documents: list, vocab_size: int, tokenizer: str, validation_documents: int,
                     extra: dict | None = None, loss_masks: list | None = None) -> dict:
    """PREFIX.bin, PREFIX.idx (one sequence per document) and PREFIX.json; the last ``validation_documents``
    documents are the validation split. ``loss_masks`` (instruction data): one uint8 array per document, 1 where
    the token is trained, written as PREFIX.mask.bin/.idx in the same layout. Each file is written beside its
    final name and renamed into place, the sidecar last: an interrupted write leaves no PREFIX.json, and a
    reader refuses the prefix."""
    import numpy as np

    dtype = np.dtype(token_dtype(vocab_size))
    meta = {"format": TOKEN_FILE_FORMAT, "dtype": dtype.name, "vocab_size": vocab_size, "tokenizer": tokenizer,
            "documents": len(documents), "tokens": int(sum(len(document) for document in documents)),
            "splits": {"train": [0, len(documents) - validation_documents],
                       "validation": [len(documents) - validation_documents, len(documents)]}, **(extra or {})}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    partial = dict(zip((".bin", ".idx"), _write_indexed(str(prefix), documents, dtype)))
    if loss_masks is not None:
        assert [len(mask) for mask in loss_masks] == [len(document) for document in documents]
        mask_files = _write_indexed(f"{prefix}{LOSS_MASK_SUFFIX}", loss_masks, np.dtype("uint8"))
        partial.update(zip((f"{LOSS_MASK_SUFFIX}.bin", f"{LOSS_MASK_SUFFIX}.idx"), mask_files))
        meta["loss_mask"] = {"files": f"{prefix.name}{LOSS_MASK_SUFFIX}.bin/.idx", "dtype": "uint8",
                             "trained_tokens": int(sum(int(np.sum(mask)) for mask in loss_masks))}
    partial[".json"] = Path(f"{prefix}.json.partial")
    partial[".json"].write_text(json.dumps(meta, indent=1) + "\n")
    for suffix, path in partial.items():
        os.replace(path, f"{prefix}{suffix}")
    return meta


def read_token_file_meta(prefix: str | Path) -> dict:
    """PREFIX.json, checked against PREFIX.idx and PREFIX.bin. ConfigError (one line, what to do) when a file
    is missing, truncated or from another data set, before any rank starts."""
    prefix = Path(prefix)
    redo = f"run recipes/data/prepare.py --out {prefix} again (or fix --data)"
    sidecar, index, tokens = (Path(f"{prefix}{suffix}") for suffix in (".json", ".idx", ".bin"))
    if prefix.is_file() and not sidecar.exists():  # a file itself: one of the three, or the text to prepare
        if prefix.suffix in (".json", ".idx", ".bin") and prefix.with_suffix(".json").is_file():
            raise ConfigError(f"--data {prefix} names one file of a token file: give the prefix of the three, "
                              f"--data {prefix.with_suffix('')}")
        raise ConfigError(f"--data {prefix} is a file, not a token file: --data takes the PREFIX of PREFIX.bin/.idx/.json; "
                          f"make them from your text with: python recipes/data/prepare.py {prefix} --out {prefix.with_suffix('')}-tokens")
    for path in (sidecar, index, tokens):
        if not path.is_file():
            from .metrics import container_runtime

            runtime = container_runtime()
            # Most often the data is there on the host, but its directory is not mounted into the container.
            if runtime != "none" and not path.exists() and not path.parent.is_dir():
                raise ConfigError(f"--data {prefix}: {path} does not exist in this {runtime} container: keep the data "
                                  "on a file system the runtime mounts (Shifter: $SCRATCH, $HOME; podman and podman-hpc: "
                                  f"CONTAINER_MOUNTS=\"{prefix.resolve().parent}\"), or {redo}")
            raise ConfigError(f"--data {prefix}: {path} {'is not a file' if path.exists() else 'does not exist'}; {redo}")
    try:
        meta = json.loads(sidecar.read_text())
        assert meta["format"] == TOKEN_FILE_FORMAT and meta["dtype"] in INDEX_DTYPE_CODES
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ConfigError(f"--data {prefix}: {sidecar} is not a {TOKEN_FILE_FORMAT} sidecar; {redo}") from None
    with open(index, "rb") as stream:
        fixed = stream.read(INDEX_FIXED_BYTES)
    if len(fixed) < INDEX_FIXED_BYTES or not fixed.startswith(INDEX_HEADER):
        raise ConfigError(f"--data {prefix}: {index} is not a megatron index (.idx) file; {redo}")
    version, code = struct.unpack("<Q", fixed[9:17])[0], fixed[17]
    sequences, documents = struct.unpack("<QQ", fixed[18:34])
    if version != 1 or code != INDEX_DTYPE_CODES[meta["dtype"]] or sequences != meta["documents"]:
        raise ConfigError(f"--data {prefix}: {index} does not belong to {sidecar} (version {version}, dtype code {code}, "
                          f"{sequences} sequences; the sidecar says {meta['dtype']}, {meta['documents']} documents); {redo}")
    expected_index = INDEX_FIXED_BYTES + 4 * sequences + 8 * sequences + 8 * documents
    if index.stat().st_size != expected_index:
        raise ConfigError(f"--data {prefix}: {index} has {index.stat().st_size} bytes, its header needs {expected_index}; {redo}")
    import numpy as np

    expected_tokens = meta["tokens"] * np.dtype(meta["dtype"]).itemsize
    if tokens.stat().st_size != expected_tokens:
        raise ConfigError(f"--data {prefix}: {tokens} has {tokens.stat().st_size} bytes, the index says {expected_tokens} "
                          f"({meta['tokens']} tokens): truncated or from another run; {redo}")
    if "loss_mask" in meta:  # instruction data: a mask per token, one document per conversation, as the tokens
        mask_index, mask_data = (Path(f"{prefix}{LOSS_MASK_SUFFIX}{suffix}") for suffix in (".idx", ".bin"))
        lengths = np.fromfile(index, dtype=np.int32, count=sequences, offset=INDEX_FIXED_BYTES)
        if not (mask_index.is_file() and mask_data.is_file() and mask_data.stat().st_size == meta["tokens"]
                and mask_index.stat().st_size == expected_index
                and np.array_equal(np.fromfile(mask_index, dtype=np.int32, count=sequences, offset=INDEX_FIXED_BYTES),
                                   lengths)):
            raise ConfigError(f"--data {prefix}: its loss mask ({mask_data.name}, {mask_index.name}) is missing or does not "
                              f"match its tokens; {redo}")
    return meta


def check_data_option(data: str, vocab_size: int, seq_len: int, evaluates: bool = False,
                      loss_masks: str | None = None) -> None:
    """--data: 'synthetic', or a prefix whose files are whole, whose token ids fit the model's --vocab-size
    and whose training split (and validation split, when the run ``evaluates``) holds at least one sample of
    --seq-len + 1 tokens. ``loss_masks``: the name of a recipe that cannot train instruction data (None: it can)."""
    if data == "synthetic":
        return
    meta = read_token_file_meta(data)
    if "loss_mask" in meta:
        if loss_masks is not None:
            # Trained as a plain token stream, the prompts would be trained too, and conversations mixed in a window.
            raise ConfigError(f"--data {data} is instruction data with a loss mask (prepare.py --chat), which {loss_masks} "
                              "does not apply yet: train it with recipes/ddp, accelerate, deepspeed or fsdp_tp_pp, or "
                              "prepare the text without --chat")
        if meta.get("seq_len", 0) > seq_len:
            raise ConfigError(f"--data {data}: its conversations were prepared for --seq-len {meta['seq_len']} and would "
                              f"be cut at {seq_len}: use --seq-len {meta['seq_len']}, or prepare it with --seq-len {seq_len}")
        if meta["vocab_size"] > vocab_size:
            raise ConfigError(f"--data {data}: its tokenizer ({meta['tokenizer']}) has {meta['vocab_size']} token ids, "
                              f"more than --vocab-size {vocab_size}: use --vocab-size {meta['vocab_size']} or more")
        return  # (prepare.py wrote at least one conversation per split, each within the window)
    token_file = TokenFileData(data, seq_len, seed=0)  # reads and checks the three files (read_token_file_meta)
    if meta["vocab_size"] > vocab_size:
        raise ConfigError(f"--data {data}: its tokenizer ({meta['tokenizer']}) has {meta['vocab_size']} token ids, more than "
                          f"--vocab-size {vocab_size}: use --vocab-size {meta['vocab_size']} or more")
    train_tokens = token_file.tokens.size
    if train_tokens < seq_len + 1:
        raise ConfigError(f"--data {data}: the training split has {train_tokens} tokens, fewer than one sample of "
                          f"--seq-len {seq_len} + 1: use a larger corpus or a smaller --seq-len")
    if evaluates:
        validation_tokens = TokenFileData(data, seq_len, seed=0, split="validation").tokens.size
        if validation_tokens < seq_len + 1:
            raise ConfigError(f"--data {data}: the validation split has {validation_tokens} tokens, fewer than one sample "
                              f"of --seq-len {seq_len} + 1: prepare it with a larger --valid-fraction, use a smaller "
                              "--seq-len, or leave out --eval-every")


class TokenFileData(GlobalBatches):
    """Batches from a token file (see the module docstring); the same interface as SyntheticTokens, plus
    ``numpy_global_batch`` for the TensorFlow recipes."""

    def __init__(self, prefix: str | Path, seq_len: int, seed: int, split: str = "train"):
        import numpy as np

        meta = read_token_file_meta(prefix)
        first, last = meta["splits"][split]
        lengths = np.fromfile(f"{prefix}.idx", dtype=np.int32, count=meta["documents"], offset=INDEX_FIXED_BYTES)
        starts = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])
        # Documents are contiguous in PREFIX.bin: a split is one range of the token stream.
        self.tokens = np.memmap(f"{prefix}.bin", dtype=meta["dtype"], mode="r")[starts[first]:starts[last]]
        self.first_document, self._document_starts = first, starts[first:last + 1] - starts[first]
        self.meta, self.seq_len, self.seed, self.split = meta, seq_len, seed, split
        self.samples_per_epoch = max((self.tokens.size - 1) // seq_len, 0)
        self._order: tuple[int, np.ndarray] | None = None

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index`` (numbered as in PREFIX.idx) of this split, from the memmap."""
        local = index - self.first_document
        if not 0 <= local < len(self._document_starts) - 1:
            raise IndexError(f"document {index} is not in the {self.split} split")
        return self.tokens[self._document_starts[local]:self._document_starts[local + 1]]

    def order(self, epoch: int) -> np.ndarray:
        """The order of the samples in ``epoch`` (a permutation, seeded by the seed and the epoch)."""
        import numpy as np

        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng(self.seed * 1_000_003 + epoch).permutation(self.samples_per_epoch))
        return self._order[1]

    def numpy_global_batch(self, step: int, batch_size: int):
        """Step ``step``'s global batch as int64 arrays (inputs, targets): samples step * batch_size onwards."""
        import numpy as np

        rows = []
        for sample in range(step * batch_size, (step + 1) * batch_size):
            epoch, position = divmod(sample, self.samples_per_epoch)
            start = int(self.order(epoch)[position]) * self.seq_len
            rows.append(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        tokens = np.stack(rows)
        return tokens[:, :-1], tokens[:, 1:]

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        inputs, targets = self.numpy_global_batch(step, batch_size)
        return torch.from_numpy(inputs), torch.from_numpy(targets)


IGNORE = -100  # a target the loss leaves out: PyTorch's cross_entropy ignore_index, and Hugging Face's


class ConversationData(GlobalBatches):
    """Instruction data (prepare.py --chat: a token file with a loss mask). Its targets are the next tokens
    where the mask says trained, and IGNORE elsewhere (the prompts, the padding). As with a token file, step s
    takes samples s * batch onwards, in a seeded order per epoch, and rank r its rows: the data depends on the
    step only. A sample is a window of --seq-len + 1 tokens:

    - by default one conversation, padded (pad id 0): a row's compute is spent on padding as much as the
      conversations are shorter than the window;
    - with ``pack`` (--pack), as many whole conversations as fit, packed once in a seeded order (each next
      one into the current window, or a new window where it does not fit). ``global_batch`` then also gives
      each token's position in its conversation, which restarts at 0 with each one: the model keeps attention
      within a conversation (recipes/gpt.py document_mask; Hugging Face's models from the position ids), and
      no token is trained on the one that ends the conversation before it.
    """

    def __init__(self, prefix: str | Path, seq_len: int, seed: int, split: str = "train", pack: bool = False):
        import numpy as np

        meta = read_token_file_meta(prefix)
        first, last = meta["splits"][split]
        lengths = np.fromfile(f"{prefix}.idx", dtype=np.int32, count=meta["documents"], offset=INDEX_FIXED_BYTES)
        self.starts = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])[first:last + 1]
        self.tokens = np.memmap(f"{prefix}.bin", dtype=meta["dtype"], mode="r")
        self.mask = np.memmap(f"{prefix}{LOSS_MASK_SUFFIX}.bin", dtype=np.uint8, mode="r")
        self.meta, self.seq_len, self.seed, self.pack = meta, seq_len, seed, pack
        self.windows = self._pack(lengths[first:last]) if pack else None  # each window's conversations
        self.samples_per_epoch = len(self.windows) if pack else last - first
        self._order = None

    order = TokenFileData.order  # (the same seeded permutation per epoch, computed once per epoch)

    def _pack(self, lengths) -> list[list[int]]:
        """The conversations in a seeded order, each into the current window or, where it does not fit, a new
        one. (Conversations are at most --seq-len + 1 tokens: check_data_option.)"""
        import numpy as np

        window, windows, free = self.seq_len + 1, [], 0
        order = np.random.default_rng([self.seed, 1]).permutation(len(lengths))  # (the epochs' orders seed with one int)
        for conversation in order:
            length = min(int(lengths[conversation]), window)
            if length > free:
                windows.append([])
                free = window
            windows[-1].append(int(conversation))
            free -= length
        return windows

    def packing_summary(self) -> dict:
        """How full the windows are: what --pack saves (and the same figure without it, for the logs)."""
        trained_or_context = int(self.starts[-1] - self.starts[0])
        return {"packed": self.pack, "conversations": len(self.starts) - 1, "windows": self.samples_per_epoch,
                "fill": round(trained_or_context / (self.samples_per_epoch * (self.seq_len + 1)), 3)}

    def global_batch(self, step: int, batch_size: int):
        """(inputs, targets) of step ``step``, and with --pack each input token's position in its conversation."""
        import numpy as np
        import torch

        window = self.seq_len + 1
        tokens, trained = np.zeros((batch_size, window), np.int64), np.zeros((batch_size, window), bool)
        positions, document = np.zeros((batch_size, window), np.int64), np.full((batch_size, window), -1)
        for row, sample in enumerate(range(step * batch_size, (step + 1) * batch_size)):
            epoch, index = divmod(sample, self.samples_per_epoch)
            sample_index = int(self.order(epoch)[index])
            at = 0
            for conversation in (self.windows[sample_index] if self.pack else [sample_index]):
                first, end = self.starts[conversation], self.starts[conversation + 1]
                length = min(int(end - first), window - at)
                tokens[row, at:at + length] = self.tokens[first:first + length]
                trained[row, at:at + length] = self.mask[first:first + length] == 1
                if faults.active("mask-ignored"):  # (a negative control: the prompts trained as if they were answers)
                    trained[row, at:at + length] = True
                positions[row, at:at + length] = np.arange(length)
                document[row, at:at + length] = conversation
                at += length
        # a target is trained where the mask says so and it continues the input's own conversation
        continues = document[:, 1:] == document[:, :-1]
        targets = np.where(trained[:, 1:] & continues, tokens[:, 1:], IGNORE)
        inputs, targets = torch.from_numpy(tokens[:, :-1]), torch.from_numpy(targets)
        if not self.pack:
            return inputs, targets
        if faults.active("pack-unconfined"):  # (a negative control: packing as if the window were one sequence)
            positions[:] = np.arange(window)
        return inputs, targets, torch.from_numpy(positions[:, :-1])


def masked_data(args) -> bool:
    """--data is instruction data (a token file with a loss mask): ConversationData's rows, loss_weights' loss."""
    return not getattr(args, "dataset", None) and args.data != "synthetic" and "loss_mask" in read_token_file_meta(args.data)


def token_weights(micro_targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """What scales each of this rank's micro-batch losses (each the mean over its trained targets, targets !=
    IGNORE) so that the gradient the data-parallel ranks average is the one of the global batch's loss: the sum
    of the cross-entropy over every trained token of the global batch (every rank, every micro-batch), divided
    by their number. Rows hold very different numbers of trained tokens, and a mean of per-rank or
    per-micro-batch means weighs a token of a short answer more than one of a long one (the Hugging Face
    Trainer's bug, transformers #34191): weight = the micro-batch's tokens x world size / the world's tokens.
    One all-reduce of a count per step, over every rank: the tensor-parallel ranks of a replica hold the same
    rows, so they count its tokens TP times, and the world size has TP in it too (weight = tokens x DP / the
    global batch's tokens: what the average over the DP ranks of DDP, FSDP and ZeRO needs)."""
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local = torch.stack([(targets != IGNORE).sum() for targets in micro_targets]).to(torch.float64)
    total = local.sum()
    if world_size > 1:
        dist.all_reduce(total)
    return list((local * world_size / total).to(torch.float32).unbind())


def loss_weights(micro_targets: list[torch.Tensor], masked: bool) -> list:
    """The weight of each of this rank's micro-batch mean losses in its step's loss (the sum of weight x loss,
    whose gradient the data-parallel ranks average): 1/M for M micro-batches of equal rows whose targets all
    count; for instruction data (``masked``: masked_data), token_weights. (The negative control rank-mean-loss:
    1/M for instruction data too, the Trainer's mean of per-micro-batch and per-rank means.)"""
    if masked and not faults.active("rank-mean-loss"):
        return token_weights(micro_targets)
    return [1.0 / len(micro_targets)] * len(micro_targets)


class DatasetBatches(GlobalBatches):
    """Batches from the user's own map-style dataset (--dataset MODULE:FACTORY): item i is a pair of tensors
    (inputs, targets), and step s's global batch is samples s * batch_size onwards of a seeded order per
    epoch, as a token file's are, so a rank reads only its own rows and the data does not depend on the world
    size or on a resume."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed, self.samples_per_epoch = dataset, seed, len(dataset)
        self._order = None

    def order(self, epoch: int):
        import torch

        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.samples_per_epoch, generator=generator))
        return self._order[1]

    def rows(self, first: int, count: int):
        import torch

        items = []
        for sample in range(first, first + count):
            epoch, position = divmod(sample, self.samples_per_epoch)
            items.append(self.dataset[int(self.order(epoch)[position])])
        return torch.stack([inputs for inputs, _ in items]), torch.stack([targets for _, targets in items])

    def global_batch(self, step: int, batch_size: int):
        return self.rows(step * batch_size, batch_size)

    def local_batch(self, step: int, global_batch_size: int, rank: int, world_size: int):
        per_rank = global_batch_size // world_size
        return self.rows(step * global_batch_size + rank * per_rank, per_rank)


def user_dataset(args, split: str):
    """--dataset MODULE:FACTORY: FACTORY(args, split) for split "train" or "validation", checked: a map-style
    dataset (len and indexing) with at least one item, each a pair of tensors (inputs, targets)."""
    import torch

    from .model import import_factory

    factory, _ = import_factory("--dataset", args.dataset)
    try:
        dataset = factory(args, split)
        size = len(dataset)
        first = dataset[0] if size else None
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 (the user's code: one line, what it raised)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--dataset {args.dataset}: its {split} data fails: {type(error).__name__}: {first_line[:160]}") from None
    if not size:
        raise ConfigError(f"--dataset {args.dataset}: its {split} data has no items")
    if not (isinstance(first, (tuple, list)) and len(first) == 2 and all(isinstance(t, torch.Tensor) for t in first)):
        raise ConfigError(f"--dataset {args.dataset}: item 0 of its {split} data is {type(first).__name__}, not a pair "
                          "of tensors (inputs, targets)")
    return dataset


def training_data(args) -> SyntheticTokens | TokenFileData | DatasetBatches:
    """The PyTorch recipes' training data: --dataset (yours), or --data synthetic or a token file (checked by
    parse_recipe_args)."""
    if getattr(args, "dataset", None):
        return DatasetBatches(user_dataset(args, "train"), args.seed)
    if args.data == "synthetic":
        return SyntheticTokens(args.vocab_size, args.seq_len, args.seed)
    if masked_data(args):
        return ConversationData(args.data, args.seq_len, args.seed, pack=getattr(args, "pack", False))
    return TokenFileData(args.data, args.seq_len, args.seed)


class _StepRows:
    """A map-style dataset over the steps of a run: item i is this rank's (inputs, targets) of steps[i]."""

    def __init__(self, data: GlobalBatches, steps: range, global_batch: int, rank: int, world_size: int):
        self.data, self.steps, self.global_batch, self.rank, self.world_size = data, steps, global_batch, rank, world_size

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int):
        return self.data.local_batch(self.steps[index], self.global_batch, self.rank, self.world_size)


def data_workers(args, device) -> int:
    """--data-workers: worker processes that read ahead (auto: 2 on a GPU, where the host must keep up with the
    device, none on a CPU, whose cores train)."""
    if args.data_workers >= 0:
        return args.data_workers
    return 2 if device.type == "cuda" else 0


def _ignore_stop_signals(worker_id: int) -> None:
    """In each read-ahead worker: ignore the time-limit and preemption signals. Slurm signals every process of
    the step, the workers too; one that died of it (PyTorch's worker re-raises SIGTERM, and SIGUSR1 kills)
    would end the training process with "DataLoader worker ... killed by signal" instead of the checkpoint
    it owes (harness.signals). The training process stops its workers itself when it ends."""
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def step_batches(data: GlobalBatches, args, steps: range, global_batch: int, rank: int, world_size: int, device):
    """This rank's (inputs, targets) of each step in ``steps``, in order, on ``device``. With worker processes
    (data_workers) a DataLoader reads ahead, in order, into pinned memory on a GPU; the copy to the GPU does
    not wait (non_blocking). The batches are those of data.local_batch: the same with or without workers."""
    import torch

    if faults.active("resume-data-from-start"):  # (a negative control: a resume that forgets where it was)
        steps = range(1, 1 + len(steps))
    rows = _StepRows(data, steps, global_batch, rank, world_size)
    workers = data_workers(args, device)
    if workers == 0:
        batches = (rows[index] for index in range(len(rows)))
    else:
        batches = torch.utils.data.DataLoader(rows, batch_size=None, shuffle=False, num_workers=workers,
                                              pin_memory=device.type == "cuda", prefetch_factor=2,
                                              worker_init_fn=_ignore_stop_signals)
    for batch in batches:  # (inputs, targets), and packed instruction data's positions (ConversationData)
        yield tuple(part.to(device, non_blocking=True) for part in batch)


def validation_data(args) -> SyntheticTokens | TokenFileData | DatasetBatches:
    """The PyTorch recipes' evaluation data: the token file's validation split, or synthetic rows of another seed
    (--dataset: its "validation" split)."""
    if getattr(args, "dataset", None):
        return DatasetBatches(user_dataset(args, "validation"), args.seed)
    if args.data == "synthetic":
        return SyntheticTokens(args.vocab_size, args.seq_len, args.seed + VALIDATION_SEED_OFFSET)
    if masked_data(args):
        return ConversationData(args.data, args.seq_len, args.seed, split="validation")
    return TokenFileData(args.data, args.seq_len, args.seed, split="validation")


def validation_loss(forward, data, args, global_batch: int, rank: int, world_size: int, device,
                    masked: bool = False):
    """This rank's mean loss over the --eval-batches validation batches (its rows of each), without gradients;
    ``forward(inputs, targets)``: one batch's loss. The recipe averages it over its data-parallel ranks.
    ``masked`` (instruction data): each batch's loss weighed as training weighs it (data.loss_weights), so the
    average over the ranks is the batch's loss over its trained tokens."""
    import torch

    total = torch.zeros((), device=device)
    with torch.no_grad():
        for batch in range(args.eval_batches):
            inputs, targets = (part.to(device) for part in data.local_batch(batch, global_batch, rank, world_size))
            total += forward(inputs, targets).float() * loss_weights([targets], masked)[0]
    return total / args.eval_batches


def tf_step_batches(args, steps: range, global_batch: int):
    """The TensorFlow recipes' global batch of each step in ``steps``, in order, through tf.data: read from
    numpy_batches (the token file's memmap, or the synthetic task) one step ahead of the training step."""
    import tensorflow as tf

    batches = numpy_batches(args)
    spec = tf.TensorSpec((global_batch, args.seq_len), tf.int32)
    dataset = tf.data.Dataset.from_generator(lambda: (batches(step, global_batch) for step in steps),
                                             output_signature=(spec, spec))
    return dataset.prefetch(1)


def numpy_batches(args, split: str = "train"):
    """The TensorFlow recipes' data: a function (step, global batch size) -> (inputs, targets) int32 arrays.
    ``split`` "validation": the evaluation data (as validation_data)."""
    if args.data == "synthetic":
        seed = args.seed + (VALIDATION_SEED_OFFSET if split == "validation" else 0)
        return lambda step, batch_size: numpy_token_batch(args.vocab_size, args.seq_len, seed, step, batch_size)
    data = TokenFileData(args.data, args.seq_len, args.seed, split=split)
    return lambda step, batch_size: tuple(array.astype("int32") for array in data.numpy_global_batch(step, batch_size))
