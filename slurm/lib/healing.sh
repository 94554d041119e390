# shellcheck shell=bash
# A node that fails: found, left out, and the run goes on from its last checkpoint (docs/reliability.md,
# "A node fails"). Sourced by slurm/lib/launch.sh, with the others; nothing here runs on its own.
#
#   HPCML_SPARE_NODES=K  of the job's N nodes, train on N-K and keep K aside: when a step fails because of a
#                        node, the step starts again in the same job on the nodes left (a spare in place of the
#                        failed one), resuming from the last checkpoint. Default 0.
#   LAUNCH_MAX_NODE_RESTARTS  in-job restarts at most (default 3); never on a node that failed in this job.
#   LAUNCH_MAX_REQUEUES  (run_dir.sh) bounds the requeues: when no spare is left, the job is requeued with the
#                        failed nodes in its excluded node list (scontrol show job: ExcNodeList), so Slurm never
#                        gives it those nodes again.
#
#   HPCML_VET_NODES=1    check every node in the image before the ranks start (slurm/lib/vet_node.py: GPUs,
#                        network plugin and devices, memory, the run directory); a node that fails is left out
#                        as if it had failed in training. Default 1 with spare nodes, else 0.
#
# Which failures are a node's: each rank writes how it ended (recipes/harness/outcome.py) into
# RUN_DIR/.hpcml/outcomes/<attempt>/rank_<R>. A rank that recorded an exception or a bad option (the same bug
# would fail the same way on any node: a Python error, a NaN, an out-of-memory error) makes the failure the
# program's: the job ends with the rank's own line, as without this file. A rank that recorded the hardware's
# error (an uncorrectable ECC error, a GPU lost), or that recorded nothing (killed by a signal, or killed
# while it hung and the others' collectives timed out), makes it its node's. Every failed step is a line of
# RUN_DIR/incidents.jsonl: the time, job, run, attempt, class, nodes, ranks, step, cause and what was done.

# The nodes that train and the ones kept aside. Run when launch.sh is sourced, before an sbatch file reads the
# job's shape (megatron_tp_pp.sh: --pp "$SLURM_JOB_NUM_NODES"): with spares, Slurm's variables in the batch
# script describe the nodes that train, and srun starts the ranks on those (srun reads them too).
SPARE_NODES=0
TRAIN_NODES=0
reserve_spare_nodes() {
    SPARE_NODES=${HPCML_SPARE_NODES:-0}
    [[ $SPARE_NODES =~ ^[0-9]+$ ]] || launch_error "HPCML_SPARE_NODES=$SPARE_NODES: give a number of nodes (0: none)"
    [[ ${LAUNCH_MAX_NODE_RESTARTS:-3} =~ ^[0-9]+$ ]] ||
        launch_error "LAUNCH_MAX_NODE_RESTARTS=$LAUNCH_MAX_NODE_RESTARTS: give a number of restarts (0: none)"
    ((SPARE_NODES > 0)) || return 0
    # (once per batch script: sourced again, launch.sh finds the training shape already in place)
    [[ ${HPCML_JOB_NODES:-} != "${SLURM_JOB_ID:-}:"* ]] || { TRAIN_NODES=$SLURM_JOB_NUM_NODES && return 0; }
    local nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    local tasks=${SLURM_NTASKS:-$nodes}
    ((SPARE_NODES < nodes)) || launch_error "HPCML_SPARE_NODES=$SPARE_NODES leaves none of the job's $nodes" \
        "node(s) to train on: ask for more (sbatch -N $((nodes + SPARE_NODES)))"
    ((tasks % nodes == 0)) || launch_error "HPCML_SPARE_NODES: $tasks tasks on $nodes nodes: a spare replaces" \
        "a node with as many ranks; use --ntasks-per-node"
    TRAIN_NODES=$((nodes - SPARE_NODES))
    local per_node=$((tasks / nodes))
    export HPCML_JOB_NODES=${SLURM_JOB_ID:-}:$nodes
    export SLURM_JOB_NUM_NODES=$TRAIN_NODES SLURM_NNODES=$TRAIN_NODES
    export SLURM_NTASKS=$((TRAIN_NODES * per_node)) SLURM_NPROCS=$((TRAIN_NODES * per_node))
    export SLURM_TASKS_PER_NODE="$per_node(x$TRAIN_NODES)"
}

# Each of the given nodes checks itself (vet_node.py, one task per node, in the runtime): VET_FAILED holds
# "node reason" for each that failed or did not answer within 120 s. $1 runtime, $2 image, the rest: the nodes.
vet_nodes() {
    local runtime=$1 image=$2 answers=$RUN_DIR/.hpcml/vet node started=$EPOCHREALTIME
    shift 2
    local -a nodes=("$@") vet=()
    rm -rf "$answers" && mkdir -p "$answers"
    build_command vet "$runtime" "$image" "$REPO_DIR/slurm/lib/vet_node.py" "$answers"
    VET_FAILED=()
    timeout 120 srun --kill-on-bad-exit=0 -N "${#nodes[@]}" --ntasks="${#nodes[@]}" --ntasks-per-node=1 \
        --nodelist="$(IFS=, && echo "${nodes[*]}")" "${vet[@]}" >/dev/null 2>&1 || true
    for node in "${nodes[@]}"; do
        if [[ ! -s $answers/$node ]]; then
            VET_FAILED+=("$node no answer from its check within 120 s")
        elif [[ $(<"$answers/$node") != ok* ]]; then
            VET_FAILED+=("$node $(sed 's/^failed //' "$answers/$node")")
        fi
    done
    echo "launch: checked ${#nodes[@]} node(s) in $(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }') s" \
        "(slurm/lib/vet_node.py): ${#VET_FAILED[@]} failed${VET_FAILED[*]:+: ${VET_FAILED[*]}}"
}

# STEP_NODES: the first TRAIN_NODES of the job's nodes that have not failed in it; false when too few are left.
choose_step_nodes() {
    local node
    STEP_NODES=()
    for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
        [[ " ${FAILED_NODES[*]} " == *" $node "* ]] || STEP_NODES+=("$node")
        ((${#STEP_NODES[@]} < TRAIN_NODES)) || return 0
    done
    return 1
}

# How the step that wrote the outcomes in $1 failed: FAILURE_CLASS (node, program or unknown), FAILURE_NODES,
# FAILURE_RANKS, FAILURE_STEP (the latest step a rank was in) and FAILURE_CAUSE (one line).
classify_failure() {
    local dir=$1 file rank first last outcome host step detail
    local -a program=() hardware=() silent=() hosts=()
    local collectives=0
    FAILURE_CLASS=unknown FAILURE_NODES=() FAILURE_RANKS=() FAILURE_STEP=0 FAILURE_CAUSE=""
    for file in "$dir"/rank_*; do
        [[ -f $file ]] || continue
        rank=${file##*/rank_}
        first=$(head -n 1 "$file") last=$(tail -n 1 "$file")
        read -r _ host _ <<<"$first"
        [[ " ${hosts[*]} " == *" $host "* ]] || hosts+=("$host")
        if [[ $last == "$first" ]]; then
            silent+=("$rank:$host")
            continue
        fi
        read -r outcome _ step detail <<<"$last"
        step=${step#step=}
        ((step <= FAILURE_STEP)) || FAILURE_STEP=$step
        case $outcome in
        program | bad-input) program+=("$rank:$host") ;;
        node) hardware+=("$rank:$host") ;;
        collective) collectives=$((collectives + 1)) && continue ;;
        *) continue ;;
        esac
        [[ -n $FAILURE_CAUSE ]] || FAILURE_CAUSE="rank $rank on $host: $detail"
    done
    local -a blamed=()
    if ((${#program[@]})); then
        FAILURE_CLASS=program blamed=("${program[@]}")
    elif ((${#hardware[@]})); then
        FAILURE_CLASS=node blamed=("${hardware[@]}")
    elif ((${#silent[@]})); then
        blamed=("${silent[@]}")
        local -a silent_hosts=()
        local entry
        for entry in "${silent[@]}"; do [[ " ${silent_hosts[*]} " == *" ${entry#*:} "* ]] || silent_hosts+=("${entry#*:}"); done
        # Every node silent: nothing tells which one failed (a whole step lost, or a one-node job).
        if ((${#silent_hosts[@]} < ${#hosts[@]})); then
            FAILURE_CLASS=node FAILURE_CAUSE="rank ${silent[0]%%:*} on ${silent[0]#*:} died or hung (no outcome recorded: killed by a signal)"
        else
            FAILURE_CAUSE="no rank recorded how it ended: cannot tell a node's failure from the program's"
        fi
    elif ((collectives)); then
        # (a rank that hung and came back when Slurm ended the step, as a stopped process does, sees its collective
        # fail like the others)
        FAILURE_CAUSE="every rank saw a collective fail: which one died or hung is not known"
    elif ((${#hosts[@]})); then
        FAILURE_CAUSE="every rank ended by itself, yet the step failed (a task's process outside the ranks, e.g. the container runtime's, was killed?)"
    else
        FAILURE_CAUSE="no rank recorded how it ended (did the ranks start?)"
    fi
    # (a negative control for the tests: every failure taken for a node's, the program's too)
    if [[ ${HPCML_TEST_FAULT:-} == program-error-as-node && $FAILURE_CLASS == program ]]; then
        FAILURE_CLASS=node blamed=("${blamed[0]}")
    fi
    local entry
    for entry in "${blamed[@]}"; do
        FAILURE_RANKS+=("${entry%%:*}")
        [[ " ${FAILURE_NODES[*]} " == *" ${entry#*:} "* ]] || FAILURE_NODES+=("${entry#*:}")
    done
}

json_string() {
    local text=$1
    text=${text//\\/\\\\}
    text=${text//\"/\\\"}
    text=${text//$'\n'/ }
    text=${text//$'\t'/ }
    printf '"%s"' "$text"
}

json_list() { # numbers as numbers, the rest as strings
    local item first=1
    printf '['
    for item in "$@"; do
        ((first)) || printf ', '
        first=0
        if [[ $item =~ ^[0-9]+$ ]]; then printf '%s' "$item"; else json_string "$item"; fi
    done
    printf ']'
}

# One line of RUN_DIR/incidents.jsonl for the failed step: $1 the attempt, $2 the exit code, $3 what was done.
record_incident() {
    local line
    line=$(printf '{"time": %s, "job": %s, "run": %s, "attempt": %s, "exit_code": %s, "class": %s, "nodes": %s, "ranks": %s, "step": %s, "cause": %s, "action": %s}' \
        "$(json_string "$(date -u '+%FT%TZ')")" "$(json_string "$SLURM_JOB_ID")" "${SLURM_RESTART_COUNT:-0}" "$1" "$2" \
        "$(json_string "$FAILURE_CLASS")" "$(json_list "${FAILURE_NODES[@]}")" "$(json_list "${FAILURE_RANKS[@]}")" \
        "$FAILURE_STEP" "$(json_string "$FAILURE_CAUSE")" "$(json_string "$3")")
    echo "$line" >>"$RUN_DIR/incidents.jsonl"
    local around=""
    ((FAILURE_STEP == 0)) || around=", around step $FAILURE_STEP"
    echo "launch: incident: $FAILURE_CLASS failure (${FAILURE_CAUSE})$around: $3 (RUN_DIR/incidents.jsonl)" >&2
}

# Requeue the job with the failed nodes excluded. A running job's excluded nodes cannot be changed; a requeued
# one's can, in the moment before this script ends: `scontrol requeue` ends it with SIGTERM (ignored here) and
# SIGKILL after Slurm's KillWait, and the update comes at once after the requeue.
requeue_without_nodes() {
    local restarts=${SLURM_RESTART_COUNT:-0} limit=${LAUNCH_MAX_REQUEUES:-10} excluded node
    excluded=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'ExcNodeList=[^ ]*') || true
    excluded=${excluded#ExcNodeList=}
    [[ $excluded != "(null)" ]] || excluded=""
    for node in "$@"; do excluded=${excluded:+$excluded,}$node; done
    trap '' TERM
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        echo "launch: error: scontrol requeue failed: resubmit the job with --exclude=$excluded to continue" >&2
        return 1
    fi
    if scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded"; then
        echo "launch: requeued job $SLURM_JOB_ID without node(s) $excluded (restart $((restarts + 1)) of at most $limit)" >&2
    else
        echo "launch: warning: job $SLURM_JOB_ID requeued, but Slurm did not take its excluded nodes ($excluded):" \
            "it may run on them again" >&2
    fi
}

# The job step, started again without a failed node while spares and LAUNCH_MAX_NODE_RESTARTS allow; then the
# job requeued without it (LAUNCH_MAX_REQUEUES). $1: the name of the srun command's array. Returns the exit code
# of the last step.
run_training_step() {
    local -n srun_step=$1
    local runtime=$2 image=$3 attempt=0 status outcomes master_given=${MASTER_ADDR_GIVEN:-0} failed
    FAILED_NODES=()
    if [[ ${HPCML_VET_NODES:-$((SPARE_NODES > 0))} == 1 && -n ${RUN_DIR:-} ]]; then
        # shellcheck disable=SC2046 # (one word per node)
        vet_nodes "$runtime" "$image" $(scontrol show hostnames "$SLURM_JOB_NODELIST")
        for failed in "${VET_FAILED[@]}"; do
            FAILED_NODES+=("${failed%% *}")
            FAILURE_CLASS=node FAILURE_NODES=("${failed%% *}") FAILURE_RANKS=() FAILURE_STEP=0
            FAILURE_CAUSE="its check before the ranks started: ${failed#* }"
            record_incident 0 null "left out before the ranks started"
        done
        if ((${#VET_FAILED[@]})) && { ((SPARE_NODES == 0)) || ! choose_step_nodes; }; then
            if ((${SLURM_RESTART_COUNT:-0} >= ${LAUNCH_MAX_REQUEUES:-10})); then
                echo "launch: error: too few good nodes left, and requeued ${SLURM_RESTART_COUNT:-0} times already" >&2
            else
                requeue_without_nodes "${FAILED_NODES[@]}"
            fi
            return 1
        fi
    fi
    while true; do
        local -a step=("${srun_step[@]}")
        if ((SPARE_NODES > 0)); then
            choose_step_nodes
            step=("${srun_step[0]}" -N "$TRAIN_NODES" --nodelist="$(IFS=, && echo "${STEP_NODES[*]}")" "${srun_step[@]:1}")
            ((master_given)) || export MASTER_ADDR=${STEP_NODES[0]}
            if ((attempt == 0)); then
                echo "launch: training on ${STEP_NODES[*]} (master $MASTER_ADDR); $SPARE_NODES spare node(s) kept aside (HPCML_SPARE_NODES)"
            else
                echo "launch: attempt $((attempt + 1)) on ${STEP_NODES[*]} (master $MASTER_ADDR), from the last checkpoint"
            fi
        fi
        status=0
        if [[ -n ${RUN_DIR:-} ]]; then
            outcomes=$RUN_DIR/.hpcml/outcomes/$attempt
            rm -rf "$outcomes" && mkdir -p "$outcomes"
            export HPCML_RANK_OUTCOMES=$outcomes
        fi
        export HPCML_STEP_STARTED_AT=$EPOCHREALTIME
        without_run_dir_lock "${step[@]}" || status=$?
        if ((status == 0)) || [[ -z ${RUN_DIR:-} ]]; then
            return "$status"
        fi
        classify_failure "$outcomes"
        if [[ $FAILURE_CLASS != node ]]; then
            if [[ $FAILURE_CLASS == program ]]; then
                record_incident "$attempt" "$status" "ended the job (program failure: a restart would fail the same way)"
            else
                record_incident "$attempt" "$status" "ended the job (unknown failure: not known to be a node's, not restarted)"
            fi
            return "$status"
        fi
        FAILED_NODES+=("${FAILURE_NODES[@]}")
        if ((SPARE_NODES > 0 && attempt < ${LAUNCH_MAX_NODE_RESTARTS:-3})) && choose_step_nodes; then
            record_incident "$attempt" "$status" "restarted in the job without ${FAILURE_NODES[*]}, on ${STEP_NODES[*]}"
            attempt=$((attempt + 1))
            continue
        fi
        if ((${SLURM_RESTART_COUNT:-0} >= ${LAUNCH_MAX_REQUEUES:-10})); then
            record_incident "$attempt" "$status" "ended the job: no spare node left, and requeued ${SLURM_RESTART_COUNT:-0} times already (LAUNCH_MAX_REQUEUES=${LAUNCH_MAX_REQUEUES:-10})"
            return "$status"
        fi
        record_incident "$attempt" "$status" "requeued the job without ${FAILED_NODES[*]}"
        requeue_without_nodes "${FAILED_NODES[@]}"
        return "$status"
    done
}
