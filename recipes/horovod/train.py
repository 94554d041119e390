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
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness and the model
import harness  # noqa: E402
import horovod_launch  # noqa: E402  (recipes/horovod/, next to this file)
import keras_model  # noqa: E402  (sets TensorFlow's environment; loads TensorFlow only when used)

RECIPE = "horovod"
FAULTS = ("grad-sum", "no-grad-allreduce", "resume-fresh-optimizer")  # tests only: harness/faults.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    horovod_launch.add_batch_options(p, lr=1e-3, optimizer="Adam")
    p.add_argument("--check-sync-every", type=int, default=0,
                   help="compare the weights of all ranks every N steps (0: only at the end); costs two all-reduces")
    harness.add_optimizer_option(p)
    keras_model.add_model_options(p)
    harness.add_schedule_options(p)  # --lr-schedule, --warmup-steps, --clip-grad (of the averaged gradients)
    return harness.parse_recipe_args(p, RECIPE, argv, collective_timeout=False, profile=False)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Everything that can be checked before ranks start talking to each other."""
    harness.validate_run(args, world_size, framework="tensorflow")
    harness.require_at_least_one(args, "batch_per_rank", "d_model", "d_hidden")
    harness.require_positive(args, "lr")
    if args.check_sync_every < 0:
        raise harness.ConfigError(f"--check-sync-every must be 0 or more, got {args.check_sync_every}")


def must_match_to_resume(args: argparse.Namespace, world_size: int) -> dict:
    """What a checkpoint must have been written with for this run to continue it."""
    model = {"vocab_size": args.vocab_size, "seq_len": args.seq_len, "d_model": args.d_model, "d_hidden": args.d_hidden}
    return {"model": model, "global_batch": args.batch_per_rank * world_size, "optimizer_name": args.optimizer,
            **harness.schedule_identity(args)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    horovod_launch.check_mpi_controller()
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        validate(args, args.preflight)
        latest, _ = harness.resume_dir(args, must_match_to_resume(args, args.preflight), state_file="meta.json")
        return harness.preflight_line(RECIPE, args, f"options fit world size {args.preflight}", latest)

    # ---- rank, device, controller: Horovod's world must exist before TensorFlow picks its devices
    launcher = horovod_launch.prepare_world()
    import horovod
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank, world_size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    # Horovod started outside any launcher's world is a world of one that trains alone and exits 0: refuse
    # a world that is not the one the job launched (slurm/lib/launch.sh sets the expected size).
    harness.check_expected_world_size(world_size)
    validate(args, world_size)
    controller = "gloo" if hvd.gloo_enabled() else "mpi" if hvd.mpi_enabled() else "none"
    gpus, gpu_name = tf.config.list_physical_devices("GPU"), None
    if gpus:  # one GPU per rank, memory taken as needed rather than all of it up front
        gpu = gpus[harness.gpu_for_local_rank(local_rank, len(gpus))]
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
    model = keras_model.build_model(keras_model.TokenModelConfig.from_args(args), args.seed)
    lr = args.lr * world_size
    optimizer = keras_model.optimizer(args.optimizer, lr)
    optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    # A test's negative control (HPCML_TEST_FAULT): TensorFlow has no gradient or load hooks, so the fault enters
    # where it applies: the tape's reduction, whether there is one, the restore.
    fault = harness.faults.inject(RECIPE, FAULTS, data_parallel=world_size)
    latest, meta = harness.resume_dir(args, must_match, state_file="meta.json")
    start_step, resumed = 0, None  # resumed: the checkpoint's metrics state
    if latest is not None:
        keras_model.restore(checkpoint, model, str(latest / "ckpt"), weights_only=fault == "resume-fresh-optimizer")
        start_step, resumed = meta["step"], meta
        if is_rank0:
            print(f"[{RECIPE}] resumed from {latest} (step {start_step})", flush=True)
    # Every rank starts from rank 0's weights and optimizer state (the same seed already agrees; this
    # makes it so whatever each rank read or drew).
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables(), root_rank=0)

    env = harness.DistEnv(rank, local_rank, world_size, "", 0, launcher)
    averaged = world_size > 1 and fault != "no-grad-allreduce"
    versions = {"tensorflow_version": tf.__version__, "horovod_version": horovod.__version__}
    run_info = {**harness.describe_run(env, f"horovod-{controller}", gpu_name or "cpu",
                                       "DistributedGradientTape" if averaged else "GradientTape", versions, dp=world_size),
                "hostnames": hostnames, "collectives": ops, "lr_used": lr, "dtype": dtype,
                "horovod_built": {"gloo": hvd.gloo_built(), "mpi": hvd.mpi_built(), "nccl": hvd.nccl_built()}}
    size = (model.count_params(), keras_model.flops_per_token(model))
    metrics = harness.start_metrics(RECIPE, args, run_info, resumed, logging_rank=is_rank0, devices=world_size, size=size,
                                    peak=keras_model.peak_flops(gpu_name, dtype, args.peak_tflops), framework="tensorflow")
    if is_rank0:
        print(f"[{RECIPE}] lr {args.lr} x {world_size} ranks = {lr}", flush=True)

    @tf.function
    def train_step(inputs, targets):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = tf.reduce_mean(keras_model.loss_per_token(targets, logits))
        if averaged:  # gradients averaged over all ranks (grad-sum: summed)
            tape = hvd.DistributedGradientTape(tape, op=hvd.Sum if fault == "grad-sum" else hvd.Average)
        grads = tape.gradient(loss, model.trainable_variables)
        norm = tf.linalg.global_norm(grads)  # of the averaged gradients: the same on every rank
        if args.clip_grad > 0:
            grads, _ = tf.clip_by_global_norm(grads, args.clip_grad, use_norm=norm)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return (hvd.allreduce(loss, op=hvd.Average) if world_size > 1 else loss), norm

    global_batch = args.batch_per_rank * world_size

    @tf.function
    def eval_loss(inputs, targets):
        return tf.reduce_mean(keras_model.loss_per_token(targets, model(inputs, training=False)))

    validation_batches = harness.numpy_batches(args, split="validation")

    def evaluate() -> float:
        """The validation loss (--eval-every), each rank its rows, averaged over the ranks."""
        rows = slice(rank * args.batch_per_rank, (rank + 1) * args.batch_per_rank)
        total = sum(eval_loss(*(a[rows] for a in validation_batches(batch, global_batch)))
                    for batch in range(args.eval_batches))
        mean = tf.cast(total, tf.float32) / args.eval_batches
        return float(hvd.allreduce(mean, op=hvd.Average)) if world_size > 1 else float(mean)

    def weight_spread() -> float:
        """Largest difference of any weight between two ranks (0.0: all ranks hold the same model)."""
        if world_size == 1:
            return 0.0
        flat = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in model.variables], axis=0)
        return float(tf.reduce_max(hvd.allreduce(flat, op=hvd.Max) - hvd.allreduce(flat, op=hvd.Min)))

    def save(step: int) -> None:
        if is_rank0:  # every rank holds the same model: rank 0's copy is the checkpoint
            harness.save_checkpoint_dir(args.out_dir / "checkpoints", step,
                                        lambda staging: checkpoint.write(str(staging / "ckpt")),
                                        {**metrics.checkpoint_state(), **must_match})
            metrics.write()

    def average(values: list) -> list[float]:  # the sync's one collective: the stop agreement (the loss is global)
        values = [float(value) for value in values]
        return hvd.allreduce(tf.constant(values), op=hvd.Average).numpy().tolist() if world_size > 1 else values

    # ---- training loop
    run = harness.TrainingRun(RECIPE, args, rank, start_step, metrics, average)
    sync_checks = []
    # --data: synthetic or a token file, read one step ahead (tf.data)
    batches = harness.tf_step_batches(args, range(start_step + 1, args.max_steps + 1), global_batch)
    for step, (inputs, targets) in run.steps(batches):  # (the wait for each batch timed apart)
        rows = slice(rank * args.batch_per_rank, (rank + 1) * args.batch_per_rank)
        lr = run.learning_rate(step) * world_size  # --lr-schedule, --warmup-steps; Horovod's --lr x ranks
        optimizer.learning_rate = lr
        loss, norm = train_step(inputs[rows], targets[rows])
        metrics.log_step(step, float(loss), global_batch, lr, grad_norm=float(norm))  # (float: waits)
        if run.eval_due(step):
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if args.check_sync_every and step % args.check_sync_every == 0:
            sync_checks.append({"step": step, "param_max_abs_diff_across_ranks": weight_spread()})
        if run.step_done(step, save):
            break
    run.save_last(save)

    # ---- prove from inside the run that the ranks really trained one model together
    exit_code = run.finish(metrics, weight_spread(), {"sync_checks": sync_checks}, differ="weights differ across ranks")
    if world_size > 1:
        hvd.join()  # leave together: no rank exits while another still waits in a collective
    return exit_code


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
