#pragma once
/// \file cuda_api.hpp
/// \brief The CUDA backend's entry points for code that is not compiled by nvcc: declarations
///        only, no CUDA header. The definitions are in the kvpack::cuda library (CMake builds it
///        when it finds nvcc), which precompiles them for the quantizers listed below; linking
///        it defines KVPACK_HAS_CUDA=1, and kvpack/dispatch.hpp then sends launches whose
///        buffers are in device memory here. Code compiled by nvcc may instead include
///        kvpack/kernels/cuda/*.cuh and instantiate the kernels for any codec.
///
/// Every function reports CUDA runtime failures, a missing device included, as kvpack::Error
/// (kUnsupported) naming the failed call.

#include <cstddef>
#include <memory>
#include <type_traits>

#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/kernels/cuda/element_encode.hpp"
#include "kvpack/kernels/paged_attention_args.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/kivi.hpp"
#include "kvpack/quant/kvquant.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace kvpack::inline v0::cuda_api {

/// The launch arguments with the parameter types the device kernels take for a codec pair.
template <class KeyCodec, class ValueCodec>
using DeviceAttentionArgs =
    kernels::PagedAttentionArgs<kernels::cuda::device_params_t<KeyCodec>, kernels::cuda::device_params_t<ValueCodec>>;

/// CUDA devices this process can use; 0 without a driver or a device (never throws).
[[nodiscard]] int device_count() noexcept;

/// Whether `address` is device memory (cudaMalloc, or managed memory) of some CUDA device. False
/// for host memory, for nullptr, and whenever no device is usable.
[[nodiscard]] bool is_device_pointer(const void* address) noexcept;

/// Device scratch for attend_paged's split partials: grows to the largest launch, freed with
/// the object. Creating one touches no device; the first launch allocates.
class AttentionWorkspace {
 public:
  AttentionWorkspace();
  ~AttentionWorkspace();
  AttentionWorkspace(AttentionWorkspace&&) noexcept;
  AttentionWorkspace& operator=(AttentionWorkspace&&) noexcept;

  struct Impl;  ///< kernels::cuda::AttentionWorkspace, defined where nvcc compiles
  [[nodiscard]] Impl& impl() noexcept { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

/// The quantizers kvpack::cuda precompiles, by aliases without commas (macro arguments).
namespace precompiled {
using F32 = quant::Float<float>;
using F16 = quant::Float<half>;
using BF16 = quant::Float<bfloat16>;
using E4M3 = quant::FP8<quant::E4M3FN>;
using E5M2 = quant::FP8<quant::E5M2>;
using Int8 = quant::Int8;
using Q8_0 = quant::Q8_0;
using Q4_0 = quant::Q4_0;
using Kivi2 = quant::KIVI<2, 32>;
using Kivi4 = quant::KIVI<4, 32>;
using KVQuant2 = quant::KVQuant<2>;
using KVQuant3 = quant::KVQuant<3>;
using KVQuant4 = quant::KVQuant<4>;
}  // namespace precompiled

}  // namespace kvpack::inline v0::cuda_api

/// Applies X(alias) to every quantizer of cuda_api::precompiled whose pages kvpack::cuda attends
/// to, and KVPACK_FOR_EACH_CUDA_ENCODED to those it also encodes (not KVQuant: its parameters
/// point into host tables, which these launches do not carry; a kernels::cuda::DeviceLayer
/// encodes it on the device).
#define KVPACK_FOR_EACH_CUDA_ENCODED(X) X(F32) X(F16) X(BF16) X(E4M3) X(E5M2) X(Int8) X(Q8_0) X(Q4_0) X(Kivi2) X(Kivi4)
#define KVPACK_FOR_EACH_CUDA_ATTENDED(X) KVPACK_FOR_EACH_CUDA_ENCODED(X) X(KVQuant2) X(KVQuant3) X(KVQuant4)

namespace kvpack::inline v0::cuda_api {

namespace detail {
#define KVPACK_CUDA_MATCHES(Q) \
  || (std::is_same_v<KeyCodec, precompiled::Q::key_codec> && std::is_same_v<ValueCodec, precompiled::Q::value_codec>)
template <class KeyCodec, class ValueCodec>
inline constexpr bool kAttended = false KVPACK_FOR_EACH_CUDA_ATTENDED(KVPACK_CUDA_MATCHES);
template <class KeyCodec, class ValueCodec>
inline constexpr bool kEncoded = false KVPACK_FOR_EACH_CUDA_ENCODED(KVPACK_CUDA_MATCHES);
#undef KVPACK_CUDA_MATCHES
}  // namespace detail

/// A codec pair whose attention kvpack::cuda precompiles: anything else would compile here and
/// fail to link, so the entry points below reject it at compile time.
template <class KeyCodec, class ValueCodec>
concept CudaAttended = detail::kAttended<KeyCodec, ValueCodec>;
template <class KeyCodec, class ValueCodec>
concept CudaEncoded = detail::kEncoded<KeyCodec, ValueCodec>;

/// kernels::cuda::attend_paged (paged_attention.cuh): out = softmax(q·Kᵀ) V for every stream and
/// query head of `args`, all of whose pointers are device memory; `max_pages` is the most pages
/// any stream holds. Asynchronous on `stream` (a cudaStream_t, nullptr for the default stream).
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires CudaAttended<KeyCodec, ValueCodec>
void attend_paged(const DeviceAttentionArgs<KeyCodec, ValueCodec>& args, index_t max_pages,
                  AttentionWorkspace& workspace, void* stream = nullptr);

/// kernels::cuda::encode_pages (encode_pages.cuh): `count` full pages encoded on the device from
/// fp32 rows there, byte for byte as the host codecs encode them. Asynchronous on `stream`.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires CudaEncoded<KeyCodec, ValueCodec>
void encode_pages(const float* keys, const float* values, std::ptrdiff_t row_stride, index_t count,
                  const typename KeyCodec::params_type& key_params,
                  const typename ValueCodec::params_type& value_params, std::byte* const* payloads,
                  quant::PageGeometry geometry, std::size_t value_offset, void* stream = nullptr);

}  // namespace kvpack::inline v0::cuda_api
