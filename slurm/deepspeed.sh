#!/bin/bash
# DeepSpeed ZeRO on Perlmutter GPU nodes (2 nodes x 4 A100 by default), or on any Slurm cluster.
#
#   cd path/to/this/repo
#   sbatch -A <account> -q regular slurm/deepspeed.sh                      # Shifter, ZeRO stage of ds_config.json
#   sbatch -A <account> -q regular slurm/deepspeed.sh --zero-stage 3       # recipe arguments after the file
#   CONTAINER_RUNTIME=podman-hpc sbatch -A <account> -q regular slurm/deepspeed.sh
#   sbatch -N 4 slurm/deepspeed.sh --ds-config my_config.json --global-batch 256
#   sbatch -N 4 slurm/deepspeed.sh --pp auto --grad-accum 8                 # pipeline: one stage per node, DP 4
#
# --pp N (or auto: one stage per node, so the activations cross Slingshot once per micro-batch and the
# replicas of a stage stay in a node) runs DeepSpeed's pipeline engine with ZeRO stage 0 or 1 (1 unless
# --zero-stage 0); --grad-accum is its micro-batches per step.
#
# One srun task per rank, as slurm/ddp.sh: no `deepspeed` launcher, no ssh/pdsh hostfile. The recipe
# takes its rank from SLURM_* (recipes/harness/launch.py), and refuses DeepSpeed batch sizes that do not fit the
# world size before any rank starts. The image, once: `make pull-deepspeed
# REGISTRY=<registry> ENGINE=shifter|podman-hpc` (see slurm/ddp.sh).
# Runtime, image and NCCL variables: slurm/lib/launch.sh. Time limit and preemption: as slurm/ddp.sh
# (checkpoint, requeue, resume with the same ZeRO stage, --pp and layout). Check first:
#   slurm/preflight.sh slurm/deepspeed.sh --zero-stage 3
#SBATCH -J deepspeed
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

# DeepSpeed JIT-compiles missing ops into TORCH_EXTENSIONS_DIR: node-local disk, not a shared home
# directory, whose file locks hang on NFS/Lustre, and one per user (the image sets none: under Shifter
# the image's environment would win over this one). (Triton's cache: slurm/lib/launch.sh, for every recipe.)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions-$(id -u)}

RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/deepspeed-$SLURM_JOB_ID}
launch_recipe recipes/deepspeed/train.py --out-dir "$RUN_DIR" "$@"
