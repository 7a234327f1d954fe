#pragma once
/// \file cuda_api_definitions.cuh
/// \brief The definitions of cuda_api.hpp's entry points, compiled by nvcc into the kvpack::cuda
///        library (cmake/kvpack_cuda_library.cu), its only includer: the functions that are
///        not templates are defined here once for the whole program.

#include <cuda_runtime.h>

#include "kvpack/backend/cuda_api.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/encode_pages.cuh"
#include "kvpack/kernels/cuda/paged_attention.cuh"

namespace kvpack::inline v0::cuda_api {

int device_count() noexcept { return kernels::cuda::device_availability().count; }

bool is_device_pointer(const void* address) noexcept { return kernels::cuda::is_device_memory(address); }

struct AttentionWorkspace::Impl {
  kernels::cuda::AttentionWorkspace workspace;
};
AttentionWorkspace::AttentionWorkspace() : impl_(std::make_unique<Impl>()) {}
AttentionWorkspace::~AttentionWorkspace() = default;
AttentionWorkspace::AttentionWorkspace(AttentionWorkspace&&) noexcept = default;
AttentionWorkspace& AttentionWorkspace::operator=(AttentionWorkspace&&) noexcept = default;

template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires CudaAttended<KeyCodec, ValueCodec>
void attend_paged(const DeviceAttentionArgs<KeyCodec, ValueCodec>& args, index_t max_pages,
                  AttentionWorkspace& workspace, void* stream) {
  kernels::cuda::attend_paged<KeyCodec, ValueCodec>(args, max_pages, workspace.impl().workspace,
                                                    static_cast<cudaStream_t>(stream));
}

template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires CudaEncoded<KeyCodec, ValueCodec>
void encode_pages(const float* keys, const float* values, std::ptrdiff_t row_stride, index_t count,
                  const typename KeyCodec::params_type& key_params,
                  const typename ValueCodec::params_type& value_params, std::byte* const* payloads,
                  quant::PageGeometry geometry, std::size_t value_offset, void* stream) {
  kernels::cuda::encode_pages<KeyCodec, ValueCodec>(keys, values, row_stride, count, key_params, value_params, payloads,
                                                    geometry, value_offset, static_cast<cudaStream_t>(stream));
}

}  // namespace kvpack::inline v0::cuda_api

// Explicit instantiation: only the preprocessor can stamp one out per listed quantizer.
#define KVPACK_CUDA_INSTANTIATE_ATTEND(Q)                                                          \
  template void kvpack::cuda_api::attend_paged<kvpack::cuda_api::precompiled::Q::key_codec,        \
                                               kvpack::cuda_api::precompiled::Q::value_codec>(     \
      const kvpack::cuda_api::DeviceAttentionArgs<kvpack::cuda_api::precompiled::Q::key_codec,     \
                                                  kvpack::cuda_api::precompiled::Q::value_codec>&, \
      kvpack::index_t, kvpack::cuda_api::AttentionWorkspace&, void*);
#define KVPACK_CUDA_INSTANTIATE_ENCODE(Q)                                                      \
  template void kvpack::cuda_api::encode_pages<kvpack::cuda_api::precompiled::Q::key_codec,    \
                                               kvpack::cuda_api::precompiled::Q::value_codec>( \
      const float*, const float*, std::ptrdiff_t, kvpack::index_t,                             \
      const kvpack::cuda_api::precompiled::Q::key_codec::params_type&,                         \
      const kvpack::cuda_api::precompiled::Q::value_codec::params_type&, std::byte* const*,    \
      kvpack::quant::PageGeometry, std::size_t, void*);
