#pragma once
// The quantizers every bench runs, fp16 first: it is the baseline of speedup_vs_fp16.

#include <string>
#include <tuple>

#include "kvpack/kvpack.hpp"

namespace kvpack::bench {

using AllQuantizers = std::tuple<quant::Float<half>, quant::Float<bfloat16>, quant::Float<float>,
                                 quant::FP8<quant::E4M3FN>, quant::FP8<quant::E5M2>, quant::Int8,
                                 quant::Q8_0, quant::Q4_0, quant::Mixed<quant::Q8_0, quant::Q4_0>, quant::KIVI<4>,
                                 quant::KIVI<2>, quant::TurboQuant<8>, quant::TurboQuant<6>, quant::TurboQuant<5>,
                                 quant::TurboQuant<6, quant::TurboVariant::kProd>, quant::QJL<>>;

/// Calls f(Quantizer{}) for every quantizer of AllQuantizers, in order.
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
