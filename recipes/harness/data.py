"""The training data: deterministic synthetic token batches, the same global batch for step ``s`` at any
world size, so a parallel run can be compared with one process step by step.

``SyntheticTokens`` for the PyTorch recipes, ``numpy_token_batch`` for the TensorFlow ones (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class SyntheticTokens:
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

    def local_batch(self, step: int, global_batch_size: int, rank: int, world_size: int):
        inputs, targets = self.global_batch(step, global_batch_size)
        per_rank = global_batch_size // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        return inputs[rows], targets[rows]


def numpy_token_batch(vocab_size: int, seq_len: int, seed: int, step: int, batch_size: int, max_stride: int = 7):
    """The same task as SyntheticTokens, drawn with NumPy (for the TensorFlow recipes): the global batch of
    ``step`` as int32 arrays (inputs, targets). The rows differ from SyntheticTokens' (another generator)."""
    import numpy as np

    generator = np.random.default_rng(seed * 1_000_003 + step)
    start = generator.integers(0, vocab_size, (batch_size, 1))
    stride = generator.integers(1, max_stride + 1, (batch_size, 1))
    tokens = ((start + stride * np.arange(seq_len + 1)) % vocab_size).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]
