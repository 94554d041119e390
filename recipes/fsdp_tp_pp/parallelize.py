"""How the FSDP2 + TP + PP recipe cuts a model over its DeviceMesh (as torchtitan's parallelize.py):

- ``Layout`` and ``choose_layout``: the sizes PP x DP_replicate x DP_shard x TP, every rule checked before
  any rank starts (one line each, with the fix);
- ``GPTStage``: the layers of one pipeline stage of the stack's GPT (embeddings on the first, the head on the
  last), named as in the full model (``blocks.<global index>``), so a checkpoint of any layout loads into any other;
- ``tensor_parallel_plan``: which linear layers TP cuts, column-wise in, row-wise out (whole heads per rank):
  the GPT's own plan, a Hugging Face model's ``base_model_tp_plan`` (from its config), or your module's
  ``tp_plan``; ``apply_tensor_parallel`` applies it;
- ``fsdp_units`` and ``apply_fsdp``: FSDP2 per block (the GPT's blocks, a Hugging Face model's decoder layers,
  your module's ``fsdp_units``) and then the whole stage (HSDP with DP_replicate > 1).

The tests' tp-no-reduce control (HPCML_TEST_FAULT, harness/faults.py) comes in here as the wrong row-wise style.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import harness
from gpt import GPT

SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    virtual: int  # pipeline stages per PP rank (Interleaved1F1B)
    micro_batches: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    @property
    def fsdp(self) -> bool:
        return self.dp > 1

    def wrapper(self, schedule: str) -> str:
        """What wraps the model, for the logs and metrics.json: e.g. "FSDP2+TP", "TP+PP(1F1B)", "none"."""
        parts = ["HSDP" if self.dp_replicate > 1 else "FSDP2"] if self.fsdp else []
        parts += ["TP"] if self.tp > 1 else []
        parts += [f"PP({schedule})"] if self.pp > 1 else []
        return "+".join(parts) or "none"

    def mesh_shape(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}


def choose_layout(args: argparse.Namespace, world_size: int, spec: harness.ModelSpec) -> Layout:
    """The mesh sizes for ``world_size`` ranks. Unset sizes come from the allocation: TP within a node (the
    ranks per node, when they divide the heads; 1 for a model without a known TP plan), pipeline 1, and FSDP
    over what is left."""
    pp, dp_replicate = args.pp, args.dp_replicate
    harness.require_at_least_one(args, "pp", "dp_replicate", "pp_virtual", "global_batch")
    tp = args.tp
    if tp is None:
        per_node = harness.ranks_per_node() or 1
        fits = per_node > 1 and world_size % (per_node * pp * dp_replicate) == 0 and spec.tp_divides is not None \
            and all(count % per_node == 0 for count in spec.tp_divides.values())
        tp = per_node if fits and args.dp_shard is None else 1
    if tp < 1:
        raise harness.ConfigError(f"--tp must be at least 1, got {tp}")
    rest = pp * dp_replicate * tp
    if args.dp_shard is None:
        if world_size % rest:
            raise harness.ConfigError(f"world size {world_size} is not divisible by PP x DP_replicate x TP = {pp} x "
                                      f"{dp_replicate} x {tp} = {rest}: launch a multiple of {rest} ranks, or change them")
        dp_shard = world_size // rest
    else:
        dp_shard = args.dp_shard
        if dp_shard < 1 or rest * dp_shard != world_size:
            raise harness.ConfigError(f"PP x DP_replicate x DP_shard x TP = {pp} x {dp_replicate} x {dp_shard} x {tp} = "
                                      f"{rest * dp_shard}, but the job has {world_size} ranks: make the product the "
                                      "world size, or leave --dp-shard out (it takes what is left)")
    micro = args.micro_batches if args.micro_batches is not None else (2 * pp if pp > 1 else 1)
    layout = Layout(pp, dp_replicate, dp_shard, tp, args.pp_virtual, micro)
    check_layout(args, layout, spec)
    return layout


def check_layout(args: argparse.Namespace, layout: Layout, spec: harness.ModelSpec) -> None:
    for what, count in (spec.tp_divides or {}).items():
        if count % layout.tp:
            raise harness.ConfigError(f"{what} {count} is not divisible by --tp {layout.tp}: each TP rank takes whole "
                                      f"heads (use a --tp that divides {count})")
    if spec.name != "gpt" and layout.pp > 1:
        raise harness.ConfigError(f"--pp {layout.pp} with --model {spec.name}: the pipeline cuts the stack's GPT into "
                                  "stages; train your model with FSDP2 and TP (--pp 1)")
    if getattr(args, "lora_rank", None) and layout.tp > 1:
        raise harness.ConfigError(f"--lora-rank with --tp {layout.tp}: LoRA's adapters are not cut for tensor "
                                  "parallelism here; fine-tune with FSDP2 (--tp 1)")
    interleaved = args.pp_schedule == "Interleaved1F1B"
    if interleaved != (layout.virtual > 1):
        raise harness.ConfigError("--pp-schedule Interleaved1F1B goes with --pp-virtual 2 or more (stages per PP rank), "
                                  f"the other schedules with --pp-virtual 1; got {args.pp_schedule} and {layout.virtual}")
    if args.n_layer % layout.stages:
        what = f"PP x virtual = {layout.pp} x {layout.virtual} = {layout.stages}" if interleaved else f"--pp {layout.pp}"
        raise harness.ConfigError(f"--n-layer {args.n_layer} is not divisible by {what}: every stage gets the same layers")
    if layout.micro_batches < 1 or (layout.pp == 1 and layout.micro_batches != 1):
        raise harness.ConfigError(f"--micro-batches {layout.micro_batches}: micro-batches are the pipeline's (--pp 2 "
                                  "or more); leave it out without a pipeline")
    if interleaved and layout.micro_batches % layout.pp:
        raise harness.ConfigError(f"Interleaved1F1B needs --micro-batches ({layout.micro_batches}) divisible by --pp {layout.pp}")
    rows = layout.dp * layout.micro_batches
    harness.require_divisible("--global-batch", args.global_batch, rows,
                              f"DP {layout.dp} x --micro-batches {layout.micro_batches} = {rows}")
    if layout.pp > 1 and layout.micro_batches < layout.pp:
        harness.stderr_line(f"[fsdp_tp_pp] warning: {layout.micro_batches} micro-batches for {layout.pp} stages: most "
                            f"stages wait (the bubble); use --micro-batches {2 * layout.pp} or more")


def build_mesh(layout: Layout, device: torch.device):
    """The named 4-D mesh (None for one process). Ranks are laid out TP fastest, then DP_shard, DP_replicate,
    PP: with ranks numbered node by node, TP stays within a node and PP crosses nodes."""
    if layout.pp * layout.dp * layout.tp == 1:
        return None
    shape = layout.mesh_shape()
    return init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))


class GPTStage(nn.Module):
    """Layers [first, last) of ``model``: the embeddings if first == 0, the final norm and head if last is
    the end. Module names are the full model's, so every layout has the same parameter names."""

    def __init__(self, model: GPT, first: int, last: int):
        super().__init__()
        self.is_first, self.is_last = first == 0, last == len(model.blocks)
        if self.is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({str(index): model.blocks[index] for index in range(first, last)})
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x


def local_stages(model: GPT, layout: Layout, pp_rank: int) -> list[tuple[int, GPTStage]]:
    """(stage index, module) of this PP rank: stage s = pp_rank + v * PP (the loop order of the interleaved
    schedule), each with n_layer / stages consecutive layers."""
    per_stage = len(model.blocks) // layout.stages
    indices = [pp_rank + v * layout.pp for v in range(layout.virtual)]
    return [(s, GPTStage(model, s * per_stage, (s + 1) * per_stage)) for s in indices]


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 wraps one by one (each gathered just before it runs): the GPT's blocks, a Hugging
    Face model's decoder layers (the classes its ``_no_split_modules`` names), or your module's
    ``fsdp_units`` (a list of its submodules); none: the whole model is one unit."""
    if isinstance(model, GPTStage):
        return list(model.blocks.values())
    declared = getattr(model, "fsdp_units", None)
    if declared is not None:
        return list(declared() if callable(declared) else declared)
    hugging_face = getattr(model, "model", None)
    block_classes = set(getattr(hugging_face, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in block_classes]


def tensor_parallel_plan(model: nn.Module) -> dict[str, str]:
    """{module name: "colwise" | "rowwise"}: the linear layers TP cuts. The GPT: qkv and the MLP's first layer
    column-wise, the projections after them row-wise (Megatron's layout). A Hugging Face model: its config's
    ``base_model_tp_plan`` (the same layout, named for its layers). Your module: its ``tp_plan`` attribute.
    Embeddings, norms and the output layer stay replicated over TP."""
    if isinstance(model, GPTStage):
        return {f"blocks.{index}.{name}": style for index in model.blocks
                for name, style in (("attn.qkv", "colwise"), ("attn.proj", "rowwise"), ("mlp.0", "colwise"),
                                    ("mlp.2", "rowwise"))}
    declared = getattr(model, "tp_plan", None)
    prefix = ""
    if declared is None and hasattr(getattr(model, "model", None), "config"):  # harness.hf_model.CausalLMLoss
        hugging_face = model.model
        declared = getattr(hugging_face.config, "base_model_tp_plan", None)
        base = getattr(hugging_face, "base_model_prefix", "model")
        # (LoRA: peft wraps the model, and the base model's names sit further in)
        inner = next(name for name, module in model.named_modules() if module is hugging_face.base_model)
        prefix = f"{inner}." if inner else f"model.{base}."
    if not declared:
        raise harness.ConfigError(f"{type(model).__name__} has no tensor-parallel plan: give your module a tp_plan "
                                  "({submodule name: 'colwise' | 'rowwise'}), or use --tp 1")
    names = [name for name, _ in model.named_modules()]
    plan = {}
    for pattern, style in declared.items():
        if style not in ("colwise", "rowwise"):
            raise harness.ConfigError(f"the model's TP plan cuts {pattern} as {style!r}; this recipe applies "
                                      "'colwise' and 'rowwise' only: use --tp 1")
        wanted = re.compile(re.escape(prefix + pattern).replace(r"\*", r"\d+") + "$")
        plan.update({name: style for name in names if wanted.match(name)})
    return plan


class RowwiseWithoutReduce(RowwiseParallel):
    """A test's negative control, wrong on purpose: row-wise parallel whose ranks keep their partial sums."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()


def apply_tensor_parallel(stage: nn.Module, tp_mesh, plan: dict[str, str]) -> None:
    """``plan`` (tensor_parallel_plan) in DTensor: column-wise layers keep their share of the outputs (each
    rank its heads, its part of the hidden width), row-wise ones all-reduce their partial sums. (The tests'
    tp-no-reduce control, harness/faults.py: row-wise without that all-reduce, chosen here because DTensor
    binds a layer's reduction when the plan is applied.)"""
    row_wise = RowwiseWithoutReduce if harness.faults.active("tp-no-reduce") else RowwiseParallel
    parallelize_module(stage, tp_mesh, {name: ColwiseParallel() if style == "colwise" else row_wise()
                                        for name, style in plan.items()})


def apply_fsdp(stage: nn.Module, units: list[nn.Module], dp_mesh, param_dtype: torch.dtype | None) -> None:
    """FSDP2: every one of ``units`` (fsdp_units) its own unit (its parameters gathered just before it runs),
    then the stage for what is left. ``param_dtype`` bf16 on GPU (gradients reduced in float32)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
    fully_shard(stage, mesh=dp_mesh, mp_policy=policy)


def grad_norm(stages: list[nn.Module], pp_group) -> torch.Tensor:
    """The global gradient norm (every parameter of every stage): the same number in any layout when the
    gradients are right; a wrong scale (a sum for a mean, micro-batches not averaged) shows at once.

    Local sums of squares, summed over the mesh dimensions each gradient is sharded on (one all-reduce per
    kind of sharding, not per parameter), then over the pipeline stages. A tensor: read on the host at the
    run's next sync, or here when --clip-grad needs it."""
    device = next(stages[0].parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    sharded: dict[tuple, list] = {}  # (mesh id, placements) -> [mesh, placements, local sum of squares]
    for stage in stages:
        for param in stage.parameters():
            grad = param.grad
            if grad is None:
                continue
            if not isinstance(grad, DTensor):
                total += grad.double().pow(2).sum()
                continue
            if any(placement.is_partial() for placement in grad.placements):
                raise RuntimeError(f"a gradient with a partial placement {grad.placements}: not reduced yet")
            entry = sharded.setdefault((id(grad.device_mesh), tuple(grad.placements)),
                                       [grad.device_mesh, grad.placements, torch.zeros_like(total)])
            entry[2] += grad.to_local().double().pow(2).sum()
    for mesh, placements, squares in sharded.values():
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():  # Shard, or FSDP2's _StridedShard over TP's shards
                torch.distributed.all_reduce(squares, group=mesh.get_group(dim))
        total += squares
    if pp_group is not None:  # each PP rank holds other layers
        torch.distributed.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_gradients(stages: list[nn.Module], norm: torch.Tensor, max_norm: float) -> None:
    """--clip-grad: every gradient scaled by max_norm / norm when the global ``norm`` (grad_norm) is larger,
    as torch.nn.utils.clip_grad_norm_ scales them (DTensor gradients scale shard by shard)."""
    if max_norm <= 0:
        return
    factor = min(1.0, max_norm / (float(norm) + 1e-6))
    for stage in stages:
        for param in stage.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)


def expected_mesh_dims(name: str, layout: Layout, tp_planned: set[str]) -> tuple[str, ...]:
    """The mesh dimensions parameter ``name`` must be a DTensor over (() for a plain tensor); ``tp_planned``:
    the modules the TP plan cuts."""
    module = name.rpartition(".")[0]
    dims = (("dp_replicate",) if layout.dp_replicate > 1 else ()) + (("dp_shard",) if layout.fsdp else ())
    return dims + (("tp",) if layout.tp > 1 and module in tp_planned else ())


def placements(stages: list[nn.Module], layout: Layout, plans: list[dict[str, str]]) -> dict[str, str]:
    """Every parameter's mesh dimensions and placements, checked against what the layout must give: the
    proof, from inside the run, that FSDP2 and TP really wrapped what they should (nothing fell back)."""
    found = {}
    for stage, plan in zip(stages, plans):
        for name, param in stage.named_parameters():
            is_dtensor = isinstance(param, DTensor)
            dims = tuple(param.device_mesh.mesh_dim_names) if is_dtensor else ()
            expected = expected_mesh_dims(name, layout, set(plan))
            if dims != expected:
                raise RuntimeError(f"{name} is over mesh dims {dims}, expected {expected}")
            found[name] = f"{dims} {tuple(param.placements)}" if is_dtensor else "plain tensor"
    return found


def pipeline_actions(schedule_name: str, layout: Layout, pp_rank: int, schedule=None) -> list[tuple[str, int, int]]:
    """PP rank ``pp_rank``'s forwards and backwards in its schedule's order: [("F" | "B", stage index,
    micro-batch)]. What a rank holds at once follows from it: the activations of each micro-batch from its
    forward to its backward (the memory estimate replays it). GPipe: every forward, then every backward;
    1F1B: min(micro-batches, PP - stage) forwards first, then one backward and one forward, then the rest of
    the backwards (torch.distributed.pipelining's Schedule1F1B); Interleaved1F1B: the order the ``schedule``
    object itself computed for every rank (its ``pipeline_order``)."""
    n = layout.micro_batches
    if schedule_name == "GPipe":
        return [("F", pp_rank, m) for m in range(n)] + [("B", pp_rank, m) for m in range(n)]
    if schedule_name == "1F1B":
        warmup = min(n, layout.pp - pp_rank)
        order = [("F", pp_rank, m) for m in range(warmup)]
        for m in range(n - warmup):
            order += [("B", pp_rank, m), ("F", pp_rank, warmup + m)]
        return order + [("B", pp_rank, m) for m in range(n - warmup, n)]
    return [(action.computation_type.value, action.stage_index, action.microbatch_index)
            for action in schedule.pipeline_order[pp_rank]
            if action is not None and action.computation_type.value in ("F", "B")]  # (forward, full backward)
