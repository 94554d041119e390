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
import gc
import json
import logging
import os
import signal
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared modules
import common  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "deepspeed"
DEFAULT_DS_CONFIG = Path(__file__).resolve().parent / "ds_config.json"
TRAINER_STATE = "trainer_state.json"  # step, loss history and layout, next to DeepSpeed's own files


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-config", type=Path, default=DEFAULT_DS_CONFIG, help="DeepSpeed JSON config")
    p.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage 0, 1, 2 or 3 (default: the config's)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step, summed over all ranks (default: the config's train_batch_size, or 16)")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches per optimizer step on each rank (default: the config's, or 1)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's)")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=1234, help="seeds the weights and the synthetic data")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--out-dir", type=Path, default=Path("runs/deepspeed"), help="checkpoints and metrics.json")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out-dir")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and exit after this step, as if the allocation ended; rerun to continue")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="process-group timeout: a collective that waits longer fails the job")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: data sheet on GPU, measured matmul on CPU)")
    p.add_argument("--config", type=Path, default=None,
                   help="a TOML file of these options (keys as here, without '--'); the command line wins")
    p.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE",
                   help="only check the options, the DeepSpeed config (and a checkpoint to resume) for this many ranks")
    p.add_argument("--skip-grad-allreduce", action="store_true",
                   help="TESTS ONLY, wrong on purpose: skip the gradient averaging (ZeRO 0/1; the parity check's negative control)")
    return common.parse_args_with_config(p, argv)


def resolve_ds_config(args: argparse.Namespace, world_size: int, on_gpu: bool) -> dict:
    """The DeepSpeed config this run uses: the file, the command line on top, "auto" filled in, all checked.

    DeepSpeed's own checks fire inside deepspeed.initialize, after the process group formed, as assertion
    stack traces; the same rules are checked here first, each with a line saying what to change.
    """
    path = args.ds_config
    try:
        config = json.loads(Path(path).read_text())
    except OSError as error:
        raise common.ConfigError(f"cannot read --ds-config {path}: {error.strerror}") from None
    except ValueError as error:
        raise common.ConfigError(f"--ds-config {path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise common.ConfigError(f"--ds-config {path} is not a DeepSpeed config (a JSON object)")

    zero = config.setdefault("zero_optimization", {})
    stage = args.zero_stage if args.zero_stage is not None else zero.get("stage", 0)
    source = "--zero-stage" if args.zero_stage is not None else f"zero_optimization.stage in {path}"
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise common.ConfigError(f"{source} is {stage!r}: ZeRO stages are 0 (plain data parallel), 1 (optimizer "
                                 "state sharded), 2 (+ gradients) and 3 (+ parameters)")
    zero["stage"] = stage

    def integer(key: str, value) -> int | None:
        if value is None or value == "auto":
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise common.ConfigError(f"{key} in {path} must be a positive integer or \"auto\", got {value!r}")
        return value

    file_batch = integer("train_batch_size", config.get("train_batch_size"))
    file_micro = integer("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu"))
    file_accum = integer("gradient_accumulation_steps", config.get("gradient_accumulation_steps"))
    accum = args.grad_accum or file_accum or 1
    batch = args.global_batch or file_batch or ((file_micro * accum * world_size) if file_micro else 16)
    if batch < 1 or accum < 1:
        raise common.ConfigError("--global-batch and --grad-accum must be at least 1")
    if file_micro and file_micro * accum * world_size != batch:
        raise common.ConfigError(
            f"train_micro_batch_size_per_gpu {file_micro} in {path} x gradient_accumulation_steps {accum} x "
            f"{world_size} ranks = {file_micro * accum * world_size}, not the train_batch_size {batch}; "
            "remove train_micro_batch_size_per_gpu from the file (it is derived) or make the product match"
        )
    if batch % (accum * world_size):
        rows = accum * world_size
        raise common.ConfigError(
            f"train_batch_size {batch} is not divisible by gradient_accumulation_steps {accum} x {world_size} "
            f"ranks = {rows}; use a multiple of {rows} (e.g. --global-batch {-(-batch // rows) * rows})"
        )
    config.update(train_batch_size=batch, gradient_accumulation_steps=accum,
                  train_micro_batch_size_per_gpu=batch // (accum * world_size))

    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict) or "lr" not in optimizer.get("params", {}):
        raise common.ConfigError(f"{path} has no optimizer with params.lr: the recipe lets DeepSpeed build the "
                                 "optimizer from the config (see recipes/deepspeed/ds_config.json)")
    if args.lr is not None:
        optimizer["params"]["lr"] = args.lr
    if not optimizer["params"]["lr"] > 0:
        raise common.ConfigError(f"the learning rate must be positive, got {optimizer['params']['lr']}")
    bf16 = config.setdefault("bf16", {})
    if bf16.get("enabled", False) == "auto":
        bf16["enabled"] = on_gpu  # fp32 on CPU: bf16 matmuls there are slow and the parity tests compare fp32
    if config.get("fp16", {}).get("enabled") == "auto":
        config["fp16"]["enabled"] = False
    return config


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Everything that can be checked before ranks start talking to each other (besides the DeepSpeed config)."""
    for name in ("max_steps", "seq_len", "vocab_size", "n_layer", "n_head", "n_embd", "log_every"):
        if getattr(args, name) < 1:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.timeout_s > 0:
        raise common.ConfigError(f"--timeout-s must be positive, got {args.timeout_s}")
    if args.checkpoint_every < 0:
        raise common.ConfigError(f"--checkpoint-every must be 0 (only at the end) or more, got {args.checkpoint_every}")
    if args.n_embd % args.n_head:
        raise common.ConfigError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        raise common.ConfigError(f"--stop-at-step must be between 1 and --max-steps {args.max_steps}")


def load_trainer_state(args: argparse.Namespace, model_cfg: GPTConfig, ds_config: dict,
                       world_size: int) -> tuple[Path | None, dict | None]:
    """The newest checkpoint in --out-dir, if this run can continue it (same model, batch, stage, ranks)."""
    resume_from = None if args.no_resume else common.latest_checkpoint_dir(args.out_dir / "checkpoints")
    if resume_from is None:
        return None, None
    try:
        state = json.loads((resume_from / TRAINER_STATE).read_text())
    except (OSError, ValueError) as error:
        raise common.ConfigError(f"cannot read {resume_from / TRAINER_STATE} ({type(error).__name__}): "
                                 "move the checkpoint away, or use --no-resume") from None
    stage = ds_config["zero_optimization"]["stage"]
    if state["model_cfg"] != asdict(model_cfg) or state["global_batch"] != ds_config["train_batch_size"]:
        raise common.ConfigError(
            f"{resume_from} was written with {state['model_cfg']} and --global-batch {state['global_batch']}; "
            "use the same settings, a new --out-dir, or --no-resume"
        )
    # A sharded optimizer state is cut for one stage and one number of ranks.
    if state["zero_stage"] != stage or (stage > 0 and state["world_size"] != world_size):
        raise common.ConfigError(
            f"{resume_from} holds ZeRO-{state['zero_stage']} shards of {state['world_size']} ranks; this run is "
            f"ZeRO-{stage} on {world_size}: resume with the same --zero-stage and layout, or use --no-resume"
        )
    return resume_from, state


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_cfg = GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd)
    on_gpu = torch.cuda.is_available()
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        validate(args, args.preflight)
        ds_config = resolve_ds_config(args, args.preflight, on_gpu)
        resume_from, _ = load_trainer_state(args, model_cfg, ds_config, args.preflight)
        print(f"[{RECIPE}] preflight: ZeRO-{ds_config['zero_optimization']['stage']}, batch "
              f"{ds_config['train_batch_size']} = {ds_config['train_micro_batch_size_per_gpu']} x "
              f"{ds_config['gradient_accumulation_steps']} x {args.preflight} ranks"
              + (f"; will resume from {resume_from}" if resume_from else ""), flush=True)
        return 0
    env = common.detect_dist_env()
    validate(args, env.world_size)
    common.check_expected_world_size(env.world_size)
    ds_config = resolve_ds_config(args, env.world_size, on_gpu)
    stage, accum = ds_config["zero_optimization"]["stage"], ds_config["gradient_accumulation_steps"]
    global_batch, micro_rows = ds_config["train_batch_size"], ds_config["train_micro_batch_size_per_gpu"]
    if args.skip_grad_allreduce and (env.world_size == 1 or stage > 1 or accum != 1):
        raise common.ConfigError("--skip-grad-allreduce needs more than one rank, --zero-stage 0 or 1 and --grad-accum 1")
    checkpoint_dir = args.out_dir / "checkpoints"
    resume_from, trainer_state = load_trainer_state(args, model_cfg, ds_config, env.world_size)

    # ---- rank, device, backend: our process group (gloo on CPU, NCCL on GPU); DeepSpeed joins it
    device, backend = common.setup_torch_distributed(env, args.timeout_s)
    if env.world_size == 1:  # DeepSpeed always wants a process group: one rank, in memory, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    # DeepSpeed reads the layout from torchrun's variables; srun sets SLURM_* ones (common.detect_dist_env).
    os.environ.update(RANK=str(env.rank), LOCAL_RANK=str(env.local_rank), WORLD_SIZE=str(env.world_size))
    is_rank0 = env.rank == 0
    hostnames = common.all_hostnames(env.world_size)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step INFO lines would bury ours
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates: one warning per call, every step.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    dtype = torch.bfloat16 if ds_config["bf16"].get("enabled") else torch.float32
    if is_rank0:
        print(f"[{RECIPE}] world_size={env.world_size} backend={backend} device={device.type} ZeRO-{stage} "
              f"dtype={dtype} batch={global_batch} (micro {micro_rows} x accum {accum} x {env.world_size} ranks) "
              f"launcher={env.launcher} hosts={','.join(hostnames)}", flush=True)

    # ---- model: same seed on every rank; the engine owns the optimizer, the sharding and the reductions
    torch.manual_seed(args.seed)
    raw_model = GPT(model_cfg)
    n_params = sum(p.numel() for p in raw_model.parameters())
    flops_per_token = common.transformer_flops_per_token(raw_model.num_params_for_flops(), args.n_layer, args.n_embd, args.seq_len)
    engine, _, _, _ = deepspeed.initialize(model=raw_model, model_parameters=raw_model.parameters(), config=ds_config)
    # Frameworks fall back to no parallelism silently: check from inside what DeepSpeed built.
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and engine.zero_optimization_stage() == stage
    assert engine.world_size == env.world_size == dist.get_world_size(), (engine.world_size, env.world_size)

    start_step, history = 0, []
    if trainer_state:
        engine.load_checkpoint(str(checkpoint_dir), tag=resume_from.name)  # weights, optimizer shards, counters
        start_step, history = trainer_state["step"], trainer_state["history"]
        if is_rank0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    data = common.SyntheticTokens(args.vocab_size, args.seq_len, args.seed)
    peak, peak_source = common.peak_flops(device, dtype, args.peak_tflops)
    metrics = common.MetricsLogger(
        recipe=RECIPE, path=args.out_dir / "metrics.json", is_logging_rank=is_rank0, tokens_per_sample=args.seq_len,
        flops_per_token=flops_per_token, peak_flops_per_device=peak, peak_source=peak_source,
        world_size=env.world_size, log_every=args.log_every, history=history,
        run_info={**common.describe_run(env, backend, device, type(engine).__name__), "hostnames": hostnames,
                  "layout": {"dp": env.world_size}, "zero_stage": stage, "grad_accum": accum,
                  "deepspeed_version": deepspeed.__version__, "ds_config": ds_config, "dtype": str(dtype),
                  "config": vars(args), "resumed_from_step": start_step or None},
    )
    if is_rank0:
        print(f"[{RECIPE}] {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.2f} MFLOP/token, "
              f"peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})", flush=True)

    def save(step: int) -> None:
        staging = common.staging_checkpoint_dir(checkpoint_dir, step)
        # Every rank writes its shard; the tag is the staging directory's name, published below.
        engine.save_checkpoint(str(checkpoint_dir), tag=staging.name, save_latest=False)
        if is_rank0:
            common.atomic_write_bytes(staging / TRAINER_STATE, json.dumps({
                "step": step, "history": metrics.history, "model_cfg": asdict(model_cfg),
                "global_batch": global_batch, "zero_stage": stage, "world_size": env.world_size}).encode())
        dist.barrier()
        if is_rank0:
            common.publish_checkpoint_dir(checkpoint_dir, step)
            metrics.write()

    # ---- training loop: one optimizer step = --grad-accum micro-batches on every rank
    if is_rank0:
        (args.out_dir / common.STOP_MARKER).unlink(missing_ok=True)  # from an earlier, stopped run
    stop = common.StopRequest(RECIPE, env.rank)
    stopped_by = 0
    engine.train()
    last_step = start_step
    for step in range(start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
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
        global_loss = common.mean_across_ranks(step_loss, env.world_size)  # also synchronises the step for timing
        metrics.log_step(step, global_loss, global_batch, time.perf_counter() - t0, engine.get_lr()[0])
        last_step = step
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
        stopped_by = stop.agreed(env.world_size, device)
        if step == args.stop_at_step or stopped_by:
            break
    if last_step > start_step and not (args.checkpoint_every and last_step % args.checkpoint_every == 0):
        save(last_step)

    # ---- prove from inside the run that the ranks really trained one model together (ZeRO-3: the
    # parameters are shards; gather the full ones first)
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=stage == 3):
        spread = common.max_difference_across_ranks(parameters, env.world_size)
    metrics.write({"param_max_abs_diff_across_ranks": spread, "last_step": last_step,
                   "stopped_early": last_step < args.max_steps,
                   "stopped_by_signal": signal.Signals(stopped_by).name if stopped_by else None})
    if is_rank0:
        s = metrics.summary()
        print(f"[{RECIPE}] done: step {last_step}/{args.max_steps}, final loss {s['final_loss']:.4f}, "
              f"{s['mean_samples_per_s']:.1f} samples/s, {s['mean_tokens_per_s']:.0f} tokens/s, "
              f"MFU {100 * s['mean_mfu']:.2f}% (peak {peak / 1e12:.3f} TFLOP/s, {peak_source}); "
              f"metrics in {metrics.path}", flush=True)
    if dist.is_initialized():
        # As in the DDP recipe: drop the engine (it holds the process group) before destroying the group.
        dist.barrier()
        engine.destroy()
        del engine
        gc.collect()
        dist.destroy_process_group()
    if spread != 0.0:
        common.stderr_line(f"[{RECIPE}] error: parameters differ across ranks by up to {spread:.3g}: "
                           "gradients were not synchronised")
        return 3
    if stopped_by and is_rank0:
        common.StopRequest.write_marker(args.out_dir, stopped_by, last_step)
        print(f"[{RECIPE}] stopped by {signal.Signals(stopped_by).name} after step {last_step}: checkpoint written; "
              "run again with the same --out-dir to continue (slurm/ files requeue the job themselves)", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except common.ConfigError as error:
        common.exit_on_config_error(RECIPE, error)
    except RuntimeError as error:  # torch's DistBackendError included
        if dist.is_available() and dist.is_initialized():
            common.exit_on_collective_failure(RECIPE, error)
        raise
