#pragma once
/// \file paged_attention_args.hpp
/// \brief One decode-attention launch over paged KV streams, described by raw pointers: what an
///        engine with its own block tables hands kvpack, on either backend. Every pointer lives in
///        the memory of the backend that runs the launch (host memory for the CPU kernels, device
///        memory for CUDA's); kernels/attend_paged.hpp picks the backend from where they are.

#include <cstddef>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::kernels {

/// Everything one launch reads. Streams are independent KV heads of any sequences and layers
/// that share one codec pair and shape; each serves `group` query heads (GQA).
template <class KeyParams, class ValueParams>
struct PagedAttentionArgs {
  const std::byte* const* pages = nullptr;    ///< [total pages] payload addresses, streams back to back
  const index_t* first_page = nullptr;        ///< [streams + 1] where each stream's pages start
  const KeyParams* key_params = nullptr;      ///< [streams]
  const ValueParams* value_params = nullptr;  ///< [streams]
  const float* tail_keys = nullptr;           ///< [streams][tail_stride][head_dim] full-precision rows
  const float* tail_values = nullptr;         ///< [streams][tail_stride][head_dim]
  const index_t* tail_count = nullptr;        ///< [streams] rows in use
  index_t tail_stride = 0;
  const float* queries = nullptr;  ///< [streams][group][head_dim], softmax scale applied
  float* out = nullptr;            ///< [streams][group][head_dim]
  index_t streams = 0;
  index_t group = 0;
  index_t page_size = 0;
  index_t head_dim = 0;
  std::size_t value_offset = 0;   ///< bytes from a payload's start to its V plane
  std::size_t payload_bytes = 0;  ///< bytes per payload, a multiple of 64
};

}  // namespace kvpack::inline v0::kernels
