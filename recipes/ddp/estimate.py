"""--estimate-memory for recipes/ddp/train.py: will it fit, the per-GPU memory of DDP on --world ranks, from one
process (harness/memory.py), and the measured peak of a launched run that an estimate is checked against.
Kept out of train.py, which reads as DDP training; ``train.py --estimate-memory GPU --world N`` calls it.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import harness

RECIPE = "ddp"


def estimate_memory(args: argparse.Namespace, spec: harness.ModelSpec, validate: Callable) -> int:
    """--estimate-memory GPU: rank 0's memory in DDP on --world ranks (harness/memory.py), from one process:
    the model at the per-rank batch on fake tensors, plus DDP's gradient buckets. Without --world, the launched
    run (one process, or torchrun's ranks) tracks its own real tensors and reads the real reducer's bucket
    sizes: the measured peak an estimate is checked against. The dtype is the GPU's (--dtype auto: bf16)."""
    env = harness.detect_dist_env()
    measured, world = harness.memory.estimate_world(args, env.world_size)
    validate(args, world, spec)
    capacity = harness.memory.gpu_memory(args.estimate_memory)  # (a GPU name it knows, before any work)
    device = harness.setup_torch_distributed(env, args.timeout_s)[0] if measured else torch.device("cpu")
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    rows = args.global_batch // (world * args.grad_accum)  # (a micro-batch's: activations are the micro-batch's)
    with harness.memory.fake_tensors(not measured):
        torch.manual_seed(args.seed)
        if measured or spec.build_empty is None:
            model = spec.build()
        else:  # a Hugging Face model on fake tensors: from its config.json alone (no weights read)
            model = spec.build_empty(meta=False)
        model = model if device.type == "cpu" else model.to(device)  # (fake tensors: no .to)
        wrapped = DDP(model) if measured and world > 1 else None
        optimizer = harness.torch_optimizer(model.parameters(), args.optimizer, args.lr)

        def train_step() -> None:
            inputs = torch.randint(0, args.vocab_size, (rows, args.seq_len), device=device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = (wrapped or model)(inputs, inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        peak = harness.memory.tracked_peak([model], [optimizer], train_step, fsdp=False)
        buckets = harness.memory.ddp_bucket_bytes(model, wrapped) if world > 1 else 0
    peak["communication buffers"] += buckets
    if wrapped is not None:  # the real wrapper: the tracker saw its buckets, which DDP rebuilds in the first backward
        peak["activations"] -= buckets  # (in the order the gradients arrive), as temporaries: filed as what they are
    else:  # the estimate: the buckets a wrapper would hold, from its start, add to the model's own peak
        peak["total"] += buckets
    code = 0
    if env.rank == 0:
        code = harness.memory.report(
            RECIPE, peak, args.estimate_memory, f"DDP on {world} ranks, {rows} rows of {args.seq_len} tokens per rank"
            f"{f' and micro-batch (--grad-accum {args.grad_accum})' if args.grad_accum > 1 else ''}, "
            f"{str(dtype).removeprefix('torch.')}, {args.optimizer}", measured,
            ["FSDP2 instead of DDP (recipes/fsdp_tp_pp: parameters, gradients and optimizer state sharded over the ranks)",
             f"fewer rows per rank (more --grad-accum micro-batches, a smaller --global-batch than {args.global_batch}, "
             "or more ranks)"])
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        ranks = min(world, harness.memory.RANKS_PER_NODE)
        print(f"[{RECIPE}] host memory per node ({ranks} ranks): {ranks * whole / 2**30:.1f} GiB to load: DDP keeps a whole "
              "replica on every rank by design, and each rank loads the whole model (recipes/fsdp_tp_pp shards it "
              "as it loads)", flush=True)
        if args.estimate_json:
            args.estimate_json.write_text(json.dumps({"world": world, "layout": {"dp": world}, "rows": rows,
                                                      "gpu": args.estimate_memory, "gpu_bytes": capacity,
                                                      "measured": measured, "peak_bytes": peak}, indent=1) + "\n")
    if measured and world > 1:
        del wrapped  # (the reducer holds the process group)
        harness.leave_process_group()
    return code

