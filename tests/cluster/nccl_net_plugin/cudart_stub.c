/*
 * A stub of the CUDA runtime (`libcudart.so.<major>`), for the local test cluster: what the stand-in network
 * plugin links against, and what an image of that CUDA major provides (build.sh; a CUDA image's own is
 * torch's nvidia-cuda-runtime wheel or NGC's toolkit). It answers one call and nothing else.
 */
int cudaRuntimeGetVersion(int *version)
{
    *version = CUDA_MAJOR * 1000;
    return 0;
}
