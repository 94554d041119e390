"""The bare loop the Megatron recipe is measured against: the same megatron-core GPTModel (TP 1, PP 1), the
same weights and data, a plain PyTorch step (forward, backward, torch AdamW) and nothing else: no megatron
DDP wrapper or grad buffers, no pipeline schedule, no megatron optimizer, no checkpoints, no metrics logger.

    python bench/bare_megatron_loop.py --out result.json --global-batch 8 --max-steps 30 [model options]
    torchrun --nproc-per-node 2 bench/bare_megatron_loop.py --out result.json    # N data-parallel ranks (gloo)

megatron-core cannot build a model without its parallel state, which needs a process group: on one process
a world of one, in memory; under torchrun the ranks' group, each rank its rows of the global batch and
PyTorch's DDP (what a minimal user script reaches for) averaging the gradients. Without a CUDA device it runs
through the recipe's placement shim, as the recipe does. Compare with the recipe at --micro-batch = the rows
per rank and --clip-grad 0 (one micro-batch per rank and step, no clipping). Each rank writes OUT.rankN with
its losses; rank 0 writes OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes" / "megatron_tp_pp"
sys.path[:0] = [str(RECIPE_DIR.parent), str(RECIPE_DIR)]
import harness  # noqa: E402
from train import init_weights_by_global_name  # noqa: E402  (the recipe's weights, so both start alike)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    for name, default in (("global-batch", 8), ("max-steps", 30), ("seed", 1234), ("seq-len", 64), ("vocab-size", 256),
                          ("num-layers", 4), ("hidden-size", 64), ("num-heads", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    warnings.filterwarnings("ignore", r"(Transformer Engine and )?Apex (is|are) not installed", UserWarning)
    if not torch.cuda.is_available():
        import cpu_placement_shim

        cpu_placement_shim.enable()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    # The recipe's model on one CPU process (its TransformerConfig at TP 1, PP 1, fp32).
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_len, position_embedding_type="rope")
    init_weights_by_global_name([model], args.seed)
    model = model.to(device)
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = harness.SyntheticTokens(args.vocab_size, args.seq_len, args.seed)
    causal_mask = torch.triu(torch.ones(1, 1, args.seq_len, args.seq_len, dtype=torch.bool), diagonal=1).to(device)
    position_ids = torch.arange(args.seq_len).unsqueeze(0).to(device)
    model.train()
    history, started = [], time.perf_counter()
    for step in range(1, args.max_steps + 1):
        if world_size > 1:  # this rank's rows of the global batch
            inputs, targets = data.local_batch(step, args.global_batch, rank, world_size)
        else:
            inputs, targets = data.global_batch(step, args.global_batch)
        inputs, targets = inputs.to(device), targets.to(device)
        loss = model(inputs, position_ids, causal_mask, labels=targets).float().mean()
        loss.backward()
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
                                        "framework": "ddp" if world_size > 1 else None}, indent=1) + "\n")
    if world_size == 1:  # (the in-memory group)
        dist.destroy_process_group()
    else:  # under torchrun, no teardown, as bench/bare_loop.py (gloo's has aborted a finished rank)
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
