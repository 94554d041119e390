#!/usr/bin/env bash
# Installs the Debian packages listed in requirements/debian.txt that are missing (make system-deps; make test
# runs it first). Nothing to do: returns at once. Missing and not root, or no apt-get: one line naming the
# command to run, exit 2.
#
#   requirements/system-packages.sh           install what is missing
#   requirements/system-packages.sh --check   only say what is missing (exit 2 when something is)
set -euo pipefail

list=$(dirname "${BASH_SOURCE[0]}")/debian.txt
mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$')
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
((${#missing[@]})) || exit 0

fail() {
    echo "system-deps: error: $*" >&2
    exit 2
}
if [[ ${1:-} == --check ]]; then
    fail "missing packages: ${missing[*]} (install them as root: make system-deps)"
fi
command -v apt-get >/dev/null 2>&1 ||
    fail "missing packages: ${missing[*]}, and no apt-get here: install their equivalents with this system's package manager"
if [[ $(id -u) != 0 ]]; then
    fail "missing packages: ${missing[*]}; run as root: sudo make system-deps (or: sudo apt-get install ${missing[*]})"
fi
echo "system-deps: installing ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
echo "system-deps: installed ${#missing[@]} package(s)" >&2
