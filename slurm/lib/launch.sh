# shellcheck shell=bash
# Shared launch logic for every sbatch file in slurm/: sourced, then `launch_recipe RECIPE [ARGS...]`.
#
# Chooses the container runtime, finds the image, sets the rendezvous host and the Slingshot/NCCL
# settings, logs what is about to run, and starts one task per rank with `srun --label --kill-on-bad-exit`.
# Everything that can be wrong with the input is checked here (preflight), before srun starts a single
# rank; after the step, a recipe stopped by the time-limit warning gets its job requeued.
#
# What it needs from a recipe: `--out-dir DIR` (the sbatch file passes RUN_DIR), `--preflight WORLD_SIZE`
# (check the options, exit 0 or 2 with one line), and, when stopped by SIGUSR1, a checkpoint plus the file
# RUN_DIR/$STOP_MARKER (recipes/harness/signals.py: StopRequest) and exit 0. Every rank sees
# HPCML_EXPECTED_WORLD_SIZE (the job's task count) and refuses to train in a world of another size.
#
# Ranks are srun tasks (one task per rank), unless the sbatch file sets RECIPE_LAUNCHER: a bash script
# run once per node (srun --ntasks-per-node=1), inside the runtime, with "$0" = PYTHON and "$@" = RECIPE
# ARGS; it starts that node's ranks itself (slurm/accelerate.sh: `accelerate launch`). Write it in single
# quotes: $SLURM_NODEID and friends must be expanded on each node, not in the batch script. It runs under
# slurm/lib/per_node.sh, which passes SIGUSR1 and SIGTERM on to the ranks.
#
# Variables (all optional; set them in the environment of `sbatch`, which passes them to the job):
#   CONTAINER_RUNTIME  shifter | podman-hpc | podman | none
#                      default: shifter where the `shifter` command exists (Perlmutter), else none
#   CONTAINER_IMAGE    image to run (REPO/NAME:TAG). Default: under Shifter the job's image (`sbatch
#                      --image=docker:REPO/NAME:TAG`: Shifter hands the job its ID), else the one
#                      `make pull-IMAGE` recorded in HPCML_IMAGES_FILE (~/.config/hpcml/images)
#   PYTHON             interpreter inside the runtime (default: python3)
#   NCCL_NET           network NCCL must use (default on more than one node "AWS Libfabric": the Slingshot
#                      plugin). NCCL then fails at start-up instead of falling back to TCP sockets. Set
#                      NCCL_NET= (empty) on clusters without the plugin. Unset on one node.
#   NCCL_NET_PLUGIN    the plugin's file (default libnccl-net.so, what the site's nccl module provides; set
#                      explicitly because an image may set another). These, the other NCCL_*, FI_* (HPE's
#                      Slingshot settings), TORCH_NCCL_*, TORCH_FR_* and TRITON_CACHE_DIR are passed into the
#                      container explicitly (Shifter --env, podman -e): under Shifter the image's own
#                      environment would otherwise win. Rank 0 logs what it sees.
#   HPCML_ALLOW_CPU=1  train on the CPU although Slurm gave the job GPUs (each rank refuses otherwise: a CPU
#                      image, or a container without its GPUs, would train at CPU speed and exit 0)
#   CONTAINER_PYTHONPATH  PYTHONPATH inside the container. The host's PYTHONPATH and PYTHONUSERBASE are not
#                      passed in (they would shadow the image's packages); PYTHONNOUSERSITE=1 is.
#   HPCML_CXI_DEVICES  the network devices given to podman-hpc containers (default: the node's Slingshot NICs,
#                      /dev/cxi*, and GDRCopy's /dev/gdrdrv, where they exist; empty: none)
#   HPCML_NCCL_MODULE  the site's network plugin module for this job's image (default: NERSC's build for the
#                      image's CUDA major: Shifter nccl-cu13-plugin or nccl-plugin, podman-hpc --nccl-cu13 or
#                      --nccl). The recipe's preflight opens the plugin in the image, with the job's modules, and
#                      refuses the job in one line when it does not load
#   HPCML_SLINGSHOT=gh200  HPE's rendezvous settings for GH200 nodes (FI_CXI_RDZV_*, srun
#                      --network=disable_rdzv_get); unset on A100 nodes, where the site's values stay
#   HPCML_GPU_ORDER    the GPU each local rank drives, e.g. 3,2,1,0 (default on Perlmutter: each rank next
#                      to its cores); empty: local rank l drives GPU l
#   HPCML_NSYS=1       each rank under Nsight Systems for the steps of the recipe's --profile START:END
#                      (GPU only; nsys in the image): RUN_DIR/nsys/rank<R>.nsys-rep
#   LAUNCH_DRY_RUN=1   print the srun command instead of running it (no checks that need the runtime)
#   LAUNCH_PREFLIGHT=0 skip the recipe's own check (python RECIPE --preflight WORLD_SIZE) before srun
#   LAUNCH_PREFLIGHT_ONLY=1  run every check, then stop before srun (slurm/preflight.sh sets it)
#   LAUNCH_MAX_REQUEUES      how often a job may requeue itself, at the time-limit warning or without a node
#                      that failed (default 10)
#   HPCML_SPARE_NODES  nodes kept aside to replace a node that fails, in the job (default 0; healing.sh)
#   LAUNCH_MAX_NODE_RESTARTS  in-job restarts on spare nodes at most (default 3)
#   HPCML_VET_NODES=1  check every node in the image before the ranks start (default with spare nodes)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING  default 1: a failed NCCL collective aborts the rank instead of hanging
#   TORCH_FR_BUFFER_SIZE  PyTorch's Flight Recorder: collectives each rank remembers (default 2000; 0: off).
#                      A hang leaves RUN_DIR/flight_recorder/rank_<R> (docs: how to read them)
#   REPO_DIR           the checkout holding recipes/ (default: the directory sbatch was called from)
#   RUN_DIR            the run's output directory (checkpoints, metrics): created here, mounted into the
#                      container; the sbatch files default it to runs/<recipe>-<jobid> in the repository
#   CONTAINER_MOUNTS   more host directories the ranks need (data sets), space-separated; each is mounted
#                      at the same path (podman, podman-hpc; Shifter mounts $SCRATCH and $HOME itself).
#                      Under podman and podman-hpc, a recipe's --data, --model hf:DIR, FILE.py and --config
#                      must sit in a mounted directory: the recipe's own preflight, in the runtime on the batch
#                      node, refuses the job otherwise (recipes/harness/mounts.py), and says whether they are
#                      there and whole
#
# The pieces, by concern (each sourced here): runtime.sh (the runtime and the srun step), image.sh (which
# image), network.sh (rendezvous host, NCCL/Slingshot settings), checks.sh (the launcher's checks),
# run_dir.sh (the run directory's lock, the requeue), healing.sh (a node that fails: spare nodes, the requeue
# without it, RUN_DIR/incidents.jsonl). What Python knows better stays in the recipes' harness
# (recipes/harness/launch.py): ranks per node (--tp node), GPUs per rank, the token files and models.

LAUNCH_LIB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/lib/contract.sh
source "$LAUNCH_LIB/contract.sh"
# shellcheck source=slurm/lib/runtime.sh
source "$LAUNCH_LIB/runtime.sh"
# shellcheck source=slurm/lib/image.sh
source "$LAUNCH_LIB/image.sh"
# shellcheck source=slurm/lib/network.sh
source "$LAUNCH_LIB/network.sh"
# shellcheck source=slurm/lib/checks.sh
source "$LAUNCH_LIB/checks.sh"
# shellcheck source=slurm/lib/run_dir.sh
source "$LAUNCH_LIB/run_dir.sh"
# shellcheck source=slurm/lib/healing.sh
source "$LAUNCH_LIB/healing.sh"

launch_error() {
    echo "launch: error: $*" >&2
    exit "$EXIT_BAD_INPUT"
}

# With HPCML_SPARE_NODES, Slurm's variables describe the nodes that train from here on (healing.sh).
reserve_spare_nodes

# The recipe checks its own options for this world size (and the checkpoint it would resume), in the
# runtime, on the batch node: seconds, instead of every rank failing after start-up.
# Its own error (exit 2) is one line already; a recipe that cannot even import its framework (the wrong image,
# a bare Python without it) gets one line here instead of Python's traceback.
recipe_preflight() {
    local runtime=$1 image=$2 recipe=$3 output status=0 module
    local -a check
    build_command check "$runtime" "$image" "$REPO_DIR/$recipe" "${@:4}" --preflight "${SLURM_NTASKS:-1}"
    output=$(without_run_dir_lock "${check[@]}" 2>&1) || status=$?
    case $status in
    0) [[ -z $output ]] || echo "$output" ;;
    "$EXIT_BAD_INPUT") [[ -z $output ]] || echo "$output" >&2 ;;
    *)
        module=$(sed -n "s/^ModuleNotFoundError: No module named '\([^']*\)'.*/\1/p" <<<"$output" | tail -n 1)
        if [[ -n $module && $runtime == none ]]; then
            echo "launch: error: $recipe cannot import $module with PYTHON=${PYTHON:-python3}" \
                "($(command -v "${PYTHON:-python3}" || echo not found)) on $(hostname): load the environment that has" \
                "it, or run in the image (CONTAINER_RUNTIME=shifter, podman-hpc or podman)" >&2
        elif [[ -n $module ]]; then
            echo "launch: error: $recipe cannot import $module in the image ${image#*:}: run it in the" \
                "$(image_family "$recipe") image (make pull-$(image_family "$recipe") ENGINE=$runtime REGISTRY=...," \
                "or CONTAINER_IMAGE=...)" >&2
        else
            echo "$output" >&2
            echo "launch: error: the recipe's own check ($(basename "$recipe") --preflight) failed with exit code $status, above" >&2
        fi
        ;;
    esac
    return "$status"
}

launch_recipe() {
    local recipe=$1
    shift
    # Start-up marks for the ranks' metrics.json ("startup": where a job's first minutes went).
    export HPCML_BATCH_STARTED_AT=$EPOCHREALTIME
    [[ -n ${SLURM_JOB_ID:-} ]] || launch_error "not inside a Slurm job: submit with 'sbatch slurm/<recipe>.sh'" \
        "(or check it first: slurm/preflight.sh slurm/<recipe>.sh)"
    REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
    [[ -f $REPO_DIR/$recipe ]] || launch_error "$REPO_DIR/$recipe not found: submit from the repository root" \
        "(cd path/to/repo && sbatch slurm/...) or set REPO_DIR"

    local runtime image
    runtime=$(choose_runtime) || exit "$EXIT_BAD_INPUT"
    choose_image "$runtime" "$recipe"
    image=$IMAGE
    export_network_settings
    export_plugin_module "$runtime" "$image" "$recipe"
    check_allocation "$runtime" "$recipe"
    [[ -z ${RUN_DIR:-} || $RUN_DIR == /* ]] || RUN_DIR=$PWD/$RUN_DIR
    check_nsys "$runtime"
    [[ $runtime != none || ${LAUNCH_DRY_RUN:-0} == 1 ]] || check_bare_python
    local created_run_dir=0
    if [[ -n ${RUN_DIR:-} ]]; then
        [[ -d $RUN_DIR ]] || created_run_dir=1
        if [[ ${LAUNCH_DRY_RUN:-0} != 1 ]] && ! { mkdir -p "$RUN_DIR" 2>/dev/null && [[ -w $RUN_DIR ]]; }; then
            launch_error "cannot write to the run directory RUN_DIR=$RUN_DIR: choose one you own (e.g. under \$SCRATCH)"
        fi
    fi

    [[ -z ${MASTER_ADDR:-} ]] || MASTER_ADDR_GIVEN=1
    MASTER_ADDR=${MASTER_ADDR:-$(first_node)}
    [[ -n $MASTER_ADDR ]] || launch_error "cannot tell the first node of the job (SLURM_JOB_NODELIST is empty): set MASTER_ADDR"
    MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 10000))}
    export MASTER_ADDR MASTER_PORT
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export PYTHONUNBUFFERED=1
    export HPCML_EXPECTED_WORLD_SIZE=${SLURM_NTASKS:-1}
    if [[ $runtime != none ]]; then
        # The image's packages, not the user's: a `pip install --user` torch or numpy (Shifter passes HOME,
        # PYTHONPATH and PYTHONUSERBASE) would shadow them. CONTAINER_PYTHONPATH passes a path on purpose.
        export PYTHONNOUSERSITE=1
        unset PYTHONPATH PYTHONUSERBASE
    fi
    if [[ -n ${RUN_DIR:-} && ${TORCH_FR_BUFFER_SIZE:-0} != 0 ]]; then
        export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$RUN_DIR/flight_recorder/rank_}
    fi

    local -a command
    build_step command "$runtime" "$image" "$recipe" "$@"

    # What ran, at the top of every job log (a requeued job appends to the same log).
    local job_nodes=${HPCML_JOB_NODES:-}
    job_nodes=${job_nodes#*:}
    echo "launch: job ${SLURM_JOB_ID}${SLURM_RESTART_COUNT:+ (restart $SLURM_RESTART_COUNT)} on ${job_nodes:-${SLURM_JOB_NUM_NODES:-?}} node(s) [${SLURM_JOB_NODELIST:-?}], ${SLURM_NTASKS:-?} task(s)${HPCML_JOB_NODES:+ on $SLURM_JOB_NUM_NODES of them (HPCML_SPARE_NODES=$SPARE_NODES)}"
    echo "launch: runtime=$runtime image=$(describe_image "$image") master=$MASTER_ADDR:$MASTER_PORT commit=$(git -C "$REPO_DIR" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "launch: NCCL_NET=${NCCL_NET:-(any)} NCCL_NET_PLUGIN=$NCCL_NET_PLUGIN (module ${HPCML_NCCL_MODULE_LOADED:-none})" \
        "NCCL_DEBUG=$NCCL_DEBUG HPCML_SLINGSHOT=${HPCML_SLINGSHOT:-(the site values)}" \
        "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME FI_MR_CACHE_MONITOR=$FI_MR_CACHE_MONITOR GPU order=${HPCML_GPU_ORDER:-(local rank l: GPU l)}"
    echo "launch: $(printf '%q ' "${command[@]}")"
    if [[ ${LAUNCH_DRY_RUN:-0} == 1 ]]; then
        return 0
    fi
    [[ -z ${RUN_DIR:-} ]] || claim_run_dir
    if [[ ${LAUNCH_PREFLIGHT:-1} == 1 ]]; then
        local preflight_started=$EPOCHREALTIME
        # The recipe's answer as JSON (recipes/harness/cli.py: preflight_line): the layout, every path the ranks
        # will read, the checkpoint it resumes, every option after --config; kept with the run.
        [[ -z ${RUN_DIR:-} || ${LAUNCH_PREFLIGHT_ONLY:-0} == 1 ]] || export HPCML_PREFLIGHT_RECORD=$RUN_DIR/preflight.json
        if ! recipe_preflight "$runtime" "$image" "$recipe" "$@"; then
            # The recipe's own line above says what to change; leave nothing behind.
            ((created_run_dir)) && rm -f "$RUN_DIR/$RUN_DIR_LOCK_FILE" && rmdir "$RUN_DIR" 2>/dev/null
            exit "$EXIT_BAD_INPUT"
        fi
        HPCML_PREFLIGHT_S=$(awk -v a="$preflight_started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.3f", b - a }')
        export HPCML_PREFLIGHT_S
        echo "launch: the recipe's preflight took $HPCML_PREFLIGHT_S s${HPCML_PREFLIGHT_RECORD:+ (its answer: $HPCML_PREFLIGHT_RECORD)}"
        unset HPCML_PREFLIGHT_RECORD
    fi
    if [[ ${LAUNCH_PREFLIGHT_ONLY:-0} == 1 ]]; then
        ((created_run_dir)) && rmdir "$RUN_DIR" 2>/dev/null
        echo "launch: preflight passed: runtime, image, allocation, directories and recipe options are fine"
        return 0
    fi

    [[ -z ${TORCH_FR_DUMP_TEMP_FILE:-} ]] || mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"
    [[ ${HPCML_NSYS:-0} != 1 ]] || mkdir -p "$RUN_DIR/nsys"
    local status=0
    run_training_step command "$runtime" "$image" || status=$?
    if ((status == 0)) && [[ -n ${RUN_DIR:-} && -f $RUN_DIR/$STOP_MARKER ]]; then
        if [[ $(<"$RUN_DIR/$STOP_MARKER") == SIGUSR1* ]]; then
            rm -f "$RUN_DIR/$STOP_MARKER"
            requeue_job
        fi
    elif ((status != 0)); then
        echo "launch: error: the job step failed with exit code $status; the first 'srun: error: <node>: task <rank>'" \
            "line above names the rank that failed first" >&2
    fi
    return "$status"
}
