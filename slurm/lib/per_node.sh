#!/bin/bash
# One node's share of a job whose framework starts the node's ranks itself (RECIPE_LAUNCHER in an sbatch
# file; slurm/lib/launch.sh runs this once per node, inside the container):
#
#   bash slurm/lib/per_node.sh 'SCRIPT' PYTHON RECIPE [ARGS...]
#
# runs SCRIPT as `bash -c` would ("$0" = PYTHON, "$@" = RECIPE ARGS), and makes Slurm's SIGUSR1 (the
# time-limit warning) and SIGTERM reach the ranks and only them. A launcher such as torchrun's agent (under
# `accelerate launch`) dies of SIGUSR1 (no handler) and answers SIGTERM by killing its ranks before they
# can checkpoint. So the launcher starts with both signals ignored (inherited across exec; the ranks set
# their own handlers: recipes/harness/signals.py, StopRequest), and this script passes each signal it gets on to
# the launcher's children, the ranks: under podman only this process (the container's first) is
# signalled, while bare or under Shifter Slurm signals every process of the step itself. The ranks
# checkpoint and stop as under srun, the launcher exits with them, and this script with its exit code.
set -uo pipefail
script=$1
shift

forward_to_ranks() {
    local stat pid rest ppid
    for stat in /proc/[0-9]*/stat; do
        read -r pid rest <"$stat" 2>/dev/null || continue
        rest=${rest##*) } # after "(command name)", which may hold spaces: "STATE PPID ..."
        ppid=${rest#* }
        ppid=${ppid%% *}
        if [[ $ppid == "$launcher" ]]; then
            echo "per_node: $(hostname): $1 to rank process $pid" >&2
            kill -s "$1" "$pid" 2>/dev/null
        fi
    done
}

# HPCML_GPU_ORDER (slurm/lib/launch.sh) as the ranks' CUDA_VISIBLE_DEVICES, so that a launcher's local
# rank l (which drives visible GPU l) gets GPU ORDER[l]; the ranks then see the order applied already.
if [[ -n ${HPCML_GPU_ORDER:-} && -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
    IFS=, read -r -a order <<<"$HPCML_GPU_ORDER"
    if ((${#visible[@]} == ${#order[@]})); then
        reordered=()
        for index in "${order[@]}"; do reordered+=("${visible[index]}"); done
        CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${reordered[*]}")
        echo "per_node: $(hostname): CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES (HPCML_GPU_ORDER=$HPCML_GPU_ORDER)" >&2
        export CUDA_VISIBLE_DEVICES
        unset HPCML_GPU_ORDER
    fi
fi

(
    trap '' USR1 TERM
    exec bash -c "$script" "$@"
) &
launcher=$!
trap 'forward_to_ranks USR1' USR1
trap 'forward_to_ranks TERM' TERM
# `wait` returns early when a trapped signal arrives: keep waiting while the launcher runs.
while kill -0 "$launcher" 2>/dev/null; do
    wait "$launcher"
done
wait "$launcher"
