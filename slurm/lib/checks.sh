# shellcheck shell=bash
# The launcher's own checks, one line each, before any rank starts: the allocation, the network plugin, the
# directories, the bare Python. (The recipe's options, and the paths they name, are its own preflight's:
# launch.sh runs it in the runtime; the launcher parses no option of a recipe.)
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

# HPCML_NSYS=1 (runtime.sh) records the steps of the recipe's --profile and writes to RUN_DIR/nsys. (That the
# recipe has --profile, on its command line or in its --config, is its own preflight's to say.)
check_nsys() {
    local runtime=$1
    [[ ${HPCML_NSYS:-0} == 1 ]] || return 0
    [[ -n ${RUN_DIR:-} ]] || launch_error "HPCML_NSYS=1 writes its reports to RUN_DIR/nsys: set RUN_DIR"
    if [[ $runtime == none && ${LAUNCH_DRY_RUN:-0} != 1 ]] && ! command -v nsys >/dev/null 2>&1; then
        launch_error "HPCML_NSYS=1 but nsys is not on PATH of $(hostname) (on Perlmutter: module load cudatoolkit)"
    fi
}
