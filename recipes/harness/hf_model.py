"""A Hugging Face causal language model under the harness's model contract (harness/model.py).

Its own module because it imports PyTorch at import time; harness.model imports it only to build one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from .metrics import transformer_flops_per_token


class CausalLMLoss(torch.nn.Module):
    """``forward(inputs, targets)``: the mean next-token cross-entropy of the model's logits for ``inputs``
    against ``targets`` (the same tokens one position later), in float32, as recipes/gpt.py computes it.
    Not the model's ``labels=``: that shifts the labels once more inside the model, and given ``targets``
    it would train the model to predict the token two positions ahead."""

    def __init__(self, model: torch.nn.Module, seq_len: int):
        super().__init__()
        self.model, self.seq_len = model, seq_len

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return F.cross_entropy(self.logits(inputs, positions).float().flatten(0, 1), targets.flatten())

    def logits(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: rows that pack several documents (--pack), each token's position in its document.
        Given position ids and no attention mask, transformers confines attention to each document itself
        (masking_utils.find_packed_sequence_indices: a document starts where a position does not follow the
        one before), for its eager and SDPA attention as for flash attention's varlen kernels."""
        return self.model(input_ids=inputs, position_ids=positions, use_cache=False).logits

    @property
    def base(self) -> torch.nn.Module:
        """The Hugging Face model itself (under LoRA, the model peft wraps)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def flops_per_token(self) -> float:
        """6N + 12*L*d*T (harness.transformer_flops_per_token); N leaves out the input embedding, a lookup,
        unless the output layer shares its weight (then it is a matmul too)."""
        model = self.base  # (LoRA's adapters add little; the frozen weights still run forward and backward)
        config = model.config
        n_params = sum(numel(p) for p in model.parameters())
        embedding = model.get_input_embeddings().weight
        output = model.get_output_embeddings()
        if output is None or output.weight is not embedding:
            n_params -= numel(embedding)
        return transformer_flops_per_token(n_params, config.num_hidden_layers, config.hidden_size, self.seq_len)


def numel(parameter: torch.Tensor) -> int:
    """A parameter's size, also where ZeRO-3 loaded the model partitioned (each rank holds a shard)."""
    return getattr(parameter, "ds_numel", parameter.numel())


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """--lora-rank R: peft's LoRA adapters of rank R (alpha 2R, no dropout) on every linear layer but the
    output layer; the model's own weights frozen. The adapters start at zero: the model starts as it was."""
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():  # peft 0.21 asks transformers 5.25 a deprecated question: not the user's to act on
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                target_modules="all-linear"))


# What a Hugging Face model directory holds besides the weights and config.json: the tokenizer, copied from
# the source directory so that the export is a model one can load and use as it is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def export_hugging_face(wrapped: CausalLMLoss, source: Path, target: Path) -> list[str]:
    """The trained model as a Hugging Face directory (save_pretrained: safetensors and config.json) plus the
    source's tokenizer files; written into TARGET.partial and renamed, so a TARGET that exists is whole.
    A LoRA model (peft): its adapters alone in TARGET/adapter, and the model with them merged into its
    weights in TARGET. Returns the files written."""
    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = wrapped.model
    if hasattr(model, "merge_and_unload"):  # peft's LoRA
        model.save_pretrained(partial / "adapter", safe_serialization=True)
        model = model.merge_and_unload()
    model.save_pretrained(partial, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file() and not (partial / name).exists():
            shutil.copy2(Path(source) / name, partial / name)
    if target.is_dir():
        target.rmdir()  # (empty: checked before the run)
    os.replace(partial, target)
    return sorted(path.name for path in target.iterdir())
