#pragma once
/// \file mixed.hpp
/// \brief quant::Mixed<KeyQuantizer, ValueQuantizer>: keys from one quantizer, values from another;
///        quant::MLA<LatentQuantizer, RopeQuantizer>, its use for layout::MLA.

#include <string>

#include "kvpack/quant/float.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::quant {

/// Keys encoded as `KeyQuantizer` encodes keys, values as `ValueQuantizer` encodes values, e.g.
/// `Mixed<Q8_0, Q4_0>`: outlier-prone keys get more bits than flat values.
template <Quantizer KeyQuantizer, Quantizer ValueQuantizer>
struct Mixed {
  using key_codec = typename KeyQuantizer::key_codec;
  using value_codec = typename ValueQuantizer::value_codec;
  key_codec key{};
  value_codec value{};
  static std::string name() { return KeyQuantizer::name() + "/" + ValueQuantizer::name(); }
  friend bool operator==(const Mixed&, const Mixed&) = default;
};

/// For layout::MLA: the latent (the value plane) encoded as `LatentQuantizer` encodes values,
/// and the decoupled RoPE key (the key plane) as `RopeQuantizer` encodes keys — bf16 by default,
/// since 64 rotated channels are a small share of the bytes and carry position (ALGORITHMS.md
/// §11.3: the two parts have different statistics and are quantized separately).
template <Quantizer LatentQuantizer, Quantizer RopeQuantizer = Float<bfloat16>>
using MLA = Mixed<RopeQuantizer, LatentQuantizer>;

}  // namespace kvpack::inline v0::quant
