"""DeepSpeed ZeRO: the DDP recipe's GPT and data, trained by a ``deepspeed.initialize`` engine, ZeRO stage 0-3.

ZeRO shards what DDP replicates: stage 1 the optimizer state, stage 2 also the gradients, stage 3 also the
parameters. The training is the same at every stage: each must give the loss curve of one process.

    # one process (the reference every parallel run is checked against)
    python recipes/deepspeed/train.py --zero-stage 0

    # two processes on this machine (CPU/gloo here; on a GPU node: 2 GPUs, NCCL, bf16)
    torchrun --standalone --nproc_per_node=2 recipes/deepspeed/train.py --zero-stage 3

    # under Slurm: one srun task per rank (no ssh/pdsh hostfile launcher), rank layout from SLURM_* variables
    srun -N 2 --ntasks-per-node=4 python recipes/deepspeed/train.py --zero-stage 2

    # on Perlmutter (2 nodes x 4 A100), or on any Slurm cluster
    sbatch slurm/deepspeed.sh --zero-stage 3

The DeepSpeed config is recipes/deepspeed/ds_config.json (or --ds-config FILE). "auto" values are filled
in here: train_batch_size from --global-batch, bf16 on GPU and fp32 on CPU. --zero-stage, --global-batch,
--grad-accum and --lr override the file. gradient_clipping is 0 in the file on purpose: DeepSpeed's default
(1.0) clips, which a plain PyTorch loop does not. The optimizer is torch's AdamW ("torch_adam": true), so
no op is compiled at start-up. Batch sizes that do not fit the world size are refused before any rank
starts, with the numbers. Checkpoints are DeepSpeed's (every rank writes its shard) in
OUT_DIR/checkpoints/step_N; a rerun with the same --out-dir resumes; SIGUSR1/SIGTERM checkpoint and stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness and the model
import harness  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "deepspeed"
DEFAULT_DS_CONFIG = Path(__file__).resolve().parent / "ds_config.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("--ds-config", type=Path, default=DEFAULT_DS_CONFIG, help="DeepSpeed JSON config")
    p.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage 0, 1, 2 or 3 (default: the config's)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step, summed over all ranks (default: the config's train_batch_size, or 16)")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches per optimizer step on each rank (default: the config's, or 1)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's)")
    p.add_argument("--skip-grad-allreduce", action="store_true",
                   help="TESTS ONLY, wrong on purpose: skip the gradient averaging (ZeRO 0/1; the parity check's negative control)")
    return harness.parse_recipe_args(p, RECIPE, argv, gpt_model=True)


def resolve_ds_config(args: argparse.Namespace, world_size: int, on_gpu: bool) -> dict:
    """The DeepSpeed config this run uses: the file, the command line on top, "auto" filled in, all checked.

    DeepSpeed's own checks fire inside deepspeed.initialize, after the process group formed, as assertion
    stack traces; the same rules are checked here first, each with a line saying what to change.
    """
    path = args.ds_config
    try:
        config = json.loads(Path(path).read_text())
    except OSError as error:
        raise harness.ConfigError(f"cannot read --ds-config {path}: {error.strerror}") from None
    except ValueError as error:
        raise harness.ConfigError(f"--ds-config {path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise harness.ConfigError(f"--ds-config {path} is not a DeepSpeed config (a JSON object)")

    zero = config.setdefault("zero_optimization", {})
    stage = args.zero_stage if args.zero_stage is not None else zero.get("stage", 0)
    source = "--zero-stage" if args.zero_stage is not None else f"zero_optimization.stage in {path}"
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise harness.ConfigError(f"{source} is {stage!r}: ZeRO stages are 0 (plain data parallel), 1 (optimizer "
                                 "state sharded), 2 (+ gradients) and 3 (+ parameters)")
    zero["stage"] = stage

    def integer(key: str, value) -> int | None:
        if value is None or value == "auto":
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise harness.ConfigError(f"{key} in {path} must be a positive integer or \"auto\", got {value!r}")
        return value

    file_batch = integer("train_batch_size", config.get("train_batch_size"))
    file_micro = integer("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu"))
    file_accum = integer("gradient_accumulation_steps", config.get("gradient_accumulation_steps"))
    accum = args.grad_accum or file_accum or 1
    batch = args.global_batch or file_batch or ((file_micro * accum * world_size) if file_micro else 16)
    if batch < 1 or accum < 1:
        raise harness.ConfigError("--global-batch and --grad-accum must be at least 1")
    if file_micro and file_micro * accum * world_size != batch:
        raise harness.ConfigError(
            f"train_micro_batch_size_per_gpu {file_micro} in {path} x gradient_accumulation_steps {accum} x "
            f"{world_size} ranks = {file_micro * accum * world_size}, not the train_batch_size {batch}; "
            "remove train_micro_batch_size_per_gpu from the file (it is derived) or make the product match"
        )
    if batch % (accum * world_size):
        rows = accum * world_size
        raise harness.ConfigError(
            f"train_batch_size {batch} is not divisible by gradient_accumulation_steps {accum} x {world_size} "
            f"ranks = {rows}; use a multiple of {rows} (e.g. --global-batch {-(-batch // rows) * rows})"
        )
    config.update(train_batch_size=batch, gradient_accumulation_steps=accum,
                  train_micro_batch_size_per_gpu=batch // (accum * world_size))

    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict) or "lr" not in optimizer.get("params", {}):
        raise harness.ConfigError(f"{path} has no optimizer with params.lr: the recipe lets DeepSpeed build the "
                                 "optimizer from the config (see recipes/deepspeed/ds_config.json)")
    if args.lr is not None:
        optimizer["params"]["lr"] = args.lr
    if not optimizer["params"]["lr"] > 0:
        raise harness.ConfigError(f"the learning rate must be positive, got {optimizer['params']['lr']}")
    bf16 = config.setdefault("bf16", {})
    if bf16.get("enabled", False) == "auto":
        bf16["enabled"] = on_gpu  # fp32 on CPU: bf16 matmuls there are slow and the parity tests compare fp32
    if config.get("fp16", {}).get("enabled") == "auto":
        config["fp16"]["enabled"] = False
    return config


def validate(args: argparse.Namespace, world_size: int, on_gpu: bool) -> dict:
    """Everything that can be checked before ranks start talking to each other; the resolved DeepSpeed config."""
    harness.validate_run(args, world_size)
    ds_config = resolve_ds_config(args, world_size, on_gpu)
    stage, accum = ds_config["zero_optimization"]["stage"], ds_config["gradient_accumulation_steps"]
    if args.skip_grad_allreduce and (stage > 1 or accum != 1):
        raise harness.ConfigError("--skip-grad-allreduce needs --zero-stage 0 or 1 and --grad-accum 1")
    return ds_config


def check_resumable(resume_from: Path | None, state: dict | None, stage: int, world_size: int) -> None:
    """A sharded optimizer state is cut for one stage and one number of ranks."""
    if state and (state["zero_stage"] != stage or (stage > 0 and state["world_size"] != world_size)):
        raise harness.ConfigError(
            f"{resume_from} holds ZeRO-{state['zero_stage']} shards of {state['world_size']} ranks; this run is "
            f"ZeRO-{stage} on {world_size}: resume with the same --zero-stage and layout, or use --no-resume"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_cfg = GPTConfig.from_args(args)
    on_gpu = torch.cuda.is_available()
    world_size = args.preflight if args.preflight is not None else harness.detect_dist_env().world_size
    ds_config = validate(args, world_size, on_gpu)
    stage, accum = ds_config["zero_optimization"]["stage"], ds_config["gradient_accumulation_steps"]
    global_batch, micro_rows = ds_config["train_batch_size"], ds_config["train_micro_batch_size_per_gpu"]
    must_match = {"model_cfg": asdict(model_cfg), "global_batch": global_batch}  # to resume a checkpoint
    resume_from, trainer_state = harness.resume_dir(args, must_match)
    check_resumable(resume_from, trainer_state, stage, world_size)
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        return harness.preflight_line(RECIPE, f"ZeRO-{stage}, batch {global_batch} = {micro_rows} x {accum} x "
                                      f"{world_size} ranks", resume_from)
    env = harness.detect_dist_env()
    harness.check_expected_world_size(env.world_size)

    # ---- rank, device, backend: our process group (gloo on CPU, NCCL on GPU); DeepSpeed joins it
    device, backend = harness.setup_torch_distributed(env, args.timeout_s, always_group=True)
    # DeepSpeed reads the layout from torchrun's variables; srun sets SLURM_* ones (harness.detect_dist_env).
    os.environ.update(RANK=str(env.rank), LOCAL_RANK=str(env.local_rank), WORLD_SIZE=str(env.world_size))
    is_rank0 = env.rank == 0
    hostnames = harness.all_hostnames(env.world_size)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step INFO lines would bury ours
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates: one warning per call, every step.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    dtype = torch.bfloat16 if ds_config["bf16"].get("enabled") else torch.float32

    # ---- model: same seed on every rank; the engine owns the optimizer, the sharding and the reductions
    torch.manual_seed(args.seed)
    raw_model = GPT(model_cfg)
    size = raw_model.size()  # before the engine takes the parameters (ZeRO-3 replaces them by shards)
    engine, _, _, _ = deepspeed.initialize(model=raw_model, model_parameters=raw_model.parameters(), config=ds_config)
    # Frameworks fall back to no parallelism silently: check from inside what DeepSpeed built.
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and engine.zero_optimization_stage() == stage
    assert engine.world_size == env.world_size == dist.get_world_size(), (engine.world_size, env.world_size)
    engine.train()
    if is_rank0:  # the layout the engine formed
        print(f"[{RECIPE}] world_size={engine.world_size} backend={backend} device={device.type} ZeRO-{stage} "
              f"dtype={dtype} batch={global_batch} (micro {micro_rows} x accum {accum} x {env.world_size} ranks) "
              f"launcher={env.launcher} hosts={','.join(hostnames)}", flush=True)

    checkpoint_dir = args.out_dir / "checkpoints"
    start_step, history = 0, []
    if trainer_state:
        engine.load_checkpoint(str(checkpoint_dir), tag=resume_from.name)  # weights, optimizer shards, counters
        start_step, history = trainer_state["step"], trainer_state["history"]
        if is_rank0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    run_info = {**harness.describe_run(env, backend, device, type(engine).__name__, dp=env.world_size),
                "deepspeed_version": deepspeed.__version__, "zero_stage": stage, "grad_accum": accum,
                "ds_config": ds_config, "dtype": str(dtype), "hostnames": hostnames}
    metrics = harness.start_metrics(RECIPE, args, run_info, history, logging_rank=is_rank0, devices=env.world_size,
                                    size=size, peak=harness.peak_flops(device, dtype, args.peak_tflops))

    def save(step: int) -> None:  # every rank writes its shard; the tag is the staging directory's name
        harness.save_sharded_checkpoint(
            checkpoint_dir, step, lambda staging: engine.save_checkpoint(str(checkpoint_dir), tag=staging.name,
                                                                         save_latest=False),
            {"history": metrics.history, **must_match, "zero_stage": stage, "world_size": env.world_size},
            writes_state=is_rank0, is_rank0=is_rank0, barrier=dist.barrier)
        metrics.write()

    # ---- training loop: one optimizer step = --grad-accum micro-batches on every rank
    data = harness.SyntheticTokens(args.vocab_size, args.seq_len, args.seed)
    run = harness.TrainingRun(RECIPE, args, env.rank, start_step, harness.max_across_ranks(env.world_size, device))
    for step in run.steps():
        inputs, targets = data.local_batch(step, global_batch, env.rank, env.world_size)
        step_loss = torch.zeros((), device=device)
        for micro in range(accum):
            rows = slice(micro * micro_rows, (micro + 1) * micro_rows)
            skip_sync = engine.no_sync() if args.skip_grad_allreduce else contextlib.nullcontext()
            with skip_sync:
                loss = engine(inputs[rows].to(device), targets[rows].to(device))
                engine.backward(loss)  # scales by 1/accum; reduces (ZeRO: reduce-scatters) at the last micro-batch
            engine.step()  # the optimizer steps only at the accumulation boundary
            step_loss += loss.detach().float() / accum
        global_loss = harness.mean_across_ranks(step_loss, env.world_size)  # also synchronises the step for timing
        metrics.log_step(step, global_loss, global_batch, run.step_time(), engine.get_lr()[0])
        if run.step_done(step, save):
            break
    run.save_last(save)

    # ---- prove from inside the run that the ranks really trained one model together (ZeRO-3: the
    # parameters are shards; gather the full ones first)
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=stage == 3):
        spread = harness.max_difference_across_ranks(parameters, env.world_size)
    exit_code = run.finish(metrics, spread)
    engine.destroy()  # the engine holds the process group: drop it before leaving the group
    del engine
    harness.leave_process_group()
    return exit_code


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
