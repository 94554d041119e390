#!/usr/bin/env bash
# NERSC's podman-hpc on the local test cluster, as a normal user runs it on Perlmutter (root; idempotent):
#
#   tests/cluster/podman-hpc/install.sh [PREFIX]     # default PREFIX /opt/hpcml-podman-hpc
#
# - podman-hpc itself (pip, PODMAN_HPC_VERSION below) in a venv made from Debian's python3, so every user
#   can run it (not from a python under root's home);
# - what it needs from the system: rootless podman (uidmap, fuse-overlayfs with /dev/fuse usable by
#   users), squashfuse for the squashed images, inotify-tools for its mount wrapper, and a statically
#   linked mksquashfs >= 4.6 for `migrate` (it runs inside a container and passes -xattrs-exclude, new in
#   4.6; Debian 12 has 4.5.1), built here from Debian trixie's source package;
# - a site config (PREFIX/etc/podman_hpc.yaml, PODMANHPC_CONFIG_FILE) with its own modules.d: `mpi` binds
#   the host's MPICH-ABI libmpi.so.12 into the container, as Perlmutter's binds Cray MPICH; `gpu` exists but
#   binds nothing (no GPUs here); `nccl` and `nccl-cu13` bind a stand-in of the network plugin built for CUDA 12
#   and 13 (tests/cluster/nccl_net_plugin).
# A user's shell then needs: PATH=PREFIX/bin:$PATH PODMANHPC_CONFIG_FILE=PREFIX/etc/podman_hpc.yaml, and
# SCRATCH (the squashed images go to $SCRATCH/storage, as on Perlmutter); `env` prints them, and
# `install.sh user` (as the user) writes their podman configuration.
set -euo pipefail

PODMAN_HPC_VERSION=1.2.2
PREFIX=${2:-${PREFIX:-/opt/hpcml-podman-hpc}}

log() { echo "podman-hpc install: $*" >&2; }

install_packages() {
    local missing=() package
    for package in uidmap fuse-overlayfs squashfuse inotify-tools podman python3-venv libmpich12; do
        dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    # Rootless podman mounts image layers with fuse-overlayfs: users must be able to open /dev/fuse.
    chmod 0666 /dev/fuse
    # --ipc=host (the launcher's, for NCCL's shared memory) makes rootless podman bind /dev/mqueue, which
    # every real node has and a container running these tests may not.
    if ! mountpoint -q /dev/mqueue; then
        mkdir -p /dev/mqueue && mount -t mqueue mqueue /dev/mqueue
    fi
}

build_mksquashfs() {
    local bin=$PREFIX/bin/mksquashfs.static
    if [[ -x $bin ]] && "$bin" -version 2>/dev/null | grep -q 'version 4\.[6-9]'; then return 0; fi
    log "building a static mksquashfs >= 4.6 from Debian trixie's squashfs-tools source"
    local build
    build=$(mktemp -d)
    echo "deb-src http://deb.debian.org/debian trixie main" >/etc/apt/sources.list.d/hpcml-trixie-src.list
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dpkg-dev gcc make zlib1g-dev liblzma-dev liblzo2-dev \
        liblz4-dev libzstd-dev >/dev/null
    (cd "$build" && apt-get source -qq squashfs-tools >/dev/null 2>&1)
    rm -f /etc/apt/sources.list.d/hpcml-trixie-src.list
    apt-get update -qq
    make -s -C "$build"/squashfs-tools-*/squashfs-tools XZ_SUPPORT=1 LZO_SUPPORT=1 LZ4_SUPPORT=1 ZSTD_SUPPORT=1 \
        EXTRA_LDFLAGS=-static mksquashfs -j"$(nproc)" >/dev/null 2>&1
    install -D -m 0755 "$build"/squashfs-tools-*/squashfs-tools/mksquashfs "$bin"
    rm -rf "$build"
    "$bin" -version | head -n 1 >&2
}

install_podman_hpc() {
    if [[ -x $PREFIX/venv/bin/podman-hpc ]] &&
        [[ $("$PREFIX/venv/bin/pip" show podman-hpc 2>/dev/null | sed -n 's/^Version: //p') == "$PODMAN_HPC_VERSION" ]]; then
        return 0
    fi
    log "installing podman-hpc==$PODMAN_HPC_VERSION"
    rm -rf "$PREFIX/venv"
    /usr/bin/python3 -m venv "$PREFIX/venv"
    "$PREFIX/venv/bin/pip" install -q "podman-hpc==$PODMAN_HPC_VERSION"
    # Its OCI hook (bind and copy what the modules name into each container).
    "$PREFIX/venv/bin/python" -m podman_hpc.configure_hooks --hooksd "$PREFIX/hooks.d" -f >/dev/null
}

write_site_config() {
    mkdir -p "$PREFIX/bin" "$PREFIX/etc/modules.d"
    # podman-hpc looks its mount wrapper up on PATH.
    ln -sf "$PREFIX/venv/bin/podman-hpc" "$PREFIX/bin/podman-hpc"
    ln -sf "$PREFIX/venv/bin/fuse-overlayfs-wrap" "$PREFIX/bin/fuse-overlayfs-wrap"
    # Debian's MPICH-ABI library (libmpich.so.12, which the MPICH ABI also calls libmpi.so.12).
    local libmpi
    libmpi=$(readlink -f "$(ldconfig -p | awk '/libmpi(ch)?\.so\.12 / {print $NF; exit}')" || true)
    [[ -f $libmpi ]] || { log "error: no libmpi.so.12 on this machine (Debian: libmpich12)"; exit 1; }
    cat >"$PREFIX/etc/podman_hpc.yaml" <<YAML
# podman-hpc site config of the local test cluster (written by tests/cluster/podman-hpc/install.sh);
# Perlmutter's, with this machine's paths.
podman_bin: "/usr/bin/podman"
mount_program: "$PREFIX/venv/bin/fuse-overlayfs-wrap"
mksquashfs_bin: "$PREFIX/bin/mksquashfs.static"
modules_dir: "$PREFIX/etc/modules.d"
hooks_dir: "$PREFIX/hooks.d"
shared_run_exec_args: ["-e", "SLURM_*", "-e", "PALS_*", "-e", "PMI_*"]
shared_run_command: ["sleep", "infinity"]
localid_var: "SLURM_LOCALID"
tasks_per_node_var: "SLURM_STEP_TASKS_PER_NODE"
ntasks_pattern: "[0-9]+"
graph_root_template: "/tmp/{{ uid }}_hpc/storage"
run_root_template: "/tmp/{{ uid }}_hpc"
config_home_template: "/tmp/{{ uid }}_hpc/config"
YAML
    # The MPICH swap: the host's MPICH-ABI library replaces the image's (Perlmutter: Cray MPICH).
    # With what it links beyond the C library, as Perlmutter's module brings Cray MPICH's dependencies.
    rm -rf "$PREFIX/mpich" && mkdir -p "$PREFIX/mpich/dep"
    cp -f "$libmpi" "$PREFIX/mpich/libmpi.so.12"
    ldd "$libmpi" | awk '/=> \// {print $3}' | grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so' |
        xargs -r cp -L -t "$PREFIX/mpich/dep"
    printf '%s\n' /opt/udiImage/modules/mpich /opt/udiImage/modules/mpich/dep >"$PREFIX/etc/01-mpich.conf"
    cat >"$PREFIX/etc/modules.d/mpich.yaml" <<YAML
name: mpich
cli_arg: mpi
help: "Enable the host MPICH (as the Perlmutter module enables Cray MPICH)"
env: ENABLE_MPICH
additional_args:
  - -e SLURM_*
  - -e PMI_*
  - -e LD_LIBRARY_PATH=/opt/udiImage/modules/mpich:/opt/udiImage/modules/mpich/dep
  - --ipc=host
  - --network=host
copy:
  - ../01-mpich.conf:/etc/ld.so.conf.d/02-mpich.conf
bind:
  - $PREFIX/mpich:/opt/udiImage/modules/mpich
YAML
    cat >"$PREFIX/etc/modules.d/gpu.yaml" <<YAML
name: gpu
cli_arg: gpu
help: "NVIDIA GPU support (present, inert here: no GPUs to bind)"
env: ENABLE_GPU
additional_args:
  - -e NVIDIA_VISIBLE_DEVICES
YAML
    # NERSC's network plugin, one module per CUDA major (--nccl: CUDA 12, --nccl-cu13): each binds its build of
    # the plugin (here the stand-in, tests/cluster/nccl_net_plugin, linking its major's CUDA runtime) and puts
    # it on the loader's path. The stub runtimes it links stay out of the containers. (One argument per list
    # entry, as podman-hpc passes each to podman whole: "--env=NAME=VALUE", not "-e NAME=VALUE".)
    local major flag
    for major in 12 13; do
        flag=nccl
        [[ $major == 12 ]] || flag=nccl-cu$major
        bash "$(dirname "${BASH_SOURCE[0]}")/../nccl_net_plugin/build.sh" "$major" "$PREFIX/modules/$flag" \
            "$PREFIX/cudart/$major"
        cat >"$PREFIX/etc/modules.d/$flag.yaml" <<YAML
name: $flag
cli_arg: $flag
help: "NCCL over Slingshot: the network plugin built for CUDA $major (a stand-in; no libfabric here)"
env: ENABLE_${flag//-/_}
additional_args:
  - --volume=$PREFIX/modules/$flag:/opt/udiImage/modules/$flag:ro
  - --env=LD_LIBRARY_PATH=/opt/udiImage/modules/$flag/lib
  - --env=FI_CXI_DISABLE_HOST_REGISTER=1
  - --env=FI_MR_CACHE_MONITOR=userfaultfd
  - --env=NCCL_CROSS_NIC=1
  - --env=NCCL_NET_GDR_LEVEL=PHB
YAML
    done
}

# A user's own podman-hpc set-up (run as that user): podman-hpc points podman's config home at
# /tmp/<uid>_hpc/config; there podman must find the overlay driver (it picks vfs otherwise, which rejects
# podman-hpc's mount program). Containers use the host's network: no /dev/net/tun for slirp4netns here
# (`migrate` runs a plain podman, which reads ~/.config/containers instead).
user_setup() {
    local dir own=$HOME/.config/containers/storage.conf
    # The user's own rootless podman (the plain podman cells; podman-hpc's migrate runs it too): overlay
    # layers through fuse-overlayfs. Without a storage.conf podman 4.3 picks vfs here, a full copy of the
    # file system per layer: the five cpu images took 42 GB. A vfs store left from before is emptied first.
    if [[ ! -f $own && -d $HOME/.local/share/containers/storage/vfs ]]; then
        podman system reset --force >/dev/null 2>&1 || true
    fi
    for dir in "/tmp/$(id -u)_hpc/config/containers" "$HOME/.config/containers"; do
        mkdir -p "$dir"
        printf '[containers]\nnetns = "host"\n' >"$dir/containers.conf"
    done
    cat >"/tmp/$(id -u)_hpc/config/containers/storage.conf" <<TOML
[storage]
driver = "overlay"
graphroot = "/tmp/$(id -u)_hpc/storage"
runroot = "/tmp/$(id -u)_hpc"
[storage.options]
additionalimagestores = ["${SCRATCH:?set SCRATCH: the squashed images go to \$SCRATCH/storage}/storage"]
[storage.options.overlay]
mount_program = "$PREFIX/bin/fuse-overlayfs-wrap"
ignore_chown_errors = "true"
TOML
    mkdir -p "$SCRATCH/storage"
    printf '[storage]\ndriver = "overlay"\n[storage.options.overlay]\nmount_program = "/usr/bin/fuse-overlayfs"\n' >"$own"
}

case ${1:-install} in
install)
    [[ $(id -u) == 0 ]] || { log "error: run as root"; exit 1; }
    install_packages
    install_podman_hpc
    build_mksquashfs
    write_site_config
    log "ready: $PREFIX/bin/podman-hpc (PODMANHPC_CONFIG_FILE=$PREFIX/etc/podman_hpc.yaml)"
    ;;
user) user_setup ;;
env) echo "export PATH=$PREFIX/bin:\$PATH PODMANHPC_CONFIG_FILE=$PREFIX/etc/podman_hpc.yaml" ;;
*) echo "usage: $0 [install|user|env] [PREFIX]" >&2; exit 2 ;;
esac
