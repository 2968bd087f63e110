// Stand-in for torch's CUDA context header, for type-checking csrc/bindings.cpp against a CPU
// build of torch (which ships this header but not the cuBLAS/cuSPARSE headers it needs).
#pragma once
#include <cuda_runtime_api.h>

namespace at::cuda {
struct StubStream {
  cudaStream_t stream() const { return nullptr; }
};
inline StubStream getCurrentCUDAStream(int device = -1) { return {}; }
inline cudaDeviceProp* getDeviceProperties(int device) {
  static cudaDeviceProp prop{};
  return &prop;
}
}  // namespace at::cuda
