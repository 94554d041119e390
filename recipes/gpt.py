"""A small GPT (decoder-only transformer), the model of the PyTorch recipes (DDP, accelerate, DeepSpeed).

Kept in its own file, as in nanoGPT, so each recipe's train.py shows only the parallel training around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.metrics import transformer_flops_per_token


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64

    @classmethod
    def from_args(cls, args) -> "GPTConfig":
        """From the options of harness.add_data_options and add_gpt_options."""
        return cls(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        # No bias: a key bias has an exactly zero gradient (softmax ignores a shift shared by all keys), so
        # Adam would scale pure rounding noise up to full-size updates and runs would differ for no reason.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, dim // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, seq, dim))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
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
        self.head.weight = self.tok_emb.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params_for_flops(self) -> int:
        """Parameters that take part in matmuls: all but the position embedding (a lookup)."""
        return sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()

    def size(self) -> tuple[int, float]:
        """(parameters, training FLOPs per token): what the metrics log and MFU need."""
        return sum(p.numel() for p in self.parameters()), self.flops_per_token()

    def flops_per_token(self) -> float:
        """Training FLOPs per token, for MFU: 6N + 12*L*d*T (harness.transformer_flops_per_token)."""
        cfg = self.cfg
        return transformer_flops_per_token(self.num_params_for_flops(), cfg.n_layer, cfg.n_embd, cfg.seq_len)
