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
