"""A node that fails, on the local Slurm cluster (slurm/lib/healing.sh; docs/reliability.md, "A node fails"):

- a rank's process killed mid-training in a 3-node job with one spare node: the job goes on in the same job,
  on the spare, from the last checkpoint, and its losses equal an uninterrupted run's;
- a deterministic error in the program (every rank, after step 5): the job ends with its line, no restart;
  its negative control (the launcher's classification off) restarts it on the spare, and the test catches that.
(Without a spare, the job requeued without the failed node: tests/test_reliability.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from support.cluster import final_state, job_nodes, rank_pid, sbatch_recipe, submit_recipe, unlabelled, wait_for
from support.curves import losses, read_metrics
from support.runs import assert_ok, run_torchrun, TINY

pytestmark = pytest.mark.slurm

RUN = [*TINY, "--global-batch", "8", "--max-steps", "300", "--checkpoint-every", "10"]
LOSS_TOLERANCE = 1e-5  # the same layout and reductions on other nodes: the same numbers, to float rounding


def log_of(tmp_path, job_id: str) -> str:
    log = tmp_path / f"ddp-{job_id}.out"
    return unlabelled(log.read_text()) if log.exists() else ""


def incidents(run_dir) -> list[dict]:
    path = run_dir / "incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_rank_goes_on_on_a_spare_node_in_the_same_job_and_curve(slurm_cluster, tmp_path):
    reference = tmp_path / "reference"
    assert_ok(run_torchrun(reference, 2, *RUN))

    _, job = submit_recipe(slurm_cluster, tmp_path, "ddp", "-N", "3", "--ntasks-per-node", "1", recipe_args=RUN,
                           HPCML_SPARE_NODES="1")
    wait_for(lambda: re.search(r"^\[ddp\] step +15 ", log_of(tmp_path, job), re.M), 120, "step 15")
    pid = wait_for(lambda: rank_pid(tmp_path / "run", 1), 30, "rank 1's process")
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # The time from the kill to the first step on the spare: the job's own recovery, as a user waits for it.
    resumed = wait_for(lambda: re.search(r"^\[ddp\] resumed from \S+ \(step (\d+)\)", log_of(tmp_path, job), re.M), 90,
                       "the run to resume on the spare")
    next_step = int(resumed.group(1)) + 1
    wait_for(lambda: re.search(rf"\[ddp\] resumed from .*^\[ddp\] step +{next_step} ", log_of(tmp_path, job), re.M | re.S),
             60, "the first step after the resume")
    print(f"{time.monotonic() - killed_at:.1f} s from the killed rank to step {next_step} on the spare node")
    state = wait_for(lambda: final_state(job), 180, "the job to finish", interval=0.5)
    log = log_of(tmp_path, job)
    assert state == "COMPLETED", log

    # Slurm's record: one run of the job (no requeue), on three nodes; rank 1 ran on the second, which failed.
    nodes = job_nodes(job)
    assert len(nodes) == 3 and "(restart 1)" not in log, log
    failed, spare = nodes[1], nodes[2]
    [incident] = incidents(tmp_path / "run")
    assert (incident["class"], incident["nodes"], incident["ranks"], incident["attempt"]) == ("node", [failed], [1], 0), incident
    assert incident["action"] == f"restarted in the job without {failed}, on {nodes[0]} {spare}"
    # The second attempt, from inside it: two ranks, on the first node and the spare, not the failed node.
    assert f"launch: attempt 2 on {nodes[0]} {spare} (master {nodes[0]})" in log
    assert f"[ddp] world_size=2 backend=gloo device=cpu dtype=torch.float32 launcher=srun master={nodes[0]}:" in log
    assert re.search(rf"hosts={nodes[0]},{spare}$", log, re.M), log
    metrics = read_metrics(tmp_path / "run")
    step = metrics["resumed_from_step"]
    assert step % 10 == 0 and 10 <= step <= incident["step"], (step, incident)
    assert metrics["incidents"]["nodes_left_out"] == [failed] and metrics["last_step"] == 300
    assert [r["step"] for r in metrics["history"]] == list(range(1, 301))
    expected = losses(read_metrics(reference))
    assert max(abs(a - b) for a, b in zip(losses(metrics), expected, strict=True)) <= LOSS_TOLERANCE


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
