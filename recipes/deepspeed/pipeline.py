"""The stack's GPT as a DeepSpeed ``PipelineModule`` (the recipe's --pp path): embedding, blocks, final norm
and head as ``LayerSpec``s, the token embedding tied to the head across the first and last stage with a
``TiedLayerSpec`` (DeepSpeed all-reduces the tied gradient between them), cut into stages by DeepSpeed's
``partition_method`` (default ``type:Block``: the same number of blocks per stage).

``build`` makes it and gives each stage the weights the one-process GPT has (the full model is built from
the seed on every rank and each stage copies its layers by global index), so any PP x DP layout is
comparable with one process.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from gpt import GPT, Block, GPTConfig, cross_entropy

TIED = "tied_modules.embed."  # where PipelineModule puts the tied embedding's parameters


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))


class FinalNorm(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


def tied_head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output layer: the token embedding's weight, transposed (GPT-2's tying, as recipes/gpt.py)."""
    return x @ embedding.tok_emb.weight.t()


def build(cfg: GPTConfig, stages: int, seed: int, partition_method: str,
          activation_checkpointing: bool) -> tuple[PipelineModule, tuple[int, float]]:
    """The pipeline of ``stages`` stages, this rank's layers holding the one-process GPT's weights; and the
    whole model's (parameters, FLOPs per token)."""
    layers = [TiedLayerSpec("embed", Embedding, cfg, tied_weight_attr="tok_emb.weight"),
              *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
              LayerSpec(FinalNorm, cfg),
              TiedLayerSpec("embed", Embedding, cfg, forward_fn=tied_head, tied_weight_attr="tok_emb.weight")]
    module = PipelineModule(layers=layers, num_stages=stages, loss_fn=cross_entropy, partition_method=partition_method,
                            activation_checkpoint_interval=1 if activation_checkpointing else 0,
                            # (the embedding takes integer tokens: nothing to recompute there, and DeepSpeed's
                            # checkpoint function wants inputs that require a gradient)
                            checkpointable_layers=["Block"])
    torch.manual_seed(seed)
    model = GPT(cfg)
    full = model.state_dict()
    module.load_state_dict({name: full[full_name(name, cfg.n_layer)] for name in module.state_dict()})
    return module, model.size()


def full_name(name: str, n_layer: int) -> str:
    """A PipelineModule parameter's name in recipes/gpt.py's GPT: layer 0 is the embedding, 1..L the blocks,
    L + 1 the final norm (the head reuses the tied embedding)."""
    if name.startswith(TIED):
        return name[len(TIED):]
    index, rest = name.split(".", 1)
    return rest if int(index) == n_layer + 1 else f"blocks.{int(index) - 1}.{rest}"
