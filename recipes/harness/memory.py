"""Will it fit: the per-GPU memory of a layout, from one CPU process, without the GPUs (--estimate-memory GPU).

The recipe builds its own model and parallelism for rank 0 of a world of --world ranks on a fake process group
(collectives do nothing) with fake tensors (shapes and dtypes, no storage), and runs two training steps under
PyTorch's memory tracker (torch.distributed._tools: FSDPMemTracker for FSDP2, MemTracker otherwise), which
counts every tensor by what it is. The peak, by kind: parameters, gradients, optimizer state, activations
(with the temporaries of backward), and FSDP's communication buffers. Launched for real (torchrun, N ranks),
the same code tracks the real tensors instead: the measured peak the estimate is checked against
(tests/test_memory.py). A pipeline's stages are estimated one PP rank at a time, by the recipe (each recipe's
estimate.py; fsdp_tp_pp: replay_pipeline).

What it leaves out, and why the verdict keeps 10% of the GPU free: the CUDA context and kernels (~0.5-1 GB),
NCCL's buffers, the caching allocator's fragmentation. On a GPU, `torch.cuda.max_memory_allocated` is the
number to compare with (bench/gpu_check.py records it).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from .errors import ConfigError

# What nvidia-smi reports as each GPU's memory, in MiB.
GPU_MEMORY_MIB = {"a100-40": 40960, "a100-80": 81920, "h100": 81559, "h200": 143771}
USABLE = 0.9  # the share a run can count on; the rest: CUDA context, NCCL buffers, fragmentation


def add_options(p) -> None:
    """--estimate-memory GPU, --world N, --estimate-json FILE (the recipes that estimate: ddp, fsdp_tp_pp, deepspeed)."""
    from pathlib import Path

    g = p.add_argument_group("will it fit (one CPU process, no GPU needed)")
    g.add_argument("--estimate-memory", metavar="GPU", default=None,
                   help="report the per-GPU memory of this layout on --world ranks and whether it fits on GPU: "
                        "a100-40, a100-80, h100 or h200 (exit 1 when it does not)")
    g.add_argument("--world", type=int, default=None,
                   help="the ranks of the job to estimate; without it, --estimate-memory measures the launched run")
    g.add_argument("--estimate-json", type=Path, default=None, help="also write the estimate to this JSON file")


def estimate_world(args, launched_world: int) -> tuple[bool, int]:
    """(measured, world size): --world N estimates N ranks from one process; without it, the launched run (one
    process, or torchrun's ranks) measures itself."""
    if args.world is None:
        return True, launched_world
    if launched_world > 1:
        raise ConfigError(f"--world {args.world} on a launched world of {launched_world} ranks: estimate from one "
                          "process (python, not torchrun), or leave --world out to measure this run")
    return False, args.world


def ddp_bucket_bytes(module, ddp_module=None) -> int:
    """DDP's gradient buckets on each rank: a second copy of every gradient (gradient_as_bucket_view off, the
    default), held for the whole run (allocated when the wrapper is built, rebuilt once in the first backward
    in the order the gradients arrive). With the real wrapper
    (``ddp_module``): the reducer's own bucket sizes; else the gradients' bytes it would allocate."""
    if ddp_module is not None:
        sizes = str(ddp_module._get_ddp_logging_data().get("bucket_sizes", ""))
        return sum(int(size) for size in sizes.split(",") if size.strip())
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def gpu_memory(name: str) -> int:
    """The memory of the GPU called ``name`` (--estimate-memory), in bytes."""
    if name not in GPU_MEMORY_MIB:
        raise ConfigError(f"--estimate-memory {name}: name the GPU, one of {', '.join(GPU_MEMORY_MIB)}")
    return GPU_MEMORY_MIB[name] * 2**20


def fake_process_group(world_size: int) -> None:
    """Rank 0 of a world of ``world_size`` ranks whose collectives do nothing (PyTorch's "fake" backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


@contextlib.contextmanager
def fake_tensors(enabled: bool):
    """Tensors with shapes and dtypes but no storage (FakeTensorMode), or real ones (``enabled`` False).

    A DeviceMesh computes its coordinates from a tensor of rank numbers, which a fake tensor does not hold:
    FSDP2 over TP builds one (the DP and TP meshes joined) while it shards, so that step runs on real
    tensors (a few integers)."""
    if not enabled:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def on_real_tensors(meshes):
        with unset_fake_temporarily():
            return concatenate(meshes)

    DeviceMesh._concatenate = staticmethod(on_real_tensors)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)


KINDS = {  # the tracker's kinds of tensor, by what the report calls them
    "parameters": ("Parameter", "Buffer", "Sharded Param", "Unsharded Param"),
    "gradients": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer state": ("Optstate", "OptState"),
    "activations": ("Activation", "Temp", "Inputs", "Other"),
    "communication buffers": ("All Gather", "Reduce Scatter"),
}


def tracked_peak(modules: list, optimizers: list, train_step: Callable[[], None], fsdp: bool,
                 steps: int = 2) -> dict[str, int]:
    """The peak of ``steps`` calls of ``train_step`` (forward, backward, optimizer step) under the memory
    tracker, by kind of tensor (KINDS) and in total, in bytes; ``modules`` and ``optimizers``: the rank's
    (several with an interleaved pipeline). Two steps: the optimizer state exists from the first step on, and
    the second step's peak holds it."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp:  # (FSDP's own kinds for the first module; the others' tensors by the plain tracker's kinds)
        tracker = FSDPMemTracker(modules[0], optimizers[0])
        tracker.track_external(*modules[1:], *optimizers[1:])
    else:
        tracker = MemTracker()
        tracker.track_external(*modules, *optimizers)

    def called_again(module, inputs) -> None:
        """A pipeline runs a stage once per micro-batch; the tracker takes a top-level module called twice in
        one step for the next step and refuses it: forget the stage's own stats before each call (its blocks'
        are kept; the peak, what is read here, is the device's, not a module's)."""
        in_backward = torch._C._current_graph_task_id() != -1  # (a checkpointed block runs forward again in backward)
        if module in roots and module in tracker.memory_tracking and not in_backward:
            del tracker.memory_tracking[module]

    roots = set(modules)
    # (global hooks run in the order registered: this one before the tracker's, which it registers on entry)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(called_again)
    try:
        with tracker:
            for _ in range(steps):
                train_step()
                tracker.reset_mod_stats()  # (the tracker counts one iteration of each module's hooks at a time)
    finally:
        handle.remove()
    return peak_by_kind(tracker, optimizers)


def peak_by_kind(tracker, optimizers: list) -> dict[str, int]:
    """The tracker's peak by kind of tensor (KINDS) and in total, in bytes (the device's; not the meta device,
    where DeepSpeed keeps placeholders)."""
    (snapshot,) = [snapshot for device, snapshot in tracker.get_tracker_snapshot("peak").items() if device.type != "meta"]
    by_name = {getattr(kind, "value", kind): size for kind, size in snapshot.items()}
    peak = {label: sum(by_name.get(name, 0) for name in names) for label, names in KINDS.items()}
    peak["total"] = by_name["Total"]
    # The optimizer state is held from the first step on, through the second step's peak. On fake tensors with
    # FSDP2 over TP the tracker counts it under other kinds (measured: the total within 1% of the real run's, but
    # its optimizer state 0 of 1.1 MB): it is counted from the optimizer itself, and taken from the activations,
    # the kind the tracker's remainder falls into, so that the kinds still add up to the (right) total.
    held = sum(optimizer_state_bytes(optimizer) for optimizer in optimizers)
    if held > peak["optimizer state"]:
        peak["activations"] = max(0, peak["activations"] - (held - peak["optimizer state"]))
        peak["optimizer state"] = held
    return peak


@contextlib.contextmanager
def fake_value_reads(enabled: bool):
    """On fake tensors, the values a framework reads while it steps (``.item()``, ``bool()``) have no data:
    answer them as a healthy step's would, flags (bool, integer) 0 (no overflow, no inf or nan) and numbers
    (floating) 1.0 (a step count, a finite gradient norm). DeepSpeed reads both in every optimizer step."""
    if not enabled:
        yield
        return
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class HealthyValues(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return 1.0 if args[0].dtype.is_floating_point else 0
            return func(*args, **(kwargs or {}))

    with HealthyValues():
        yield


def optimizer_state_bytes(optimizer) -> int:
    """The bytes of this rank's optimizer state (a DTensor's: its local shard)."""
    import torch

    tensors = [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
    local = [getattr(tensor, "_local_tensor", tensor) for tensor in tensors]
    return sum(tensor.numel() * tensor.element_size() for tensor in local if tensor.dim() > 0)  # (not the step counts)


def report(recipe: str, peak: dict[str, int], gpu: str, layout: str, measured: bool, advice: list[str]) -> int:
    """Print the per-GPU memory by kind against ``gpu``'s, whether it fits and, if not, what to change
    (``advice``, the recipe's, most useful first); 0 when it fits, 1 when it does not."""
    capacity = gpu_memory(gpu)
    how = "measured (real tensors, tracked)" if measured else "estimated on one CPU process (fake tensors)"
    print(f"[{recipe}] memory per GPU, {layout}: {how}")
    for label in KINDS:
        print(f"[{recipe}]   {label:<22} {peak[label] / 2**30:9.3f} GiB")
    print(f"[{recipe}]   {'total at the peak':<22} {peak['total'] / 2**30:9.3f} GiB of {capacity / 2**30:.1f} GiB ({gpu}; "
          f"{USABLE:.0%} usable: {USABLE * capacity / 2**30:.1f} GiB)")
    fits = peak["total"] <= USABLE * capacity
    print(f"[{recipe}] {'fits' if fits else 'does not fit'} on {gpu}"
          + ("" if fits else ": " + "; or ".join(advice)), flush=True)
    return 0 if fits else 1


# A Perlmutter GPU node: 4 GPUs and 256 GB of host memory (the A100-80 nodes: 512 GB)
RANKS_PER_NODE, NODE_HOST_BYTES = 4, 256 * 10**9


def host_bytes(stages: list, optimizers: list) -> dict[str, int]:
    """What a rank needs in host memory besides the process itself, in bytes: to load (the largest tensor,
    whole: the most a rank reads at once; its shards then go to the GPU) and to write a checkpoint in the
    background (--async-checkpoint copies the rank's parameters and optimizer state to host memory first)."""
    import torch

    params = [p for stage in stages for p in stage.parameters()]
    local = [getattr(p, "_local_tensor", p) for p in params]
    state = sum(t.numel() * t.element_size() for t in local) + sum(optimizer_state_bytes(o) for o in optimizers)
    largest = max((p.numel() * torch.finfo(torch.float32).bits // 8 for p in params), default=0)
    return {"load": largest, "async_checkpoint": state}


def report_host(recipe: str, per_rank: dict[str, int], world: int) -> None:
    """The host memory a node needs for the ranks it holds (RANKS_PER_NODE, or the world if fewer)."""
    ranks = min(world, RANKS_PER_NODE)
    load, checkpoint = (ranks * per_rank[kind] for kind in ("load", "async_checkpoint"))
    print(f"[{recipe}] host memory per node ({ranks} ranks), besides the processes: {load / 2**30:.1f} GiB to load "
          f"(each rank reads one tensor at a time), {checkpoint / 2**30:.1f} GiB for --async-checkpoint (each rank's "
          f"model and optimizer state); a Perlmutter GPU node has {NODE_HOST_BYTES / 10**9:.0f} GB", flush=True)


def advice(peak: dict[str, int], sharded_over: int, ranks: int, activation_checkpointing: bool) -> list[str]:
    """What to change when it does not fit, the largest kind of memory first."""
    states = peak["parameters"] + peak["gradients"] + peak["optimizer state"]
    shard = [f"shard the model over more ranks (parameters, gradients and optimizer state are split over "
             f"{sharded_over} of {ranks}: --dp-shard, or --tp within a node)"] if sharded_over < ranks else [
        "more ranks (--world: each holds 1/N of the model's states)"]
    smaller = ([] if activation_checkpointing else ["--activation-checkpointing (recompute each block's activations "
                                                    "in backward)"]) + [
        "fewer rows per rank (a smaller --global-batch, or more data-parallel ranks)"]
    return shard + smaller if states >= peak["activations"] else smaller + shard
