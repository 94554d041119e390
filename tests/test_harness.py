"""Unit tests of the recipe harness (recipes/harness/): rank layout, host lists, synthetic data, MFU formula, checkpoints."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402
from harness.launch import check_ranks_per_gpu  # noqa: E402


@pytest.mark.parametrize(
    "hostlist, expected",
    [
        ("nid000001", ["nid000001"]),
        ("nid[000001-000003]", ["nid000001", "nid000002", "nid000003"]),
        ("nid[000008-000009,000012],login01", ["nid000008", "nid000009", "nid000012", "login01"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("gpu[09-11]", ["gpu09", "gpu10", "gpu11"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert harness.expand_hostlist(hostlist) == expected


def test_torchrun_variables_win():
    env = harness.detect_dist_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "nid000005",
                                  "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"})
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port, env.launcher) == (
        3, 1, 8, "nid000005", 1234, "torchrun")


def test_srun_layout_uses_first_node_not_localhost():
    env = harness.detect_dist_env({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
                                  "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "nid[000017-000018]"})
    assert (env.rank, env.local_rank, env.world_size, env.launcher) == (5, 1, 8, "srun")
    assert env.master_addr == "nid000017"
    assert env.master_port == 29500  # torch's default under a bare srun; slurm/lib/launch.sh sets one per job
    assert harness.detect_dist_env({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
                                    "SLURM_JOB_NODELIST": "nid000017", "MASTER_PORT": "34242"}).master_port == 34242


@pytest.mark.parametrize("tasks_env", [{"SLURM_NTASKS_PER_NODE": "4"}, {"SLURM_TASKS_PER_NODE": "4(x2)"},
                                       {"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "1"}])
def test_tp_node_is_the_ranks_of_a_node(tasks_env, monkeypatch):
    """--tp node (slurm/fsdp_tp_pp.sh, slurm/megatron_tp_pp.sh): what the launcher started on a node."""
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in tasks_env.items():
        monkeypatch.setenv(name, value)
    assert harness.tp_size("node") == 4 and harness.tp_size("2") == 2
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.delenv("SLURM_TASKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert harness.tp_size("node") == 1  # nothing says: one rank per node
    with pytest.raises(argparse.ArgumentTypeError, match="use a number of ranks or 'node'"):
        harness.tp_size("nodes")


def test_more_ranks_than_gpus_per_node_is_refused():
    """Checked by every recipe's preflight (slurm/lib/launch.sh runs it before srun) and on every rank."""
    error = "8 ranks per node but 4 GPUs per node: one rank per GPU; use --ntasks-per-node=4 (or ask for --gpus-per-node=8)"
    with pytest.raises(harness.ConfigError, match=re.escape(error)):
        check_ranks_per_gpu({"SLURM_GPUS_PER_NODE": "a100:4", "SLURM_TASKS_PER_NODE": "8(x2)"})
    check_ranks_per_gpu({"SLURM_GPUS_PER_NODE": "4", "SLURM_NTASKS_PER_NODE": "4"})
    check_ranks_per_gpu({"SLURM_NTASKS_PER_NODE": "8"})  # no GPUs: nothing to share


def test_srun_step_nodelist_and_task_count_preferred():
    env = harness.detect_dist_env({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "8",
                                  "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "nid[000001-000004]",
                                  "SLURM_STEP_NODELIST": "nid000003"})
    assert (env.world_size, env.master_addr) == (2, "nid000003")


def test_batch_script_without_srun_is_refused():
    with pytest.raises(harness.ConfigError, match="launch it with srun"):
        harness.detect_dist_env({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                                "SLURM_JOB_NODELIST": "nid[000001-000002]"})


def test_plain_process_is_single():
    assert harness.detect_dist_env({}).launcher == "single"
    assert harness.detect_dist_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).world_size == 1


def test_synthetic_batches_are_deterministic_and_split_by_rank():
    data = harness.SyntheticTokens(vocab_size=50, seq_len=16, seed=3)
    inputs, targets = data.global_batch(step=5, batch_size=8)
    again, _ = data.global_batch(step=5, batch_size=8)
    other, _ = data.global_batch(step=6, batch_size=8)
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    halves = [data.local_batch(5, 8, rank, 2)[0] for rank in range(2)]
    assert torch.equal(torch.cat(halves), inputs)
    assert int(inputs.max()) < 50


def test_flops_formula():
    # 6N + 12 L d T with N = 1e6, L = 2, d = 64, T = 32
    assert harness.transformer_flops_per_token(1_000_000, 2, 64, 32) == 6e6 + 12 * 2 * 64 * 32


def test_cpu_peak_is_measured():
    flops, source = harness.peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 1e8 and source.startswith("measured")
    assert harness.peak_flops(torch.device("cpu"), torch.float32, override_tflops=2.0) == (2e12, "--peak-tflops")


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    for step in (10, 20, 30):
        harness.save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    assert [p.name for p in harness.list_checkpoints(tmp_path)] == ["step_00000020.pt", "step_00000030.pt"]

    class ExplodesWhilePickled:
        def __reduce__(self):
            raise RuntimeError("crash in the middle of writing")

    with pytest.raises(RuntimeError, match="crash in the middle"):
        harness.save_checkpoint(tmp_path, 40, {"step": 40, "payload": torch.zeros(1000), "bad": ExplodesWhilePickled()})
    latest = harness.latest_checkpoint(tmp_path)
    assert latest.name == "step_00000030.pt"  # the half-written step 40 is never picked
    assert torch.load(latest)["step"] == 30
    assert any(p.name.startswith(".step_00000040.pt.tmp") for p in tmp_path.iterdir())


def test_config_file_gives_defaults_and_the_command_line_wins(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out-dir", type=Path, default=Path("runs"))
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--config", type=Path)
    config = tmp_path / "run.toml"
    config.write_text('max-steps = 50\nlr = 1\nout_dir = "elsewhere"\nno-resume = true\n')
    args = harness.parse_args_with_config(parser, ["--config", str(config), "--max-steps", "7"])
    assert (args.max_steps, args.lr, args.out_dir, args.no_resume) == (7, 1.0, Path("elsewhere"), True)
    config.write_text("no-resume = 1\n")
    with pytest.raises(harness.ConfigError, match="'no-resume' in --config .* must be true/false, got 1"):
        harness.parse_args_with_config(parser, ["--config", str(config)])
    with pytest.raises(harness.ConfigError, match="cannot read --config .*missing.toml"):
        harness.parse_args_with_config(parser, ["--config", str(tmp_path / "missing.toml")])


def test_lines_of_ranks_printing_at_once_never_run_into_each_other():
    """Four unbuffered processes writing 2000 error lines each into one pipe, as ranks do into one job log:
    every line arrives whole (print() would write text and newline separately, and lines would merge)."""
    writer = ("import sys; sys.path.insert(0, sys.argv[1]); import harness\n"
              "for i in range(2000): harness.stderr_line(f'[rank {sys.argv[2]}] error: the same long message, ' + 'x' * 200)")
    script = " & ".join(f"{sys.executable} -c \"{writer}\" {REPO / 'recipes'} {rank}" for rank in range(4))
    result = subprocess.run(["bash", "-c", f"{{ {script} & wait; }} 2>&1"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=120)
    lines = result.stdout.splitlines()
    assert len(lines) == 8000
    assert all(re.fullmatch(r"\[rank \d\] error: the same long message, x{200}", line) for line in lines)


@pytest.mark.parametrize(("order", "gpus", "expected"), [
    ("", 4, [0, 1, 2, 3]),
    ("3,2,1,0", 4, [3, 2, 1, 0]),  # Perlmutter: local rank l on NUMA domain l, next to GPU 3-l
    ("3,2,1,0", 1, [0, 0, 0, 0]),  # Slurm bound one GPU to each rank: that one
    ("1,0", 2, [1, 0, 1, 0]),
])
def test_each_local_rank_drives_the_gpu_the_order_names(order, gpus, expected):
    assert [harness.gpu_for_local_rank(rank, gpus, order) for rank in range(4)] == expected


@pytest.mark.parametrize("order", ["3,2,1", "0,0,1,2", "a,b,c,d", "4,3,2,1"])
def test_a_gpu_order_that_is_not_a_permutation_is_refused(order):
    with pytest.raises(harness.ConfigError, match="must name each of this node's 4 GPUs once"):
        harness.gpu_for_local_rank(0, 4, order)


def test_cpu_lists_are_written_as_taskset_writes_them():
    from harness.launch import cpu_list
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and cpu_list([3]) == "3"


def test_a_checkpoint_directory_with_a_missing_or_short_file_is_refused(tmp_path):
    from harness.checkpoint import check_manifest, write_manifest

    checkpoint = tmp_path / "step_00000002"
    (checkpoint / "shards").mkdir(parents=True)
    (checkpoint / "shards" / "rank0.pt").write_bytes(b"x" * 100)
    (checkpoint / "state.json").write_text("{}")
    write_manifest(checkpoint)
    check_manifest(checkpoint)  # whole
    (checkpoint / "shards" / "rank0.pt").write_bytes(b"x" * 60)
    with pytest.raises(harness.ConfigError, match=r"is damaged: shards/rank0.pt has 60 bytes where 100 were written; "
                                                  r"move .*step_00000002 away"):
        check_manifest(checkpoint)
    (checkpoint / "shards" / "rank0.pt").unlink()
    with pytest.raises(harness.ConfigError, match="is damaged: shards/rank0.pt is missing"):
        check_manifest(checkpoint)


def test_the_parity_comparison_fails_a_curve_that_went_nan():
    """max() skips a NaN it meets after the first element: the tests' comparison must not."""
    from conftest import max_relative_difference

    assert max_relative_difference([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert max_relative_difference([1.0, float("nan")], [1.0, 2.0]) == float("inf")
    assert max_relative_difference([1.0, 2.0], [1.0, float("inf")]) == float("inf")


def test_only_a_collective_that_lost_its_peer_is_named_a_collective_failure():
    """A bug in this process (on a GPU once: 'expected scalar type BFloat16 but found Float' inside the model)
    keeps its traceback; gloo's lost-peer and timeout errors and NCCL's DistBackendError become the one line."""
    import torch.distributed as dist

    from harness.launch import failed_collective_rank

    bug = RuntimeError("expected scalar type BFloat16 but found Float")
    lost_peer = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:41234: Connection reset by peer")
    timed_out = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation "
                             "to complete")
    assert failed_collective_rank(lost_peer) is None  # no process group yet: nothing to blame on another rank
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert failed_collective_rank(bug) is None
        assert failed_collective_rank(ValueError("Connection reset by peer")) is None
        assert failed_collective_rank(lost_peer) == 0 and failed_collective_rank(timed_out) == 0
        assert failed_collective_rank(dist.DistBackendError("NCCL communicator was aborted on rank 0")) == 0
    finally:
        dist.destroy_process_group()


def test_a_job_given_gpus_refuses_a_cpu_pytorch_unless_told():
    """Slurm gave the job GPUs and this PyTorch (the CPU build here, as in a cpu image) cannot use them: one
    ConfigError naming the variable and the fix; HPCML_ALLOW_CPU=1 lets it train on the CPU; no GPUs given
    (or zero), nothing to check. (A CUDA build that sees no device is the GPU-only half of the check.)"""
    from harness.launch import check_gpus_visible, slurm_gave_gpus

    assert torch.version.cuda is None
    for given in ({"SLURM_GPUS_ON_NODE": "4"}, {"SLURM_JOB_GPUS": "0,1,2,3"}, {"SLURM_GPUS_PER_NODE": "a100:4"}):
        for build_only in (False, True):
            with pytest.raises(harness.ConfigError) as refused:
                check_gpus_visible("torch", build_only=build_only, environ=given)
            name, value = next(iter(given.items()))
            assert str(refused.value).startswith(f"Slurm gave this job GPUs ({name}={value}) but PyTorch "
                                                 f"{torch.__version__} is a CPU build: run the cuda image")
            assert str(refused.value).endswith("HPCML_ALLOW_CPU=1 trains on the CPU anyway")
        check_gpus_visible("torch", environ={**given, "HPCML_ALLOW_CPU": "1"})
    for nothing in ({}, {"SLURM_GPUS_ON_NODE": "0"}, {"SLURM_GPUS_PER_NODE": "gpu:0"}, {"SLURM_JOB_GPUS": ""}):
        assert slurm_gave_gpus(nothing) is None
        check_gpus_visible("torch", environ=nothing)


def test_a_collective_that_fails_leaves_the_flight_recorder_naming_it(tmp_path):
    """Gloo has no watchdog that dumps the Flight Recorder on a timeout (NCCL's has: TORCH_NCCL_DUMP_ON_TIMEOUT),
    so the rank whose collective failed writes it: TORCH_FR_DUMP_TEMP_FILE<rank>, a pickle of its last
    collectives whose last entry is the one that hung, and the failure line names it."""
    script = tmp_path / "hang.py"
    script.write_text(f"""
import datetime, os, sys, time
sys.path.insert(0, {str(REPO / 'recipes')!r})
import torch, torch.distributed as dist
from harness.launch import exit_on_collective_failure
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
values = torch.ones(3)
dist.all_reduce(values)
if dist.get_rank() == 1:
    time.sleep(20)  # (stopped: the other rank's next collective times out)
    os._exit(0)
try:
    dist.broadcast(values, src=0)
    dist.all_reduce(values)
except RuntimeError as error:
    exit_on_collective_failure("test", error, 0)
""")
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "100", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank_"),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                             f"--master_port={_free_port()}", str(script)], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.startswith("[test] error: ")]
    assert len(lines) == 1, result.stderr
    trace = tmp_path / "fr" / "rank_0"
    assert lines[0].endswith(f"(its last collective: gloo:broadcast #2; flight recorder: {trace})"), lines[0]
    import pickle

    entries = pickle.loads(trace.read_bytes())["entries"]
    assert [entry["profiling_name"] for entry in entries] == ["gloo:all_reduce", "gloo:broadcast"]
    assert not (tmp_path / "fr" / "rank_1").exists()  # the stopped rank wrote nothing


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_users_dataset_gives_each_rank_its_rows_of_the_same_global_batch():
    """DatasetBatches (--dataset): rank r's rows of step s are rows [r*b, (r+1)*b) of the global batch, at any
    world size; the order is a seeded permutation per epoch, and a step past an epoch wraps into the next."""
    from harness.data import DatasetBatches

    items = [(torch.full((2,), float(i)), torch.tensor(float(i))) for i in range(10)]
    data = DatasetBatches(items, seed=5)
    inputs, targets = data.global_batch(3, 4)  # samples 12..15: epoch 1, positions 2..5
    assert torch.equal(inputs[:, 0], targets) and sorted(set(targets.tolist())) == sorted(targets.tolist())
    assert targets.tolist() == [float(data.order(1)[p]) for p in range(2, 6)]
    for world in (1, 2, 4):
        parts = [data.local_batch(3, 4, rank, world)[1] for rank in range(world)]
        assert torch.equal(torch.cat(parts), targets)
    assert sorted(data.order(0).tolist()) == list(range(10)) and not torch.equal(data.order(0), data.order(1))


# The harness in layers: a module imports only modules of lower layers (function-level imports included), so
# the graph has no cycle and a reader can start at the bottom. recipes/gpt.py, the model, imports no harness.
HARNESS_LAYERS = {
    "errors": 0,
    "checkpoint": 1, "faults": 1, "launch": 1,
    "signals": 2, "metrics": 2,
    "hf_model": 3, "run": 3,
    "model": 4,
    "data": 5,
    "cli": 6,
    "__init__": 7,
}


def harness_imports(path: Path) -> set[str]:
    """The harness modules ``path`` imports, anywhere in it (relative imports: from .x, from . import x)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
    return found


def test_the_harness_imports_only_downward_and_the_model_not_at_all():
    modules = {path.stem: path for path in (REPO / "recipes" / "harness").glob("*.py")}
    assert set(modules) == set(HARNESS_LAYERS), "a harness module without a layer: add it to HARNESS_LAYERS"
    upward = {(name, imported) for name, path in modules.items() for imported in harness_imports(path)
              if HARNESS_LAYERS[imported] >= HARNESS_LAYERS[name]}
    assert not upward, f"imports at or above the importer's layer: {sorted(upward)}"
    gpt = (REPO / "recipes" / "gpt.py").read_text()
    assert "harness" not in {line.split()[1].split(".")[0] for line in gpt.splitlines() if line.startswith(("import ", "from "))}
