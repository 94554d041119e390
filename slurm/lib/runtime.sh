# shellcheck shell=bash
# The container runtime and the command of the job step: which runtime (choose_runtime), the command that runs
# Python in it (build_command), the srun step around it (build_step).
# Sourced by slurm/lib/launch.sh, with the others; nothing here runs on its own.

SUPPORTED_RUNTIMES="shifter podman-hpc podman none"

choose_runtime() {
    local runtime=${CONTAINER_RUNTIME:-}
    if [[ -z $runtime ]]; then
        if command -v shifter >/dev/null 2>&1; then runtime=shifter; else runtime=none; fi
        echo "launch: CONTAINER_RUNTIME not set: using '$runtime'" >&2
    fi
    case " $SUPPORTED_RUNTIMES " in
    *" $runtime "*) ;;
    *) launch_error "unknown CONTAINER_RUNTIME '$runtime': use one of: $SUPPORTED_RUNTIMES" ;;
    esac
    # A dry run only shows the command, so it may be made where the runtime is not installed.
    if [[ $runtime != none && ${LAUNCH_DRY_RUN:-0} != 1 ]] && ! command -v "$runtime" >/dev/null 2>&1; then
        launch_error "CONTAINER_RUNTIME=$runtime but the '$runtime' command is not on PATH of $(hostname)" \
            "(on Perlmutter: module load $runtime; elsewhere pick another runtime, or none)"
    fi
    echo "$runtime"
}

# The launcher's settings, named explicitly in the container's command: under Shifter the image's own
# environment wins over the job's for every variable the image sets (only --env overrides it), so an image
# that sets NCCL_* or FI_* would silently beat these. podman takes them with -e.
container_settings() {
    local name
    for name in $(compgen -e | LC_ALL=C sort); do
        # (Shifter refuses --env=NAME= with an empty value: "Improperly formatted environment variable")
        [[ -n ${!name} ]] || continue
        case $name in
        NCCL_* | FI_* | TORCH_NCCL_* | TORCH_FR_* | TRITON_CACHE_DIR | PYTHONNOUSERSITE) echo "$name" ;;
        esac
    done
}

# True when directory $1 is one of the others or inside one of them.
is_inside() {
    local dir=$1 other
    shift
    for other in "$@"; do
        [[ $dir == "$other" || $dir == "$other"/* ]] && return 0
    done
    return 1
}

# Fills the array named by $1 with the command that runs "$@" in the runtime (srun goes in front of it).
build_command() {
    local -n cmd=$1
    local runtime=$2 image=$3
    shift 3
    cmd=()
    case $runtime in
    none) ;;
    shifter)
        # The job's own image (an ID) is the one a bare `shifter` takes from the environment; any other is
        # named. The modules come from '#SBATCH --module'.
        if [[ $image == id:* && ${image#id:} == "${SLURM_SPANK_SHIFTER_IMAGE:-}" ]]; then
            cmd+=(shifter)
        else
            cmd+=(shifter "--image=$image")
        fi
        [[ -n ${SLURM_SPANK_SHIFTER_MODULE:-} ]] && cmd+=("--module=$SLURM_SPANK_SHIFTER_MODULE")
        local name
        for name in $(container_settings); do cmd+=("--env=$name=${!name}"); done
        [[ -z ${CONTAINER_PYTHONPATH:-} ]] || cmd+=("--env=PYTHONPATH=$CONTAINER_PYTHONPATH")
        ;;
    podman | podman-hpc)
        # (podman-hpc runs podman with --log-level=fatal unless told: a container that cannot start would
        # end the rank with exit code 1 and not a word in the job log)
        [[ $runtime == podman-hpc ]] && cmd+=(podman-hpc --log-level=error) || cmd+=(podman)
        cmd+=(run --rm --network=host --ipc=host)
        if [[ $runtime == podman-hpc ]]; then
            # podman-hpc adds the GPUs and the Slingshot/NCCL libraries (its gpu and nccl modules). It runs
            # rootless: uid 0 in the container is the submitting user outside, any other uid (the image's
            # USER 10001) a subordinate id that can neither write the user's RUN_DIR nor read an image from
            # the squashed store (squashfuse mounts belong to the user: runc fails with "stat ...: operation
            # not supported"). `--userns keep-id` fails there too ("creating /etc/mtab symlink").
            # The network plugin's flag follows the image's CUDA major (network.sh: export_plugin_module).
            cmd+=(--gpu "--${HPCML_NCCL_MODULE_LOADED:-nccl}" --user 0:0)
            # The Slingshot NICs: NERSC's nccl module binds libfabric and libcxi but not the devices the
            # CXI provider opens (its mpich module does); without them NCCL cannot use the network. Nor does its
            # gpu module pass GPUDirect RDMA's /dev/gdrdrv: with NERSC's NCCL_NET_GDR_LEVEL=PHB, a Perlmutter run
            # timed out on its first GPU-direct transfer until it was passed.
            local device
            for device in ${HPCML_CXI_DEVICES-$(network_devices)}; do cmd+=("--device=$device"); done
        elif (($(id -u) == 0)); then
            cmd+=(--user 0:0) # podman as root: the ranks as root, not the image's USER, writing root's RUN_DIR
        else
            # Rootless podman: keep-id maps the submitting user to the same uid inside, and --user runs the
            # ranks as that uid (not the image's USER), so what they write is theirs, as under Shifter. (--user
            # alone would be a subordinate uid outside; keep-id alone, the image's user.)
            cmd+=(--userns=keep-id --user "$(id -u):$(id -g)")
        fi
        # Same paths inside as outside, so logs, checkpoints and metrics land where the user looks: the
        # repository, the working directory, the run directory and CONTAINER_MOUNTS. Anything a rank
        # writes elsewhere would vanish with its container.
        local -a mounted=()
        local dir
        # shellcheck disable=SC2086 # CONTAINER_MOUNTS is a space-separated list
        for dir in "$REPO_DIR" "$PWD" ${RUN_DIR:+"$RUN_DIR"} ${CONTAINER_MOUNTS:-}; do
            if ! is_inside "$dir" "${mounted[@]}"; then
                mounted+=("$dir")
                cmd+=(-v "$dir:$dir")
            fi
        done
        cmd+=(-w "$PWD")
        # The recipe's preflight checks every path its ranks will read (--data, --model, --config: after the
        # TOML file is read) against this list, recipes/harness/mounts.py; the launcher parses no option.
        cmd+=(-e "HPCML_CONTAINER_MOUNTS=$(IFS=: && echo "${mounted[*]}")")
        # The job's containers carry its id: `podman ps --filter label=io.hpcml.job=ID` on a node, and
        # `podman events` afterwards, find them (the tests count them there).
        cmd+=(--label "io.hpcml.job=${SLURM_JOB_ID:-none}")
        # Prefixes: podman reads the matching variables from each task's own environment when its
        # container starts, so every rank gets its own SLURM_PROCID and the step's SLURM_STEP_* (which the
        # batch script, where this command is built, does not have).
        cmd+=(-e 'SLURM_*' -e 'MASTER_*' -e 'NCCL_*' -e 'TORCH_NCCL_*' -e 'TORCH_FR_*' -e 'FI_*' -e 'HPCML_*' -e 'HOROVOD_*' -e 'TF_*'
            -e OMP_NUM_THREADS -e PYTHONUNBUFFERED -e PYTHONNOUSERSITE -e TRITON_CACHE_DIR)
        [[ -z ${CONTAINER_PYTHONPATH:-} ]] || cmd+=(-e "PYTHONPATH=$CONTAINER_PYTHONPATH")
        cmd+=("${image#docker:}")
        ;;
    esac
    local -a nsys=()
    # HPCML_NSYS=1: each rank under Nsight Systems, capturing the steps of the recipe's --profile START:END (the
    # recipe opens and closes the CUDA profiler's range there): RUN_DIR/nsys/rank<R>.nsys-rep (a per-node
    # launcher: one report per node, its ranks inside). nsys comes from the image (or the node: runtime none).
    [[ ${HPCML_NSYS:-0} != 1 ]] || nsys=(nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop
        "--trace=cuda,nvtx,osrt" --force-overwrite=true "--output=$RUN_DIR/nsys/rank%q{SLURM_PROCID}")
    cmd+=("${nsys[@]}" "${PYTHON:-python3}" "$@")
}

# The network devices of this node for podman-hpc: the Slingshot NICs (Perlmutter: /dev/cxi0 ... /dev/cxi3) and
# GDRCopy's /dev/gdrdrv, where they exist. $1: the device directory (default /dev).
network_devices() {
    local dir=${1:-/dev} device
    for device in "$dir"/cxi* "$dir/gdrdrv"; do [[ -c $device ]] && echo "$device"; done
    return 0
}

# The srun options and the command of the job step: one task per rank, or one per node (RECIPE_LAUNCHER).
build_step() {
    local -n step=$1
    local runtime=$2 image=$3 recipe=$4
    shift 4
    local -a container
    if [[ -z ${RECIPE_LAUNCHER:-} ]]; then
        build_command container "$runtime" "$image" "$REPO_DIR/$recipe" "$@"
        # --label: every line of a rank reaches the log whole (srun forwards whole lines unless -u) and starts
        # with the rank's task id (" 9: [ddp] ..."): at hundreds of ranks, the only way to read who said what.
        step=(srun --label --kill-on-bad-exit=1)
        [[ ${HPCML_SLINGSHOT:-} != gh200 ]] || step+=(--network=disable_rdzv_get) # (network.sh: HPE's GH200 set)
        # Since Slurm 22.05 srun does not inherit the job's --cpus-per-task: without it every rank of a node
        # would share one core. Each rank gets its own cores, bound.
        [[ ${SLURM_CPUS_PER_TASK:-} =~ ^[0-9]+$ ]] && step+=(--cpus-per-task="$SLURM_CPUS_PER_TASK" --cpu-bind=cores)
        step+=("${container[@]}")
        return
    fi
    local nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}} tasks=${SLURM_NTASKS:-1}
    ((tasks % nodes == 0)) || launch_error "$tasks tasks on $nodes nodes: one launcher per node starts the same"         "number of ranks on every node; use --ntasks-per-node (e.g. -N $nodes --ntasks-per-node=$(((tasks + nodes - 1) / nodes)))"
    # build_command puts PYTHON first; here it becomes $0 of the per-node script, the recipe and its args "$@".
    build_command container "$runtime" "$image" "$REPO_DIR/$recipe" "$@"
    local python_at=$((${#container[@]} - $# - 2))
    container=("${container[@]:0:python_at}" bash "$REPO_DIR/slurm/lib/per_node.sh" "$RECIPE_LAUNCHER"
        "${container[@]:python_at}")
    step=(srun --label --kill-on-bad-exit=1 -N "$nodes" --ntasks="$nodes" --ntasks-per-node=1)
    [[ ${HPCML_SLINGSHOT:-} != gh200 ]] || step+=(--network=disable_rdzv_get)
    # The node's launcher task needs the CPUs of all the ranks it starts.
    [[ ${SLURM_CPUS_PER_TASK:-} =~ ^[0-9]+$ ]] &&
        step+=(--cpus-per-task=$((SLURM_CPUS_PER_TASK * tasks / nodes)) --cpu-bind=cores)
    step+=("${container[@]}")
}
