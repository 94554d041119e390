"""The TP x PP x DP layout of the Megatron recipe, and every rule megatron-core would otherwise enforce with an
assertion deep inside (after the process groups formed, as a stack trace on every rank): checked here first,
before any rank starts (``--preflight``, which slurm/lib/launch.sh runs), one line each with the fix.
Imports no megatron (it takes ~10 s to import; the preflight must answer in seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

import torch

import harness

RECIPE = "megatron_tp_pp"


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vp: int | None
    micro_batch: int
    num_microbatches: int  # per DP rank and optimizer step


def validate(args: argparse.Namespace, world_size: int) -> Layout:
    """Every rule megatron would otherwise enforce with an assertion deep inside, checked first, one line each."""
    harness.validate_run(args, world_size)
    harness.require_at_least_one(args, "tp", "pp", "micro_batch", "global_batch", "num_layers", "hidden_size",
                                 "num_heads")
    harness.require_positive(args, "lr")
    if args.optimizer == "sgd" and args.distributed_optimizer:
        raise harness.ConfigError("megatron-core's distributed optimizer is Adam only: drop --distributed-optimizer "
                                  "or --optimizer sgd")
    if importlib.util.find_spec("psutil") is None:  # megatron-core uses it undeclared; its save hangs without
        raise harness.ConfigError("psutil is not installed, and megatron-core's checkpoint writer needs it: "
                                 "pip install psutil (the megatron image has it)")
    tp, pp = args.tp, args.pp
    if world_size % (tp * pp):
        raise harness.ConfigError(
            f"world size {world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}: "
            f"launch a multiple of {tp * pp} ranks, or change --tp/--pp"
        )
    dp = world_size // (tp * pp)
    if args.num_heads % tp:
        raise harness.ConfigError(f"--num-heads {args.num_heads} is not divisible by --tp {tp}: each TP rank takes whole heads")
    if args.hidden_size % tp:
        raise harness.ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --tp {tp}")
    if args.hidden_size % args.num_heads:
        raise harness.ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-heads {args.num_heads}")
    if args.vocab_size % tp:
        raise harness.ConfigError(f"--vocab-size {args.vocab_size} is not divisible by --tp {tp}: "
                                  "the embedding is split by vocabulary rows")
    if args.vp is not None:
        if args.vp < 2 or pp < 2:
            raise harness.ConfigError(f"--vp {args.vp} needs --vp >= 2 and --pp >= 2 (leave --vp out for the plain schedule)")
        if args.batch_p2p_comm and pp == 2 and not harness.faults.active("batch-p2p-with-vp"):  # (a test's control)
            raise harness.ConfigError(
                "--batch-p2p-comm with --vp at --pp 2 trains on swapped activations (the previous and next stage "
                "are the same rank and the batched messages cross; a known Megatron-LM problem): drop --batch-p2p-comm"
            )
    stages = pp * (args.vp or 1)
    if args.num_layers % stages:
        what = f"PP x VP = {pp} x {args.vp} = {stages}" if args.vp else f"--pp {pp}"
        raise harness.ConfigError(f"--num-layers {args.num_layers} is not divisible by {what}: every stage needs the same number of layers")
    rows = args.micro_batch * dp
    harness.require_divisible("--global-batch", args.global_batch, rows, f"--micro-batch {args.micro_batch} x DP {dp} = {rows}")
    num_microbatches = args.global_batch // rows
    if pp > 1 and num_microbatches < pp:
        harness.stderr_line(f"[{RECIPE}] warning: {num_microbatches} micro-batches for {pp} pipeline stages: most "
                           f"stages wait (the bubble); use --global-batch >= {pp * rows}")
    if args.vp is not None and num_microbatches % pp:
        raise harness.ConfigError(f"the interleaved schedule (--vp) needs micro-batches ({num_microbatches}) divisible by --pp {pp}")
    if args.layer_spec == "te" and not (torch.cuda.is_available() and have_transformer_engine()):
        raise harness.ConfigError("--layer-spec te needs a GPU and Transformer Engine (the cuda image has both); use auto or local")
    per_node = args.ranks_per_node or harness.ranks_per_node()
    if per_node and tp > per_node:
        harness.stderr_line(f"[{RECIPE}] warning: --tp {tp} is more than the {per_node} ranks per node: tensor "
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
