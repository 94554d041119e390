# shellcheck shell=bash
# The launcher's own checks, one line each, before any rank starts: the allocation, the network plugin, the
# paths the ranks read, the bare Python. (The recipe's options are its own preflight's: launch.sh runs it.)
# Sourced by slurm/lib/launch.sh, with the others; nothing here runs on its own.

# One line per check, before any rank starts: the allocation, the network plugin, the directories.
check_allocation() {
    local runtime=$1 recipe=$2
    if [[ -n ${MASTER_PORT:-} ]] && ! [[ $MASTER_PORT =~ ^[0-9]+$ && $MASTER_PORT -ge 1024 && $MASTER_PORT -le 65535 ]]; then
        launch_error "MASTER_PORT=$MASTER_PORT is not a port number between 1024 and 65535: unset it (one is derived from the job id)"
    fi
    if ! [[ ${LAUNCH_MAX_REQUEUES:-10} =~ ^[0-9]+$ ]]; then
        launch_error "LAUNCH_MAX_REQUEUES=$LAUNCH_MAX_REQUEUES is not a number of requeues (0 or more): unset it (default 10)"
    fi
    # (More ranks per node than GPUs: the recipe's preflight refuses it, recipes/harness/launch.py.)
    local gpus=${SLURM_GPUS_PER_NODE:-}
    gpus=${gpus##*:}
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
            # (Which build the image can load, the recipe's preflight says: it opens the plugin in the image.)
            local module
            module=$(nccl_plugin_module shifter "$(family_cuda_major "$recipe")")
            [[ -n ${HPCML_NCCL_MODULE_LOADED:-} ]] || launch_error \
                "NCCL_NET='$NCCL_NET' needs Shifter's network plugin module: add '#SBATCH --module=gpu,$module'" \
                "(the $(image_family "$recipe") image's CUDA $(family_cuda_major "$recipe") build), or set NCCL_NET= to let NCCL use TCP"
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

# --data PATH under podman and podman-hpc: inside a directory mounted into the containers. Whether the token
# file is there and whole is the recipe's preflight's to say (recipes/harness/data.py), on the batch node, in
# the runtime. With --dataset, --data is whatever the user's factory reads (a file or a directory), which no
# recipe can check before it runs: readable on the batch node, here.
check_data_path() {
    local runtime=$1 path="" previous="" arg dataset=0
    shift
    for arg in "$@"; do # the last --data wins, as in argparse
        [[ $previous == --data ]] && path=$arg
        [[ $arg == --data=* ]] && path=${arg#--data=}
        [[ $arg == --dataset || $arg == --dataset=* ]] && dataset=1
        previous=$arg
    done
    [[ -n $path && $path != synthetic ]] || return 0
    [[ $path == /* ]] || path=$PWD/$path
    if ((dataset)) && [[ ! -r $path ]]; then
        launch_error "--data $path is not readable on the batch node $(hostname): put it on a file system every" \
            "node mounts (Perlmutter: under \$SCRATCH)"
    fi
    require_mounted "$runtime" "--data $path" "$path"
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
# under podman and podman-hpc, inside a mounted directory, as --data is. (Whether they are there is the
# recipe's preflight's to say, recipes/harness/model.py; a module on PYTHONPATH, mypkg.models:build, too.)
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
        elif [[ ${path%:*} == *.py || ${path%:*} == */* ]]; then
            path=${path%:*}
        else
            continue
        fi
        [[ $path == /* ]] || path=$PWD/$path
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

# HPCML_NSYS=1 (runtime.sh) records the steps of the recipe's --profile and writes to RUN_DIR/nsys.
check_nsys() {
    local runtime=$1
    shift
    [[ ${HPCML_NSYS:-0} == 1 ]] || return 0
    [[ " $* " == *" --profile "* || " $* " == *" --profile="* ]] ||
        launch_error "HPCML_NSYS=1 captures the steps of the recipe's --profile START:END: add it (e.g. --profile 10:12)"
    [[ -n ${RUN_DIR:-} ]] || launch_error "HPCML_NSYS=1 writes its reports to RUN_DIR/nsys: set RUN_DIR"
    if [[ $runtime == none && ${LAUNCH_DRY_RUN:-0} != 1 ]] && ! command -v nsys >/dev/null 2>&1; then
        launch_error "HPCML_NSYS=1 but nsys is not on PATH of $(hostname) (on Perlmutter: module load cudatoolkit)"
    fi
}
