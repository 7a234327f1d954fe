#pragma once
/// \file mixed.hpp
/// \brief quant::Mixed<KeyQuantizer, ValueQuantizer>: keys from one quantizer, values from another.

#include <string>

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

}  // namespace kvpack::inline v0::quant
