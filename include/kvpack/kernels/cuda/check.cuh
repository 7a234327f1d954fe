#pragma once
/// \file check.cuh
/// \brief CUDA runtime errors as kvpack::Error, and the question "is there a GPU at all".

#include <cuda_runtime.h>

#include "kvpack/error.hpp"

namespace kvpack::inline v0::kernels::cuda {

/// Throws kvpack::Error (kUnsupported) naming the failed call and CUDA's reason.
inline void check(cudaError_t status, const char* what) {
  KVPACK_CHECK(status == cudaSuccess, kUnsupported,
               ::kvpack::detail::message("CUDA: ", what, " failed: ", cudaGetErrorName(status), " (",
                                         cudaGetErrorString(status), ")"));
}

/// Number of CUDA devices this process can use, and why there is none (empty when there is one).
struct DeviceAvailability {
  int count = 0;
  std::string reason;
};

inline DeviceAvailability device_availability() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" state for later calls
    return {0, ::kvpack::detail::message("cudaGetDeviceCount: ", cudaGetErrorString(status))};
  }
  if (count == 0) return {0, "no CUDA device"};
  return {count, {}};
}

/// Whether `address` is device (or managed) memory: what a kernel may read. A pointer CUDA does
/// not know is host memory.
inline bool is_device_memory(const void* address) noexcept {
  if (address == nullptr || device_availability().count == 0) return false;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, address) != cudaSuccess) {
    cudaGetLastError();  // leave no error behind
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

}  // namespace kvpack::inline v0::kernels::cuda
