"""A node that fails, on the local Slurm cluster (slurm/lib/healing.sh; docs/reliability.md, "A node fails"):

- a rank's process killed mid-training in a 3-node job with one spare node: the job goes on in the same job,
  on the spare, from the last checkpoint, and its losses equal an uninterrupted run's;
- a deterministic error in the program (every rank, after step 5): the job ends with its line, no restart;
  its negative control (the launcher's classification off) restarts it on the spare, and the test catches that.
- a node that fails its check before the ranks start is never used;
- the first case again under the Shifter and podman-hpc stand-ins, as a normal user, and with accelerate's
  per-node launcher (full tier).
(Without a spare, the job requeued without the failed node: tests/test_reliability.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from support.cluster import (final_state, job_nodes, rank_pid, sbatch_recipe, shifter_pull, submit_recipe, unlabelled,
                             wait_for)
from support.curves import losses, read_metrics
from support.runs import assert_ok, run_torchrun, TINY

pytestmark = pytest.mark.slurm

RUN = [*TINY, "--global-batch", "8", "--max-steps", "300", "--checkpoint-every", "10"]
LOSS_TOLERANCE = 1e-5  # the same layout and reductions on other nodes: the same numbers, to float rounding


def log_of(tmp_path, job_id: str, recipe: str = "ddp") -> str:
    log = tmp_path / f"{recipe}-{job_id}.out"
    return unlabelled(log.read_text()) if log.exists() else ""


def incidents(run_dir) -> list[dict]:
    path = run_dir / "incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def python_rank_pid(run_dir, rank: int) -> int | None:
    """A rank that a per-node launcher started (torchrun's RANK), by its run directory."""
    for pid in subprocess.run(["pgrep", "-f", "--", f"--out-dir {run_dir}"], capture_output=True, text=True).stdout.split():
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"-m" not in argv and os.path.basename(argv[0]).startswith(b"python"):
            return int(pid)
    return None


def kill_and_go_on_on_a_spare(cluster: dict, tmp_path, user=None, recipe: str = "ddp", **env: str) -> None:
    """sbatch slurm/RECIPE.sh on 3 nodes with one spare, rank 1's process killed after step 15: the checks below."""
    reference = tmp_path / "reference"
    assert_ok(run_torchrun(reference, 2, *RUN))  # (accelerate's DDP trains the same numbers: tests/parity.toml)
    _, job = submit_recipe(cluster, tmp_path, recipe, "-N", "3", "--ntasks-per-node", "1", recipe_args=RUN, user=user,
                           HPCML_SPARE_NODES="1", **env)
    wait_for(lambda: re.search(rf"^\[{recipe}\] step +15 ", log_of(tmp_path, job, recipe), re.M), 180, "step 15")
    find = rank_pid if recipe == "ddp" else python_rank_pid
    pid = wait_for(lambda: find(tmp_path / "run", 1), 30, "rank 1's process")
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # The time from the kill to the first step on the spare: the job's own recovery, as a user waits for it.
    def current_log() -> str:
        return log_of(tmp_path, job, recipe)
    resumed = wait_for(lambda: re.search(rf"^\[{recipe}\] resumed from \S+ \(step (\d+)\)", current_log(), re.M), 120,
                       "the run to resume on the spare")
    next_step = int(resumed.group(1)) + 1
    wait_for(lambda: re.search(rf"\[{recipe}\] resumed from .*^\[{recipe}\] step +{next_step} ", current_log(), re.M | re.S),
             60, "the first step after the resume")
    print(f"{time.monotonic() - killed_at:.1f} s from the killed rank to step {next_step} on the spare node")
    state = wait_for(lambda: final_state(job), 180, "the job to finish", interval=0.5)
    log = current_log()
    assert state == "COMPLETED", log

    # Slurm's record: one run of the job (no requeue), on three nodes; rank 1 ran on the second, which failed.
    nodes = job_nodes(job)
    assert len(nodes) == 3 and "(restart 1)" not in log, log
    failed, spare = nodes[1], nodes[2]
    checks = [i for i in incidents(tmp_path / "run") if i["attempt"] == 0 and i["exit_code"] is None]
    assert checks == [], checks  # (every node passed its check before the ranks started)
    [incident] = incidents(tmp_path / "run")
    assert (incident["class"], incident["nodes"], incident["ranks"], incident["attempt"]) == ("node", [failed], [1], 0), incident
    assert incident["action"] == f"restarted in the job without {failed}, on {nodes[0]} {spare}"
    # The second attempt, from inside it: two ranks, on the first node and the spare, not the failed node.
    assert f"launch: attempt 2 on {nodes[0]} {spare} (master {nodes[0]})" in log
    if recipe == "ddp":
        assert f"[ddp] world_size=2 backend=gloo device=cpu dtype=torch.float32 launcher=srun master={nodes[0]}:" in log
    assert re.search(rf"hosts={nodes[0]},{spare}$", log, re.M), log
    metrics = read_metrics(tmp_path / "run")
    step = metrics["resumed_from_step"]
    assert step % 10 == 0 and 10 <= step <= incident["step"], (step, incident)
    assert metrics["incidents"]["nodes_left_out"] == [failed] and metrics["last_step"] == 300
    assert [r["step"] for r in metrics["history"]] == list(range(1, 301))
    expected = losses(read_metrics(reference))
    assert max(abs(a - b) for a, b in zip(losses(metrics), expected, strict=True)) <= LOSS_TOLERANCE


def test_a_killed_rank_goes_on_on_a_spare_node_in_the_same_job_and_curve(slurm_cluster, tmp_path):
    kill_and_go_on_on_a_spare(slurm_cluster, tmp_path)


@pytest.mark.full
def test_where_the_framework_starts_each_nodes_ranks_a_killed_rank_goes_on_on_a_spare(slurm_cluster, tmp_path):
    """accelerate's launcher on each node (slurm/accelerate.sh: RECIPE_LAUNCHER): the same (full tier: the launcher
    path above, with a per-node launcher that starts its ranks itself)."""
    kill_and_go_on_on_a_spare(slurm_cluster, tmp_path, recipe="accelerate")


@pytest.mark.full
@pytest.mark.containers
@pytest.mark.parametrize("runtime", ["shifter", "podman-hpc"])
def test_in_a_container_as_a_normal_user_a_killed_rank_goes_on_on_a_spare(slurm_cluster, ddp_image, request, tmp_path,
                                                                         runtime):
    """The same, under the Shifter and podman-hpc stand-ins, as the cluster's normal user (full tier: the bare
    case above is the same launcher path; these add the runtimes' start and end of a rank's container)."""
    if runtime == "shifter":
        shifter_pull("ddp")
        user = request.getfixturevalue("cluster_user")
    else:
        user = request.getfixturevalue("squashed_images")("ddp")
    work = user.work_dir(tmp_path)
    kill_and_go_on_on_a_spare(slurm_cluster, work, user=user, CONTAINER_RUNTIME=runtime, CONTAINER_IMAGE="hpcml/ddp:cpu")


@pytest.mark.parametrize("fault, restarted", [("program-error", False), ("program-error-as-node", True)],
                         ids=["classified", "control-unclassified"])
def test_a_programs_error_ends_the_job_without_a_restart(slurm_cluster, tmp_path, fault, restarted):
    """The same error on every rank after step 5 is the program's: restarting it elsewhere would fail again.
    The control takes it for a node's failure and restarts on the spare: the check sees the restart."""
    code, state, log = sbatch_recipe(slurm_cluster, tmp_path, "ddp", "-N", "3", "--ntasks-per-node", "1",
                                     recipe_args=[*RUN, "--max-steps", "20"], HPCML_SPARE_NODES="1",
                                     HPCML_TEST_FAULT=fault, LAUNCH_MAX_REQUEUES="0")
    assert code != 0 and state == "FAILED", log
    log = unlabelled(log)
    assert "ValueError: a deterministic error in the program after step 5" in log
    records = incidents(tmp_path / "run")
    if not restarted:
        assert [r["class"] for r in records] == ["program"] and "attempt 2" not in log, records
        assert records[0]["action"].startswith("ended the job (program failure")
        assert records[0]["cause"].endswith("ValueError: a deterministic error in the program after step 5 "
                                            "(HPCML_TEST_FAULT=program-error)"), records
    else:  # the check catches the wrong decision
        assert "launch: attempt 2 on" in log and records[0]["action"].startswith("restarted in the job"), records


def test_a_node_that_fails_its_check_is_never_used(slurm_cluster, tmp_path):
    """With a spare, every node checks itself before the ranks start (slurm/lib/vet_node.py); the job's first
    node fails (the tests' probe, HPCML_TEST_BAD_NODE=@0): the ranks train on the other two, rank 0 and the
    rendezvous included, and the incident names it."""
    code, state, log = sbatch_recipe(slurm_cluster, tmp_path, "ddp", "-N", "3", "--ntasks-per-node", "1",
                                     recipe_args=[*RUN, "--max-steps", "4"], HPCML_SPARE_NODES="1",
                                     HPCML_TEST_BAD_NODE="@0")
    assert (code, state) == (0, "COMPLETED"), log
    nodes = job_nodes(job_id := re.search(r"^launch: job (\d+) ", log, re.M).group(1))
    log = unlabelled(log)
    checked = rf"^launch: checked 3 node\(s\) in \S+ s \(slurm/lib/vet_node.py\): 1 failed: {nodes[0]} the tests' probe"
    assert re.search(checked, log, re.M), log
    assert f"launch: training on {nodes[1]} {nodes[2]} (master {nodes[1]})" in log, log
    assert re.search(rf"world_size=2 .* master={nodes[1]}:\d+ hosts={nodes[1]},{nodes[2]}$", log, re.M), log
    [incident] = incidents(tmp_path / "run")
    assert (incident["class"], incident["nodes"], incident["action"], incident["job"]) == \
        ("node", [nodes[0]], "left out before the ranks started", job_id), incident


def test_a_slow_rank_is_named_with_its_node(slurm_cluster, tmp_path):
    """HPCML_TEST_FAULT=slow-rank: rank 1's forward pass 30 ms slower in every step. The ranks compare their
    forward times at each sync; rank 1 is named, with the node Slurm ran it on, in the log and metrics.json.
    (Without the fault: the false-positive rate measured in bench/stragglers.json.)"""
    code, state, log = sbatch_recipe(slurm_cluster, tmp_path, "ddp", "-N", "2", "--ntasks-per-node", "1",
                                     recipe_args=[*RUN, "--max-steps", "40", "--log-every", "5"], HPCML_TEST_FAULT="slow-rank")
    assert (code, state) == (0, "COMPLETED"), log
    node = job_nodes(re.search(r"^launch: job (\d+) ", log, re.M).group(1))[1]
    named = rf"^\[ddp\] warning: rank 1 on {node} is a straggler: its forward pass took [\d.]+ ms per step"
    assert re.search(named, unlabelled(log), re.M), log
    [found] = read_metrics(tmp_path / "run")["stragglers"]
    assert (found["rank"], found["host"]) == (1, node) and found["forward_s_per_step"] > 0.03, found


def test_with_leave_stragglers_a_slow_node_is_left_out_and_the_run_goes_on(slurm_cluster, tmp_path):
    """--leave-stragglers with a spare: the rank on the job's second node is slow (HPCML_TEST_FAULT=slow-node: the
    node, whichever rank runs there); once named, the run checkpoints and ends as that node's failure, and goes
    on on the spare, where no rank is slow, on the same curve."""
    args = [*RUN, "--max-steps", "60", "--log-every", "5", "--leave-stragglers"]
    reference = tmp_path / "reference"
    assert_ok(run_torchrun(reference, 2, *args))
    code, state, log = sbatch_recipe(slurm_cluster, tmp_path, "ddp", "-N", "3", "--ntasks-per-node", "1", recipe_args=args,
                                     HPCML_SPARE_NODES="1", HPCML_TEST_FAULT="slow-node", HPCML_TEST_SLOW_NODE="@1")
    assert (code, state) == (0, "COMPLETED"), log
    nodes = job_nodes(re.search(r"^launch: job (\d+) ", log, re.M).group(1))
    log = unlabelled(log)
    assert f"[ddp] error: rank 1 on {nodes[1]} is a straggler (--leave-stragglers)" in log, log
    [incident] = incidents(tmp_path / "run")
    assert (incident["class"], incident["nodes"], incident["ranks"]) == ("node", [nodes[1]], [1]), incident
    assert f"launch: attempt 2 on {nodes[0]} {nodes[2]} (master {nodes[0]})" in log
    metrics = read_metrics(tmp_path / "run")
    assert metrics["stragglers"] == [] and metrics["last_step"] == 60  # (the second attempt's: no one slow there)
    expected = losses(read_metrics(reference))
    assert max(abs(a - b) for a, b in zip(losses(metrics), expected, strict=True)) <= LOSS_TOLERANCE
