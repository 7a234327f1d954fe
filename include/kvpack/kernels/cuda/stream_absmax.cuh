#pragma once
/// \file stream_absmax.cuh
/// \brief max |x| per KV stream over rows in device memory: what a codec that calibrates from the
///        data (FP8) takes its scales from, over the rows KVCache calibrates a layer's first page
///        from (its tail rows and the rows being appended, not the exact prefix).

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/device_memory.cuh"
#include "kvpack/kernels/cuda/warp_reduce.cuh"

namespace kvpack::inline v0::kernels::cuda {

/// Rows of one plane: stream s's row r at `data + s * stream_stride + r * row_stride` floats.
struct StridedRows {
  const float* data = nullptr;
  std::size_t stream_stride = 0;
  std::size_t row_stride = 0;
  index_t rows = 0;
};

namespace stream_absmax_detail {

/// This thread's share of max |x| over stream s's rows of `rows`, folded into `top`.
template <int kThreads>
__device__ float thread_absmax(const StridedRows& rows, std::size_t s, index_t d, float top) {
  const std::size_t n = static_cast<std::size_t>(rows.rows) * d;
  for (std::size_t i = threadIdx.x; i < n; i += kThreads) {
    top = fmaxf(top, fabsf(rows.data[s * rows.stream_stride + (i / d) * rows.row_stride + i % d]));
  }
  return top;
}

/// Block s: max |x| over stream s's rows of `a` and of `b`, into out[s].
template <int kThreads>
__global__ void __launch_bounds__(kThreads) absmax_kernel(StridedRows a, StridedRows b, index_t d, float* out) {
  const std::size_t s = blockIdx.x;
  float top = thread_absmax<kThreads>(b, s, d, thread_absmax<kThreads>(a, s, d, 0.0f));
  __shared__ float per_warp[kThreads / 32];
  top = warp_max(top);
  if (threadIdx.x % 32 == 0) per_warp[threadIdx.x / 32] = top;
  __syncthreads();
  if (threadIdx.x < 32) {
    top = warp_max(threadIdx.x < kThreads / 32 ? per_warp[threadIdx.x] : 0.0f);
    if (threadIdx.x == 0) out[s] = top;
  }
}

}  // namespace stream_absmax_detail

/// max |x| of each of `streams` streams over its rows in `a` and `b` (`d` floats each), on
/// `stream` after what is queued there. Synchronous: returns the maxima on the host. Like the
/// host's std::max chain it passes NaN over (rows must be finite in any case).
inline std::vector<float> stream_absmax(StridedRows a, StridedRows b, index_t streams, index_t d,
                                        cudaStream_t stream) {
  constexpr int kThreads = 256;
  DeviceBuffer<float> device(static_cast<std::size_t>(streams));
  stream_absmax_detail::absmax_kernel<kThreads>
      <<<static_cast<unsigned>(streams), kThreads, 0, stream>>>(a, b, d, device.data());
  check(cudaGetLastError(), "absmax kernel launch");
  std::vector<float> host(static_cast<std::size_t>(streams));
  check(cudaMemcpyAsync(host.data(), device.data(), host.size() * sizeof(float), cudaMemcpyDeviceToHost, stream),
        "absmax download");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return host;
}

}  // namespace kvpack::inline v0::kernels::cuda
