"""PyTorch + Horovod (horovod.torch): the GPT of recipes/ddp trained with Horovod's data parallelism instead of DDP.

For PyTorch users who already run Horovod; new PyTorch work should use recipes/ddp (torch.distributed is
maintained with PyTorch; Horovod's last release is from 2023). Launched like recipes/horovod/train.py:

    python recipes/horovod/train_torch.py --batch-per-rank 16 --lr 6e-3   # the 1-process reference of:
    horovodrun --gloo -np 2 -H localhost:2 python recipes/horovod/train_torch.py
    srun -N 2 --ntasks-per-node=4 python recipes/horovod/train_torch.py
    RECIPE=recipes/horovod/train_torch.py sbatch slurm/horovod.sh

Each rank trains on its --batch-per-rank rows of the step's global batch; hvd.DistributedOptimizer averages
the gradients, and the learning rate is --lr x world size. Rank 0 logs, writes OUT_DIR/metrics.json and a
checkpoint at the end (and every --checkpoint-every steps); a rerun with the same --out-dir resumes.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared modules
import common  # noqa: E402
import horovod_launch  # noqa: E402  (recipes/horovod/, next to this file)
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "horovod_torch"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-per-rank", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate for one rank; used x world size")
    p.add_argument("--seed", type=int, default=1234, help="seeds the weights and the synthetic data")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--out-dir", type=Path, default=Path("runs/horovod_torch"), help="checkpoints and metrics.json")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out-dir")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device for MFU")
    p.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE",
                   help="only check the options for this many ranks, then exit")
    p.add_argument("--skip-grad-allreduce", action="store_true",
                   help="TESTS ONLY, wrong on purpose: the plain optimizer, no averaging (the negative control)")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> None:
    for name in ("batch_per_rank", "max_steps", "seq_len", "vocab_size", "n_layer", "n_head", "n_embd"):
        if getattr(args, name) < 1:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.lr > 0:
        raise common.ConfigError(f"--lr must be positive, got {args.lr}")
    if args.n_embd % args.n_head:
        raise common.ConfigError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.skip_grad_allreduce and world_size == 1:
        raise common.ConfigError("--skip-grad-allreduce only means something with more than one rank")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.preflight is not None:
        validate(args, args.preflight)
        print(f"[{RECIPE}] preflight: options fit world size {args.preflight}", flush=True)
        return 0

    # ---- rank, device, controller
    launcher = horovod_launch.prepare_world()
    import horovod
    import horovod.torch as hvd

    hvd.init()
    rank, world_size = hvd.rank(), hvd.size()
    common.check_expected_world_size(world_size)
    validate(args, world_size)
    if torch.cuda.is_available():
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    controller = "gloo" if hvd.gloo_enabled() else "mpi" if hvd.mpi_enabled() else "none"
    is_rank0 = rank == 0
    if is_rank0:
        print(f"[{RECIPE}] world_size={world_size} controller={controller} device={device.type} launcher={launcher} "
              f"host={socket.gethostname()}", flush=True)

    # ---- model and optimizer; Horovod's wrapper averages the gradients during backward
    model_cfg = GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd)
    torch.manual_seed(args.seed)
    model = GPT(model_cfg).to(device)
    lr = args.lr * world_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    checkpoint_dir = args.out_dir / "checkpoints"
    latest = None if args.no_resume else common.latest_checkpoint(checkpoint_dir)
    start_step, history = 0, []
    if latest is not None:
        state = torch.load(latest, map_location="cpu", weights_only=True)
        if state["model_cfg"] != asdict(model_cfg) or state["global_batch"] != args.batch_per_rank * world_size:
            raise common.ConfigError(f"{latest} was written with other settings; use the same ones, a new "
                                     "--out-dir, or --no-resume")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step, history = state["step"], state["history"]
    wrapper = "none"
    if world_size > 1 and not args.skip_grad_allreduce:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
        wrapper = "DistributedOptimizer"  # (the wrapped optimizer keeps its class name, AdamW)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = common.SyntheticTokens(args.vocab_size, args.seq_len, args.seed)
    global_batch = args.batch_per_rank * world_size
    peak, peak_source = common.peak_flops(device, torch.float32, args.peak_tflops)
    flops_per_token = common.transformer_flops_per_token(model.num_params_for_flops(), args.n_layer, args.n_embd, args.seq_len)
    env = common.DistEnv(rank, hvd.local_rank(), world_size, "", 0, launcher)
    metrics = common.MetricsLogger(
        recipe=RECIPE, path=args.out_dir / "metrics.json", is_logging_rank=is_rank0, tokens_per_sample=args.seq_len,
        flops_per_token=flops_per_token, peak_flops_per_device=peak, peak_source=peak_source, world_size=world_size,
        history=history,
        run_info={**common.describe_run(env, f"horovod-{controller}", device,
                                        wrapper,
                                        {"torch_version": torch.__version__, "horovod_version": horovod.__version__}),
                  "layout": {"dp": world_size}, "lr_used": lr, "config": vars(args), "resumed_from_step": start_step or None},
    )

    def save(step: int) -> None:
        if is_rank0:
            common.save_checkpoint(checkpoint_dir, step, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "history": metrics.history, "model_cfg": asdict(model_cfg), "global_batch": global_batch})
            metrics.write()

    # ---- training loop
    last_step = start_step
    for step in range(start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
        inputs, targets = data.local_batch(step, global_batch, rank, world_size)
        optimizer.zero_grad()  # (Horovod's wrapper takes no set_to_none)
        loss = model(inputs.to(device), targets.to(device))
        loss.backward()  # DistributedOptimizer starts an all-reduce per gradient as it becomes ready
        optimizer.step()  # ...and waits for them here
        global_loss = float(hvd.allreduce(loss.detach(), op=hvd.Average)) if world_size > 1 else float(loss)
        metrics.log_step(step, global_loss, global_batch, time.perf_counter() - t0, lr)
        last_step = step
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
    if last_step > start_step and not (args.checkpoint_every and last_step % args.checkpoint_every == 0):
        save(last_step)

    # ---- prove from inside the run that the ranks really trained one model together
    spread = 0.0
    if world_size > 1:
        flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        spread = float((hvd.allreduce(flat, op=hvd.Max) - hvd.allreduce(flat, op=hvd.Min)).max())
    metrics.write({"param_max_abs_diff_across_ranks": spread, "last_step": last_step})
    if is_rank0:
        s = metrics.summary()
        print(f"[{RECIPE}] done: step {last_step}/{args.max_steps}, final loss {s['final_loss']:.4f}, "
              f"{s['mean_samples_per_s']:.1f} samples/s, MFU {100 * s['mean_mfu']:.2f}%; metrics in {metrics.path}",
              flush=True)
    if world_size > 1:
        hvd.join()
    if spread != 0.0:
        common.stderr_line(f"[{RECIPE}] error: parameters differ across ranks by up to {spread:.3g}: "
                           "gradients were not synchronised")
        return 3
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except common.ConfigError as error:
        common.exit_on_config_error(RECIPE, error)
