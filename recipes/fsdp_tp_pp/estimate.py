"""--estimate-memory for recipes/fsdp_tp_pp/train.py: will it fit, the per-GPU memory of a layout of --world ranks
(FSDP2 x TP x PP), from one process on fake tensors, every PP rank's (harness/memory.py), and the measured peak
of a launched run that an estimate is checked against. Kept out of train.py, which reads as FSDP2/TP/PP
training; ``train.py --estimate-memory GPU --world N`` calls it.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import harness
import parallelize
from gpt import cross_entropy

RECIPE = "fsdp_tp_pp"


def replay_pipeline(actions: list[tuple[str, int, int]], local, stages, args: argparse.Namespace, layout, rows: int,
                    hidden_dtype: torch.dtype, autocast):
    """One PP rank's step of the pipeline on fake tensors, without the schedule's p2p (fake tensors cannot
    answer its start-up handshake): its forwards and backwards in the schedule's order (``actions``), each
    micro-batch's activations held from its forward to its backward, as the schedule holds them. A stage's
    input from the stage before is a tensor of the activations' shape (what it receives), its output's
    gradient one of the output's (what it receives in backward).

    And what the pipeline holds besides: torch 2.13's PipelineStage infers its shapes with a first forward of
    one micro-batch whose activations stay alive for the whole run (measured on the first stage: the tracked
    memory between two steps holds one micro-batch's activations); the replay keeps one such forward per stage.
    Returns the step and the most micro-batches any moment holds."""
    position = {index: i for i, (index, _) in enumerate(local)}
    micro_rows = rows // layout.micro_batches
    held, most = set(), 0
    for kind, index, micro in actions:  # (the count alone: the step below holds the tensors)
        held.add((index, micro)) if kind == "F" else held.discard((index, micro))
        most = max(most, len(held))
    last_backward = {index: micro for kind, index, micro in actions if kind == "B"}  # (each stage's last)
    shape_inference: list[torch.Tensor] = []  # (kept for the run, as the pipeline keeps them)

    def forward(stage, tokens: torch.Tensor) -> torch.Tensor:
        inputs = tokens if stage.is_first else torch.randn(micro_rows, args.seq_len, args.n_embd,
                                                           dtype=hidden_dtype, requires_grad=True)
        with autocast:
            output = stage(inputs)
            return cross_entropy(output, tokens) / layout.micro_batches if stage.is_last else output

    def forward_backward() -> None:
        tokens = torch.randint(0, args.vocab_size, (micro_rows, args.seq_len))
        if not shape_inference:
            shape_inference.extend(forward(stage, tokens) for stage in stages)
        outputs = {}
        for kind, index, micro in actions:
            stage = stages[position[index]]
            if kind == "F":
                outputs[index, micro] = forward(stage, tokens)
            else:
                if isinstance(stage, FSDPModule):  # as the pipeline: gradients reduced and resharded in the last
                    last = micro == last_backward[index]  # backward only (unsharded until then)
                    stage.set_is_last_backward(last)
                    stage.set_reshard_after_backward(last)
                    stage.set_requires_gradient_sync(last)
                output = outputs.pop((index, micro))
                output.backward(None if stage.is_last else torch.ones_like(output))

    return forward_backward, most



def estimate_memory(args: argparse.Namespace, spec: harness.ModelSpec, validate: Callable, build_stages: Callable,
                    build_schedule: Callable) -> int:
    """--estimate-memory GPU: the per-GPU memory of the layout of --world ranks (harness/memory.py), from one
    process on fake tensors: rank 0's, and with --pp every PP rank's (each holds other layers and another
    number of micro-batches in flight), the largest reported. Without --world, the launched run (one process,
    or torchrun's ranks) tracks its own real tensors instead (with --pp: the real schedule, on the first PP
    rank): the measured peak an estimate is checked against. The dtype is the GPU's (--dtype auto: bf16)."""
    env = harness.detect_dist_env()
    measured, world = harness.memory.estimate_world(args, env.world_size)
    layout = validate(args, world, spec)
    capacity = harness.memory.gpu_memory(args.estimate_memory)  # (a GPU name it knows, before any work)
    if measured:
        device, _ = harness.setup_torch_distributed(env, args.timeout_s)
        torch.manual_seed(args.seed)
    else:
        device = torch.device("cpu")
        harness.memory.fake_process_group(world)
    mesh = parallelize.build_mesh(layout, device)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    rows = args.global_batch // layout.dp
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32 and not layout.fsdp)
    own_pp_rank = mesh.get_local_rank("pp") if layout.pp > 1 and measured else 0
    peaks, in_flight, host = {}, {}, {}  # by PP rank
    with harness.memory.fake_tensors(not measured):
        for pp_rank in [own_pp_rank] if measured else range(layout.pp):
            _, local, stages, _, optimizers = build_stages(args, spec, layout, mesh, pp_rank, device, dtype,
                                                           read_weights=measured)
            if layout.pp == 1:
                def forward_backward() -> None:
                    inputs = torch.randint(0, args.vocab_size, (rows, args.seq_len), device=device)
                    with autocast:
                        logits_or_loss = stages[0](inputs) if spec.name == "gpt" else stages[0](inputs, inputs)
                        loss = cross_entropy(logits_or_loss, inputs) if spec.name == "gpt" else logits_or_loss
                    loss.backward()
            elif measured:  # the real schedule, its p2p included
                schedule = build_schedule(args, layout, local, stages, mesh, device)
                has_first, has_last = stages[0].is_first, stages[-1].is_last

                def forward_backward() -> None:
                    inputs = torch.randint(0, args.vocab_size, (rows, args.seq_len), device=device)
                    schedule.step(*([inputs] if has_first else []), target=inputs if has_last else None,
                                  losses=[] if has_last else None, return_outputs=False)
            else:  # the estimate: the schedule's order replayed (Interleaved1F1B's, from the schedule itself)
                order_of = build_schedule(args, layout, local, stages, mesh, device) if layout.virtual > 1 else None
                actions = parallelize.pipeline_actions(args.pp_schedule, layout, pp_rank, order_of)
                forward_backward, in_flight[pp_rank] = replay_pipeline(
                    actions, local, stages, args, layout, rows, dtype if layout.fsdp else torch.float32, autocast)

            def train_step() -> None:
                forward_backward()
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

            if measured and pp_rank > 0:  # (the tracker cannot follow the later stages' backward, autograd.grad
                for _ in range(2):            # from the received inputs: they run the same steps, untracked)
                    train_step()
                continue
            peaks[pp_rank] = harness.memory.tracked_peak(stages, optimizers, train_step, fsdp=layout.fsdp)
            host[pp_rank] = harness.memory.host_bytes(stages, optimizers)
    if measured and layout.pp > 1:  # the first PP rank measured itself: rank 0's peak, for every rank to report
        every: list = [None] * world
        dist.all_gather_object(every, peaks.get(0))
        peaks = {0: every[0]}
    largest = max(peaks, key=lambda pp_rank: peaks[pp_rank]["total"])
    peak = peaks[largest]
    shape = " x ".join(f"{name} {size}" for name, size in layout.mesh_shape().items() if size > 1) or "one rank"
    stage_note = ""
    if layout.pp > 1:
        stage_note = f", {args.pp_schedule} over {layout.micro_batches} micro-batches: " + (
            "the first PP rank's" if measured else
            f"the largest PP rank, {largest}, holds {in_flight[largest]} of them in flight")
    code = 0
    if env.rank == 0:
        advice = harness.memory.advice(peak, layout.dp_shard * layout.tp, world, args.activation_checkpointing)
        if layout.pp > 1 and args.pp_schedule == "GPipe":
            advice.insert(0, f"--pp-schedule 1F1B (GPipe holds the activations of all {layout.micro_batches} "
                             f"micro-batches, 1F1B at most {min(layout.pp, layout.micro_batches)})")
        code = harness.memory.report(
            RECIPE, peak, args.estimate_memory, f"{shape} ({world} ranks), {rows} rows of {args.seq_len} tokens per "
            f"rank{stage_note}, {str(dtype).removeprefix('torch.')}, {args.optimizer}", measured, advice)
        if host:
            harness.memory.report_host(RECIPE, host[largest], world)
        if layout.fsdp and layout.tp > 1 and not measured:
            print(f"[{RECIPE}] (FSDP2 x TP on fake tensors: the total is the real run's; its split between parameters "
                  "and activations is approximate)", flush=True)
        if args.estimate_json:
            args.estimate_json.write_text(json.dumps({
                "world": world, "layout": layout.mesh_shape(), "rows": rows, "gpu": args.estimate_memory,
                "gpu_bytes": capacity, "measured": measured, "peak_bytes": peak, "largest_pp_rank": largest,
                "total_bytes_by_pp_rank": {str(r): peaks[r]["total"] for r in sorted(peaks)},
                "in_flight_by_pp_rank": {str(r): in_flight[r] for r in sorted(in_flight)},
                "host_bytes_per_rank": host.get(largest)}, indent=1) + "\n")
    if measured and world > 1:
        harness.leave_process_group()
    return code

