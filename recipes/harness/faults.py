"""Mistakes made on purpose, for the tests only: each negative control breaks one step of a run so that a test
can show its check catches it (a parity check that cannot fail proves nothing). Switched on by the
environment, ``HPCML_TEST_FAULT=NAME``, never by an option: nothing of it shows in a recipe's --help, and the
training loops hold no test code. A recipe hands what it built to ``inject`` once, before its first step; the
fault then enters through the framework's own hooks:

    grad-sum               the ranks' gradients summed instead of averaged: each parameter's gradient hook
                           multiplies it by the data-parallel size before the all-reduce averages it
    accum-sum              the micro-batches' gradients summed instead of averaged (the same hook, times the
                           micro-batches)
    no-grad-allreduce      the ranks never average their gradients (a DDP communication hook that returns the
                           rank's own; DeepSpeed's all-reduce, Megatron's and FSDP's gradient sync switched off)
    tp-no-reduce           tensor parallelism's row-wise layers keep their partial sums (no all-reduce)
    pp-loss-unscaled       the pipeline schedule does not divide the loss by the micro-batches
    last-microbatch-loss   a pipeline trains on its last micro-batch's loss alone
    resume-fresh-optimizer a resume restores the weights, not the optimizer state (an optimizer load hook
                           empties it again)
    resume-data-from-start a resumed run reads the data from the first step again (harness/data.py)
    schedule-restart       a resumed run starts its learning-rate schedule again (harness/run.py)
    step-time-from-start   a step timed from its own start to its end, as the loop once did: the time between
                           steps (the checkpoint written before it) is in no step's time (harness/run.py)
    track-every-step       W&B and MLflow receive each step as it is logged, not when a checkpoint holds it
                           (a resume after a crash then records the steps since the checkpoint twice)
    rank-mean-loss         instruction data's loss as each rank's (and micro-batch's) mean over its own trained
                           tokens, averaged (Hugging Face Trainer's bug), not the global batch's sum over its
                           trained tokens (the recipe reads it where it weighs the loss: harness/data.py
                           token_weights)
    mask-ignored           instruction data's loss mask ignored: every token of a conversation trained, prompts
                           too (harness/data.py ConversationData)
    pack-unconfined        packed instruction data (--pack) given to the model as one sequence per window: its
                           positions do not restart at each conversation, and attention crosses conversations
                           (harness/data.py ConversationData)
    whole-model-load       every rank loads the whole Hugging Face model before cutting and sharding it (the
                           sharded load skipped: recipes/fsdp_tp_pp reads it where it builds the model)
    batch-p2p-with-vp      Megatron's batched p2p with virtual stages at PP 2 let through, which the recipe
                           refuses (it trains on swapped activations; recipes/megatron_tp_pp/layout.py)
    slow-rank              rank 1 sleeps SLOW_RANK_S in each forward pass (harness/profiling.py): the straggler
                           check must name it (harness/run.py)
    slow-node              the same for the rank on the job's node HPCML_TEST_SLOW_NODE=@I (a slow machine:
                           --leave-stragglers must leave it out, and the rank that replaces it is not slow)
    program-error          every rank raises the same exception after step 5, as a bug in the program would
                           (harness/run.py): the launcher must end the job, not restart it on other nodes
    program-error-as-node  the same error, and the launcher takes every failure for a node's (its
                           classification off, slurm/lib/healing.sh): it restarts the job, which its test catches

Where a framework has no such hook (TensorFlow; Horovod's torch optimizer; DTensor, which binds a row-wise
layer's reduction when its plan is applied), the recipe reads the fault where it applies, and says so.
A fault a recipe does not support, or one that would change nothing in the run's layout (a gradient sum on one
rank), is a ConfigError: a control that silently does nothing would "pass" its test.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterable

from .errors import ConfigError

FAULT_ENV = "HPCML_TEST_FAULT"
FAULTS = ("grad-sum", "accum-sum", "no-grad-allreduce", "tp-no-reduce", "pp-loss-unscaled", "last-microbatch-loss",
          "resume-fresh-optimizer", "resume-data-from-start", "schedule-restart", "batch-p2p-with-vp",
          "track-every-step", "step-time-from-start", "rank-mean-loss", "mask-ignored", "pack-unconfined", "whole-model-load",
          "program-error", "program-error-as-node", "slow-rank",
          "slow-node")


def active(name: str) -> bool:
    """Is the fault ``name`` switched on for this process?"""
    assert name in FAULTS, name
    return os.environ.get(FAULT_ENV) == name


def requested() -> str | None:
    return os.environ.get(FAULT_ENV) or None


def check(recipe: str, supported: Iterable[str], applies: dict[str, bool] | None = None) -> None:
    """Refuse a fault ``recipe`` cannot inject, or one ``applies`` says changes nothing in this layout (every
    rank, through ``inject``)."""
    fault = requested()
    if fault is None:
        return
    supported = tuple(supported)
    if fault not in supported:
        raise ConfigError(f"{FAULT_ENV}={fault}: {recipe} injects only {', '.join(supported)}")
    if applies is not None and not applies.get(fault, True):
        raise ConfigError(f"{FAULT_ENV}={fault} changes nothing in this layout: it needs the parallelism it breaks")


def scale_gradients(parameters: Iterable[Any], factor: float) -> None:
    """Each parameter's gradient times ``factor`` as it is computed: a tensor hook runs before the gradient
    is accumulated, so before any all-reduce a data-parallel wrapper starts from the accumulation."""
    for parameter in parameters:
        if parameter.requires_grad:
            parameter.register_hook(lambda grad, factor=factor: grad * factor)


def _own_gradient(state, bucket):
    """A DDP communication hook that communicates nothing: each rank keeps its own gradients."""
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _empty_after_load(optimizer) -> None:
    """After ``load_state_dict``: Adam's moments and step count gone, as in a new optimizer."""
    optimizer.state.clear()


def _zero_after_load(optimizer) -> None:
    """After ``load_state_dict``: every state tensor zero (megatron-core's optimizers index their state, and
    keep it where an empty dict would be refilled differently), so the moments start again."""
    import torch

    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                value.zero_()


def torch_optimizers(optimizer) -> list:
    """The torch.optim optimizers inside a framework's wrapper (accelerate's, megatron-core's, a chain of them)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for one in chained for inner in torch_optimizers(one)]
    while hasattr(optimizer, "optimizer"):  # the wrappers load the inner optimizer's state through it
        optimizer = optimizer.optimizer
    return [optimizer]


def inject(recipe: str, supported: Iterable[str], *, parameters: Iterable[Any] = (), data_parallel: int = 1,
           micro_batches: int = 1, ddp_model=None, optimizers=(), engine=None, megatron_chunks=(), fsdp_modules=(),
           schedule=None, applies: dict[str, bool] | None = None) -> str | None:
    """Switch on the fault HPCML_TEST_FAULT names, if any, on what the recipe built; returns its name.

    ``supported``: the faults this recipe can inject. ``parameters``: the model's (gradient hooks);
    ``data_parallel``, ``micro_batches``: what the gradients are averaged over. ``ddp_model``: a torch DDP
    module (communication hook). ``optimizers``: torch optimizers or a framework's wrappers of them.
    ``engine``: a DeepSpeed engine. ``megatron_chunks``: megatron-core's DDP chunks. ``fsdp_modules``: FSDP2
    modules. ``schedule``: a torch.distributed.pipelining schedule. ``applies``: fault -> whether this
    layout has what it breaks. A recipe whose framework has no hook for a fault (TensorFlow, Horovod's optimizer)
    acts on the name returned, where the fault applies."""
    fault = requested()
    applies = {"grad-sum": data_parallel > 1, "no-grad-allreduce": data_parallel > 1, "accum-sum": micro_batches > 1,
               **(applies or {})}
    check(recipe, supported, applies)
    if fault is None or fault in ("resume-data-from-start", "schedule-restart", "step-time-from-start", "batch-p2p-with-vp",
                                  "rank-mean-loss", "whole-model-load", "program-error", "program-error-as-node",
                                  "slow-rank", "slow-node"):  # (where they act)
        return fault
    parameters = list(parameters)
    if fault == "grad-sum" and fsdp_modules:  # FSDP's own switches: reduce with SUM and divide by 1
        for module in fsdp_modules:
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    elif fault == "grad-sum":
        scale_gradients(parameters, data_parallel)
    elif fault == "accum-sum":
        scale_gradients(parameters, micro_batches)
    elif fault == "no-grad-allreduce":
        if ddp_model is not None:
            ddp_model.register_comm_hook(None, _own_gradient)
        elif engine is not None:  # DeepSpeed's own switches (ZeRO-0; a pipeline's replicas of a stage)
            engine.enable_backward_allreduce = engine.pipeline_enable_backward_allreduce = False
        elif megatron_chunks:
            for chunk in megatron_chunks:
                chunk.finish_grad_sync = lambda *args, **kwargs: None
        elif fsdp_modules:
            for module in fsdp_modules:
                module.set_requires_gradient_sync(False)
        # (else the recipe acts on the name returned: Horovod's optimizer and TensorFlow have no hook for it)
    elif fault == "tp-no-reduce" and megatron_chunks:
        _break_megatron_tensor_parallel_reduce()
    elif fault == "tp-no-reduce":
        pass  # DTensor binds a layer's reduction when the plan is applied: recipes/fsdp_tp_pp/parallelize.py
    elif fault == "pp-loss-unscaled":
        schedule.scale_grads = False  # (the schedule divides the gradients by the micro-batches when True)
    elif fault == "last-microbatch-loss":
        engine.module.loss_fn = _LastMicroBatchOnly(engine.module.loss_fn, micro_batches)
    elif fault == "resume-fresh-optimizer":
        if engine is not None:  # DeepSpeed loads its (possibly partitioned) optimizer state itself
            engine.load_checkpoint = functools.partial(engine.load_checkpoint, load_optimizer_states=False)
        else:
            for one in (inner for optimizer in optimizers for inner in torch_optimizers(optimizer)):
                one.register_load_state_dict_post_hook(_zero_after_load if megatron_chunks else _empty_after_load)
    return fault


def _break_megatron_tensor_parallel_reduce() -> None:
    """megatron-core: its row-parallel layers' all-reduce becomes the identity (looked up at every forward)."""
    from megatron.core import tensor_parallel

    tensor_parallel.layers.reduce_from_tensor_model_parallel_region = lambda tensor, group=None: tensor


class _LastMicroBatchOnly:
    """A pipeline's loss function under which only the last micro-batch of each step gives gradients (the
    others report their true loss, detached), as a pipeline that kept only the last micro-batch's loss trains."""

    def __init__(self, loss_fn, micro_batches: int):
        self.loss_fn, self.micro_batches, self.calls = loss_fn, micro_batches, 0

    def __call__(self, outputs, labels):
        self.calls += 1
        loss = self.loss_fn(outputs, labels)
        return loss if self.calls % self.micro_batches == 0 else loss.detach() + 0.0 * loss
