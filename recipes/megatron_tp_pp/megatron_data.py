"""--data PREFIX for the Megatron recipe through megatron-core's own data pipeline: ``GPTDataset`` built by
``BlendedMegatronDatasetBuilder``, as Megatron-LM builds it, so a Megatron user's samples are the ones
Megatron-LM would draw from the same files (document shuffle, sequences packed across documents, sample
shuffle, its index cache).

The split is the token file's own (PREFIX.json: the last documents are the validation split), given to
megatron as document weights, so megatron's train/validation boundary is the same document as
harness.data's. Step s is samples [s * B, (s + 1) * B) of the training dataset, rank r of DP its rows
(harness.data.GlobalBatches): the same global batch at any layout, and a resume continues exactly.
Evaluation batch k is samples [k * B, (k + 1) * B) of the validation dataset.

megatron sizes its index for ``--max-steps`` x ``--global-batch`` samples (Megatron-LM's train_samples): a
resume that raises --max-steps past another epoch boundary draws a new order from there on, as Megatron-LM
does. Its index files are cached in OUT_DIR/megatron_data_cache (the data directory may be read-only).
"""

from __future__ import annotations

import types
from pathlib import Path

import torch

import harness
from harness.data import GlobalBatches, read_token_file_meta


def megatron_split(meta: dict) -> str:
    """The token file's train/validation split as megatron's split string (weights over the documents; no
    test split): megatron rounds weight x documents to the same boundary."""
    (train_first, train_last), (valid_first, valid_last) = meta["splits"]["train"], meta["splits"]["validation"]
    return f"{train_last - train_first},{valid_last - valid_first},0"


class MegatronTokenFile(GlobalBatches):
    """One split of PREFIX as megatron's GPTDataset: ``global_batch(step, B)`` stacks its samples step * B onwards."""

    def __init__(self, dataset):
        self.dataset = dataset

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        samples = [self.dataset[index] for index in range(step * batch_size, (step + 1) * batch_size)]
        return torch.stack([s["tokens"] for s in samples]), torch.stack([s["labels"] for s in samples])


def build(args, cache_dir: Path) -> tuple[MegatronTokenFile, MegatronTokenFile]:
    """The training and validation data of --data PREFIX (every rank calls this: megatron builds the index on
    rank 0 first, then the others read it from ``cache_dir``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    meta = read_token_file_meta(args.data)
    # megatron asks its tokenizer for the vocabulary size, the end-of-document and padding ids, and what
    # identifies it (in the hash that names the cached index). The byte-level tokenizer has neither special
    # token: no end-of-document id (used only with the reset/mask options, all off), and megatron's own -1 for
    # padding (no token id is negative).
    tokenizer = types.SimpleNamespace(vocab_size=meta["vocab_size"], eod=None, pad=-1,
                                      unique_identifiers={"tokenizer": meta["tokenizer"], "vocab_size": meta["vocab_size"]})
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_len, blend=([str(args.data)], None), split=megatron_split(meta),
        path_to_cache=str(cache_dir), tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False,  # the recipe passes its own causal mask
    )
    sizes = [args.max_steps * args.global_batch, max(args.eval_batches, 1) * args.global_batch, None]
    train, validation, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return MegatronTokenFile(train), MegatronTokenFile(validation)


def data(args, cache_dir: Path) -> tuple[GlobalBatches, GlobalBatches]:
    """(training, validation) data: megatron's GPTDataset for a token file, the harness's synthetic task otherwise."""
    if args.data == "synthetic":
        return harness.training_data(args), harness.validation_data(args)
    return build(args, cache_dir)
