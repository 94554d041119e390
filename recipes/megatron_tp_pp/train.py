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

Without a CUDA device the recipe loads cpu_placement_shim.py (next to this file; it says so in the log):
megatron-core has no CPU path, and the shim only moves its tensors to the CPU. GPU runs never load it.

Every layout starts from the same weights: each parameter is generated from its global name at full
shape and the rank keeps its own TP/PP piece, so any layout is comparable with one process. Checkpoints
are megatron distributed checkpoints in OUT_DIR/checkpoints/step_N; a rerun with the same --out-dir
resumes; SIGUSR1/SIGTERM checkpoint and stop. Options that cannot form a valid layout are refused before
any rank starts (--preflight WORLD_SIZE, which slurm/lib/launch.sh runs), each with one line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: the shared modules
import common  # noqa: E402

RECIPE = "megatron_tp_pp"
TRAINER_STATE = "trainer_state.json"  # step, loss history and layout, next to the distributed checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: ranks that split each layer (within a node)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size: ranks that each hold a block of layers")
    p.add_argument("--vp", type=int, default=None,
                   help="virtual pipeline stages per PP rank (interleaved schedule; needs --pp >= 2)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch on each DP rank")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, over all DP ranks")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--tie-embeddings", action="store_true", help="share the input embedding with the output layer")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--distributed-optimizer", action="store_true", help="shard the optimizer state over DP (ZeRO-1)")
    p.add_argument("--batch-p2p-comm", action="store_true",
                   help="batch the pipeline's send/recv pairs (refused with --vp at --pp 2: the messages get swapped)")
    p.add_argument("--layer-spec", choices=["auto", "local", "te"], default="auto",
                   help="auto: Transformer Engine layers on GPU where TE is installed, megatron's torch layers otherwise")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=1234, help="seeds the weights and the synthetic data")
    p.add_argument("--out-dir", type=Path, default=Path("runs/megatron_tp_pp"), help="checkpoints and metrics.json")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out-dir")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and exit after this step, as if the allocation ended; rerun to continue")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="process-group timeout: a collective that waits longer fails the job")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: data sheet on GPU, measured matmul on CPU)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="for the TP placement check (default: from Slurm or torchrun variables)")
    p.add_argument("--config", type=Path, default=None,
                   help="a TOML file of these options (keys as here, without '--'); the command line wins")
    p.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE",
                   help="only check the options (and a checkpoint to resume) for this many ranks, then exit")
    p.add_argument("--unsafe-batch-p2p-with-vp", action="store_true",
                   help="TESTS ONLY, wrong on purpose: allow --batch-p2p-comm with --vp at --pp 2 (the negative control)")
    return common.parse_args_with_config(p, argv)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vp: int | None
    micro_batch: int
    num_microbatches: int  # per DP rank and optimizer step


def ranks_per_node_from_env(environ=os.environ) -> int | None:
    """Ranks on this node, as the launcher says: torchrun's LOCAL_WORLD_SIZE or Slurm's tasks per node."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    match = re.match(r"(\d+)", environ.get("SLURM_TASKS_PER_NODE", ""))  # e.g. "4(x2)"
    return int(match.group(1)) if match else None


def validate(args: argparse.Namespace, world_size: int) -> Layout:
    """Every rule megatron would otherwise enforce with an assertion deep inside, checked first, one line each."""
    for name in ("tp", "pp", "micro_batch", "global_batch", "num_layers", "hidden_size", "num_heads", "seq_len",
                 "vocab_size", "max_steps", "log_every"):
        if getattr(args, name) < 1:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("lr", "timeout_s"):
        if not getattr(args, name) > 0:
            raise common.ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.clip_grad < 0:
        raise common.ConfigError(f"--clip-grad must be 0 (no clipping) or more, got {args.clip_grad}")
    if args.checkpoint_every < 0:
        raise common.ConfigError(f"--checkpoint-every must be 0 (only at the end) or more, got {args.checkpoint_every}")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        raise common.ConfigError(f"--stop-at-step must be between 1 and --max-steps {args.max_steps}")
    if importlib.util.find_spec("psutil") is None:  # megatron-core uses it undeclared; its save hangs without
        raise common.ConfigError("psutil is not installed, and megatron-core's checkpoint writer needs it: "
                                 "pip install psutil (the megatron image has it)")
    tp, pp = args.tp, args.pp
    if world_size % (tp * pp):
        raise common.ConfigError(
            f"world size {world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}: "
            f"launch a multiple of {tp * pp} ranks, or change --tp/--pp"
        )
    dp = world_size // (tp * pp)
    if args.num_heads % tp:
        raise common.ConfigError(f"--num-heads {args.num_heads} is not divisible by --tp {tp}: each TP rank takes whole heads")
    if args.hidden_size % tp:
        raise common.ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --tp {tp}")
    if args.hidden_size % args.num_heads:
        raise common.ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-heads {args.num_heads}")
    if args.vocab_size % tp:
        raise common.ConfigError(f"--vocab-size {args.vocab_size} is not divisible by --tp {tp}: the embedding is split by vocabulary rows")
    if args.vp is not None:
        if args.vp < 2 or pp < 2:
            raise common.ConfigError(f"--vp {args.vp} needs --vp >= 2 and --pp >= 2 (leave --vp out for the plain schedule)")
        if args.batch_p2p_comm and pp == 2 and not args.unsafe_batch_p2p_with_vp:
            raise common.ConfigError(
                "--batch-p2p-comm with --vp at --pp 2 trains on swapped activations (the previous and next stage "
                "are the same rank and the batched messages cross; a known Megatron-LM problem): drop --batch-p2p-comm"
            )
    stages = pp * (args.vp or 1)
    if args.num_layers % stages:
        what = f"PP x VP = {pp} x {args.vp} = {stages}" if args.vp else f"--pp {pp}"
        raise common.ConfigError(f"--num-layers {args.num_layers} is not divisible by {what}: every stage needs the same number of layers")
    rows = args.micro_batch * dp
    if args.global_batch % rows:
        raise common.ConfigError(
            f"--global-batch {args.global_batch} is not divisible by --micro-batch {args.micro_batch} x DP {dp} = {rows}; "
            f"use a multiple of {rows} (e.g. --global-batch {-(-args.global_batch // rows) * rows})"
        )
    num_microbatches = args.global_batch // rows
    if pp > 1 and num_microbatches < pp:
        common.stderr_line(f"[{RECIPE}] warning: {num_microbatches} micro-batches for {pp} pipeline stages: most "
                           f"stages wait (the bubble); use --global-batch >= {pp * rows}")
    if args.vp is not None and num_microbatches % pp:
        raise common.ConfigError(f"the interleaved schedule (--vp) needs micro-batches ({num_microbatches}) divisible by --pp {pp}")
    if args.layer_spec == "te" and not (torch.cuda.is_available() and have_transformer_engine()):
        raise common.ConfigError("--layer-spec te needs a GPU and Transformer Engine (the cuda image has both); use auto or local")
    per_node = args.ranks_per_node or ranks_per_node_from_env()
    if per_node and tp > per_node:
        common.stderr_line(f"[{RECIPE}] warning: --tp {tp} is more than the {per_node} ranks per node: tensor "
                           "parallelism across nodes all-reduces every layer over the network (slow on Slingshot); "
                           "keep TP within a node and use PP")
    return Layout(tp, pp, dp, args.vp, args.micro_batch, num_microbatches)


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def model_settings(args: argparse.Namespace) -> dict:
    """What a checkpoint must match to be resumed (the layout may differ: distributed checkpoints reshard)."""
    keys = ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size", "tie_embeddings", "global_batch", "seed")
    return {key: getattr(args, key) for key in keys}


def load_trainer_state(args: argparse.Namespace) -> tuple[Path | None, dict | None]:
    resume_from = None if args.no_resume else common.latest_checkpoint_dir(args.out_dir / "checkpoints")
    if resume_from is None:
        return None, None
    try:
        state = json.loads((resume_from / TRAINER_STATE).read_text())
    except (OSError, ValueError) as error:
        raise common.ConfigError(f"cannot read {resume_from / TRAINER_STATE} ({type(error).__name__}): "
                                 "move the checkpoint away, or use --no-resume") from None
    if state["model"] != model_settings(args):
        raise common.ConfigError(f"{resume_from} was written with {state['model']}; use the same settings, "
                                 "a new --out-dir, or --no-resume")
    return resume_from, state


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
    if args.preflight is not None:  # slurm/lib/launch.sh, before it starts any rank (no megatron import: seconds)
        layout = validate(args, args.preflight)
        resume_from, _ = load_trainer_state(args)
        print(f"[{RECIPE}] preflight: TP {layout.tp} x PP {layout.pp} x DP {layout.dp} = {args.preflight} ranks, "
              f"{layout.num_microbatches} micro-batches of {layout.micro_batch}"
              + (f", VP {layout.vp}" if layout.vp else "")
              + (f"; will resume from {resume_from}" if resume_from else ""), flush=True)
        return 0
    env = common.detect_dist_env()
    layout = validate(args, env.world_size)
    common.check_expected_world_size(env.world_size)
    resume_from, trainer_state = load_trainer_state(args)
    checkpoint_dir = args.out_dir / "checkpoints"

    # ---- rank, device, backend (gloo on CPU, NCCL on GPU); megatron needs a process group even for one rank
    device, backend = common.setup_torch_distributed(env, args.timeout_s)
    if env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    # Without Transformer Engine/apex megatron warns at import, once per module: the log line below says it.
    warnings.filterwarnings("ignore", r"(Transformer Engine and )?Apex (is|are) not installed", UserWarning)
    warnings.filterwarnings("ignore", "full scope is deprecated", UserWarning)
    if device.type == "cpu":
        import cpu_placement_shim  # recipes/megatron_tp_pp/: megatron-core has no CPU path of its own
        cpu_placement_shim.enable()
    # Imported here, not at the top: megatron takes ~10 s to import, and --preflight must answer in seconds.
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core import __version__ as megatron_version
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                         get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

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
    hostnames = common.all_hostnames(env.world_size)
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
    flops_per_token = common.transformer_flops_per_token(n_params, args.num_layers, args.hidden_size, args.seq_len)

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
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                        adam_eps=1e-8, clip_grad=args.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                        use_distributed_optimizer=args.distributed_optimizer),
        model_chunks,
    )

    def sharded_state(is_loading: bool) -> dict:
        # One entry per model chunk, as Megatron-LM lays it out; the optimizer maps its state onto them.
        # (the GPT models under the DDP wrappers: the keys carry no "module." prefix)
        state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}
        # The distributed optimizer's state in the canonical per-parameter form: resumable in any layout.
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return state

    start_step, history = 0, []
    if trainer_state:
        try:  # megatron reshards on load: a checkpoint of another TP/PP/DP layout loads too
            loaded = dist_checkpointing.load(sharded_state(is_loading=True), str(resume_from))
        except Exception as error:  # its errors are deep and long; say which checkpoint and what to do
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise common.ConfigError(f"cannot load {resume_from}: {first_line[:300]}; "
                                     "move it away, use a new --out-dir, or --no-resume") from error
        for i, chunk in enumerate(model_chunks):
            chunk.module.load_state_dict(loaded[f"model{i}"])
        optimizer.load_state_dict(loaded["optimizer"])
        start_step, history = trainer_state["step"], trainer_state["history"]
        if env.rank == 0:
            print(f"[{RECIPE}] resumed from {resume_from} (step {start_step})", flush=True)

    peak, peak_source = common.peak_flops(device, dtype, args.peak_tflops)
    layout_info = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "vp": layout.vp,
                   "micro_batch": layout.micro_batch, "num_microbatches": layout.num_microbatches}
    metrics = common.MetricsLogger(
        recipe=RECIPE, path=args.out_dir / "metrics.json", is_logging_rank=is_logging_rank,
        tokens_per_sample=args.seq_len, flops_per_token=flops_per_token, peak_flops_per_device=peak,
        peak_source=peak_source, world_size=env.world_size, log_every=args.log_every, history=history,
        run_info={**common.describe_run(env, backend, device, type(model_chunks[0]).__name__), "hostnames": hostnames,
                  "layout": layout_info, "n_params": n_params, "megatron_core_version": megatron_version,
                  "optimizer": type(optimizer).__name__, "dtype": str(dtype), "config": vars(args),
                  "layer_spec": "transformer_engine" if use_te else "local",
                  "cpu_placement_shim": device.type == "cpu", "resumed_from_step": start_step or None},
    )
    if is_logging_rank:
        print(f"[{RECIPE}] {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.2f} MFLOP/token "
              f"(6N + 12*L*d*T), peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})", flush=True)

    def save(step: int) -> None:
        staging = common.staging_checkpoint_dir(checkpoint_dir, step)
        if env.rank == 0:  # megatron wants an empty, existing directory (a crashed write may have left one)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(sharded_state(is_loading=False), str(staging))  # every rank writes its shards
        if is_logging_rank:  # the rank that holds the loss history
            common.atomic_write_bytes(staging / TRAINER_STATE, json.dumps({
                "step": step, "history": metrics.history, "model": model_settings(args),
                "layout": layout_info}).encode())
        dist.barrier()
        if env.rank == 0:
            common.publish_checkpoint_dir(checkpoint_dir, step)
        metrics.write()

    # ---- data: every DP rank takes its rows of the step's global batch, cut into micro-batches; all TP
    # and PP ranks of a replica read the same rows (stage 0 uses the tokens, the last stage the labels)
    data = common.SyntheticTokens(args.vocab_size, args.seq_len, args.seed)
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

    # ---- training loop: one optimizer step = the schedule's forward/backward over all micro-batches
    if env.rank == 0:
        (args.out_dir / common.STOP_MARKER).unlink(missing_ok=True)  # from an earlier, stopped run
    stop = common.StopRequest(RECIPE, env.rank)
    stopped_by = 0
    for chunk in model_chunks:
        chunk.train()
    last_step = start_step
    dp_group = parallel_state.get_data_parallel_group()
    for step in range(start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
        inputs, targets = data.local_batch(step, args.global_batch, dp_rank, layout.dp)
        micro = [(inputs[i:i + layout.micro_batch].to(device), targets[i:i + layout.micro_batch].to(device))
                 for i in range(0, len(inputs), layout.micro_batch)]
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(micro) for _ in model_chunks] if layout.vp else iter(micro),
            model=model_chunks if layout.vp else model_chunks[0],
            num_microbatches=layout.num_microbatches, seq_length=args.seq_len,
            micro_batch_size=layout.micro_batch, forward_only=False,
        )
        update_successful, grad_norm, _ = optimizer.step()
        if not update_successful:
            raise RuntimeError(f"step {step}: the optimizer skipped the update (grad norm {grad_norm})")
        step_loss = torch.zeros((), device=device)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            step_loss = torch.stack([item["loss"] for item in losses]).mean()
            dist.all_reduce(step_loss, group=dp_group)  # mean over DP replicas: the global batch's loss
            step_loss /= layout.dp
        else:
            dist.barrier(group=dp_group)  # the same collective count on every rank keeps the timing honest
        metrics.log_step(step, float(step_loss), args.global_batch, time.perf_counter() - t0,
                         optimizer.param_groups[0]["lr"])
        last_step = step
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
        stopped_by = stop.agreed(env.world_size, device)
        if step == args.stop_at_step or stopped_by:
            break
    if last_step > start_step and not (args.checkpoint_every and last_step % args.checkpoint_every == 0):
        save(last_step)

    # ---- prove from inside the run that the replicas trained one model: DP replicas (and, for what TP
    # does not split, the TP ranks) must hold identical parameters
    spread = max(
        common.max_difference_across_ranks([p.data for chunk in model_chunks for p in chunk.parameters()],
                                           layout.dp, group=dp_group),
        common.max_difference_across_ranks(
            [p.data for chunk in model_chunks for p in chunk.parameters()
             if not getattr(p, "tensor_model_parallel", False)],
            layout.tp, group=parallel_state.get_tensor_model_parallel_group()),
    )
    shim_sites = cpu_placement_shim_sites(env.world_size)
    metrics.write({"param_max_abs_diff_across_ranks": spread, "last_step": last_step,
                   "stopped_early": last_step < args.max_steps, "cpu_placement_shim_sites": shim_sites,
                   "stopped_by_signal": signal.Signals(stopped_by).name if stopped_by else None})
    if is_logging_rank:
        s = metrics.summary()
        print(f"[{RECIPE}] done: step {last_step}/{args.max_steps}, final loss {s['final_loss']:.4f}, "
              f"{s['mean_samples_per_s']:.1f} samples/s, {s['mean_tokens_per_s']:.0f} tokens/s, "
              f"MFU {100 * s['mean_mfu']:.2f}% (peak {peak / 1e12:.3f} TFLOP/s, {peak_source}); "
              f"metrics in {metrics.path}", flush=True)
    # As in the DDP recipe: drop what holds the process groups before destroying them.
    dist.barrier()
    model_chunks = optimizer = None  # (the DDP buffers and the optimizer hold the groups)
    gc.collect()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if spread != 0.0:
        common.stderr_line(f"[{RECIPE}] error: parameters differ across replicas by up to {spread:.3g}: "
                           "gradients were not synchronised")
        return 3
    if stopped_by and env.rank == 0:
        common.StopRequest.write_marker(args.out_dir, stopped_by, last_step)
        print(f"[{RECIPE}] stopped by {signal.Signals(stopped_by).name} after step {last_step}: checkpoint written; "
              "run again with the same --out-dir to continue (slurm/ files requeue the job themselves)", flush=True)
    return 0


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
    try:
        sys.exit(main())
    except common.ConfigError as error:
        common.exit_on_config_error(RECIPE, error)
    except RuntimeError as error:  # torch's DistBackendError included
        if dist.is_available() and dist.is_initialized():
            common.exit_on_collective_failure(RECIPE, error)
        raise
