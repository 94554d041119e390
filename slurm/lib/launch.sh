# shellcheck shell=bash
# Shared launch logic for every sbatch file in slurm/: sourced, then `launch_recipe RECIPE [ARGS...]`.
#
# Chooses the container runtime, finds the image, sets the rendezvous host and the Slingshot/NCCL
# settings, logs what is about to run, and starts one task per rank with `srun -u --kill-on-bad-exit`.
# Everything that can be wrong with the input is checked here (preflight), before srun starts a single
# rank; after the step, a recipe stopped by the time-limit warning gets its job requeued.
#
# What it needs from a recipe: `--out-dir DIR` (the sbatch file passes RUN_DIR), `--preflight WORLD_SIZE`
# (check the options, exit 0 or 2 with one line), and, when stopped by SIGUSR1, a checkpoint plus the file
# RUN_DIR/stopped_by_signal (recipes/harness/signals.py: StopRequest) and exit 0. Every rank sees
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
#   HPCML_CXI_DEVICES  the Slingshot NIC devices given to podman-hpc containers (default: /dev/cxi* of the
#                      node; empty: none)
#   HPCML_GPU_ORDER    the GPU each local rank drives, e.g. 3,2,1,0 (default on Perlmutter: each rank next
#                      to its cores); empty: local rank l drives GPU l
#   LAUNCH_DRY_RUN=1   print the srun command instead of running it (no checks that need the runtime)
#   LAUNCH_PREFLIGHT=0 skip the recipe's own check (python RECIPE --preflight WORLD_SIZE) before srun
#   LAUNCH_PREFLIGHT_ONLY=1  run every check, then stop before srun (slurm/preflight.sh sets it)
#   LAUNCH_MAX_REQUEUES      how often a job may requeue itself at the time-limit warning (default 10)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING  default 1: a failed NCCL collective aborts the rank instead of hanging
#   TORCH_FR_BUFFER_SIZE  PyTorch's Flight Recorder: collectives each rank remembers (default 2000; 0: off).
#                      A hang leaves RUN_DIR/flight_recorder/rank_<R> (docs: how to read them)
#   REPO_DIR           the checkout holding recipes/ (default: the directory sbatch was called from)
#   RUN_DIR            the run's output directory (checkpoints, metrics): created here, mounted into the
#                      container; the sbatch files default it to runs/<recipe>-<jobid> in the repository
#   CONTAINER_MOUNTS   more host directories the ranks need (data sets), space-separated; each is mounted
#                      at the same path (podman, podman-hpc; Shifter mounts $SCRATCH and $HOME itself).
#                      A recipe's --data PREFIX must be readable on the batch node and, under podman and
#                      podman-hpc, inside a mounted directory (the preflight refuses the job otherwise)

SUPPORTED_RUNTIMES="shifter podman-hpc podman none"

launch_error() {
    echo "launch: error: $*" >&2
    exit 2
}

# The first host of the allocation: rank 0's address for every rank, on every node.
# Ranks per node of this job: SLURM_NTASKS_PER_NODE is set with --ntasks-per-node only;
# SLURM_TASKS_PER_NODE ("4(x2)", or "4(x2),3" when uneven: the recipes' preflight then refuses the layout)
# in every job. 1 if neither says. (The default TP size of the model-parallel batch files.)
ranks_per_node() {
    local count=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}
    echo "${count%%[(,]*}"
}

first_node() {
    local list=${SLURM_JOB_NODELIST:-} first rest
    if first=$(scontrol show hostnames "$list" 2>/dev/null | head -n 1) && [[ -n $first ]]; then
        echo "$first"
    elif [[ ${list%%,*} == *"["* ]]; then # no scontrol here: nid[000003-000004,...] -> nid000003
        rest=${list#*[}
        echo "${list%%[*}${rest%%[],-]*}"
    else
        echo "${list%%,*}"
    fi
}

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

# The image family each entry point runs in (containers/<family>): what `make pull-<family>` records.
image_family() {
    case $1 in
    recipes/ddp/* | recipes/fsdp_tp_pp/* | bench/*) echo ddp ;;
    recipes/accelerate/*) echo accelerate ;;
    recipes/deepspeed/*) echo deepspeed ;;
    recipes/megatron_tp_pp/*) echo megatron ;;
    recipes/horovod/* | recipes/tf_mirrored/*) echo horovod ;;
    *) echo "" ;;
    esac
}

# Where `make pull-IMAGE` (containers/images.sh pull) records the image a user pulled, one FAMILY=REF a line.
images_file() {
    echo "${HPCML_IMAGES_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/hpcml/images}"
}

recorded_image() {
    local file
    file=$(images_file)
    [[ -n $1 && -f $file && -r $file ]] && sed -n "s/^$1=//p" "$file" | tail -n 1
    return 0
}

# Sets IMAGE to the image to run, "docker:NAME" or "id:ID" (under Shifter, once the gateway has resolved the
# name), IMAGE_NAME to the name it had, and IMAGE_SOURCE to where it came from.
# In this order: CONTAINER_IMAGE; under Shifter the job's own image (`sbatch --image=docker:NAME`, which
# Shifter resolves to an ID at submission); the image `make pull-IMAGE` recorded. The podman runtimes
# never take Shifter's job image: a Shifter ID means nothing to them.
choose_image() {
    local runtime=$1 recipe=$2 family image
    IMAGE="" IMAGE_SOURCE="" IMAGE_NAME=""
    [[ $runtime == none ]] && return 0
    family=$(image_family "$recipe")
    if [[ -e $(images_file) && ! -f $(images_file) ]]; then
        launch_error "HPCML_IMAGES_FILE=$(images_file) is not a file (it lists FAMILY=IMAGE lines, as make pull-IMAGE" \
            "writes): point it at a file, or unset it (default ~/.config/hpcml/images)"
    fi
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        image=docker:${CONTAINER_IMAGE#docker:} IMAGE_SOURCE=CONTAINER_IMAGE
    elif [[ $runtime == shifter && -n ${SLURM_SPANK_SHIFTER_IMAGE:-} ]]; then
        # Shifter's SPANK plugin hands the job the image's ID with type "id" (a name only if unresolved).
        if [[ ${SLURM_SPANK_SHIFTER_IMAGETYPE:-docker} == id ]]; then
            image=id:$SLURM_SPANK_SHIFTER_IMAGE
        else
            image=docker:${SLURM_SPANK_SHIFTER_IMAGE#docker:}
        fi
        IMAGE_SOURCE="the job's --image"
    elif image=$(recorded_image "$family") && [[ -n $image ]]; then
        image=docker:${image#docker:} IMAGE_SOURCE=$(images_file)
    else
        local per_job="set CONTAINER_IMAGE=REPO/NAME:TAG"
        [[ $runtime == shifter ]] && per_job="submit with --image=docker:REPO/NAME:TAG, or $per_job"
        launch_error "CONTAINER_RUNTIME=$runtime needs the ${family:-recipe} image: pull it once with" \
            "'make pull-${family:-IMAGE} REGISTRY=... ENGINE=$runtime' (it is recorded in $(images_file)), or $per_job"
    fi
    if [[ $runtime == podman && ${LAUNCH_DRY_RUN:-0} != 1 ]] && ! podman image exists "${image#docker:}"; then
        launch_error "image '${image#docker:}' is not in podman's local storage on $(hostname):" \
            "build it (make build-$family) or pull it (make pull-$family ENGINE=podman REGISTRY=...)"
    fi
    # podman-hpc: a compute node sees the squashed store ($SCRATCH/storage) only, never the login node's
    # local one; `make pull-IMAGE ENGINE=podman-hpc` and `podman-hpc migrate` put images there.
    if [[ $runtime == podman-hpc && ${LAUNCH_DRY_RUN:-0} != 1 ]]; then
        local found=0 failure
        failure=$(bash "$REPO_DIR/slurm/lib/squashed_image.sh" "$image" 2>&1) || found=$?
        if ((found == 1)); then
            launch_error "image '${image#docker:}' is not in podman-hpc's squashed store (${SQUASH_DIR:-${SCRATCH:-\$SCRATCH}/storage}), the" \
                "only one compute nodes see: make pull-$family ENGINE=podman-hpc REGISTRY=..., or podman-hpc migrate ${image#docker:}"
        elif ((found != 0)); then
            # Its state, not the image (seen after a killed shared-run left a container behind:
            # "invalid internal status, try resetting the pause process").
            launch_error "${failure//$'\n'/ }: podman-hpc itself fails on this node, and every rank would;" \
                "'podman-hpc ps -a' shows containers left behind, 'podman-hpc system migrate' resets its state"
        fi
    fi
    # Shifter starts only images its gateway has pulled (an ID was resolved at submission already). The
    # name is resolved once, here: every rank then starts the image by its ID (--image=id:...), instead of
    # each of 4 x N ranks asking the gateway for the tag at every start and requeue.
    if [[ $runtime == shifter && $image == docker:* && ${LAUNCH_DRY_RUN:-0} != 1 ]] && command -v shifterimg >/dev/null 2>&1; then
        local id=""
        id=$(shifterimg lookup "$image" 2>/dev/null) || id=""
        [[ -n $id ]] || launch_error "Shifter's image gateway has no image '${image#docker:}': shifterimg pull $image (then resubmit)"
        IMAGE_NAME=$image
        image=id:$id
    fi
    IMAGE=$image
}

# The image for the log: its name, also when Shifter handed the job an ID (`shifterimg images` knows the name).
describe_image() {
    local image=$1 name=""
    [[ -n $image ]] || { echo "(none)"; return; }
    if [[ -n ${IMAGE_NAME:-} ]]; then
        name=${IMAGE_NAME#docker:}
    elif [[ $image == id:* ]] && command -v shifterimg >/dev/null 2>&1; then
        name=$(shifterimg images 2>/dev/null | awk -v id="${image:3:10}" '$4 == id {print $NF; exit}') || true
    fi
    echo "${name:+docker:$name }$image (from $IMAGE_SOURCE)"
}

# Slingshot-11 settings for NCCL over the aws-ofi-nccl (libfabric/CXI) plugin; harmless where unused.
# Those of HPE's "Running NCCL-Based Applications" application note (HewlettPackard/shs-ccl-docs,
# nccl/nccl_tuning_guide.md, SHS 2.1 and later; read 2026-12) that need nothing from the scheduler: the
# completion queue and hybrid matching for large jobs, and the rendezvous settings of its April 2026 change
# that keep LL128-sized messages off the eager path (its workaround for data corruption over CXI). Its
# alt_read rendezvous protocol also needs `srun --network=disable_rdzv_get`, so it is left to the site.
export_network_settings() {
    export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
    export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER:-1}
    export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
    export FI_CXI_RX_MATCH_MODE=${FI_CXI_RX_MATCH_MODE:-hybrid}
    export FI_CXI_RDZV_THRESHOLD=${FI_CXI_RDZV_THRESHOLD:-0}
    export FI_CXI_RDZV_GET_MIN=${FI_CXI_RDZV_GET_MIN:-0}
    export FI_CXI_RDZV_EAGER_SIZE=${FI_CXI_RDZV_EAGER_SIZE:-0}
    export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn}
    export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-1}
    # Naming the network makes NCCL fail loudly when the plugin is missing, instead of silently using
    # TCP sockets at a fraction of the bandwidth. An explicitly empty NCCL_NET turns the check off. Not on
    # one node, where nothing crosses the network (HPE: it forces the network transport there, slower).
    if [[ -z ${NCCL_NET+set} && ${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}} != 1 ]]; then export NCCL_NET="AWS Libfabric"; fi
    [[ -n ${NCCL_NET:-} ]] || unset NCCL_NET
    # The plugin file the site's module provides (Shifter's nccl-plugin, podman-hpc's nccl, Lmod's nccl):
    # libnccl-net.so. Named, because an image may set NCCL_NET_PLUGIN (NVIDIA's recent PyTorch images do),
    # and then NCCL looks only for libnccl-net-<name>.so and never loads the site's plugin.
    export NCCL_NET_PLUGIN=${NCCL_NET_PLUGIN:-libnccl-net.so}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # A failed or timed-out NCCL collective aborts the rank (and srun then the job) instead of hanging.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    # PyTorch's Flight Recorder: each rank keeps its last collectives and, when one times out, writes them
    # to RUN_DIR/flight_recorder/rank_<R> (set in launch_recipe): what hung, and on which ranks.
    export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
    export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
    # torch.compile's kernels on node-local disk, not $HOME (Shifter passes HOME; a shared home is slow
    # and every rank of every node would write there).
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-$(id -u)}
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
            cmd+=(--gpu --nccl --user 0:0)
            # The Slingshot NICs: NERSC's nccl module binds libfabric and libcxi but not the devices the
            # CXI provider opens (its mpich module does); without them NCCL cannot use the network.
            local device
            for device in ${HPCML_CXI_DEVICES-$(cxi_devices)}; do cmd+=("--device=$device"); done
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
    cmd+=("${PYTHON:-python3}" "$@")
}

# The Slingshot NIC devices of this node (Perlmutter: /dev/cxi0 ... /dev/cxi3), for podman-hpc.
cxi_devices() {
    local device
    for device in /dev/cxi*; do [[ -c $device ]] && echo "$device"; done
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
        step=(srun -u --kill-on-bad-exit=1)
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
    step=(srun -u --kill-on-bad-exit=1 -N "$nodes" --ntasks="$nodes" --ntasks-per-node=1)
    # The node's launcher task needs the CPUs of all the ranks it starts.
    [[ ${SLURM_CPUS_PER_TASK:-} =~ ^[0-9]+$ ]] &&
        step+=(--cpus-per-task=$((SLURM_CPUS_PER_TASK * tasks / nodes)) --cpu-bind=cores)
    step+=("${container[@]}")
}

# One line per check, before any rank starts: the allocation, the network plugin, the directories.
check_allocation() {
    local runtime=$1
    if [[ -n ${MASTER_PORT:-} ]] && ! [[ $MASTER_PORT =~ ^[0-9]+$ && $MASTER_PORT -ge 1024 && $MASTER_PORT -le 65535 ]]; then
        launch_error "MASTER_PORT=$MASTER_PORT is not a port number between 1024 and 65535: unset it (one is derived from the job id)"
    fi
    if ! [[ ${LAUNCH_MAX_REQUEUES:-10} =~ ^[0-9]+$ ]]; then
        launch_error "LAUNCH_MAX_REQUEUES=$LAUNCH_MAX_REQUEUES is not a number of requeues (0 or more): unset it (default 10)"
    fi
    # One rank per GPU: more tasks than GPUs on a node would share devices (or fail in NCCL much later).
    local gpus=${SLURM_GPUS_PER_NODE:-} tasks=${SLURM_TASKS_PER_NODE:-}
    tasks=${SLURM_NTASKS_PER_NODE:-${tasks%%[(,]*}} # "4(x2)" or "4,2": the first node's count
    gpus=${gpus##*:}
    if [[ $gpus =~ ^[0-9]+$ && $tasks =~ ^[0-9]+$ ]] && ((gpus > 0 && tasks > gpus)); then
        launch_error "$tasks tasks per node but $gpus GPUs per node: one rank per GPU;" \
            "use --ntasks-per-node=$gpus (or ask for --gpus-per-node=$tasks)"
    fi
    # On Perlmutter GPU k is closest to NUMA domain 3-k (NERSC's own job scripts set
    # CUDA_VISIBLE_DEVICES=3,2,1,0), and --cpu-bind=cores puts local rank l on domain l: local rank l
    # drives GPU 3-l (recipes/harness/launch.py: gpu_for_local_rank). HPCML_GPU_ORDER= (empty) turns it off.
    if [[ -z ${HPCML_GPU_ORDER+set} && ${NERSC_HOST:-} == perlmutter && $gpus == 4 ]]; then
        export HPCML_GPU_ORDER=3,2,1,0
    fi
    # NCCL_NET names the Slingshot plugin: make sure the job can load it, instead of failing in NCCL.
    if [[ -n ${NCCL_NET:-} && ($gpus =~ ^[1-9] || -n ${SLURM_GPUS_ON_NODE:-}) ]]; then
        case $runtime in
        shifter)
            [[ ,${SLURM_SPANK_SHIFTER_MODULE:-}, == *,nccl-plugin,* ]] || launch_error \
                "NCCL_NET='$NCCL_NET' needs Shifter's nccl-plugin module: add '#SBATCH --module=gpu,nccl-plugin'" \
                "(or set NCCL_NET= to let NCCL use TCP)"
            ;;
        none)
            if command -v nvidia-smi >/dev/null 2>&1 && ! find_on_library_path 'libnccl-net*.so*'; then
                launch_error "NCCL_NET='$NCCL_NET' but no libnccl-net*.so on LD_LIBRARY_PATH:" \
                    "module load nccl (Perlmutter's module of the plugin) or set NCCL_NET= to let NCCL use TCP"
            fi
            ;;
        esac
    fi
    # Horovod's MPI controller: MPI must be Cray MPICH, put in place of the image's MPICH by the runtime.
    if [[ ${HOROVOD_CONTROLLER:-} == mpi ]]; then
        case $runtime in
        shifter)
            # Naming modules replaces Shifter's defaults: mpich must then be named too.
            [[ -z ${SLURM_SPANK_SHIFTER_MODULE:-} || ,$SLURM_SPANK_SHIFTER_MODULE, == *,mpich,* ]] || launch_error \
                "HOROVOD_CONTROLLER=mpi needs Shifter's mpich module (Cray MPICH in place of the image's):" \
                "submit with --module=$SLURM_SPANK_SHIFTER_MODULE,mpich, or unset HOROVOD_CONTROLLER (gloo needs no MPI)"
            ;;
        podman-hpc)
            # NERSC's podman-hpc turns `run --mpi` into shared-run, whose ranks never see Slurm's signals.
            launch_error "HOROVOD_CONTROLLER=mpi under podman-hpc: its mpi module runs the ranks in one container per node" \
                "(shared-run), where they never receive the time-limit signal; unset HOROVOD_CONTROLLER (gloo needs" \
                "no MPI), or use Shifter (--module=gpu,nccl-plugin,mpich)"
            ;;
        esac
    fi
    local dir
    for dir in ${CONTAINER_MOUNTS:-}; do
        [[ $dir == /* && -d $dir ]] || launch_error "CONTAINER_MOUNTS: '$dir' is not an existing absolute directory"
    done
}

# --data PREFIX (a token file of recipes/data/prepare.py): readable on the batch node and, under podman and
# podman-hpc, inside a directory mounted into the containers. (Under Shifter, the site's file systems are
# mounted: the recipe's own preflight, in the image, says so when the prefix is not visible there.)
check_data_path() {
    local runtime=$1 prefix="" previous="" arg suffix dir dataset=0
    shift
    for arg in "$@"; do # the last --data wins, as in argparse
        [[ $previous == --data ]] && prefix=$arg
        [[ $arg == --data=* ]] && prefix=${arg#--data=}
        [[ $arg == --dataset || $arg == --dataset=* ]] && dataset=1
        previous=$arg
    done
    [[ -n $prefix && $prefix != synthetic ]] || return 0
    [[ $prefix == /* ]] || prefix=$PWD/$prefix
    if ((dataset)); then # --dataset: --data is whatever the user's factory reads (a file or a directory)
        [[ -r $prefix ]] || launch_error "--data $prefix is not readable on the batch node $(hostname): put it on a" \
            "file system every node mounts (Perlmutter: under \$SCRATCH)"
    fi
    for suffix in .json .idx .bin; do
        ((dataset)) && break
        [[ -r $prefix$suffix ]] || launch_error "--data $prefix: $prefix$suffix is not readable on the batch node" \
            "$(hostname): prepare it first (python recipes/data/prepare.py --out $prefix) on a file system every" \
            "node mounts (Perlmutter: under \$SCRATCH)"
    done
    require_mounted "$runtime" "--data $prefix" "$prefix"
}

# Under podman and podman-hpc, a host path the ranks read must sit in a directory mounted into the containers.
require_mounted() {
    local runtime=$1 what=$2 path=$3 dir
    [[ $runtime == podman || $runtime == podman-hpc ]] || return 0
    # shellcheck disable=SC2086 # CONTAINER_MOUNTS is a space-separated list
    for dir in "$REPO_DIR" "$PWD" ${RUN_DIR:+"$RUN_DIR"} ${CONTAINER_MOUNTS:-}; do
        is_inside "$path" "$dir" && return 0
    done
    launch_error "$what is not in any directory mounted into the $runtime containers (the repository," \
        "the working directory, RUN_DIR${CONTAINER_MOUNTS:+, CONTAINER_MOUNTS}): mount its directory," \
        "CONTAINER_MOUNTS=\"${CONTAINER_MOUNTS:+$CONTAINER_MOUNTS }$(dirname "$path")\""
}

# --model hf:DIR (a Hugging Face model directory) and --model/--dataset FILE.py:FACTORY (the user's code):
# readable on the batch node and, under podman and podman-hpc, mounted, as --data is. (A module on
# PYTHONPATH, mypkg.models:build, is the recipe's own preflight's to find.)
check_model_paths() {
    local runtime=$1 previous="" arg value path
    shift
    for arg in "$@"; do
        value=""
        [[ $previous == --model || $previous == --dataset ]] && value="$previous $arg"
        [[ $arg == --model=* || $arg == --dataset=* ]] && value="${arg%%=*} ${arg#*=}"
        previous=$arg
        [[ -n $value ]] || continue
        path=${value#* }
        if [[ $path == hf:* ]]; then
            path=${path#hf:}
            [[ $path == /* ]] || path=$PWD/$path
            [[ -d $path && -r $path ]] || launch_error "$value: $path is not a directory readable on the batch node" \
                "$(hostname): download or save the model on a login node into a file system every node mounts" \
                "(Perlmutter: under \$SCRATCH)"
        elif [[ ${path%:*} == *.py || ${path%:*} == */* ]]; then
            path=${path%:*}
            [[ $path == /* ]] || path=$PWD/$path
            [[ -f $path && -r $path ]] || launch_error "$value: $path is not a file readable on the batch node" \
                "$(hostname): put your code on a file system every node mounts"
        else
            continue
        fi
        require_mounted "$runtime" "$value" "$path"
    done
}

# The bare runtime runs PYTHON on every node as the job's user: an interpreter that user cannot run (a venv
# whose Python lives under another user's home, mode 700; a path that is not there) is one line here rather
# than "Permission denied" from every rank.
check_bare_python() {
    local python=${PYTHON:-python3} path
    path=$(command -v "$python" 2>/dev/null) || true
    [[ -n $path && -x $path ]] && return 0
    [[ -z $path ]] || python+=" ($(readlink -m "$path"))"
    launch_error "PYTHON=$python is not an interpreter $(id -un) can run on $(hostname): use a Python" \
        "environment every user of the compute nodes can read (make site-env builds one), or run in the image" \
        "(CONTAINER_RUNTIME=shifter, podman-hpc or podman)"
}

find_on_library_path() {
    local dir
    for dir in ${LD_LIBRARY_PATH//:/ }; do
        compgen -G "$dir/$1" >/dev/null && return 0
    done
    return 1
}

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
    2) [[ -z $output ]] || echo "$output" >&2 ;;
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
    [[ -n ${SLURM_JOB_ID:-} ]] || launch_error "not inside a Slurm job: submit with 'sbatch slurm/<recipe>.sh'" \
        "(or check it first: slurm/preflight.sh slurm/<recipe>.sh)"
    REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
    [[ -f $REPO_DIR/$recipe ]] || launch_error "$REPO_DIR/$recipe not found: submit from the repository root" \
        "(cd path/to/repo && sbatch slurm/...) or set REPO_DIR"

    local runtime image
    runtime=$(choose_runtime) || exit 2
    choose_image "$runtime" "$recipe"
    image=$IMAGE
    export_network_settings
    check_allocation "$runtime"
    [[ -z ${RUN_DIR:-} || $RUN_DIR == /* ]] || RUN_DIR=$PWD/$RUN_DIR
    check_data_path "$runtime" "$@"
    check_model_paths "$runtime" "$@"
    [[ $runtime != none || ${LAUNCH_DRY_RUN:-0} == 1 ]] || check_bare_python
    local created_run_dir=0
    if [[ -n ${RUN_DIR:-} ]]; then
        [[ -d $RUN_DIR ]] || created_run_dir=1
        if [[ ${LAUNCH_DRY_RUN:-0} != 1 ]] && ! { mkdir -p "$RUN_DIR" 2>/dev/null && [[ -w $RUN_DIR ]]; }; then
            launch_error "cannot write to the run directory RUN_DIR=$RUN_DIR: choose one you own (e.g. under \$SCRATCH)"
        fi
    fi

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
    echo "launch: job ${SLURM_JOB_ID}${SLURM_RESTART_COUNT:+ (restart $SLURM_RESTART_COUNT)} on ${SLURM_JOB_NUM_NODES:-?} node(s) [${SLURM_JOB_NODELIST:-?}], ${SLURM_NTASKS:-?} task(s)"
    echo "launch: runtime=$runtime image=$(describe_image "$image") master=$MASTER_ADDR:$MASTER_PORT commit=$(git -C "$REPO_DIR" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "launch: NCCL_NET=${NCCL_NET:-(any)} NCCL_NET_PLUGIN=$NCCL_NET_PLUGIN NCCL_DEBUG=$NCCL_DEBUG" \
        "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME FI_MR_CACHE_MONITOR=$FI_MR_CACHE_MONITOR GPU order=${HPCML_GPU_ORDER:-(local rank l: GPU l)}"
    echo "launch: $(printf '%q ' "${command[@]}")"
    if [[ ${LAUNCH_DRY_RUN:-0} == 1 ]]; then
        return 0
    fi
    [[ -z ${RUN_DIR:-} ]] || claim_run_dir
    if [[ ${LAUNCH_PREFLIGHT:-1} == 1 ]]; then
        if ! recipe_preflight "$runtime" "$image" "$recipe" "$@"; then
            # The recipe's own line above says what to change; leave nothing behind.
            ((created_run_dir)) && rm -f "$RUN_DIR/$RUN_DIR_LOCK_FILE" && rmdir "$RUN_DIR" 2>/dev/null
            exit 2
        fi
    fi
    if [[ ${LAUNCH_PREFLIGHT_ONLY:-0} == 1 ]]; then
        ((created_run_dir)) && rmdir "$RUN_DIR" 2>/dev/null
        echo "launch: preflight passed: runtime, image, allocation, directories and recipe options are fine"
        return 0
    fi

    [[ -z ${TORCH_FR_DUMP_TEMP_FILE:-} ]] || mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"
    local status=0
    without_run_dir_lock "${command[@]}" || status=$?
    if ((status == 0)) && [[ -n ${RUN_DIR:-} && -f $RUN_DIR/stopped_by_signal ]]; then
        if [[ $(<"$RUN_DIR/stopped_by_signal") == SIGUSR1* ]]; then
            rm -f "$RUN_DIR/stopped_by_signal"
            requeue_job
        fi
    elif ((status != 0)); then
        echo "launch: error: the job step failed with exit code $status; the first 'srun: error: <node>: task <rank>'" \
            "line above names the rank that failed first" >&2
    fi
    return "$status"
}

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
# RUN_DIR/stopped_by_signal: put the job back in the queue. It restarts with the same job id, so the same
# RUN_DIR, and resumes from that checkpoint. (On SIGTERM, preemption, Slurm requeues it itself.)
requeue_job() {
    local restarts=${SLURM_RESTART_COUNT:-0} limit=${LAUNCH_MAX_REQUEUES:-10}
    if ((restarts >= limit)); then
        echo "launch: error: job $SLURM_JOB_ID was requeued $restarts times (LAUNCH_MAX_REQUEUES=$limit): not again;" \
            "resubmit it, or raise the time limit" >&2
        return
    fi
    echo "launch: checkpoint written before the time limit: requeueing job $SLURM_JOB_ID (restart $((restarts + 1)))"
    scontrol requeue "$SLURM_JOB_ID" || echo "launch: error: scontrol requeue failed: resubmit the job to continue" >&2
}
