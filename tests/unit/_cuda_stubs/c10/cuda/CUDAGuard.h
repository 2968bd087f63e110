// Stand-in for torch's CUDA device guard, for type-checking csrc/bindings.cpp on a CPU machine.
#pragma once
#include <c10/core/Device.h>

namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace c10::cuda
