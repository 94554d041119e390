"""Megatron-core GPT with tensor (TP), pipeline (PP) and data (DP) parallelism: world = TP x PP x DP.

TP splits every layer's matmuls across the GPUs of a node (it all-reduces activations twice per layer:
it needs NVLink); PP gives each node a contiguous block of layers and passes activations between nodes
(one send per micro-batch: Slingshot is fine); DP replicates that TP x PP model and averages gradients.
Everything below is megatron-core's own: parallel_state, GPTModel, the pipeline schedule, its DDP wrapper,
its optimizer and its distributed checkpoints.

    # one process: the reference every layout is checked against
    python recipes/megatron_tp_pp/train.py

    # TP=2 x PP=2 on 4 processes (CPU/gloo here; on a GPU node: 4 GPUs, NCCL, bf16)
    torchrun --standalone --nproc_per_node=4 recipes/megatron_tp_pp/train.py --tp 2 --pp 2

    # under Slurm, one srun task per rank; on Perlmutter 2 nodes x 4 A100: TP=4 in a node, PP=2 across
    srun -N 2 --ntasks-per-node=4 python recipes/megatron_tp_pp/train.py --tp 4 --pp 2
    sbatch slurm/megatron_tp_pp.sh --tp 4 --pp 2 --num-layers 24 --hidden-size 2048 --num-heads 16
    sbatch slurm/megatron_tp_pp.sh --tp 4 --pp 2 --async-checkpoint      # checkpoints written in the background

Without a CUDA device the recipe loads cpu_placement_shim.py (next to this file; it says so in the log):
megatron-core has no CPU path, and the shim only moves its tensors to the CPU. GPU runs never load it.

Every layout starts from the same weights: each parameter is generated from its global name at full
shape and the rank keeps its own TP/PP piece, so any layout is comparable with one process. Checkpoints
are megatron distributed checkpoints in OUT_DIR/checkpoints/step_N; a rerun with the same --out-dir
resumes; SIGUSR1/SIGTERM checkpoint and stop. Options that cannot form a valid layout are refused before
any rank starts (--preflight WORLD_SIZE, which slurm/lib/launch.sh runs), each with one line.

--data PREFIX (a token file of recipes/data/prepare.py, or Megatron-LM's preprocessing output with a
sidecar) goes through megatron-core's GPTDataset, as in Megatron-LM (megatron_data.py):

    torchrun --standalone --nproc_per_node=2 recipes/megatron_tp_pp/train.py --data data/stdlib/tokens --eval-every 10
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
import zlib
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the harness
import harness  # noqa: E402
from layout import Layout, have_transformer_engine, model_settings, validate  # noqa: E402  (next to this file)
import megatron_data  # noqa: E402  (next to this file)

RECIPE = "megatron_tp_pp"
# The negative controls the tests can switch on (HPCML_TEST_FAULT, harness/faults.py)
FAULTS = ("tp-no-reduce", "grad-sum", "no-grad-allreduce", "accum-sum", "resume-fresh-optimizer", "batch-p2p-with-vp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("--tp", type=harness.tp_size, default=1,
                   help="tensor-parallel size: ranks that split each layer (within a node), or node: the ranks of a node")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size: ranks that each hold a block of layers")
    p.add_argument("--vp", type=int, default=None,
                   help="virtual pipeline stages per PP rank (interleaved schedule; needs --pp >= 2)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch on each DP rank")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, over all DP ranks")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--tie-embeddings", action="store_true", help="share the input embedding with the output layer")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off; megatron's optimizer clips)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--distributed-optimizer", action="store_true", help="shard the optimizer state over DP (ZeRO-1)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background (megatron's async save: a forked writer process); "
                        "published once written")
    p.add_argument("--batch-p2p-comm", action="store_true",
                   help="batch the pipeline's send/recv pairs (refused with --vp at --pp 2: the messages get swapped)")
    p.add_argument("--layer-spec", choices=["auto", "local", "te"], default="auto",
                   help="auto: Transformer Engine layers on GPU where TE is installed, megatron's torch layers otherwise")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="for the TP placement check (default: from Slurm or torchrun variables)")
    harness.add_optimizer_option(p)
    harness.add_schedule_options(p, clip_grad=False)  # --lr-schedule, --warmup-steps (the rate set every step)
    return harness.parse_recipe_args(p, RECIPE, argv)


def init_weights_by_global_name(model_chunks, seed: int) -> None:
    """Give every parameter the value it has in the one-process model, whatever the layout.

    Each weight is generated at its full (unsplit) shape from a seed derived from its global checkpoint key
    (and its global layer number), and this rank copies in its own TP slice: the same global tensor, cut
    differently. Norm weights start near 1, everything else near 0 with std 0.02.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for chunk in model_chunks:
        for sharded in chunk.sharded_state_dict().values():
            if not isinstance(sharded, ShardedTensor) or not isinstance(sharded.data, torch.nn.Parameter):
                continue
            if sharded.key.endswith("_extra_state"):
                continue
            lead = sharded.prepend_axis_num  # stacked layers: the first offsets are the global layer number
            name = f"{sharded.key}@{sharded.global_offset[:lead]}"
            generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(sharded.global_shape[lead:], generator=generator, dtype=torch.float32) * 0.02
            if "norm" in sharded.key and sharded.key.endswith("weight"):
                full += 1.0
            piece = full[tuple(slice(off, off + size) for off, size in
                               zip(sharded.global_offset[lead:], sharded.local_shape))]
            with torch.no_grad():
                sharded.data.copy_(piece.to(sharded.data.device, sharded.data.dtype))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # to resume a checkpoint (in any layout: megatron reshards)
    must_match = {"model": model_settings(args), "optimizer_name": args.optimizer, **harness.schedule_identity(args)}
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank (no megatron import: seconds)
        layout = validate(args, args.preflight)
        resume_from, _ = harness.resume_dir(args, must_match)
        return harness.preflight_line(RECIPE, args, f"TP {layout.tp} x PP {layout.pp} x DP {layout.dp} = {args.preflight} "
                                      f"ranks, {layout.num_microbatches} micro-batches of {layout.micro_batch}"
                                      + (f", VP {layout.vp}" if layout.vp else ""), resume_from,
                                      layout={"tp": layout.tp, "pp": layout.pp, "dp": layout.dp})
    env = harness.detect_dist_env()
    layout = validate(args, env.world_size)
    harness.check_expected_world_size(env.world_size)
    resume_from, trainer_state = harness.resume_dir(args, must_match)
    checkpoint_dir = args.out_dir / "checkpoints"

    # ---- rank, device, backend (gloo on CPU, NCCL on GPU); megatron needs a process group even for one rank
    if layout.tp > 1:  # before CUDA starts: one hardware queue, so that TP's all-reduce of a layer's input
        # gradient goes out before the weight-gradient GEMM it overlaps (as Megatron-LM sets it; warned otherwise)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    device, backend = harness.setup_torch_distributed(env, args.timeout_s, always_group=True)
    # Without Transformer Engine/apex megatron warns at import, once per module: the log line below says it.
    warnings.filterwarnings("ignore", r"(Transformer Engine and )?Apex (is|are) not installed", UserWarning)
    warnings.filterwarnings("ignore", "full scope is deprecated", UserWarning)
    # megatron-core's checkpoint loader still calls torch's deprecated APIs: notes for its developers, on every
    # resume, with nothing a user can change.
    warnings.filterwarnings("ignore", r"`load_state_dict` is deprecated", FutureWarning)
    warnings.filterwarnings("ignore", "Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning)
    if device.type == "cpu":
        import cpu_placement_shim  # recipes/megatron_tp_pp/: megatron-core has no CPU path of its own
        cpu_placement_shim.enable()
    # Imported here, not at the top: megatron takes ~10 s to import, and --preflight must answer in seconds.
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core import __version__ as megatron_version
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                         get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
        distributed_timeout_minutes=max(1, int(args.timeout_s // 60)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    # Frameworks fall back to no parallelism silently: check from inside what megatron built.
    assert parallel_state.get_tensor_model_parallel_world_size() == layout.tp
    assert parallel_state.get_pipeline_model_parallel_world_size() == layout.pp
    assert parallel_state.get_data_parallel_world_size() == layout.dp
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    # The loss lives on the last pipeline stage: its first TP rank of the first DP replica logs.
    is_logging_rank = pp_rank == layout.pp - 1 and tp_rank == 0 and dp_rank == 0
    hostnames = harness.all_hostnames(env.world_size)
    dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda") else torch.float32
    if env.rank == 0:
        print(f"[{RECIPE}] world_size={env.world_size} backend={backend} device={device.type} "
              f"TP={layout.tp} PP={layout.pp} DP={layout.dp} VP={layout.vp} micro-batches={layout.num_microbatches}x"
              f"{layout.micro_batch} dtype={dtype} megatron-core={megatron_version} launcher={env.launcher} "
              f"hosts={','.join(hostnames)}", flush=True)
        if device.type == "cpu":
            print(f"[{RECIPE}] no CUDA device: megatron-core runs on CPU through cpu_placement_shim "
                  "(placement only; GPU runs never load it)", flush=True)

    # ---- model: megatron's GPT, local (non-Transformer-Engine) layers; fused kernels off (no CPU versions)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp, pipeline_dtype=dtype, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu", batch_p2p_comm=args.batch_p2p_comm,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    # Transformer Engine's layers (fused kernels, FP8-ready) where it is installed (NGC images, GPU);
    # megatron's own torch layers otherwise.
    use_te = args.layer_spec == "te" or (args.layer_spec == "auto" and device.type == "cuda" and have_transformer_engine())
    layer_spec = get_gpt_layer_with_transformer_engine_spec() if use_te else get_gpt_layer_local_spec()
    if env.rank == 0:
        print(f"[{RECIPE}] layers: {'Transformer Engine' if use_te else 'local (megatron-core torch layers)'} spec", flush=True)
    model_chunks = []
    for chunk_index in range(layout.vp or 1):
        vp_stage = chunk_index if layout.vp else None
        chunk = GPTModel(
            config=config, transformer_layer_spec=layer_spec, vocab_size=args.vocab_size,
            max_sequence_length=args.seq_len, position_embedding_type="rope",
            share_embeddings_and_output_weights=args.tie_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        ).to(device)
        model_chunks.append(chunk)
    init_weights_by_global_name(model_chunks, args.seed)
    n_params = count_global_parameters(model_chunks, layout, args.tie_embeddings, device)
    flops_per_token = harness.transformer_flops_per_token(n_params, args.num_layers, args.hidden_size, args.seq_len)

    if dtype == torch.bfloat16:
        # As Megatron-LM does: every parameter in bf16 (the local spec's torch LayerNorm ignores params_dtype and
        # stays fp32, which CUDA's layer norm refuses next to bf16 activations, and which throws the mixed-precision
        # optimizer's checkpoint mapping off), the logits back in fp32 for the loss.
        model_chunks = [Float16Module(config, chunk) for chunk in model_chunks]
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.distributed_optimizer)
    model_chunks = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)  # as Megatron-LM does
        for index, chunk in enumerate(model_chunks)
    ]
    assert all(isinstance(chunk, DistributedDataParallel) for chunk in model_chunks)
    # The schedule calls these: no gradient sync between micro-batches, then the DP (and tied-embedding) reductions.
    config.no_sync_func = [chunk.no_sync for chunk in model_chunks]
    config.finalize_model_grads_func = finalize_model_grads
    if len(model_chunks) == 1:
        config.no_sync_func = config.no_sync_func[0]
    # --optimizer adamw: megatron's Adam with no weight decay (AdamW); sgd: plain SGD, no momentum.
    optimizer_choice = (dict(optimizer="adam", adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8) if args.optimizer == "adamw"
                        else dict(optimizer="sgd", sgd_momentum=0.0))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(**optimizer_choice, lr=args.lr, weight_decay=0.0, clip_grad=args.clip_grad,
                        bf16=dtype == torch.bfloat16, params_dtype=dtype,
                        use_distributed_optimizer=args.distributed_optimizer),
        model_chunks,
    )

    def sharded_state(is_loading: bool) -> dict:
        # One entry per model chunk, as Megatron-LM lays it out; the optimizer maps its state onto them.
        # (the GPT models under the DDP wrappers: the keys carry no "module." prefix)
        state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}
        if args.optimizer == "sgd":  # plain SGD keeps no state (and megatron cannot load SGD's: no init_state_fn)
            return state
        # The distributed optimizer's state in the canonical per-parameter form: resumable in any layout.
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return state

    harness.faults.inject(RECIPE, FAULTS, parameters=[p for chunk in model_chunks for p in chunk.parameters()],
                          data_parallel=layout.dp, micro_batches=layout.num_microbatches, megatron_chunks=model_chunks,
                          optimizers=[optimizer], applies={"tp-no-reduce": layout.tp > 1})  # (tests only: their controls)
    start_step, resumed = 0, None  # resumed: the checkpoint's metrics state
    if trainer_state:
        try:  # megatron reshards on load: a checkpoint of another TP/PP/DP layout loads too
            loaded = dist_checkpointing.load(sharded_state(is_loading=True), str(resume_from))
        except Exception as error:  # its errors are deep and long; say which checkpoint and what to do
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise harness.ConfigError(f"cannot load {resume_from}: {first_line[:300]}; "
                                     "move it away, use a new --out-dir, or --no-resume") from error
        for i, chunk in enumerate(model_chunks):
            chunk.module.load_state_dict(loaded[f"model{i}"])
        if "optimizer" in loaded:
            optimizer.load_state_dict(loaded["optimizer"])
        start_step, resumed = trainer_state["step"], trainer_state
        if env.rank == 0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    layout_info = asdict(layout)
    run_info = {**harness.describe_run(env, backend, device, type(model_chunks[0]).__name__, **layout_info),
                "megatron_core_version": megatron_version, "optimizer": type(optimizer).__name__,
                "optimizers": [type(inner).__name__ for inner in getattr(optimizer, "chained_optimizers", [optimizer])],
                "dtype": str(dtype),
                "parameter_dtypes": sorted({str(p.dtype) for chunk in model_chunks for p in chunk.parameters()}),
                "layer_spec": "transformer_engine" if use_te else "local", "cpu_placement_shim": device.type == "cpu",
                "hostnames": hostnames}
    metrics = harness.start_metrics(RECIPE, args, run_info, resumed, logging_rank=is_logging_rank,
                                    devices=env.world_size, size=(n_params, flops_per_token),
                                    peak=harness.peak_flops(device, dtype, args.peak_tflops))

    checkpoints = harness.ShardedCheckpoints(  # published: then (not before) metrics.json and the trackers count it
        checkpoint_dir, writes_state=is_logging_rank, is_rank0=env.rank == 0, barrier=dist.barrier,
        published=lambda step: metrics.write(checkpointed=step))
    # --async-checkpoint: megatron's own async save; its queue forks the writer and finalizes the checkpoint
    # (metadata.json, a barrier) when the next save starts or the run ends.
    async_queue = AsyncCallsQueue() if args.async_checkpoint else None

    def write_shards(staging: Path):
        request = dist_checkpointing.save(sharded_state(is_loading=False), str(staging),
                                          async_sharded_save=async_queue is not None)
        if request is None:
            return None
        async_queue.schedule_async_request(request)
        return MegatronAsyncSave(async_queue)

    def save(step: int) -> None:  # every rank writes its shards; the loss history is on the logging rank
        checkpoints.save(step, write_shards, {**metrics.checkpoint_state(), **must_match, "layout": layout_info})

    # ---- data: every DP rank takes its rows of the step's global batch, cut into micro-batches; all TP
    # and PP ranks of a replica read the same rows (stage 0 uses the tokens, the last stage the labels).
    # --data PREFIX: megatron's GPTDataset (megatron_data.py); synthetic: the harness's task.
    data, validation = megatron_data.data(args, args.out_dir / "megatron_data_cache")
    # megatron's own attention needs the causal mask spelled out (True = masked); Transformer Engine's
    # applies its causal mask type itself and takes none.
    causal_mask = None if use_te else torch.triu(
        torch.ones(1, 1, args.seq_len, args.seq_len, dtype=torch.bool, device=device), diagonal=1)
    position_ids = torch.arange(args.seq_len, device=device).unsqueeze(0)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, position_ids, causal_mask, labels=labels)  # last stage: per-token losses

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            # The schedule divides the returned loss in place by the micro-batch count: report a copy.
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    dp_group = parallel_state.get_data_parallel_group()

    def run_schedule(inputs: torch.Tensor, targets: torch.Tensor, forward_only: bool) -> torch.Tensor:
        """This DP rank's rows of a global batch in micro-batches through the schedule. On the last stage its mean
        loss over the micro-batches x PP, 0 elsewhere: the mean of that over all ranks is the global batch's loss
        (the last stage's TP ranks hold the same), taken at the run's next sync, not after every step."""
        micro = [(inputs[i:i + layout.micro_batch].to(device), targets[i:i + layout.micro_batch].to(device))
                 for i in range(0, len(inputs), layout.micro_batch)]
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(micro) for _ in model_chunks] if layout.vp else iter(micro),
            model=model_chunks if layout.vp else model_chunks[0],
            num_microbatches=layout.num_microbatches, seq_length=args.seq_len,
            micro_batch_size=layout.micro_batch, forward_only=forward_only,
        )
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return torch.stack([item["loss"] for item in losses]).mean() * layout.pp
        return torch.zeros((), device=device)

    # ---- evaluation (--eval-every): the validation loss, forward only, averaged over DP (from the last stage)
    @torch.no_grad()
    def evaluate() -> float:
        for chunk in model_chunks:
            chunk.eval()
        loss = sum(run_schedule(*validation.local_batch(batch, args.global_batch, dp_rank, layout.dp), forward_only=True)
                   for batch in range(args.eval_batches))
        for chunk in model_chunks:
            chunk.train()
        return harness.mean_across_ranks(loss, env.world_size) / args.eval_batches

    # ---- training loop: one optimizer step = the schedule's forward/backward over all micro-batches
    run = harness.TrainingRun(RECIPE, args, env.rank, start_step, metrics, harness.average_across_ranks(env.world_size, device))
    for chunk in model_chunks:
        chunk.train()
    batches = harness.step_batches(data, args, range(start_step + 1, args.max_steps + 1), args.global_batch, dp_rank,
                                   layout.dp, device)  # (--data-workers: read ahead)
    for step, (inputs, targets) in run.steps(batches):  # (harness.phase: named ranges for --profile and Nsight)
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        harness.set_learning_rate(optimizer, run.learning_rate(step))  # --lr-schedule, --warmup-steps
        with harness.phase("forward-backward"):  # megatron's schedule: every micro-batch, its p2p and grad sync
            step_loss = run_schedule(inputs, targets, forward_only=False)
        with harness.phase("optimizer"):
            update_successful, grad_norm, _ = optimizer.step()
        if not update_successful:
            raise RuntimeError(f"step {step}: the optimizer skipped the update (grad norm {grad_norm})")
        if not grad_norm:  # megatron computes the global norm only to clip: the norm of the gradients applied
            grad_norm = optimizer.get_grad_norm()
        # this rank's share of the loss, as a tensor: averaged over the ranks at the next sync (every --log-every
        # steps); megatron's optimizer has the norm on the host already
        metrics.log_step(step, step_loss.detach(), args.global_batch, optimizer.param_groups[0]["lr"],
                         grad_norm=float(grad_norm))
        if run.eval_due(step):
            metrics.log_eval(step, evaluate(), args.eval_batches)
        if run.step_done(step, save):
            break
    run.save_last(save)
    checkpoints.wait()  # (a checkpoint still written in the background: published before the run ends)
    if async_queue is not None:
        async_queue.close()

    # ---- prove from inside the run that the replicas trained one model: DP replicas (and, for what TP
    # does not split, the TP ranks) must hold identical parameters
    spread = max(
        harness.max_difference_across_ranks([p.data for chunk in model_chunks for p in chunk.parameters()],
                                           layout.dp, group=dp_group),
        harness.max_difference_across_ranks(
            [p.data for chunk in model_chunks for p in chunk.parameters()
             if not getattr(p, "tensor_model_parallel", False)],
            layout.tp, group=parallel_state.get_tensor_model_parallel_group()),
    )
    exit_code = run.finish(metrics, spread, {"cpu_placement_shim_sites": cpu_placement_shim_sites(env.world_size),
                                             "async_checkpoint": args.async_checkpoint,
                                             "checkpoint_blocking_s": checkpoints.blocking_s},
                           differ="parameters differ across replicas")
    model_chunks = optimizer = None  # the DDP buffers and the optimizer hold the groups: drop them first
    parallel_state.destroy_model_parallel()
    harness.leave_process_group()
    return exit_code


class MegatronAsyncSave:
    """Megatron's pending async save as the future harness.ShardedCheckpoints waits on: ``result()`` waits for
    the writer and runs megatron's finalization (every rank, at the same point)."""

    def __init__(self, queue):
        self.queue = queue

    def result(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True, no_dist=False)


def count_global_parameters(model_chunks, layout: Layout, tied: bool, device: torch.device) -> int:
    """Parameters of the whole model (not this rank's piece): what 6N in the MFU formula means.

    TP-split weights count in full on each TP rank's share, TP-replicated ones (norms, some biases) once
    per TP group; the last stage's copy of a tied embedding is not a parameter of its own.
    """
    total = 0.0
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if tied and name.endswith("output_layer.weight"):
                continue
            if "position_embeddings" in name:
                continue  # a lookup, no FLOPs (rope has none)
            total += param.numel() if getattr(param, "tensor_model_parallel", False) else param.numel() / layout.tp
    count = torch.tensor([total], dtype=torch.float64, device=device)
    if layout.tp * layout.pp > 1:
        from megatron.core import parallel_state
        dist.all_reduce(count, group=parallel_state.get_model_parallel_group())
    return int(round(count.item()))


def cpu_placement_shim_sites(world_size: int) -> list[str] | None:
    """What the CPU shim rewrote on any rank of this run (the tests check it against their allow-list).

    None on GPU, where the shim is never loaded. Every rank calls this (a collective).
    """
    shim = sys.modules.get("cpu_placement_shim")
    if shim is None or not shim.is_enabled():
        return None
    per_rank: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(per_rank, shim.sites())
    return sorted({site for sites in per_rank for site in sites})


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
