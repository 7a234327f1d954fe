#pragma once
/// \file reference.hpp
/// \brief The scalar reference of decode attention: the oracle every SIMD and CUDA kernel is
///        tested against. Pages are decoded with the codec's own scalar decoder, one at a time,
///        and everything after that is computed in double. Not a fallback: it allocates.

#include <cmath>
#include <limits>
#include <vector>

#include "kvpack/kernels/attend_stream.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels::reference {

/// Keys stored before RoPE: the spec and every slot's position (see kernels::KeyRope).
struct ReferenceRope {
  RopeSpec spec;
  const std::int32_t* const* page_positions = nullptr;  ///< [pages.count][page_size]
  const std::int32_t* tail_positions = nullptr;         ///< [tail.count]
};

/// Same contract as kernels::attend_stream, computed exactly (up to the decoded values; pre-RoPE
/// keys are rotated in double precision).
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
void attend_stream(const KeyCodec& key_codec, const ValueCodec& value_codec, const PageRun& pages,
                   const typename KeyCodec::params_type& key_params,
                   const typename ValueCodec::params_type& value_params, const TailView& tail,
                   const float* queries, index_t group, float* out, const ReferenceRope* rope = nullptr) {
  const index_t d = pages.head_dim;
  const quant::PageGeometry geometry{pages.page_size, d};
  std::vector<float> keys(static_cast<std::size_t>(pages.page_size) * d);
  std::vector<float> values(keys.size());
  std::vector<std::vector<double>> scores(group);
  std::vector<const float*> rows;  // value rows of every live token, in order
  std::vector<std::vector<float>> decoded_values;
  decoded_values.reserve(pages.count);

  std::vector<float> rotated(static_cast<std::size_t>(d));
  auto add_token = [&](const float* k, const float* v, std::int32_t position) {
    if (rope != nullptr) {
      rotated.assign(k, k + d);
      apply_rope_reference(rope->spec, d, position, rotated.data());
      k = rotated.data();
    }
    for (index_t h = 0; h < group; ++h) {
      double s = 0.0;
      for (index_t c = 0; c < d; ++c) s += static_cast<double>(queries[h * d + c]) * k[c];
      scores[h].push_back(s);
    }
    rows.push_back(v);
  };
  for (index_t i = 0; i < pages.count; ++i) {
    key_codec.decode(geometry, pages.pages[i], key_params, keys.data());
    decoded_values.emplace_back(values.size());
    value_codec.decode(geometry, pages.pages[i] + pages.value_offset, value_params,
                       decoded_values.back().data());
    for (index_t t = 0; t < pages.page_size; ++t) {
      const std::uint64_t* live = pages.live != nullptr ? pages.live[i] : nullptr;
      if (live != nullptr && !((live[t / 64] >> (t % 64)) & 1u)) continue;
      add_token(keys.data() + static_cast<std::size_t>(t) * d,
                decoded_values.back().data() + static_cast<std::size_t>(t) * d,
                rope != nullptr ? rope->page_positions[i][t] : 0);
    }
  }
  for (index_t t = 0; t < tail.count; ++t) {
    add_token(tail.keys + static_cast<std::size_t>(t) * d, tail.values + static_cast<std::size_t>(t) * d,
              rope != nullptr ? rope->tail_positions[t] : 0);
  }

  for (index_t h = 0; h < group; ++h) {
    double top = -std::numeric_limits<double>::infinity();
    for (double s : scores[h]) top = std::max(top, s);
    double sum = 0.0;
    std::vector<double> acc(d, 0.0);
    for (std::size_t t = 0; t < rows.size(); ++t) {
      const double w = std::exp(scores[h][t] - top);
      sum += w;
      for (index_t c = 0; c < d; ++c) acc[c] += w * rows[t][c];
    }
    // No token (or none with weight): 0. A NaN sum (an infinite score: exp(inf − inf)) stays NaN.
    const bool weighted = sum > 0.0 || std::isnan(sum);
    for (index_t c = 0; c < d; ++c) out[h * d + c] = weighted ? static_cast<float>(acc[c] / sum) : 0.0f;
  }
}

}  // namespace kvpack::inline v0::kernels::reference
