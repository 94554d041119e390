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

    # a Hugging Face causal LM saved in a directory, or your own module, instead of the GPT (harness/model.py)
    accelerate launch --multi_gpu --num_processes 2 recipes/accelerate/train.py --model hf:$SCRATCH/models/my-llama

    # GPUs only: accelerate's ParallelismConfig, FSDP2 over --dp-shard ranks x tensor parallel over --tp ranks
    # (the model's own TP plan, through transformers' tp_plan="auto"); on a CPU, recipes/fsdp_tp_pp does the same
    torchrun --standalone --nproc_per_node=4 recipes/accelerate/train.py --model hf:DIR --dp-shard 2 --tp 2

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
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

# accelerate loads DeepSpeed where it is installed (to resume a checkpoint), which guesses its accelerator
# and logs a WARNING when it finds no GPU: name it instead.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType, InitProcessGroupKwargs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness and the model
import harness  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

RECIPE = "accelerate"
FAULTS = ("grad-sum", "accum-sum", "no-grad-allreduce", "rank-mean-loss", "mask-ignored",
          "resume-fresh-optimizer")  # tests only: harness/faults.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, summed over all ranks")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step on each rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="accelerate's mixed precision; auto = bf16 on GPU, none (float32) on CPU")
    p.add_argument("--dp-shard", type=int, default=None,
                   help="GPUs only: FSDP2 over this many ranks (accelerate's ParallelismConfig; default: plain DDP)")
    p.add_argument("--tp", type=int, default=1,
                   help="GPUs only: tensor-parallel ranks (with --model hf:DIR: the model's own TP plan)")
    p.add_argument("--launch-config", type=Path, default=None,
                   help="the accelerate config file `accelerate launch --config_file` was given: checked against "
                        "the world size (slurm/accelerate.sh passes it)")
    harness.add_optimizer_option(p)
    harness.add_schedule_options(p)
    return harness.parse_recipe_args(p, RECIPE, argv, model_options=GPTConfig.add_arguments, loss_masks=True)


def validate(args: argparse.Namespace, world_size: int, model: harness.ModelSpec, nodes: int | None = None) -> int:
    """Everything that can be checked before ranks start talking to each other; the data-parallel size."""
    harness.validate_run(args, world_size)
    harness.check_model_vocabulary(model, args.vocab_size)
    harness.check_export_option(args, model)
    harness.require_at_least_one(args, "global_batch", "grad_accum", "tp")
    harness.require_positive(args, "lr")
    dp = data_parallel_size(args, world_size, model)
    harness.require_divisible("--global-batch", args.global_batch, dp * args.grad_accum,
                              f"{dp} data-parallel ranks x --grad-accum {args.grad_accum} = {dp * args.grad_accum}")
    if args.launch_config is not None:
        check_launch_config(args.launch_config, world_size, nodes)
    return dp


def data_parallel_size(args: argparse.Namespace, world_size: int, model: harness.ModelSpec) -> int:
    """The ranks that take different rows of a step's batch: the world, or with --dp-shard/--tp (accelerate's
    ParallelismConfig: FSDP2 x TP) the FSDP ranks; the layout's rules checked here, one line each."""
    if args.dp_shard is None and args.tp == 1:
        return world_size
    if args.preflight is None and not torch.cuda.is_available():
        raise harness.ConfigError("--dp-shard/--tp: accelerate's ParallelismConfig runs on GPUs only (it refuses a CPU "
                                  "world); on a CPU, recipes/fsdp_tp_pp trains FSDP2 x TP: use it, or leave both out")
    dp_shard = args.dp_shard if args.dp_shard is not None else world_size // args.tp
    if dp_shard < 1 or dp_shard * args.tp != world_size:
        raise harness.ConfigError(f"--dp-shard {dp_shard} x --tp {args.tp} = {dp_shard * args.tp}, but the job has "
                                  f"{world_size} ranks: make the product the world size (or leave --dp-shard out)")
    if args.tp > 1 and not model.name.startswith("hf:"):
        raise harness.ConfigError(f"--tp {args.tp}: accelerate cuts a Hugging Face model with its own TP plan; "
                                  f"--model {model.name} has none here (use --model hf:DIR, or recipes/fsdp_tp_pp)")
    for what, count in (model.tp_divides or {}).items():
        if count % args.tp:
            raise harness.ConfigError(f"{what} {count} is not divisible by --tp {args.tp}: each TP rank takes whole heads")
    if args.export_hf:
        raise harness.ConfigError("--export-hf with --dp-shard/--tp is not supported yet: export the run's checkpoint "
                                  "with recipes/export_hf.py, or train with recipes/fsdp_tp_pp")
    return dp_shard


def check_launch_config(path: Path, world_size: int, nodes: int | None) -> None:
    """An accelerate config that asks for another layout than the allocation would start the wrong world."""
    import yaml  # accelerate's own dependency

    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise harness.ConfigError(f"cannot read --launch-config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise harness.ConfigError(f"--launch-config {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise harness.ConfigError(f"--launch-config {path} is not an accelerate config (a YAML mapping)")
    for key, value, have in (("num_processes", world_size, "ranks"), ("num_machines", nodes, "nodes")):
        if config.get(key) is not None and value is not None and config[key] != value:
            raise harness.ConfigError(
                f"{path} says {key}: {config[key]} but the job has {value} {have}; delete {key} "
                "from the file (slurm/accelerate.sh takes it from the allocation) or change the allocation")
    if config.get("distributed_type") == "FSDP" and not torch.cuda.is_available():
        raise harness.ConfigError(f"{path} asks for FSDP, which accelerate runs only on GPUs (on CPU it silently "
                                  "trains plain DDP): use recipes/accelerate/multi_gpu.yaml here")


def parallelism_options(args: argparse.Namespace, dp_shard: int) -> dict:
    """Accelerator options for --dp-shard/--tp: a ParallelismConfig and FSDP2 (each decoder layer a unit: the
    model's _no_split_modules); {} for plain DDP."""
    if args.dp_shard is None and args.tp == 1:
        return {}
    from accelerate import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    return {"parallelism_config": ParallelismConfig(dp_shard_size=dp_shard, tp_size=args.tp),
            "fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                          state_dict_type="SHARDED_STATE_DICT")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the stack's GPT, or --model hf:DIR (a Hugging Face model) or MODULE:FACTORY (yours): harness/model.py
    spec = harness.model_spec(args, gpt=GPT, gpt_config=GPTConfig.from_args(args))
    must_match = {**spec.identity, "global_batch": args.global_batch,  # to resume a checkpoint
                  "optimizer_name": args.optimizer, **harness.schedule_identity(args)}
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        validate(args, args.preflight, spec, harness.nodes_in_job())
        resume_from, _ = harness.resume_dir(args, must_match)
        return harness.preflight_line(RECIPE, args, f"options fit world size {args.preflight}", resume_from)
    env = harness.detect_dist_env()  # accelerate launch speaks torchrun's protocol (RANK, WORLD_SIZE, ...)
    dp = validate(args, env.world_size, spec, harness.nodes_in_job() if env.launcher != "single" else None)
    harness.check_expected_world_size(env.world_size)
    resume_from, trainer_state = harness.resume_dir(args, must_match)

    # ---- rank, device, backend: accelerate's choice, made explicit where it would otherwise guess
    on_gpu = torch.cuda.is_available()
    mixed_precision = {"auto": "bf16" if on_gpu else "no", "float32": "no", "bfloat16": "bf16"}[args.dtype]
    accelerator = Accelerator(
        **parallelism_options(args, dp),  # --dp-shard/--tp: FSDP2 x TP (GPUs only); none: DDP
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
        raise harness.ConfigError(f"accelerate formed a world of {world_size} process(es) but the launcher started "
                                  f"{env.world_size}: check the accelerate config and launch command")
    backend = dist.get_backend() if world_size > 1 else "none"
    hostnames = harness.all_hostnames(world_size)
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    if is_rank0:
        print(f"[{RECIPE}] world_size={world_size} backend={backend} device={device.type} "
              f"distributed_type={accelerator.distributed_type.value} mixed_precision={mixed_precision} "
              f"grad_accum={args.grad_accum} launcher={env.launcher} hosts={','.join(hostnames)}", flush=True)

    # ---- model and optimizer: same seed on every rank, wrapped by accelerate (DDP when world > 1; FSDP2 x TP
    # with --dp-shard/--tp: transformers cuts the model over the TP mesh as it loads, accelerate shards the rest)
    torch.manual_seed(args.seed)
    mesh = accelerator.torch_device_mesh if accelerator.parallelism_config else None
    raw_model = spec.build(tp_plan="auto", device_mesh=mesh["tp"]) if args.tp > 1 else spec.build()
    optimizer = harness.torch_optimizer(raw_model.parameters(), args.optimizer, args.lr)
    model, optimizer = accelerator.prepare(raw_model, optimizer)
    sharded = accelerator.distributed_type == DistributedType.FSDP  # fsdp.yaml or --dp-shard, GPU only
    # this rank's rows of a step: the FSDP coordinate (the TP ranks of a shard take the same rows)
    dp_rank = mesh.get_local_rank("dp_shard") if mesh is not None and "dp_shard" in mesh.mesh_dim_names else \
        (0 if mesh is not None else accelerator.process_index)
    if sharded and args.export_hf:  # (rank 0 holds a shard only; the gather is not written yet)
        raise harness.ConfigError("--export-hf with accelerate's FSDP is not supported yet: export from the DDP "
                                  "run (recipes/accelerate/multi_gpu.yaml) or from recipes/ddp/train.py")
    if world_size > 1:
        # Frameworks fall back to no parallelism silently; refuse to "train in parallel" without the wrapper.
        if sharded:
            assert isinstance(model, FSDPModule) or dp == 1, type(model)
        else:
            assert isinstance(model, DDP) and accelerator.distributed_type in (DistributedType.MULTI_CPU,
                                                                                DistributedType.MULTI_GPU)
    masked = harness.masked_data(args)  # instruction data: every trained token of the global batch weighs the same
    harness.faults.inject(RECIPE, FAULTS, parameters=raw_model.parameters(), data_parallel=dp, micro_batches=args.grad_accum,
                          ddp_model=model if isinstance(model, DDP) else None, optimizers=[optimizer],
                          applies={"rank-mean-loss": dp * args.grad_accum > 1 and masked, "mask-ignored": masked})  # (tests)

    start_step, resumed = 0, None  # resumed: the checkpoint's metrics state
    if trainer_state:
        accelerator.load_state(str(resume_from))  # weights, optimizer, RNG of every rank
        start_step, resumed = trainer_state["step"], trainer_state
        if is_rank0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    run_info = {**harness.describe_run(env, backend, device, type(model).__name__, dp=dp, tp=args.tp), "dtype": str(dtype),
                "hostnames": hostnames, "distributed_type": accelerator.distributed_type.value, "grad_accum": args.grad_accum,
                "model": spec.name}
    peak = harness.peak_flops(device, dtype, args.peak_tflops)
    metrics = harness.start_metrics(RECIPE, args, run_info, resumed, logging_rank=is_rank0, devices=world_size,
                                    size=harness.model_size(raw_model), peak=peak)

    def save(step: int) -> None:  # accelerate's save_state: every rank writes its part (RNG included)
        harness.save_sharded_checkpoint(
            # (torch's format: safetensors cannot hold the tied embedding/head and warns that it dropped one)
            args.out_dir / "checkpoints", step, lambda staging: accelerator.save_state(str(staging), safe_serialization=False),
            {**metrics.checkpoint_state(), **must_match}, writes_state=is_rank0, is_rank0=is_rank0,
            barrier=accelerator.wait_for_everyone)
        metrics.write()

    # ---- evaluation (--eval-every): the validation loss, each rank its rows, averaged over the ranks; through
    # the prepared model (its autocast; FSDP gathers the shards in forward)
    validation = harness.validation_data(args)

    def evaluate() -> float:
        model.eval()
        loss = harness.validation_loss(model, validation, args, args.global_batch, dp_rank, dp, device, masked)
        model.train()
        return harness.mean_across_ranks(loss, world_size)

    # ---- training loop: one optimizer step = --grad-accum micro-batches on every rank
    data = harness.training_data(args)  # --data: synthetic or a token file
    run = harness.TrainingRun(RECIPE, args, env.rank, start_step, metrics, harness.average_across_ranks(world_size, device))
    model.train()
    micro_rows = args.global_batch // (dp * args.grad_accum)
    batches = harness.step_batches(data, args, range(start_step + 1, args.max_steps + 1), args.global_batch,
                                   dp_rank, dp, device)  # (--data-workers: read ahead)
    for step, (inputs, targets) in run.steps(batches):  # (harness.phase: named ranges for --profile and Nsight)
        step_loss, norm = torch.zeros((), device=device), None
        lr = run.learning_rate(step)  # --lr-schedule, --warmup-steps
        harness.set_learning_rate(optimizer, lr)
        micro_batches = [slice(micro * micro_rows, (micro + 1) * micro_rows) for micro in range(args.grad_accum)]
        # what each micro-batch's mean loss weighs: 1/M, or (instruction data) its share of the global batch's
        # trained tokens, so that every trained token weighs the same on any layout
        weights = harness.loss_weights([targets[rows] for rows in micro_batches], masked)
        for rows, weight in zip(micro_batches, weights):
            # accumulate(): no gradient all-reduce until the last micro-batch, and the optimizer steps only then
            with accelerator.accumulate(model):
                with harness.phase("forward"):
                    loss = model(inputs[rows].to(device), targets[rows].to(device))
                # backward() divides by --grad-accum, which the weights do already (x M: 1 for a mean of equal
                # micro-batches); the all-reduce averages over the ranks
                with harness.phase("backward"):
                    accelerator.backward(loss * (weight * args.grad_accum))
                with harness.phase("optimizer"):
                    if accelerator.sync_gradients:  # the step's last micro-batch: the gradients are whole
                        norm = accelerator.clip_grad_norm_(model.parameters(),
                                                           args.clip_grad if args.clip_grad > 0 else float("inf"))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() * weight
        # this rank's loss, as a tensor: averaged over the ranks at the next sync (every --log-every steps)
        metrics.log_step(step, step_loss, args.global_batch, lr, grad_norm=norm)
        if run.eval_due(step):
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):
            break
    run.save_last(save)

    # ---- prove from inside the run that the ranks really trained one model together
    # (FSDP, TP: each rank holds different shards by design; the loss parity on GPU is their check)
    spread = None if sharded or mesh is not None else harness.max_difference_across_ranks(
        list(accelerator.unwrap_model(model).parameters()), world_size)
    exit_code = run.finish(metrics, spread)
    if args.export_hf and is_rank0 and exit_code == 0 and run.last_step == args.max_steps:  # (a finished run)
        harness.export_trained_model(accelerator.unwrap_model(model), spec, args.export_hf, RECIPE)
    if world_size > 1:
        del model, optimizer  # they hold the process group: drop them (and accelerate's references) first
        accelerator.free_memory()
        harness.leave_process_group()
    return exit_code


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
