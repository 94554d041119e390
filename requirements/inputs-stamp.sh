#!/usr/bin/env bash
# What a venv was built from, by content: writes STAMP (the sha256 of the interpreter's path and version and of
# each FILE's contents) only when that differs from what STAMP holds, so make rebuilds the venv when an input
# changed, and not when a fresh clone merely made every file newer than a venv that outlives it (make compares
# times: the site venvs of `make site-env` were rebuilt for each new clone).
#
#   requirements/inputs-stamp.sh STAMP PYTHON FILE...
#   requirements/inputs-stamp.sh --print PYTHON FILE...    the hash alone (VENV_CACHE's key)
set -euo pipefail
stamp=$1 python=$2
shift 2
hash=$({ command -v "$python" && "$python" -c 'import sys; print(sys.version)' && cat "$@"; } | sha256sum | cut -d' ' -f1)
if [[ $stamp == --print ]]; then
    echo "$hash"
    exit 0
fi
mkdir -p "$(dirname "$stamp")"
[[ -f $stamp && $(<"$stamp") == "$hash" ]] || echo "$hash" >"$stamp"
