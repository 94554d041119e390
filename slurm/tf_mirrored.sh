#!/bin/bash
# TensorFlow MirroredStrategy on one Perlmutter GPU node (4 A100), or on any Slurm node: one process drives
# every GPU of the node. For more than one node use slurm/horovod.sh.
#
#   cd path/to/this/repo
#   sbatch -A <account> -q regular slurm/tf_mirrored.sh               # Shifter (default on Perlmutter)
#   CONTAINER_RUNTIME=podman-hpc sbatch -A <account> -q regular slurm/tf_mirrored.sh
#   sbatch slurm/tf_mirrored.sh --global-batch 256 --max-steps 500    # recipe args
#
# One task on one node (the recipe refuses more); it uses every GPU Slurm gives the node, or, on a node
# without GPUs, splits the CPU into 2 logical devices (--devices N for another count). Same image as
# slurm/horovod.sh. Runtime, image and NCCL variables: slurm/lib/launch.sh. Time limit and preemption:
# checkpoint at SIGUSR1, requeue, resume from the same RUN_DIR (as slurm/ddp.sh).
# Check a submission without spending an allocation:  slurm/preflight.sh slurm/tf_mirrored.sh [recipe args]
#SBATCH -J tf_mirrored
#SBATCH -C gpu
#SBATCH -N 1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=128
#SBATCH -t 00:30:00
#SBATCH -o %x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --module=gpu,nccl-plugin

set -euo pipefail
[[ -f ${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh ]] || { echo "launch: error: no slurm/lib/launch.sh in" \
    "${REPO_DIR:-$SLURM_SUBMIT_DIR}: submit from the repository's root (cd path/to/repo && sbatch slurm/...), or set REPO_DIR" >&2; exit 2; }
# shellcheck source=slurm/lib/launch.sh
source "${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh"

RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/tf_mirrored-$SLURM_JOB_ID}
launch_recipe recipes/tf_mirrored/train.py --out-dir "$RUN_DIR" "$@"
