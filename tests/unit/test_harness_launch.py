"""recipes/harness/launch.py: the rank layout from torchrun's or Slurm's variables, host lists, GPUs
per rank, CPU lists, a collective that failed."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from support.runs import REPO, free_port

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
                             f"--master_port={free_port()}", str(script)], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.startswith("[test] error: ")]
    assert len(lines) == 1, result.stderr
    trace = tmp_path / "fr" / "rank_0"
    assert lines[0].endswith(f"(its last collective: gloo:broadcast #2; flight recorder: {trace})"), lines[0]
    import pickle

    entries = pickle.loads(trace.read_bytes())["entries"]
    assert [entry["profiling_name"] for entry in entries] == ["gloo:all_reduce", "gloo:broadcast"]
    assert not (tmp_path / "fr" / "rank_1").exists()  # the stopped rank wrote nothing


EXIT_AFTER_LEAVING = """
import multiprocessing, sys, time
sys.path.insert(0, {recipes!r})
from harness import launch
print("trained", end="")  # (no newline, no flush: what the ordinary exit would flush)
launch._left_process_group = {left}
child = multiprocessing.Process(target=time.sleep, args=(0.5,)) if {with_child} else None
if child:
    child.start()
launch.exit_after_leaving_the_group(5)
print(" and exited the ordinary way")
sys.exit(6)
"""


@pytest.mark.parametrize("left, with_child, code, out", [
    (True, False, 5, "trained"),  # left the group: ends at once, its output flushed
    (False, False, 6, "trained and exited the ordinary way"),  # no group left (one process): the ordinary exit
    (True, True, 6, "trained and exited the ordinary way"),  # children (data workers): shut down the ordinary way
])
def test_a_run_that_left_its_group_exits_without_the_interpreters_teardown(left, with_child, code, out):
    script = EXIT_AFTER_LEAVING.format(recipes=str(REPO / "recipes"), left=left, with_child=with_child)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.rstrip("\n")) == (code, out), result.stderr


def test_startup_times_separate_the_ranks_arrival_spread_from_the_rendezvous(tmp_path):
    """metrics.json's "startup" (harness.launch.startup_times): rank 1 reaches the group 1.5 s after rank 0,
    so rank 0's rendezvous_s holds that wait, arrival_spread_s says it, and the rendezvous after the last
    arrival does not; the launcher's marks (HPCML_*) are read as it exported them."""
    script = tmp_path / "startup.py"
    script.write_text(f"""
import json, os, sys, time
sys.path.insert(0, {str(REPO / 'recipes')!r})
from harness.launch import detect_dist_env, setup_torch_distributed, startup_times
import torch.distributed  # (here, not in setup_torch_distributed: two imports on a busy machine differ by a second)
env = detect_dist_env()
ready = {str(tmp_path / 'rank0-ready')!r}
if env.rank == 0:
    open(ready, "w").close()
else:  # 1.5 s after rank 0 reached the group, whatever each one's imports took
    while not os.path.exists(ready):
        time.sleep(0.01)
    time.sleep(1.5)
setup_torch_distributed(env, timeout_s=60)
from harness.launch import _STARTUP
# (one write with its newline: under PYTHONUNBUFFERED=1 print() writes them apart, and the two ranks' lines can run together)
sys.stdout.write(json.dumps({{**startup_times(), "now": time.time(), "rank": env.rank,
                              "reached_group_at": _STARTUP["group_started_at"]}}) + "\\n")
sys.stdout.flush()
torch.distributed.destroy_process_group()
""")
    launched = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HPCML_BATCH_STARTED_AT": f"{launched - 3:.6f}", "HPCML_PREFLIGHT_S": "2.500",
           "HPCML_STEP_STARTED_AT": f"{launched:.6f}"}
    env.pop("SLURM_JOB_ID", None)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                             f"--master_port={free_port()}", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = {line["rank"]: line for line in map(json.loads, result.stdout.strip().splitlines()[-2:])}
    times = ranks[0]
    assert times["batch_started_at"] == pytest.approx(launched - 3) and times["preflight_s"] == 2.5
    assert launched - 1 < times["process_started_at"] < times["now"]
    assert times["srun_to_process_s"] == pytest.approx(times["process_started_at"] - launched)
    assert times["imports_s"] > 0
    # The spread is the ranks' own arrival marks apart (on a busy machine more than the 1.5 s held, at times
    # less); rank 0's rendezvous holds it, and the rest is the rendezvous after the last arrival.
    spread = ranks[1]["reached_group_at"] - ranks[0]["reached_group_at"]
    assert spread > 0.5 and times["arrival_spread_s"] == pytest.approx(spread, abs=1e-6)
    assert times["rendezvous_s"] == pytest.approx(spread + times["rendezvous_after_last_arrival_s"], abs=1e-6)
    assert 0 <= times["rendezvous_after_last_arrival_s"] < times["rendezvous_s"]
