#!/bin/bash
# PyTorch DDP on Perlmutter GPU nodes (2 nodes x 4 A100 by default), or on any Slurm cluster.
#
#   cd path/to/this/repo
#   sbatch -A <account> -q regular slurm/ddp.sh                  # Shifter (default on Perlmutter)
#   CONTAINER_RUNTIME=podman-hpc sbatch -A <account> -q regular slurm/ddp.sh
#   sbatch -N 4 slurm/ddp.sh --global-batch 256 --max-steps 500  # override the layout and the recipe args
#
# The image, once: `make pull-ddp REGISTRY=<registry> ENGINE=shifter` (or ENGINE=podman-hpc) pulls
# <registry>/hpcml/ddp:cuda and records it in ~/.config/hpcml/images, which every job then uses. Or name it
# per job: `sbatch --image=docker:<registry>/hpcml/ddp:cuda ...` (Shifter) or CONTAINER_IMAGE=<ref>.
# Runtime, image and NCCL variables are documented in slurm/lib/launch.sh.
#
# Time limit and preemption: Slurm sends SIGUSR1 120 s before the limit; the recipe finishes its step,
# checkpoints and stops, and the job requeues itself (same job id, same run directory) and resumes.
# On preemption (SIGTERM) it checkpoints too, and Slurm requeues it (--requeue). The log is appended to.
# Check a submission without spending an allocation:  slurm/preflight.sh slurm/ddp.sh [recipe args]
#SBATCH -J ddp
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
# sbatch runs a copy of this file from Slurm's spool directory, so find the repository from the
# directory the job was submitted from.
[[ -f ${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh ]] || { echo "launch: error: no slurm/lib/launch.sh in" \
    "${REPO_DIR:-$SLURM_SUBMIT_DIR}: submit from the repository's root (cd path/to/repo && sbatch slurm/...), or set REPO_DIR" >&2; exit 2; }
# shellcheck source=slurm/lib/launch.sh
source "${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh"

RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/ddp-$SLURM_JOB_ID}
launch_recipe recipes/ddp/train.py --out-dir "$RUN_DIR" "$@"
