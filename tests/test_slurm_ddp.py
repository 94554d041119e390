"""slurm/ddp.sh, unchanged, on the local Slurm cluster (tests/cluster/local_slurm.sh).

Every node is its own host (network + UTS namespace), so a job whose ranks do not find each other across
nodes fails here as it would on Perlmutter. Runtime "none": the containers' turn comes with the images.
Jobs are judged by `sbatch --wait`'s exit code and by the final state Slurm recorded (jobcomp), since
`sbatch --wait` alone reports 0 for a job cancelled before it ran.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import CLUSTER_DIR, REPO, TINY, recipe_env, run

pytestmark = pytest.mark.slurm
RECIPE_ARGS = [*TINY, "--max-steps", "4", "--global-batch", "8", "--checkpoint-every", "0"]


def sbatch(cluster: dict, tmp_path: Path, *options: str, recipe_args=RECIPE_ARGS, **env: str):
    """Submit slurm/ddp.sh from the repository root and wait; returns (exit code, job state, log text)."""
    run_env = recipe_env(**{**cluster, "CONTAINER_RUNTIME": "none", "RUN_DIR": str(tmp_path / "run"), **env})
    result = run(["sbatch", "--wait", "--parsable", "-o", str(tmp_path / "%x-%j.out"), *options,
                  str(REPO / "slurm" / "ddp.sh"), *recipe_args], env=run_env, cwd=REPO, timeout=300)
    job_id = result.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch did not submit:\n{result.stdout}\n{result.stderr}"
    log = tmp_path / f"ddp-{job_id}.out"
    return result.returncode, job_state(job_id), log.read_text() if log.exists() else ""


def job_state(job_id: str) -> str:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        records = [line for line in (CLUSTER_DIR / "jobcomp.txt").read_text().splitlines()
                   if line.startswith(f"JobId={job_id} ")]
        if records:  # the last one: a requeued job has a record per run
            return re.search(r"JobState=(\S+)", records[-1]).group(1)
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never reached a final state in jobcomp.txt")


def test_two_nodes_two_tasks_each_form_one_world(slurm_cluster, tmp_path):
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "2", "--ntasks-per-node", "2")
    assert (code, state) == (0, "COMPLETED"), log
    assert "world_size=4 backend=gloo" in log
    assert "launch: runtime=none" in log and "master=nid000001:" in log
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["launcher"] == "srun"
    assert metrics["model_wrapper"] == "DistributedDataParallel"
    assert metrics["hostnames"] == ["nid000001", "nid000001", "nid000002", "nid000002"]
    assert [r["step"] for r in metrics["history"]] == [1, 2, 3, 4]
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0


def test_one_node(slurm_cluster, tmp_path):
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "1", "--ntasks-per-node", "2")
    assert (code, state) == (0, "COMPLETED"), log
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and set(metrics["hostnames"]) == {"nid000001"}


def test_negative_control_localhost_rendezvous_fails_across_nodes(slurm_cluster, tmp_path):
    """The mistake the separate hosts exist to catch: each node meeting at its own localhost."""
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "2", "--ntasks-per-node", "1", "-t", "2",
                              recipe_args=[*RECIPE_ARGS, "--timeout-s", "15"], MASTER_ADDR="localhost")
    assert code != 0 and state == "FAILED", log
    assert "done: step" not in log


def test_unknown_runtime_fails_before_any_rank(slurm_cluster, tmp_path):
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "1", "--ntasks-per-node", "2", CONTAINER_RUNTIME="docker")
    assert code == 2 and state == "FAILED", log
    assert "launch: error: unknown CONTAINER_RUNTIME 'docker'" in log
    assert "[ddp]" not in log and "launch: srun" not in log


def test_batch_not_divisible_by_world_size_fails_with_one_line(slurm_cluster, tmp_path):
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "2", "--ntasks-per-node", "2",
                              recipe_args=[*TINY, "--global-batch", "10"])
    assert code != 0 and state == "FAILED", log
    assert "[ddp] error: --global-batch 10 is not divisible by the world size 4" in log
    assert "Traceback" not in log and "world_size=4" not in log


def test_shifter_directives_reach_the_job_as_shifter_names_them(slurm_cluster, tmp_path):
    """The SPANK plugin: --image/--module are accepted and exported under Shifter's variable names."""
    out = tmp_path / "probe.out"
    result = run(["sbatch", "--wait", "-o", str(out), "--image=docker:me/ddp:v1", "--module=gpu,nccl-plugin", "--wrap",
                  "echo image=$SLURM_SPANK_SHIFTER_IMAGE type=$SLURM_SPANK_SHIFTER_IMAGETYPE module=$SLURM_SPANK_SHIFTER_MODULE"],
                 env=recipe_env(**slurm_cluster), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_text().strip() == "image=me/ddp:v1 type=docker module=gpu,nccl-plugin"
