#!/bin/bash
# Submit a batch file of this repository on any Slurm cluster: sbatch, as is where Shifter is installed, and
# elsewhere without the file's Shifter-only lines (#SBATCH --image, --module: options of Shifter's SPANK
# plugin, which sbatch refuses on a cluster that lacks it: "sbatch: unrecognized option '--module=...'").
#
#   slurm/submit.sh -A <account> slurm/ddp.sh --max-steps 100        # sbatch options, the file, recipe options
#   CONTAINER_RUNTIME=none PYTHON=/path/to/venv/bin/python slurm/submit.sh -C a100 -N 2 slurm/ddp.sh
#
# Options before the file go to sbatch (-C there replaces the file's `-C gpu`, Perlmutter's feature name);
# what follows the file goes to the recipe, as with sbatch.
set -euo pipefail

usage() {
    sed -n '2,10s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

options=()
while (($#)) && ! [[ $1 == *.sh && -f $1 ]]; do
    options+=("$1")
    shift
done
(($#)) || usage
file=$1
shift
command -v sbatch >/dev/null 2>&1 || { echo "submit: error: no sbatch here: run this on the cluster's login node" >&2; exit 2; }
# A cluster with Shifter registers its options with sbatch (they are in its --help).
if sbatch --help 2>&1 | grep -q -- '--module='; then
    exec sbatch "${options[@]}" "$file" "$@"
fi
echo "submit: this cluster's sbatch has no Shifter options: $file goes without its #SBATCH --image/--module lines" >&2
exec sbatch "${options[@]}" <(sed -E '/^#SBATCH[[:space:]]+--(image|module)([= ]|$)/d' "$file") "$@"
