#pragma once
/// \file encode_pages.cuh
/// \brief Encoding full pages on the GPU from fp32 K/V rows already there: the device's append
///        path. Each thread encodes independent units of a plane (ElementEncoder), so the bytes
///        are those the host codec would write.

#include <cuda_runtime.h>

#include <cstddef>

#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/element_encode.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace encode_detail {

inline constexpr int kEncodeThreads = 128;

/// Block (page, plane): plane 0 is the K plane at the payload's start, plane 1 the V plane.
template <class KeyCodec, class ValueCodec>
__global__ void __launch_bounds__(kEncodeThreads)
    encode_pages_kernel(const float* keys, const float* values, std::ptrdiff_t row_stride,
                        typename KeyCodec::params_type key_params, typename ValueCodec::params_type value_params,
                        std::byte* const* payloads, quant::PageGeometry geometry, std::size_t value_offset) {
  const std::size_t first_row = static_cast<std::size_t>(blockIdx.x) * geometry.page_size;
  std::byte* payload = payloads[blockIdx.x];
  if (blockIdx.y == 0) {
    const float* src = keys + first_row * row_stride;
    for (index_t u = threadIdx.x; u < ElementEncoder<KeyCodec>::units(geometry); u += kEncodeThreads) {
      ElementEncoder<KeyCodec>::encode_unit(src, row_stride, key_params, payload, geometry, u);
    }
  } else {
    const float* src = values + first_row * row_stride;
    for (index_t u = threadIdx.x; u < ElementEncoder<ValueCodec>::units(geometry); u += kEncodeThreads) {
      ElementEncoder<ValueCodec>::encode_unit(src, row_stride, value_params, payload + value_offset, geometry, u);
    }
  }
}

}  // namespace encode_detail

/// Encodes `count` pages: page i from rows [i·page_size, (i+1)·page_size) of `keys` and
/// `values` (device memory, rows `row_stride` floats apart) into `payloads[i]` (a device array of
/// device page addresses). Inputs must be finite and within the codecs' max_abs_input(), as the
/// host cache checks before encoding. Asynchronous on `stream`.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires DeviceEncodable<KeyCodec> && DeviceEncodable<ValueCodec>
void encode_pages(const float* keys, const float* values, std::ptrdiff_t row_stride, index_t count,
                  const typename KeyCodec::params_type& key_params, const typename ValueCodec::params_type& value_params,
                  std::byte* const* payloads, quant::PageGeometry geometry, std::size_t value_offset,
                  cudaStream_t stream = nullptr) {
  if (count <= 0) return;
  encode_detail::encode_pages_kernel<KeyCodec, ValueCodec><<<dim3(static_cast<unsigned>(count), 2),
                                                             encode_detail::kEncodeThreads, 0, stream>>>(
      keys, values, row_stride, key_params, value_params, payloads, geometry, value_offset);
  check(cudaGetLastError(), "encode kernel launch");
}

}  // namespace kvpack::inline v0::kernels::cuda
