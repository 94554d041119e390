# shellcheck shell=bash
# The run directory's lock (one job per RUN_DIR) and the requeue at the time-limit warning.
# Sourced by slurm/lib/launch.sh, with the others; nothing here runs on its own.

# One job per run directory: two jobs writing the same checkpoints and metrics would ruin both runs. The batch
# script holds a lock on RUN_DIR/.hpcml-job.lock while it lives (a requeued job, the same id, finds it free
# again: the old batch script is gone); the preflight only looks. The file names the job that holds it.
RUN_DIR_LOCK_FILE=.hpcml-job.lock
claim_run_dir() {
    local lock=$RUN_DIR/$RUN_DIR_LOCK_FILE status=0 holder
    if [[ ${LAUNCH_PREFLIGHT_ONLY:-0} == 1 ]]; then
        [[ -e $lock ]] || return 0
        exec {RUN_DIR_LOCK}<"$lock"
    else
        exec {RUN_DIR_LOCK}>>"$lock"
    fi
    flock -n -E 75 "$RUN_DIR_LOCK" || status=$?
    if ((status == 75)); then
        holder=$(head -n 1 "$lock" 2>/dev/null) || true
        launch_error "RUN_DIR=$RUN_DIR is in use by ${holder:-another job}, which would overwrite this one's" \
            "checkpoints (and this one its): choose another RUN_DIR, or wait for that job to end (squeue --me)"
    elif ((status != 0)); then
        echo "launch: warning: cannot lock $lock (this file system has no flock): nothing stops a second job" \
            "from writing into RUN_DIR at the same time" >&2
    fi
    if [[ ${LAUNCH_PREFLIGHT_ONLY:-0} == 1 ]]; then
        exec {RUN_DIR_LOCK}<&-
    else
        echo "job $SLURM_JOB_ID (started $(date '+%F %T') on $(hostname))" >"$lock"
    fi
}

# "$@" without the lock's descriptor: a daemon it leaves behind (a container runtime's monitor) must not hold
# the lock past the job.
without_run_dir_lock() {
    if [[ -n ${RUN_DIR_LOCK:-} ]]; then "$@" {RUN_DIR_LOCK}>&-; else "$@"; fi
}

# The recipe checkpointed at Slurm's time-limit warning (SIGUSR1, '#SBATCH --signal=USR1@…') and left
# RUN_DIR/$STOP_MARKER: put the job back in the queue. It restarts with the same job id, so the same
# RUN_DIR, and resumes from that checkpoint. (On SIGTERM, preemption, Slurm requeues it itself.)
# Not a job cancelled meanwhile: `scontrol requeue` takes a finished job too, and a `scancel` that came while
# the ranks checkpointed was undone (the job ran again, up to LAUNCH_MAX_REQUEUES times). The line is printed
# once the job is back in the queue: a `scancel` after it cancels the queued job for good.
requeue_job() {
    local restarts=${SLURM_RESTART_COUNT:-0} limit=${LAUNCH_MAX_REQUEUES:-10} state
    if ((restarts >= limit)); then
        echo "launch: error: job $SLURM_JOB_ID was requeued $restarts times (LAUNCH_MAX_REQUEUES=$limit): not again;" \
            "resubmit it, or raise the time limit" >&2
        return
    fi
    state=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*') || true
    if [[ $state != JobState=RUNNING ]]; then
        echo "launch: job $SLURM_JOB_ID was cancelled while it checkpointed (${state:-its state unknown}): not requeued;" \
            "the checkpoint is kept, and resubmitting the job continues from it" >&2
        return
    fi
    if scontrol requeue "$SLURM_JOB_ID"; then
        echo "launch: checkpoint written before the time limit: requeued job $SLURM_JOB_ID (restart $((restarts + 1)))"
    else
        echo "launch: error: scontrol requeue failed: resubmit the job to continue" >&2
    fi
}
