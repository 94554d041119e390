#!/bin/bash
# HuggingFace accelerate on Perlmutter GPU nodes (2 nodes x 4 A100 by default), or on any Slurm cluster.
#
#   cd path/to/this/repo
#   sbatch -A <account> -q regular slurm/accelerate.sh                  # Shifter (default on Perlmutter)
#   CONTAINER_RUNTIME=podman-hpc sbatch -A <account> -q regular slurm/accelerate.sh
#   ACCELERATE_CONFIG=recipes/accelerate/fsdp.yaml sbatch slurm/accelerate.sh   # FSDP2 (GPU only)
#   sbatch -N 4 slurm/accelerate.sh --global-batch 256 --grad-accum 2   # layout and recipe args
#
# --ntasks-per-node is the number of ranks (GPUs) per node, as in slurm/ddp.sh, but srun starts one
# `accelerate launch` per node, which starts that node's ranks (torchrun's c10d rendezvous at the first
# node). The accelerate config file (ACCELERATE_CONFIG, default recipes/accelerate/multi_gpu.yaml) gives
# the kind of parallelism; the layout comes from the allocation. The image, once:
# `make pull-accelerate REGISTRY=<registry> ENGINE=shifter|podman-hpc` (see slurm/ddp.sh). Runtime, image and NCCL variables: slurm/lib/launch.sh. Time limit and
# preemption: as slurm/ddp.sh (checkpoint, requeue, resume). Check first: slurm/preflight.sh slurm/accelerate.sh
#SBATCH -J accelerate
#SBATCH -C gpu
#SBATCH -N 2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH -t 00:30:00
#SBATCH -o %x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --module=gpu,nccl-cu13-plugin

set -euo pipefail
[[ -f ${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh ]] || { echo "launch: error: no slurm/lib/launch.sh in" \
    "${REPO_DIR:-$SLURM_SUBMIT_DIR}: submit from the repository's root (cd path/to/repo && sbatch slurm/...), or set REPO_DIR" >&2; exit 2; }
# shellcheck source=slurm/lib/launch.sh
source "${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh"

REPO_DIR=${REPO_DIR:-$SLURM_SUBMIT_DIR}
config=${ACCELERATE_CONFIG:-$REPO_DIR/recipes/accelerate/multi_gpu.yaml}
[[ $config == /* ]] || config=$PWD/$config
[[ -f $config ]] || launch_error "ACCELERATE_CONFIG=$config: no such file (see recipes/accelerate/*.yaml)"
export HPCML_ACCELERATE_CONFIG=$config

# Run once per node, inside the container (under slurm/lib/per_node.sh, which passes Slurm's SIGUSR1 and
# SIGTERM on to the ranks); single quotes: each node expands its own $SLURM_NODEID. $0 is the image's
# python, "$@" the recipe and its arguments.
# shellcheck disable=SC2016
{
    RECIPE_LAUNCHER='exec "$0" -m accelerate.commands.launch --config_file "$HPCML_ACCELERATE_CONFIG"'
    RECIPE_LAUNCHER+=' --num_machines "$SLURM_JOB_NUM_NODES" --machine_rank "$SLURM_NODEID"'
    RECIPE_LAUNCHER+=' --num_processes "$HPCML_EXPECTED_WORLD_SIZE"'
    RECIPE_LAUNCHER+=' --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" --rdzv_backend c10d "$@"'
}

RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/accelerate-$SLURM_JOB_ID}
launch_recipe recipes/accelerate/train.py --launch-config "$config" --out-dir "$RUN_DIR" "$@"
