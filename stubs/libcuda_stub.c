/* A stand-in for the NVIDIA driver library on hosts without a GPU.
 *
 * sgl_kernel's common_ops links libcuda.so.1 for a handful of driver entry points, so
 * importing SGLang fails on a machine with no driver even when everything runs on the CPU.
 * Each entry point here answers CUDA_ERROR_NO_DEVICE, as NVIDIA's own stub libraries for
 * GPU-less build hosts do; torch.cuda stays unavailable. Built only when no driver exists.
 */
#define CUDA_ERROR_NO_DEVICE 100

#define NO_DEVICE(name) int name() { return CUDA_ERROR_NO_DEVICE; }

/* The driver symbols that sgl-kernel 0.3.21 and sglang-kernel 0.4.4 link (nm -D --undefined-only). */
NO_DEVICE(cuCtxFromGreenCtx)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuDevResourceGenerateDesc)
NO_DEVICE(cuDevSmResourceSplitByCount)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDeviceGetDevResource)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuGetErrorString)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuGreenCtxCreate)
NO_DEVICE(cuGreenCtxDestroy)
NO_DEVICE(cuGreenCtxGetDevResource)
NO_DEVICE(cuInit)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuStreamCreate)
