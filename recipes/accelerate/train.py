"""HuggingFace accelerate: the DDP recipe's GPT and data, trained through an ``Accelerator`` loop.

accelerate picks the device, the backend and the wrapper (DDP here) from how it was launched; the same
file runs on CPU (gloo) and on GPUs (NCCL, bf16 autocast). Gradient accumulation, checkpoints
(``save_state``/``load_state``) and mixed precision are accelerate's own.

    # one process (the reference every parallel run is checked against)
    python recipes/accelerate/train.py

    # two processes on this machine (CPU/gloo here; on a GPU node: 2 GPUs, NCCL)
    accelerate launch --multi_gpu --num_machines 1 --num_processes 2 recipes/accelerate/train.py

    # one `accelerate launch` per node, as slurm/accelerate.sh does (multi-node, c10d rendezvous)
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml --num_machines 2 --machine_rank $SLURM_NODEID \
        --num_processes 8 --main_process_ip <first node> --main_process_port 29500 recipes/accelerate/train.py

    # on Perlmutter (2 nodes x 4 A100), or on any Slurm cluster
    sbatch slurm/accelerate.sh

Accelerator(cpu=True) where there is no GPU: without it, `--multi_gpu` on a CPU machine starts N
independent single-process trainings that all exit 0. The run refuses to continue when the world it
joined is not the one the launcher asked for (HPCML_EXPECTED_WORLD_SIZE), and records world size,
backend and wrapper in OUT_DIR/metrics.json. Each step is --global-batch rows of the same synthetic batch
as the DDP recipe, split over ranks and then into --grad-accum micro-batches: the loss curve matches one
process on the full batch. Checkpoints are directories under OUT_DIR/checkpoints (a rerun resumes from
the newest); SIGUSR1/SIGTERM checkpoint and stop as in the DDP recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared modules
import common  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "accelerate"
TRAINER_STATE = "trainer_state.json"  # step, loss history and settings, next to accelerate's own files


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, summed over all ranks")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step on each rank")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234, help="seeds the weights and the synthetic data")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="accelerate's mixed precision; auto = bf16 on GPU, none (float32) on CPU")
    p.add_argument("--out-dir", type=Path, default=Path("runs/accelerate"), help="checkpoints and metrics.json")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out-dir")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and exit after this step, as if the allocation ended; rerun to continue")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="process-group timeout: a collective that waits longer fails the job")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: data sheet on GPU, measured matmul on CPU)")
    p.add_argument("--launch-config", type=Path, default=None,
                   help="the accelerate config file `accelerate launch --config_file` was given: checked against "
                        "the world size (slurm/accelerate.sh passes it)")
    p.add_argument("--config", type=Path, default=None,
                   help="a TOML file of these options (keys as here, without '--'); the command line wins")
    p.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE",
                   help="only check the options (and a checkpoint to resume) for this many ranks, then exit")
    p.add_argument("--skip-grad-allreduce", action="store_true",
                   help="TESTS ONLY, wrong on purpose: skip the gradient averaging (the parity check's negative control)")
    return common.parse_args_with_config(p, argv)


def validate(args: argparse.Namespace, world_size: int, nodes: int | None = None) -> None:
    """Everything that can be checked before ranks start talking to each other."""
    for name in ("global_batch", "grad_accum", "max_steps", "seq_len", "vocab_size", "n_layer", "n_head", "n_embd",
                 "log_every"):
        if getattr(args, name) < 1:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("lr", "timeout_s"):
        if not getattr(args, name) > 0:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.checkpoint_every < 0:
        raise common.ConfigError(f"--checkpoint-every must be 0 (only at the end) or more, got {args.checkpoint_every}")
    rows = world_size * args.grad_accum
    if args.global_batch % rows:
        raise common.ConfigError(
            f"--global-batch {args.global_batch} is not divisible by world size {world_size} x --grad-accum "
            f"{args.grad_accum} = {rows}; use a multiple of {rows} (e.g. --global-batch {-(-args.global_batch // rows) * rows})"
        )
    if args.n_embd % args.n_head:
        raise common.ConfigError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        raise common.ConfigError(f"--stop-at-step must be between 1 and --max-steps {args.max_steps}")
    if args.skip_grad_allreduce and (world_size == 1 or args.grad_accum != 1):
        raise common.ConfigError("--skip-grad-allreduce needs more than one rank and --grad-accum 1")
    if args.launch_config is not None:
        check_launch_config(args.launch_config, world_size, nodes)


def check_launch_config(path: Path, world_size: int, nodes: int | None) -> None:
    """An accelerate config that asks for another layout than the allocation would start the wrong world."""
    import yaml  # accelerate's own dependency

    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise common.ConfigError(f"cannot read --launch-config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise common.ConfigError(f"--launch-config {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise common.ConfigError(f"--launch-config {path} is not an accelerate config (a YAML mapping)")
    processes, machines = config.get("num_processes"), config.get("num_machines")
    if processes is not None and processes != world_size:
        raise common.ConfigError(
            f"{path} says num_processes: {processes} but the job has {world_size} ranks; delete num_processes "
            "from the file (slurm/accelerate.sh takes it from the allocation) or change the allocation"
        )
    if machines is not None and nodes is not None and machines != nodes:
        raise common.ConfigError(
            f"{path} says num_machines: {machines} but the job has {nodes} nodes; delete num_machines "
            "from the file (slurm/accelerate.sh takes it from the allocation) or change the allocation"
        )
    if config.get("distributed_type") == "FSDP" and not torch.cuda.is_available():
        raise common.ConfigError(f"{path} asks for FSDP, which accelerate runs only on GPUs (on CPU it silently "
                                 "trains plain DDP): use recipes/accelerate/multi_gpu.yaml here")


def load_trainer_state(args: argparse.Namespace, model_cfg: GPTConfig) -> tuple[Path | None, dict | None]:
    """The newest checkpoint directory in --out-dir, if it was written by the same model and batch."""
    resume_from = None if args.no_resume else common.latest_checkpoint_dir(args.out_dir / "checkpoints")
    if resume_from is None:
        return None, None
    try:
        state = json.loads((resume_from / TRAINER_STATE).read_text())
    except (OSError, ValueError) as error:
        raise common.ConfigError(f"cannot read {resume_from / TRAINER_STATE} ({type(error).__name__}): "
                                 "move the checkpoint away, or use --no-resume") from None
    if state["model_cfg"] != asdict(model_cfg) or state["global_batch"] != args.global_batch:
        raise common.ConfigError(
            f"{resume_from} was written with {state['model_cfg']} and --global-batch {state['global_batch']}; "
            "use the same settings, a new --out-dir, or --no-resume"
        )
    return resume_from, state


def nodes_in_job() -> int | None:
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    return int(nodes) if nodes and nodes.isdigit() else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_cfg = GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd)
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        validate(args, args.preflight, nodes_in_job())
        resume_from, _ = load_trainer_state(args, model_cfg)
        print(f"[{RECIPE}] preflight: options fit world size {args.preflight}"
              + (f"; will resume from {resume_from}" if resume_from else ""), flush=True)
        return 0
    env = common.detect_dist_env()  # accelerate launch speaks torchrun's protocol (RANK, WORLD_SIZE, ...)
    validate(args, env.world_size, nodes_in_job() if env.launcher != "single" else None)
    common.check_expected_world_size(env.world_size)
    checkpoint_dir = args.out_dir / "checkpoints"
    resume_from, trainer_state = load_trainer_state(args, model_cfg)

    # ---- rank, device, backend: accelerate's choice, made explicit where it would otherwise guess
    on_gpu = torch.cuda.is_available()
    mixed_precision = {"auto": "bf16" if on_gpu else "no", "float32": "no", "bfloat16": "bf16"}[args.dtype]
    accelerator = Accelerator(
        cpu=not on_gpu,  # without it a CPU machine runs independent world-size-1 trainings
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=args.grad_accum,
        # (only with more than one rank: a backend given to one plain process makes accelerate expect a group)
        kwargs_handlers=[InitProcessGroupKwargs(backend="nccl" if on_gpu else "gloo",
                                                timeout=datetime.timedelta(seconds=args.timeout_s))]
        if env.world_size > 1 else [],
    )
    world_size, is_rank0, device = accelerator.num_processes, accelerator.is_main_process, accelerator.device
    if world_size != env.world_size:
        raise common.ConfigError(f"accelerate formed a world of {world_size} process(es) but the launcher started "
                                 f"{env.world_size}: check the accelerate config and launch command")
    backend = dist.get_backend() if world_size > 1 else "none"
    hostnames = common.all_hostnames(world_size)
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    if is_rank0:
        print(f"[{RECIPE}] world_size={world_size} backend={backend} device={device.type} "
              f"distributed_type={accelerator.distributed_type.value} mixed_precision={mixed_precision} "
              f"grad_accum={args.grad_accum} launcher={env.launcher} hosts={','.join(hostnames)}", flush=True)

    # ---- model and optimizer: same seed on every rank, wrapped by accelerate (DDP when world > 1)
    torch.manual_seed(args.seed)
    raw_model = GPT(model_cfg)
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(raw_model, optimizer)
    sharded = accelerator.distributed_type == DistributedType.FSDP  # fsdp.yaml, GPU only
    if world_size > 1:
        # Frameworks fall back to no parallelism silently; refuse to "train in parallel" without the wrapper.
        if sharded:
            assert isinstance(model, FSDPModule), type(model)
        else:
            assert isinstance(model, DDP) and accelerator.distributed_type in (DistributedType.MULTI_CPU,
                                                                                DistributedType.MULTI_GPU)

    start_step, history = 0, []
    if trainer_state:
        accelerator.load_state(str(resume_from))  # weights, optimizer, RNG of every rank
        start_step, history = trainer_state["step"], trainer_state["history"]
        if is_rank0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    data = common.SyntheticTokens(args.vocab_size, args.seq_len, args.seed)
    peak, peak_source = common.peak_flops(device, dtype, args.peak_tflops)
    flops_per_token = common.transformer_flops_per_token(raw_model.num_params_for_flops(), args.n_layer, args.n_embd, args.seq_len)
    metrics = common.MetricsLogger(
        recipe=RECIPE, path=args.out_dir / "metrics.json", is_logging_rank=is_rank0, tokens_per_sample=args.seq_len,
        flops_per_token=flops_per_token, peak_flops_per_device=peak, peak_source=peak_source,
        world_size=world_size, log_every=args.log_every, history=history,
        run_info={**common.describe_run(env, backend, device, type(model).__name__), "hostnames": hostnames,
                  "layout": {"dp": world_size}, "distributed_type": accelerator.distributed_type.value,
                  "grad_accum": args.grad_accum, "dtype": str(dtype), "config": vars(args),
                  "resumed_from_step": start_step or None},
    )
    if is_rank0:
        print(f"[{RECIPE}] {sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M parameters, "
              f"{flops_per_token / 1e6:.2f} MFLOP/token, peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})",
              flush=True)

    def save(step: int) -> None:
        staging = common.staging_checkpoint_dir(checkpoint_dir, step)
        accelerator.save_state(str(staging))  # every rank writes its part into the staging directory
        if is_rank0:
            common.atomic_write_bytes(staging / TRAINER_STATE, json.dumps({
                "step": step, "history": metrics.history, "model_cfg": asdict(model_cfg),
                "global_batch": args.global_batch}).encode())
        accelerator.wait_for_everyone()
        if is_rank0:
            common.publish_checkpoint_dir(checkpoint_dir, step)
            metrics.write()

    # ---- training loop: one optimizer step = --grad-accum micro-batches on every rank
    if is_rank0:
        (args.out_dir / common.STOP_MARKER).unlink(missing_ok=True)  # from an earlier, stopped run
    stop = common.StopRequest(RECIPE, env.rank)
    stopped_by = 0
    model.train()
    last_step = start_step
    micro_rows = args.global_batch // (world_size * args.grad_accum)
    for step in range(start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
        inputs, targets = data.local_batch(step, args.global_batch, accelerator.process_index, world_size)
        step_loss = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            rows = slice(micro * micro_rows, (micro + 1) * micro_rows)
            skip_sync = accelerator.no_sync(model) if args.skip_grad_allreduce else contextlib.nullcontext()
            # accumulate(): no gradient all-reduce until the last micro-batch, and the optimizer steps only then
            with accelerator.accumulate(model), skip_sync:
                loss = model(inputs[rows].to(device), targets[rows].to(device))
                accelerator.backward(loss)  # divides by --grad-accum: the gradient of the mean loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() / args.grad_accum
        global_loss = common.mean_across_ranks(step_loss, world_size)  # also synchronises the step for timing
        metrics.log_step(step, global_loss, args.global_batch, time.perf_counter() - t0, args.lr)
        last_step = step
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
        stopped_by = stop.agreed(world_size, device)
        if step == args.stop_at_step or stopped_by:
            break
    if last_step > start_step and not (args.checkpoint_every and last_step % args.checkpoint_every == 0):
        save(last_step)

    # ---- prove from inside the run that the ranks really trained one model together
    # (FSDP: each rank holds a different shard by design; the loss parity on GPU is its check)
    spread = None if sharded else common.max_difference_across_ranks(
        list(accelerator.unwrap_model(model).parameters()), world_size)
    metrics.write({"param_max_abs_diff_across_ranks": spread, "last_step": last_step,
                   "stopped_early": last_step < args.max_steps,
                   "stopped_by_signal": signal.Signals(stopped_by).name if stopped_by else None})
    if is_rank0:
        s = metrics.summary()
        print(f"[{RECIPE}] done: step {last_step}/{args.max_steps}, final loss {s['final_loss']:.4f}, "
              f"{s['mean_samples_per_s']:.1f} samples/s, {s['mean_tokens_per_s']:.0f} tokens/s, "
              f"MFU {100 * s['mean_mfu']:.2f}% (peak {peak / 1e12:.3f} TFLOP/s, {peak_source}); "
              f"metrics in {metrics.path}", flush=True)
    if world_size > 1:
        # As in the DDP recipe: drop every holder of the process group before destroying it, while the
        # interpreter is fully alive (a gloo group alive at exit can abort the process after a good run).
        accelerator.wait_for_everyone()
        del model, optimizer
        accelerator.free_memory()
        gc.collect()
        dist.destroy_process_group()
    if spread:
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
