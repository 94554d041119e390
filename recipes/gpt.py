"""A small GPT (decoder-only transformer), the model of the PyTorch recipes (DDP, accelerate, DeepSpeed).

Kept in its own file, as in nanoGPT, so each recipe's train.py shows only the parallel training around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    tie_embeddings: bool = True  # the output layer reuses the token embedding, as in GPT-2

    @classmethod
    def add_arguments(cls, parser) -> None:
        """The GPT's own options (a recipe passes this to harness.parse_recipe_args); --vocab-size and
        --seq-len are the data's."""
        g = parser.add_argument_group("the stack's GPT (--model gpt, the default)")
        g.add_argument("--n-layer", type=int, default=cls.n_layer, help="transformer blocks")
        g.add_argument("--n-head", type=int, default=cls.n_head, help="attention heads (each n-embd / n-head wide)")
        g.add_argument("--n-embd", type=int, default=cls.n_embd, help="the width of the residual stream")

    @classmethod
    def from_args(cls, args) -> "GPTConfig":
        """From the options of add_arguments and the data's (harness.add_data_options)."""
        return cls(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        # No bias: a key bias has an exactly zero gradient (softmax ignores a shift shared by all keys), so
        # Adam would scale pure rounding noise up to full-size updates and runs would differ for no reason.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: which keys each query may attend to, (batch, 1, seq, seq) (packed documents, see
        document_mask); None: every earlier position (causal)."""
        batch, seq, _ = x.shape
        # qkv's outputs are laid out head by head ([q k v] of head 0, then of head 1, ...), so tensor
        # parallelism, which splits them into contiguous blocks, gives each rank whole heads: the head count
        # is read from the (local) width, never assumed.
        q, k, v = self.qkv(x).view(batch, seq, -1, 3, self.head_dim).unbind(dim=3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return cross_entropy(self.logits(tokens, positions), targets)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: each token's position in its document, (batch, seq), for rows that pack several
        documents (--pack): they restart at 0 with each document, and attention stays within it. None: one
        sequence per row, positions 0, 1, 2, ..."""
        mask = None
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        else:
            mask = document_mask(positions)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def num_params_for_flops(self) -> int:
        """Parameters that take part in matmuls: all but the embeddings, which are lookups (a token embedding
        tied to the output layer is that layer's weight, and counts)."""
        lookups = self.pos_emb.weight.numel() + (0 if self.cfg.tie_embeddings else self.tok_emb.weight.numel())
        return sum(p.numel() for p in self.parameters()) - lookups

    def size(self) -> tuple[int, float]:
        """(parameters, training FLOPs per token): what the metrics log and MFU need."""
        return sum(p.numel() for p in self.parameters()), self.flops_per_token()

    def flops_per_token(self) -> float:
        """Training FLOPs per token, for MFU: 6N for the weight matmuls (forward and backward) plus 12*L*d*T for
        attention (the PaLM paper's appendix B; the harness counts a Hugging Face model the same way)."""
        cfg = self.cfg
        return 6.0 * self.num_params_for_flops() + 12.0 * cfg.n_layer * cfg.n_embd * cfg.seq_len


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed rows, (batch, 1, seq, seq): a query attends to the earlier keys of its own
    document. A document starts wherever a position does not follow the one before (position 0 after any
    other), the rule Hugging Face's masks use for packed position ids (transformers' masking_utils)."""
    step = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1)
    document = (step != 1).cumsum(dim=-1)
    seq = positions.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return (causal & (document[:, :, None] == document[:, None, :]))[:, None]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss over every position of every row (in float32, whatever the logits' dtype), but
    those whose target is -100 (cross_entropy's ignore_index: instruction data's prompts and padding). Rows with
    no trained target at all (a micro-batch of prompts only) give 0, where a mean over nothing is 0/0: their
    weight in the step's loss is 0 (harness.token_weights), but NaN x 0 is NaN, and the step logged NaN."""
    total = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return total / (targets != -100).sum().clamp(min=1)
