"""PyTorch DistributedDataParallel: a small GPT on synthetic tokens, from one CPU to many GPU nodes.

The same file runs everywhere; it picks NCCL when CUDA is present and gloo otherwise, and logs which.

    # one process (the reference every parallel run is checked against)
    python recipes/ddp/train.py

    # two processes on this machine (CPU/gloo, or 2 GPUs/NCCL)
    torchrun --standalone --nproc_per_node=2 recipes/ddp/train.py

    # under Slurm, one process per task, started by srun directly (rank layout from SLURM_* variables)
    srun -N 2 --ntasks-per-node=4 python recipes/ddp/train.py

    # on Perlmutter (Shifter image, 2 nodes x 4 A100), or on any Slurm cluster
    sbatch slurm/ddp.sh

Every rank gets global_batch / world_size rows of the same global batch, so the loss curve does not depend
on the number of ranks: 2 ranks must match 1 process to float precision (tests/test_ddp_parity.py).
Checkpoints go to OUT_DIR/checkpoints every --checkpoint-every steps and at the end; a rerun with the same
--out-dir resumes from the newest one. Rank 0 writes OUT_DIR/metrics.json. SIGUSR1 (Slurm's time-limit
warning) or SIGTERM (preemption): every rank stops after the same step, checkpoints and exits 0, leaving
OUT_DIR/stopped_by_signal for the launcher, which requeues the job. Options can come from a TOML file:

    python recipes/ddp/train.py --config run.toml --max-steps 100   # the command line wins
    python recipes/ddp/train.py --preflight 8                       # only check the options for 8 ranks
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared modules
import common  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "ddp"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, summed over all ranks")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234, help="seeds the weights and the synthetic data")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="autocast dtype; auto = bfloat16 on GPU, float32 on CPU")
    p.add_argument("--out-dir", type=Path, default=Path("runs/ddp"), help="checkpoints and metrics.json")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out-dir")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and exit after this step, as if the allocation ended; rerun to continue")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="process-group timeout: a collective that waits longer fails the job")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: data sheet on GPU, measured matmul on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU speed; slow to start)")
    p.add_argument("--config", type=Path, default=None,
                   help="a TOML file of these options (keys as here, without '--'); the command line wins")
    p.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE",
                   help="only check the options (and a checkpoint to resume) for this many ranks, then exit")
    p.add_argument("--skip-grad-allreduce", action="store_true",
                   help="TESTS ONLY, wrong on purpose: skip DDP's gradient averaging (the parity check's negative control)")
    return common.parse_args_with_config(p, argv)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Everything that can be checked before ranks start talking to each other."""
    for name in ("global_batch", "max_steps", "seq_len", "vocab_size", "n_layer", "n_head", "n_embd", "log_every"):
        if getattr(args, name) < 1:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("lr", "timeout_s"):
        if not getattr(args, name) > 0:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.checkpoint_every < 0:
        raise common.ConfigError(f"--checkpoint-every must be 0 (only at the end) or more, got {args.checkpoint_every}")
    if args.global_batch % world_size:
        nearest = -(-args.global_batch // world_size) * world_size  # the next multiple up
        raise common.ConfigError(
            f"--global-batch {args.global_batch} is not divisible by the world size {world_size}; "
            f"use a multiple of {world_size} (e.g. --global-batch {nearest})"
        )
    if args.n_embd % args.n_head:
        raise common.ConfigError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        raise common.ConfigError(f"--stop-at-step must be between 1 and --max-steps {args.max_steps}")
    if args.skip_grad_allreduce and world_size == 1:
        raise common.ConfigError("--skip-grad-allreduce only means something with more than one rank")


def load_resume_checkpoint(args: argparse.Namespace, model_cfg: GPTConfig) -> tuple[Path | None, dict | None]:
    """The newest checkpoint in --out-dir, if it was written by the same model and batch."""
    resume_from = None if args.no_resume else common.latest_checkpoint(args.out_dir / "checkpoints")
    if resume_from is None:
        return None, None
    try:
        checkpoint = torch.load(resume_from, map_location="cpu", weights_only=True)
    except Exception as error:  # a file we did not write (our own writes are atomic)
        raise common.ConfigError(f"cannot read the checkpoint {resume_from} ({type(error).__name__}): "
                                 "move it away, or use --no-resume") from None
    if checkpoint["model_cfg"] != asdict(model_cfg) or checkpoint["global_batch"] != args.global_batch:
        raise common.ConfigError(
            f"{resume_from} was written with {checkpoint['model_cfg']} and --global-batch "
            f"{checkpoint['global_batch']}; use the same settings, a new --out-dir, or --no-resume"
        )
    return resume_from, checkpoint


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_cfg = GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd)
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        validate(args, args.preflight)
        resume_from, _ = load_resume_checkpoint(args, model_cfg)
        print(f"[{RECIPE}] preflight: options fit world size {args.preflight}"
              + (f"; will resume from {resume_from}" if resume_from else ""), flush=True)
        return 0
    env = common.detect_dist_env()
    validate(args, env.world_size)
    checkpoint_dir = args.out_dir / "checkpoints"
    resume_from, checkpoint = load_resume_checkpoint(args, model_cfg)

    # ---- rank, device, backend
    device, backend = common.setup_torch_distributed(env, args.timeout_s)
    is_rank0 = env.rank == 0
    hostnames = common.all_hostnames(env.world_size)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if is_rank0:
        print(f"[{RECIPE}] world_size={env.world_size} backend={backend} device={device.type} dtype={dtype} "
              f"launcher={env.launcher} master={env.master_addr}:{env.master_port} hosts={','.join(hostnames)}",
              flush=True)

    # ---- model: same seed on every rank; DDP also broadcasts rank 0's weights at construction
    torch.manual_seed(args.seed)
    model = GPT(model_cfg).to(device)
    raw_model = model  # checkpoints and parameter checks use the plain module
    if args.compile:
        model = torch.compile(model)
    if env.world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        # Frameworks fall back to no parallelism silently; refuse to "train in parallel" without the wrapper.
        assert isinstance(model, DDP) and dist.get_world_size() == env.world_size
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, weight_decay=0.0)

    start_step, history = 0, []
    if checkpoint:
        raw_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        common.restore_rng_state(checkpoint["rng"])
        start_step, history = checkpoint["step"], checkpoint["history"]
        if is_rank0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    data = common.SyntheticTokens(args.vocab_size, args.seq_len, args.seed)
    peak, peak_source = common.peak_flops(device, dtype, args.peak_tflops)
    flops_per_token = common.transformer_flops_per_token(raw_model.num_params_for_flops(), args.n_layer, args.n_embd, args.seq_len)
    metrics = common.MetricsLogger(
        recipe=RECIPE, path=args.out_dir / "metrics.json", is_logging_rank=is_rank0, tokens_per_sample=args.seq_len,
        flops_per_token=flops_per_token, peak_flops_per_device=peak, peak_source=peak_source,
        world_size=env.world_size, log_every=args.log_every, history=history,
        run_info={**common.describe_run(env, backend, device, type(model).__name__), "hostnames": hostnames,
                  "layout": {"dp": env.world_size},
                  "dtype": str(dtype), "config": vars(args), "resumed_from_step": start_step or None},
    )
    if is_rank0:
        print(f"[{RECIPE}] {sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M parameters, "
              f"{flops_per_token / 1e6:.2f} MFLOP/token, peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})",
              flush=True)

    def save(step: int) -> None:
        if is_rank0:  # DDP keeps every rank's weights identical: one copy is the checkpoint
            common.save_checkpoint(checkpoint_dir, step, {
                "step": step, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": common.rng_state(), "history": metrics.history, "model_cfg": asdict(model_cfg),
                "global_batch": args.global_batch})
            metrics.write()

    # ---- training loop
    if is_rank0:
        (args.out_dir / common.STOP_MARKER).unlink(missing_ok=True)  # from an earlier, stopped run
    stop = common.StopRequest(RECIPE, env.rank)  # SIGUSR1 before the time limit, SIGTERM on preemption
    stopped_by = 0
    model.train()
    last_step = start_step
    for step in range(start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
        inputs, targets = data.local_batch(step, args.global_batch, env.rank, env.world_size)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        skip_sync = model.no_sync() if args.skip_grad_allreduce else contextlib.nullcontext()
        with skip_sync, torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(inputs, targets)
            loss.backward()  # DDP averages the gradients across ranks here, overlapped with backward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = common.mean_across_ranks(loss, env.world_size)  # also synchronises the step for timing
        metrics.log_step(step, global_loss, args.global_batch, time.perf_counter() - t0, args.lr)
        last_step = step
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
        stopped_by = stop.agreed(env.world_size, device)
        if step == args.stop_at_step or stopped_by:
            break
    if last_step > start_step and not (args.checkpoint_every and last_step % args.checkpoint_every == 0):
        save(last_step)

    # ---- prove from inside the run that the ranks really trained one model together
    spread = common.max_difference_across_ranks(list(raw_model.parameters()), env.world_size)
    metrics.write({"param_max_abs_diff_across_ranks": spread, "last_step": last_step,
                   "stopped_early": last_step < args.max_steps,
                   "stopped_by_signal": signal.Signals(stopped_by).name if stopped_by else None})
    if is_rank0:
        s = metrics.summary()
        print(f"[{RECIPE}] done: step {last_step}/{args.max_steps}, final loss {s['final_loss']:.4f}, "
              f"{s['mean_samples_per_s']:.1f} samples/s, {s['mean_tokens_per_s']:.0f} tokens/s, "
              f"MFU {100 * s['mean_mfu']:.2f}% (peak {peak / 1e12:.3f} TFLOP/s, {peak_source}); "
              f"metrics in {metrics.path}", flush=True)
    if env.world_size > 1:
        # Tear down together, and while the interpreter is fully alive: DDP's reducer holds the process
        # group, and a gloo group still alive at interpreter exit can abort the process (SIGABRT, exit != 0
        # after a successful run).
        dist.barrier()
        del model
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
