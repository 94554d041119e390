#!/bin/bash
# Check a submission in seconds, before it spends an allocation: the checks every sbatch file runs before
# starting ranks (runtime, image, layout against the allocation, NCCL plugin, directories, the recipe's
# own options and the checkpoint it would resume), for the layout of the file's #SBATCH lines.
#
#   slurm/preflight.sh slurm/ddp.sh                              # as '#SBATCH -N/--ntasks-per-node/...' say
#   slurm/preflight.sh -N 4 -n 4 slurm/ddp.sh --global-batch 96  # nodes, tasks per node (and -g GPUs per node)
#   CONTAINER_RUNTIME=podman-hpc slurm/preflight.sh slurm/ddp.sh
#   slurm/preflight.sh -i docker:REPO/NAME:TAG slurm/ddp.sh     # as 'sbatch --image=docker:...' (Shifter)
#   slurm/preflight.sh -m gpu,nccl-cu13-plugin slurm/ddp.sh      # as 'sbatch --module=...' (Shifter)
#
# Run it from the repository root, with the environment you would submit with. Exit 0: the job would
# start its ranks; exit 2: one line says what to change.
set -euo pipefail

usage() {
    sed -n '2,11s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

nodes="" tasks="" gpus="" image="" module=""
while getopts "N:n:g:i:m:h" option; do
    case $option in
    i) image=$OPTARG ;;
    m) module=$OPTARG ;;
    N) nodes=$OPTARG ;;
    n) tasks=$OPTARG ;;
    g) gpus=$OPTARG ;;
    *) usage ;;
    esac
done
shift $((OPTIND - 1))
(($#)) || usage
sbatch_file=$1
shift
[[ -f $sbatch_file ]] || { echo "preflight: error: $sbatch_file not found" >&2; exit 2; }

# The file's own #SBATCH lines give what the command line does not.
directive() {
    sed -n "s/^#SBATCH[[:space:]]\{1,\}$1[= ]\([^[:space:]]*\).*/\1/p" "$sbatch_file" | tail -n 1
}
nodes=${nodes:-$(directive '-N')}
nodes=${nodes:-$(directive '--nodes')}
tasks=${tasks:-$(directive '--ntasks-per-node')}
gpus=${gpus:-$(directive '--gpus-per-node')}
nodes=${nodes:-1} tasks=${tasks:-1}
for value in "$nodes" "$tasks" ${gpus:+"$gpus"}; do
    [[ $value =~ ^[1-9][0-9]*$ ]] || { echo "preflight: error: '$value' is not a positive count (-N, -n, -g)" >&2; exit 2; }
done

# What Slurm would give the batch script (job id 0), then the sbatch file itself. HPCML_LOGIN_NODE_CHECK tells
# the recipe's preflight that it runs here, where there may be no GPU to see (recipes/harness/contract.py).
export HPCML_LOGIN_NODE_CHECK=1
export SLURM_JOB_ID=0 SLURM_SUBMIT_DIR=$PWD SLURM_JOB_NUM_NODES=$nodes SLURM_NNODES=$nodes
export SLURM_NTASKS=$((nodes * tasks)) SLURM_NTASKS_PER_NODE=$tasks SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-$(hostname)}
[[ -z $gpus ]] || export SLURM_GPUS_PER_NODE=$gpus
image=${image:-$(directive '--image')} module=${module:-$(directive '--module')}
[[ -z $module ]] || export SLURM_SPANK_SHIFTER_MODULE=$module
# A Shifter image as the job would get it: Shifter's SPANK plugin resolves the name at submission and hands
# the job the image's ID with type "id" (a bare `shifter` takes an image from the environment only when
# both are set). sbatch would refuse an image the gateway does not have: so does this check.
if [[ -n $image ]] && command -v shifterimg >/dev/null 2>&1; then
    case $image in
    id:*) id=${image#id:} ;;
    *) id=$(shifterimg lookup "docker:${image#docker:}" 2>/dev/null) ||
        { echo "preflight: error: Shifter's image gateway has no ${image/#docker:/}: shifterimg pull docker:${image#docker:} (sbatch would refuse the job)" >&2; exit 2; } ;;
    esac
    export SLURM_SPANK_SHIFTER_IMAGE=$id SLURM_SPANK_SHIFTER_IMAGETYPE=id
elif [[ -n $image ]]; then # no Shifter here: the name as given (the podman runtimes ignore it)
    export SLURM_SPANK_SHIFTER_IMAGE=${image#docker:} SLURM_SPANK_SHIFTER_IMAGETYPE=docker
fi
echo "preflight: $sbatch_file on $nodes node(s) x $tasks task(s)${gpus:+, $gpus GPU(s) per node}"
LAUNCH_PREFLIGHT_ONLY=1 exec bash "$sbatch_file" "$@"
