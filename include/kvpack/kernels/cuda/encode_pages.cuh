#pragma once
/// \file encode_pages.cuh
/// \brief Encoding full pages on the GPU from fp32 K/V rows already there: the device's append
///        path. Each thread encodes independent units of a plane (ElementEncoder; KVQuant's in
///        stages with barriers between), so the bytes are those the host codec would write.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/element_encode.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace encode_detail {

inline constexpr int kEncodeThreads = 128;

/// One plane of one page by the whole block: unit by unit, or stage by stage for a staged encoder.
template <class Codec>
__device__ void encode_plane(const float* src, std::ptrdiff_t row_stride, const device_params_t<Codec>& params,
                             std::byte* plane, quant::PageGeometry geometry, void* scratch) {
  using Encoder = ElementEncoder<Codec>;
  if constexpr (StagedEncoder<Encoder>) {
    for (int stage = 0; stage < Encoder::kStages; ++stage) {
      for (index_t u = threadIdx.x; u < Encoder::units(stage, geometry, params); u += kEncodeThreads) {
        Encoder::encode_unit(stage, src, row_stride, params, plane, geometry, u, scratch);
      }
      __syncthreads();
    }
  } else {
    for (index_t u = threadIdx.x; u < Encoder::units(geometry); u += kEncodeThreads) {
      Encoder::encode_unit(src, row_stride, params, plane, geometry, u);
    }
  }
}

/// Block memory a staged encoder shares between its stages (none for the others).
template <class Codec>
std::size_t scratch_bytes(quant::PageGeometry geometry) {
  if constexpr (StagedEncoder<ElementEncoder<Codec>>) {
    return ElementEncoder<Codec>::scratch_bytes(geometry);
  } else {
    return 0;
  }
}

/// Block (page, plane): plane 0 is the K plane at the payload's start, plane 1 the V plane.
template <class KeyCodec, class ValueCodec>
__global__ void __launch_bounds__(kEncodeThreads)
    encode_pages_kernel(const float* keys, const float* values, std::ptrdiff_t row_stride,
                        device_params_t<KeyCodec> key_params, device_params_t<ValueCodec> value_params,
                        std::byte* const* payloads, quant::PageGeometry geometry, std::size_t value_offset) {
  extern __shared__ __align__(16) unsigned char encode_scratch[];
  const std::size_t first_row = static_cast<std::size_t>(blockIdx.x) * geometry.page_size;
  std::byte* payload = payloads[blockIdx.x];
  if (blockIdx.y == 0) {
    encode_plane<KeyCodec>(keys + first_row * row_stride, row_stride, key_params, payload, geometry, encode_scratch);
  } else {
    encode_plane<ValueCodec>(values + first_row * row_stride, row_stride, value_params, payload + value_offset,
                             geometry, encode_scratch);
  }
}

}  // namespace encode_detail

/// Encodes `count` pages: page i from rows [i·page_size, (i+1)·page_size) of `keys` and
/// `values` (device memory, rows `row_stride` floats apart) into `payloads[i]` (a device array of
/// device page addresses), with the codecs' parameters in their device form (device_params_t:
/// the host's own, but for KVQuant's). Inputs must be finite and within the codecs'
/// max_abs_input(), as the host cache checks before encoding. Asynchronous on `stream`.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires DeviceEncodable<KeyCodec> && DeviceEncodable<ValueCodec>
void encode_pages(const float* keys, const float* values, std::ptrdiff_t row_stride, index_t count,
                  const device_params_t<KeyCodec>& key_params, const device_params_t<ValueCodec>& value_params,
                  std::byte* const* payloads, quant::PageGeometry geometry, std::size_t value_offset,
                  cudaStream_t stream = nullptr) {
  if (count <= 0) return;
  // KVQuant's: 22 KiB at most for a cache's pages (256 tokens, head_dim 256); a DeviceLayer built
  // by hand may ask for more than a block can have without opting in.
  const std::size_t scratch =
      std::max(encode_detail::scratch_bytes<KeyCodec>(geometry), encode_detail::scratch_bytes<ValueCodec>(geometry));
  KVPACK_CHECK(scratch <= 48 * 1024, kUnsupported,
               ::kvpack::detail::message("encode_pages: pages of ", geometry.page_size, " tokens at head_dim ",
                                         geometry.head_dim, " need ", scratch, " bytes of block memory to encode; "
                                         "the device encoder has 48 KiB"));
  encode_detail::encode_pages_kernel<KeyCodec, ValueCodec>
      <<<dim3(static_cast<unsigned>(count), 2), encode_detail::kEncodeThreads, scratch, stream>>>(
          keys, values, row_stride, key_params, value_params, payloads, geometry, value_offset);
  check(cudaGetLastError(), "encode kernel launch");
}

}  // namespace kvpack::inline v0::kernels::cuda
