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
import socket
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness and the model
import harness  # noqa: E402
import keras_model  # noqa: E402  (sets TensorFlow's environment; loads TensorFlow only when used)

RECIPE = "tf_mirrored"
FAULTS = ("grad-sum", "no-grad-allreduce", "resume-fresh-optimizer")  # tests only: harness/faults.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("--devices", type=int, default=None,
                   help="replicas: default every GPU, or 2 logical CPU devices without a GPU")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, summed over all replicas")
    p.add_argument("--lr", type=float, default=2e-3)
    harness.add_optimizer_option(p)
    keras_model.add_model_options(p)
    harness.add_schedule_options(p)  # --lr-schedule, --warmup-steps, --clip-grad (of the all-reduced gradients)
    return harness.parse_recipe_args(p, RECIPE, argv, collective_timeout=False, profile=False)


def validate(args: argparse.Namespace, processes: int) -> None:
    """Everything that can be checked before TensorFlow starts."""
    if processes != 1:
        raise harness.ConfigError(
            f"MirroredStrategy runs as one process per node, but {processes} were started: use one task "
            "(slurm/tf_mirrored.sh: -N 1 --ntasks-per-node=1), or the Horovod recipe for more than one node")
    harness.validate_run(args, None, framework="tensorflow")  # (its replicas are known once TensorFlow runs)
    harness.require_at_least_one(args, "global_batch", "d_model", "d_hidden")
    harness.require_positive(args, "lr")
    if args.devices is not None:
        harness.require_at_least_one(args, "devices")
        if args.global_batch % args.devices:
            raise harness.ConfigError(f"--global-batch {args.global_batch} is not divisible by --devices {args.devices}")


def choose_devices(tf, wanted: int | None) -> tuple[list[str], str]:
    """The devices the strategy mirrors over, and what they are. Must run before TensorFlow initialises."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if wanted and wanted > len(gpus):
            raise harness.ConfigError(f"--devices {wanted} but this node shows {len(gpus)} GPU(s): ask Slurm for "
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
        return harness.preflight_line(RECIPE, args, "options are fine for one process", None)
    env = harness.detect_dist_env()
    harness.check_expected_world_size(1)
    validate(args, env.world_size)

    import tensorflow as tf

    # ---- devices and strategy
    devices, device_kind = choose_devices(tf, args.devices)
    if args.global_batch % len(devices):
        raise harness.ConfigError(f"--global-batch {args.global_batch} is not divisible by the {len(devices)} devices; "
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
    cfg = keras_model.TokenModelConfig.from_args(args)
    with strategy.scope():
        model = keras_model.build_model(cfg, args.seed)
        optimizer = keras_model.optimizer(args.optimizer, args.lr)
        optimizer.build(model.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    # A test's negative control (HPCML_TEST_FAULT): TensorFlow has no gradient or load hooks, so the fault enters
    # where it applies: the replica's loss, its all-reduce, the restore.
    fault = harness.faults.inject(RECIPE, FAULTS, data_parallel=replicas)
    must_match = {"model": asdict(cfg), "global_batch": args.global_batch, "optimizer_name": args.optimizer,
                  **harness.schedule_identity(args)}
    latest, meta = harness.resume_dir(args, must_match, state_file="meta.json")
    start_step, resumed = 0, None  # resumed: the checkpoint's metrics state
    if latest is not None:
        keras_model.restore(checkpoint, model, str(latest / "ckpt"), weights_only=fault == "resume-fresh-optimizer")
        start_step, resumed = meta["step"], meta
        print(f"[{RECIPE}] resumed from {latest} (step {start_step})", flush=True)

    run_info = {**harness.describe_run(env, f"MirroredStrategy/{all_reduce}", device_kind, type(strategy).__name__,
                                       {"tensorflow_version": tf.__version__}, dp=replicas),
                "replicas": replicas, "devices": devices, "hostnames": [socket.gethostname()], "dtype": dtype}
    metrics = harness.start_metrics(RECIPE, args, run_info, resumed, logging_rank=True, devices=replicas,
                                    size=(model.count_params(), keras_model.flops_per_token(model)),
                                    peak=keras_model.peak_flops(gpu_name, dtype, args.peak_tflops), framework="tensorflow")

    per_replica = args.global_batch // replicas

    def replica_step(inputs, targets):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            # Summed over this replica's rows, divided by the global batch: the replicas' sum is the mean.
            per_row = tf.reduce_mean(keras_model.loss_per_token(targets, logits), axis=1)
            loss = tf.nn.compute_average_loss(per_row, global_batch_size=args.global_batch)
            # grad-sum (a test's control): the replica's own mean, the classic mistake; the replicas' sum is N x.
            trained = tf.reduce_mean(per_row) if fault == "grad-sum" else loss
        grads = tape.gradient(trained, model.trainable_variables)
        # The all-reduce, here rather than inside apply_gradients, so that the norm (and --clip-grad) is the one
        # of the summed gradients, the same on every replica. (no-grad-allreduce: each replica its own.)
        if fault != "no-grad-allreduce":
            grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
        norm = tf.linalg.global_norm(grads)
        if args.clip_grad > 0:
            grads, _ = tf.clip_by_global_norm(grads, args.clip_grad, use_norm=norm)
        optimizer.apply_gradients(zip(grads, model.trainable_variables), skip_gradients_aggregation=True)
        return loss, norm

    @tf.function
    def train_step(step_inputs, step_targets):
        losses, norms = strategy.run(replica_step, args=(step_inputs, step_targets))
        return (strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None),
                strategy.reduce(tf.distribute.ReduceOp.MEAN, norms, axis=None))

    @tf.function
    def eval_step(step_inputs, step_targets):
        def replica_loss(inputs, targets):  # (as replica_step's loss: the replicas' sum is the mean)
            per_row = tf.reduce_mean(keras_model.loss_per_token(targets, model(inputs, training=False)), axis=1)
            return tf.nn.compute_average_loss(per_row, global_batch_size=args.global_batch)

        losses = strategy.run(replica_loss, args=(step_inputs, step_targets))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    validation_batches = harness.numpy_batches(args, split="validation")

    def replica_rows(inputs, targets):
        """Each replica its rows of a global batch (copied to its device by tf.identity in its scope)."""
        rows = lambda ctx: slice(ctx.replica_id_in_sync_group * per_replica, (ctx.replica_id_in_sync_group + 1) * per_replica)  # noqa: E731
        return (strategy.experimental_distribute_values_from_function(lambda ctx: tf.identity(inputs[rows(ctx)])),
                strategy.experimental_distribute_values_from_function(lambda ctx: tf.identity(targets[rows(ctx)])))

    def evaluate() -> float:
        """The validation loss (--eval-every), each replica its rows of each batch, summed as the training loss is."""
        return sum(float(eval_step(*replica_rows(*validation_batches(batch, args.global_batch))))
                   for batch in range(args.eval_batches)) / args.eval_batches

    def weight_spread() -> float:
        """Largest difference between the copies of any weight on different devices (0.0: in sync)."""
        spread = 0.0
        for variable in model.variables:
            copies = [tf.cast(v, tf.float32) for v in getattr(variable, "values", (variable,))]
            spread = max(spread, *(float(tf.reduce_max(tf.abs(c - copies[0]))) for c in copies))
        return spread

    def save(step: int) -> None:
        harness.save_checkpoint_dir(args.out_dir / "checkpoints", step,
                                    lambda staging: checkpoint.write(str(staging / "ckpt")),
                                    {**metrics.checkpoint_state(), **must_match})
        metrics.write()

    # ---- training loop (one process: a signal needs no agreement between ranks)
    run = harness.TrainingRun(RECIPE, args, 0, start_step, metrics)
    # --data: synthetic or a token file, read one step ahead (tf.data)
    batches = harness.tf_step_batches(args, range(start_step + 1, args.max_steps + 1), args.global_batch)
    for step, (inputs, targets) in run.steps(batches):  # (the wait for each batch timed apart)
        lr = run.learning_rate(step)  # --lr-schedule, --warmup-steps
        optimizer.learning_rate = lr
        loss, norm = train_step(*replica_rows(inputs, targets))
        metrics.log_step(step, float(loss), args.global_batch, lr, grad_norm=float(norm))  # (the replicas' loss)
        if run.eval_due(step):
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):
            break
    run.save_last(save)

    # ---- prove from inside the run that the replicas really trained one model together
    return run.finish(metrics, weight_spread(), differ="the replicas' weights differ")


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
