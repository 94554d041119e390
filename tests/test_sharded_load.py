"""A Hugging Face model larger than one rank's memory (recipes/harness/hf_model.py): built empty, cut and sharded,
each rank reading only its part of the safetensors files; exported tensor by tensor; broken files refused in one
line.

The bound, measured on 4 FSDP2 ranks with a Llama of 126 MB in fp32 (saved in bf16, as Llama ships; trained in
fp32): each rank's host memory (its anonymous resident memory, sampled every 2 ms, above what it held before it
built the model: harness.HostMemory) must stay within

    load     the model / 4 + its largest tensor + MARGIN
    step     the recipe's own estimate of the step on this layout (--estimate-memory, fake tensors, from
             config.json alone) + STEP_MARGIN
    check    the end-of-run check that the ranks agree adding at most 4 x the largest tensor + MARGIN
    export   what the rank held before the export + the largest tensor + MARGIN
    resume   on 2 ranks from the 4 ranks' checkpoint: the load within half the model + the largest tensor +
             MARGIN, and the resume adding no more than that

DeepSpeed ZeRO-3 on the same 4 ranks (transformers loads it under zero.Init): the load and export bounds.

and the negative control (HPCML_TEST_FAULT=whole-model-load: every rank loads the whole model before sharding,
as the recipe did before) must exceed the load bound on every rank. The runs fix glibc's mmap threshold
(MALLOC_MMAP_THRESHOLD_): otherwise glibc keeps the freed buffers of FSDP2's gathers in its heap, and the
measure is of glibc's cache, not of what the rank holds (measured here: ~5x the step's tensors).
The parity of the sharded load with one process (train, evaluate, export: tests/parity.toml's fsdp2-hf,
fsdp2xtp-hf, fsdp2-lora and the @sft rows) and its bit-for-bit equality with from_pretrained (below) are the
numbers; these are the memory.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from support.cluster import HOST_SHAPED_DIR, job_state, submit_recipe
from support.curves import read_metrics
from support.runs import assert_ok, python, recipe_env, REPO, run, run_recipe, torchrun

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402

RECIPE = REPO / "recipes" / "fsdp_tp_pp" / "train.py"
MiB = 1024**2
MARGIN = 24 * MiB  # the meta model's Python objects, DCP's read plan, the slice being read (bf16)
STEP_MARGIN = 48 * MiB  # gloo's copies of FSDP2's gathers, the autograd engine, what the estimate does not track
SHAPE = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 128}
RUN = ["--tp", "1", "--dp-shard", "4",  # (RUN[4:]: without the layout, for DeepSpeed)
       "--vocab-size", "4096", "--seq-len", "32", "--global-batch", "4", "--max-steps", "2", "--optimizer", "sgd",
       "--checkpoint-every", "0"]
MEASURED = {"MALLOC_MMAP_THRESHOLD_": str(MiB), "OMP_NUM_THREADS": "1"}


def save_llama(directory: Path, dtype: torch.dtype, shard_bytes: int | None = None, **shape) -> Path:
    """A Llama of ``shape`` with random weights, as save_pretrained writes one (config.json, safetensors: one
    file, or shards of ``shard_bytes`` and their index), without building the model (quick at any size)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in LlamaForCausalLM(config).named_parameters()}
    generator = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(size, generator=generator) * 0.02).to(dtype) for name, size in shapes.items()}
    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    if shard_bytes is None:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    files, size = [[]], 0
    for name, tensor in tensors.items():
        if files[-1] and size + tensor.nbytes > shard_bytes:
            files, size = files + [[]], 0
        files[-1].append(name)
        size += tensor.nbytes
    weight_map = {}
    for index, names in enumerate(files):
        file = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
        save_file({name: tensors[name] for name in names}, directory / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in names})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


@pytest.fixture(scope="module")
def llama_126mb(tmp_path_factory) -> Path:
    return save_llama(tmp_path_factory.mktemp("models") / "llama-126mb", torch.bfloat16, **SHAPE)


def model_bytes() -> tuple[int, int]:
    """(the model's bytes in fp32, its largest tensor's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        sizes = [p.numel() * 4 for p in LlamaForCausalLM(LlamaConfig(**SHAPE)).parameters()]
    return sum(sizes), max(sizes)


def test_zero3_loads_and_exports_within_the_same_bound(llama_126mb, tmp_path):
    """DeepSpeed ZeRO-3 on the same 4 ranks: transformers' own load under zero.Init (each parameter
    partitioned as it is read) and the export a tensor at a time keep within the same bounds; the engine's
    own buffers (its flat partitions and buckets: DeepSpeed's) are recorded apart, as "engine"."""
    total, largest = model_bytes()
    result = run_recipe(REPO / "recipes" / "deepspeed" / "train.py", tmp_path / "run", 4, "--model", f"hf:{llama_126mb}",
                        "--zero-stage", "3", *RUN[4:],
                        "--export-hf", str(tmp_path / "export"), timeout=600, **MEASURED)
    assert_ok(result)
    memory = read_metrics(tmp_path / "run")["host_memory"]
    assert len(memory) == 4 and all("engine_peak_bytes" in rank for rank in memory)
    loads = [rank["load_peak_bytes"] for rank in memory]
    exports = [rank["export_peak_bytes"] - rank["export_start_bytes"] for rank in memory]
    assert max(loads) <= total / 4 + largest + MARGIN, loads
    assert max(exports) <= largest + MARGIN, exports
    print(f"ZeRO-3, per rank, MB: load {[round(b / 1e6, 1) for b in loads]}, engine adds "
          f"{[round((r['engine_peak_bytes'] - r['engine_start_bytes']) / 1e6, 1) for r in memory]}, step "
          f"{[round(r['step_peak_bytes'] / 1e6, 1) for r in memory]}, export adds {[round(b / 1e6, 1) for b in exports]}")


@pytest.mark.parametrize("fault", [None, "whole-model-load"])
def test_each_rank_holds_its_share_to_load_step_and_export(fault, llama_126mb, tmp_path):
    total, largest = model_bytes()
    assert 120e6 < total < 130e6 and largest < total / 10  # (the shape this test is about)
    fault_env = {"HPCML_TEST_FAULT": fault} if fault else {}
    result = run_recipe(RECIPE, tmp_path / "run", 4, "--model", f"hf:{llama_126mb}", *RUN,
                        *([] if fault else ["--export-hf", str(tmp_path / "export")]), timeout=600, **MEASURED, **fault_env)
    assert_ok(result)
    memory = read_metrics(tmp_path / "run")["host_memory"]
    assert len(memory) == 4
    load_bound = total / 4 + largest + MARGIN
    loads = [rank["load_peak_bytes"] for rank in memory]
    if fault:  # every rank held the whole model: caught
        assert min(loads) > load_bound, (loads, load_bound)
        assert min(loads) > total, loads
        print(f"whole-model-load, per rank, MB: load {[round(b / 1e6, 1) for b in loads]} (bound {load_bound / 1e6:.1f})")
        return
    assert max(loads) <= load_bound, (loads, load_bound)

    estimate = tmp_path / "estimate.json"
    estimated = python(RECIPE, "--out-dir", str(tmp_path / "estimate"), "--model", f"hf:{llama_126mb}", *RUN,
                       "--dtype", "float32", "--estimate-memory", "a100-40", "--world", "4", "--estimate-json", str(estimate),
                       env=recipe_env(), timeout=300)
    assert_ok(estimated)
    step_bound = json.loads(estimate.read_text())["peak_bytes"]["total"] + STEP_MARGIN
    steps = [rank["step_peak_bytes"] for rank in memory]
    assert max(steps) <= step_bound, (steps, step_bound)

    exports = [rank["export_peak_bytes"] - rank["export_start_bytes"] for rank in memory]
    assert max(exports) <= largest + MARGIN, (exports, largest + MARGIN)
    # the end-of-run check that the ranks agree: a parameter gathered at a time (the tensor, its flat copy and
    # the max and min being reduced), never the whole model
    checks = [rank["check_peak_bytes"] - rank["check_start_bytes"] for rank in memory]
    assert max(checks) <= 4 * largest + MARGIN, (checks, 4 * largest + MARGIN)
    from safetensors import safe_open  # the export: every tensor, in fp32, one file set
    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as exported:
        assert sum(math.prod(exported.get_slice(name).get_shape()) * 4 for name in exported.keys()) == total

    # resumed on 2 ranks from the 4 ranks' checkpoint (DCP reshards it): the load and the resume stay within a
    # half each (the resume reads into the model and optimizer in place; SGD keeps no state)
    resumed = run_recipe(RECIPE, tmp_path / "run", 2, "--model", f"hf:{llama_126mb}",
                         "--tp", "1", "--dp-shard", "2",
                         "--vocab-size", "4096", "--seq-len", "32", "--global-batch", "4", "--max-steps", "3",
                         "--optimizer", "sgd", "--checkpoint-every", "0", timeout=600, **MEASURED)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout
    again = read_metrics(tmp_path / "run")["host_memory"]
    half_bound = total / 2 + largest + MARGIN
    resumes = [rank["resume_peak_bytes"] - rank["resume_start_bytes"] for rank in again]
    assert max(rank["load_peak_bytes"] for rank in again) <= half_bound, (again, half_bound)
    assert max(resumes) <= half_bound, (resumes, half_bound)
    print(f"per rank, MB above baseline: load {[round(b / 1e6, 1) for b in loads]} (bound {load_bound / 1e6:.1f}), "
          f"step {[round(b / 1e6, 1) for b in steps]} (bound {step_bound / 1e6:.1f}), export adds "
          f"{[round(b / 1e6, 1) for b in exports]} (bound {(largest + MARGIN) / 1e6:.1f}), the check adds "
          f"{[round(b / 1e6, 1) for b in checks]} (bound {(4 * largest + MARGIN) / 1e6:.1f}); on 2 ranks: load "
          f"{[round(rank['load_peak_bytes'] / 1e6, 1) for rank in again]}, resume adds {[round(b / 1e6, 1) for b in resumes]} "
          f"(bound {half_bound / 1e6:.1f})")


# A Llama of 1.7 GB in fp32 (860 MB as bf16 files): large enough that the whole model on each of a node's 2 ranks
# stands far apart from their shares, small enough for a CPU step of LoRA on it.
LARGER = {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 32,
          "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 128}
JOB_MEMORY_MIB = 3500


@pytest.mark.slurm
@pytest.mark.full
def test_a_job_under_a_memory_limit_trains_sharded_where_loading_the_whole_model_is_killed(host_shaped_cluster, tmp_path):
    """The proof a user would believe: slurm/fsdp_tp_pp.sh on one node of the host-shaped cluster (task/cgroup,
    ConstrainRAMSpace: the job's --mem is a hard limit), 2 ranks, LoRA on a Llama of 1.7 GB in fp32, with
    --mem=JOB_MEMORY_MIB. The sharded load trains (COMPLETED, each rank's host memory in metrics.json); the
    whole model on every rank (HPCML_TEST_FAULT=whole-model-load, the recipe's old path) is ended by the
    kernel's OOM killer while loading (srun: "Out Of Memory"; the job FAILED). Measured: the sharded job ~3.1 GB
    of the node's anonymous memory at its peak (the step), the whole-model one ~4.0 GB (the load): 3500 MiB lies
    ~0.5 GB from each. Full tier (~1 minute); the bound test above proves the same per rank, within stated
    margins, in the default tier. MALLOC_MMAP_THRESHOLD_ as there: otherwise glibc keeps FSDP2's freed gather
    buffers in its heap, which is glibc's cache, not what the rank holds."""
    config = run(["scontrol", "show", "config"], env=recipe_env(**host_shaped_cluster)).stdout
    if not re.search(r"^ConstrainRAMSpace\s*=\s*yes", config, re.M):
        pytest.skip("this machine's cgroup v1 memory hierarchy is not writable: the host-shaped cluster sets no "
                    "memory limit per job (tests/cluster/local_slurm.sh)")
    model = save_llama(tmp_path / "llama", torch.bfloat16, **LARGER)
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device("meta"):
        total = sum(p.numel() * 4 for p in LlamaForCausalLM(LlamaConfig(**LARGER)).parameters())
    assert 1.6e9 < total < 1.8e9, total
    recipe_args = ["--model", f"hf:{model}", "--tp", "1", "--dp-shard", "2", "--lora-rank", "8", "--vocab-size", "4096",
                   "--seq-len", "32", "--global-batch", "2", "--max-steps", "2", "--checkpoint-every", "0", "--log-every", "1"]
    states = {}
    for fault in ("whole-model-load", None):
        work = tmp_path / (fault or "sharded")
        work.mkdir()
        code, job = submit_recipe(host_shaped_cluster, work, "fsdp_tp_pp", "--wait", "-N", "1", "--ntasks-per-node", "2",
                                  "--cpus-per-task", "1", f"--mem={JOB_MEMORY_MIB}M", recipe_args=recipe_args,
                                  MALLOC_MMAP_THRESHOLD_=str(MiB), **({"HPCML_TEST_FAULT": fault} if fault else {}))
        states[fault] = (code, job_state(job, cluster_dir=HOST_SHAPED_DIR), (work / f"fsdp_tp_pp-{job}.out").read_text())
    code, state, log = states["whole-model-load"]
    assert code != 0 and state == "FAILED" and re.search(r"^srun: error: cpu000001: task \d: Out Of Memory$", log, re.M), \
        (state, log[-3000:])
    assert "step     1 |" not in log, log[-3000:]  # (killed while loading)
    code, state, log = states[None]
    assert (code, state) == (0, "COMPLETED"), (state, log[-3000:])
    metrics = read_metrics(tmp_path / "sharded" / "run")
    assert metrics["world_size"] == 2 and len(metrics["host_memory"]) == 2
    print(f"--mem={JOB_MEMORY_MIB}M, model {total / 1e6:.0f} MB in fp32; sharded, per rank, MB: baseline "
          f"{[round(r['baseline_bytes'] / 1e6) for r in metrics['host_memory']]}, load above it "
          f"{[round(r['load_peak_bytes'] / 1e6) for r in metrics['host_memory']]}, step "
          f"{[round(r['step_peak_bytes'] / 1e6) for r in metrics['host_memory']]}")


LOAD_CHECK = """
import sys, torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
sys.path[:0] = [{recipes!r}, {recipes!r} + "/fsdp_tp_pp"]
import harness, parallelize, train
args = train.parse_args(["--model", "hf:" + {model!r}, "--seq-len", "16", "--vocab-size", "256", "--global-batch", "4",
                         "--tp", "{tp}", "--dp-shard", "{dp_shard}"])
env = harness.detect_dist_env()
device, _ = harness.setup_torch_distributed(env, 60)
spec = harness.model_spec(args)
layout = parallelize.choose_layout(args, env.world_size, spec)
mesh = parallelize.build_mesh(layout, device)
model = spec.build_empty()
plan = parallelize.tensor_parallel_plan(model) if layout.tp > 1 else {{}}
if layout.tp > 1:
    parallelize.apply_tensor_parallel(model, mesh["tp"], plan)
if layout.fsdp:
    parallelize.apply_fsdp(model, parallelize.fsdp_units(model), mesh["dp_shard"], None)
model.to_empty(device=device)
spec.load_weights(model)
whole = spec.build()
kinds = set()
for name, param in model.named_parameters():
    kinds.add(type(param.data).__name__ + str(getattr(param, "placements", "")))
    gathered = param.full_tensor() if isinstance(param, DTensor) else param
    assert torch.equal(gathered, whole.get_parameter(name)), name
x = torch.arange(16).reshape(1, 16)
loss = model(x, x.roll(-1))  # (the forward through FSDP2's and TP's hooks)
assert torch.equal(loss.full_tensor() if isinstance(loss, DTensor) else loss, whole(x, x.roll(-1))), loss
if env.rank == 0:
    print("EQUAL", sorted(kinds))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("tp, dp_shard", [(1, 2), (2, 2)])
def test_the_loaded_shards_are_from_pretrained_weights_bit_for_bit(tp, dp_shard, tmp_path):
    """FSDP2 (2 ranks) and FSDP2 x TP (2 x 2) from a bf16 model in three safetensors shards and their index:
    every parameter gathered from the ranks' shards equals from_pretrained's (fp32) exactly, and so does the
    loss of a batch (the rotary frequencies, which the files do not hold, computed as from_pretrained does)."""
    model = save_llama(tmp_path / "llama", torch.bfloat16, shard_bytes=40_000, vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64)
    assert len(list(model.glob("model-*.safetensors"))) >= 3
    script = tmp_path / "check.py"
    script.write_text(LOAD_CHECK.format(recipes=str(REPO / "recipes"), model=str(model), tp=tp, dp_shard=dp_shard))
    result = torchrun(script, tp * dp_shard, env=recipe_env(), timeout=300)
    assert_ok(result)
    assert "EQUAL" in result.stdout
    assert "Shard(dim=0)" in result.stdout and (tp == 1 or "Shard(dim=1)" in result.stdout), result.stdout


def test_the_same_adapters_whole_or_sharded(tiny_llama, tmp_path):
    """LoRA on the empty model: after the load its adapters are the whole model's (same seed), in one process."""
    import argparse

    args = argparse.Namespace(model=f"hf:{tiny_llama}", seq_len=16, lora_rank=4, seed=7, out_dir=None)
    spec = harness.model_spec(args)
    whole, empty = spec.build(), spec.build_empty()
    empty.to_empty(device="cpu")
    spec.load_weights(empty)
    mine, theirs = empty.state_dict(), whole.state_dict()
    assert mine.keys() == theirs.keys() and any(".lora_A." in key for key in mine)
    assert all(torch.equal(mine[key], theirs[key]) for key in mine)


# ---- broken files: one line, exit 2, before any rank trains


def cut_short(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])


BROKEN = {
    "a shard named in the index is not there": (lambda d: next(d.glob("model-00002-*")).unlink(), "which is not in"),
    "a shard cut short": (lambda d: cut_short(next(d.glob("model-00003-*"))), "is cut off"),
    "a shard that is not safetensors": (lambda d: next(d.glob("model-00001-*")).write_bytes(b"\x10\x00" * 40),
                                        "cannot be read as safetensors"),
    "an index that is not JSON": (lambda d: (d / "model.safetensors.index.json").write_text("{"), "is not a safetensors index"),
    "a weight the files lack": (lambda d: drop_weight(d, "model.norm.weight"), "hold no model.norm.weight of its Llama"),
}


def drop_weight(directory: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    file = directory / index["weight_map"].pop(name)
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("case", BROKEN)
def test_broken_weight_files_are_one_line(case, tmp_path):
    model = save_llama(tmp_path / "llama", torch.float32, shard_bytes=40_000, vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64)
    breaks, message = BROKEN[case]
    breaks(model)
    args = ["--model", f"hf:{model}", "--tp", "1", "--vocab-size", "256", "--seq-len", "16", "--global-batch", "4",
            "--max-steps", "1"]
    result = python(RECIPE, "--out-dir", str(tmp_path / "run"), *args, "--preflight", "2", env=recipe_env(), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    if case == "a weight the files lack":  # unless asked for: then trained, the missing weight newly drawn
        assert "--allow-new-weights" in lines[0]
        allowed = run_recipe(RECIPE, tmp_path / "allowed", 2, *args, "--dp-shard", "2", "--allow-new-weights",
                             "--checkpoint-every", "0", timeout=300)
        assert_ok(allowed)
        assert read_metrics(tmp_path / "allowed")["last_step"] == 1
