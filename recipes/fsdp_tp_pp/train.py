"""PyTorch-native model parallelism on one DeviceMesh: FSDP2, tensor parallel and pipeline parallel together.

The stack's GPT over a named mesh PP x DP_replicate x DP_shard x TP, composed as torchtitan does: DTensor
tensor parallelism inside each block (whole heads per rank), FSDP2 (``fully_shard``, HSDP when
DP_replicate > 1) per block, and a ``torch.distributed.pipelining`` schedule over stages cut from the
layer list. world = PP x DP_replicate x DP_shard x TP; unset sizes come from the allocation: TP within a
node, FSDP across.

    # one process (the reference every layout is checked against)
    python recipes/fsdp_tp_pp/train.py

    # on this machine (CPU/gloo; on a GPU node the same, NCCL and bf16)
    torchrun --standalone --nproc_per_node=2 recipes/fsdp_tp_pp/train.py --tp 1 --dp-shard 2      # FSDP2
    torchrun --standalone --nproc_per_node=4 recipes/fsdp_tp_pp/train.py --tp 2 --dp-shard 2      # FSDP2 x TP
    torchrun --standalone --nproc_per_node=4 recipes/fsdp_tp_pp/train.py --tp 2 --pp 2            # TP x PP
    torchrun --standalone --nproc_per_node=2 recipes/fsdp_tp_pp/train.py --tp 1 --pp 2 --n-layer 4 \\
        --pp-schedule Interleaved1F1B --pp-virtual 2                                            # interleaved

    # checkpoints written in the background while training goes on (DCP async_save)
    torchrun --standalone --nproc_per_node=2 recipes/fsdp_tp_pp/train.py --tp 1 --dp-shard 2 --async-checkpoint

    # will it fit? one CPU process, no GPU: the per-GPU memory of this layout on 32 ranks, against an A100-40
    python recipes/fsdp_tp_pp/train.py --estimate-memory a100-40 --world 32 --tp 4 --n-layer 48 --n-embd 6144 --n-head 48
    python recipes/fsdp_tp_pp/train.py --estimate-memory a100-40 --world 32 --tp 4 --pp 2 --n-layer 48 --n-embd 6144 --n-head 48

    # Perlmutter (4 A100 per node): 2 nodes = TP 4 x FSDP 2; 8 nodes with a pipeline = TP 4 x PP 2 x FSDP 4
    sbatch slurm/fsdp_tp_pp.sh
    sbatch -N 8 slurm/fsdp_tp_pp.sh --pp 2 --n-layer 24 --n-embd 2048 --n-head 16

Every layout starts from the same weights (the full model is built from --seed on every rank, then each
rank keeps its stages and its shards), and step s is the same global batch: each DP rank trains on its
rows, the pipeline cuts them into --micro-batches. Checkpoints are torch.distributed.checkpoint (DCP)
directories (model, optimizer, RNG; the data position is the step), sharded as trained and loadable in
any other layout (e.g. saved at FSDP 2 x TP 2, resumed at PP 2). Sizes that cannot form the mesh are
refused before any rank starts (--preflight N), one line each.

Your model instead of the GPT (harness/model.py: the contract), with FSDP2 per block and TP from the model's
own plan (a Hugging Face model's base_model_tp_plan; your module's tp_plan and fsdp_units), no pipeline:

    torchrun --standalone --nproc_per_node=4 recipes/fsdp_tp_pp/train.py --model hf:$SCRATCH/models/my-llama \
        --tp 2 --dp-shard 2 --vocab-size 32000 --export-hf $SCRATCH/my-llama-tuned
    torchrun --standalone --nproc_per_node=2 recipes/fsdp_tp_pp/train.py --tp 1 --model hf:DIR --lora-rank 8
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness and the model
import harness  # noqa: E402
import estimate  # noqa: E402  (next to this file: --estimate-memory)
import parallelize  # noqa: E402  (next to this file)
from gpt import GPT, GPTConfig, cross_entropy  # noqa: E402

RECIPE = "fsdp_tp_pp"
# The negative controls the tests can switch on (HPCML_TEST_FAULT, harness/faults.py)
FAULTS = ("whole-model-load", "tp-no-reduce", "grad-sum", "no-grad-allreduce", "pp-loss-unscaled", "rank-mean-loss", "mask-ignored",
          "resume-fresh-optimizer")
SCHEDULE = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B, "GPipe": ScheduleGPipe}
DCP_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keyed by parameter name: reshardable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("--tp", type=harness.tp_size, default=None,
                   help="tensor-parallel ranks, or node: the ranks of a node (default: those, where the model splits into them)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks that each hold a block of layers)")
    p.add_argument("--dp-replicate", type=int, default=1, help="replicas of the sharded model (HSDP; default 1: FSDP)")
    p.add_argument("--dp-shard", type=int, default=None, help="FSDP2 shards (default: what is left of the world)")
    p.add_argument("--pp-schedule", choices=parallelize.SCHEDULES, default="1F1B")
    p.add_argument("--pp-virtual", type=int, default=1, help="stages per PP rank (Interleaved1F1B: 2 or more)")
    p.add_argument("--micro-batches", type=int, default=None, help="per DP rank and step (default: 2 x PP)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, summed over the DP ranks")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="sgd: plain SGD, which a wrong gradient scale cannot hide from (the parity tests use it)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="auto: bf16 on GPU")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (GPU speed; slow to start)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background (DCP async_save): training waits only for the copy "
                        "of the state to CPU memory; published once written")
    harness.memory.add_options(p)
    harness.add_schedule_options(p)
    return harness.parse_recipe_args(p, RECIPE, argv, model_options=GPTConfig.add_arguments, lora=True, loss_masks=True)


def validate(args: argparse.Namespace, world_size: int, spec: harness.ModelSpec) -> parallelize.Layout:
    harness.validate_run(args, world_size)
    harness.check_model_vocabulary(spec, args.vocab_size)
    harness.check_export_option(args, spec)
    harness.require_positive(args, "lr")
    layout = parallelize.choose_layout(args, world_size, spec)
    if layout.pp > 1 and harness.masked_data(args):  # (the schedule averages its micro-batches' losses itself)
        raise harness.ConfigError(f"--data {args.data} is instruction data, which a pipeline (--pp {layout.pp}) does not "
                                  "weigh by trained tokens yet: train it with --pp 1 (FSDP2, TP, HSDP), or recipes/ddp")
    return layout


def state_dicts(stages: list, optimizers: list) -> list[dict]:
    """Each local stage's model and optimizer state, keyed by global parameter names (DCP reshards them)."""
    return [{**{f"model.{k}": v for k, v in get_model_state_dict(stage).items()},
             **{f"optim.{k}": v for k, v in get_optimizer_state_dict(stage, optimizer, options=DCP_OPTIONS).items()}}
            for stage, optimizer in zip(stages, optimizers)]


def load_dcp(path: Path, stages: list, optimizers: list) -> None:
    for optimizer in optimizers:  # AdamW has no state before its first step: make room for the saved one
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
    per_stage = state_dicts(stages, optimizers)
    # (DCP loads into these tensors in place, and they are the optimizer's own state tensors)
    merged = {"rng": torch.get_rng_state()} | {k: v for d in per_stage for k, v in d.items()}
    with one_process_dcp():
        dcp.load(merged, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    torch.set_rng_state(merged["rng"])
    for stage, optimizer, own in zip(stages, optimizers, per_stage):
        set_model_state_dict(stage, {k[6:]: merged[k] for k in own if k.startswith("model.")})
        set_optimizer_state_dict(stage, optimizer, {k[6:]: merged[k] for k in own if k.startswith("optim.")},
                                 options=DCP_OPTIONS)


@contextlib.contextmanager
def one_process_dcp():
    """DCP in one process (no_dist): torch warns that it assumes one process even when no_dist asks for exactly
    that; nothing to act on, so not in the log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        yield


def save_dcp(state: dict, path: Path, world_size: int, background=None):
    """The DCP checkpoint of ``state`` in ``path``; ``background``: (the process group of) a write in the
    background, which returns the future of the write (async_save copies the state to CPU memory first)."""
    with one_process_dcp():
        if background is None:
            dcp.save(state, checkpoint_id=str(path), no_dist=world_size == 1)
            return None
        return dcp.async_save(state, checkpoint_id=str(path), no_dist=world_size == 1,
                              process_group=background if world_size > 1 else None)


def build_stages(args: argparse.Namespace, spec: harness.ModelSpec, layout: parallelize.Layout, mesh, pp_rank: int,
                 device: torch.device, dtype: torch.dtype, read_weights: bool = True):
    """This rank's part of the model, parallelised, and its optimizers: (model size, [(stage index, module)],
    the stage modules, their TP plans, their optimizers). The full model is built from --seed on every rank;
    this rank keeps its stages, then TP cuts them, then FSDP2 shards them. A Hugging Face model is built
    empty (on the meta device), cut and sharded so, and only then does each rank read its own part of the
    weights from the files (harness/hf_model.py load_weights): no rank holds the whole model. (The memory
    estimate on fake tensors reads no weights: ``read_weights`` False; the model's config.json is all it needs.)"""
    torch.manual_seed(args.seed)
    # (the test's negative control, whole-model-load: every rank loads the whole model first, as before)
    sharded_load = spec.build_empty is not None and not harness.faults.active("whole-model-load")
    full = spec.build_empty() if sharded_load else spec.build()
    size = harness.model_size(full)
    # [(stage index, module)]: the GPT's stages of this PP rank; your model is one stage (no pipeline)
    local = parallelize.local_stages(full, layout, pp_rank) if spec.name == "gpt" else [(0, full)]
    stages = [stage if device.type == "cpu" or sharded_load else stage.to(device) for _, stage in local]
    del full  # (fake tensors: no .to; the empty model goes to the device as its shards, below)
    plans = [parallelize.tensor_parallel_plan(stage) if layout.tp > 1 else {} for stage in stages]
    for stage, plan in zip(stages, plans):
        if layout.tp > 1:
            parallelize.apply_tensor_parallel(stage, mesh["tp"], plan)
        units = parallelize.fsdp_units(stage)  # the blocks (decoder layers)
        for block in units:
            if args.activation_checkpointing:
                forward = block.forward
                block.forward = lambda *inputs, forward=forward, **options: torch.utils.checkpoint.checkpoint(
                    forward, *inputs, use_reentrant=False, **options)
            if args.compile:
                block.compile()
        if layout.fsdp:
            dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
            parallelize.apply_fsdp(stage, units, dp_mesh, dtype if dtype != torch.float32 else None)
        if sharded_load:
            stage.to_empty(device=device)
            if read_weights:
                spec.load_weights(stage)
    make_optimizer = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.0),
                      "sgd": lambda ps: torch.optim.SGD(ps, lr=args.lr)}[args.optimizer]
    optimizers = [make_optimizer([p for p in stage.parameters() if p.requires_grad]) for stage in stages]
    return size, local, stages, plans, optimizers


def build_schedule(args: argparse.Namespace, layout: parallelize.Layout, local, stages, mesh, device):
    """The pipeline: this rank's stages, and the schedule that runs the micro-batches through them."""
    pipeline = [PipelineStage(stage, index, layout.stages, device, group=mesh["pp"].get_group())
                for (index, _), stage in zip(local, stages)]
    return SCHEDULE[args.pp_schedule](
        pipeline if layout.virtual > 1 else pipeline[0], n_microbatches=layout.micro_batches,
        loss_fn=cross_entropy, scale_grads=True)  # scale: the micro-batches' mean


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_cfg = GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd, tie_embeddings=False)
    # the stack's GPT, or --model hf:DIR (a Hugging Face model) or MODULE:FACTORY (yours): harness/model.py
    spec = harness.model_spec(args, gpt=GPT, gpt_config=model_cfg)
    is_gpt = spec.name == "gpt"
    if args.estimate_memory:  # will it fit: the memory of a layout, without its GPUs
        return estimate.estimate_memory(args, spec, validate=validate, build_stages=build_stages, build_schedule=build_schedule)
    must_match = {**spec.identity, "global_batch": args.global_batch,  # any layout may resume
                  **harness.schedule_identity(args)}
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank
        layout = validate(args, args.preflight, spec)
        resume_from, _ = harness.resume_dir(args, must_match)
        return harness.preflight_line(RECIPE, args, " x ".join(f"{k} {v}" for k, v in layout.mesh_shape().items())
                                      + f" = {args.preflight} ranks, {layout.micro_batches} micro-batches", resume_from,
                                      layout=layout.mesh_shape())
    env = harness.detect_dist_env()
    layout = validate(args, env.world_size, spec)
    harness.check_expected_world_size(env.world_size)
    resume_from, trainer_state = harness.resume_dir(args, must_match)

    # ---- rank, device, backend, mesh
    device, backend = harness.setup_torch_distributed(env, args.timeout_s)
    mesh = parallelize.build_mesh(layout, device)
    coordinate = {name: mesh.get_local_rank(name) if mesh else 0 for name in layout.mesh_shape()}
    dp_rank = coordinate["dp_replicate"] * layout.dp_shard + coordinate["dp_shard"]
    hostnames = harness.all_hostnames(env.world_size)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" or (args.dtype == "auto" and on_gpu) else torch.float32
    if env.rank == 0:
        print(f"[{RECIPE}] world_size={env.world_size} backend={backend} device={device.type} mesh="
              f"{'x'.join(f'{k}{v}' for k, v in layout.mesh_shape().items())} schedule={args.pp_schedule} "
              f"micro-batches={layout.micro_batches} dtype={dtype} launcher={env.launcher} hosts={','.join(hostnames)}",
              flush=True)

    # ---- model: the full model from the seed on every rank; this rank keeps its stages, then TP, then FSDP2
    # (a Hugging Face model: built empty, cut and sharded, then each rank reads its part of the weights)
    host_memory = harness.HostMemory()  # (each rank's peak host memory while it loads, steps and exports)
    with host_memory.phase("load"):
        size, local, stages, plans, optimizers = build_stages(args, spec, layout, mesh, coordinate["pp"], device, dtype)
    # Frameworks fall back to no parallelism silently: check every parameter's DTensor mesh and placements.
    placements = parallelize.placements(stages, layout, plans)
    if mesh is not None:
        assert tuple(mesh.shape) == tuple(layout.mesh_shape().values()) and dist.get_world_size() == env.world_size
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32 and not layout.fsdp)

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One batch's loss without a pipeline: the GPT's logits against the targets; your model's own."""
        return cross_entropy(stages[0](inputs), targets) if is_gpt else stages[0](inputs, targets)

    # the pipeline: this rank's stages, the schedule that runs the micro-batches through them
    schedule = build_schedule(args, layout, local, stages, mesh, device) if layout.pp > 1 else None
    has_first, has_last = (stages[0].is_first, stages[-1].is_last) if is_gpt else (True, True)
    masked = harness.masked_data(args)  # instruction data: every trained token of the global batch weighs the same
    harness.faults.inject(RECIPE, FAULTS, optimizers=optimizers, schedule=schedule,  # (tests only: their controls)
                          fsdp_modules=[m for stage in stages for m in stage.modules() if isinstance(m, FSDPModule)],
                          applies={"tp-no-reduce": layout.tp > 1, "grad-sum": layout.fsdp, "no-grad-allreduce": layout.fsdp,
                                   "pp-loss-unscaled": layout.pp > 1 and layout.micro_batches > 1,
                                   "rank-mean-loss": layout.dp > 1 and masked, "mask-ignored": masked,
                                   "whole-model-load": spec.load_weights is not None})

    checkpoint_dir = args.out_dir / "checkpoints"
    start_step, resumed = 0, None  # resumed: the checkpoint's metrics state
    if trainer_state:
        with host_memory.phase("resume"):
            load_dcp(resume_from, stages, optimizers)
        start_step, resumed = trainer_state["step"], trainer_state
        if env.rank == 0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step}, written with "
                  f"{trainer_state['layout']})", flush=True)

    run_info = {**harness.describe_run(env, backend, device, layout.wrapper(args.pp_schedule), **asdict(layout)),
                "model": spec.name,
                "mesh": layout.mesh_shape(), "schedule": args.pp_schedule if layout.pp > 1 else None,
                "placements": gather_placements(placements, env.world_size), "dtype": str(dtype), "hostnames": hostnames}
    metrics = harness.start_metrics(RECIPE, args, run_info, resumed, logging_rank=env.rank == 0,
                                    devices=env.world_size, size=size, peak=harness.peak_flops(device, dtype, args.peak_tflops))

    # --async-checkpoint: the background writes talk over a process group of their own (gloo: the state is
    # in CPU memory by then), never interleaving with the training's collectives on the default group.
    background = (dist.new_group(backend="gloo") if env.world_size > 1 else True) if args.async_checkpoint else None
    checkpoints = harness.ShardedCheckpoints(  # published: then (not before) metrics.json and the trackers count it
        checkpoint_dir, writes_state=env.rank == 0, is_rank0=env.rank == 0,
        barrier=dist.barrier if env.world_size > 1 else lambda: None,
        published=lambda step: metrics.write(checkpointed=step))

    def save(step: int) -> None:  # every rank writes its shards of its stages
        state = {"rng": torch.get_rng_state()} | {k: v for d in state_dicts(stages, optimizers) for k, v in d.items()}
        checkpoints.save(step, lambda staging: save_dcp(state, staging, env.world_size, background),
                         {**metrics.checkpoint_state(), **must_match, "layout": asdict(layout)})

    # ---- evaluation (--eval-every): the validation loss, each DP rank its rows (the pipeline: forward only,
    # the schedule's eval), averaged as the training loss is
    validation = harness.validation_data(args)

    @torch.no_grad()
    def evaluate() -> float:
        for stage in stages:
            stage.eval()
        total = torch.zeros((), device=device)
        for batch in range(args.eval_batches):
            inputs, targets = (t.to(device) for t in validation.local_batch(batch, args.global_batch, dp_rank, layout.dp))
            with autocast:
                if schedule is None:  # (instruction data: weighed as in training, harness.loss_weights)
                    total += loss_of(inputs, targets).float() * harness.loss_weights([targets], masked)[0]
                else:
                    losses = []
                    schedule.eval(*([inputs] if has_first else []), target=targets if has_last else None,
                                  losses=losses if has_last else None, return_outputs=False)  # (only the losses)
                    total += torch.stack(losses).float().mean() if has_last else 0.0
        for stage in stages:
            stage.train()
        return harness.mean_across_ranks(total / args.eval_batches, env.world_size) * layout.pp

    # ---- training loop: every DP rank its rows of the step's batch; TP and PP ranks of a replica the same
    data = harness.training_data(args)  # --data: synthetic or a token file
    run = harness.TrainingRun(RECIPE, args, env.rank, start_step, metrics, harness.average_across_ranks(env.world_size, device),
                              host_memory=host_memory)
    for stage in stages:
        stage.train()
    batches = harness.step_batches(data, args, range(start_step + 1, args.max_steps + 1), args.global_batch, dp_rank,
                                   layout.dp, device)  # (--data-workers: read ahead)
    for step, (inputs, targets) in run.steps(batches):  # (harness.phase: named ranges for --profile and Nsight)
        with autocast:
            if schedule is None:
                with harness.phase("forward"):
                    # (instruction data: weighed by its share of the global batch's trained tokens; else x 1)
                    loss = loss_of(inputs, targets) * harness.loss_weights([targets], masked)[0]
                with harness.phase("backward"):
                    loss.backward()  # TP's all-reduces and FSDP2's reduce-scatters run inside backward
            else:
                losses = []
                with harness.phase("pipeline-step"):  # the schedule's forwards, backwards and p2p, interleaved
                    schedule.step(*([inputs] if has_first else []), target=targets if has_last else None,
                                  losses=losses if has_last else None, return_outputs=False)  # (only the losses)
                loss = torch.stack(losses).mean() if has_last else torch.zeros((), device=device)
        with harness.phase("optimizer"):
            norm = parallelize.grad_norm(stages, mesh["pp"].get_group() if layout.pp > 1 else None)
            parallelize.clip_gradients(stages, norm, args.clip_grad)  # --clip-grad
            lr = run.learning_rate(step)  # --lr-schedule, --warmup-steps
            for optimizer in optimizers:
                harness.set_learning_rate(optimizer, lr)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        # The loss lives on the last stage, the same on each of its TP ranks: x PP, its mean over all ranks is
        # the mean over the DP ranks (taken at the next sync, every --log-every steps)
        metrics.log_step(step, loss.detach().float() * layout.pp, args.global_batch, lr, grad_norm=norm)
        if run.eval_due(step):
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):
            break
    run.save_last(save)
    checkpoints.wait()  # (a checkpoint still written in the background: published before the run ends)

    # ---- prove from inside the run that the copies that must agree do: the full parameters of a stage
    # are the same on every rank that holds that stage (replicas over DP_replicate, TP's replicated ones)
    with host_memory.phase("check"):
        spread = stage_spread(stages, mesh, layout, coordinate["pp"])
    if args.export_hf and not spread and run.last_step == args.max_steps:  # (a finished run whose ranks agree)
        # tensor by tensor: every rank gathers each one (FSDP2's all-gathers, TP's), the rank whose file holds
        # it writes it; no rank holds the whole model
        with host_memory.phase("export"):
            harness.export_sharded_model(stages[0], spec, args.export_hf, RECIPE, rank=env.rank, world_size=env.world_size,
                                         barrier=dist.barrier if env.world_size > 1 else lambda: None)
    exit_code = run.finish(metrics, spread, differ="parameters differ across the ranks of a stage",
                           extra={"async_checkpoint": args.async_checkpoint, "checkpoint_blocking_s": checkpoints.blocking_s,
                                  "host_memory": harness.gather_from_ranks(host_memory.record(), env.world_size)})
    if env.world_size > 1:
        del schedule, local, stages, optimizers, mesh  # they hold the process groups: drop them before leaving
        harness.leave_process_group()
    return exit_code


def gather_placements(local: dict[str, str], world_size: int) -> dict[str, str]:
    """Every stage's parameter placements (each PP rank knows only its own), for metrics.json."""
    if world_size == 1:
        return local
    everyone: list[dict | None] = [None] * world_size
    dist.all_gather_object(everyone, local)
    return {name: text for part in everyone for name, text in sorted(part.items())}


def stage_spread(stages: list, mesh, layout: parallelize.Layout, pp_rank: int) -> float:
    """Largest difference of a full parameter between two ranks of the same pipeline stage (0.0: in sync).
    A parameter at a time: all of them gathered at once would be the whole model on every rank (measured: a
    1.7 GB Llama's job on 2 ranks was killed by its memory limit here, after training)."""
    if mesh is None:
        return 0.0
    from torch.distributed.tensor import DTensor

    groups = [dist.new_group(mesh.mesh[p].flatten().tolist()) for p in range(layout.pp)]  # every rank makes all
    # (gathering FSDP2 x TP's strided shards takes two all-gathers, which DTensor warns about: fine, once)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    spread = 0.0
    for stage in stages:
        for param in stage.parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            spread = max(spread, harness.max_difference_across_ranks([full], layout.dp * layout.tp, group=groups[pp_rank]))
    return spread


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
