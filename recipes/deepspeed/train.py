"""DeepSpeed ZeRO and pipeline parallelism: the DDP recipe's GPT and data, trained by a DeepSpeed engine.

ZeRO shards what DDP replicates: stage 1 the optimizer state, stage 2 also the gradients, stage 3 also the
parameters. With --pp N the GPT becomes a ``PipelineModule`` of N stages (recipes/deepspeed/pipeline.py)
trained by DeepSpeed's pipeline engine, world = PP x DP, with ZeRO stage 0 or 1 (DeepSpeed runs no higher
stage with a pipeline; --pp defaults to 1). The training is the same in every layout: each must give the
loss curve of one process.

    # one process (the reference every parallel run is checked against)
    python recipes/deepspeed/train.py --zero-stage 0

    # two processes on this machine (CPU/gloo here; on a GPU node: 2 GPUs, NCCL, bf16)
    torchrun --standalone --nproc_per_node=2 recipes/deepspeed/train.py --zero-stage 3

    # under Slurm: one srun task per rank (no ssh/pdsh hostfile launcher), rank layout from SLURM_* variables
    srun -N 2 --ntasks-per-node=4 python recipes/deepspeed/train.py --zero-stage 2

    # pipeline: 2 stages x 2 data-parallel replicas, 4 micro-batches per step, ZeRO-1
    torchrun --standalone --nproc_per_node=4 recipes/deepspeed/train.py --pp 2 --grad-accum 4

    # on Perlmutter (2 nodes x 4 A100), or on any Slurm cluster; --pp auto: one stage per node
    sbatch slurm/deepspeed.sh --zero-stage 3
    sbatch slurm/deepspeed.sh --pp auto --grad-accum 8

    # will it fit? one CPU process, no GPU: DeepSpeed's engine for 8 ranks on fake tensors, against an A100-40
    python recipes/deepspeed/train.py --estimate-memory a100-40 --world 8 --zero-stage 3

    # a Hugging Face causal LM saved in a directory, or your own module and data, instead of the GPT (ZeRO,
    # not the pipeline: harness/model.py); --export-hf gathers ZeRO-3's shards into one directory
    torchrun --standalone --nproc_per_node=2 recipes/deepspeed/train.py --zero-stage 3 --model hf:$SCRATCH/models/my-llama

The DeepSpeed config is recipes/deepspeed/ds_config.json (or --ds-config FILE). "auto" values are filled
in here: train_batch_size from --global-batch, bf16 on GPU and fp32 on CPU. --zero-stage, --global-batch,
--grad-accum, --lr and --clip-grad override the file. gradient_clipping is 0 in the file on purpose: DeepSpeed's
default (1.0) clips, which a plain PyTorch loop does not. --lr-schedule and --warmup-steps set the optimizer's
rate before every step (the config's "scheduler" is not used). The optimizer is torch's AdamW ("torch_adam": true), so
no op is compiled at start-up. Batch sizes that do not fit the world size are refused before any rank
starts, with the numbers; with --pp the batch is micro x --grad-accum (the micro-batches) x DP.
Checkpoints are DeepSpeed's (every rank writes its shard; the pipeline one file per layer) in
OUT_DIR/checkpoints/step_N; a rerun with the same --out-dir resumes (in the same layout: the optimizer
state is cut for it); SIGUSR1/SIGTERM checkpoint and stop. --optimizer sgd trains with plain SGD instead of
the config's AdamW: the parity tests use it (a wrong gradient scale changes SGD's curve; Adam hides it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

# DeepSpeed guesses its accelerator, and logs a WARNING each run when it finds no GPU: name it instead.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
import deepspeed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness and the model
import harness  # noqa: E402
import estimate  # noqa: E402  (next to this file: --estimate-memory)
import pipeline  # noqa: E402  (next to this file)
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "deepspeed"
# The negative controls the tests can switch on (HPCML_TEST_FAULT, harness/faults.py)
FAULTS = ("grad-sum", "accum-sum", "no-grad-allreduce", "last-microbatch-loss", "rank-mean-loss", "mask-ignored",
          "resume-fresh-optimizer")
DEFAULT_DS_CONFIG = Path(__file__).resolve().parent / "ds_config.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("--ds-config", type=Path, default=DEFAULT_DS_CONFIG, help="DeepSpeed JSON config")
    p.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage 0, 1, 2 or 3 (default: the config's)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step, summed over all ranks (default: the config's train_batch_size, or 16)")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches per optimizer step on each rank (default: the config's, or 1)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's)")
    p.add_argument("--pp", default="1", help="pipeline stages (a number, or auto: one per node); micro-batches: --grad-accum")
    p.add_argument("--optimizer", choices=["config", "sgd"], default="config",
                   help="sgd: plain torch SGD at --lr instead of the config's optimizer (the parity tests use it)")
    p.add_argument("--partition-method", choices=["type:Block", "parameters", "uniform"], default="type:Block",
                   help="--pp: how DeepSpeed cuts the layers into stages (type:Block: the same blocks per stage)")
    p.add_argument("--activation-checkpointing", action="store_true", help="--pp: recompute each layer in backward")
    harness.add_schedule_options(p)
    harness.memory.add_options(p)  # --estimate-memory GPU --world N
    return harness.parse_recipe_args(p, RECIPE, argv, model_options=GPTConfig.add_arguments, loss_masks=True)


def resolve_ds_config(args: argparse.Namespace, world_size: int, on_gpu: bool, pp: int = 1) -> dict:
    """The DeepSpeed config this run uses: the file, the command line on top, "auto" filled in, all checked.

    DeepSpeed's own checks fire inside deepspeed.initialize, after the process group formed, as assertion
    stack traces; the same rules are checked here first, each with a line saying what to change.
    """
    path = args.ds_config
    try:
        config = json.loads(Path(path).read_text())
    except OSError as error:
        raise harness.ConfigError(f"cannot read --ds-config {path}: {error.strerror}") from None
    except ValueError as error:
        raise harness.ConfigError(f"--ds-config {path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise harness.ConfigError(f"--ds-config {path} is not a DeepSpeed config (a JSON object)")

    zero = config.setdefault("zero_optimization", {})
    stage = args.zero_stage if args.zero_stage is not None else (1 if pp > 1 else zero.get("stage", 0))
    source = "--zero-stage" if args.zero_stage is not None else f"zero_optimization.stage in {path}"
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise harness.ConfigError(f"{source} is {stage!r}: ZeRO stages are 0 (plain data parallel), 1 (optimizer "
                                 "state sharded), 2 (+ gradients) and 3 (+ parameters)")
    if pp > 1 and stage > 1:
        raise harness.ConfigError(f"--zero-stage {stage} with --pp {pp}: DeepSpeed's pipeline engine runs ZeRO stage 0 "
                                  "or 1 only (leave --zero-stage out: --pp uses 1)")
    zero["stage"] = stage
    world_size //= pp  # the batch is split over the data-parallel ranks; the stages share their rows
    ranks = "ranks" if pp == 1 else "DP ranks"

    def integer(key: str, value) -> int | None:
        if value is None or value == "auto":
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise harness.ConfigError(f"{key} in {path} must be a positive integer or \"auto\", got {value!r}")
        return value

    file_batch = integer("train_batch_size", config.get("train_batch_size"))
    file_micro = integer("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu"))
    file_accum = integer("gradient_accumulation_steps", config.get("gradient_accumulation_steps"))
    accum = args.grad_accum or file_accum or 1
    batch = args.global_batch or file_batch or ((file_micro * accum * world_size) if file_micro else 16)
    if batch < 1 or accum < 1:
        raise harness.ConfigError("--global-batch and --grad-accum must be at least 1")
    if file_micro and file_micro * accum * world_size != batch:
        raise harness.ConfigError(
            f"train_micro_batch_size_per_gpu {file_micro} in {path} x gradient_accumulation_steps {accum} x "
            f"{world_size} {ranks} = {file_micro * accum * world_size}, not the train_batch_size {batch}; "
            "remove train_micro_batch_size_per_gpu from the file (it is derived) or make the product match"
        )
    if batch % (accum * world_size):
        rows = accum * world_size
        raise harness.ConfigError(
            f"train_batch_size {batch} is not divisible by gradient_accumulation_steps {accum} x {world_size} "
            f"{ranks} = {rows}; use a multiple of {rows} (e.g. --global-batch {-(-batch // rows) * rows})"
        )
    config.update(train_batch_size=batch, gradient_accumulation_steps=accum,
                  train_micro_batch_size_per_gpu=batch // (accum * world_size))

    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict) or "lr" not in optimizer.get("params", {}):
        raise harness.ConfigError(f"{path} has no optimizer with params.lr: the recipe lets DeepSpeed build the "
                                 "optimizer from the config (see recipes/deepspeed/ds_config.json)")
    if args.lr is not None:
        optimizer["params"]["lr"] = args.lr
    lr = optimizer["params"]["lr"]
    if args.clip_grad > 0:
        config["gradient_clipping"] = args.clip_grad
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
        raise harness.ConfigError(f"the learning rate must be a positive finite number, got {lr!r}")
    if args.optimizer == "sgd":  # the recipe passes torch's SGD to deepspeed.initialize (a "client" optimizer)
        config["client_sgd_lr"] = config.pop("optimizer")["params"]["lr"]
        config["zero_allow_untested_optimizer"] = True
    bf16 = config.setdefault("bf16", {})
    if bf16.get("enabled", False) == "auto":
        bf16["enabled"] = on_gpu  # fp32 on CPU: bf16 matmuls there are slow and the parity tests compare fp32
    if config.get("fp16", {}).get("enabled") == "auto":
        config["fp16"]["enabled"] = False
    return config


def pipeline_stages(args: argparse.Namespace, world_size: int) -> int:
    """--pp as a number of stages (auto: one per node of the job), checked against the world and the layers."""
    text = str(args.pp)
    pp = (harness.nodes_in_job() or 1) if text == "auto" else int(text) if text.isdigit() else 0
    if pp < 1:
        raise harness.ConfigError(f"--pp must be a number of stages or auto (one per node), got {text!r}")
    if world_size % pp:
        raise harness.ConfigError(f"world size {world_size} is not divisible by --pp {pp}: launch a multiple of {pp} "
                                  "ranks, or change --pp")
    if args.n_layer % pp and args.partition_method == "type:Block":
        raise harness.ConfigError(f"--n-layer {args.n_layer} is not divisible by --pp {pp}: every stage gets the "
                                  "same number of blocks")
    return pp


def validate(args: argparse.Namespace, world_size: int, on_gpu: bool) -> tuple[dict, int]:
    """Everything that can be checked before ranks start talking to each other: the resolved DeepSpeed
    config and the pipeline stages."""
    harness.validate_run(args, world_size)
    pp = pipeline_stages(args, world_size)
    if pp > 1 and harness.masked_data(args):  # (the engine's pipeline averages its micro-batches' losses itself)
        raise harness.ConfigError(f"--data {args.data} is instruction data, which the DeepSpeed pipeline (--pp {args.pp}) "
                                  "does not weigh by trained tokens yet: train it with --pp 1 (ZeRO), or recipes/ddp")
    ds_config = resolve_ds_config(args, world_size, on_gpu, pp)
    return ds_config, pp


def check_resumable(resume_from: Path | None, state: dict | None, stage: int, world_size: int, pp: int) -> None:
    """A sharded optimizer state is cut for one stage and one number of ranks; a pipeline checkpoint for one
    number of stages (DeepSpeed reloads its layer files, not its per-stage optimizer state, in another)."""
    if state and state.get("pp", 1) != pp:
        raise harness.ConfigError(f"{resume_from} was written by {state.get('pp', 1)} pipeline stage(s); this run has "
                                  f"--pp {pp}: resume with the same --pp, or use --no-resume")
    if state and (state["zero_stage"] != stage or (stage > 0 and state["world_size"] != world_size)):
        raise harness.ConfigError(
            f"{resume_from} holds ZeRO-{state['zero_stage']} shards of {state['world_size']} ranks; this run is "
            f"ZeRO-{stage} on {world_size}: resume with the same --zero-stage and layout, or use --no-resume"
        )


def hugging_face_zero3_loading(ds_config: dict):
    """transformers' HfDeepSpeedConfig: while it lives, from_pretrained builds the model under deepspeed.zero.Init
    (each parameter partitioned as it is made) and loads the weights shard by shard."""
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed()  # (zero.Init partitions over DeepSpeed's communicator: it joins our group)
    return HfDeepSpeedConfig(ds_config)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_cfg = GPTConfig.from_args(args)
    # the stack's GPT, or --model hf:DIR (a Hugging Face model) or MODULE:FACTORY (yours): harness/model.py
    spec = harness.model_spec(args, gpt=GPT, gpt_config=model_cfg)
    # DeepSpeed JIT-compiles missing ops into TORCH_EXTENSIONS_DIR: node-local disk and one directory per
    # user (a shared home's file locks hang on NFS/Lustre; one /tmp directory for everyone belongs to whoever
    # made it first). The image sets none, so under Shifter, where the image's environment wins, the job's does.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", f"/tmp/torch_extensions-{os.getuid()}")
    if args.estimate_memory:  # will it fit: the memory of ZeRO-N on --world ranks, without their GPUs
        return estimate.estimate_memory(args, spec, validate=validate)
    on_gpu = torch.cuda.is_available()
    world_size = args.preflight if args.preflight is not None else harness.detect_dist_env().world_size
    ds_config, pp = validate(args, world_size, on_gpu)
    harness.check_model_vocabulary(spec, args.vocab_size)
    harness.check_export_option(args, spec)
    if pp > 1 and (spec.name != "gpt" or getattr(args, "dataset", None)):
        raise harness.ConfigError(f"--model {spec.name} / --dataset with --pp {pp}: the pipeline splits the stack's GPT "
                                  "into stages (recipes/deepspeed/pipeline.py); train your model with ZeRO (--pp 1)")
    stage, accum = ds_config["zero_optimization"]["stage"], ds_config["gradient_accumulation_steps"]
    global_batch, micro_rows = ds_config["train_batch_size"], ds_config["train_micro_batch_size_per_gpu"]
    sgd_lr, dp = ds_config.pop("client_sgd_lr", None), world_size // pp
    # the rate the schedule starts from (harness.learning_rate): --lr, or the config's
    args.lr = sgd_lr or ds_config["optimizer"]["params"]["lr"]
    must_match = {**spec.identity, "global_batch": global_batch,  # to resume a checkpoint
                  "optimizer_name": args.optimizer, **harness.schedule_identity(args)}
    resume_from, trainer_state = harness.resume_dir(args, must_match)
    check_resumable(resume_from, trainer_state, stage, world_size, pp)
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        return harness.preflight_line(RECIPE, args, f"ZeRO-{stage}, PP {pp} x DP {dp}, batch {global_batch} = {micro_rows} x "
                                      f"{accum} x {dp} {'ranks' if pp == 1 else 'DP ranks'}", resume_from,
                                      layout={"pp": pp, "dp": dp})
    env = harness.detect_dist_env()
    harness.check_expected_world_size(env.world_size)

    # ---- rank, device, backend: our process group (gloo on CPU, NCCL on GPU); DeepSpeed joins it
    device, backend = harness.setup_torch_distributed(env, args.timeout_s, always_group=True)
    # DeepSpeed reads the layout from torchrun's variables; srun sets SLURM_* ones (harness.detect_dist_env).
    os.environ.update(RANK=str(env.rank), LOCAL_RANK=str(env.local_rank), WORLD_SIZE=str(env.world_size))
    is_rank0 = env.rank == 0
    hostnames = harness.all_hostnames(env.world_size)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step INFO lines would bury ours
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates: one warning per call, every step.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    # Its pipeline broadcasts the tied embedding with an op torch has no autograd kernel for: warned per rank.
    warnings.filterwarnings("ignore", r"c10d::broadcast_: an autograd kernel was not registered", UserWarning)
    dtype = torch.bfloat16 if ds_config["bf16"].get("enabled") else torch.float32

    # ---- model: same seed on every rank (the pipeline: each stage its layers of the same GPT); the engine
    # owns the optimizer, the sharding and the reductions
    zero3_loading = None
    host_memory = harness.HostMemory()  # (each rank's peak host memory while it loads, steps and exports)
    with host_memory.phase("load"):
        if pp > 1:
            deepspeed.init_distributed(dist_backend=backend)  # the pipeline's process topology needs DeepSpeed's comm
            model, size = pipeline.build(model_cfg, pp, args.seed, args.partition_method, args.activation_checkpointing)
        else:
            torch.manual_seed(args.seed)
            # ZeRO-3 and a Hugging Face model: from_pretrained loads it straight into shards (zero.Init through the
            # transformers integration, which reads this config while it is alive), so no rank holds it whole
            zero3_loading = hugging_face_zero3_loading(ds_config) if stage == 3 and spec.name.startswith("hf:") else None
            model = spec.build()
            if zero3_loading is not None:  # (the integration falls back to a whole model silently: check)
                assert all(hasattr(p, "ds_id") for p in model.parameters()), "from_pretrained did not load under zero.Init"
            size = harness.model_size(model)  # (parameters counted whole; ZeRO-3's are shards)
    with host_memory.phase("engine"):  # (DeepSpeed's own buffers: its flat partitions, its buckets)
        parameters = [p for p in model.parameters() if p.requires_grad]
        client_optimizer = torch.optim.SGD(parameters, lr=sgd_lr) if sgd_lr else None
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters, optimizer=client_optimizer,
                                               config=ds_config)
    # Frameworks fall back to no parallelism silently: check from inside what DeepSpeed built.
    assert isinstance(engine, deepspeed.PipelineEngine if pp > 1 else deepspeed.DeepSpeedEngine)
    assert engine.zero_optimization_stage() == stage and engine.world_size == env.world_size == dist.get_world_size()
    if pp > 1:
        assert engine.num_stages == pp and engine.grid.get_data_parallel_world_size() == dp
    dp_rank = engine.grid.get_data_parallel_rank() if pp > 1 else env.rank
    masked = harness.masked_data(args)  # instruction data: every trained token of the global batch weighs the same
    harness.faults.inject(RECIPE, FAULTS, parameters=model.parameters(), data_parallel=dp, micro_batches=accum, engine=engine,
                          applies={"grad-sum": dp > 1 and pp == 1, "accum-sum": accum > 1 and pp == 1,  # (tests only)
                                   "no-grad-allreduce": dp > 1 and stage == 0, "last-microbatch-loss": pp > 1 and accum > 1,
                                   "rank-mean-loss": dp * accum > 1 and masked, "mask-ignored": masked})
    engine.train()
    if is_rank0:  # the layout the engine formed
        print(f"[{RECIPE}] world_size={engine.world_size} backend={backend} device={device.type} ZeRO-{stage} "
              f"PP={pp} DP={dp} dtype={dtype} batch={global_batch} (micro {micro_rows} x accum {accum} x {dp}) "
              f"launcher={env.launcher} hosts={','.join(hostnames)}", flush=True)

    checkpoint_dir = args.out_dir / "checkpoints"
    start_step, resumed = 0, None  # resumed: the checkpoint's metrics state
    if trainer_state:
        engine.load_checkpoint(str(checkpoint_dir), tag=resume_from.name)  # weights, optimizer shards, counters
        start_step, resumed = trainer_state["step"], trainer_state
        if is_rank0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    run_info = {**harness.describe_run(env, backend, device, type(engine).__name__, pp=pp, dp=dp),
                "deepspeed_version": deepspeed.__version__, "zero_stage": stage, "grad_accum": accum,
                "ds_config": ds_config, "dtype": str(dtype), "hostnames": hostnames, "model": spec.name,
                "loaded_partitioned": zero3_loading is not None}
    metrics = harness.start_metrics(RECIPE, args, run_info, resumed, logging_rank=is_rank0, devices=env.world_size,
                                    size=size, peak=harness.peak_flops(device, dtype, args.peak_tflops))

    def save(step: int) -> None:  # every rank writes its shard; the tag is the staging directory's name
        harness.save_sharded_checkpoint(
            checkpoint_dir, step, lambda staging: engine.save_checkpoint(str(checkpoint_dir), tag=staging.name,
                                                                         save_latest=False),
            {**metrics.checkpoint_state(), **must_match, "zero_stage": stage, "world_size": env.world_size, "pp": pp},
            writes_state=is_rank0, is_rank0=is_rank0, barrier=dist.barrier)
        metrics.write()

    # ---- evaluation (--eval-every): the validation loss, averaged over DP (the pipeline: the engine's
    # forward-only schedule over the same micro-batches, its mean over them and DP, on every stage)
    validation = harness.validation_data(args)

    @torch.no_grad()
    def evaluate() -> float:
        total = torch.zeros((), device=device)
        for batch in range(args.eval_batches):
            inputs, targets = validation.local_batch(batch, global_batch, dp_rank, dp)
            micro = [(inputs[i:i + micro_rows].to(device), targets[i:i + micro_rows].to(device))
                     for i in range(0, len(inputs), micro_rows)]
            if pp > 1:
                total += engine.eval_batch(data_iter=iter(micro)).float().reshape(())  # (a 1-element tensor)
            else:  # (each micro-batch weighed as in training: instruction data's loss over its trained tokens)
                engine.eval()
                weights = harness.loss_weights([targets for _, targets in micro], masked)
                total += sum(engine(*rows).float() * weight for rows, weight in zip(micro, weights))
        engine.train()
        return float(total) / args.eval_batches if pp > 1 else harness.mean_across_ranks(total / args.eval_batches, dp)

    # ---- training loop: one optimizer step = --grad-accum micro-batches on every rank
    data = harness.training_data(args)  # --data: synthetic or a token file
    run = harness.TrainingRun(RECIPE, args, env.rank, start_step, metrics, harness.average_across_ranks(env.world_size, device),
                              host_memory=host_memory)
    batches = harness.step_batches(data, args, range(start_step + 1, args.max_steps + 1), global_batch, dp_rank, dp,
                                   device)  # (--data-workers: read ahead)
    # DeepSpeed computes the global gradient norm for ZeRO 1-3 and bf16; at ZeRO-0 in fp32 (clipping or not) it
    # keeps none, so the recipe takes it itself: every run logs grad_norm (and a parity test can compare it).
    own_norm = pp == 1 and stage == 0 and dtype == torch.float32
    for step, (inputs, targets) in run.steps(batches):  # (harness.phase: named ranges for --profile and Nsight)
        harness.set_learning_rate(engine.optimizer, run.learning_rate(step))  # --lr-schedule, --warmup-steps
        if pp > 1:  # the engine runs the micro-batches through the stages (its 1F1B schedule), then steps
            micro = [(inputs[i:i + micro_rows].to(device), targets[i:i + micro_rows].to(device))
                     for i in range(0, len(inputs), micro_rows)]
            with harness.phase("pipeline-step"):  # forward, backward, p2p and the optimizer, in the engine's schedule
                loss = float(engine.train_batch(data_iter=iter(micro)))  # mean over micro-batches and DP, every stage
            metrics.log_step(step, loss, global_batch, engine.get_lr()[0])
            if run.eval_due(step):
                metrics.log_eval(step, evaluate(), args.eval_batches)
            if run.step_done(step, save):
                break
            continue
        step_loss = torch.zeros((), device=device)
        micro_batches = [slice(micro * micro_rows, (micro + 1) * micro_rows) for micro in range(accum)]
        # what each micro-batch's mean loss weighs: 1/M, or (instruction data) its share of the global batch's
        # trained tokens, so that every trained token weighs the same on any layout
        weights = harness.loss_weights([targets[rows].to(device) for rows in micro_batches], masked)
        for micro, (rows, weight) in enumerate(zip(micro_batches, weights)):
            with harness.phase("forward"):
                loss = engine(inputs[rows].to(device), targets[rows].to(device))
            # backward() scales by 1/accum, which the weights do already (x accum: 1 for a mean of equal
            # micro-batches), and reduces (ZeRO: reduce-scatters) the mean over the ranks at the last micro-batch
            with harness.phase("backward"):
                engine.backward(loss * (weight * accum))
            with harness.phase("optimizer"):
                if own_norm and micro == accum - 1:  # the reduced gradients, on the module until the step
                    norm = harness.clip_gradients(engine.module.parameters(), 0)
                engine.step()  # the optimizer steps only at the accumulation boundary
            step_loss += loss.detach().float() * weight
        norm = norm if own_norm else engine.get_global_grad_norm()
        # this rank's loss, as a tensor: averaged over the ranks at the next sync (every --log-every steps)
        metrics.log_step(step, step_loss, global_batch, engine.get_lr()[0], grad_norm=norm)
        if run.eval_due(step):
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):
            break
    run.save_last(save)

    # ---- prove from inside the run that the replicas really trained one model together (ZeRO-3: the
    # parameters are shards, gathered first; the pipeline: the DP replicas of each stage)
    parameters = list(engine.module.parameters())
    group = engine.grid.get_data_parallel_group() if pp > 1 else None
    if stage == 3:  # a parameter at a time: no rank holds the whole model, not even to check it
        spread = 0.0
        for parameter in parameters:
            with deepspeed.zero.GatheredParameters([parameter]):
                spread = max(spread, harness.max_difference_across_ranks([parameter], dp, group=group))
    else:
        spread = harness.max_difference_across_ranks(parameters, dp, group=group)
    if args.export_hf and not spread and run.last_step == args.max_steps:  # (a finished run whose ranks agree)
        # a tensor at a time (ZeRO-3: every rank takes part in gathering each one; the rank whose file holds
        # it writes it)
        with host_memory.phase("export"):
            harness.export_sharded_model(engine.module, spec, args.export_hf, RECIPE, rank=env.rank,
                                         world_size=env.world_size, barrier=dist.barrier)
    exit_code = run.finish(metrics, spread,
                           extra={"host_memory": harness.gather_from_ranks(host_memory.record(), env.world_size)})
    engine.destroy()  # the engine holds the process group: drop it before leaving the group
    engine = None  # (the closures above share this variable: the last reference goes with it)
    harness.leave_process_group()
    return exit_code


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
