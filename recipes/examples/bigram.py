"""Your own model in a recipe: the smallest one there is, a bigram language model (the next token's logits
depend on the current token only), as an example of --model MODULE:FACTORY (harness/model.py).

    python recipes/ddp/train.py --model recipes/examples/bigram.py:build
    torchrun --standalone --nproc_per_node=2 recipes/ddp/train.py --model recipes/examples/bigram.py:build

What the harness asks of a model: ``build(args)`` returns a torch.nn.Module whose ``forward(inputs, targets)``
returns the batch's mean loss; ``args`` are the recipe's options (--vocab-size, --seq-len, ...). Optional:
``flops_per_token`` (training FLOPs per token), for MFU in the logs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Bigram(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.logits = nn.Embedding(vocab_size, vocab_size)  # row t: the logits of the token after t

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(inputs)  # (batch, seq_len, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def flops_per_token(self) -> float:
        return 0.0  # a lookup: no matmul, so MFU means nothing here (0: the logs say "n/a")


def build(args) -> nn.Module:
    return Bigram(args.vocab_size)
