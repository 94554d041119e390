"""The bare PyTorch training loop the recipes are measured against: same model, data, batch and optimizer,
nothing else (no process group, no checkpoints, no metrics logger, no signal handling).

    python bench/bare_loop.py --out result.json --global-batch 8 --max-steps 30 [model options]
    python bench/bare_loop.py --out result.json --model hf:DIR --seq-len 128    # a Hugging Face model
    python bench/bare_loop.py --out result.json --data PREFIX --pack            # instruction data, packed

Writes per-step times and losses, so the benchmark compares like with like and can check that both
loops trained the very same model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import harness  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    for name, default in (("global-batch", 16), ("max-steps", 30), ("seed", 1234), ("seq-len", 64), ("vocab-size", 256),
                          ("n-layer", 2), ("n-head", 4), ("n-embd", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--untie-embeddings", action="store_true", help="a separate output layer (the FSDP2/TP/PP recipe's)")
    p.add_argument("--model", default="gpt", help="gpt, or hf:DIR: a Hugging Face causal LM under the recipes' loss")
    p.add_argument("--data", default="synthetic", help="synthetic, or instruction data (prepare.py --chat): its batches")
    p.add_argument("--pack", action="store_true", help="with instruction data: packed windows (the recipes' --pack)")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    if args.model == "gpt":
        model = GPT(GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd,
                              tie_embeddings=not args.untie_embeddings))
    else:  # the same module the recipes build for --model hf:DIR (its loss: the logits against the next tokens)
        model = harness.model_spec(argparse.Namespace(model=args.model, seq_len=args.seq_len)).build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = (harness.SyntheticTokens(args.vocab_size, args.seq_len, args.seed) if args.data == "synthetic" else
            harness.ConversationData(args.data, args.seq_len, args.seed, pack=args.pack))
    model.train()
    history = []
    for step in range(1, args.max_steps + 1):
        t0 = time.perf_counter()
        inputs, targets, *positions = data.global_batch(step, args.global_batch)  # (packed: and the positions)
        loss = model(inputs, targets, *positions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # every real loop looks at its loss
        step_time = time.perf_counter() - t0
        history.append({"step": step, "loss": value, "step_time_s": step_time,
                        "samples_per_s": args.global_batch / step_time})
    args.out.write_text(json.dumps({"history": history}, indent=1) + "\n")


if __name__ == "__main__":
    main()
