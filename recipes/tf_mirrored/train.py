"""TensorFlow MirroredStrategy: one process drives every GPU of a node (the one-node path; Horovod for more).

One replica per device, each on its own slice of the step's --global-batch; the strategy all-reduces the
gradients (NCCL between GPUs) and keeps one mirrored copy of every weight per device. Without a GPU the CPU is
split into --devices logical devices, so the strategy really runs that many replicas.

    # one device (the reference every multi-device run is checked against)
    python recipes/tf_mirrored/train.py --devices 1

    # every GPU of this node (or 2 logical CPU devices where there is no GPU)
    python recipes/tf_mirrored/train.py

    # on Perlmutter (Shifter image, 1 node x 4 A100), or on any Slurm cluster
    sbatch slurm/tf_mirrored.sh

The loss of each replica is averaged over the global batch (tf.nn.compute_average_loss), so the loss curve
does not depend on the number of devices: N replicas must match 1 device to float precision
(tests/test_tensorflow.py). Checkpoints go to OUT_DIR/checkpoints/step_XXXXXXXX (published by a rename) and
a rerun with the same --out-dir resumes; SIGUSR1 or SIGTERM: stop after the step, checkpoint, exit 0.

    python recipes/tf_mirrored/train.py --preflight 1    # only check the options (one process per node)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

# Before TensorFlow loads: Keras 2 (tf-keras), which Horovod's TensorFlow integration needs, and no INFO
# lines from TensorFlow's C++ side (oneDNN, CPU features) in the training log.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared modules
import common  # noqa: E402

RECIPE = "tf_mirrored"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=None,
                   help="replicas: default every GPU, or 2 logical CPU devices without a GPU")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, summed over all replicas")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234, help="seeds the weights and the synthetic data")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-hidden", type=int, default=256)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto = mixed bfloat16 on GPU, float32 on CPU")
    p.add_argument("--out-dir", type=Path, default=Path("runs/tf_mirrored"), help="checkpoints and metrics.json")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out-dir")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and exit after this step, as if the allocation ended; rerun to continue")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: data sheet on GPU, measured matmul on CPU)")
    p.add_argument("--config", type=Path, default=None,
                   help="a TOML file of these options (keys as here, without '--'); the command line wins")
    p.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE",
                   help="only check the options for this many processes (must be 1), then exit")
    p.add_argument("--skip-grad-allreduce", action="store_true",
                   help="TESTS ONLY, wrong on purpose: every replica applies its own gradients (the negative control)")
    return common.parse_args_with_config(p, argv)


def validate(args: argparse.Namespace, processes: int) -> None:
    """Everything that can be checked before TensorFlow starts."""
    if processes != 1:
        raise common.ConfigError(
            f"MirroredStrategy runs as one process per node, but {processes} were started: use one task "
            "(slurm/tf_mirrored.sh: -N 1 --ntasks-per-node=1), or the Horovod recipe for more than one node")
    for name in ("global_batch", "max_steps", "seq_len", "vocab_size", "d_model", "d_hidden", "log_every"):
        if getattr(args, name) < 1:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.devices is not None and args.devices < 1:
        raise common.ConfigError(f"--devices must be at least 1, got {args.devices}")
    if not args.lr > 0:
        raise common.ConfigError(f"--lr must be positive, got {args.lr}")
    if args.checkpoint_every < 0:
        raise common.ConfigError(f"--checkpoint-every must be 0 or more, got {args.checkpoint_every}")
    if args.devices and args.global_batch % args.devices:
        raise common.ConfigError(f"--global-batch {args.global_batch} is not divisible by --devices {args.devices}")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        raise common.ConfigError(f"--stop-at-step must be between 1 and --max-steps {args.max_steps}")


def choose_devices(tf, wanted: int | None) -> tuple[list[str], str]:
    """The devices the strategy mirrors over, and what they are. Must run before TensorFlow initialises."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if wanted and wanted > len(gpus):
            raise common.ConfigError(f"--devices {wanted} but this node shows {len(gpus)} GPU(s): ask Slurm for "
                                     f"--gpus-per-node={wanted}, or use --devices {len(gpus)}")
        count = wanted or len(gpus)
        return [f"/gpu:{i}" for i in range(count)], "gpu"
    count = wanted or 2
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    return [f"/cpu:{i}" for i in range(count)], f"cpu split into {count} logical devices"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts the process
        validate(args, args.preflight)
        print(f"[{RECIPE}] preflight: options are fine for one process", flush=True)
        return 0
    env = common.detect_dist_env()
    common.check_expected_world_size(1)
    validate(args, env.world_size)

    import tensorflow as tf

    import keras_model

    # ---- devices and strategy
    devices, device_kind = choose_devices(tf, args.devices)
    if args.global_batch % len(devices):
        raise common.ConfigError(f"--global-batch {args.global_batch} is not divisible by the {len(devices)} devices; "
                                 f"use a multiple of {len(devices)}")
    # NCCL between GPUs; between CPU devices the gradients are summed on one device and copied back.
    cross_device_ops = tf.distribute.NcclAllReduce() if device_kind == "gpu" else tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops)
    replicas = strategy.num_replicas_in_sync
    # The strategy quietly runs one replica when it finds fewer devices than asked: refuse that.
    if replicas != len(devices):
        raise RuntimeError(f"MirroredStrategy runs {replicas} replica(s), expected {len(devices)}")
    all_reduce = type(cross_device_ops).__name__
    dtype = {"auto": "bfloat16" if device_kind == "gpu" else "float32", "float32": "float32", "bfloat16": "bfloat16"}[args.dtype]
    if dtype == "bfloat16":
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    gpu_name = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0]).get("device_name") \
        if device_kind == "gpu" else None
    print(f"[{RECIPE}] replicas={replicas} devices={','.join(devices)} ({device_kind}) all_reduce={all_reduce} "
          f"dtype={dtype} host={socket.gethostname()}", flush=True)

    # ---- model and optimizer: one mirrored copy per device, created in the strategy's scope
    cfg = keras_model.TokenModelConfig(args.vocab_size, args.seq_len, args.d_model, args.d_hidden)
    with strategy.scope():
        model = keras_model.build_model(cfg, args.seed)
        optimizer = tf.keras.optimizers.Adam(learning_rate=args.lr)
        optimizer.build(model.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    checkpoint_dir = args.out_dir / "checkpoints"
    must_match = {"model": asdict(cfg), "global_batch": args.global_batch}
    latest, meta = common.checkpoint_dir_to_resume(checkpoint_dir, args.no_resume, must_match)
    start_step, history = 0, []
    if latest is not None:
        checkpoint.read(str(latest / "ckpt")).assert_consumed()
        start_step, history = meta["step"], meta["history"]
        print(f"[{RECIPE}] resumed from {latest} (step {start_step})", flush=True)

    peak, peak_source = keras_model.peak_flops(gpu_name, dtype, args.peak_tflops)
    flops_per_token = keras_model.flops_per_token(model)
    metrics = common.MetricsLogger(
        recipe=RECIPE, path=args.out_dir / "metrics.json", is_logging_rank=True, tokens_per_sample=args.seq_len,
        flops_per_token=flops_per_token, peak_flops_per_device=peak, peak_source=peak_source,
        world_size=replicas, log_every=args.log_every, history=history,
        run_info={**common.describe_run(env, f"MirroredStrategy/{all_reduce}", device_kind, type(strategy).__name__,
                                        {"tensorflow_version": tf.__version__}),
                  "replicas": replicas, "devices": devices, "hostnames": [socket.gethostname()],
                  "layout": {"dp": replicas}, "dtype": dtype, "config": vars(args),
                  "resumed_from_step": start_step or None},
    )
    print(f"[{RECIPE}] {model.count_params() / 1e6:.2f}M parameters, {flops_per_token / 1e6:.2f} MFLOP/token, "
          f"peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})", flush=True)

    per_replica = args.global_batch // replicas

    def replica_step(inputs, targets):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            # Summed over this replica's rows, divided by the global batch: the replicas' sum is the mean.
            per_row = tf.reduce_mean(keras_model.loss_per_token(targets, logits), axis=1)
            loss = tf.nn.compute_average_loss(per_row, global_batch_size=args.global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        # apply_gradients sums the replicas' gradients (the all-reduce) before it updates the weights.
        optimizer.apply_gradients(zip(grads, model.trainable_variables),
                                  skip_gradients_aggregation=args.skip_grad_allreduce)
        return loss

    @tf.function
    def train_step(step_inputs, step_targets):
        losses = strategy.run(replica_step, args=(step_inputs, step_targets))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    def replica_rows(step: int):
        inputs, targets = common.numpy_token_batch(args.vocab_size, args.seq_len, args.seed, step, args.global_batch)
        rows = lambda ctx: slice(ctx.replica_id_in_sync_group * per_replica, (ctx.replica_id_in_sync_group + 1) * per_replica)  # noqa: E731
        return (strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(inputs[rows(ctx)])),
                strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(targets[rows(ctx)])))

    def weight_spread() -> float:
        """Largest difference between the copies of any weight on different devices (0.0: in sync)."""
        spread = 0.0
        for variable in model.variables:
            copies = [tf.cast(v, tf.float32) for v in getattr(variable, "values", (variable,))]
            spread = max(spread, *(float(tf.reduce_max(tf.abs(c - copies[0]))) for c in copies))
        return spread

    def save(step: int) -> None:
        common.save_checkpoint_dir(checkpoint_dir, step, lambda staging: checkpoint.write(str(staging / "ckpt")),
                                   {"history": metrics.history, **must_match})
        metrics.write()

    # ---- training loop
    (args.out_dir / common.STOP_MARKER).unlink(missing_ok=True)  # from an earlier, stopped run
    stop = common.StopRequest(RECIPE, 0)  # SIGUSR1 before the time limit, SIGTERM on preemption
    last_step = start_step
    for step in range(start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
        loss = float(train_step(*replica_rows(step)))  # float(): waits for the step, for the timing
        metrics.log_step(step, loss, args.global_batch, time.perf_counter() - t0, args.lr)
        last_step = step
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
        if step == args.stop_at_step or stop.received:
            break
    if last_step > start_step and not (args.checkpoint_every and last_step % args.checkpoint_every == 0):
        save(last_step)

    # ---- prove from inside the run that the replicas really trained one model together
    spread = weight_spread()
    metrics.write({"param_max_abs_diff_across_ranks": spread, "last_step": last_step,
                   "stopped_early": last_step < args.max_steps,
                   "stopped_by_signal": signal.Signals(stop.received).name if stop.received else None})
    s = metrics.summary()
    print(f"[{RECIPE}] done: step {last_step}/{args.max_steps}, final loss {s['final_loss']:.4f}, "
          f"{s['mean_samples_per_s']:.1f} samples/s, {s['mean_tokens_per_s']:.0f} tokens/s, "
          f"MFU {100 * s['mean_mfu']:.2f}% (peak {peak / 1e12:.3f} TFLOP/s, {peak_source}); "
          f"metrics in {metrics.path}", flush=True)
    if spread != 0.0:
        common.stderr_line(f"[{RECIPE}] error: the replicas' weights differ by up to {spread:.3g}: "
                           "gradients were not all-reduced")
        return 3
    if stop.received:
        common.StopRequest.write_marker(args.out_dir, stop.received, last_step)
        print(f"[{RECIPE}] stopped by {signal.Signals(stop.received).name} after step {last_step}: checkpoint "
              "written; run again with the same --out-dir to continue", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except common.ConfigError as error:
        common.exit_on_config_error(RECIPE, error)
