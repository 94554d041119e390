# shellcheck shell=bash
# The image a job runs: the one named, Shifter's job image, or the one `make pull-IMAGE` recorded.
# Sourced by slurm/lib/launch.sh, with the others; nothing here runs on its own.
# shellcheck disable=SC2034 # IMAGE, IMAGE_NAME and IMAGE_SOURCE are choose_image's results, read by launch.sh

# The image family each entry point runs in (containers/<family>): what `make pull-<family>` records.
image_family() {
    case $1 in
    recipes/ddp/* | recipes/fsdp_tp_pp/* | bench/*) echo ddp ;;
    recipes/accelerate/*) echo accelerate ;;
    recipes/deepspeed/*) echo deepspeed ;;
    recipes/megatron_tp_pp/*) echo megatron ;;
    recipes/horovod/* | recipes/tf_mirrored/*) echo horovod ;;
    *) echo "" ;;
    esac
}

# Where `make pull-IMAGE` (containers/images.sh pull) records the image a user pulled, one FAMILY=REF a line.
images_file() {
    echo "${HPCML_IMAGES_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/hpcml/images}"
}

recorded_image() {
    local file
    file=$(images_file)
    [[ -n $1 && -f $file && -r $file ]] && sed -n "s/^$1=//p" "$file" | tail -n 1
    return 0
}

# Sets IMAGE to the image to run, "docker:NAME" or "id:ID" (under Shifter, once the gateway has resolved the
# name), IMAGE_NAME to the name it had, and IMAGE_SOURCE to where it came from.
# In this order: CONTAINER_IMAGE; under Shifter the job's own image (`sbatch --image=docker:NAME`, which
# Shifter resolves to an ID at submission); the image `make pull-IMAGE` recorded. The podman runtimes
# never take Shifter's job image: a Shifter ID means nothing to them.
choose_image() {
    local runtime=$1 recipe=$2 family image
    IMAGE="" IMAGE_SOURCE="" IMAGE_NAME=""
    [[ $runtime == none ]] && return 0
    family=$(image_family "$recipe")
    if [[ -e $(images_file) && ! -f $(images_file) ]]; then
        launch_error "HPCML_IMAGES_FILE=$(images_file) is not a file (it lists FAMILY=IMAGE lines, as make pull-IMAGE" \
            "writes): point it at a file, or unset it (default ~/.config/hpcml/images)"
    fi
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        image=docker:${CONTAINER_IMAGE#docker:} IMAGE_SOURCE=CONTAINER_IMAGE
    elif [[ $runtime == shifter && -n ${SLURM_SPANK_SHIFTER_IMAGE:-} ]]; then
        # Shifter's SPANK plugin hands the job the image's ID with type "id" (a name only if unresolved).
        if [[ ${SLURM_SPANK_SHIFTER_IMAGETYPE:-docker} == id ]]; then
            image=id:$SLURM_SPANK_SHIFTER_IMAGE
        else
            image=docker:${SLURM_SPANK_SHIFTER_IMAGE#docker:}
        fi
        IMAGE_SOURCE="the job's --image"
    elif image=$(recorded_image "$family") && [[ -n $image ]]; then
        image=docker:${image#docker:} IMAGE_SOURCE=$(images_file)
    else
        local per_job="set CONTAINER_IMAGE=REPO/NAME:TAG"
        [[ $runtime == shifter ]] && per_job="submit with --image=docker:REPO/NAME:TAG, or $per_job"
        launch_error "CONTAINER_RUNTIME=$runtime needs the ${family:-recipe} image: pull it once with" \
            "'make pull-${family:-IMAGE} REGISTRY=... ENGINE=$runtime' (it is recorded in $(images_file)), or $per_job"
    fi
    if [[ $runtime == podman && ${LAUNCH_DRY_RUN:-0} != 1 ]] && ! podman image exists "${image#docker:}"; then
        launch_error "image '${image#docker:}' is not in podman's local storage on $(hostname):" \
            "build it (make build-$family) or pull it (make pull-$family ENGINE=podman REGISTRY=...)"
    fi
    # podman-hpc: a compute node sees the squashed store ($SCRATCH/storage) only, never the login node's
    # local one; `make pull-IMAGE ENGINE=podman-hpc` and `podman-hpc migrate` put images there.
    if [[ $runtime == podman-hpc && ${LAUNCH_DRY_RUN:-0} != 1 ]]; then
        local found=0 failure
        failure=$(bash "$REPO_DIR/slurm/lib/squashed_image.sh" "$image" 2>&1) || found=$?
        if ((found == 1)); then
            launch_error "image '${image#docker:}' is not in podman-hpc's squashed store (${SQUASH_DIR:-${SCRATCH:-\$SCRATCH}/storage}), the" \
                "only one compute nodes see: make pull-$family ENGINE=podman-hpc REGISTRY=..., or podman-hpc migrate ${image#docker:}"
        elif ((found != 0)); then
            # Its state, not the image (seen after a killed shared-run left a container behind:
            # "invalid internal status, try resetting the pause process").
            launch_error "${failure//$'\n'/ }: podman-hpc itself fails on this node, and every rank would;" \
                "'podman-hpc ps -a' shows containers left behind, 'podman-hpc system migrate' resets its state"
        fi
    fi
    # Shifter starts only images its gateway has pulled (an ID was resolved at submission already). The
    # name is resolved once, here: every rank then starts the image by its ID (--image=id:...), instead of
    # each of 4 x N ranks asking the gateway for the tag at every start and requeue.
    if [[ $runtime == shifter && $image == docker:* && ${LAUNCH_DRY_RUN:-0} != 1 ]] && command -v shifterimg >/dev/null 2>&1; then
        local id=""
        id=$(shifterimg lookup "$image" 2>/dev/null) || id=""
        [[ -n $id ]] || launch_error "Shifter's image gateway has no image '${image#docker:}': shifterimg pull $image (then resubmit)"
        IMAGE_NAME=$image
        image=id:$id
    fi
    IMAGE=$image
}

# The image for the log: its name, also when Shifter handed the job an ID (`shifterimg images` knows the name).
describe_image() {
    local image=$1 name=""
    [[ -n $image ]] || { echo "(none)"; return; }
    if [[ -n ${IMAGE_NAME:-} ]]; then
        name=${IMAGE_NAME#docker:}
    elif [[ $image == id:* ]] && command -v shifterimg >/dev/null 2>&1; then
        name=$(shifterimg images 2>/dev/null | awk -v id="${image:3:10}" '$4 == id {print $NF; exit}') || true
    fi
    echo "${name:+docker:$name }$image (from $IMAGE_SOURCE)"
}
