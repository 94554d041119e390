#!/bin/bash
# NCCL all-reduce bandwidth between 2 Perlmutter GPU nodes, in the ddp image (bench/allreduce.py):
# fails when NCCL fell back to TCP sockets instead of the libfabric plugin, or busbw is far too low.
#
#   sbatch -A <account> -q debug slurm/nccl_check.sh                     # or: make nccl-check
#   sbatch -A <account> -q debug slurm/nccl_check.sh --min-busbw 60
#   sbatch -N 2 --ntasks-per-node=1 slurm/nccl_check.sh --max-bytes 4M  # a CPU cluster (gloo): bandwidth only
#
#SBATCH -J nccl_check
#SBATCH -C gpu
#SBATCH -N 2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH -t 00:10:00
#SBATCH -o %x-%j.out
#SBATCH --module=gpu,nccl-cu13-plugin

set -euo pipefail
[[ -f ${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh ]] || { echo "launch: error: no slurm/lib/launch.sh in" \
    "${REPO_DIR:-$SLURM_SUBMIT_DIR}: submit from the repository's root (cd path/to/repo && sbatch slurm/...), or set REPO_DIR" >&2; exit 2; }
# shellcheck source=slurm/lib/launch.sh
source "${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/lib/launch.sh"

# The check reads NCCL's own INFO lines (NET/OFI or NET/Socket) to tell which transport it chose: the
# launcher's default, WARN, would hide them.
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT,NET}
RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/nccl_check-$SLURM_JOB_ID}
launch_recipe bench/allreduce.py --out-dir "$RUN_DIR" "$@"
