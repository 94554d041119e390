#!/bin/bash
# Megatron-core GPT with tensor x pipeline (x data) parallelism on Perlmutter GPU nodes (2 nodes x 4 A100
# by default), or on any Slurm cluster.
#
#   cd path/to/this/repo
#   sbatch -A <account> -q regular slurm/megatron_tp_pp.sh          # TP 4 in each node, PP 2 across the nodes
#   sbatch -A <account> -q regular slurm/megatron_tp_pp.sh --num-layers 24 --hidden-size 2048 --num-heads 16 \
#          --seq-len 2048 --vocab-size 50304 --global-batch 64 --micro-batch 1
#   sbatch -N 4 slurm/megatron_tp_pp.sh --tp 4 --pp 2               # 16 ranks: TP 4 x PP 2 x DP 2
#   CONTAINER_RUNTIME=podman-hpc sbatch -A <account> -q regular slurm/megatron_tp_pp.sh
#
# Default layout: TP = ranks per node (TP all-reduces every layer: keep it on NVLink, inside a node),
# PP = number of nodes (one activation send per micro-batch crosses Slingshot), DP = what is left (1).
# --tp/--pp given after the file win. The recipe refuses layouts that do not divide the world, the heads,
# the layers or the batch before any rank starts. One srun task per rank, as slurm/ddp.sh.
# The image, once: `make pull-megatron REGISTRY=<registry> ENGINE=shifter|podman-hpc` (see slurm/ddp.sh).
# Runtime, image and NCCL variables: slurm/lib/launch.sh. Time limit and preemption: as slurm/ddp.sh
# (a distributed checkpoint, requeue, resume, in any layout).
# Check first:  slurm/preflight.sh slurm/megatron_tp_pp.sh --num-layers 24
#SBATCH -J megatron_tp_pp
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

RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/megatron_tp_pp-$SLURM_JOB_ID}
launch_recipe recipes/megatron_tp_pp/train.py --tp node --pp "${SLURM_JOB_NUM_NODES:-1}" \
    --out-dir "$RUN_DIR" "$@"
