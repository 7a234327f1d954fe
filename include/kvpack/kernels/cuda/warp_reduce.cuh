#pragma once
/// \file warp_reduce.cuh
/// \brief The maximum and the sum of a value over the 32 lanes of a warp, every lane getting it.

namespace kvpack::inline v0::kernels::cuda {

__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace kvpack::inline v0::kernels::cuda
