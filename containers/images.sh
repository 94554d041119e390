#!/usr/bin/env bash
# Build, label, push and pull the hpcml images. The Makefile's build-*/push-*/pull-*/versions targets call it.
#
#   containers/images.sh build IMAGE...      build IMAGE (and its parents, from cache when unchanged)
#   containers/images.sh push IMAGE...       push to $REGISTRY: :FLAVOR and the immutable :FLAVOR-COMMIT
#   containers/images.sh pull IMAGE...       pull from $REGISTRY with shifterimg, podman-hpc, podman or docker
#   containers/images.sh versions IMAGE      the image's labels, and what it really holds (hpcml-versions)
#   containers/images.sh wheels IMAGE DIR    copy the wheels an image built (/opt/hpcml/wheels) into DIR
#   containers/images.sh rootfs              make the cpu flavor's Debian base locally (mmdebstrap + import)
#   containers/images.sh pin-cuda-bases      print the NGC bases with their digests (needs skopeo + nvcr.io)
#
# IMAGE: base pytorch ddp megatron deepspeed accelerate horovod (base-tf: the cuda flavor's TF base).
# Names: hpcml/IMAGE:TAG locally (podman stores them as localhost/hpcml/IMAGE:TAG). TAG is the flavor: cpu,
# cuda (the cpu flavor's twin with torch's CUDA wheels), or cuda-ngc (CUDA_BASE=ngc). The horovod image has
# one cuda flavor, NGC's TensorFlow + Horovod, tagged cuda.
#
# Variables:
#   FLAVOR       cpu (default of build and push; runs anywhere, what CI tests) | cuda (x86_64; GPU nodes).
#                `pull` with ENGINE=shifter or podman-hpc defaults to cuda: those pull for GPU nodes, where
#                the cpu image would train on the CPU
#   CUDA_BASE    what FLAVOR=cuda is built on: pypi (default: the cpu flavor's Debian base and pins, torch's
#                CUDA wheels from PyPI, pinned in containers/pytorch/cuda-wheels.txt) | ngc (NGC's PyTorch
#                image, tag cuda-ngc: NVIDIA's torch build with Transformer Engine and apex; reaches nvcr.io)
#   ENGINE       podman-hpc | podman | docker | shifter (pull only); default: the first one installed
#   REGISTRY     where push/pull go, e.g. registry.nersc.gov/myproject or 127.0.0.1:5000
#   HPCML_IMAGES_FILE  where `pull` records the pulled image for the sbatch files (~/.config/hpcml/images)
#   TLS_VERIFY   false for a plain-http registry such as a local test one (default true)
#   WHEEL_DIR    a local directory of wheels, bind-mounted into pip steps (podman only, cpu flavor); default:
#                the directory PIP_FIND_LINKS names, if any. Never copied into a layer. Not used by the cuda
#                flavor: a local torch+cpu wheel would win over PyPI's CUDA build of the same version.
#   CA_BUNDLE    a CA bundle for pip behind a TLS-inspecting proxy, given as a build secret (never a
#                layer); default: PIP_CERT, else none
#   NO_CACHE=1   rebuild every layer (a cold build, for benchmarks)
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONTAINERS_DIR=$REPO_DIR/containers
FLAVOR_GIVEN=${FLAVOR:+1}
FLAVOR=${FLAVOR:-cpu}
CUDA_BASE_GIVEN=${CUDA_BASE:+1}
CUDA_BASE=${CUDA_BASE:-pypi}
IMAGE_REPO=${IMAGE_REPO:-hpcml}
LEAVES="ddp megatron deepspeed accelerate horovod"
KNOWN="base base-tf pytorch $LEAVES"

die() {
    echo "images: error: $*" >&2
    exit 2
}

# Temporary files and directories (the CA secret among them) go, however the script ends.
CLEANUP=()
trap 'rm -rf "${CLEANUP[@]}"' EXIT
say() { echo "images: $*" >&2; }

# shellcheck source=containers/versions.env
source "$CONTAINERS_DIR/versions.env"

case $FLAVOR in
cpu | cuda) ;;
*) die "unknown FLAVOR '$FLAVOR': use cpu or cuda" ;;
esac
case $CUDA_BASE in
pypi | ngc) ;;
*) die "unknown CUDA_BASE '$CUDA_BASE': use pypi (torch's CUDA wheels on Debian) or ngc (NGC's PyTorch image)" ;;
esac

# The settings this project's CI machines need (runc, explicit ulimits), unless the user chose their own.
# Not for podman-hpc, which keeps its own podman configuration (its config home, site modules).
use_ci_podman_settings() {
    if [[ -z ${CONTAINERS_CONF:-} && $ENGINE == podman ]] && command -v runc >/dev/null 2>&1; then
        export CONTAINERS_CONF=$CONTAINERS_DIR/podman/containers.conf
    fi
}

choose_engine() {
    if [[ -n ${ENGINE:-} ]]; then
        command -v "$ENGINE" >/dev/null 2>&1 || die "ENGINE=$ENGINE is not installed on $(hostname)"
        echo "$ENGINE"
        return
    fi
    local engine
    for engine in podman-hpc podman docker; do
        if command -v "$engine" >/dev/null 2>&1; then
            echo "$engine"
            return
        fi
    done
    die "no container engine found: install podman (apt-get install podman) or docker, or set ENGINE"
}

# The tag of IMAGE in FLAVOR (default: this build's): cpu, cuda or cuda-ngc. TensorFlow's CUDA family is
# NGC's (docs/images.md says why): its images are :cuda whatever CUDA_BASE says.
tag_of() {
    local flavor=${2:-$FLAVOR}
    if [[ $flavor == cuda && $CUDA_BASE == ngc && $1 != horovod && $1 != base-tf ]]; then
        echo cuda-ngc
    else
        echo "$flavor"
    fi
}

# What to add to `make build-IMAGE` for this flavor.
build_settings() { echo "FLAVOR=$FLAVOR${CUDA_BASE_GIVEN:+ CUDA_BASE=$CUDA_BASE}"; }

local_name() { echo "$IMAGE_REPO/$1:$(tag_of "$1")"; }

# Whether IMAGE is built on an NGC image: CUDA_BASE=ngc, and the TensorFlow family's cuda flavor. (The
# Containerfiles' FLAVOR argument is the tag: cpu, cuda or cuda-ngc.)
uses_ngc() { [[ $FLAVOR == cuda && ($CUDA_BASE == ngc || $1 == horovod || $1 == base-tf) ]]; }

# The image each one is built on, and the Containerfile it is built from.
parent_of() {
    case $1 in
    base | base-tf) echo "" ;;
    pytorch) echo base ;;
    ddp | megatron | deepspeed | accelerate) echo pytorch ;;
    horovod) if [[ $FLAVOR == cuda ]]; then echo base-tf; else echo pytorch; fi ;;
    esac
}

containerfile_of() {
    case $1 in
    base-tf) echo "$CONTAINERS_DIR/base/Containerfile" ;;
    *) echo "$CONTAINERS_DIR/$1/Containerfile" ;;
    esac
}

check_known() {
    local image
    for image in "$@"; do
        case " $KNOWN " in
        *" $image "*) ;;
        *) die "unknown image '$image': use one of: $KNOWN" ;;
        esac
    done
}

# The commit the image's content comes from: the last one that changed what goes into an image (containers/ and
# recipes/: the Containerfiles, their pins and scripts, the recipes copied in); "-dirty" when those differ from it.
# Not HEAD: a commit of tests or docs alone builds the same image, which keeps its ID (and every squashed,
# pulled or pushed copy of it stays valid) instead of being stamped anew.
revision() {
    local commit
    commit=$(git -C "$REPO_DIR" log -1 --format=%h --abbrev=12 -- containers recipes 2>/dev/null) || commit=""
    if [[ -z $commit ]]; then
        echo unknown
        return
    fi
    if [[ -n $(git -C "$REPO_DIR" status --porcelain -- containers recipes 2>/dev/null) ]]; then
        commit+=-dirty
    fi
    echo "$commit"
}

# Every pin of versions.env, under the names the Containerfiles use, for this flavor: one
# "--build-arg NAME=VALUE" pair per argument the image's Containerfile declares (engines warn about others).
build_args() {
    local image=$1 pin parent
    local -a pins=("FLAVOR=$(tag_of "$image")")
    for pin in MPICH_VERSION MPI4PY_VERSION MEGATRON_CORE_VERSION PSUTIL_VERSION DEEPSPEED_VERSION \
        ACCELERATE_VERSION HOROVOD_VERSION TF_KERAS_VERSION TORCH_CPU_INDEX TENSORBOARD_VERSION \
        TRANSFORMERS_VERSION PEFT_VERSION SAFETENSORS_VERSION H5PY_VERSION WANDB_VERSION MLFLOW_SKINNY_VERSION \
        SQLALCHEMY_VERSION ALEMBIC_VERSION; do
        pins+=("$pin=${!pin}")
    done
    if ! uses_ngc "$image"; then
        pins+=("BASE_IMAGE=$CPU_BASE_IMAGE" "PYTHON_VERSION=$PYTHON_VERSION_cpu" "TORCH_VERSION=$TORCH_VERSION_cpu"
            "NUMPY_VERSION=$NUMPY_VERSION_cpu" "TENSORFLOW_VERSION=$TENSORFLOW_VERSION_cpu")
    elif [[ $image == base-tf ]]; then
        pins+=("BASE_IMAGE=$CUDA_TF_BASE")
    else
        pins+=("BASE_IMAGE=$CUDA_TORCH_BASE")
    fi
    parent=$(parent_of "$image")
    [[ -z $parent ]] || pins+=("PARENT=$(qualified "$(local_name "$parent")")")
    local declared
    declared=" $(sed -n 's/^ARG \([A-Z0-9_]*\).*/\1/p' "$(containerfile_of "$image")" | tr '\n' ' ') "
    for pin in "${pins[@]}"; do
        [[ $declared == *" ${pin%%=*} "* ]] && printf '%s\n' --build-arg "$pin"
    done
    return 0
}

# podman keeps unqualified local builds under localhost/; FROM lines need the qualified name.
qualified() {
    if [[ $ENGINE == docker ]]; then echo "$1"; else echo "localhost/$1"; fi
}

ensure_cpu_base() {
    [[ $CPU_BASE_IMAGE == localhost/* ]] || return 0
    local image
    for image in "$@"; do
        if ! uses_ngc "$image" && ! image_exists "$CPU_BASE_IMAGE"; then
            hold_build_lock rootfs
            image_exists "$CPU_BASE_IMAGE" || make_rootfs  # (unless the build we waited for made it)
            release_build_lock
            return
        fi
    done
}

# One build of an image at a time per user (two make targets, or the tests' parallel workers): two builds of
# the same image would each make it and race to tag the name. Builds of different images run at once (the
# set-up builds the leaves while the horovod image compiles); a build waits for its parent's build, then
# finds the parent built.
hold_build_lock() {
    local lock
    lock=${TMPDIR:-/tmp}/hpcml-images-build-$(id -u)-$1-$FLAVOR.lock
    exec {BUILD_LOCK_FD}>>"$lock"
    if ! flock -n "$BUILD_LOCK_FD"; then
        say "waiting for another build of $1 ($FLAVOR) to finish (lock $lock)"
        flock "$BUILD_LOCK_FD"
    fi
}

release_build_lock() { exec {BUILD_LOCK_FD}>&-; }

image_exists() {
    if [[ $ENGINE == docker ]]; then docker image inspect "$1" >/dev/null 2>&1; else "$ENGINE" image exists "$1"; fi
}

# Debian bookworm (minbase, with security updates, no docs/man/locales), imported as CPU_BASE_IMAGE.
make_rootfs() {
    command -v mmdebstrap >/dev/null 2>&1 || die "mmdebstrap is needed to make $CPU_BASE_IMAGE: apt-get install mmdebstrap" \
        "(or set CPU_BASE_IMAGE=docker.io/library/debian:bookworm-slim where docker.io is reachable)"
    local tmp
    tmp=$(mktemp -d)
    CLEANUP+=("$tmp")
    say "making $CPU_BASE_IMAGE with mmdebstrap (about a minute)"
    mmdebstrap --quiet --variant=minbase --include=ca-certificates \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm "$tmp/rootfs.tar" \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main"
    "$ENGINE" import --change 'CMD ["/bin/bash"]' "$tmp/rootfs.tar" "$CPU_BASE_IMAGE" >/dev/null
    rm -rf "$tmp"
}

label_of() {
    # shellcheck disable=SC2016 # a Go template for the engine
    "$ENGINE" image inspect --format "{{ index .Config.Labels \"$2\" }}" "$(qualified "$1")" 2>/dev/null || true
}

engine_build() {
    local -a extra=()
    if [[ $ENGINE == podman || $ENGINE == podman-hpc ]]; then
        # docker format: the OCI format drops SHELL, and the Containerfiles rely on bash with pipefail.
        extra+=(--format docker)
        [[ -n $WHEEL_DIR && $FLAVOR == cpu ]] && extra+=(-v "$WHEEL_DIR:/wheels:ro")
    else
        export DOCKER_BUILDKIT=1
    fi
    [[ ${NO_CACHE:-0} != 1 ]] || extra+=(--no-cache)
    "$ENGINE" build --network=host --secret "id=cacert,src=$CA_SECRET" "${extra[@]}" "$@"
}

build_one() {
    local image=$1 parent
    parent=$(parent_of "$image")
    [[ -z $parent ]] || build_one "$parent"
    case " $BUILT " in *" $image "*) return 0 ;; esac
    hold_build_lock "$image"
    build_image "$image" "$parent"
    release_build_lock
}

build_image() {
    local image=$1 parent=$2 name tmp start=$SECONDS
    name=$(local_name "$image")
    tmp=$(mktemp -d)
    CLEANUP+=("$tmp")
    say "building $name ($(build_settings), engine $ENGINE)"
    local -a args
    mapfile -t args < <(build_args "$image")
    engine_build "${args[@]}" --iidfile "$tmp/iid" -f "$(containerfile_of "$image")" "$REPO_DIR"

    # Labels written from what the built image really holds, plus where it came from. Only the leaf
    # images carry the git commit: a commit label on a parent would rebuild every child on every commit.
    local iid stamped
    iid=$(<"$tmp/iid")
    # Unchanged build, already stamped (same content, same commit): nothing to do. Saves a container start
    # per image, which is most of a rebuild after a recipe edit.
    stamped=$(label_of "$name" io.hpcml.build-id)
    if [[ $stamped == "$iid" ]] && { [[ " $LEAVES " != *" $image "* ]] ||
        [[ $(label_of "$name" org.opencontainers.image.revision) == "$(revision)" ]]; }; then
        rm -rf "$tmp"
        BUILT="$BUILT $image"
        say "built $name in $((SECONDS - start)) s (unchanged)"
        return 0
    fi
    {
        echo "FROM $iid"
        if [[ -n $parent ]] && ! grep -q '^RUN' "$(containerfile_of "$image")"; then
            # Nothing installed on top of the parent (recipes copied in): its versions hold, no container start.
            # shellcheck disable=SC2016 # a Go template for the engine
            "$ENGINE" image inspect --format '{{ range $k, $v := .Config.Labels }}{{ $k }}={{ $v }}{{ "\n" }}{{ end }}' \
                "$(qualified "$(local_name "$parent")")" | sed -n 's/^\(io\.hpcml\.version\.[^=]*\)=\(.*\)$/LABEL \1="\2"/p'
        else
            "$ENGINE" run --rm --entrypoint hpcml-versions "$iid" --labels
        fi
        echo "LABEL io.hpcml.image=\"$image\" io.hpcml.flavor=\"$(tag_of "$image")\" org.opencontainers.image.title=\"hpcml/$image\"" \
            "io.hpcml.build-id=\"$iid\""
        case " $LEAVES " in
        *" $image "*) echo "LABEL org.opencontainers.image.revision=\"$(revision)\"" ;;
        esac
    } >"$tmp/Containerfile"
    engine_build -t "$name" -f "$tmp/Containerfile" "$tmp" >/dev/null
    rm -rf "$tmp"
    # podman-hpc: compute nodes see only squashed images; `podman-hpc pull` squashes, a build does not.
    if [[ $ENGINE == podman-hpc && " $LEAVES " == *" $image "* ]]; then
        squash "$name"
    fi
    BUILT="$BUILT $image"
    say "built $name in $((SECONDS - start)) s"
}

cmd_build() {
    (($#)) || die "name the images to build: $KNOWN"
    check_known "$@"
    WHEEL_DIR=${WHEEL_DIR-${PIP_FIND_LINKS:-}}
    if [[ -n $WHEEL_DIR && ! -d $WHEEL_DIR ]]; then
        say "WHEEL_DIR=$WHEEL_DIR is not a directory: ignoring it"
        WHEEL_DIR=
    fi
    # The secret always exists for the build (an empty file when there is no CA bundle), so the same
    # Containerfile builds with and without one. Its name carries this script's PID: a copy left behind
    # is told from the secret of a build still running (tests/test_images.py).
    CA_SECRET=$(mktemp "${TMPDIR:-/tmp}/hpcml-ca.$$.XXXXXX")
    CLEANUP+=("$CA_SECRET")
    local bundle=${CA_BUNDLE-${PIP_CERT:-}}
    if [[ -n $bundle ]]; then
        [[ -r $bundle ]] || die "CA_BUNDLE=$bundle is not readable"
        cat "$bundle" >"$CA_SECRET"
    fi
    if [[ -n $WHEEL_DIR && $FLAVOR == cuda ]]; then
        say "not using WHEEL_DIR=$WHEEL_DIR for FLAVOR=cuda: its wheels come from PyPI (pinned)"
    fi
    ensure_cpu_base "$@"
    BUILT=""
    local image
    for image in "$@"; do
        build_one "$image"
    done
}

registry_ref() {
    [[ -n ${REGISTRY:-} ]] || die "set REGISTRY, e.g. REGISTRY=registry.nersc.gov/myproject (or 127.0.0.1:5000)"
    echo "$REGISTRY/$IMAGE_REPO/$1:${2:-$(tag_of "$1")}"
}

# Pushes the immutable :TAG-COMMIT (refused if the registry holds a different image under it), then
# moves :TAG to it. Images built from uncommitted changes are refused unless ALLOW_DIRTY=1.
cmd_push() {
    (($#)) || die "name the images to push: $LEAVES"
    check_known "$@"
    registry_ref "$1" >/dev/null
    local image name revision floating immutable
    for image in "$@"; do
        name=$(qualified "$(local_name "$image")")
        image_exists "$name" || die "$name is not built here: make build-$image $(build_settings)"
        revision=$("$ENGINE" image inspect --format '{{ index .Config.Labels "org.opencontainers.image.revision" }}' "$name")
        [[ -n $revision && $revision != "<no value>" ]] || die "$name has no revision label: push the leaf images ($LEAVES)"
        if [[ $revision == *-dirty && ${ALLOW_DIRTY:-0} != 1 ]]; then
            die "$name was built from uncommitted changes ($revision): commit and rebuild, or set ALLOW_DIRTY=1"
        fi
        floating=$(registry_ref "$image")
        immutable=$(registry_ref "$image" "$(tag_of "$image")-$revision")
        check_immutable "$name" "$immutable"
        push_one "$name" "$immutable"
        push_one "$name" "$floating"
        echo "$immutable"
    done
}

# An immutable tag already in the registry must name this very image (same config digest = image id).
check_immutable() {
    command -v skopeo >/dev/null 2>&1 || {
        say "skopeo not installed: cannot check that $2 is new (apt-get install skopeo)"
        return 0
    }
    local remote local_id
    remote=$(skopeo inspect --raw --tls-verify="${TLS_VERIFY:-true}" "docker://$2" 2>/dev/null |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["config"]["digest"])' 2>/dev/null) || return 0
    local_id=$("$ENGINE" image inspect --format '{{ .Id }}' "$1")
    [[ $remote == "sha256:${local_id#sha256:}" ]] ||
        die "$2 already exists in the registry and is a different image: immutable tags are never overwritten" \
            "(rebuild from a new commit)"
}

push_one() {
    say "pushing $1 to $2"
    if [[ $ENGINE == docker ]]; then
        docker tag "$1" "$2" && docker push --quiet "$2"
    else
        "$ENGINE" push --quiet --tls-verify="${TLS_VERIFY:-true}" "$1" "docker://$2"
    fi
}

cmd_pull() {
    (($#)) || die "name the images to pull: $LEAVES"
    check_known "$@"
    registry_ref "$1" >/dev/null
    local image ref flavor=$FLAVOR
    # Shifter and podman-hpc pull for the GPU nodes of an HPC center: the GPU flavor, unless asked otherwise.
    [[ -z $FLAVOR_GIVEN && ($ENGINE == shifter || $ENGINE == podman-hpc) ]] && flavor=cuda
    for image in "$@"; do
        ref=$(registry_ref "$image" "${TAG:-$(tag_of "$image" "$flavor")}")
        say "pulling $ref with $ENGINE"
        case $ENGINE in
        shifter) shifterimg pull "docker:$ref" ;;
        docker) docker pull "$ref" ;;
        # No docker:// here: podman-hpc squashes what it pulled by looking the name up as given, and a
        # name with a transport matches nothing (the pull then succeeds, unsquashed, with exit code 0).
        podman-hpc) podman-hpc pull --tls-verify="${TLS_VERIFY:-true}" "$ref" && squash "$ref" ;;
        *) "$ENGINE" pull --tls-verify="${TLS_VERIFY:-true}" "docker://$ref" ;;
        esac
        record_image "$image" "$ref"
    done
}

# podman-hpc: make sure IMAGE is in the squashed store, the only one compute nodes see. `podman-hpc
# migrate` (and the migrate inside `podman-hpc pull`) exits 0 when it fails, so the store is asked.
squash() {
    local squashed=$REPO_DIR/slurm/lib/squashed_image.sh
    bash "$squashed" "$1" || podman-hpc migrate "$1"
    bash "$squashed" "$1" || die "podman-hpc could not squash $1 into ${SQUASH_DIR:-${SCRATCH:-\$SCRATCH}/storage}" \
        "(podman-hpc migrate $1 printed why; is SCRATCH set and writable?)"
    say "$1 is in podman-hpc's squashed store (what compute nodes see)"
}

# The sbatch files run the image a user pulled last (slurm/lib/launch.sh reads the same file): the name
# is given once, here, and not copied into every job.
record_image() {
    local file=${HPCML_IMAGES_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/hpcml/images}
    mkdir -p "$(dirname "$file")"
    { grep -v "^$1=" "$file" 2>/dev/null || true; echo "$1=$2"; } >"$file.tmp"
    mv "$file.tmp" "$file"
    say "recorded $1=$2 in $file: the sbatch files in slurm/ now run it (CONTAINER_IMAGE overrides it)"
}

cmd_versions() {
    (($# == 1)) || die "usage: containers/images.sh versions IMAGE (e.g. make versions IMAGE=ddp)"
    check_known "$1"
    local name
    name=$(qualified "$(local_name "$1")")
    image_exists "$name" || die "$name is not built here: make build-$1 $(build_settings)"
    echo "# labels of $name"
    # shellcheck disable=SC2016 # a Go template for the engine, not a shell expansion
    "$ENGINE" image inspect --format '{{ range $k, $v := .Config.Labels }}{{ $k }}={{ $v }}{{ "\n" }}{{ end }}' "$name" |
        grep -E '^(io\.hpcml|org\.opencontainers)' | sort
    echo "# what $name holds (hpcml-versions, run inside)"
    "$ENGINE" run --rm --entrypoint hpcml-versions "$name"
}

# The horovod image keeps the Horovod wheel it compiled; `make venv-tf` installs that one on the host.
cmd_wheels() {
    (($# == 2)) || die "usage: containers/images.sh wheels IMAGE DIR"
    check_known "$1"
    local name container
    name=$(qualified "$(local_name "$1")")
    image_exists "$name" || die "$name is not built here: make build-$1 $(build_settings)"
    mkdir -p "$2"
    container=$("$ENGINE" create "$name")
    "$ENGINE" cp "$container:/opt/hpcml/wheels/." "$2" || { "$ENGINE" rm "$container" >/dev/null; die "$name has no /opt/hpcml/wheels"; }
    "$ENGINE" rm "$container" >/dev/null
    say "copied $(find "$2" -maxdepth 1 -name '*.whl' | wc -l) wheel(s) of $name into $2"
}

cmd_pin_cuda_bases() {
    command -v skopeo >/dev/null 2>&1 || die "skopeo is needed: apt-get install skopeo"
    local ref digest
    for ref in "$CUDA_TORCH_BASE" "$CUDA_TF_BASE"; do
        digest=$(skopeo inspect --format '{{ .Digest }}' "docker://${ref%@*}")
        echo "${ref%@*}@$digest"
    done
    say "put these into containers/versions.env (CUDA_TORCH_BASE, CUDA_TF_BASE)"
}

main() {
    local command=${1:-}
    shift || true
    case $command in
    build | push | versions | wheels | rootfs) ENGINE=$(choose_engine) ;;
    pull) [[ ${ENGINE:-} == shifter ]] || ENGINE=$(choose_engine) ;;
    esac
    [[ -z ${ENGINE:-} ]] || use_ci_podman_settings
    case $command in
    build) cmd_build "$@" ;;
    push) cmd_push "$@" ;;
    pull) cmd_pull "$@" ;;
    versions) cmd_versions "$@" ;;
    wheels) cmd_wheels "$@" ;;
    rootfs) FLAVOR=cpu && make_rootfs ;;
    pin-cuda-bases) cmd_pin_cuda_bases ;;
    *) sed -n '2,11s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2 && exit 2 ;;
    esac
}

main "$@"
