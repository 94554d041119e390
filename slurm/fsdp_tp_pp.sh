#!/bin/bash
# PyTorch-native FSDP2 + tensor parallel + pipeline parallel on Perlmutter GPU nodes (2 nodes x 4 A100 by
# default), or on any Slurm cluster. The PyTorch image is enough (the ddp image: PyTorch and the recipes).
#
#   cd path/to/this/repo
#   sbatch -A <account> -q regular slurm/fsdp_tp_pp.sh                 # TP 4 in each node, FSDP2 across (2)
#   sbatch -N 8 slurm/fsdp_tp_pp.sh --pp 2 --n-layer 24 --n-embd 2048 --n-head 16 --seq-len 2048 \
#          --vocab-size 50304 --global-batch 64                         # TP 4 x PP 2 x FSDP2 4
#   sbatch -N 8 slurm/fsdp_tp_pp.sh --dp-replicate 2                   # TP 4 x HSDP (2 replicas x 4 shards)
#   CONTAINER_RUNTIME=podman-hpc sbatch -A <account> -q regular slurm/fsdp_tp_pp.sh
#
# Default layout: TP = ranks per node (TP all-reduces inside every layer: keep it on NVLink, in a node),
# FSDP2 over what is left (its all-gathers and reduce-scatters overlap with compute across Slingshot);
# --pp N puts N pipeline stages across nodes. --tp/--pp/--dp-shard/--dp-replicate given after the file
# win. The recipe refuses sizes that do not divide the world, the heads, the layers or the batch before any
# rank starts. One srun task per rank, as slurm/ddp.sh. The image, once: `make pull-ddp
# REGISTRY=<registry> ENGINE=shifter|podman-hpc` (see slurm/ddp.sh). Runtime, image and NCCL variables: slurm/lib/launch.sh. Time limit and preemption: as
# slurm/ddp.sh (a DCP checkpoint, requeue, resume, in any layout).
# Check first:  slurm/preflight.sh slurm/fsdp_tp_pp.sh --pp 2
#SBATCH -J fsdp_tp_pp
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

RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/fsdp_tp_pp-$SLURM_JOB_ID}
launch_recipe recipes/fsdp_tp_pp/train.py --tp node --out-dir "$RUN_DIR" "$@"
