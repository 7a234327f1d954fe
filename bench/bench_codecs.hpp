#pragma once
// The quantizers every bench runs, fp16 first: it is the baseline of speedup_vs_fp16.

#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kvpack/kvpack.hpp"

namespace kvpack::bench {

using AllQuantizers = std::tuple<quant::Float<half>, quant::Float<bfloat16>, quant::Float<float>,
                                 quant::FP8<quant::E4M3FN>, quant::FP8<quant::E5M2>, quant::Int8,
                                 quant::Q8_0, quant::Q4_0, quant::Mixed<quant::Q8_0, quant::Q4_0>, quant::KIVI<4>,
                                 quant::KIVI<2>, quant::KVQuant<4>, quant::KVQuant<3>, quant::KVQuant<2>,
                                 quant::TurboQuant<8>, quant::TurboQuant<7>, quant::TurboQuant<6>, quant::TurboQuant<5>,
                                 quant::TurboQuant<6, quant::TurboVariant::kProd>, quant::QJL<>>;

template <class Q>
struct IsKVQuant : std::false_type {};
template <int Bits>
struct IsKVQuant<quant::KVQuant<Bits>> : std::true_type {};

/// The quantizer a bench cache of `shape` uses: KVQuant calibrated on 1024 tokens drawn like the
/// benches' own data (normal, 4 key channels x8) and its tables repeated for every layer; every
/// other quantizer as default-constructed.
template <class Q>
Q make_quantizer(const ModelShape& shape) {
  if constexpr (IsKVQuant<Q>::value) {
    const ModelShape one_layer{1, shape.q_heads, shape.kv_heads, shape.head_dim};
    quant::KVQuantCalibrator calibrator(one_layer, {Q::key_codec::kBits, 0.01, true, 50, 1});
    const std::size_t elements = std::size_t{1024} * shape.kv_heads * shape.head_dim;
    std::vector<float> keys(elements), values(elements);
    std::mt19937 rng(4242);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < elements; ++i) {
      keys[i] = normal(rng) * (i % static_cast<std::size_t>(shape.head_dim) < 4 ? 8.0f : 1.0f);
      values[i] = normal(rng);
    }
    calibrator.add(0, keys, values);
    auto tables = std::make_shared<quant::KVQuantTables>(*calibrator.finish());
    const quant::KVQuantTables layer = *tables;
    tables->layers = shape.layers;
    for (index_t l = 1; l < shape.layers; ++l) {
      tables->key_offset.insert(tables->key_offset.end(), layer.key_offset.begin(), layer.key_offset.end());
      tables->key_half_range.insert(tables->key_half_range.end(), layer.key_half_range.begin(), layer.key_half_range.end());
      tables->key_codebook.push_back(layer.key_codebook[0]);
      tables->value_codebook.push_back(layer.value_codebook[0]);
      if (!layer.key_encode_codebook.empty()) tables->key_encode_codebook.push_back(layer.key_encode_codebook[0]);
      if (!layer.value_encode_codebook.empty()) tables->value_encode_codebook.push_back(layer.value_encode_codebook[0]);
    }
    return Q(std::move(tables), 0.01);
  } else {
    return Q{};
  }
}

/// Calls f(Quantizer{}) for every quantizer of AllQuantizers, in order (the argument only carries
/// the type; build the real one with make_quantizer).
template <class F>
void for_each_quantizer(F&& f) {
  std::apply([&](auto... q) { (f(q), ...); }, AllQuantizers{});
}

/// The name rows carry, e.g. "Q4_0", "F16", "FP8_E4M3FN", "Q8_0/Q4_0".
template <class Q>
std::string row_name() {
  std::string name = Q::name();
  for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace kvpack::bench
