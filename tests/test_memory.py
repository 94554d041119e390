"""Will it fit (recipes/harness/memory.py; recipes/fsdp_tp_pp, ddp and deepspeed --estimate-memory GPU --world N): the estimate
made on one CPU process with fake tensors and a fake process group is the peak a real run of that layout
tracks, kind by kind; sharding divides the model's states; a layout that does not fit says so (exit 1) and
what to change; bad input is one line.

Measured: in 5 layouts of fsdp_tp_pp (one process, FSDP2 2, TP 2, HSDP 2 x 2, FSDP2 x TP 2 x 2) and 3 of DDP (1,
2 and 4 ranks: the model at the per-rank batch plus DDP's gradient buckets) the estimate and the real
run's tracked peak agree within the tolerance below, in total and kind by kind (FSDP2 x TP: the total and the
optimizer state; the split of the rest between parameters and activations is approximate there). With a
pipeline (PP 2: 1F1B, GPipe, 8 micro-batches, FSDP2 2 x PP 2) the estimate replays each PP rank's schedule and is
checked on the first PP rank's total (PP_TOLERANCE). DeepSpeed ZeRO 0-3: its own engine on fake tensors against the
real engine, 0.0%. They are
the same code on fake and on real tensors, with fake and real collectives. What neither sees (the CUDA
context, NCCL's buffers, the allocator's fragmentation) is why the verdict keeps 10% of the GPU free; on a
GPU, bench/gpu_check.py records torch.cuda.max_memory_allocated for the comparison (not yet run on a GPU).
"""

from __future__ import annotations

import json

import pytest

from support.runs import assert_ok, python, REPO, recipe_env, run_recipe

RECIPE = REPO / "recipes" / "fsdp_tp_pp" / "train.py"
DDP_RECIPE = REPO / "recipes" / "ddp" / "train.py"
DEEPSPEED_RECIPE = REPO / "recipes" / "deepspeed" / "train.py"
MODEL = ["--n-layer", "2", "--n-embd", "128", "--n-head", "4", "--seq-len", "128", "--global-batch", "8",
         "--dtype", "float32"]
TOLERANCE = 0.05  # of the measured total, for the total and for each kind
LAYOUTS = {  # name: (ranks, options)
    "one-process": (1, ["--tp", "1"]),
    "fsdp2": (2, ["--tp", "1", "--dp-shard", "2"]),
    "tp2": (2, ["--tp", "2"]),
    "hsdp-2x2": (4, ["--tp", "1", "--dp-replicate", "2", "--dp-shard", "2"]),
    "fsdp2xtp2": (4, ["--tp", "2", "--dp-shard", "2"]),
    "ddp-one-process": (1, []),
    "ddp-2": (2, []),
    "ddp-4": (4, []),
}


def recipe_of(name: str):
    return DDP_RECIPE if name.startswith("ddp") else DEEPSPEED_RECIPE if name.startswith("deepspeed") else RECIPE


def estimate(tmp_path, name: str, ranks: int, options: list[str], gpu: str = "a100-40", model=MODEL):
    """(exit code, stdout, the JSON report) of an estimate from one process for ``ranks`` ranks."""
    out = tmp_path / f"{name}.json"
    result = python(recipe_of(name), "--out-dir", str(tmp_path / "run"), *model, *options, "--estimate-memory", gpu,
                    "--world", str(ranks), "--estimate-json", str(out), env=recipe_env(), timeout=300)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    return result.returncode, result.stdout, json.loads(out.read_text())


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_estimate_from_one_process_is_the_peak_a_real_run_tracks(name, tmp_path):
    ranks, options = LAYOUTS[name]
    code, stdout, estimated = estimate(tmp_path, name, ranks, options)
    assert code == 0 and "estimated on one CPU process (fake tensors)" in stdout and "fits on a100-40" in stdout
    measured_json = tmp_path / "measured.json"
    assert_ok(run_recipe(recipe_of(name), tmp_path / "real", ranks, *MODEL, *options, "--estimate-memory", "a100-40",
                         "--estimate-json", str(measured_json)))
    measured = json.loads(measured_json.read_text())
    assert measured["measured"] and not estimated["measured"]
    assert measured["layout"] == estimated["layout"] and measured["world"] == estimated["world"] == ranks
    total = measured["peak_bytes"]["total"]
    assert total > 1e6  # (a peak worth comparing: MiBs of activations and states)
    assert abs(estimated["peak_bytes"]["total"] - total) <= TOLERANCE * total, (estimated["peak_bytes"], measured["peak_bytes"])
    # Kind by kind; FSDP2 x TP on fake tensors: the optimizer state (counted from the optimizer), not the split
    # of the rest between parameters and activations (harness/memory.py: tracked_peak)
    kinds = ["optimizer state"] if name == "fsdp2xtp2" else list(measured["peak_bytes"])
    for kind in kinds:
        assert abs(estimated["peak_bytes"][kind] - measured["peak_bytes"][kind]) <= TOLERANCE * total, \
            (kind, estimated["peak_bytes"], measured["peak_bytes"])


PIPELINES = {  # name: (ranks, options); the first PP rank measured (harness/memory.py: the later stages' backward
    "pp2-1f1b": (2, ["--tp", "1", "--pp", "2"]),  # is not trackable), every PP rank estimated
    "pp2-gpipe": (2, ["--tp", "1", "--pp", "2", "--pp-schedule", "GPipe"]),
    "pp2-8-micro-batches": (2, ["--tp", "1", "--pp", "2", "--micro-batches", "8"]),
    "pp2xfsdp2": (4, ["--tp", "1", "--pp", "2", "--dp-shard", "2"]),
}
# (estimate - measured) / measured. Measured here: -2.6% to +4.4%; the real peak itself moves by up to 7% between two
# runs of the same layout (when a send of the pipeline completes against the next forward), the estimate does not.
PP_TOLERANCE = (-0.05, 0.08)


@pytest.mark.parametrize("name", PIPELINES)
def test_a_pipelines_estimate_is_the_peak_its_first_stage_tracks_under_the_real_schedule(name, tmp_path):
    """With --pp the estimate replays each PP rank's forwards and backwards in its schedule's order on fake
    tensors (no p2p); the real run is torch's schedule. Compared on the first PP rank, the one a real run can
    track; its micro-batches in flight are the schedule's (1F1B: PP of them on the first stage, GPipe: all)."""
    ranks, options = PIPELINES[name]
    _, stdout, estimated = estimate(tmp_path, name, ranks, options)
    assert "the largest PP rank" in stdout and "in flight" in stdout and set(estimated["total_bytes_by_pp_rank"]) == {"0", "1"}
    micro_batches = 8 if "8-micro" in name else 4
    assert estimated["in_flight_by_pp_rank"] == ({"0": 4, "1": 4} if "gpipe" in name else {"0": 2, "1": 1}) \
        if micro_batches == 4 else {"0": 2, "1": 1}
    measured_json = tmp_path / "measured.json"
    assert_ok(run_recipe(RECIPE, tmp_path / "real", ranks, *MODEL, *options, "--estimate-memory", "a100-40",
                         "--estimate-json", str(measured_json)))
    measured = json.loads(measured_json.read_text())
    assert measured["measured"] and measured["layout"] == estimated["layout"] and list(measured["total_bytes_by_pp_rank"]) == ["0"]
    real, guess = measured["total_bytes_by_pp_rank"]["0"], estimated["total_bytes_by_pp_rank"]["0"]
    assert real > 1e6
    low, high = PP_TOLERANCE
    assert low <= (guess - real) / real <= high, (guess, real, estimated["peak_bytes"], measured["peak_bytes"])


def test_an_interleaved_pipeline_is_estimated_in_its_own_order(tmp_path):
    """Interleaved1F1B (2 stages on each of 2 PP ranks): the order torch's schedule computes for every rank,
    replayed; its first rank holds more micro-batches in flight than 1F1B's (it runs ahead on its second
    stage), and the advice for GPipe does not appear."""
    deep = [*MODEL, "--n-layer", "4"]
    options = ["--tp", "1", "--pp", "2", "--pp-schedule", "Interleaved1F1B", "--pp-virtual", "2"]
    code, stdout, report = estimate(tmp_path, "interleaved", 2, options, model=deep)
    assert code == 0 and "Interleaved1F1B over 4 micro-batches" in stdout
    assert report["in_flight_by_pp_rank"]["0"] > 2, report["in_flight_by_pp_rank"]
    _, _, plain = estimate(tmp_path, "plain", 2, ["--tp", "1", "--pp", "2"], model=deep)
    assert report["total_bytes_by_pp_rank"]["0"] > plain["total_bytes_by_pp_rank"]["0"]


def test_gpipe_that_does_not_fit_is_told_about_1f1b(tmp_path):
    big = ["--n-layer", "8", "--n-embd", "2048", "--n-head", "16", "--seq-len", "4096", "--global-batch", "64",
           "--tp", "1", "--pp", "2", "--pp-schedule", "GPipe", "--micro-batches", "4"]
    code, stdout, _ = estimate(tmp_path, "gpipe-big", 2, [], model=big)
    assert code == 1 and "does not fit on a100-40: --pp-schedule 1F1B (GPipe holds the activations of all 4 " \
        "micro-batches, 1F1B at most 2)" in stdout, stdout


HF_TOLERANCE = (-0.05, 0.20)  # measured on the tiny Llama: +10.6% (FSDP2 2), +14.0% (DDP 2); see the test


@pytest.mark.parametrize("recipe, options", [("fsdp_tp_pp", ["--tp", "1", "--dp-shard", "2"]), ("ddp", [])],
                         ids=["fsdp2", "ddp"])
def test_a_hugging_face_models_estimate_is_over_its_real_peak_never_under(recipe, options, tiny_llama, tmp_path):
    """--model hf:DIR: the same estimate for a Hugging Face model. Over the real run's tracked peak by 10-15%
    in activations: the model runs the same operators with the same output sizes on fake and real tensors
    (compared op by op), and an allocation log of its forward and backward peaks at the same bytes on both;
    PyTorch's tracker keeps some of them alive longer on fake tensors. An over-estimate, the safe side: the
    test holds it there. The estimate is made from the model's config.json alone (a directory without its
    weights, as for a model not downloaded yet): nothing is read but the shapes."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny_llama / "config.json").read_text())
    shape = ["--vocab-size", "256", "--seq-len", "128", "--global-batch", "8", "--dtype", "float32"]
    model = ["--model", f"hf:{tiny_llama}", *shape]
    name = "ddp-hf" if recipe == "ddp" else "hf"
    _, stdout, estimated = estimate(tmp_path, name, 2, options, model=["--model", f"hf:{config_only}", *shape])
    measured_json = tmp_path / "measured.json"
    assert_ok(run_recipe(recipe_of(name), tmp_path / "real", 2, *model, *options, "--estimate-memory", "a100-40",
                         "--estimate-json", str(measured_json)))
    measured = json.loads(measured_json.read_text())
    real, guess = measured["peak_bytes"]["total"], estimated["peak_bytes"]["total"]
    low, high = HF_TOLERANCE
    assert low <= (guess - real) / real <= high, (estimated["peak_bytes"], measured["peak_bytes"])
    for kind in ("parameters", "optimizer state", "communication buffers"):  # the states: exact
        assert estimated["peak_bytes"][kind] == measured["peak_bytes"][kind], kind


def test_ddp_holds_the_whole_model_and_its_buckets_on_every_rank(tmp_path):
    """DDP on 4 ranks: the model's states of one process (nothing sharded), a quarter of its activations (a
    quarter of the rows), and DDP's gradient buckets, one more copy of the gradients."""
    _, _, alone = estimate(tmp_path, "ddp-alone", 1, [])
    _, stdout, four = estimate(tmp_path, "ddp-four", 4, [])
    whole = alone["peak_bytes"]["parameters"]  # (fp32: the model's bytes)
    assert (f"host memory per node (4 ranks): {4 * whole / 2**30:.1f} GiB to load: DDP keeps a whole replica on every "
            "rank by design") in stdout, stdout
    for kind in ("parameters", "optimizer state"):
        assert four["peak_bytes"][kind] == alone["peak_bytes"][kind]
    assert alone["peak_bytes"]["communication buffers"] == 0
    assert four["peak_bytes"]["communication buffers"] == alone["peak_bytes"]["parameters"]  # (fp32: the gradients' bytes)
    assert four["peak_bytes"]["activations"] < 0.3 * alone["peak_bytes"]["activations"]


def test_sharding_divides_the_models_states(tmp_path):
    """FSDP2 over 4 ranks: each holds a quarter of the parameters' fp32 copy and of Adam's two moments."""
    _, _, whole = estimate(tmp_path, "whole", 1, ["--tp", "1"])
    _, _, sharded = estimate(tmp_path, "sharded", 4, ["--tp", "1", "--dp-shard", "4"])
    ratio = sharded["peak_bytes"]["optimizer state"] / whole["peak_bytes"]["optimizer state"]
    assert 0.24 <= ratio <= 0.27, ratio  # (a quarter, and the padding of shards that do not divide evenly)


def test_a_layout_that_does_not_fit_says_so_and_what_to_change(tmp_path):
    """A ~0.5B-parameter GPT, whole on one A100-40 with 32 rows of 4096 tokens: the activations alone are
    far over; the advice starts with what is largest. (8 wide layers: a fake-tensor estimate's time is its
    number of operators, not their sizes.)"""
    big = ["--n-layer", "8", "--n-embd", "2048", "--n-head", "16", "--seq-len", "4096", "--global-batch", "32"]
    code, stdout, report = estimate(tmp_path, "big", 1, ["--tp", "1"], model=big)
    assert code == 1 and "does not fit on a100-40: --activation-checkpointing" in stdout, stdout
    assert report["peak_bytes"]["total"] > 0.9 * report["gpu_bytes"]


DEEPSPEED_MODEL = ["--n-layer", "2", "--n-embd", "128", "--n-head", "4", "--seq-len", "128", "--vocab-size", "256",
                   "--global-batch", "8"]


def small_buckets(tmp_path) -> list[str]:
    """A DeepSpeed config whose buckets are small (1e5 elements), so that the model's own memory, not a
    bucket, makes the peak the test compares."""
    config = json.loads((REPO / "recipes" / "deepspeed" / "ds_config.json").read_text())
    config["zero_optimization"].update(reduce_bucket_size=100000, allgather_bucket_size=100000,
                                       stage3_prefetch_bucket_size=100000, stage3_param_persistence_threshold=1000)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return ["--ds-config", str(path)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeeds_estimate_is_its_real_engines_peak(stage, tmp_path):
    """--estimate-memory on the DeepSpeed recipe builds DeepSpeed's own engine on fake tensors and a fake group
    of 2 ranks; the real engine on 2 ranks tracks the same peak, kind by kind, in bf16 (the GPU's dtype) on
    CPU. Measured: 0.0% at every stage."""
    options = [*DEEPSPEED_MODEL, *small_buckets(tmp_path), "--zero-stage", str(stage)]
    code, stdout, estimated = estimate(tmp_path, "deepspeed", 2, options, model=[])
    assert code == 0 and f"ZeRO-{stage} on 2 ranks" in stdout and "bfloat16" in stdout, stdout
    measured_json = tmp_path / "measured.json"
    assert_ok(run_recipe(DEEPSPEED_RECIPE, tmp_path / "real", 2, *options, "--estimate-memory", "a100-40",
                         "--estimate-json", str(measured_json)))
    measured = json.loads(measured_json.read_text())
    assert measured["measured"] and not estimated["measured"] and measured["layout"] == estimated["layout"]
    total = measured["peak_bytes"]["total"]
    assert total > 5e6
    for kind in measured["peak_bytes"]:
        assert abs(estimated["peak_bytes"][kind] - measured["peak_bytes"][kind]) <= TOLERANCE * total, \
            (kind, estimated["peak_bytes"], measured["peak_bytes"])


def test_zero_shards_the_optimizer_state_and_deepspeeds_default_bucket_is_a_gib(tmp_path):
    """ZeRO-1 holds half of stage 0's optimizer state on 2 ranks; with the recipe's own config (DeepSpeed's
    default reduce_bucket_size, 5e8 elements) every stage from 1 on allocates its bucket whole: 1 GB in bf16
    per GPU, whatever the model's size, and the report names it."""
    small = [*DEEPSPEED_MODEL, *small_buckets(tmp_path)]
    _, _, stage0 = estimate(tmp_path, "deepspeed-0", 2, [*small, "--zero-stage", "0"], model=[])
    _, _, stage1 = estimate(tmp_path, "deepspeed-1", 2, [*small, "--zero-stage", "1"], model=[])
    assert stage1["peak_bytes"]["optimizer state"] * 2 == pytest.approx(stage0["peak_bytes"]["optimizer state"], rel=0.01)
    _, stdout, default = estimate(tmp_path, "deepspeed-default", 2, [*DEEPSPEED_MODEL, "--zero-stage", "2"], model=[])
    bucket = default["peak_bytes"]["total"] - stage1["peak_bytes"]["total"]  # (ZeRO-1 and 2: the same peak here)
    assert bucket == pytest.approx(5e8 * 2, rel=0.01), default["peak_bytes"]
    assert "reduce bucket, 5e+08 elements" in stdout


@pytest.mark.parametrize("recipe, options, message", [
    ("fsdp_tp_pp", ["--estimate-memory", "v100", "--world", "2"],
     "--estimate-memory v100: name the GPU, one of a100-40, a100-80, h100, h200"),
    ("fsdp_tp_pp", ["--estimate-memory", "h100", "--world", "3", "--tp", "2"], "world size 3 is not divisible by PP x DP_replicate x TP"),
    ("fsdp_tp_pp", ["--estimate-memory", "h100", "--world", "2", "--tp", "1", "--pp", "2", "--micro-batches", "3"],
     "DP 1 x --micro-batches 3 = 3"),
    ("ddp", ["--estimate-memory", "h100", "--world", "3"], "--global-batch 8 is not divisible by the world size 3"),
    ("ddp", ["--estimate-memory", "a100", "--world", "2"], "--estimate-memory a100: name the GPU"),
    ("deepspeed", ["--estimate-memory", "h100", "--world", "2", "--pp", "2"], "--estimate-memory with --pp 2: the ZeRO layouts only"),
    ("deepspeed", ["--estimate-memory", "h100", "--world", "3"], "train_batch_size 8 is not divisible by"),
    ("deepspeed", ["--estimate-memory", "h100", "--world", "2", "--model", f"{REPO}/recipes/examples/bigram.py:build"],
     "recipes/examples/bigram.py:build: the stack's GPT only here"),
])
def test_what_cannot_be_estimated_is_one_line(tmp_path, recipe, options, message):
    path = recipe_of(recipe)
    model = DEEPSPEED_MODEL if recipe == "deepspeed" else MODEL
    result = python(path, "--out-dir", str(tmp_path), *model, *options, env=recipe_env(), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"[{recipe}] error: ") and message in lines[0], \
        result.stderr
