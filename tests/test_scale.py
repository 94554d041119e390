"""The scale tier (`make test-scale`, its own tier): the unchanged sbatch files on 16 local nodes, each run
against one process, and the start-up figures bench/scale_model.py is fitted to.

- DDP on 2, 4, 8 and 16 nodes x 1 rank: the losses of one process (relative PARITY_RTOL), world size,
  backend, wrapper and 16 distinct hosts asserted from inside the run; at 16 nodes the negative control
  (gradients summed, not averaged) must miss the reference;
- FSDP2 + TP on 8 nodes x 2 (TP 2 inside a node, FSDP2 across 8) and Megatron TP 2 x PP 4 x DP 2 on
  8 nodes x 2, each against one process;
- a rank killed on a 16-node job ends it within 60 s and the log names the rank's node;
- the time-limit signal on 2 and 16 nodes: checkpoint, requeue, resume on the uninterrupted curve.

Every run records, in runs/scale/timings.json (per node count): submission to the first step, the
launcher's preflight and its share of that, srun and runtime to the Python process, imports, rendezvous
(the ranks' arrival spread, and the rendezvous after the last one arrived), and from the time-limit signal
to the requeued job's first step. Measured on one host, so every "node" shares its cores (what that means
for the fit: bench/scale_model.py). The cluster has 16 nodes only in this tier: `make test-scale` sets
HPCML_CLUSTER_NODES=16 (the default tier's 6-node cluster is restarted).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from support import megatron_shim
from support.cluster import final_state, job_nodes, job_state, rank_pid, submit_recipe, unlabelled, wait_for
from support.curves import losses, max_relative_difference, PARITY_RTOL, read_metrics
from support.runs import fault, recipe_env, REPO, run, run_single, TINY

pytestmark = [pytest.mark.slurm, pytest.mark.scale]

SCALE_NODES = 16
NODE_COUNTS = (2, 4, 8, SCALE_NODES)
TIMINGS = REPO / "runs" / "scale" / "timings.json"
# Plain SGD at a rate where gradients summed instead of averaged move the loss by far more than the
# tolerance (tests/test_matrix.py); 16 sequences: one per rank at 16 nodes.
SGD = ["--optimizer", "sgd", "--lr", "1.0"]
SHORT = [*TINY, "--global-batch", "16", "--max-steps", "4", "--checkpoint-every", "0", *SGD]
# Long enough to be signalled in the middle on 16 ranks sharing this host's cores, with Adam (the default).
LONG = [*TINY, "--global-batch", "16", "--max-steps", "150", "--checkpoint-every", "0", "--log-every", "10"]


@pytest.fixture(scope="module")
def scale_cluster(slurm_cluster) -> dict[str, str]:
    result = run(["sinfo", "-h", "-o", "%D"], env=recipe_env(**slurm_cluster))
    nodes = sum(int(count) for count in result.stdout.split())
    assert nodes >= SCALE_NODES, (f"the local cluster has {nodes} nodes, this tier needs {SCALE_NODES}: "
                                  "run it with `make test-scale` (HPCML_CLUSTER_NODES=16)")
    # The requeue figures are a site's with Slurm's default hold (the default tier's cluster holds 30 s).
    config = run(["scontrol", "show", "config"], env=recipe_env(**slurm_cluster)).stdout
    assert "cred_expire=120" in config, ("the local cluster's requeue hold is not Slurm's default 120 s: "
                                         "run this tier with `make test-scale` (LOCAL_SLURM_CRED_EXPIRE=120)")
    return slurm_cluster


def record(key: str, figures: dict) -> None:
    """Adds one run's figures to runs/scale/timings.json (merged: the tier's tests each add theirs)."""
    TIMINGS.parent.mkdir(parents=True, exist_ok=True)
    with open(TIMINGS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        document = json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {"runs": {}}
        document["runs"][key] = figures
        document["host"] = {"cpus": os.cpu_count(), "note": "every local node shares these CPUs"}
        TIMINGS.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


def startup_figures(metrics: dict, submitted_at: float) -> dict:
    """The run's start-up (metrics.json's "startup", rank 0's view) against the time of its submission."""
    startup = metrics["startup"]
    to_first_step = startup["first_step_at"] - submitted_at
    return {
        "submission_to_first_step_s": to_first_step,
        "queue_and_prolog_s": startup["batch_started_at"] - submitted_at,
        "preflight_s": startup["preflight_s"],
        "preflight_share": startup["preflight_s"] / to_first_step,
        "srun_to_process_s": startup["srun_to_process_s"],
        "imports_s": startup["imports_s"],
        "rendezvous_s": startup["rendezvous_s"],
        "arrival_spread_s": startup["arrival_spread_s"],
        "rendezvous_after_last_arrival_s": startup["rendezvous_after_last_arrival_s"],
        "setup_and_first_step_s": startup["first_step_at"] - startup["process_started_at"] - startup["imports_s"]
        - startup["rendezvous_s"],
    }


def sbatch_timed(cluster: dict, tmp_path: Path, recipe: str, nodes: int, per_node: int, args: list[str],
                 **env: str) -> tuple[str, str, float]:
    """slurm/<recipe>.sh unchanged, bare (the host's venv), waited for: (job id, log, submission time)."""
    submitted_at = time.time()
    code, job = submit_recipe(cluster, tmp_path, recipe, "--wait", "-N", str(nodes), "--ntasks-per-node",
                              str(per_node), "-t", "10", recipe_args=args, **env)
    log_path = tmp_path / f"{recipe}-{job}.out"
    log = log_path.read_text() if log_path.exists() else ""
    assert code == 0 and job_state(job) == "COMPLETED", log[-4000:]
    return job, log, submitted_at


def one_process(recipe: str, tmp_path: Path, args: list[str]) -> list[float]:
    result = run_single(tmp_path / "one", *args) if recipe == "ddp" else run(
        [str(REPO / ".venv" / "bin" / "python"), str(REPO / "recipes" / recipe / "train.py"),
         "--out-dir", str(tmp_path / "one"), *args], env=recipe_env(), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(read_metrics(tmp_path / "one"))


def assert_parallel(metrics: dict, job: str, world: int, nodes: int, wrapper: str) -> None:
    """From inside the run: its world, backend and wrapper; from Slurm: the nodes it ran on."""
    assert (metrics["world_size"], metrics["backend"], metrics["model_wrapper"], metrics["launcher"]) == \
        (world, "gloo", wrapper, "srun"), {k: metrics.get(k) for k in ("world_size", "backend", "model_wrapper", "launcher")}
    assert len(set(job_nodes(job))) == nodes


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_ddp_on_n_nodes_trains_as_one_process(scale_cluster, tmp_path, nodes):
    job, log, submitted_at = sbatch_timed(scale_cluster, tmp_path, "ddp", nodes, 1, SHORT)
    metrics = read_metrics(tmp_path / "run")
    assert_parallel(metrics, job, nodes, nodes, "DistributedDataParallel")
    hosts = re.search(r"^ *0: \[ddp\] world_size=\d+ .* hosts=(\S+)", log, re.M)
    assert hosts and sorted(hosts.group(1).split(",")) == sorted(job_nodes(job)), log[-3000:]
    difference = max_relative_difference(losses(metrics), one_process("ddp", tmp_path, SHORT))
    assert difference <= PARITY_RTOL, f"{nodes} nodes: {difference:.2e} from one process"
    figures = startup_figures(metrics, submitted_at)
    assert re.search(r"^ *0: \[ddp\] first step done [\d.]+ s after the job started \(preflight ", log, re.M), log[-3000:]
    record(f"ddp-{nodes}x1", {"nodes": nodes, "ranks": nodes, "max_relative_difference": difference, **figures})


def test_negative_control_summed_gradients_on_16_nodes_miss_one_process(scale_cluster, tmp_path):
    """The check above must catch a wrong result at this scale: gradients summed over 16 ranks (16x)."""
    sbatch_timed(scale_cluster, tmp_path, "ddp", SCALE_NODES, 1, SHORT, **fault("grad-sum"))
    difference = max_relative_difference(losses(read_metrics(tmp_path / "run")), one_process("ddp", tmp_path, SHORT))
    assert difference > 100 * PARITY_RTOL, f"summed gradients on 16 ranks were only {difference:.2e} from one process"


def test_fsdp2_tp_on_8_nodes_x_2_trains_as_one_process(scale_cluster, tmp_path):
    """slurm/fsdp_tp_pp.sh's default layout: TP = ranks per node (2), FSDP2 across the 8 nodes."""
    args = [*TINY, "--global-batch", "16", "--max-steps", "4", "--checkpoint-every", "0", "--optimizer", "sgd", "--lr", "0.3"]
    job, log, submitted_at = sbatch_timed(scale_cluster, tmp_path, "fsdp_tp_pp", 8, 2, args)
    metrics = read_metrics(tmp_path / "run")
    assert (metrics["world_size"], metrics["backend"], metrics["launcher"]) == (16, "gloo", "srun")
    assert {k: metrics["layout"][k] for k in ("pp", "dp_replicate", "dp_shard", "tp")} == \
        {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 2}, metrics["layout"]
    assert len(set(job_nodes(job))) == 8
    difference = max_relative_difference(losses(metrics), one_process("fsdp_tp_pp", tmp_path, [*args, "--tp", "1"]))
    assert difference <= PARITY_RTOL, f"FSDP2 8 x TP 2: {difference:.2e} from one process"
    record("fsdp_tp_pp-8x2", {"nodes": 8, "ranks": 16, "max_relative_difference": difference,
                               **startup_figures(metrics, submitted_at)})


def test_megatron_tp2_pp4_dp2_on_8_nodes_x_2_trains_as_one_process(scale_cluster, tmp_path):
    """TP 2 inside each node, a 4-stage pipeline and 2 data-parallel replicas across the 8 nodes."""
    args = ["--seq-len", "32", "--log-every", "1", "--max-steps", "4", "--checkpoint-every", "0",
            "--optimizer", "sgd", "--lr", "1.0", "--clip-grad", "0", "--global-batch", "16"]
    job, log, submitted_at = sbatch_timed(scale_cluster, tmp_path, "megatron_tp_pp", 8, 2, [*args, "--pp", "4"])
    metrics = read_metrics(tmp_path / "run")
    assert_parallel(metrics, job, 16, 8, "DistributedDataParallel")
    assert {k: metrics["layout"][k] for k in ("tp", "pp", "dp")} == {"tp": 2, "pp": 4, "dp": 2}, metrics["layout"]
    megatron_shim.check_sites(metrics)  # megatron-core on CPU: only the allowed placement rewrites
    difference = max_relative_difference(losses(metrics), one_process("megatron_tp_pp", tmp_path, [*args, "--tp", "1", "--pp", "1"]))
    assert difference <= PARITY_RTOL, f"Megatron TP 2 x PP 4 x DP 2: {difference:.2e} from one process"
    record("megatron_tp_pp-8x2", {"nodes": 8, "ranks": 16, "max_relative_difference": difference,
                                   **startup_figures(metrics, submitted_at)})


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_killed_rank_ends_a_16_node_job_promptly_and_is_named(scale_cluster, tmp_path):
    job = submit_recipe(scale_cluster, tmp_path, "ddp", "-N", str(SCALE_NODES), "--ntasks-per-node", "1", "-t", "10",
                        recipe_args=[*LONG, "--max-steps", "100000"], LAUNCH_MAX_REQUEUES="0")[1]
    log = tmp_path / f"ddp-{job}.out"
    wait_for(lambda: re.search(r"^\[ddp\] step +10 ", unlabelled(read(log)), re.M), 300, "training to start")
    last = SCALE_NODES - 1
    pid = wait_for(lambda: rank_pid(tmp_path / "run", last), 30, f"rank {last}'s process")
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    state = wait_for(lambda: final_state(job), 60, "the job to end after a rank was killed")
    elapsed = time.monotonic() - killed_at
    assert state == "FAILED", read(log)[-3000:]
    assert f"srun: error: {job_nodes(job)[last]}: task {last}: Killed" in read(log), read(log)[-3000:]
    # (not requeued: LAUNCH_MAX_REQUEUES=0; the node is named in the run's incident record all the same)
    incident = json.loads((tmp_path / "run" / "incidents.jsonl").read_text().splitlines()[0])
    assert (incident["class"], incident["nodes"], incident["ranks"]) == ("node", [job_nodes(job)[last]], [last]), incident
    record(f"killed-rank-{SCALE_NODES}x1", {"nodes": SCALE_NODES, "ranks": SCALE_NODES, "kill_to_job_end_s": elapsed})


@pytest.mark.parametrize("nodes", (2, SCALE_NODES))
def test_time_limit_signal_requeues_and_resumes_on_the_same_curve(scale_cluster, tmp_path, nodes):
    """What '#SBATCH --signal=USR1@T' does, at 2 and at 16 nodes: the ranks checkpoint, the job requeues
    itself, the requeued run resumes, and its losses are the uninterrupted run's, within PARITY_RTOL. (Bitwise
    at 2 ranks; at 16, 2.2e-7 apart from the first step after the resume on, in every run so far: most likely
    the new process's first DDP step, on DDP's initial gradient buckets, groups 16 ranks' sums differently
    from the uninterrupted run's rebuilt buckets. The default tier's resume controls show that a wrong
    resume misses by far more.)"""
    reference = tmp_path / "reference"
    reference.mkdir()
    sbatch_timed(scale_cluster, reference, "ddp", nodes, 1, LONG)
    job = submit_recipe(scale_cluster, tmp_path, "ddp", "-N", str(nodes), "--ntasks-per-node", "1", "-t", "10",
                        recipe_args=LONG)[1]
    log = tmp_path / f"ddp-{job}.out"
    wait_for(lambda: re.search(r"^\[ddp\] step +10 ", unlabelled(read(log)), re.M), 300, "training to start")
    signalled_at = time.time()
    assert run(["scancel", "--signal=USR1", job], env=recipe_env(**scale_cluster)).returncode == 0
    # Slurm holds a requeued job until its step credentials expire (slurm.conf AuthInfo cred_expire).
    state = wait_for(lambda: final_state(job), 420, "the requeued job to finish", interval=1)
    text = read(log)
    assert state == "COMPLETED", text[-3000:]
    stopped = re.search(r"\[ddp\] stopped by SIGUSR1 after step (\d+): checkpoint written", text)
    assert stopped and f"launch: job {job} (restart 1)" in text, text[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert metrics["resumed_from_step"] == int(stopped.group(1)) and metrics["world_size"] == nodes
    assert [r["step"] for r in metrics["history"]] == list(range(1, 151))
    difference = max_relative_difference(losses(metrics), losses(read_metrics(reference / "run")))
    assert difference <= PARITY_RTOL, f"{nodes} nodes: the resumed curve is {difference:.2e} from the uninterrupted one"
    startup = metrics["startup"]  # the requeued run's (the last process to write metrics.json)
    record(f"requeue-{nodes}x1", {"nodes": nodes, "ranks": nodes, "stopped_after_step": int(stopped.group(1)),
                                  "max_relative_difference": difference,
                                  "signal_to_requeued_first_step_s": startup["first_step_at"] - signalled_at,
                                  "signal_to_requeued_batch_s": startup["batch_started_at"] - signalled_at,
                                  "requeued_preflight_s": startup["preflight_s"]})


def test_a_killed_rank_in_a_16_node_job_goes_on_on_a_spare_in_the_same_job(scale_cluster, tmp_path):
    """HPCML_SPARE_NODES=2 on 16 nodes: 14 train. Rank 7's process killed after step 20: every node was checked
    before the ranks started, the job goes on in the same job on a spare from its last checkpoint, and its losses
    are the uninterrupted 14-node run's within PARITY_RTOL (as for the requeue below: DDP's first step after a
    restart may group the sums differently)."""
    args = [*LONG, "--global-batch", "28", "--checkpoint-every", "10"]  # (2 sequences per rank at 14 ranks)
    reference = tmp_path / "reference"
    reference.mkdir()
    sbatch_timed(scale_cluster, reference, "ddp", 14, 1, args)
    job = submit_recipe(scale_cluster, tmp_path, "ddp", "-N", str(SCALE_NODES), "--ntasks-per-node", "1", "-t", "10",
                        recipe_args=args, HPCML_SPARE_NODES="2")[1]
    log = tmp_path / f"ddp-{job}.out"
    wait_for(lambda: re.search(r"^\[ddp\] step +20 ", unlabelled(read(log)), re.M), 300, "step 20")
    pid = wait_for(lambda: rank_pid(tmp_path / "run", 7), 30, "rank 7's process")
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    resumed = wait_for(lambda: re.search(r"^\[ddp\] resumed from \S+ \(step (\d+)\)", unlabelled(read(log)), re.M), 300,
                       "the run to resume on a spare")
    next_step = int(resumed.group(1)) + 10  # (the first step logged after it: --log-every 10, checkpoints every 10)
    wait_for(lambda: re.search(rf"\[ddp\] resumed from .*^\[ddp\] step +{next_step} ", unlabelled(read(log)), re.M | re.S),
             300, "the first logged step after the resume")
    recovery_s = time.monotonic() - killed_at
    state = wait_for(lambda: final_state(job), 420, "the job to finish", interval=1)
    text = unlabelled(read(log))
    assert state == "COMPLETED" and "(restart 1)" not in text, text[-3000:]
    nodes = job_nodes(job)
    assert re.search(r"^launch: checked 16 node\(s\) in \S+ s \(slurm/lib/vet_node.py\): 0 failed$", text, re.M), text[-3000:]
    incident = json.loads((tmp_path / "run" / "incidents.jsonl").read_text().splitlines()[0])
    assert (incident["class"], incident["nodes"], incident["ranks"]) == ("node", [nodes[7]], [7]), incident
    second = nodes[:7] + nodes[8:15]
    assert f"launch: attempt 2 on {' '.join(second)} (master {nodes[0]})" in text, text[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert metrics["world_size"] == 14 and metrics["last_step"] == 150
    assert [r["step"] for r in metrics["history"]] == list(range(1, 151))
    difference = max_relative_difference(losses(metrics), losses(read_metrics(reference / "run")))
    assert difference <= PARITY_RTOL, f"the curve on the spare is {difference:.2e} from the uninterrupted one"
    record(f"spare-{SCALE_NODES}x1", {"nodes": SCALE_NODES, "ranks": 14, "spare_nodes": 2,
                                      "kill_to_step_10_after_the_resume_s": recovery_s, "max_relative_difference": difference})
