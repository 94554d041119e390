"""TensorFlow + Horovod data parallelism: a small Keras model on synthetic tokens, one CPU to many GPU nodes.

One rank per device: each rank trains on its own --batch-per-rank rows of the step's global batch, and
hvd.DistributedGradientTape averages the gradients (NCCL on GPUs, gloo or MPI on CPUs). The learning rate is
--lr x world size (Horovod's linear-scaling convention: the global batch grows with the ranks).

    # one process (the reference: --batch-per-rank 16 --lr 2e-3 here equals 2 ranks x 8 rows at 1e-3)
    python recipes/horovod/train.py

    # two ranks on this machine, with horovodrun's gloo launcher (or MPI: mpiexec -n 2 python ...)
    horovodrun --gloo -np 2 -H localhost:2 python recipes/horovod/train.py

    # under Slurm, one task per rank, started by srun (rank 0 serves Horovod's rendezvous: horovod_launch.py)
    srun -N 2 --ntasks-per-node=4 python recipes/horovod/train.py
    HOROVOD_CONTROLLER=mpi srun --mpi=pmi2 -N 2 --ntasks-per-node=4 python recipes/horovod/train.py   # MPI

    # on Perlmutter (Shifter image, 2 nodes x 4 A100), or on any Slurm cluster
    sbatch slurm/horovod.sh

Rank 0 logs loss, samples/s, tokens/s and MFU, writes OUT_DIR/metrics.json and the checkpoints (TensorFlow
checkpoints in OUT_DIR/checkpoints/step_XXXXXXXX, published by a rename, so a crash never leaves a torn
one); a rerun with the same --out-dir resumes. SIGUSR1 (Slurm's time-limit warning) or SIGTERM: all ranks
stop after the same step, checkpoint and exit 0, leaving OUT_DIR/stopped_by_signal for the launcher.

    python recipes/horovod/train.py --config run.toml --max-steps 100   # options from TOML; the command line wins
    python recipes/horovod/train.py --preflight 8                       # only check the options for 8 ranks
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

# Before TensorFlow loads: Keras 2 (tf-keras), which Horovod's TensorFlow integration needs, and no INFO
# lines from TensorFlow's C++ side (oneDNN, CPU features) in the training log.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared modules
import common  # noqa: E402
import horovod_launch  # noqa: E402  (recipes/horovod/, next to this file)

RECIPE = "horovod"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-per-rank", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate for one rank; used x world size")
    p.add_argument("--seed", type=int, default=1234, help="seeds the weights and the synthetic data")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-hidden", type=int, default=256)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto = mixed bfloat16 on GPU, float32 on CPU")
    p.add_argument("--out-dir", type=Path, default=Path("runs/horovod"), help="checkpoints and metrics.json")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out-dir")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and exit after this step, as if the allocation ended; rerun to continue")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--check-sync-every", type=int, default=0,
                   help="compare the weights of all ranks every N steps (0: only at the end); costs two all-reduces")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: data sheet on GPU, measured matmul on CPU)")
    p.add_argument("--config", type=Path, default=None,
                   help="a TOML file of these options (keys as here, without '--'); the command line wins")
    p.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE",
                   help="only check the options (and a checkpoint to resume) for this many ranks, then exit")
    p.add_argument("--skip-grad-allreduce", action="store_true",
                   help="TESTS ONLY, wrong on purpose: a plain GradientTape, no averaging (the negative control)")
    return common.parse_args_with_config(p, argv)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Everything that can be checked before ranks start talking to each other."""
    for name in ("batch_per_rank", "max_steps", "seq_len", "vocab_size", "d_model", "d_hidden", "log_every"):
        if getattr(args, name) < 1:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.lr > 0:
        raise common.ConfigError(f"--lr must be positive, got {args.lr}")
    for name in ("checkpoint_every", "check_sync_every"):
        if getattr(args, name) < 0:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        raise common.ConfigError(f"--stop-at-step must be between 1 and --max-steps {args.max_steps}")
    if args.skip_grad_allreduce and world_size == 1:
        raise common.ConfigError("--skip-grad-allreduce only means something with more than one rank")


def must_match_to_resume(args: argparse.Namespace, world_size: int) -> dict:
    """What a checkpoint must have been written with for this run to continue it."""
    model = {"vocab_size": args.vocab_size, "seq_len": args.seq_len, "d_model": args.d_model, "d_hidden": args.d_hidden}
    return {"model": model, "global_batch": args.batch_per_rank * world_size}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        validate(args, args.preflight)
        latest, _ = common.checkpoint_dir_to_resume(args.out_dir / "checkpoints", args.no_resume,
                                                    must_match_to_resume(args, args.preflight))
        print(f"[{RECIPE}] preflight: options fit world size {args.preflight}"
              + (f"; will resume from {latest}" if latest else ""), flush=True)
        return 0

    # ---- rank, device, controller: Horovod's world must exist before TensorFlow picks its devices
    launcher = horovod_launch.prepare_world()
    import horovod
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import keras_model

    hvd.init()
    rank, world_size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    # Horovod started outside any launcher's world is a world of one that trains alone and exits 0: refuse
    # a world that is not the one the job launched (slurm/lib/launch.sh sets the expected size).
    common.check_expected_world_size(world_size)
    validate(args, world_size)
    controller = "gloo" if hvd.gloo_enabled() else "mpi" if hvd.mpi_enabled() else "none"
    gpus, gpu_name = tf.config.list_physical_devices("GPU"), None
    if gpus:  # one GPU per rank, memory taken as needed rather than all of it up front
        gpu = gpus[local_rank % len(gpus)]
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
        gpu_name = tf.config.experimental.get_device_details(gpu).get("device_name")
    ops = "NCCL" if gpus and hvd.nccl_built() else controller
    dtype = {"auto": "bfloat16" if gpus else "float32", "float32": "float32", "bfloat16": "bfloat16"}[args.dtype]
    if dtype == "bfloat16":
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    is_rank0 = rank == 0
    hostnames = [str(h) for h in hvd.allgather_object(socket.gethostname())] if world_size > 1 else [socket.gethostname()]
    if is_rank0:
        print(f"[{RECIPE}] world_size={world_size} controller={controller} collectives={ops} "
              f"device={'gpu' if gpus else 'cpu'} dtype={dtype} launcher={launcher} hosts={','.join(hostnames)}",
              flush=True)

    # ---- model and optimizer, both built now, so that rank 0's values can be broadcast before step 1
    must_match = must_match_to_resume(args, world_size)
    model = keras_model.build_model(keras_model.TokenModelConfig(**must_match["model"]), args.seed)
    lr = args.lr * world_size
    optimizer = tf.keras.optimizers.Adam(learning_rate=lr)
    optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    checkpoint_dir = args.out_dir / "checkpoints"
    latest, meta = common.checkpoint_dir_to_resume(checkpoint_dir, args.no_resume, must_match)
    start_step, history = 0, []
    if latest is not None:
        checkpoint.read(str(latest / "ckpt")).assert_consumed()
        start_step, history = meta["step"], meta["history"]
        if is_rank0:
            print(f"[{RECIPE}] resumed from {latest} (step {start_step})", flush=True)
    # Every rank starts from rank 0's weights and optimizer state (the same seed already agrees; this
    # makes it so whatever each rank read or drew).
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables(), root_rank=0)

    peak, peak_source = keras_model.peak_flops(gpu_name, dtype, args.peak_tflops)
    flops_per_token = keras_model.flops_per_token(model)
    env = common.DistEnv(rank, local_rank, world_size, "", 0, launcher)
    metrics = common.MetricsLogger(
        recipe=RECIPE, path=args.out_dir / "metrics.json", is_logging_rank=is_rank0, tokens_per_sample=args.seq_len,
        flops_per_token=flops_per_token, peak_flops_per_device=peak, peak_source=peak_source,
        world_size=world_size, log_every=args.log_every, history=history,
        run_info={**common.describe_run(env, f"horovod-{controller}", gpu_name or "cpu",
                                        "DistributedGradientTape" if world_size > 1 and not args.skip_grad_allreduce
                                        else "GradientTape",
                                        {"tensorflow_version": tf.__version__, "horovod_version": horovod.__version__}),
                  "hostnames": hostnames, "layout": {"dp": world_size}, "collectives": ops, "lr_used": lr,
                  "horovod_built": {"gloo": hvd.gloo_built(), "mpi": hvd.mpi_built(), "nccl": hvd.nccl_built()},
                  "dtype": dtype, "config": vars(args), "resumed_from_step": start_step or None},
    )
    if is_rank0:
        print(f"[{RECIPE}] {model.count_params() / 1e6:.2f}M parameters, {flops_per_token / 1e6:.2f} MFLOP/token, "
              f"lr {args.lr} x {world_size} ranks = {lr}, peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})",
              flush=True)

    @tf.function
    def train_step(inputs, targets):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = tf.reduce_mean(keras_model.loss_per_token(targets, logits))
        if world_size > 1 and not args.skip_grad_allreduce:
            tape = hvd.DistributedGradientTape(tape)  # gradients averaged over all ranks
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return hvd.allreduce(loss, op=hvd.Average) if world_size > 1 else loss

    def weight_spread() -> float:
        """Largest difference of any weight between two ranks (0.0: all ranks hold the same model)."""
        if world_size == 1:
            return 0.0
        flat = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in model.variables], axis=0)
        return float(tf.reduce_max(hvd.allreduce(flat, op=hvd.Max) - hvd.allreduce(flat, op=hvd.Min)))

    def save(step: int) -> None:
        if is_rank0:  # every rank holds the same model: rank 0's copy is the checkpoint
            common.save_checkpoint_dir(checkpoint_dir, step, lambda staging: checkpoint.write(str(staging / "ckpt")),
                                       {"history": metrics.history, **must_match})
            metrics.write()

    # ---- training loop
    if is_rank0:
        (args.out_dir / common.STOP_MARKER).unlink(missing_ok=True)  # from an earlier, stopped run
    stop = common.StopRequest(RECIPE, rank)  # SIGUSR1 before the time limit, SIGTERM on preemption
    stopped_by, last_step, sync_checks = 0, start_step, []
    global_batch = args.batch_per_rank * world_size
    for step in range(start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
        inputs, targets = common.numpy_token_batch(args.vocab_size, args.seq_len, args.seed, step, global_batch)
        rows = slice(rank * args.batch_per_rank, (rank + 1) * args.batch_per_rank)
        loss = float(train_step(inputs[rows], targets[rows]))  # float(): waits for the step, for the timing
        metrics.log_step(step, loss, global_batch, time.perf_counter() - t0, lr)
        if args.check_sync_every and step % args.check_sync_every == 0:
            sync_checks.append({"step": step, "param_max_abs_diff_across_ranks": weight_spread()})
        last_step = step
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
        stopped_by = int(hvd.allreduce(tf.constant(stop.received), op=hvd.Max)) if world_size > 1 else stop.received
        if step == args.stop_at_step or stopped_by:
            break
    if last_step > start_step and not (args.checkpoint_every and last_step % args.checkpoint_every == 0):
        save(last_step)

    # ---- prove from inside the run that the ranks really trained one model together
    spread = weight_spread()
    metrics.write({"param_max_abs_diff_across_ranks": spread, "sync_checks": sync_checks, "last_step": last_step,
                   "stopped_early": last_step < args.max_steps,
                   "stopped_by_signal": signal.Signals(stopped_by).name if stopped_by else None})
    if is_rank0:
        s = metrics.summary()
        print(f"[{RECIPE}] done: step {last_step}/{args.max_steps}, final loss {s['final_loss']:.4f}, "
              f"{s['mean_samples_per_s']:.1f} samples/s, {s['mean_tokens_per_s']:.0f} tokens/s, "
              f"MFU {100 * s['mean_mfu']:.2f}% (peak {peak / 1e12:.3f} TFLOP/s, {peak_source}); "
              f"metrics in {metrics.path}", flush=True)
    if world_size > 1:
        hvd.join()  # leave together: no rank exits while another still waits in a collective
    if spread != 0.0:
        common.stderr_line(f"[{RECIPE}] error: weights differ across ranks by up to {spread:.3g}: "
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
    except Exception as error:  # a Horovod collective that failed: another rank died or hung
        if type(error).__module__.startswith(("tensorflow", "horovod")):
            import horovod.tensorflow as hvd

            common.exit_on_collective_failure(RECIPE, error, rank=hvd.rank() if hvd.is_initialized() else "?")
        raise
