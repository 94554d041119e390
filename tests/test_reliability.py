"""Reliability on the local Slurm cluster, with real processes and real signals.

- a rank killed (SIGKILL) mid-training ends the job step within 60 s, the log names the rank, and the job is
  requeued without its node and resumes on the same curve (spare nodes: tests/test_healing.py);
- a rank stopped (SIGSTOP) ends the job within the process-group timeout, not at the wall-clock limit;
- Slurm's time-limit warning (SIGUSR1 to the job's tasks, as '#SBATCH --signal=USR1@T' sends it):
  the ranks checkpoint and stop, the job requeues itself, the requeued run resumes, and its losses
  equal an uninterrupted run's (DDP; accelerate, Megatron and Horovod: checkpoint and requeue);
- a crash in the middle of writing a checkpoint leaves the previous one, and resume uses it;
- bad input (at least 10 kinds) is refused before any rank starts, with one line, leaving nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from support.cluster import (copy_checkout, final_state, job_nodes, job_state, rank_pid, sbatch_recipe,
                             shifter_pull, submit_recipe, unlabelled, wait_for)
from support.curves import losses, read_metrics
from support.runs import assert_ok, container_env, DDP_RECIPE, recipe_env, REPO, run, run_single, run_torchrun, TINY

pytestmark = pytest.mark.slurm

# Long enough to be signalled in the middle (about 10 ms per step here), short enough to finish quickly.
LONG_RUN = [*TINY, "--global-batch", "8", "--max-steps", "400", "--checkpoint-every", "0", "--log-every", "10"]


def submit(cluster: dict, tmp_path: Path, *options: str, recipe_args: list[str], **env: str) -> str:
    """sbatch slurm/ddp.sh without waiting; returns the job id."""
    return submit_recipe(cluster, tmp_path, "ddp", *options, recipe_args=recipe_args, **env)[1]


def log_of(tmp_path: Path, job_id: str) -> str:
    log = tmp_path / f"ddp-{job_id}.out"
    return log.read_text() if log.exists() else ""


def started_training(tmp_path: Path, job_id: str) -> bool:
    return bool(re.search(r"^\[ddp\] step +10 ", unlabelled(log_of(tmp_path, job_id)), re.M))


def test_killed_rank_is_named_and_the_job_requeued_without_its_node_on_the_same_curve(slurm_cluster, tmp_path):
    """No spare node (tests/test_healing.py has those): a rank killed mid-training is its node's failure; the job
    step ends within 60 s, the log names the rank and node, and the job is requeued with that node in its
    excluded node list, resumes from its last checkpoint on other nodes, and ends on the uninterrupted curve."""
    args = [*LONG_RUN, "--checkpoint-every", "10"]
    reference = tmp_path / "reference"
    assert_ok(run_torchrun(reference, 2, *args))
    job = submit(slurm_cluster, tmp_path, "-N", "2", "--ntasks-per-node", "1", recipe_args=args)
    wait_for(lambda: started_training(tmp_path, job), 120, "training to start")
    pid = wait_for(lambda: rank_pid(tmp_path / "run", 1), 30, "rank 1's process")
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "launch: requeued job" in log_of(tmp_path, job), 60, "the job to requeue itself")
    print(f"job requeued {time.monotonic() - killed_at:.1f} s after rank 1 was killed")
    state = wait_for(lambda: final_state(job), 300, "the requeued job to finish", interval=1)
    log = log_of(tmp_path, job)
    assert state == "COMPLETED", log
    # Rank 1 ran on the job's second node (block distribution, one task per node), as Slurm recorded it.
    first_run, second_run = job_nodes(job, 0), job_nodes(job, -1)
    failed = first_run[1]
    assert f"srun: error: {failed}: task 1: Killed" in log, log
    assert f"launch: requeued job {job} without node(s) {failed} (restart 1 of at most 10)" in log, log
    assert failed not in second_run and f"launch: job {job} (restart 1)" in log, (second_run, log)
    [incident] = [json.loads(line) for line in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert (incident["class"], incident["nodes"], incident["ranks"]) == ("node", [failed], [1]), incident
    assert incident["action"] == f"requeued the job without {failed}"
    metrics = read_metrics(tmp_path / "run")
    assert 10 <= metrics["resumed_from_step"] <= incident["step"] and metrics["last_step"] == 400
    assert [r["step"] for r in metrics["history"]] == list(range(1, 401))
    assert max(abs(a - b) for a, b in zip(losses(metrics), losses(read_metrics(reference)), strict=True)) <= 1e-5


def test_stopped_rank_ends_the_job_within_the_collective_timeout(slurm_cluster, tmp_path):
    timeout_s = 15
    job = submit(slurm_cluster, tmp_path, "-N", "2", "--ntasks-per-node", "1",
                 recipe_args=[*LONG_RUN, "--max-steps", "100000", "--timeout-s", str(timeout_s)],
                 LAUNCH_MAX_REQUEUES="0")  # (ends the job whichever way the hang is classified, below)
    wait_for(lambda: started_training(tmp_path, job), 120, "training to start")
    pid = wait_for(lambda: rank_pid(tmp_path / "run", 1), 30, "rank 1's process")
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        # The timeout, plus Slurm's KillWait (5 s here) and a margin for this 2-core machine.
        state = wait_for(lambda: final_state(job), timeout_s + 30, "the job to end after a rank was stopped")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    elapsed = time.monotonic() - stopped_at
    print(f"job ended {elapsed:.1f} s after rank 1 was stopped (timeout {timeout_s} s)")
    log = log_of(tmp_path, job)
    assert state == "FAILED" and elapsed >= timeout_s - 1, (state, elapsed, log)
    assert f"[ddp] error: rank 0 on {job_nodes(job)[0]}: a collective failed" in log, log
    assert "another rank died, hung or was stopped" in log
    # Either Slurm killed the stopped rank before it ran again (it recorded nothing: its node's failure), or
    # Slurm's SIGCONT woke it first and it saw its collective fail like rank 0 (nothing tells which one hung: not
    # restarted; docs/reliability.md, "A node fails": the limits). Both happen here, by a race in Slurm's kill.
    [incident] = [json.loads(line) for line in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert (incident["class"], incident["nodes"], incident["cause"]) in [
        ("node", [job_nodes(job)[1]], f"rank 1 on {job_nodes(job)[1]} died or hung (no outcome recorded: killed by a signal)"),
        ("unknown", [], "every rank saw a collective fail: which one died or hung is not known")], incident
    # The evidence of the hang (PyTorch's Flight Recorder, which the launcher turns on): rank 0's last
    # collectives, the one that timed out last, in the run directory, and named in its line.
    trace = tmp_path / "run" / "flight_recorder" / "rank_0"
    entries = pickle.loads(trace.read_bytes())["entries"]
    assert entries and entries[-1]["profiling_name"].startswith("gloo:"), entries[-1:]
    assert f"(its last collective: {entries[-1]['profiling_name']} #{entries[-1]['collective_seq_id']}; " \
           f"flight recorder: {trace})" in log, log


def test_time_limit_signal_checkpoints_requeues_and_resumes_on_the_same_curve(slurm_cluster, tmp_path):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    code, state, log = sbatch_recipe(slurm_cluster, reference_dir, "ddp", "-N", "2", "--ntasks-per-node", "1",
                                     recipe_args=LONG_RUN)
    assert (code, state) == (0, "COMPLETED"), log

    job = submit(slurm_cluster, tmp_path, "-N", "2", "--ntasks-per-node", "1", recipe_args=LONG_RUN)
    wait_for(lambda: started_training(tmp_path, job), 120, "training to start")
    # What '#SBATCH --signal=USR1@120' does before the time limit: SIGUSR1 to every task of the job's steps.
    assert run(["scancel", "--signal=USR1", job], env=recipe_env(**slurm_cluster)).returncode == 0
    wait_for(lambda: "requeued job" in log_of(tmp_path, job), 60, "the job to requeue itself")
    # Slurm holds a requeued job until its step credentials expire (starting it sooner fails with "Job
    # credential revoked" on the nodes): 30 s on the local cluster (tests/cluster/local_slurm.sh).
    state = wait_for(lambda: final_state(job), 300, "the requeued job to finish", interval=1)
    log = log_of(tmp_path, job)
    assert state == "COMPLETED", log

    stopped = re.search(r"\[ddp\] stopped by SIGUSR1 after step (\d+): checkpoint written", log)
    assert stopped, log
    step = int(stopped.group(1))
    assert 10 <= step < 400
    assert f"launch: job {job} (restart 1)" in log
    assert re.search(rf"\[ddp\] resumed from \S+step_{step:08d}\.pt \(step {step}\)", log), log
    metrics = read_metrics(tmp_path / "run")
    assert metrics["resumed_from_step"] == step and metrics["last_step"] == 400
    assert [r["step"] for r in metrics["history"]] == list(range(1, 401))
    # Same layout, same reductions: the interrupted curve is the uninterrupted one.
    assert losses(metrics) == losses(read_metrics(reference_dir / "run"))


@pytest.mark.parametrize("runtime", ["none", pytest.param("podman", marks=pytest.mark.containers)])
def test_paths_with_spaces_work(slurm_cluster, request, tmp_path, runtime):
    """A checkout, a submission directory, a RUN_DIR and a CONTAINER_MOUNTS entry with spaces in their paths:
    the job runs (bare and in a container) and writes where it was told. (CONTAINER_MOUNTS separates its
    entries with spaces, so a mount with a space is given through a symlink without one.)"""
    checkout = tmp_path / "my checkout"
    copy_checkout(checkout)
    data = tmp_path / "data set"
    data.mkdir()
    (tmp_path / "data-link").symlink_to(data)
    env = {"CONTAINER_RUNTIME": runtime, "RUN_DIR": str(tmp_path / "run dir"), "CONTAINER_MOUNTS": str(tmp_path / "data-link")}
    if runtime == "podman":
        env["CONTAINER_IMAGE"] = request.getfixturevalue("ddp_image")[0]
    result = run(["sbatch", "--parsable", "--wait", "-t", "5", "-N", "1", "--ntasks-per-node", "2", "-o",
                  str(tmp_path / "%x-%j.out"), "slurm/ddp.sh", *TINY, "--global-batch", "4", "--max-steps", "2"],
                 env=container_env(**slurm_cluster, **env), cwd=checkout, timeout=420)
    job = result.stdout.strip().split(";")[0]
    log = (tmp_path / f"ddp-{job}.out").read_text()
    assert result.returncode == 0 and job_state(job) == "COMPLETED", log
    assert read_metrics(tmp_path / "run dir")["world_size"] == 2
    assert f"-v {str(tmp_path / 'run dir').replace(' ', chr(92) + ' ')}:" in log or runtime == "none", log


def test_a_job_submitted_from_outside_the_repository_says_where_to_submit_from(slurm_cluster, tmp_path):
    """sbatch path/to/repo/slurm/ddp.sh from another directory, without REPO_DIR: Slurm runs a copy of the
    file, which finds the repository through the submission directory only. One line, exit 2."""
    env = {key: value for key, value in recipe_env(**slurm_cluster).items() if key != "REPO_DIR"}
    result = run(["sbatch", "--parsable", "--wait", "-t", "5", "-N", "1", "-o", str(tmp_path / "%x-%j.out"),
                  str(REPO / "slurm" / "ddp.sh")], env=env, cwd=tmp_path, timeout=420)
    job = result.stdout.strip().split(";")[0]
    log = (tmp_path / f"ddp-{job}.out").read_text()
    assert result.returncode == 2 and job_state(job) == "FAILED", log
    assert log.strip().splitlines() == [
        f"launch: error: no slurm/lib/launch.sh in {tmp_path}: submit from the repository's root "
        "(cd path/to/repo && sbatch slurm/...), or set REPO_DIR"], log


def test_a_second_job_in_the_same_run_directory_is_refused(slurm_cluster, tmp_path):
    """Two jobs writing one RUN_DIR would overwrite each other's checkpoints: while the first trains, a second
    job (and the login-node check) with the same RUN_DIR is refused with one line naming the first; the first
    is untouched. (A requeued job, the same job again, gets its directory back: the time-limit test above.)"""
    # The first job trains until it is cancelled below: the second job and the check must find it still
    # running (its 400 steps once ended before them, under load, and the check then judged its checkpoint).
    first = submit(slurm_cluster, tmp_path, "-N", "1", "--ntasks-per-node", "1",
                   recipe_args=[*LONG_RUN, "--max-steps", "1000000"])
    try:
        wait_for(lambda: started_training(tmp_path, first), 120, "the first job to train")
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        code, state, log = sbatch_recipe(slurm_cluster, second_dir, "ddp", "-N", "1", "--ntasks-per-node", "1",
                                         recipe_args=LONG_RUN, RUN_DIR=str(tmp_path / "run"))
        assert (code, state) == (2, "FAILED"), log
        errors = [line for line in log.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(f"launch: error: RUN_DIR={tmp_path / 'run'} is in use by job {first} "), log
        check = run(["bash", str(REPO / "slurm" / "preflight.sh"), "-N", "1", "-n", "1", "slurm/ddp.sh"], cwd=REPO,
                    env=recipe_env(CONTAINER_RUNTIME="none", RUN_DIR=str(tmp_path / "run"), PYTHON=sys.executable), timeout=120)
        assert check.returncode == 2 and f"is in use by job {first} " in check.stderr, check.stderr
        assert final_state(first) is None  # still running
    finally:
        run(["scancel", first], env=recipe_env(**slurm_cluster))


@pytest.mark.parametrize("runtime", ["none", pytest.param("podman", marks=pytest.mark.containers)])
def test_accelerate_time_limit_signal_reaches_ranks_started_by_the_per_node_launcher(slurm_cluster, accelerate_image,
                                                                                     tmp_path, runtime):
    """slurm/accelerate.sh: Slurm signals one `accelerate launch` per node; the ranks must still checkpoint.

    Bare, Slurm signals every process of the step; under podman only the podman client, which passes
    the signal to the container's first process (slurm/lib/per_node.sh). (The requeued run is not waited
    for: the DDP test above covers requeue and resume, and tests/test_accelerate.py the accelerate resume.)
    """
    env = {"CONTAINER_RUNTIME": runtime}
    if runtime == "podman":
        env["CONTAINER_IMAGE"] = accelerate_image[0]
    job = submit_recipe(slurm_cluster, tmp_path, "accelerate", "-N", "2", "--ntasks-per-node", "1",
                        recipe_args=LONG_RUN, **env)[1]
    log_path = tmp_path / f"accelerate-{job}.out"
    log = lambda: log_path.read_text() if log_path.exists() else ""  # noqa: E731
    try:
        wait_for(lambda: re.search(r"^\[accelerate\] step +10 ", unlabelled(log()), re.M), 120, "training to start")
        assert run(["scancel", "--signal=USR1", job], env=recipe_env(**slurm_cluster)).returncode == 0
        wait_for(lambda: "requeued job" in log(), 60, "the job to requeue itself")
    finally:
        run(["scancel", job], env=recipe_env(**slurm_cluster))
    wait_for(lambda: left_the_queue(job, slurm_cluster), 60, "the cancelled job to leave the queue")
    text = log()
    signalled = re.findall(r"per_node: (\S+): USR1 to rank process \d+", text)
    assert sorted(signalled) == sorted(job_nodes(job)), text  # one launcher on each of the job's two nodes
    stopped = re.search(r"\[accelerate\] stopped by SIGUSR1 after step (\d+): checkpoint written", text)
    assert stopped, text
    step = int(stopped.group(1))
    assert 10 <= step < 400
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    assert sorted(p.name for p in checkpoint.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]


def left_the_queue(job: str, cluster: dict) -> bool:
    """Neither pending, running nor on its way back: no longer listed (the local cluster forgets an ended job
    within seconds; the job-completion log may have no record of a job cancelled while it was being requeued),
    or listed in a final state."""
    listed = run(["squeue", "-h", "-j", job, "-o", "%T"], env=recipe_env(**cluster))
    if listed.returncode != 0:  # (forgotten by the controller; any other failure of squeue is not an answer)
        return "Invalid job id" in listed.stderr
    return listed.stdout.strip() in ("", "CANCELLED", "COMPLETED", "FAILED")


def signal_time_limit_and_wait_for_requeue(cluster: dict, tmp_path: Path, recipe: str, max_steps: int,
                                           extra_args: tuple[str, ...] = (), user=None, **env: str) -> tuple[str, int, list[str]]:
    """Submit slurm/<recipe>.sh on 2 nodes x 1 task (as ``user`` when given: tmp_path must be theirs), send
    SIGUSR1 once step 10 is logged (what '#SBATCH --signal=USR1@T' does), wait for the job to requeue itself,
    then cancel it. Returns the log, the step the ranks stopped after (checked to lie between 10 and
    max_steps) and the nodes Slurm ran it on."""
    job = submit_recipe(cluster, tmp_path, recipe, "-N", "2", "--ntasks-per-node", "1",
                        recipe_args=["--seq-len", "32", "--max-steps", str(max_steps), "--checkpoint-every", "0",
                                     "--log-every", "10", *extra_args], user=user, **env)[1]
    log_path = tmp_path / f"{recipe}-{job}.out"
    log = lambda: log_path.read_text() if log_path.exists() else ""  # noqa: E731
    try:  # (whatever fails, the job goes: it would requeue itself at each time limit, LAUNCH_MAX_REQUEUES times)
        wait_for(lambda: re.search(rf"^\[{recipe}\] step +10 ", unlabelled(log()), re.M), 180, "training to start")
        assert run(["scancel", "--signal=USR1", job], env=recipe_env(**cluster)).returncode == 0
        wait_for(lambda: "requeued job" in log(), 90, "the job to requeue itself")
    finally:
        run(["scancel", job], env=recipe_env(**cluster))
    # The scancel holds: the launcher says "requeued" once the job is back in the queue, and requeues only a job
    # still running (`scontrol requeue` takes a cancelled one too: a scancel while the ranks checkpointed was undone).
    wait_for(lambda: left_the_queue(job, cluster), 60, "the cancelled job to leave the queue")
    text = log()
    stopped = re.search(rf"\[{recipe}\] stopped by SIGUSR1 after step (\d+): checkpoint written", text)
    assert stopped, text
    step = int(stopped.group(1))
    assert 10 <= step < max_steps
    assert not list((tmp_path / "run" / "checkpoints").glob(".step_*.partial"))
    return text, step, job_nodes(job)


def test_megatron_time_limit_signal_writes_a_distributed_checkpoint_across_the_pipeline(slurm_cluster, tmp_path):
    """slurm/megatron_tp_pp.sh on 2 nodes x 1 task (PP 2 across the nodes): at SIGUSR1 both stages agree on
    the step, write their shards of one distributed checkpoint, and the job requeues itself. (The resume
    itself, in the same and in another layout, is covered by tests/test_megatron.py.)"""
    text, step, nodes = signal_time_limit_and_wait_for_requeue(slurm_cluster, tmp_path, "megatron_tp_pp", 2000)
    assert "TP=1 PP=2 DP=1" in text and f"hosts={','.join(nodes)}" in text, text
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    assert (checkpoint / "metadata.json").exists() and list(checkpoint.glob("*.distcp"))


def test_fsdp_tp_pp_time_limit_signal_writes_a_dcp_checkpoint_of_every_shard(slurm_cluster, tmp_path):
    """slurm/fsdp_tp_pp.sh on 2 nodes x 1 task (TP 1 per node, FSDP2 across the two): at SIGUSR1 both ranks
    agree on the step, write their shards of one torch.distributed.checkpoint, and the job requeues itself.
    (Resuming, in the same and in another layout, is tests/test_fsdp_tp_pp.py's.)"""
    text, step, nodes = signal_time_limit_and_wait_for_requeue(slurm_cluster, tmp_path, "fsdp_tp_pp", 4000)
    assert "mesh=pp1xdp_replicate1xdp_shard2xtp1" in text and f"hosts={','.join(nodes)}" in text, text
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    assert (checkpoint / ".metadata").exists() and sorted(p.name for p in checkpoint.glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]


def test_deepspeed_pipeline_time_limit_signal_checkpoints_every_stage_and_requeues(slurm_cluster, tmp_path):
    """slurm/deepspeed.sh --pp auto on 2 nodes x 1 task (one pipeline stage per node): at SIGUSR1 both stages
    agree on the step, write DeepSpeed's pipeline checkpoint (a file per layer) and the job requeues itself.
    (Resuming it is tests/test_deepspeed_pipeline.py's.)"""
    text, step, nodes = signal_time_limit_and_wait_for_requeue(slurm_cluster, tmp_path, "deepspeed", 4000,
                                                               ("--pp", "auto"))
    assert "PP=2 DP=1" in text and f"hosts={','.join(nodes)}" in text, text
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["pp"] == 2
    # a file per layer with parameters (embedding, 2 blocks, final norm; the head is the tied embedding), and
    # one model and one optimizer file per stage
    assert sorted(p.name for p in checkpoint.glob("layer_*-model_states.pt")) == \
        [f"layer_{i:02d}-model_states.pt" for i in range(4)]
    assert len(list(checkpoint.glob("zero_pp_rank_0_mp_rank_*_optim_states.pt"))) == 2


def test_horovod_time_limit_signal_checkpoints_and_requeues(slurm_cluster, tmp_path):
    """slurm/horovod.sh on 2 nodes x 1 task, bare (.venv-tf): at SIGUSR1 the Horovod ranks agree on the step
    (an all-reduce max of what each received), rank 0 publishes one TensorFlow checkpoint, and the job
    requeues itself. (Resuming from it is tests/test_tensorflow.py's.)"""
    text, step, nodes = signal_time_limit_and_wait_for_requeue(slurm_cluster, tmp_path, "horovod", 100000,
                                                               PYTHON=str(REPO / ".venv-tf" / "bin" / "python"))
    assert "world_size=2 controller=gloo" in text and f"hosts={','.join(nodes)}" in text, text
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    assert json.loads((checkpoint / "meta.json").read_text())["step"] == step
    assert (checkpoint / "ckpt.index").exists()


@pytest.mark.containers
@pytest.mark.parametrize("runtime", ["shifter", "podman-hpc"])
def test_time_limit_signal_reaches_the_ranks_in_perlmutters_runtimes(slurm_cluster, ddp_image, request, tmp_path, runtime):
    """slurm/ddp.sh as a normal user, under the Shifter stand-in and NERSC's podman-hpc: Slurm's SIGUSR1
    reaches every rank through the runtime, the ranks checkpoint and the job requeues itself. (One
    container per rank: `podman-hpc run` execs podman, which passes signals to the rank. `podman-hpc
    shared-run`, one container per node with the ranks exec'd into it, does not: its Python wrapper dies
    of the signal and the ranks never see it, measured here; the launcher therefore uses `run`.)"""
    if runtime == "podman-hpc":
        user = request.getfixturevalue("squashed_images")("ddp")
    else:
        user = request.getfixturevalue("cluster_user")
        shifter_pull("ddp")
    work = user.work_dir(tmp_path)
    text, step, nodes = signal_time_limit_and_wait_for_requeue(slurm_cluster, work, "ddp", 4000, tuple(TINY[2:8]), user=user,
                                                               CONTAINER_RUNTIME=runtime, CONTAINER_IMAGE=ddp_image[0])
    assert f"launch: runtime={runtime} " in text and f"hosts={','.join(nodes)}" in text, text
    checkpoint = work / "run" / "checkpoints" / f"step_{step:08d}.pt"
    assert checkpoint.exists() and checkpoint.stat().st_uid == user.uid, text


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path):
    args = ["--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "2"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert_ok(run_single(straight, *args))
    result = run([sys.executable, str(DDP_RECIPE), "--out-dir", str(crashed), *TINY, *args],
                 env=recipe_env(HPCML_TEST_CRASH_DURING_CHECKPOINT="4"), timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr
    checkpoints = sorted(p.name for p in (crashed / "checkpoints").iterdir())
    assert checkpoints[-1] == "step_00000002.pt" and any(n.startswith(".step_00000004.pt.tmp.") for n in checkpoints)

    resumed = run_single(crashed, *args)
    assert_ok(resumed)
    assert "(step 2)" in resumed.stdout and "step_00000002.pt" in resumed.stdout
    assert not [p for p in (crashed / "checkpoints").iterdir() if ".tmp." in p.name]  # the torn file is gone
    assert losses(read_metrics(crashed)) == losses(read_metrics(straight))


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# Each: (sbatch options, recipe args, environment, the one line that must say what to change).
BAD_INPUTS = {
    "unknown runtime": ([], [], {"CONTAINER_RUNTIME": "docker"}, "launch: error: unknown CONTAINER_RUNTIME 'docker'"),
    "runtime not installed": ([], [], {"CONTAINER_RUNTIME": "shifter"},
        "launch: error: CONTAINER_RUNTIME=shifter but the 'shifter' command is not on PATH"),
    "missing image": ([], [], {"CONTAINER_RUNTIME": "podman", "CONTAINER_IMAGE": "hpcml/no-such-image:cpu"},
                      "launch: error: image 'hpcml/no-such-image:cpu' is not in podman's local storage"),
    "more tasks than GPUs per node": (["--ntasks-per-node", "6", "--cpus-per-task", "1"], [], {},
        "[ddp] error: 6 ranks per node but 4 GPUs per node"),
    "bad MASTER_PORT": ([], [], {"MASTER_PORT": "99999"}, "launch: error: MASTER_PORT=99999 is not a port number"),
    "unwritable output": ([], [], {"RUN_DIR": "{tmp}/file/run"}, "launch: error: cannot write to the run directory"),
    "relative extra mount": ([], [], {"CONTAINER_MOUNTS": "data"},
        "launch: error: CONTAINER_MOUNTS: 'data' is not an existing absolute directory"),
    "batch not divisible by the world size": ([], ["--global-batch", "6"], {},
        "[ddp] error: --global-batch 6 is not divisible by the world size 4"),
    "zero size": ([], ["--global-batch", "0"], {}, "[ddp] error: --global-batch must be at least 1, got 0"),
    "negative size": ([], ["--checkpoint-every", "-5"], {}, "[ddp] error: --checkpoint-every must be 0 (only at the end) or more, got -5"),
    "heads do not divide the width": ([], ["--n-embd", "30", "--n-head", "4"], {},
        "[ddp] error: --n-embd 30 is not divisible by --n-head 4"),
    "malformed config file": ([], ["--config", "{tmp}/broken.toml"], {}, "[ddp] error: --config {tmp}/broken.toml is not valid TOML"),
    "unknown key in config file": ([], ["--config", "{tmp}/typo.toml"], {}, "[ddp] error: unknown option 'learning_rate' in --config"),
    "wrong type in config file": ([], ["--config", "{tmp}/type.toml"], {},
        "[ddp] error: 'max-steps' in --config {tmp}/type.toml must be int, got '10'"),
    # GPU nodes (the cluster's are placeholders, which its jobs otherwise declare) and a CPU PyTorch
    "a CPU PyTorch on GPU nodes": ([], [], {"HPCML_ALLOW_CPU": ""}, "[ddp] error: Slurm gave this job GPUs (SLURM_"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_refused_before_any_rank_with_one_line(slurm_cluster, tmp_path, case):
    options, args, env, message = BAD_INPUTS[case]
    write(tmp_path / "file", "")
    write(tmp_path / "broken.toml", "lr = 0.001\nmax-steps = [10\n")
    write(tmp_path / "typo.toml", "learning_rate = 0.001\n")
    write(tmp_path / "type.toml", "max-steps = '10'\n")
    fill = lambda text: text.replace("{tmp}", str(tmp_path))  # noqa: E731
    code, state, log = sbatch_recipe(slurm_cluster, tmp_path, "ddp", "-N", "2", "--ntasks-per-node", "2", *options,
                                     recipe_args=[*TINY, *map(fill, args)], **{k: fill(v) for k, v in env.items()})
    assert code == 2 and state == "FAILED", log
    errors = [line for line in log.splitlines() if " error: " in line or line.startswith("srun: error")]
    assert len(errors) == 1 and errors[0].startswith(fill(message)) and "Traceback" not in log, log
    assert "world_size=" not in log and "srun: " not in log.replace("launch: srun", ""), log  # no rank started
    assert not (tmp_path / "run").exists(), "a refused job left its run directory behind"
