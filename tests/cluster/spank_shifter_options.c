/*
 * Shifter's SPANK plugin, as the local test cluster's stand-in: the job options and what they do at
 * submission, following NERSC's shifter (wlm_integration/slurm/shifterSpank.c,
 * shifterSpank_init_allocator_setup), so that the project's sbatch files meet what they meet on Perlmutter.
 *
 *   sbatch --image=docker:REPO/NAME:TAG   resolved at submission through the image gateway
 *                                         (`shifterimg lookup`); an image the gateway does not have
 *                                         aborts sbatch ("Failed to lookup image"), as on Perlmutter.
 *                                         The job gets the image's ID, not its name:
 *                                         SLURM_SPANK_SHIFTER_IMAGE=<id>, SLURM_SPANK_SHIFTER_IMAGETYPE=id
 *   sbatch --module=gpu,nccl-cu13-plugin  SLURM_SPANK_SHIFTER_MODULE in the job (the site modules: gpu, and the
 *                                         network plugin for CUDA 13 or 12, nccl-cu13-plugin or nccl-plugin)
 *   sbatch --volume=SRC:DST[;...]         SLURM_SPANK_SHIFTER_VOLUME in the job
 *
 * A bare `shifter` in the job takes the image from those variables (tests/cluster/shifter/shifter).
 * Plugin arguments (plugstack.conf): shifterimg=PATH gateway=DIR.
 * Built by tests/cluster/local_slurm.sh against Debian's libslurm-dev headers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/spank.h>

SPANK_PLUGIN(shifter, 1);

static char image[1024] = "";
static char modules[1024] = "";
static char volumes[2048] = "";
static char shifterimg[1024] = "shifterimg";
static char gateway[1024] = "";

static int take_image(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (optarg == NULL || optarg[0] == '\0') {
        slurm_error("shifter: --image needs a value, e.g. --image=docker:REPO/NAME:TAG");
        return -1;
    }
    snprintf(image, sizeof(image), "%s", optarg);
    return 0;
}

static int take_modules(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    snprintf(modules, sizeof(modules), "%s", optarg ? optarg : "");
    return 0;
}

static int take_volumes(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    snprintf(volumes, sizeof(volumes), "%s", optarg ? optarg : "");
    return 0;
}

static struct spank_option options[] = {
    {"image", "IMAGE", "Shifter image, docker:NAME:TAG or id:ID (resolved at submission)", 1, 0, take_image},
    {"module", "LIST", "Shifter modules, e.g. gpu,nccl-cu13-plugin", 1, 0, take_modules},
    {"volume", "SRC:DST", "Shifter volume mounts", 1, 0, take_volumes},
    SPANK_OPTIONS_TABLE_END};

static void read_arguments(int ac, char **av)
{
    int i;
    for (i = 0; i < ac; i++) {
        if (strncmp(av[i], "shifterimg=", 11) == 0)
            snprintf(shifterimg, sizeof(shifterimg), "%s", av[i] + 11);
        else if (strncmp(av[i], "gateway=", 8) == 0)
            snprintf(gateway, sizeof(gateway), "%s", av[i] + 8);
    }
}

/* Registered here rather than through a static spank_options table, which sbatch and salloc ignore. */
int slurm_spank_init(spank_t sp, int ac, char **av)
{
    struct spank_option *opt;
    read_arguments(ac, av);
    for (opt = options; opt->name != NULL; opt++)
        if (spank_option_register(sp, opt) != ESPANK_SUCCESS)
            return -1;
    return 0;
}

/* The image's ID from the gateway, or "" when it has no such image (shifterimg lookup exits non-zero). */
static void lookup_image(const char *name, char *id, size_t size)
{
    char command[4096];
    FILE *out;
    size_t length;
    id[0] = '\0';
    if (gateway[0] != '\0')
        setenv("SHIFTER_GATEWAY_DIR", gateway, 1);
    /* The name goes in single quotes; one with a quote in it is not an image name. */
    if (strchr(name, '\'') != NULL)
        return;
    snprintf(command, sizeof(command), "'%s' lookup 'docker:%s' 2>/dev/null", shifterimg, name);
    out = popen(command, "r");
    if (out == NULL)
        return;
    if (fgets(id, (int)size, out) == NULL)
        id[0] = '\0';
    if (pclose(out) != 0)
        id[0] = '\0';
    length = strlen(id);
    while (length > 0 && (id[length - 1] == '\n' || id[length - 1] == ' '))
        id[--length] = '\0';
}

/* At submission only (sbatch, salloc): resolve the image and hand the job its ID, as Shifter does. */
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    char id[256];
    const char *name = image;
    (void)ac;
    (void)av;
    if (spank_context() != S_CTX_ALLOCATOR)
        return 0;
    if (modules[0] != '\0')
        spank_job_control_setenv(sp, "SHIFTER_MODULE", modules, 1);
    if (volumes[0] != '\0')
        spank_job_control_setenv(sp, "SHIFTER_VOLUME", volumes, 1);
    if (image[0] == '\0')
        return 0;
    if (strncmp(image, "id:", 3) == 0) {
        snprintf(id, sizeof(id), "%s", image + 3);
    } else {
        if (strncmp(name, "docker:", 7) == 0)
            name += 7;
        lookup_image(name, id, sizeof(id));
        if (id[0] == '\0') {
            slurm_error("Failed to lookup image.  Aborting. (shifter: the image gateway has no docker:%s; "
                        "shifterimg pull docker:%s, then submit again)", name, name);
            return -1;
        }
    }
    spank_job_control_setenv(sp, "SHIFTER_IMAGE", id, 1);
    spank_job_control_setenv(sp, "SHIFTER_IMAGETYPE", "id", 1);
    return 0;
}
