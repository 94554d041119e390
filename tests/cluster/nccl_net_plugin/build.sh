#!/usr/bin/env bash
# Builds the stand-in of the site's NCCL network plugin for one CUDA major (the Shifter and podman-hpc
# stand-ins inject it, as NERSC's modules inject aws-ofi-nccl), and the stub CUDA runtime it links:
#
#   tests/cluster/nccl_net_plugin/build.sh MAJOR MODULE_DIR CUDART_DIR
#
# MODULE_DIR/lib/libnccl-net.so     the plugin, linking libcudart.so.MAJOR, which it does not carry (as on the site)
# CUDART_DIR/libcudart.so.MAJOR     the stub CUDA runtime: what an image of that major provides
# Rebuilt only when a source is newer. Needs gcc.
set -euo pipefail
usage="usage: build.sh MAJOR MODULE_DIR CUDART_DIR"
major=${1:?$usage} module=${2:?$usage} cudart_dir=${3:?$usage}
[[ $major =~ ^[0-9]+$ ]] || { echo "build.sh: error: '$major' is not a CUDA major" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
plugin=$module/lib/libnccl-net.so cudart=$cudart_dir/libcudart.so.$major
if [[ -f $plugin && -f $cudart && $plugin -nt $here/plugin.c && $cudart -nt $here/cudart_stub.c ]]; then
    exit 0
fi
mkdir -p "$module/lib" "$cudart_dir"
gcc -Wall -Werror -shared -fPIC -DCUDA_MAJOR="$major" -Wl,-soname,"libcudart.so.$major" \
    -o "$cudart.tmp" "$here/cudart_stub.c"
mv "$cudart.tmp" "$cudart"
# --no-as-needed: the dependency on libcudart.so.MAJOR stays in the plugin (DT_NEEDED), as in the real one.
gcc -Wall -Werror -shared -fPIC -DCUDA_MAJOR="$major" -o "$plugin.tmp" "$here/plugin.c" \
    -Wl,--no-as-needed -L"$cudart_dir" -l:"libcudart.so.$major"
mv "$plugin.tmp" "$plugin"
chmod -R a+rX "$module" "$cudart_dir"
