/*
 * The site's NCCL network plugin (aws-ofi-nccl, `libnccl-net.so`), as the local test cluster's stand-in: a
 * library that, like the real one, links the CUDA runtime of the major it was built for, dynamically (the
 * plugin's configure looks for `cudart`). NERSC ships two builds, one per CUDA major (Shifter modules
 * nccl-plugin and nccl-cu13-plugin, podman-hpc --nccl and --nccl-cu13); a build opened in an image of the
 * other major fails in the dynamic loader ("libcudart.so.12: cannot open shared object file"), which is
 * what the launcher's preflight must catch before any rank starts.
 *
 * Built by build.sh with -DCUDA_MAJOR=12 or 13, against a stub CUDA runtime of that major (cudart_stub.c).
 * No collective ever runs through it (the local cluster trains with gloo); it only has to load, or not.
 */
extern int cudaRuntimeGetVersion(int *version);

#define STR_(x) #x
#define STR(x) STR_(x)

/* What a test reads back once the plugin has loaded (not part of NCCL's plugin interface). */
const char *hpcml_stand_in_plugin(void)
{
    int version = 0;
    cudaRuntimeGetVersion(&version);
    return version == CUDA_MAJOR * 1000 ? "stand-in aws-ofi-nccl, CUDA " STR(CUDA_MAJOR) " build" : "wrong CUDA runtime";
}
