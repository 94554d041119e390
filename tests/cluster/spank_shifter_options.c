/*
 * SPANK plugin for the local test cluster: registers Shifter's job options so that the project's
 * sbatch files, written for NERSC Perlmutter, run on plain Slurm unchanged.
 *
 *   #SBATCH --image=docker:REPO/NAME:TAG    -> SLURM_SPANK_SHIFTER_IMAGE / _IMAGETYPE in the job
 *   #SBATCH --module=gpu,nccl-plugin        -> SLURM_SPANK_SHIFTER_MODULE in the job
 *
 * Plain Slurm rejects unknown options ("sbatch: unrecognized option '--image'"), so without this the
 * files would need editing. The variables use the names real Shifter reads (SLURM_SPANK_SHIFTER_IMAGE
 * and SLURM_SPANK_SHIFTER_IMAGETYPE select the image of a bare `shifter` call), which lets the shared
 * launcher take its image from the same directive on both clusters. Nothing is containerised here.
 *
 * Built by tests/cluster/local_slurm.sh against Debian's libslurm-dev headers.
 */
#include <stdio.h>
#include <string.h>

#include <slurm/spank.h>

SPANK_PLUGIN(shifter, 1);

static char image[1024] = "";
static char modules[1024] = "";

static int take_image(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (optarg == NULL || optarg[0] == '\0') {
        slurm_error("shifter: --image needs a value, e.g. --image=docker:REPO/NAME:TAG");
        return -1;
    }
    /* "docker:name:tag" and a bare "name:tag" both name a docker image, as in Shifter. */
    if (strncmp(optarg, "docker:", 7) == 0)
        optarg += 7;
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

static struct spank_option options[] = {
    {"image", "IMAGE", "Shifter image (local test cluster: exported as SLURM_SPANK_SHIFTER_IMAGE)", 1, 0,
     take_image},
    {"module", "LIST", "Shifter modules (local test cluster: exported as SLURM_SPANK_SHIFTER_MODULE)", 1, 0,
     take_modules},
    SPANK_OPTIONS_TABLE_END};

/* Registered here rather than through a static spank_options table, which sbatch and salloc ignore. */
int slurm_spank_init(spank_t sp, int ac, char **av)
{
    struct spank_option *opt;
    (void)ac;
    (void)av;
    for (opt = options; opt->name != NULL; opt++)
        if (spank_option_register(sp, opt) != ESPANK_SUCCESS)
            return -1;
    return 0;
}

/* Runs in every task (the batch script included) after the options were parsed in slurmstepd. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    if (image[0] != '\0') {
        spank_setenv(sp, "SLURM_SPANK_SHIFTER_IMAGE", image, 1);
        spank_setenv(sp, "SLURM_SPANK_SHIFTER_IMAGETYPE", "docker", 1);
    }
    if (modules[0] != '\0')
        spank_setenv(sp, "SLURM_SPANK_SHIFTER_MODULE", modules, 1);
    return 0;
}
