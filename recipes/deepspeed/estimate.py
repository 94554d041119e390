"""--estimate-memory for recipes/deepspeed/train.py: will it fit, the per-GPU memory of ZeRO-N on --world ranks,
from one process: DeepSpeed's own engine on fake tensors (harness/memory.py), and the measured peak of a launched
run that an estimate is checked against. Kept out of train.py, which reads as DeepSpeed training;
``train.py --estimate-memory GPU --world N`` calls it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import warnings
from typing import Callable

import deepspeed
import torch

import harness

RECIPE = "deepspeed"


@contextlib.contextmanager
def deepspeed_on_fake_tensors(enabled: bool, model: torch.nn.Module, dtype: torch.dtype):
    """The real DeepSpeed engine, built and stepped on fake tensors (--estimate-memory --world N), with what it
    needs there: the model already in the engine's dtype and device (its own conversion swaps each parameter
    for a new tensor, which fake parameters refuse), the values it reads answered (harness.memory.
    fake_value_reads: no overflow, a finite norm), and ZeRO-3's check that every rank holds the same list of
    parameters skipped (it compares values sent over the process group; the fake group sends none)."""
    if not enabled:
        yield
        return
    import deepspeed.runtime.zero.partition_parameters as partition_parameters
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.utils as zero_utils

    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    model._apply = lambda fn, recurse=True: model  # (module.to(device), .bfloat16(): nothing to convert)
    checked = [module for module in (zero_utils, partition_parameters, coordinator)
               if hasattr(module, "assert_ints_same_as_other_ranks")]
    originals = [module.assert_ints_same_as_other_ranks for module in checked]
    for module in checked:
        module.assert_ints_same_as_other_ranks = lambda ints: None
    try:
        with harness.memory.fake_value_reads(True):
            yield
    finally:
        for module, original in zip(checked, originals):
            module.assert_ints_same_as_other_ranks = original
        del model._apply



def estimate_memory(args: argparse.Namespace, spec: harness.ModelSpec, validate: Callable) -> int:
    """--estimate-memory GPU: the per-GPU memory of ZeRO-N on --world ranks (harness/memory.py), from one
    process: DeepSpeed's own engine, built and stepped twice on fake tensors and a fake process group, under
    PyTorch's memory tracker, so that everything the engine allocates counts (its fp32 partitions, its reduce
    and all-gather buckets). Without --world, the launched run (one process, or torchrun's ranks) tracks its
    real engine instead: the measured peak an estimate is checked against. The config's dtype is the GPU's
    (bf16 where it says "auto"), on CPU too."""
    from torch.distributed._tools.mem_tracker import MemTracker

    env = harness.detect_dist_env()
    measured, world = harness.memory.estimate_world(args, env.world_size)
    ds_config, pp = validate(args, world, on_gpu=True)
    if pp > 1:
        raise harness.ConfigError(f"--estimate-memory with --pp {pp}: the ZeRO layouts only (--pp 1); a pipeline's "
                                  "stages: recipes/fsdp_tp_pp --pp")
    if spec.name != "gpt":  # (tried: a Hugging Face model's parameters refuse DeepSpeed's flat buffers on fake tensors)
        raise harness.ConfigError(f"--estimate-memory with --model {spec.name}: the stack's GPT only here; for your model, "
                                  "recipes/fsdp_tp_pp/train.py --estimate-memory --tp 1 --dp-shard N is ZeRO-3's layout")
    capacity = harness.memory.gpu_memory(args.estimate_memory)  # (a GPU name it knows, before any work)
    stage, accum = ds_config["zero_optimization"]["stage"], ds_config["gradient_accumulation_steps"]
    micro_rows = ds_config["train_micro_batch_size_per_gpu"]
    dtype = torch.bfloat16 if ds_config["bf16"].get("enabled") else torch.float32
    if measured:
        device, _ = harness.setup_torch_distributed(env, args.timeout_s, always_group=True)
    else:
        device = torch.device("cpu")
        harness.memory.fake_process_group(world)
    os.environ.update(RANK=str(env.rank), LOCAL_RANK=str(env.local_rank), WORLD_SIZE=str(world))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)  # (DeepSpeed's, harmless)
    tracker = MemTracker()
    with harness.memory.fake_tensors(not measured):
        torch.manual_seed(args.seed)
        model = spec.build()
        parameters = [p for p in model.parameters() if p.requires_grad]
        if measured:  # (fake parameters: tracked once the engine holds them, see deepspeed_on_fake_tensors)
            tracker.track_external(model)
        with deepspeed_on_fake_tensors(not measured, model, dtype), tracker:
            client_optimizer = torch.optim.SGD(parameters, lr=ds_config.pop("client_sgd_lr")) \
                if "client_sgd_lr" in ds_config else None
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters, optimizer=client_optimizer,
                                                   config=ds_config)
            assert engine.zero_optimization_stage() == stage
            if not measured:
                tracker.track_external(model)
            for _ in range(2):  # (the optimizer state exists from the first step on: the second's peak holds it)
                for _ in range(accum):
                    inputs = torch.randint(0, args.vocab_size, (micro_rows, args.seq_len), device=device)
                    engine.backward(engine(inputs, inputs))
                    engine.step()
                tracker.reset_mod_stats()
    peak = harness.memory.peak_by_kind(tracker, [])
    zero = ds_config["zero_optimization"]
    bucket = int(zero.get("reduce_bucket_size", 5e8))  # (DeepSpeed's default)
    code = 0
    if env.rank == 0:
        advice = ([f"a higher --zero-stage than {stage} (1: the optimizer state sharded over the ranks, 2: and the "
                   "gradients, 3: and the parameters)"] if stage < 3 else []) + [
            f"a smaller zero_optimization.reduce_bucket_size in --ds-config (now {bucket:.3g} elements, "
            f"{bucket * dtype.itemsize / 2**30:.2f} GiB in {str(dtype).removeprefix('torch.')}, allocated whole)",
            f"fewer rows per rank (now {micro_rows} per micro-batch: a smaller --global-batch, or --grad-accum)"]
        code = harness.memory.report(
            RECIPE, peak, args.estimate_memory, f"ZeRO-{stage} on {world} ranks, {micro_rows} rows of {args.seq_len} "
            f"tokens per micro-batch, {str(dtype).removeprefix('torch.')}", measured, advice)
        print(f"[{RECIPE}] (the tracker files DeepSpeed's own buffers where it finds them: its reduce bucket, "
              f"{bucket:.3g} elements, among the gradients or activations)", flush=True)
        if args.estimate_json:
            args.estimate_json.write_text(json.dumps({"world": world, "layout": {"zero_stage": stage, "dp": world},
                                                      "rows": micro_rows, "gpu": args.estimate_memory,
                                                      "gpu_bytes": capacity, "measured": measured,
                                                      "peak_bytes": peak}, indent=1) + "\n")
    if measured and world > 1:
        engine.destroy()  # the engine holds the process group: drop it before leaving the group
        engine = None
        harness.leave_process_group()
    return code

