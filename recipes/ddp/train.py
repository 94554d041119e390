"""PyTorch DistributedDataParallel: a small GPT on synthetic tokens (or your model), from one CPU to many GPU nodes.

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
on the number of ranks: 2 ranks must match 1 process to float precision (tests/parity.toml).
Checkpoints go to OUT_DIR/checkpoints every --checkpoint-every steps and at the end; a rerun with the same
--out-dir resumes from the newest one. Rank 0 writes OUT_DIR/metrics.json and TensorBoard
events (OUT_DIR/tensorboard). SIGUSR1 (Slurm's time-limit warning) or SIGTERM (preemption): every rank
stops after the same step, checkpoints and exits 0, leaving OUT_DIR/stopped_by_signal for the launcher,
which requeues the job. Options can come from a TOML file:

    python recipes/ddp/train.py --config run.toml --max-steps 100   # the command line wins
    python recipes/ddp/train.py --preflight 8                       # only check the options for 8 ranks
    python recipes/ddp/train.py --estimate-memory a100-40 --world 8  # will it fit: the per-GPU memory of 8 ranks

On real text (recipes/data/prepare.py writes the token file), evaluated on its validation split:

    make data && torchrun --standalone --nproc_per_node=2 recipes/ddp/train.py --data data/stdlib/tokens --eval-every 10

Instruction tuning: chat or prompt/completion JSONL rendered with the model's own chat template, only the
answers trained, whole conversations packed into each window (docs/instruction-tuning.md):

    python recipes/data/prepare.py --chat $SCRATCH/models/my-llama --seq-len 2048 --out data/sft/tokens chats.jsonl
    torchrun --standalone --nproc_per_node=2 recipes/ddp/train.py --model hf:$SCRATCH/models/my-llama \
        --vocab-size 32000 --data data/sft/tokens --seq-len 2048 --pack

Your model instead of the GPT (harness/model.py: the contract): a Hugging Face causal LM saved in a directory
(fine-tuning, offline), or your own module:

    torchrun --standalone --nproc_per_node=2 recipes/ddp/train.py --model hf:$SCRATCH/models/my-llama --vocab-size 32000
    torchrun --standalone --nproc_per_node=2 recipes/ddp/train.py --model path/to/mymodel.py:build
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness and the model
import harness  # noqa: E402
import estimate  # noqa: E402  (next to this file: --estimate-memory)
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "ddp"
# The negative controls the tests can switch on (HPCML_TEST_FAULT, harness/faults.py)
FAULTS = ("grad-sum", "accum-sum", "no-grad-allreduce", "rank-mean-loss", "mask-ignored", "pack-unconfined",
          "resume-fresh-optimizer", "resume-data-from-start", "schedule-restart", "track-every-step",
          "step-time-from-start", "program-error", "program-error-as-node", "slow-rank", "slow-node")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, summed over all ranks")
    p.add_argument("--grad-accum", type=int, default=1, metavar="M",
                   help="micro-batches per step on each rank (the global batch in M parts: less activation memory)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="autocast dtype; auto = bfloat16 on GPU, float32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU speed; slow to start)")
    harness.add_optimizer_option(p)
    harness.memory.add_options(p)
    harness.add_schedule_options(p)
    return harness.parse_recipe_args(p, RECIPE, argv, model_options=GPTConfig.add_arguments, lora=True, loss_masks=True,
                                    packing=True)


def validate(args: argparse.Namespace, world_size: int, model: harness.ModelSpec) -> None:
    """Everything that can be checked before ranks start talking to each other."""
    harness.validate_run(args, world_size)
    harness.check_model_vocabulary(model, args.vocab_size)
    harness.check_export_option(args, model)
    harness.require_at_least_one(args, "global_batch", "grad_accum")
    harness.require_positive(args, "lr")
    harness.require_divisible("--global-batch", args.global_batch, world_size * args.grad_accum,
                              f"the world size {world_size}" if args.grad_accum == 1 else
                              f"the world size {world_size} x --grad-accum {args.grad_accum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the stack's GPT, or --model hf:DIR (a Hugging Face model) or MODULE:FACTORY (yours): harness/model.py
    spec = harness.model_spec(args, gpt=GPT, gpt_config=GPTConfig.from_args(args))
    if args.estimate_memory:  # will it fit: the memory of DDP on --world ranks, without their GPUs
        return estimate.estimate_memory(args, spec, validate=validate)
    must_match = {**spec.identity, "global_batch": args.global_batch,  # to resume a checkpoint
                  "optimizer_name": args.optimizer, **harness.schedule_identity(args)}
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        validate(args, args.preflight, spec)
        resume_from, _ = harness.resume_file(args, must_match)
        return harness.preflight_line(RECIPE, args, f"options fit world size {args.preflight}", resume_from)
    env = harness.detect_dist_env()
    validate(args, env.world_size, spec)
    harness.check_expected_world_size(env.world_size)
    resume_from, checkpoint = harness.resume_file(args, must_match)

    # ---- rank, device, backend
    device, backend = harness.setup_torch_distributed(env, args.timeout_s)
    is_rank0 = env.rank == 0
    hostnames = harness.all_hostnames(env.world_size)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if is_rank0:
        print(f"[{RECIPE}] world_size={env.world_size} backend={backend} device={device.type} dtype={dtype} "
              f"launcher={env.launcher} master={env.master_addr}:{env.master_port} hosts={','.join(hostnames)}",
              flush=True)

    # ---- model: same seed on every rank; DDP also broadcasts rank 0's weights at construction
    torch.manual_seed(args.seed)
    model = raw_model = spec.build().to(device)  # raw_model: for checkpoints and the parameter check
    if args.compile:
        model = torch.compile(model)
    if env.world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        # Frameworks fall back to no parallelism silently; refuse to "train in parallel" without the wrapper.
        assert isinstance(model, DDP) and dist.get_world_size() == env.world_size
    model.train()
    optimizer = harness.torch_optimizer(raw_model.parameters(), args.optimizer, args.lr)
    masked = harness.masked_data(args)  # instruction data: every trained token of the global batch weighs the same
    harness.faults.inject(RECIPE, FAULTS, parameters=raw_model.parameters(), data_parallel=env.world_size,
                          micro_batches=args.grad_accum, ddp_model=model if env.world_size > 1 else None,
                          optimizers=[optimizer], applies={"rank-mean-loss": env.world_size * args.grad_accum > 1 and masked,
                                                           "mask-ignored": masked, "pack-unconfined": args.pack})  # (tests)

    start_step, resumed = 0, None  # resumed: the checkpoint's metrics state
    if checkpoint:
        raw_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        harness.restore_rng_state(checkpoint["rng"])
        start_step, resumed = checkpoint["step"], checkpoint
        if is_rank0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    data = harness.training_data(args)  # --data: synthetic or a token file (instruction data: conversations)
    run_info = {**harness.describe_run(env, backend, device, type(model).__name__, dp=env.world_size),
                "hostnames": hostnames, "dtype": str(dtype), "model": spec.name, "grad_accum": args.grad_accum,
                **({"conversations": data.packing_summary()} if masked else {})}  # (how full --pack's windows are)
    metrics = harness.start_metrics(RECIPE, args, run_info, resumed, logging_rank=is_rank0, devices=env.world_size,
                                    size=harness.model_size(raw_model),
                                    peak=harness.peak_flops(device, dtype, args.peak_tflops))

    def save(step: int) -> None:
        if is_rank0:  # DDP keeps every rank's weights identical: one copy is the checkpoint
            harness.save_checkpoint(args.out_dir / "checkpoints", step, {
                "step": step, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": harness.rng_state(), **metrics.checkpoint_state(), **must_match})
            metrics.write()

    # ---- evaluation: the loss on the validation data (--eval-every), each rank its rows, averaged over ranks
    validation = harness.validation_data(args)

    def evaluate() -> float:
        model.eval()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = harness.validation_loss(raw_model, validation, args, args.global_batch, env.rank, env.world_size,
                                           device, masked)
        model.train()
        return harness.mean_across_ranks(loss, env.world_size)

    # ---- training loop
    run = harness.TrainingRun(RECIPE, args, env.rank, start_step, metrics, harness.average_across_ranks(env.world_size, device))
    batches = harness.step_batches(data, args, range(start_step + 1, args.max_steps + 1), args.global_batch,
                                   env.rank, env.world_size, device)  # (--data-workers: read ahead)
    for step, batch in run.steps(batches):  # (harness.phase: named ranges for --profile and Nsight)
        # this rank's rows in --grad-accum micro-batches: (inputs, targets), and --pack's positions, which keep
        # attention within each conversation
        micro_batches = list(zip(*(part.chunk(args.grad_accum) for part in batch)))
        # what each micro-batch's mean loss weighs: 1/M, or (instruction data) its share of the global batch's
        # trained tokens, so that every trained token weighs the same on any layout
        weights = harness.loss_weights([targets for _, targets, *_ in micro_batches], masked)
        loss = 0.0
        for micro, ((inputs, targets, *positions), weight) in enumerate(zip(micro_batches, weights)):
            # DDP all-reduces the gradients in the last micro-batch's backward only: no_sync() before it
            last = micro == args.grad_accum - 1
            with contextlib.nullcontext() if last or env.world_size == 1 else model.no_sync():
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    with harness.phase("forward"):
                        micro_loss = model(inputs, targets, *positions) * weight  # (the mean over its trained targets)
                with harness.phase("backward"):
                    micro_loss.backward()  # the last one: DDP averages the gradients across ranks, overlapped
            loss = loss + micro_loss.detach()
        with harness.phase("optimizer"):
            norm = harness.clip_gradients(raw_model.parameters(), args.clip_grad)  # (--clip-grad; the norm for the logs)
            lr = run.learning_rate(step)  # --lr-schedule, --warmup-steps
            harness.set_learning_rate(optimizer, lr)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # this rank's loss, as a tensor: averaged over the ranks at the next sync (every --log-every steps)
        metrics.log_step(step, loss, args.global_batch, lr, grad_norm=norm)
        if run.eval_due(step):
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):  # checkpoints when due; True: --stop-at-step, SIGUSR1 or SIGTERM
            break
    run.save_last(save)

    # ---- prove from inside the run that the ranks really trained one model together
    spread = harness.max_difference_across_ranks(list(raw_model.parameters()), env.world_size)
    exit_code = run.finish(metrics, spread)
    if args.export_hf and is_rank0 and exit_code == 0 and run.last_step == args.max_steps:  # (a finished run)
        harness.export_trained_model(raw_model, spec, args.export_hf, RECIPE)
    if env.world_size > 1:
        del model  # DDP's reducer holds the process group: drop it before leaving the group
        harness.leave_process_group()
    return exit_code


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
