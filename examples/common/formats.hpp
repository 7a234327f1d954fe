#pragma once
/// \file formats.hpp
/// \brief The storage formats the examples accept as `--format`, each with the bits per element
/// and the head_dim rule of kvpack's own codecs, so an example reports what a kvpack cache would
/// store rather than an idealised format.

#include <array>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvpack/cache_config.hpp"
#include "kvpack/error.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace kvpack::inline v0::examples {

/// One storage format as kvpack's codecs describe it for one head_dim.
struct FormatRow {
  std::string kvpack_name;  ///< Quantizer::name(), e.g. "f16", "fp8_e4m3fn", "q4_0"
  double bits = 0.0;        ///< mean of the key and value rates, metadata included
  std::string unsupported;  ///< why this head_dim cannot use the format; empty when it can
};

/// A `--format` value and the quantizer it names.
struct FormatChoice {
  std::string_view flag;
  FormatRow (*describe)(index_t head_dim);
};

namespace detail {

/// Rates and applicability straight from the quantizer's codecs.
/// \tparam Quantizer  a kvpack quantizer (quant::Float<half>, quant::Q4_0, ...)
/// \param requirement the rule its codecs enforce, printed when they reject `head_dim`; empty to
///                    print the codec's own message
template <class Quantizer>
FormatRow describe(std::string_view requirement, index_t head_dim) {
  const Quantizer quantizer{};
  FormatRow row{Quantizer::name(),
                (quantizer.key.nominal_bits_per_element(head_dim) +
                 quantizer.value.nominal_bits_per_element(head_dim)) /
                    2.0,
                {}};
  // Ask the codecs rather than re-deriving their rules here, so an example refuses exactly the
  // shapes a cache would refuse. The page size is the cache's default.
  const quant::PageGeometry geometry{CacheConfig{}.page_size, head_dim};
  try {
    quantizer.key.validate(geometry);
    quantizer.value.validate(geometry);
  } catch (const Error& error) {
    row.unsupported = requirement.empty() ? std::string(error.what()) : std::string(requirement);
  }
  return row;
}

// In the order `kv_calculator --format all` prints them and the usage texts list them.
inline constexpr std::array<FormatChoice, 7> kFormats{{
    {"f16", [](index_t d) { return describe<quant::Float<half>>("", d); }},
    {"bf16", [](index_t d) { return describe<quant::Float<bfloat16>>("", d); }},
    {"f32", [](index_t d) { return describe<quant::Float<float>>("", d); }},
    // E4M3FN is the FP8 format vLLM and FlashInfer store KV in; E5M2 has the same 8-bit rate.
    {"fp8", [](index_t d) { return describe<quant::FP8<quant::E4M3FN>>("", d); }},
    {"int8", [](index_t d) { return describe<quant::Int8>("head_dim must be even", d); }},
    {"q8_0",
     [](index_t d) { return describe<quant::Q8_0>("head_dim must be a multiple of 32", d); }},
    {"q4_0",
     [](index_t d) { return describe<quant::Q4_0>("head_dim must be a multiple of 32", d); }},
}};

}  // namespace detail

/// Every format, in a fixed order.
[[nodiscard]] constexpr std::span<const FormatChoice> formats() noexcept {
  return detail::kFormats;
}

/// The format whose `--format` value is `flag` (exact match); std::nullopt when none is.
[[nodiscard]] constexpr std::optional<FormatChoice> find_format(std::string_view flag) noexcept {
  for (const FormatChoice& choice : detail::kFormats) {
    if (choice.flag == flag) return choice;
  }
  return std::nullopt;
}

/// "f16|bf16|...|q4_0", for usage texts and the unknown-format message.
[[nodiscard]] inline std::string format_names() {
  std::string out;
  for (const FormatChoice& choice : detail::kFormats) {
    if (!out.empty()) out += "|";
    out += choice.flag;
  }
  return out;
}

}  // namespace kvpack::inline v0::examples
