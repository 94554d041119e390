"""The bare PyTorch training loop the recipes are measured against: same model, data, batch and optimizer,
nothing else (no checkpoints, no metrics logger, no signal handling, no collective of its own).

    python bench/bare_loop.py --out result.json --global-batch 8 --max-steps 30 [model options]
    python bench/bare_loop.py --out result.json --model hf:DIR --seq-len 128    # a Hugging Face model
    python bench/bare_loop.py --out result.json --data PREFIX --pack            # instruction data, packed
    torchrun --nproc-per-node 2 bench/bare_loop.py --out result.json --framework ddp    # N ranks (gloo)

Under torchrun, each rank trains on its rows of the global batch (the recipes' rows) in the framework's
minimal form (--framework: DDP, accelerate's prepare/backward, FSDP2's fully_shard, or DeepSpeed's engine with
the recipe's ds_config.json at --zero-stage, on one process too) and does what a minimal
user script does besides: it reads its own loss every step (rank 0 writes OUT, every rank OUT.rankN with its
losses, so that the benchmark can check the mean over the ranks against the recipe's loss).

Writes per-step times (the period from one step's start to the next's) and losses, so the benchmark compares
like with like and can check that both loops trained the very same model.
"""

from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("--framework", choices=("ddp", "accelerate", "fsdp", "deepspeed"), default="ddp",
                   help="how the ranks share the work under torchrun (one process: none, except deepspeed's engine)")
    p.add_argument("--zero-stage", type=int, default=2, help="--framework deepspeed: its ZeRO stage")
    args = p.parse_args()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # a GPU per rank where there are GPUs (NCCL), else the CPU (gloo), as the recipes choose
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.framework == "deepspeed":  # (its engine on one process too: the recipe's is one)
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29400"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                            ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)  # (one plain process: a world of one)
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    elif world_size > 1 and args.framework != "accelerate":  # (accelerate's Accelerator starts its own)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")

    torch.manual_seed(args.seed)
    if args.model == "gpt":
        model = GPT(GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd,
                              tie_embeddings=not args.untie_embeddings))
    else:  # the same module the recipes build for --model hf:DIR (its loss: the logits against the next tokens)
        model = harness.model_spec(argparse.Namespace(model=args.model, seq_len=args.seq_len)).build()
    model, accelerator = model.to(device), None
    if world_size > 1 and args.framework == "fsdp":  # each block sharded, then the rest (FSDP2's minimal form)
        from torch.distributed.fsdp import fully_shard

        # the GPT's blocks; a Hugging Face model's decoder layers (model.layers in every Llama-like model)
        blocks = model.blocks if hasattr(model, "blocks") else model.model.model.layers
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    elif world_size > 1 and args.framework == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0) if args.framework != "deepspeed" else None
    engine = None
    if args.framework == "deepspeed":  # the recipe's ds_config.json, as a minimal script writes it
        config = {"train_batch_size": args.global_batch, "train_micro_batch_size_per_gpu": args.global_batch // world_size,
                  "gradient_accumulation_steps": 1, "zero_optimization": {"stage": args.zero_stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                            "weight_decay": 0.0, "torch_adam": True}},
                  "gradient_clipping": 0.0, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if world_size > 1 and args.framework == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=device.type == "cpu")
        model, optimizer = accelerator.prepare(model, optimizer)
    data = (harness.SyntheticTokens(args.vocab_size, args.seq_len, args.seed) if args.data == "synthetic" else
            harness.ConversationData(args.data, args.seq_len, args.seed, pack=args.pack))
    model.train()
    history, started = [], time.perf_counter()
    for step in range(1, args.max_steps + 1):
        if world_size > 1:  # this rank's rows of the global batch
            inputs, targets, *positions = data.local_batch(step, args.global_batch, rank, world_size)
        else:
            inputs, targets, *positions = data.global_batch(step, args.global_batch)  # (packed: and the positions)
        inputs, targets, *positions = (part.to(device) for part in (inputs, targets, *positions))
        if engine is not None:
            loss = engine(inputs, targets, *positions)
            engine.backward(loss)
            engine.step()
        else:
            loss = model(inputs, targets, *positions)
            accelerator.backward(loss) if accelerator else loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # every real loop looks at its loss
        now = time.perf_counter()
        step_time, started = now - started, now  # (the whole period: from this step's start to the next's)
        history.append({"step": step, "loss": value, "step_time_s": step_time,
                        "samples_per_s": args.global_batch / step_time})
    Path(f"{args.out}.rank{rank}").write_text(json.dumps([record["loss"] for record in history]) + "\n")
    if rank == 0:
        args.out.write_text(json.dumps({"history": history, "world_size": world_size,
                                        "framework": args.framework if world_size > 1 else None}, indent=1) + "\n")
    # (no destroy_process_group, and no interpreter teardown under torchrun: gloo's teardown once hung and once
    # aborted (SIGABRT) a 4-rank run of this benchmark after every rank had written its losses, which failed
    # the whole benchmark; the harness ends its ranks the same way, harness/launch.py)
    if world_size > 1:
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
