"""Where the time and the memory go (recipes/harness/profiling.py): --profile START:END writes a torch.profiler
trace per rank of exactly those steps, with the recipe's phases and its collectives; every run's metrics.json
records its peak memory and the data loader's share of the step time, which a slow dataset must raise.
HPCML_NSYS=1 (Nsight Systems around each rank) is the launcher's: tests/test_launch.py, as a dry run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.curves import read_metrics
from support.runs import assert_ok, python, REPO, recipe_env, run_recipe, tf_single, TINY

RECIPES = REPO / "recipes"
SHORT = [*TINY, "--global-batch", "8", "--checkpoint-every", "0", "--no-resume"]


def trace_names(path: Path) -> list[str]:
    """The names of the events of a Chrome trace (what Perfetto and TensorBoard show)."""
    return [event.get("name", "") for event in json.loads(path.read_text())["traceEvents"]]


def test_a_profiled_run_writes_a_trace_per_rank_of_exactly_those_steps(tmp_path):
    """DDP on 2 ranks, --profile 2:3 of 5 steps: rank<R>.pt.trace.json for both ranks, with the recipe's
    phases once per profiled step (2 forwards, not 5: the range is the one asked for) and the gradients'
    all-reduce; metrics.json says where rank 0's trace is, its peak memory and the data loader's share."""
    result = run_recipe(RECIPES / "ddp" / "train.py", tmp_path, 2, *SHORT, "--max-steps", "5", "--profile", "2:3")
    assert_ok(result)
    for rank in (0, 1):
        names = trace_names(tmp_path / "profile" / f"rank{rank}.pt.trace.json")
        assert names.count("forward") == 2 and names.count("backward") == 2 and names.count("optimizer") == 2, rank
        assert "c10d::allreduce_" in names or "gloo:all_reduce" in names, sorted(set(names))[:50]
    metrics = read_metrics(tmp_path)
    assert metrics["profile_trace"] == str(tmp_path / "profile" / "rank0.pt.trace.json")
    assert metrics["peak_memory"]["cpu_rss_bytes"] > 50e6 and "gpu_allocated_bytes" not in metrics["peak_memory"]
    assert 0 < metrics["data_wait_s"] < metrics["step_time_s"] and 0 < metrics["data_wait_share"] < 1


def test_two_ranks_average_their_losses_once_per_window_and_time_whole_steps(tmp_path):
    """DDP on 2 ranks, 8 steps, a checkpoint every 2: with --log-every 4 the ranks meet 5 times, after steps 1, 2,
    4, 6 and 8 (the first two steps alone, then every 4 and at each checkpoint: harness/run.py), not 8 times,
    and every step's loss is the same as when they meet after
    each step; the step times add up to the wall time of the steps, checkpoints included. Control: timed from
    each step's start (the fault step-time-from-start), the checkpoints' time is missing from the sum."""
    steps = [*SHORT, "--max-steps", "8", "--checkpoint-every", "2"]
    runs = {}
    for name, options, fault in (("windows", ["--log-every", "4"], None), ("every-step", ["--log-every", "1"], None),
                                 ("control", ["--log-every", "4"], "step-time-from-start")):
        out = tmp_path / name
        assert_ok(run_recipe(RECIPES / "ddp" / "train.py", out, 2, *steps, *options,
                             **({"HPCML_TEST_FAULT": fault} if fault else {})))
        runs[name] = read_metrics(out)
    windows, every_step = runs["windows"], runs["every-step"]
    assert windows["world_size"] == 2 and windows["syncs"] == 5 and every_step["syncs"] == 8
    assert [r["loss"] for r in windows["history"]] == [r["loss"] for r in every_step["history"]]
    for name in ("windows", "control"):
        summed = sum(r["step_time_s"] for r in runs[name]["history"])
        runs[name]["share"] = summed / runs[name]["steps_wall_s"]
    assert runs["windows"]["share"] == pytest.approx(1.0, abs=0.01), runs["windows"]["share"]
    assert runs["control"]["share"] < 0.9, runs["control"]["share"]  # (the checkpoints' time: not in the sum)


PHASES = {  # recipe -> (ranks, options, the phases its trace must name)
    "accelerate": (1, [], {"forward", "backward", "optimizer"}),
    "deepspeed": (1, ["--zero-stage", "0"], {"forward", "backward", "optimizer"}),
    "fsdp_tp_pp": (1, ["--tp", "1"], {"forward", "backward", "optimizer"}),
    "fsdp_tp_pp-pipeline": (2, ["--tp", "1", "--pp", "2", "--micro-batches", "2"], {"pipeline-step", "optimizer"}),
    "megatron_tp_pp": (1, [], {"forward-backward", "optimizer"}),
}


@pytest.mark.parametrize("name", PHASES)
def test_every_pytorch_recipe_names_its_phases(name, tmp_path):
    ranks, options, phases = PHASES[name]
    recipe = RECIPES / name.split("-")[0] / "train.py"
    model = ["--seq-len", "32", "--log-every", "1"] if name == "megatron_tp_pp" else TINY
    result = run_recipe(recipe, tmp_path, ranks, *model, "--global-batch", "8", "--checkpoint-every", "0",
                        "--max-steps", "2", "--profile", "2:2", *options)
    assert_ok(result)
    names = set(trace_names(tmp_path / "profile" / "rank0.pt.trace.json"))
    assert phases <= names, sorted(names)[:80]


@pytest.mark.tensorflow
def test_horovod_torch_names_its_phases(tmp_path):
    result = tf_single(RECIPES / "horovod" / "train_torch.py", tmp_path, *TINY, "--max-steps", "2", "--checkpoint-every", "0",
                       "--profile", "1:2")
    assert_ok(result)
    names = trace_names(tmp_path / "profile" / "rank0.pt.trace.json")
    assert names.count("forward") == 2 and {"backward", "optimizer"} <= set(names)


SLOW_DATASET = """
import time, torch
class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(0.01)  # a slow file system: 10 ms an item
        tokens = torch.arange(33) % 7 + i % 5
        return tokens[:-1], tokens[1:]
def build(args, split):
    return Slow()
"""


def test_the_data_loaders_share_of_the_step_is_measured(tmp_path):
    """A dataset that takes 10 ms an item (80 ms a step of 8 rows, read in the training process) against the
    synthetic tokens: its share of the step time must be most of it, the synthetic one's small."""
    (tmp_path / "slow.py").write_text(SLOW_DATASET)
    common = [*SHORT, "--max-steps", "4", "--data-workers", "0", "--eval-every", "0"]
    assert_ok(run_recipe(RECIPES / "ddp" / "train.py", tmp_path / "slow", 1, *common, "--dataset", f"{tmp_path / 'slow.py'}:build"))
    assert_ok(run_recipe(RECIPES / "ddp" / "train.py", tmp_path / "fast", 1, *common))
    slow, fast = read_metrics(tmp_path / "slow")["data_wait_share"], read_metrics(tmp_path / "fast")["data_wait_share"]
    assert slow > 0.5 and fast < 0.2, (slow, fast)


@pytest.mark.parametrize("value, message", [
    ("3:2", "--profile 3:2: give the first and last step to record, START:END with 1 <= START <= END"),
    ("3", "--profile 3: give the first and last step"),
    ("0:2", "--profile 0:2: give the first and last step"),
    ("7:8", "--profile 7:8 starts after the last step (--max-steps 5)"),
])
def test_a_profile_range_that_cannot_be_recorded_is_one_line(tmp_path, value, message):
    result = python(RECIPES / "ddp" / "train.py", "--out-dir", str(tmp_path), "--max-steps", "5",
                    "--profile", value, "--preflight", "2", env=recipe_env(), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("[ddp] error: ") and message in lines[0], result.stderr


def test_a_resumed_run_past_the_profiled_steps_names_no_trace(tmp_path):
    """--profile 1:2, stopped after step 2 and rerun: the first run wrote the trace and names it; the resumed
    run (steps 3-4) recorded nothing, and metrics.json does not pass the earlier run's trace off as its own."""
    args = [*TINY, "--global-batch", "8", "--max-steps", "4", "--checkpoint-every", "2", "--profile", "1:2"]
    assert_ok(run_recipe(RECIPES / "ddp" / "train.py", tmp_path, 1, *args, "--stop-at-step", "2"))
    assert read_metrics(tmp_path)["profile_trace"] == str(tmp_path / "profile" / "rank0.pt.trace.json")
    resumed = run_recipe(RECIPES / "ddp" / "train.py", tmp_path, 1, *args)
    assert_ok(resumed)
    assert "(step 2)" in resumed.stdout and read_metrics(tmp_path)["profile_trace"] is None
