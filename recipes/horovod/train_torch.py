"""PyTorch + Horovod (horovod.torch): the GPT of recipes/ddp trained with Horovod's data parallelism instead of DDP.

For PyTorch users who already run Horovod; new PyTorch work should use recipes/ddp (torch.distributed is
maintained with PyTorch; Horovod's last release is from 2023). Launched like recipes/horovod/train.py:

    python recipes/horovod/train_torch.py --batch-per-rank 16 --lr 6e-3   # the 1-process reference of:
    horovodrun --gloo -np 2 -H localhost:2 python recipes/horovod/train_torch.py
    srun -N 2 --ntasks-per-node=4 python recipes/horovod/train_torch.py
    RECIPE=recipes/horovod/train_torch.py sbatch slurm/horovod.sh

    # your own module and data instead of the GPT (harness/model.py; a Hugging Face model needs transformers,
    # which the bare TensorFlow environment, .venv-tf, does not carry: recipes/ddp is the tested path for those)
    horovodrun --gloo -np 2 -H localhost:2 python recipes/horovod/train_torch.py --model path/to/mymodel.py:build

Each rank trains on its --batch-per-rank rows of the step's global batch; hvd.DistributedOptimizer averages
the gradients, and the learning rate is --lr x world size. Rank 0 logs, writes OUT_DIR/metrics.json,
TensorBoard events and the checkpoints (every --checkpoint-every steps and at the end); a rerun with the
same --out-dir resumes; SIGUSR1/SIGTERM checkpoint and stop, as in the other recipes.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness and the model
import harness  # noqa: E402
import horovod_launch  # noqa: E402  (recipes/horovod/, next to this file)
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "horovod_torch"
FAULTS = ("grad-sum", "no-grad-allreduce")  # tests only: harness/faults.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    horovod_launch.add_batch_options(p, lr=3e-3, optimizer="AdamW")
    harness.add_optimizer_option(p)
    harness.add_schedule_options(p)
    return harness.parse_recipe_args(p, RECIPE, argv, model_options=GPTConfig.add_arguments, collective_timeout=False)


def validate(args: argparse.Namespace, world_size: int, spec: harness.ModelSpec) -> None:
    harness.validate_run(args, world_size)
    harness.check_model_vocabulary(spec, args.vocab_size)
    harness.check_export_option(args, spec)
    harness.require_at_least_one(args, "batch_per_rank")
    harness.require_positive(args, "lr")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the stack's GPT, or --model MODULE:FACTORY (yours) or hf:DIR (where transformers is installed): harness/model.py
    spec = harness.model_spec(args, gpt=GPT, gpt_config=GPTConfig.from_args(args))
    must_match = lambda world_size: {**spec.identity, "global_batch": args.batch_per_rank * world_size,  # noqa: E731
                                     "optimizer_name": args.optimizer, **harness.schedule_identity(args)}
    horovod_launch.check_mpi_controller()
    if args.preflight is not None:
        validate(args, args.preflight, spec)
        resume_from, _ = harness.resume_file(args, must_match(args.preflight))
        return harness.preflight_line(RECIPE, args, f"options fit world size {args.preflight}", resume_from)

    # ---- rank, device, controller
    launcher = horovod_launch.prepare_world()
    import horovod
    import horovod.torch as hvd

    hvd.init()
    rank, world_size = hvd.rank(), hvd.size()
    harness.check_expected_world_size(world_size)
    validate(args, world_size, spec)
    if torch.cuda.is_available():
        device = torch.device("cuda", harness.gpu_for_local_rank(hvd.local_rank(), torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    controller = "gloo" if hvd.gloo_enabled() else "mpi" if hvd.mpi_enabled() else "none"
    is_rank0 = rank == 0
    if is_rank0:
        print(f"[{RECIPE}] world_size={world_size} controller={controller} device={device.type} launcher={launcher} "
              f"host={socket.gethostname()}", flush=True)

    # ---- model and optimizer; Horovod's wrapper averages the gradients during backward
    torch.manual_seed(args.seed)
    model = spec.build().to(device)
    lr = args.lr * world_size  # (and the schedule's rate x world size at every step)
    optimizer = harness.torch_optimizer(model.parameters(), args.optimizer, lr)
    resume_from, state = harness.resume_file(args, must_match(world_size))
    start_step, resumed = 0, None  # resumed: the checkpoint's metrics state
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step, resumed = state["step"], state
        if is_rank0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)
    wrapper = "none"
    fault = harness.faults.inject(RECIPE, FAULTS, parameters=model.parameters(), data_parallel=world_size)  # (tests only)
    # (Horovod's optimizer has no hook to switch its all-reduce off: the no-grad-allreduce control leaves it unwrapped)
    if world_size > 1 and fault != "no-grad-allreduce":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
        wrapper = "DistributedOptimizer"  # (the wrapped optimizer keeps its class name, AdamW)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = harness.training_data(args)  # --data: synthetic or a token file
    global_batch = args.batch_per_rank * world_size
    env = harness.DistEnv(rank, hvd.local_rank(), world_size, "", 0, launcher)
    versions = {"torch_version": torch.__version__, "horovod_version": horovod.__version__}
    run_info = {**harness.describe_run(env, f"horovod-{controller}", device, wrapper, versions, dp=world_size),
                "lr_used": lr, "model": spec.name}
    metrics = harness.start_metrics(RECIPE, args, run_info, resumed, logging_rank=is_rank0, devices=world_size,
                                    size=harness.model_size(model),
                                    peak=harness.peak_flops(device, torch.float32, args.peak_tflops))

    def save(step: int) -> None:
        if is_rank0:
            harness.save_checkpoint(args.out_dir / "checkpoints", step, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                **metrics.checkpoint_state(), **must_match(world_size)})
            metrics.write()

    def average(values: list) -> list[float]:  # the sync's one collective: the window's losses, the stop agreement
        vector = torch.stack([torch.as_tensor(value, dtype=torch.float32, device=device).reshape(()) for value in values])
        return (hvd.allreduce(vector, op=hvd.Average) if world_size > 1 else vector).tolist()

    # ---- evaluation (--eval-every): the validation loss, each rank its rows, averaged over the ranks
    validation = harness.validation_data(args)

    def evaluate() -> float:
        model.eval()
        loss = harness.validation_loss(model, validation, args, global_batch, rank, world_size, device)
        model.train()
        return float(hvd.allreduce(loss, op=hvd.Average)) if world_size > 1 else float(loss)

    # ---- training loop
    run = harness.TrainingRun(RECIPE, args, rank, start_step, metrics, average)
    batches = harness.step_batches(data, args, range(start_step + 1, args.max_steps + 1), global_batch, rank, world_size,
                                   device)  # (--data-workers: read ahead)
    for step, (inputs, targets) in run.steps(batches):  # (harness.phase: named ranges for --profile and Nsight)
        optimizer.zero_grad()  # (Horovod's wrapper takes no set_to_none)
        with harness.phase("forward"):
            loss = model(inputs, targets)
        averaged = wrapper == "DistributedOptimizer"
        with harness.phase("backward"):
            loss.backward()  # DistributedOptimizer starts an all-reduce per gradient as it becomes ready
            if averaged:
                optimizer.synchronize()  # ...waits for them (here, so that clipping sees the averaged gradients)
        with harness.phase("optimizer"):
            norm = harness.clip_gradients(model.parameters(), args.clip_grad)  # (--clip-grad; the norm for the logs)
            step_lr = run.learning_rate(step) * world_size  # --lr-schedule, --warmup-steps; x world size, as --lr
            harness.set_learning_rate(optimizer, step_lr)
            with optimizer.skip_synchronize() if averaged else contextlib.nullcontext():
                optimizer.step()
        # this rank's loss, as a tensor: averaged over the ranks at the next sync (every --log-every steps)
        metrics.log_step(step, loss.detach(), global_batch, step_lr, grad_norm=norm)
        if run.eval_due(step):
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):
            break
    run.save_last(save)

    # ---- prove from inside the run that the ranks really trained one model together
    spread = 0.0
    if world_size > 1:
        flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        spread = float((hvd.allreduce(flat, op=hvd.Max) - hvd.allreduce(flat, op=hvd.Min)).max())
    exit_code = run.finish(metrics, spread)
    if args.export_hf and is_rank0 and exit_code == 0 and run.last_step == args.max_steps:  # (a finished run)
        harness.export_trained_model(model, spec, args.export_hf, RECIPE)
    if world_size > 1:
        hvd.join()
    return exit_code


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
