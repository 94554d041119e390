#!/usr/bin/env bash
# Exit 0 when podman-hpc's squashed image store ($SCRATCH/storage: the only store a Perlmutter compute node
# sees) holds the image REF; 1 when it does not; 2, with podman's error on stderr, when podman-hpc cannot
# list its images at all (not a missing image: "podman-hpc migrate" would not help).
#
#   slurm/lib/squashed_image.sh REF        # e.g. hpcml/ddp:cpu, registry.nersc.gov/proj/hpcml/ddp:cuda
#
# `podman-hpc image exists` cannot answer this: podman-hpc (1.2.x) hands its squashed store to `run` and
# `images` only (--storage-opt additionalimagestore=...), so `image exists` says no for an image that
# every job would find. `images` lists both stores, with R/O "true" for the squashed one. The name is
# completed as podman-hpc's own migrate does (podman_hpc/migrate2scratch.py: ImageStore.get_img_info):
# ":latest" when no tag; localhost/, docker.io/ and docker.io/library/ when no registry.
# Used by slurm/lib/launch.sh (before any rank starts) and containers/images.sh (after pull and build).
set -euo pipefail

ref=${1:?usage: squashed_image.sh REF}
ref=${ref#docker://}
ref=${ref#docker:}
[[ ${ref##*/} == *:* || $ref == *@* ]] || ref=$ref:latest
names=("$ref")
first=${ref%%/*}
if [[ $ref != */* ]] || ! [[ $first == *.* || $first == *:* || $first == localhost ]]; then
    names+=("localhost/$ref" "docker.io/$ref" "docker.io/library/$ref")
fi
# podman-hpc passes --log-level=fatal to podman unless told otherwise: a failure would say nothing.
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
status=0
listed=$(podman-hpc --log-level=error images --format '{{.Repository}}:{{.Tag}} {{.ReadOnly}}' 2>"$errors") || status=$?
if ((status != 0)); then
    message=$(tr '\n' ' ' <"$errors" | sed 's/ *$//')
    echo "podman-hpc images failed on $(hostname) (exit $status${message:+: $message}${message:-, no message})" >&2
    exit 2
fi
for name in "${names[@]}"; do
    grep -qxF "$name true" <<<"$listed" && exit 0
done
exit 1
