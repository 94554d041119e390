# shellcheck shell=bash
# The rendezvous host and the network settings every rank gets (NCCL over Slingshot-11).
# Sourced by slurm/lib/launch.sh, with the others; nothing here runs on its own.

# The first host of the allocation: rank 0's address for every rank, on every node.
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

# Slingshot-11 settings for NCCL over the aws-ofi-nccl (libfabric/CXI) plugin; harmless where unused.
# Those of HPE's "Running NCCL-Based Applications" application note (HewlettPackard/shs-ccl-docs,
# nccl/nccl_tuning_guide.md, SHS 2.1 and later; read 2026-12) that need nothing from the scheduler: the
# completion queue and hybrid matching for large jobs. Its rendezvous settings (FI_CXI_RDZV_THRESHOLD,
# _GET_MIN and _EAGER_SIZE at 0, with FI_CXI_RDZV_PROTO=alt_read and `srun --network=disable_rdzv_get`) came
# in its April 2026 change for a GDRCopy data corruption on GH200 nodes: on Perlmutter's A100 nodes the
# site's own values stay (NERSC's modules set them); HPCML_SLINGSHOT=gh200 chooses HPE's set (docs/perlmutter.md).
export_network_settings() {
    export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
    export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER:-1}
    export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
    export FI_CXI_RX_MATCH_MODE=${FI_CXI_RX_MATCH_MODE:-hybrid}
    case ${HPCML_SLINGSHOT:-} in
    "") ;;
    gh200)
        export FI_CXI_RDZV_THRESHOLD=${FI_CXI_RDZV_THRESHOLD:-0}
        export FI_CXI_RDZV_GET_MIN=${FI_CXI_RDZV_GET_MIN:-0}
        export FI_CXI_RDZV_EAGER_SIZE=${FI_CXI_RDZV_EAGER_SIZE:-0}
        export FI_CXI_RDZV_PROTO=${FI_CXI_RDZV_PROTO:-alt_read}
        ;;
    *) launch_error "HPCML_SLINGSHOT=$HPCML_SLINGSHOT is not a node type with its own Slingshot settings: use gh200" \
        "(HPE's rendezvous settings for GH200 nodes), or unset it (A100 nodes: the site's own values)" ;;
    esac
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

# NERSC builds the network plugin (aws-ofi-nccl) once per CUDA major, and it links that major's CUDA runtime:
# in an image of the other major it does not load, and NCCL stops at start-up on 2+ nodes ("Failed to
# initialize any NET plugin"). The module of each major, as each runtime names it (NERSC's slurm-ray-cluster
# README, May 2026; recipes/harness/image_checks.py has the same table for its messages). HPCML_NCCL_MODULE names
# the module for a site that names its own otherwise.
nccl_plugin_module() {
    local runtime=$1 major=$2
    if [[ -n ${HPCML_NCCL_MODULE:-} ]]; then
        echo "$HPCML_NCCL_MODULE"
        return
    fi
    case $runtime:$major in
    shifter:12) echo nccl-plugin ;;
    shifter:13) echo nccl-cu13-plugin ;;
    podman-hpc:12) echo nccl ;;
    podman-hpc:13) echo nccl-cu13 ;;
    esac
}

# The CUDA major of the project's cuda image a recipe runs in: the PyTorch family is CUDA 13 (torch's wheels),
# the horovod image NGC's TensorFlow (CUDA 12).
family_cuda_major() {
    [[ $(image_family "$1") == horovod ]] && echo 12 || echo 13
}

# The image's CUDA major from its label (io.hpcml.version.cuda, which containers/images.sh stamps from what the
# image holds): podman-hpc can read it; empty where it cannot (a dry run, Shifter, an image without it).
# (`podman-hpc image inspect` does not see the squashed store, `images` does: slurm/lib/squashed_image.sh.)
labelled_cuda_major() {
    local runtime=$1 image=$2 cuda=""
    [[ $runtime == podman-hpc && ${LAUNCH_DRY_RUN:-0} != 1 ]] || return 0
    # shellcheck disable=SC2016 # a Go template for podman
    cuda=$(podman-hpc --log-level=error images --filter "reference=${image#docker:}" \
        --format '{{ index .Labels "io.hpcml.version.cuda" }}' 2>/dev/null | grep -m 1 .) || cuda=""
    [[ $cuda =~ ^([0-9]+)\. ]] && echo "${BASH_REMATCH[1]}"
    return 0
}

# The plugin module this job's containers load, exported for the ranks' preflight (which opens the plugin in
# the image, recipes/harness/image_checks.py: check_network_plugin) as HPCML_NCCL_MODULE_LOADED; HPCML_CONTAINER_RUNTIME
# tells it whose name that is. podman-hpc: the flag the launcher passes, from the image's label (else the
# image family's). Shifter: the plugin module among the job's '#SBATCH --module' list, if any.
export_plugin_module() {
    local runtime=$1 image=$2 recipe=$3 major module
    export HPCML_CONTAINER_RUNTIME=$runtime
    unset HPCML_NCCL_MODULE_LOADED
    case $runtime in
    podman-hpc)
        major=$(labelled_cuda_major "$runtime" "$image")
        HPCML_NCCL_MODULE_LOADED=$(nccl_plugin_module podman-hpc "${major:-$(family_cuda_major "$recipe")}")
        export HPCML_NCCL_MODULE_LOADED
        ;;
    shifter)
        local -a asked
        IFS=, read -r -a asked <<<"${SLURM_SPANK_SHIFTER_MODULE:-}"
        for module in "${asked[@]}"; do
            if [[ $module == "$(nccl_plugin_module shifter 12)" || $module == "$(nccl_plugin_module shifter 13)" ]]; then
                export HPCML_NCCL_MODULE_LOADED=$module
            fi
        done
        ;;
    esac
}
