// Float inputs drawn from the fuzzer's bytes, shared by the operation-sequence targets.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvpack::fuzz {

/// `n` finite values in [-8, 8) on a 1/16 grid, one byte each: every codec stores them and a
/// reference model compares them exactly (the bit-pattern fuzzing is fuzz_codec_spans' job).
inline std::vector<float> values_from(FuzzedDataProvider& in, std::size_t n) {
  std::vector<float> out(n);
  for (float& x : out) x = static_cast<float>(in.ConsumeIntegral<std::int8_t>()) / 16.0f;
  return out;
}

}  // namespace kvpack::fuzz
