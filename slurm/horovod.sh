#!/bin/bash
# TensorFlow + Horovod on Perlmutter GPU nodes (2 nodes x 4 A100 by default), or on any Slurm cluster.
#
#   cd path/to/this/repo
#   sbatch -A <account> -q regular slurm/horovod.sh                   # Shifter (default on Perlmutter)
#   CONTAINER_RUNTIME=podman-hpc sbatch -A <account> -q regular slurm/horovod.sh
#   sbatch -N 4 slurm/horovod.sh --batch-per-rank 64 --max-steps 500  # override the layout and the recipe args
#   RECIPE=recipes/horovod/train_torch.py sbatch slurm/horovod.sh     # horovod.torch (cpu image flavor only)
#
# One srun task per rank (one GPU each). By default the ranks form Horovod's world without MPI: rank 0
# serves Horovod's rendezvous at the job's first node and the gloo controller coordinates the ranks, while
# the tensors themselves go through NCCL on GPUs (recipes/horovod/horovod_launch.py). To use MPI as the
# controller instead (Cray MPICH replacing the image's MPICH under Shifter), submit with
#   HOROVOD_CONTROLLER=mpi SLURM_MPI_TYPE=pmi2 sbatch slurm/horovod.sh     (any cluster; bare or podman)
#   HOROVOD_CONTROLLER=mpi SLURM_MPI_TYPE=cray_shasta sbatch --module=gpu,nccl-plugin,mpich slurm/horovod.sh
# (Perlmutter). It needs a Horovod linked against the MPICH ABI: the cpu flavor, not the cuda one (NGC's
# TensorFlow image links Open MPI); not under podman-hpc (its mpi module runs shared-run, where the ranks
# never see the time-limit signal). The preflight refuses each of these with one line.
# The image, once: `make pull-horovod REGISTRY=<registry> ENGINE=shifter|podman-hpc` (see slurm/ddp.sh).
# Runtime, image and NCCL variables: slurm/lib/launch.sh.
# Time limit and preemption: as slurm/ddp.sh (checkpoint at SIGUSR1, requeue, resume from the same RUN_DIR).
# Check a submission without spending an allocation:  slurm/preflight.sh slurm/horovod.sh [recipe args]
#SBATCH -J horovod
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
#SBATCH --module=gpu,nccl-plugin

set -euo pipefail
[[ -f ${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh ]] || { echo "launch: error: no slurm/lib/launch.sh in" \
    "${REPO_DIR:-$SLURM_SUBMIT_DIR}: submit from the repository's root (cd path/to/repo && sbatch slurm/...), or set REPO_DIR" >&2; exit 2; }
# shellcheck source=slurm/lib/launch.sh
source "${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh"

recipe=${RECIPE:-recipes/horovod/train.py}
case $recipe in
recipes/horovod/train.py | recipes/horovod/train_torch.py) ;;
*) launch_error "RECIPE=$recipe: use recipes/horovod/train.py (TensorFlow) or recipes/horovod/train_torch.py (PyTorch)" ;;
esac
RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/horovod-$SLURM_JOB_ID}
launch_recipe "$recipe" --out-dir "$RUN_DIR" "$@"
